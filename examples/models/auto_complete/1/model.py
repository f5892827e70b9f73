"""AddSub whose configuration comes from the model itself (auto-complete).

config.pbtxt only names the backend. ``auto_complete_config`` adds the inputs and
outputs, sets max_batch_size 4 and turns on dynamic batching, following the
batching example of Triton's Python-backend documentation.
"""

import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        """Called once, before ``initialize``, unless the server runs with a strict
        model config (``--disable-auto-complete-config``; ``strict_model_config``
        in dlserve's Options).

        It may set ``max_batch_size``, dynamic batching, inputs and outputs (and the
        transaction policy) through ``set_max_batch_size``, ``set_dynamic_batching``,
        ``add_input`` and ``add_output``; ``as_dict`` gives read access to the
        configuration so far. The returned ``pb_utils.ModelConfig`` is the model's
        final configuration.

        It runs in a separate, throwaway Python interpreter: nothing created here is
        available to ``initialize``, ``execute`` or ``finalize``.
        """
        inputs = [
            {"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]},
            {"name": "INPUT1", "data_type": "TYPE_FP32", "dims": [4]},
        ]
        outputs = [
            {"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]},
            {"name": "OUTPUT1", "data_type": "TYPE_FP32", "dims": [4]},
        ]

        # Read what config.pbtxt already declares, to add only what is missing.
        # (add_input/add_output would also reject a tensor that config.pbtxt
        # declares with another data type or other dims.)
        config = auto_complete_model_config.as_dict()
        input_names = [tensor["name"] for tensor in config["input"]]
        output_names = [tensor["name"] for tensor in config["output"]]

        for tensor in inputs:
            if tensor["name"] not in input_names:
                auto_complete_model_config.add_input(tensor)
        for tensor in outputs:
            if tensor["name"] not in output_names:
                auto_complete_model_config.add_output(tensor)

        # Requests of up to 4 rows; the dynamic batcher may merge several requests
        # into one execute call.
        auto_complete_model_config.set_max_batch_size(4)
        auto_complete_model_config.set_dynamic_batching()

        return auto_complete_model_config

    def initialize(self, args):
        # args["model_config"] is the completed configuration.
        model_config = json.loads(args["model_config"])
        output0_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT0")
        output1_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT1")
        self.output0_dtype = pb_utils.triton_string_to_numpy(output0_config["data_type"])
        self.output1_dtype = pb_utils.triton_string_to_numpy(output1_config["data_type"])

    def execute(self, requests):
        responses = []
        for request in requests:
            # With max_batch_size > 0 every input has a leading batch dimension: [N, 4].
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            out_0 = pb_utils.Tensor("OUTPUT0", (a + b).astype(self.output0_dtype))
            out_1 = pb_utils.Tensor("OUTPUT1", (a - b).astype(self.output1_dtype))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out_0, out_1]))
        return responses
