"""Decoupled: sends 8 responses from one buffer it refills before each send (response i
holds i everywhere). The buffer is a pb_utils.Tensor.empty of INPUT0's shape, or with
the request parameter "buffer": "input", INPUT0 itself."""

import json

import numpy as np

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            if json.loads(request.parameters()).get("buffer") == "input":
                out = pb_utils.Tensor("OUTPUT0", x.as_numpy())
            else:
                out = pb_utils.Tensor.empty("OUTPUT0", x.shape(), np.float32)
            sender = request.get_response_sender()
            for i in range(8):
                out.as_numpy()[:] = i
                sender.send(pb_utils.InferenceResponse([out]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
