"""``pb_utils.Tensor``: Triton's model-side tensor, over a :class:`dlserve.memory.Tensor`.

Request inputs are views of shared memory; ``as_numpy()`` and DLPack exports
alias them. A tensor made from a CUDA DLPack object (torch, cupy, jax on a GPU) stays
on its GPU until its response leaves, when its bytes are copied once into host memory. Outputs made from an array that already lives in shared memory (an
input, or a block from :meth:`Tensor.empty`) are sent back by reference; anything
else is copied once into the worker's arena when the response leaves.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from dlserve.errors import InvalidArgumentError
from dlserve.ipc.tensors import INLINE_MAX
from dlserve.memory.dlpack import is_capsule
from dlserve.memory.dtypes import DataType, numpy_dtype
from dlserve.memory.tensor import Tensor as _CoreTensor
from dlserve.memory.tensor import allocation_size
from dlserve.pb_utils import _runtime
from dlserve.pb_utils.errors import TritonModelException


class Tensor:
    """``pb_utils.Tensor(name, numpy_array)``."""

    __slots__ = ("_name", "_tensor")

    def __init__(self, name: str, tensor: Any) -> None:
        # Wrong argument types are TypeErrors, as Triton's constructor raises them: a list
        # accepted here would also pick its own dtype (int64 for an INT32 output).
        # (the arguments' types first, then the name's value, as Triton checks them)
        if not isinstance(name, str):
            raise TypeError(f"pb_utils.Tensor name must be a str, got {type(name).__name__}")
        if not isinstance(tensor, (np.ndarray, _CoreTensor)):
            raise TypeError(
                f"pb_utils.Tensor('{name}', ...) takes a numpy.ndarray, got {type(tensor).__name__} "
                "(framework tensors: pb_utils.Tensor.from_dlpack)"
            )
        if not name:
            raise TritonModelException("Tensor name cannot be an empty string.")
        self._name = name
        if isinstance(tensor, _CoreTensor):
            self._tensor = tensor
            return
        try:
            self._tensor = _CoreTensor.from_numpy(tensor)
        except TypeError as exc:
            raise TritonModelException(f"Tensor '{name}': {exc}") from None

    @classmethod
    def _received(cls, name: str, tensor: _CoreTensor) -> Tensor:
        """A tensor the worker received (an input, a BLS response's output): trusted
        values, no re-validation."""
        received = cls.__new__(cls)
        received._name = name
        received._tensor = tensor
        return received

    @classmethod
    def empty(cls, name: str, shape: Sequence[int], dtype: Any) -> Tensor:
        """A new output tensor allocated in shared memory; fill ``as_numpy()`` in place.

        Returning it sends it by reference: the server never copies its bytes. What the
        model writes into it after sending it (refilling it for the next response) is the
        model's own: the response keeps what was sent.
        Outside a worker process (e.g. unit tests) it is an ordinary numpy array.
        """
        data_type = _empty_data_type(name, dtype)
        if data_type is DataType.BYTES:
            raise TritonModelException("Tensor.empty cannot allocate BYTES tensors")
        try:
            shape = tuple(_dimension(d) for d in shape)
        except TypeError:
            raise TritonModelException(
                f"Tensor.empty('{name}'): shape must be a sequence of ints, got {shape!r}"
            ) from None
        try:
            nbytes = allocation_size(data_type, shape)
        except InvalidArgumentError as exc:
            raise TritonModelException(f"Tensor.empty('{name}'): {exc}") from None
        storage_type = data_type.storage_dtype
        runtime = _runtime.current()
        if runtime is None:
            data = np.empty(shape, dtype=storage_type)
        else:
            arena = runtime.arena
            small = nbytes <= INLINE_MAX  # (copied when it is sent anyway)
            anchor = arena.allocate(nbytes) if small else arena.allocate_apart(nbytes)
            data = np.frombuffer(anchor, dtype=storage_type).reshape(shape)
        return cls(name, _CoreTensor(data_type, shape, data=data))

    @staticmethod
    def from_dlpack(name: str, capsule: Any) -> Tensor:
        """Wrap a DLPack capsule or any ``__dlpack__`` object without copying."""
        if not (is_capsule(capsule) or hasattr(capsule, "__dlpack__")):
            raise TritonModelException(
                "from_dlpack expects a DLPack capsule or an object with __dlpack__"
            )
        try:
            return Tensor(name, _CoreTensor.from_dlpack(capsule))
        except Exception as exc:  # noqa: BLE001 - surfaced to the model as Triton does
            raise TritonModelException(str(exc)) from None

    def name(self) -> str:
        return self._name

    def shape(self) -> list[int]:
        return list(self._tensor.shape)

    def triton_dtype(self) -> int:
        return int(self._tensor.data_type)

    def is_cpu(self) -> bool:
        return self._tensor.device_array is None

    def as_numpy(self) -> np.ndarray:
        if self._tensor.device_array is not None:  # (Triton's words)
            raise TritonModelException("Tensor is stored in GPU and cannot be converted to NumPy.")
        if self._tensor.data_type is DataType.BF16:  # (Triton's words: its QA's identity_bf16 expects it)
            raise TritonModelException(
                "Tensor dtype is BF16 and cannot be converted to NumPy. Use to_dlpack() and from_dlpack() instead."
            )
        try:
            return self._tensor.as_numpy()
        except TypeError as exc:
            raise TritonModelException(str(exc)) from None

    def to_dlpack(self) -> Any:
        """A legacy ``"dltensor"`` capsule (what TensorFlow's importer expects). Raises
        TritonModelException where DLPack cannot carry the tensor (BYTES), as Triton's
        does; ``__dlpack__`` raises the protocol's BufferError."""
        try:
            return self.__dlpack__()
        except BufferError as exc:
            raise TritonModelException(str(exc)) from None

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        # As Triton's, the capsule holds this Tensor, not only its memory: a model's
        # refcount of it counts the capsule (upstream's BLS QA checks exactly that).
        return self._tensor.export_dlpack(keep_alive=self, stream=stream, **kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._tensor.__dlpack_device__()

    def __repr__(self) -> str:
        return (
            f"pb_utils.Tensor(name={self._name!r}, dtype={self._tensor.data_type.wire_name}, "
            f"shape={list(self._tensor.shape)})"
        )


def _dimension(value: Any) -> int:
    """An int, or a float that is one (``np.ceil``'s, ``/``'s), as ``int()`` took them."""
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        return int(value)
    return operator.index(value)


def _empty_data_type(name: str, dtype: Any) -> DataType:
    """``Tensor.empty``'s ``dtype``: a numpy dtype (or what ``numpy.dtype`` reads as one, but
    ``None``, its float64 default, and a numpy number, which it reads as the number's own
    type) or a Triton data type number, as ``triton_dtype()`` returns (a numpy integer too)."""
    data_type = None
    try:
        if isinstance(dtype, (int, np.integer)) and not isinstance(dtype, bool):
            data_type = DataType(int(dtype))
        elif dtype is not None and not isinstance(dtype, (np.number, np.bool_)):
            data_type = DataType.from_numpy(dtype)
    except (TypeError, ValueError):
        pass
    if data_type is None or data_type is DataType.INVALID:
        named = isinstance(dtype, str)
        hint = " (config.pbtxt names: pb_utils.triton_string_to_numpy)" if named else ""
        raise TritonModelException(
            f"Tensor.empty('{name}'): dtype must be a numpy dtype such as numpy.float32 or a "
            f"Triton data type number such as triton_dtype() returns, got {dtype!r}{hint}"
        )
    return data_type


def numpy_type_of(data_type: int) -> Any:
    """numpy type for a ``TRITONSERVER_DataType`` int (BYTES → ``np.object_``)."""
    dt = DataType(data_type)
    if dt is DataType.BF16:
        return None  # Triton maps BF16 to no numpy type
    return numpy_dtype(dt).type
