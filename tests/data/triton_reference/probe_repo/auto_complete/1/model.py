import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        inputs = [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]},
                  {"name": "INPUT1", "data_type": "TYPE_FP32", "dims": [4], "optional": True}]
        outputs = [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]}]
        config = auto_complete_model_config.as_dict()
        input_names = [i["name"] for i in config["input"]]
        output_names = [o["name"] for o in config["output"]]
        for input in inputs:
            if input["name"] not in input_names:
                auto_complete_model_config.add_input(input)
        for output in outputs:
            if output["name"] not in output_names:
                auto_complete_model_config.add_output(output)
        auto_complete_model_config.set_max_batch_size(4)
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def initialize(self, args):
        with open("/tmp/triton_probe_args_auto_complete.json", "w") as f:
            f.write(args["model_config"])

    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())]) for r in requests]
