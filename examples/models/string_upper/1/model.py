"""String upper-casing: a BYTES (TYPE_STRING) tensor in, the same strings upper-cased out.

Triton hands BYTES tensors to Python models as numpy object arrays of ``bytes``.
Elements are decoded as UTF-8, so non-ASCII letters are upper-cased too; a request
with an element that is not UTF-8 gets an INVALID_ARG error response.
"""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            try:
                upper = [self._upper(value) for value in values.ravel()]
            except UnicodeDecodeError as exc:
                error = pb_utils.TritonError(
                    f"INPUT0 must hold UTF-8 text: {exc}", pb_utils.TritonError.INVALID_ARG
                )
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            output = np.array(upper, dtype=np.object_).reshape(values.shape)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", output)]))
        return responses

    @staticmethod
    def _upper(value):
        text = value.decode("utf-8") if isinstance(value, bytes) else str(value)
        return text.upper().encode("utf-8")
