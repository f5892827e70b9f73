"""BLS, asynchronous: two add_sub calls per request run at once.

OUTPUT0 = INPUT0 + INPUT1 (from add_sub(INPUT0, INPUT1)) and OUTPUT1 = INPUT1 -
INPUT0 (from add_sub(INPUT1, INPUT0)). ``async def execute`` with ``await
async_exec()``: while the calls are out, this instance takes further requests
(up to the ASYNC_EXECUTE_CONCURRENCY config parameter, 16 by default).
"""

import asyncio

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        return list(await asyncio.gather(*(self.answer(request) for request in requests)))

    async def answer(self, request):
        a = pb_utils.get_input_tensor_by_name(request, "INPUT0")
        b = pb_utils.get_input_tensor_by_name(request, "INPUT1")

        def add_sub(x, y):
            return pb_utils.InferenceRequest(
                model_name="add_sub",
                inputs=[pb_utils.Tensor.from_dlpack("INPUT0", x), pb_utils.Tensor.from_dlpack("INPUT1", y)],
                requested_output_names=["OUTPUT0", "OUTPUT1"],
            ).async_exec()

        forward, backward = await asyncio.gather(add_sub(a, b), add_sub(b, a))
        for answer in (forward, backward):
            if answer.has_error():
                return pb_utils.InferenceResponse(error=answer.error())
        total = pb_utils.get_output_tensor_by_name(forward, "OUTPUT0")
        difference = pb_utils.get_output_tensor_by_name(backward, "OUTPUT1")
        return pb_utils.InferenceResponse(
            [
                pb_utils.Tensor.from_dlpack("OUTPUT0", total),
                pb_utils.Tensor.from_dlpack("OUTPUT1", difference),
            ]
        )
