"""``async def execute`` that sleeps IN milliseconds and answers with the most
executes it saw running at once in this instance."""

import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.running = 0
        self.peak = 0

    async def execute(self, requests):
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            delay = max(int(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()[0]) for r in requests)
            await asyncio.sleep(delay / 1000)
            peak = self.peak
        finally:
            self.running -= 1
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([peak], np.int32))])
            for _ in requests
        ]
