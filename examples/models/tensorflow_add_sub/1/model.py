"""AddSub in TensorFlow, with inputs and outputs handed over through DLPack (no copies).

OUTPUT0 = INPUT0 + INPUT1 and OUTPUT1 = INPUT0 - INPUT1 are computed by TensorFlow
on tensors that *are* the request's memory. ZERO_COPY reports whether that held: it
is True when each TensorFlow tensor's data pointer is the address of its pb_utils input.

TensorFlow's DLPack functions take and give raw capsules: ``pb_tensor.to_dlpack()``
in, ``tf.experimental.dlpack.to_dlpack(t)`` out.

TensorFlow's kernels abort the whole process (``Check failed: IsAligned()``) when
they meet data that is not 64-byte aligned, and DLPack import does not check. Inputs
in dlserve's shared memory are 64-byte aligned; inputs of at most 4 KiB travel inside
the control message and may not be, so this model copies an unaligned input into a
TensorFlow-owned tensor instead (ZERO_COPY is then False).
"""

import os

import numpy as np
import triton_python_backend_utils as pb_utils

TENSORFLOW_ALIGNMENT = 64  # bytes; TensorFlow's CPU kernels require it (EIGEN_MAX_ALIGN_BYTES)


class TritonPythonModel:
    def initialize(self, args):
        # Keep TensorFlow's start-up chatter out of the server's log.
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        # The framework is imported here rather than at the top of the file, so that
        # a server without it fails to load this model with a clear reason.
        try:
            import tensorflow as tf
        except ModuleNotFoundError:
            raise pb_utils.TritonModelException(
                "tensorflow is not installed; pip install 'dlserve[tensorflow]'"
            ) from None
        self.tf = tf

    def execute(self, requests):
        tf = self.tf
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            if in_0.shape() != in_1.shape():
                responses.append(shape_mismatch(in_0, in_1))
                continue

            x = self.to_tensorflow(in_0)
            y = self.to_tensorflow(in_1)
            zero_copy = (
                self.data_ptr(x) == in_0.as_numpy().ctypes.data
                and self.data_ptr(y) == in_1.as_numpy().ctypes.data
            )

            # And back: TensorFlow exports a capsule that pb_utils.Tensor wraps.
            out_0 = pb_utils.Tensor.from_dlpack("OUTPUT0", tf.experimental.dlpack.to_dlpack(x + y))
            out_1 = pb_utils.Tensor.from_dlpack("OUTPUT1", tf.experimental.dlpack.to_dlpack(x - y))
            flag = pb_utils.Tensor("ZERO_COPY", np.array([zero_copy], dtype=np.bool_))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out_0, out_1, flag]))
        return responses

    def to_tensorflow(self, pb_tensor):
        """A tf.Tensor over the input's memory: its DLPack capsule, imported without a copy."""
        if pb_tensor.as_numpy().ctypes.data % TENSORFLOW_ALIGNMENT:
            # See the module docstring: TensorFlow would abort on this buffer.
            return self.tf.constant(pb_tensor.as_numpy())
        return self.tf.experimental.dlpack.from_dlpack(pb_tensor.to_dlpack())

    def data_ptr(self, tensor):
        """Address of a tf.Tensor's data: TensorFlow has no accessor for it, so export
        the tensor through DLPack (no copy) and read the address of the result."""
        capsule = self.tf.experimental.dlpack.to_dlpack(tensor)
        return pb_utils.Tensor.from_dlpack("address", capsule).as_numpy().ctypes.data


def shape_mismatch(in_0, in_1):
    return pb_utils.InferenceResponse(
        error=pb_utils.TritonError(
            f"INPUT0 and INPUT1 must have the same shape, got {in_0.shape()} and {in_1.shape()}",
            pb_utils.TritonError.INVALID_ARG,
        )
    )
