"""AddSub in PyTorch, with inputs and outputs handed over through DLPack (no copies).

OUTPUT0 = INPUT0 + INPUT1 and OUTPUT1 = INPUT0 - INPUT1 are computed by torch on
tensors that *are* the request's memory. ZERO_COPY reports whether that held: it is
True when each torch tensor's data pointer is the address of its pb_utils input.
"""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        # The framework is imported here rather than at the top of the file, so that
        # a server without it fails to load this model with a clear reason.
        try:
            import torch
        except ModuleNotFoundError:
            raise pb_utils.TritonModelException(
                "torch is not installed; pip install 'dlserve[torch]'"
            ) from None
        self.torch = torch

    def execute(self, requests):
        torch = self.torch
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            if in_0.shape() != in_1.shape():
                responses.append(shape_mismatch(in_0, in_1))
                continue

            # pb_utils.Tensor speaks DLPack: torch wraps its memory, copying nothing.
            x = torch.from_dlpack(in_0)
            y = torch.from_dlpack(in_1)
            zero_copy = (
                x.data_ptr() == in_0.as_numpy().ctypes.data
                and y.data_ptr() == in_1.as_numpy().ctypes.data
            )

            # And back: pb_utils.Tensor.from_dlpack wraps the torch results as outputs.
            out_0 = pb_utils.Tensor.from_dlpack("OUTPUT0", x + y)
            out_1 = pb_utils.Tensor.from_dlpack("OUTPUT1", x - y)
            flag = pb_utils.Tensor("ZERO_COPY", np.array([zero_copy], dtype=np.bool_))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out_0, out_1, flag]))
        return responses


def shape_mismatch(in_0, in_1):
    return pb_utils.InferenceResponse(
        error=pb_utils.TritonError(
            f"INPUT0 and INPUT1 must have the same shape, got {in_0.shape()} and {in_1.shape()}",
            pb_utils.TritonError.INVALID_ARG,
        )
    )
