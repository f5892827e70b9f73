"""Decoupled "repeat": one response per element of IN, then a flag-only final.

Each request is answered from its own thread, so ``execute`` returns at once and
the instance takes the next request while earlier ones are still streaming.
A request that is cancelled (its client went away) stops early.
"""

import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.threads = []

    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            delay = pb_utils.get_input_tensor_by_name(request, "DELAY")
            delays = delay.as_numpy() if delay is not None else np.zeros(len(values), np.uint32)
            if len(delays) != len(values):
                sender = request.get_response_sender()
                error = pb_utils.TritonError(
                    f"DELAY has {len(delays)} elements, IN has {len(values)}: they must match"
                )
                sender.send(
                    pb_utils.InferenceResponse(error=error),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
                continue
            thread = threading.Thread(target=self.respond, args=(request, values, delays))
            thread.start()
            # Keep the threads still answering (finalize waits for them), not every one ever
            # started: a long-lived instance would grow by each request it took.
            self.threads = [t for t in self.threads if t.is_alive()]
            self.threads.append(thread)
        return None  # decoupled: every answer goes through the response senders

    def respond(self, request, values, delays):
        sender = request.get_response_sender()
        for index, (value, delay) in enumerate(zip(values, delays)):
            time.sleep(delay / 1000)
            if request.is_cancelled():
                break
            sender.send(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("OUT", np.array([value], np.int32)),
                        pb_utils.Tensor("IDX", np.array([index], np.uint32)),
                    ]
                )
            )
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for thread in self.threads:
            thread.join()
