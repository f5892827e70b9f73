"""A decoupled iterative model that answers from a thread across a reschedule (Triton's
QA request_rescheduling case): the first execute hands the request's response sender
to a thread, which sends OUT=1, OUT=0 and the final flag after DELAY_MS, and
reschedules the request; the second execute returns without sending anything."""
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.executes = {}

    def execute(self, requests):
        for request in requests:
            key = request.correlation_id()
            self.executes[key] = self.executes.get(key, 0) + 1
            if self.executes[key] == 1:
                delay = int(pb_utils.get_input_tensor_by_name(request, "DELAY_MS").as_numpy()[0, 0]) / 1000
                sender = request.get_response_sender()
                threading.Thread(target=self._answer, args=(sender, delay), daemon=True).start()
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
            else:
                del self.executes[key]
        return None

    @staticmethod
    def _answer(sender, delay):
        time.sleep(delay)
        for value in (1, 0):
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([[value]], np.int32))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
