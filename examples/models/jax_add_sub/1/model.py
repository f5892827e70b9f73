"""AddSub in JAX, with inputs and outputs handed over through DLPack (no copies).

OUTPUT0 = INPUT0 + INPUT1 and OUTPUT1 = INPUT0 - INPUT1 are computed by jax on
arrays that *are* the request's memory. ZERO_COPY reports whether that held: it is
True when each jax array's buffer pointer is the address of its pb_utils input.

JAX copies a buffer that is not aligned enough for XLA instead of wrapping it. Inputs
in dlserve's shared memory are 64-byte aligned; inputs of at most 4 KiB travel inside
the control message and may be less aligned, so jax may copy those (ZERO_COPY is then
False).
"""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        # The framework is imported here rather than at the top of the file, so that
        # a server without it fails to load this model with a clear reason.
        try:
            import jax
            import jax.dlpack
        except ModuleNotFoundError:
            raise pb_utils.TritonModelException(
                "jax is not installed; pip install 'dlserve[jax]'"
            ) from None
        self.jax = jax

    def execute(self, requests):
        jax = self.jax
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            if in_0.shape() != in_1.shape():
                responses.append(shape_mismatch(in_0, in_1))
                continue

            # pb_utils.Tensor speaks DLPack: jax wraps its memory, copying nothing.
            # (jax.numpy.from_dlpack is the same function.)
            x = jax.dlpack.from_dlpack(in_0)
            y = jax.dlpack.from_dlpack(in_1)
            zero_copy = (
                x.unsafe_buffer_pointer() == in_0.as_numpy().ctypes.data
                and y.unsafe_buffer_pointer() == in_1.as_numpy().ctypes.data
            )

            # And back: pb_utils.Tensor.from_dlpack wraps the jax results as outputs.
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
