"""Implicit state: the running sum lives in the server (INPUT_STATE / OUTPUT_STATE)."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            total = (
                pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
                + pb_utils.get_input_tensor_by_name(request, "INPUT_STATE").as_numpy()
            )
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT", total),
                pb_utils.Tensor("OUTPUT_STATE", total),
            ]))
        return responses
