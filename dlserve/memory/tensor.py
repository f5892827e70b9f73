"""``dlserve.Tensor``: a typed n-d array in host (usually shared) memory or on a GPU.

The bytes live in a C-contiguous numpy *storage* array: the tensor's own dtype for
fixed-size types, ``uint16`` bits for BF16, and Triton's length-prefixed encoding
(flat ``uint8``) for BYTES. A BYTES tensor made from Python objects keeps the
objects and encodes them only when the bytes must be shared; one read from shared
memory decodes only when the objects are asked for. Nothing here copies unless a
conversion needs it, and every hand-off (numpy, DLPack) is a view.

A GPU tensor holds a device array (cupy's, over the producer's memory: see
:mod:`dlserve.memory.cuda`). Where its bytes must reach host memory (another process,
the network) they are copied once, straight to where they go (:meth:`Tensor.write_into`);
:meth:`Tensor.storage` keeps one host copy for the code that reads bytes.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from dlserve.errors import InvalidArgumentError, UnsupportedError
from dlserve.memory import bytes_codec, cuda
from dlserve.memory.copying import copy_bytes
from dlserve.memory.dlpack import (
    HOST_DEVICES,
    NOT_CONTIGUOUS,
    DLDeviceType,
    device_of,
    export_host_array,
    exposed,
    host_array_from_dlpack,
)
from dlserve.memory.dtypes import DataType, bfloat16_dtype


class DestinationTooSmall(ValueError):
    """:meth:`Tensor.write_into` was given less room than the tensor's bytes take."""

    def __init__(self, needed: int, holds: int) -> None:
        super().__init__(f"needs {needed} bytes, but its destination holds {holds}")
        self.needed = needed
        self.holds = holds


class MemoryType(enum.IntEnum):
    """``TRITONSERVER_MemoryType``."""

    CPU = 0
    CPU_PINNED = 1
    GPU = 2


_MEMORY_WORDS = {"cpu": MemoryType.CPU, "cpu_pinned": MemoryType.CPU_PINNED, "gpu": MemoryType.GPU,
                 "cuda": MemoryType.GPU}


def is_host_memory(where: Any) -> bool:
    """Whether a memory type or device, in any of the forms ``tritonserver`` takes
    (``"cpu"``, ``"cpu:0"``, ``MemoryType.CPU_PINNED``, ``(MemoryType.CPU, 0)``,
    ``(DLDeviceType.kDLCPU, 0)``, ``"cuda:1"``, None for the default), names host
    memory rather than a GPU's; InvalidArgumentError for anything else."""
    if isinstance(where, tuple) and len(where) == 2 and isinstance(where[1], int):
        where = where[0]
    if where is None:
        return True
    if isinstance(where, DLDeviceType):
        if where in HOST_DEVICES:
            return True
        if where in (DLDeviceType.kDLCUDA, DLDeviceType.kDLCUDAManaged):
            return False
    elif isinstance(where, str):
        kind, _, index = where.lower().partition(":")
        if kind in _MEMORY_WORDS and (not index or index.isdigit()):
            return _MEMORY_WORDS[kind] is not MemoryType.GPU
    elif isinstance(where, int) and not isinstance(where, bool) and where in set(MemoryType):
        return MemoryType(where) is not MemoryType.GPU
    raise InvalidArgumentError(f"unsupported memory type or device {where!r}")


@dataclasses.dataclass
class MemoryBuffer:
    """Where a tensor's bytes are: address, kind of memory, device and size; ``owner``
    keeps the memory alive (``tritonserver.MemoryBuffer``)."""

    data_ptr: int
    memory_type: MemoryType
    memory_type_id: int
    size: int
    owner: Any

    @staticmethod
    def from_dlpack(owner: Any) -> MemoryBuffer:
        """The memory of a C-contiguous array that speaks DLPack (numpy, torch, cupy...,
        or a raw capsule), in host memory or on a GPU. Its ``owner`` is the array imported
        from it, which keeps the memory alive (and, on the host, knows whether it may be
        written)."""
        tensor = Tensor.from_dlpack(owner)
        if tensor.memory_type is MemoryType.GPU:
            return tensor.memory_buffer
        storage = tensor.storage()
        address = int(storage.__array_interface__["data"][0])
        return MemoryBuffer(address, MemoryType.CPU, 0, storage.nbytes, storage)

    def host_view(self, writable: bool = True) -> np.ndarray:
        """The buffer as a flat uint8 array that keeps ``owner`` alive: writable, or
        with ``writable=False`` read-only where the owner's memory is."""
        if self.memory_type is MemoryType.GPU:
            raise UnsupportedError("a GPU memory buffer has no host view (Tensor.to_host() copies one)")
        read_only = isinstance(self.owner, np.ndarray) and not self.owner.flags.writeable
        if read_only and writable:
            raise InvalidArgumentError("the memory buffer is read-only")
        return exposed(self.data_ptr, (self.size,), "|u1", self, readonly=read_only)

    def storage_for(self, data_type: DataType, shape: tuple[int, ...]) -> np.ndarray:
        """The buffer as a tensor's storage (see :class:`Tensor`), without a copy."""
        flat = self.host_view(writable=False)
        if data_type is DataType.BYTES:
            return flat
        needed = math.prod(shape) * data_type.itemsize
        if flat.nbytes != needed:
            raise InvalidArgumentError(
                f"the memory buffer holds {flat.nbytes} bytes, but {data_type.name} {list(shape)} needs {needed}"
            )
        return flat.view(data_type.storage_dtype).reshape(shape)


