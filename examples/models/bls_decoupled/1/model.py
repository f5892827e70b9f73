"""BLS into a decoupled model: call "square" and add up everything it streams back.

``exec(decoupled=True)`` returns an iterator over square's responses as they
arrive; the last one is final (for IN = 0 it is empty: a flag-only final).
"""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            call = pb_utils.InferenceRequest(
                model_name="square",
                inputs=[pb_utils.get_input_tensor_by_name(request, "IN")],
                requested_output_names=["OUT"],
            )
            total = count = 0
            error = None
            for answer in call.exec(decoupled=True):
                if answer.has_error():
                    error = answer.error()
                    break
                out = pb_utils.get_output_tensor_by_name(answer, "OUT")
                if out is not None:  # the flag-only final has no outputs
                    total += int(out.as_numpy()[0])
                    count += 1
            if error is not None:
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("SUM", np.array([total], np.int32)),
                        pb_utils.Tensor("COUNT", np.array([count], np.int32)),
                    ]
                )
            )
        return responses
