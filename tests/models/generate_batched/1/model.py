"""Batched generate probe: text_output echoes each row's text, ``shape`` is the shape
the request's text_input arrived with (so [1, 1] for one generate request)."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            array = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
            rows = array.shape[0]
            texts = np.array([[b"echo:" + row[0]] for row in array], dtype=np.object_)
            outputs = [
                pb_utils.Tensor("text_output", texts),
                pb_utils.Tensor("shape", np.tile(np.array(array.shape, dtype=np.int64), (rows, 1))),
            ]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
