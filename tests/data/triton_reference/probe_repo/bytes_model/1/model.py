import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            out = np.array([repr(v).encode() + b"|" + (v if isinstance(v, bytes) else str(v).encode()).upper() for v in x.reshape(-1)], dtype=np.object_).reshape(x.shape)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT0", out)]))
        return responses
