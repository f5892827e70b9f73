"""Identity: OUTPUT0 is INPUT0, returned without a copy.

``as_numpy()`` of an input is a view of the request's memory, and an output made
from such a view is sent back by reference. On dlserve the response's OUTPUT0
therefore has the very address of the caller's INPUT0 once the input is in shared
memory (bigger than 4 KiB, or allocated with ``server.allocate_tensor``).
"""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            input_tensor = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            output_tensor = pb_utils.Tensor("OUTPUT0", input_tensor.as_numpy())
            responses.append(pb_utils.InferenceResponse(output_tensors=[output_tensor]))
        return responses
