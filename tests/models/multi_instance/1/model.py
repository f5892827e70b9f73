import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_instance_name"]

    def execute(self, requests):
        time.sleep(0.05)  # long enough that concurrent requests need both instances
        return [
            pb_utils.InferenceResponse([
                pb_utils.Tensor("INSTANCE", np.array([self.name.encode()], dtype=np.object_)),
                pb_utils.Tensor("PID", np.array([os.getpid()], dtype=np.int64)),
            ])
            for _ in requests
        ]
