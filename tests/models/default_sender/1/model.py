"""A default-mode (not decoupled) model answering through its response sender,
as Triton allows since 24.06; "mode" picks how (see below)."""

import json
import sys
import threading
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
            elif mode == "racing_return":
                return [self.racing_return(sender, data)]
            elif mode == "send_then_raise":
                sender.send(response)  # not final: the server holds it for its final
                try:
                    sender.send(response)  # (Triton's QA response_sender model does this)
                except pb_utils.TritonModelException as exc:
                    raise RuntimeError(f"failed after sending a response: {exc}") from None
            # mode "silent": returns None without answering
        return None

    def racing_return(self, sender, data):
        """Answers through the sender on another thread, paused (a profile hook) at the
        first call inside its send, and in the list execute returns meanwhile: one answer
        goes, and the other must not be lost without a word."""
        paused = threading.Event()

        def pause_in_send(frame, event, arg):
            caller = frame.f_back
            if event == "call" and caller is not None and caller.f_code.co_name == "_send":
                sys.setprofile(None)
                paused.set()
                time.sleep(0.3)

        def send():
            response = pb_utils.InferenceResponse([pb_utils.Tensor("OUT", data * 2)])
            sys.setprofile(pause_in_send)
            try:
                sender.send(response, flags=FINAL)
            finally:
                sys.setprofile(None)

        threading.Thread(target=send).start()
        if not paused.wait(10):
            raise RuntimeError("the sender's send never paused")
        return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", data * 3)])
