import asyncio

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def initialize(self, args):
        await asyncio.sleep(0)

    async def execute(self, requests):
        await asyncio.sleep(0.001)
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() * 3)]
            )
            for r in requests
        ]
