"""Doubles INPUT0 and says how many requests it has executed (EXECUTED), so a test
can tell a response from the cache; a negative input gets an error response."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.executed = 0

    def execute(self, requests):
        responses = []
        for request in requests:
            self.executed += 1
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            if (x < 0).any():
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("negative input")))
                continue
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", x * 2),
                pb_utils.Tensor("EXECUTED", np.array([self.executed], dtype=np.int64)),
            ]))
        return responses
