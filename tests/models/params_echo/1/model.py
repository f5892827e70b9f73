import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Reports what it sees of each request in INFO (a JSON string)."""

    def initialize(self, args):
        self.args = args
        self.config = json.loads(args["model_config"])

    def execute(self, requests):
        responses = []
        for request in requests:
            info = {
                "request_id": request.request_id(),
                "correlation_id": request.correlation_id(),
                "flags": request.flags(),
                "timeout": request.timeout(),
                "parameters": json.loads(request.parameters()),
                "parameters_text": request.parameters(),
                "requested_output_names": sorted(request.requested_output_names()),
                "inputs": [t.name() for t in request.inputs()],
                "args": self.args,
                "model_dir": pb_utils.get_model_dir(),
                "greeting": self.config["parameters"]["greeting"]["string_value"],
            }
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor("INFO", np.array([json.dumps(info)], dtype=np.object_)),
                        pb_utils.Tensor("OUTPUT0", data * 2),
                    ],
                    parameters={"echoed": True, "count": len(requests), "model": "params_echo"},
                )
            )
        return responses
