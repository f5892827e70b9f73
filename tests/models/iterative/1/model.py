"""Iterative sequence: a request asks for STEPS runs; the model reschedules it until
it has run that many times, then answers with the count (STEPS < 0: it reschedules the
request and answers it too, which Triton refuses)."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.runs = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            key = request.correlation_id()
            self.runs[key] = self.runs.get(key, 0) + 1
            steps = int(pb_utils.get_input_tensor_by_name(request, "STEPS").as_numpy()[0, 0])
            if steps < 0:  # wrong on purpose: rescheduled, and answered all the same
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                self.runs.pop(key)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("RUNS", np.array([[0]], np.int32))]))
            elif self.runs[key] < steps:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                responses.append(None)
            else:
                runs = self.runs.pop(key)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("RUNS", np.array([[runs]], np.int32))]))
        return responses
