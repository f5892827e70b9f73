import json

import numpy as np

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Answers INPUT0 as it sees it (under the config's reshape, two variable dimensions)
    and that shape; with the request parameter "flatten", OUTPUT0 as one row per batch
    entry, which its reshape cannot take."""

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            seen = np.tile(np.array(x.shape, dtype=np.int64), (x.shape[0], 1))
            if json.loads(request.parameters()).get("flatten"):
                x = x.reshape(x.shape[0], -1).copy()  # (its own memory, not the input's)
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", x), pb_utils.Tensor("SEEN_SHAPE", seen)]))
        return responses
