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
        for tensor in inputs:
            if tensor["name"] not in input_names:
                auto_complete_model_config.add_input(tensor)
        for tensor in outputs:
            if tensor["name"] not in output_names:
                auto_complete_model_config.add_output(tensor)
        auto_complete_model_config.set_max_batch_size(4)
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            out = a if b is None else a + b.as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", out)]))
        return responses