class MemoryAllocator(abc.ABC):
    """Where a request's outputs go (``tritonserver.MemoryAllocator``): ``allocate``
    returns a buffer of at least ``size`` bytes for the output ``tensor_name``, which
    the output is then copied into."""

    @abc.abstractmethod
    def allocate(
        self, size: int, memory_type: MemoryType, memory_type_id: int, tensor_name: str
    ) -> MemoryBuffer: ...


class HostMemoryAllocator(MemoryAllocator):
    """Host memory of numpy's (``tritonserver.default_memory_allocators[MemoryType.CPU]``)."""

    def allocate(
        self, size: int, memory_type: MemoryType = MemoryType.CPU, memory_type_id: int = 0, tensor_name: str = ""
    ) -> MemoryBuffer:
        if not is_host_memory(memory_type):
            raise UnsupportedError(f"the host memory allocator cannot allocate memory type {memory_type!r}")
        return MemoryBuffer.from_dlpack(np.empty(int(size), dtype=np.uint8))


# As tritonserver's: an allocator per kind of memory this build has.
default_memory_allocators: dict[MemoryType, MemoryAllocator] = {MemoryType.CPU: HostMemoryAllocator()}


def allocation_size(data_type: DataType, shape: Sequence[int]) -> int:
    """The bytes a new tensor of a fixed-size type and ``shape`` takes; a negative
    dimension is refused before anything is allocated for it."""
    if any(d < 0 for d in shape):
        raise InvalidArgumentError(
            f"cannot allocate a tensor of shape {list(shape)}: negative dimension"
        )
    return math.prod(shape) * data_type.itemsize


class ElementCountError(ValueError):
    """A BYTES tensor's encoded elements are not as many as its shape needs."""

    def __init__(self, count: int, expected: int, shape: Sequence[int]) -> None:
        super().__init__(f"holds {count} BYTES elements, but its shape {list(shape)} needs {expected}")
        self.count, self.expected = count, expected


