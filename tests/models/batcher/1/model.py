"""Reports how it was batched: BATCH = [requests, rows] of its execute call, ORDER =
how many execute calls this instance ran before, ZERO_COPY = whether join_inputs
joined the batch without copying. OUTPUT0 = 2 * INPUT0. A request parameter
"sleep" (seconds) on the first request holds the instance busy."""
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.calls = 0

    def execute(self, requests):
        order = self.calls
        self.calls += 1
        time.sleep(float(json.loads(requests[0].parameters()).get("sleep", 0)))
        ragged = json.loads(requests[0].parameters()).get("ragged", "reject")
        joined = pb_utils.join_inputs(requests, "INPUT0", ragged=ragged)
        doubled = joined.array * 2
        responses = []
        for part, rows in zip(joined.split(doubled), joined.sizes):
            outputs = [
                pb_utils.Tensor("OUTPUT0", part),
                pb_utils.Tensor("BATCH", np.tile([len(requests), sum(joined.sizes)], (rows, 1)).astype(np.int64)),
                pb_utils.Tensor("ORDER", np.full((rows, 1), order, dtype=np.int64)),
                pb_utils.Tensor("ZERO_COPY", np.full((rows, 1), not joined.copied)),
            ]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
