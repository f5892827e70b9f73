import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Upper-cases every element of a BYTES tensor."""

    def execute(self, requests):
        responses = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            upper = np.array([v.upper() for v in values.ravel()], dtype=np.object_).reshape(values.shape)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", upper)]))
        return responses
