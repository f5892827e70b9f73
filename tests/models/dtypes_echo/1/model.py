import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Echoes every input it gets as OUT_<type>; BF16 goes through DLPack (no numpy type)."""

    def execute(self, requests):
        responses = []
        for request in requests:
            outputs = []
            for tensor in request.inputs():
                name = "OUT_" + tensor.name()[len("IN_"):]
                if name == "OUT_BF16":
                    outputs.append(pb_utils.Tensor.from_dlpack(name, tensor.to_dlpack()))
                else:
                    outputs.append(pb_utils.Tensor(name, tensor.as_numpy()))
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
