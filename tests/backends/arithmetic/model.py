"""A Python-based backend: every model whose config says ``backend: "arithmetic"`` runs
this file, with its operation ("add" or "sub") read from ``<version>/model.json``."""

import json
import os

import numpy as np
import operations  # beside this file: the backend's folder is on sys.path
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        present = {tensor["name"] for tensor in config.as_dict()["input"]}
        for name in ("INPUT0", "INPUT1"):
            if name not in present:
                config.add_input({"name": name, "data_type": "TYPE_FP32", "dims": [-1]})
        if not config.as_dict()["output"]:
            config.add_output({"name": "OUTPUT", "data_type": "TYPE_FP32", "dims": [-1]})
            config.add_output({"name": "MODEL_DIR", "data_type": "TYPE_STRING", "dims": [1]})
        return config

    def initialize(self, args):
        self.model_dir = pb_utils.get_model_dir()
        with open(os.path.join(self.model_dir, "model.json")) as file:
            self.operation = operations.BY_NAME[json.load(file)["operation"]]

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            outputs = [
                pb_utils.Tensor("OUTPUT", self.operation(a, b)),
                pb_utils.Tensor("MODEL_DIR", np.array([self.model_dir.encode()], dtype=object)),
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses
