"""A model written against Triton's C module as user models are: its classes in type
hints and in use, and the free bytes of the worker's shared memory."""
from typing import List

import c_python_backend_utils as c_utils
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests: List[c_utils.InferenceRequest]) -> List[c_utils.InferenceResponse]:
        free = np.array([c_utils.shared_memory.free_memory()], dtype=np.int64)
        return [
            c_utils.InferenceResponse(
                output_tensors=[
                    c_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() * 2),
                    c_utils.Tensor("FREE", free),
                ]
            )
            for r in requests
        ]
