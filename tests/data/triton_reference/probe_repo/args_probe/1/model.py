import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        with open("/tmp/triton_probe_args.json", "w") as f:
            f.write(json.dumps(args))
        with open("/tmp/triton_probe_args_%s.json" % args["model_instance_name"], "w") as f:
            f.write(json.dumps(args))
        with open("/tmp/triton_probe_args_repr.txt", "w") as f:
            f.write(repr(self.model_config) + "\n")
            f.write("types: " + repr({k: type(v).__name__ for k, v in args.items()}) + "\n")

    def execute(self, requests):
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            opt = pb_utils.get_input_tensor_by_name(request, "OPT_IN")
            n = in_0.shape[0]
            r = np.zeros((n, 4), dtype=np.float32) + (0 if opt is None else 1)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", in_0),
                pb_utils.Tensor("OUTPUT_R", r)]))
        return responses
