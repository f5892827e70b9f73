"""Decoupled test model: one response per IN element, behaviour picked by the
request parameter "mode" (see the branches below); "delay_ms" spaces responses."""

import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def value(v):
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([v], np.int32))])


def info(text):
    return pb_utils.InferenceResponse([pb_utils.Tensor("INFO", np.array([text.encode()], np.object_))])


class TritonPythonModel:
    def initialize(self, args):
        self.kept = []  # senders kept forever ("never_final")
        self.notes = []  # what the model observed, read back with mode "notes"
        self.threads = []

    def execute(self, requests):
        for request in requests:
            params = json.loads(request.parameters())
            mode = params.get("mode", "stream")
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().tolist()
            delay = params.get("delay_ms", 0) / 1000
            sender = request.get_response_sender()
            if mode == "stream":
                for v in values:
                    sender.send(value(v))
                sender.send(flags=FINAL)
            elif mode == "final_with_last":
                for i, v in enumerate(values):
                    sender.send(value(v), flags=FINAL if i == len(values) - 1 else 0)
            elif mode == "thread":
                self.start_thread(self.stream, request, values, delay, params.get("ignore_cancel", False))
            elif mode == "error_mid":
                sender.send(value(values[0]))
                error = pb_utils.TritonError("failed halfway", pb_utils.TritonError.INVALID_ARG)
                sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
            elif mode == "error_first":  # an error response, then the values
                error = pb_utils.TritonError("failed first", pb_utils.TritonError.INVALID_ARG)
                sender.send(pb_utils.InferenceResponse(error=error))
                for v in values:
                    sender.send(value(v))
                sender.send(flags=FINAL)
            elif mode == "raise_after_one":
                sender.send(value(values[0]))
                raise pb_utils.TritonModelException("execute broke after one response")
            elif mode == "return_list":
                return [value(1) for _ in requests]
            elif mode == "never_final":
                sender.send(value(values[0]))
                self.kept.append(sender)
            elif mode == "drop_sender":
                sender.send(value(values[0]))
            elif mode == "send_after_final":
                sender.send(value(values[0]), flags=FINAL)
                try:
                    sender.send(value(values[0]))
                except pb_utils.TritonModelException as exc:
                    self.notes.append(str(exc))
            elif mode in ("wait_cancel", "wait_cancel_sender"):
                self.start_thread(self.wait_cancel, request, mode)
            elif mode == "big":
                # 8 KiB responses (they travel by reference), as many as fit before a cancel
                for v in values:
                    if request.is_cancelled():
                        break
                    big = pb_utils.Tensor("BIG", np.full(2048, v, np.float32))
                    sender.send(pb_utils.InferenceResponse([big]))
                sender.send(flags=FINAL)
            elif mode == "notes":
                sender.send(info(json.dumps(self.notes)), flags=FINAL)
            else:
                sender.send(info(f"unknown mode {mode}"), flags=FINAL)
        return None

    def stream(self, request, values, delay, ignore_cancel):
        sender = request.get_response_sender()
        for v in values:
            time.sleep(delay)
            if request.is_cancelled() and not ignore_cancel:
                self.notes.append("cancelled while streaming")
                break
            sender.send(value(v))
        sender.send(flags=FINAL)

    def wait_cancel(self, request, mode):
        sender = request.get_response_sender()
        check = sender.is_cancelled if mode == "wait_cancel_sender" else request.is_cancelled
        deadline = time.monotonic() + 10
        while not check() and time.monotonic() < deadline:
            time.sleep(0.005)
        self.notes.append(f"{mode}: cancelled={check()}")
        error = pb_utils.TritonError("stopped: cancelled", pb_utils.TritonError.CANCELLED)
        sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)

    def start_thread(self, target, *args):
        """Answer from a thread; the live ones are kept for finalize (not every one ever
        started, which would grow with each request)."""
        thread = threading.Thread(target=target, args=args)
        thread.start()
        self.threads = [t for t in self.threads if t.is_alive()]
        self.threads.append(thread)

    def finalize(self):
        for thread in self.threads:
            thread.join()
