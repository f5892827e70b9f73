import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            scores = pb_utils.get_input_tensor_by_name(request, "SCORES").as_numpy()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("PROBS", scores.astype(np.float32)),
                pb_utils.Tensor("LOGITS", (scores * 2).astype(np.float32)),
            ]))
        return responses
