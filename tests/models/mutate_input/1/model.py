"""Adds 1000 to INPUT0 in place (as ``x += 1``, ``np.clip(x, out=x)`` or torch's in-place
ops do) and answers that very array as OUTPUT0. INPUT1, optional, is not read: in an
ensemble it makes this step wait for the step that makes it."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            x += 1000.0
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
        return responses
