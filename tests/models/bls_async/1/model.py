"""Async BLS test model (``async def execute``). Request parameter "mode":

- "gather": "count" concurrent ``async_exec`` calls to async_overlap (each
  sleeping "sleep_ms"); INFO has the peak concurrency async_overlap saw.
- "stream": ``async for`` over ``async_exec(decoupled=True)`` of the decoupled
  test model, IN = INPUT0 as int32; INFO has the values and the final count.
- "cancel": the same, cancelling after the first response.
- "self": calls itself with "depth" - 1 (down to 0) through ``async_exec``.
"""

import asyncio
import json

import numpy as np
import triton_python_backend_utils as pb_utils


def reply(info, output=None):
    tensors = [pb_utils.Tensor("INFO", np.array([json.dumps(info).encode()], np.object_))]
    if output is not None:
        tensors.append(pb_utils.Tensor("OUTPUT0", output))
    return pb_utils.InferenceResponse(tensors)


class TritonPythonModel:
    async def execute(self, requests):
        return [await self.answer(request) for request in requests]

    async def answer(self, request):
        params = json.loads(request.parameters())
        mode = params.get("mode", "gather")
        x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
        if mode == "gather":
            sleep = np.array([params.get("sleep_ms", 50)], np.int32)
            calls = [
                pb_utils.InferenceRequest(
                    model_name="async_overlap",
                    inputs=[pb_utils.Tensor("IN", sleep)],
                    requested_output_names=["OUT"],
                ).async_exec()
                for _ in range(params.get("count", 4))
            ]
            answers = await asyncio.gather(*calls)
            errors = [a.error().message() for a in answers if a.has_error()]
            peaks = [int(pb_utils.get_output_tensor_by_name(a, "OUT").as_numpy()[0]) for a in answers if not a.has_error()]
            return reply({"errors": errors, "peak": max(peaks, default=0)})
        if mode == "self":
            # calls itself "depth" times over: one instance runs several async executes at once
            depth = params.get("depth", 1)
            if depth == 0:
                return reply({"bottom": True})
            answer = await pb_utils.InferenceRequest(
                model_name="bls_async",
                inputs=[pb_utils.Tensor("INPUT0", x)],
                requested_output_names=["INFO"],
                parameters={"mode": "self", "depth": depth - 1},
            ).async_exec()
            if answer.has_error():
                return reply({"error": answer.error().message()})
            inner = json.loads(pb_utils.get_output_tensor_by_name(answer, "INFO").as_numpy()[0])
            return reply({"depth": depth, "inner": inner})
        call = pb_utils.InferenceRequest(
            model_name="decoupled",
            inputs=[pb_utils.Tensor("IN", x.astype(np.int32))],
            requested_output_names=["OUT"],
            parameters={"mode": "thread", "delay_ms": params.get("delay_ms", 0)},
        )
        responses = await call.async_exec(decoupled=True)
        values, count, errors = [], 0, []
        async for response in responses:
            count += 1
            if response.has_error():
                errors.append([response.error().code(), response.error().message()])
            out = pb_utils.get_output_tensor_by_name(response, "OUT")
            if out is not None:
                values.append(int(out.as_numpy()[0]))
            if mode == "cancel" and count == 1:
                responses.cancel()
        return reply({"values": values, "count": count, "errors": errors}, x)
