"""A running sum per sequence, kept in the instance: OUTPUT = sum of the sequence's
INPUTs so far. Reports its instance, the batch it ran in and the control inputs
(START, END, READY, CORRID) the sequence batcher gave it."""
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.instance = args["model_instance_name"]
        self.sums = {}

    def execute(self, requests):
        time.sleep(float(json.loads(requests[0].parameters()).get("sleep", 0)))
        responses = []
        for request in requests:
            def value(name):
                return int(pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)[0])

            key = request.correlation_id()
            if value("START"):
                self.sums[key] = 0
            self.sums[key] = self.sums.get(key, 0) + value("INPUT")
            total = self.sums[key]
            if value("END"):
                del self.sums[key]
            controls = [value("START"), value("END"), value("READY"), value("CORRID")]
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("OUTPUT", np.array([[total]], dtype=np.int32)),
                        pb_utils.Tensor("INSTANCE", np.array([[self.instance.encode()]], dtype=np.object_)),
                        pb_utils.Tensor("BATCH", np.array([[len(requests)]], dtype=np.int32)),
                        # (as uint64, read back as INT64: a CORRID above 2**63 comes out negative)
                        pb_utils.Tensor("CONTROLS", np.array([controls], dtype=np.uint64).astype(np.int64)),
                    ]
                )
            )
        return responses