class Tensor:
    """A typed n-d array; see the module docstring for how its bytes are held."""

    __slots__ = ("data_type", "shape", "_data", "_objects", "_device")
    # Whether a legacy DLPack capsule may hand out its read-only memory (export_host_array)
    shares_read_only: ClassVar[bool] = True

    def __init__(
        self,
        data_type: DataType,
        shape: Sequence[int],
        data: np.ndarray | MemoryBuffer | None = None,
        objects: np.ndarray | None = None,
        memory_buffer: MemoryBuffer | None = None,
        device_array: Any = None,
    ) -> None:
        """``data``: the storage array, or (as tritonserver's ``Tensor(data_type, shape,
        memory_buffer)``, positionally or by that name) a :class:`MemoryBuffer` holding
        the bytes; ``device_array``: a GPU tensor's (see :mod:`dlserve.memory.cuda`)."""
        self.data_type = data_type if type(data_type) is DataType else DataType(data_type)
        self.shape: tuple[int, ...] = shape if type(shape) is tuple else tuple(int(d) for d in shape)
        if memory_buffer is not None:
            data = memory_buffer
        if isinstance(data, MemoryBuffer):
            data = data.storage_for(self.data_type, self.shape)
        elif data is not None and not isinstance(data, np.ndarray):
            raise InvalidArgumentError(f"a Tensor's memory must be a MemoryBuffer, not {type(data).__name__}")
        self._data = data
        self._objects = objects
        self._device = device_array
        if data is None and objects is None and device_array is None:
            raise ValueError("a Tensor needs storage data, BYTES objects or a device array")

    # -- construction ---------------------------------------------------------------
    @classmethod
    def _of(cls, data_type: DataType, shape: tuple[int, ...], data: np.ndarray) -> Tensor:
        """A host tensor over ``data``, its storage array, from values the caller has
        checked (what a peer sent, against its shape; what from_numpy worked out): none
        of the constructor's checks."""
        tensor = cls.__new__(cls)
        tensor.data_type = data_type
        tensor.shape = shape
        tensor._data = data
        tensor._objects = None
        tensor._device = None
        return tensor

    @classmethod
    def from_numpy(cls, array: Any) -> Tensor:
        arr = array if type(array) is np.ndarray else np.asarray(array)
        data_type = DataType.from_numpy(arr.dtype)
        if data_type is DataType.BYTES:
            return cls(data_type, arr.shape, objects=arr)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        if data_type is DataType.BF16:
            arr = arr.view(np.uint16)
        return cls._of(data_type, arr.shape, arr)  # (checked above: the constructor's checks hold)

    @classmethod
    def from_dlpack(cls, obj: Any) -> Tensor:
        """Zero-copy import of anything that speaks DLPack (or a raw capsule)."""
        try:
            device_type, _ = device_of(obj)
        except TypeError as exc:  # (tritonserver: InvalidArgumentError)
            raise InvalidArgumentError(str(exc)) from None
        if device_type == DLDeviceType.kDLCUDA:
            array, data_type = cuda.import_device_array(obj)
            if not array.flags.c_contiguous:
                raise InvalidArgumentError(NOT_CONTIGUOUS)
            return cls(data_type, array.shape, device_array=array)
        if device_type not in HOST_DEVICES:
            raise UnsupportedError(
                f"tensors on DLPack device {_device_name(device_type)} are not supported "
                "(host memory and CUDA are)"
            )
        try:
            array, data_type = host_array_from_dlpack(obj)
        except BufferError as exc:
            raise InvalidArgumentError(f"cannot import DLPack tensor: {exc}") from None
        if not array.flags.c_contiguous:
            raise InvalidArgumentError(NOT_CONTIGUOUS)
        return cls(data_type, array.shape, data=array)

    @classmethod
    def of_bytes(cls, view: Any) -> Tensor:
        """A UINT8 tensor over a flat byte view, of host or of device memory."""
        if cuda.is_device_array(view):
            return cls(DataType.UINT8, view.shape, device_array=view)
        return cls(DataType.UINT8, view.shape, data=view)

    @classmethod
    def from_bytes_array(cls, values: Any) -> Tensor:
        """A BYTES tensor of these elements, held as ``bytes`` (str encoded as UTF-8, anything
        else as its ``str``), so that ``to_bytes_array`` gives bytes back, as tritonserver's."""
        arr = np.asarray(values, dtype=np.object_) if isinstance(values, list) else np.asarray(values)
        if arr.dtype.kind not in ("O", "S", "U"):
            raise InvalidArgumentError(f"cannot make a BYTES tensor from a {arr.dtype} array")
        items = [
            v if isinstance(v, bytes) else (v if isinstance(v, str) else str(v)).encode("utf-8")
            for v in arr.ravel().tolist()
        ]
        objects = np.empty(len(items), dtype=np.object_)
        objects[:] = items
        return cls(DataType.BYTES, arr.shape, objects=objects.reshape(arr.shape))

    from_string_array = from_bytes_array

    @classmethod
    def zeros(cls, data_type: DataType, shape: Sequence[int]) -> Tensor:
        """A tensor of zeros (empty strings for BYTES)."""
        if data_type is DataType.BYTES:
            objects = np.empty(math.prod(shape), dtype=np.object_)
            objects[:] = [b""] * objects.size
            return cls(data_type, shape, objects=objects.reshape(shape))
        return cls(data_type, shape, data=np.zeros(shape, dtype=data_type.storage_dtype))

    @classmethod
    def from_object(cls, obj: Any) -> Tensor:
        """Accept a Tensor, numpy array or scalar, list, or DLPack-capable object."""
        if isinstance(obj, Tensor):
            return obj
        if isinstance(obj, (np.ndarray, np.generic)):
            return cls.from_numpy(obj)
        if isinstance(obj, list):
            try:
                return cls.from_numpy(np.array(obj))
            except (ValueError, TypeError) as exc:
                raise InvalidArgumentError(f"cannot convert list to a tensor: {exc}") from None
        if hasattr(obj, "__dlpack__"):
            return cls.from_dlpack(obj)
        raise InvalidArgumentError(
            f"input of type {type(obj).__name__} is not supported: pass a dlserve.Tensor, "
            "a numpy array, a list or an object with __dlpack__"
        )

    # -- storage --------------------------------------------------------------------
    @property
    def element_count(self) -> int:
        return math.prod(self.shape)

    def storage(self) -> np.ndarray:
        """The bytes as a C-contiguous array (BYTES: encoded, flat uint8); a GPU
        tensor's copied to host memory once."""
        if self._data is None and self._device is not None:
            host = np.empty(self._device.shape, dtype=self._device.dtype)
            cuda.copy_to_host(self._device, host)
            self._data = host
        if self._data is None:
            assert self._objects is not None
            self._data = bytes_codec.serialize_bytes(self._objects)
        return self._data

    def check_size(self) -> None:
        """Raise ValueError if the bytes held do not fit the shape (BYTES: the count)."""
        if self.data_type is DataType.BYTES:
            if self._data is None and self._device is None:
                return  # Python objects: nothing encoded to check
            count = bytes_codec.count_elements(self.storage())
            if count != self.element_count:
                raise ElementCountError(count, self.element_count, self.shape)
            return
        expected = math.prod(self.shape) * self.data_type.itemsize
        data = self._data  # (every request's every input: no property calls)
        if (data.nbytes if data is not None else self.size) != expected:
            raise ValueError(
                f"byte size mismatch: shape {list(self.shape)} of {self.data_type.name} "
                f"needs {expected} bytes, got {self.size}"
            )

    def write_into(self, buffer: Any) -> Tensor:
        """This tensor's bytes placed at the start of ``buffer`` (a uint8 view of shared
        memory, or of device memory): copied there unless already there, straight from
        where they are (host or device). Raises DestinationTooSmall if it is too small."""
        nbytes = self.size
        if nbytes > buffer.nbytes:
            raise DestinationTooSmall(nbytes, int(buffer.nbytes))
        target = buffer[:nbytes]
        if cuda.is_device_array(target):
            return self._written_to_device(target)
        if self._device is not None and self._data is None:
            cuda.copy_to_host(self._device, target)
        elif target.__array_interface__["data"][0] != self.data_ptr:
            copy_bytes(target, self.storage().reshape(-1).view(np.uint8))
        if self.data_type is DataType.BYTES:
            return Tensor(self.data_type, self.shape, data=target)
        view = target.view(self.data_type.storage_dtype).reshape(self.shape)
        return Tensor(self.data_type, self.shape, data=view)

    def _written_to_device(self, target: Any) -> Tensor:
        source = self._device if self._device is not None else self.storage()
        if self._device is None or cuda.address_of(target) != self.data_ptr:
            cuda.copy_into_device(target, source.reshape(-1).view(np.uint8))
        if self.data_type is not DataType.BYTES:
            target = target.view(self.data_type.storage_dtype).reshape(self.shape)
        return Tensor(self.data_type, self.shape, device_array=target)

    @property
    def device_array(self) -> Any:
        """A GPU tensor's device array (cupy's); None for a host tensor."""
        return self._device

    def allocated_by(self, allocator: MemoryAllocator, name: str) -> Tensor:
        """This tensor copied into memory ``allocator`` gives for the output ``name``."""
        buffer = allocator.allocate(self.size, MemoryType.CPU, 0, name)
        if not isinstance(buffer, MemoryBuffer):
            raise TypeError(f"allocate() returned a {type(buffer).__name__}, not a MemoryBuffer")
        return self.write_into(buffer.host_view())

    def reshape(self, shape: Sequence[int]) -> Tensor:
        """The same bytes under another shape with as many elements."""
        shape = tuple(int(d) for d in shape)
        if self._device is not None:
            return Tensor(self.data_type, shape, device_array=self._device.reshape(shape))
        if self.data_type is DataType.BYTES:
            objects = None if self._objects is None else self._objects.reshape(shape)
            return Tensor(self.data_type, shape, data=self._data, objects=objects)
        return Tensor(self.data_type, shape, data=self.storage().reshape(shape))

    @property
    def size(self) -> int:
        """Size of the tensor's bytes (BYTES: of its encoding)."""
        if self._device is not None:
            return int(self._device.nbytes)
        return int(self.storage().nbytes)

    @property
    def data_ptr(self) -> int:
        if self._device is not None:
            return cuda.address_of(self._device)
        return int(self.storage().__array_interface__["data"][0])

    @property
    def memory_type(self) -> MemoryType:
        return MemoryType.CPU if self._device is None else MemoryType.GPU

    @property
    def memory_type_id(self) -> int:
        return 0 if self._device is None else cuda.device_of_array(self._device)

    @property
    def memory_buffer(self) -> MemoryBuffer:
        owner = self.storage() if self._device is None else self._device
        return MemoryBuffer(self.data_ptr, self.memory_type, self.memory_type_id, self.size, owner)

    # -- views ----------------------------------------------------------------------
    def as_numpy(self) -> np.ndarray:
        """A numpy view (BYTES: object array of bytes; BF16: ``ml_dtypes.bfloat16``)."""
        if self._device is not None:
            raise InvalidArgumentError("the tensor is in GPU memory: to_host() gives a copy in host memory")
        if self.data_type is DataType.BYTES:
            return self.to_bytes_array()
        data = self._shaped()
        if self.data_type is DataType.BF16:
            return data.view(bfloat16_dtype())
        return data

    def _shaped(self) -> np.ndarray:
        """The storage under the tensor's shape, which its user may have set anew
        (``tensor.shape = [...]``, as tritonserver's dataclass lets one)."""
        data = self.storage()
        if data.shape == self.shape:
            return data
        try:
            return data.reshape(self.shape)
        except ValueError:
            raise InvalidArgumentError(
                f"tensor shape {list(self.shape)} does not fit its {data.size} elements"
            ) from None

    def to_bytes_array(self) -> np.ndarray:
        if self.data_type is not DataType.BYTES:
            raise InvalidArgumentError(f"tensor is {self.data_type.name}, not BYTES")
        if self._objects is None:
            try:
                decoded = bytes_codec.deserialize_bytes(self.storage(), self.element_count)
            except ValueError as exc:
                raise InvalidArgumentError(f"malformed BYTES tensor: {exc}") from None
            self._objects = decoded.reshape(self.shape)
        return self._objects

    def to_string_array(self) -> np.ndarray:
        """BYTES elements decoded as UTF-8 into a numpy ``str`` array."""
        objects = self.to_bytes_array()
        decoded = [
            item.decode("utf-8") if isinstance(item, (bytes, bytearray)) else str(item)
            for item in objects.ravel().tolist()
        ]
        return np.array(decoded, dtype=np.str_).reshape(self.shape)

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        return self.export_dlpack(stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)

    def export_dlpack(self, keep_alive: Any = None, **protocol: Any) -> Any:
        """``__dlpack__`` (its keywords in ``protocol``), whose capsule also holds
        ``keep_alive`` while it lives (a GPU tensor's holds its device array)."""
        if self._device is not None:
            return cuda.export_device_array(self._device, self.data_type, **protocol)
        return export_host_array(
            self.storage() if self.data_type is DataType.BYTES else self._shaped(),
            self.data_type,
            keep_alive=keep_alive,
            share_read_only=self.shares_read_only,
            **protocol,
        )

    def __dlpack_device__(self) -> tuple[int, int]:
        if self._device is not None:
            return (int(DLDeviceType.kDLCUDA), self.memory_type_id)
        return (int(DLDeviceType.kDLCPU), 0)

    def to_host(self) -> Tensor:
        """This tensor in host memory: itself, or a GPU tensor's copy."""
        if self._device is None:
            return self
        return Tensor(self.data_type, self.shape, data=self.storage())

    def to_device(self, device: Any) -> Tensor:
        """This tensor in host memory or on a GPU (any form :func:`is_host_memory`
        takes; ``"gpu"`` and ``"cuda"`` alone mean GPU 0): itself if it is there already,
        else a copy."""
        if is_host_memory(device):
            return self.to_host()
        index = _device_index(device)
        if self._device is not None and self.memory_type_id == index:
            return self
        if self.data_type is DataType.BYTES:
            raise InvalidArgumentError("BYTES tensors cannot be moved to a GPU")
        return Tensor(self.data_type, self.shape, device_array=cuda.to_device(self.storage(), index))

    def __repr__(self) -> str:
        return f"Tensor(data_type={self.data_type.name}, shape={list(self.shape)})"


def _device_index(where: Any) -> int:
    """The GPU a device form that names one means (``"cuda:1"``, ``(MemoryType.GPU, 1)``,
    ``(DLDeviceType.kDLCUDA, 1)``); 0 where it names no index."""
    if isinstance(where, tuple):
        return int(where[1])
    if isinstance(where, str):
        index = where.partition(":")[2]
        return int(index) if index else 0
    return 0


def _device_name(device_type: int) -> str:
    try:
        return DLDeviceType(device_type).name
    except ValueError:
        return f"type {device_type}"
