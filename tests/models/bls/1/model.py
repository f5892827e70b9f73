"""BLS test model. Request parameters:

- "route": comma-separated models to call in turn (each hop calls the next one
  with the rest of the route); empty: answer OUTPUT0 = INPUT0 here.
- "mode" (for this hop's call): "exec"; "decoupled" (call the decoupled test
  model with IN = INPUT0 as int32 and collect everything); "cancel" (the same,
  cancelling after the first response; "ignore_cancel": the callee goes on regardless); "first_only" (the same with 8 KiB responses,
  leaving the loop after the first); "missing_input"; "bytes_name" (the model
  name given as bytes, as a model reading it from a BYTES input passes it);
  "empty_name" (no model name at all); "check_input" ("exec", and INFO says whether
  INPUT0 is as it was before the call: "input_kept").

INFO is a JSON object saying what happened (e.g. whether the output came back
in the very memory of the input, i.e. without a copy).
"""

import json

import numpy as np

import triton_python_backend_utils as pb_utils
from dlserve.pb_utils import _runtime


def shared_place(array):
    """Which shared memory an array is a view of: (segment, offset), or None. (The worker
    sees each tensor it receives through a copy-on-write mapping of its own: two tensors
    in the same memory have different addresses here.)"""
    found = _runtime.current().arena.space.locate(array)
    return None if found is None else (found[0].segment.name, found[1])


def reply(output, info):
    tensors = [pb_utils.Tensor("INFO", np.array([json.dumps(info).encode()], np.object_))]
    if output is not None:
        tensors.append(pb_utils.Tensor("OUTPUT0", output))
    return pb_utils.InferenceResponse(tensors)


def describe(response):
    error = response.error()
    return {
        "outputs": [t.name() for t in response.output_tensors()],
        "error": None if error is None else [error.code(), error.message()],
    }


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_name"]

    def execute(self, requests):
        return [self.answer(request) for request in requests]

    def answer(self, request):
        params = json.loads(request.parameters())
        route = [m for m in params.get("route", "").split(",") if m]
        mode = params.get("mode", "exec")
        x = pb_utils.get_input_tensor_by_name(request, "INPUT0")
        if not route:
            return reply(x.as_numpy(), {"model": self.name})
        target, rest = route[0], ",".join(route[1:])
        if mode in ("decoupled", "cancel"):
            call = pb_utils.InferenceRequest(
                model_name=target,
                inputs=[pb_utils.Tensor("IN", x.as_numpy().astype(np.int32))],
                requested_output_names=["OUT"],
                parameters={
                    "mode": params.get("inner_mode", "stream"),
                    "delay_ms": params.get("delay_ms", 0),
                    "ignore_cancel": params.get("ignore_cancel", False),
                },
            )
            responses = call.exec(decoupled=True)
            seen, values = [], []
            for response in responses:
                seen.append(describe(response))
                out = pb_utils.get_output_tensor_by_name(response, "OUT")
                if out is not None:
                    values.append(int(out.as_numpy()[0]))
                if mode == "cancel" and len(seen) == 1:
                    responses.cancel()
            again = [describe(response) for response in responses]  # (Triton's iterator replays)
            return reply(None, {"responses": seen, "values": values, "again": again})
        if mode == "first_only":
            # reads the first of a stream of 8 KiB responses and lets the call go
            call = pb_utils.InferenceRequest(
                model_name=target,
                inputs=[pb_utils.Tensor("IN", x.as_numpy().astype(np.int32))],
                requested_output_names=["BIG"],
                parameters={"mode": "big"},
            )
            for response in call.exec(decoupled=True):
                first = float(pb_utils.get_output_tensor_by_name(response, "BIG").as_numpy()[0])
                break
            return reply(None, {"first": first})
        before = x.as_numpy().copy() if mode == "check_input" else None
        inputs = [] if mode == "missing_input" else [x]
        call = pb_utils.InferenceRequest(
            model_name={"bytes_name": target.encode(), "empty_name": ""}.get(mode, target),
            inputs=inputs,
            requested_output_names=["OUTPUT0"],
            parameters={"route": rest, "mode": params.get("inner_mode", "exec")},
        )
        answer = call.exec()
        if answer.has_error():
            return pb_utils.InferenceResponse(error=answer.error())
        out = pb_utils.get_output_tensor_by_name(answer, "OUTPUT0").as_numpy()
        same = shared_place(out) is not None and shared_place(out) == shared_place(x.as_numpy())
        info = {"same_memory": bool(same), "via": target}
        if mode == "check_input":
            info["input_kept"] = bool(np.array_equal(x.as_numpy(), before))
        return reply(out, info)
