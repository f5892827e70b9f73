"""A decoupled ``async def execute`` model making async BLS calls (Triton cannot):
for each request, "count" concurrent calls to identity, each answer streamed back
as its own response as soon as it arrives, then a flag-only final."""

import asyncio
import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        await asyncio.gather(*(self.answer(request) for request in requests))

    async def answer(self, request):
        sender = request.get_response_sender()
        count = json.loads(request.parameters()).get("count", 3)
        x = pb_utils.get_input_tensor_by_name(request, "INPUT0")

        async def one(i):
            call = pb_utils.InferenceRequest(
                model_name="identity",
                inputs=[pb_utils.Tensor("INPUT0", x.as_numpy() + i)],
                requested_output_names=["OUTPUT0"],
            )
            answer = await call.async_exec()
            if answer.has_error():
                sender.send(pb_utils.InferenceResponse(error=answer.error()))
            else:
                out = pb_utils.get_output_tensor_by_name(answer, "OUTPUT0")
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor.from_dlpack("OUTPUT0", out)]))

        await asyncio.gather(*(one(i) for i in range(count)))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
