"""A default-mode (not decoupled) model answering through its response sender,
as Triton allows since 24.06; "mode" picks how (see below)."""

import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            mode = json.loads(request.parameters()).get("mode", "send_final")
            data = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            response = pb_utils.InferenceResponse([pb_utils.Tensor("OUT", data * 2)])
            sender = request.get_response_sender()
            if mode == "send_final":
                sender.send(response, flags=FINAL)
            elif mode == "send_then_flag":
                sender.send(response)
                sender.send(flags=FINAL)
            elif mode in ("twice", "final_first"):
                errors = []
                if mode == "final_first":
                    try:
                        sender.send(flags=FINAL)
                    except pb_utils.TritonModelException as exc:
                        errors.append(str(exc))
                sender.send(response)
                if mode == "twice":
                    try:
                        sender.send(response)
                    except pb_utils.TritonModelException as exc:
                        errors.append(str(exc))
                # The one response is out; close it. (The errors go back in a new request.)
                sender.send(flags=FINAL)
                self.last = errors
            elif mode == "wait_cancel":
                # Polls from the main thread, busy in execute: nobody else reads the
                # channel, so is_cancelled() itself must notice the cancellation.
                deadline = time.monotonic() + 10
                while not request.is_cancelled() and time.monotonic() < deadline:
                    time.sleep(0.002)
                self.last = [f"wait_cancel: cancelled={request.is_cancelled()}"]
                error = pb_utils.TritonError("stopped: cancelled", pb_utils.TritonError.CANCELLED)
                sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
            elif mode == "last_errors":
                note = pb_utils.Tensor("INFO", np.array([json.dumps(self.last).encode()], np.object_))
                sender.send(pb_utils.InferenceResponse([note]), flags=FINAL)
            elif mode == "send_then_raise":
                sender.send(response)  # not final: the server holds it for its final
                try:
                    sender.send(response)  # (Triton's QA response_sender model does this)
                except pb_utils.TritonModelException as exc:
                    raise RuntimeError(f"failed after sending a response: {exc}") from None
            # mode "silent": returns None without answering
        return None
