"""add_sub_batched: add_sub over a dynamically batched [-1, 16] FP32 pair, for the benchmarks.

execute() gets every request the dynamic batcher gathered, joins their inputs into one array,
waits EXECUTE_DELAY_MS (config parameter: a fixed cost per call, as a GPU kernel launch or a
framework call would have, so that batching pays), computes a + b and a - b once and splits
the answer back per request. Plain Triton Python-backend API only.
"""

import json
import time

import numpy as np

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {})
        delay = parameters.get("EXECUTE_DELAY_MS", {}).get("string_value", "0")
        self.delay = float(delay) / 1000

    def execute(self, requests):
        first = [pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() for r in requests]
        second = [pb_utils.get_input_tensor_by_name(r, "INPUT1").as_numpy() for r in requests]
        rows = [len(x) for x in first]
        a, b = np.concatenate(first), np.concatenate(second)
        time.sleep(self.delay)
        added, subtracted = a + b, a - b
        responses, start = [], 0
        for n in rows:
            outputs = [
                pb_utils.Tensor("OUTPUT0", added[start : start + n]),
                pb_utils.Tensor("OUTPUT1", subtracted[start : start + n]),
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
            start += n
        return responses
