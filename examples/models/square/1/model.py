"""Decoupled "square": for IN = n, n responses each holding n (so n * n in all).

The last response carries the final flag itself; IN = 0 gets no response at all,
only a flag-only final. Written as ``async def execute``: several requests of
one instance stream at once.
"""

import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        await asyncio.gather(*(self.answer(request) for request in requests))
        return None

    async def answer(self, request):
        n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
        sender = request.get_response_sender()
        if n < 0:
            error = pb_utils.TritonError(f"IN must be >= 0, got {n}", pb_utils.TritonError.INVALID_ARG)
            sender.send(pb_utils.InferenceResponse(error=error), pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        if n == 0:
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        for index in range(n):
            response = pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([n], np.int32))])
            final = index == n - 1
            sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
            await asyncio.sleep(0)  # let the instance's other requests stream too
