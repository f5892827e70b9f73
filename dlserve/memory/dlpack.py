"""DLPack producer and consumer helpers (protocol of DLPack 1.x, legacy capsules accepted).

Host memory is exported and imported through numpy's own DLPack support, which
already speaks the current protocol (``max_version``, versioned capsules with the
read-only flag, ``dl_device``, ``copy``). This module adds what numpy cannot do:

* BF16: numpy has no bfloat16 type, so BF16 travels as ``uint16`` bits and the
  capsule's dtype field is rewritten in place (``kDLUInt,16`` ⇄ ``kDLBfloat,16``)
  before the consumer sees it.
* Raw capsules (TensorFlow hands those out) are wrapped in an object with
  ``__dlpack__``/``__dlpack_device__`` so every consumer path is the same.
* Device discovery and a clear error for BYTES, which DLPack cannot describe.
"""

from __future__ import annotations

import ctypes
import enum
from typing import Any

import numpy as np

from dlserve.memory.dtypes import FROM_DLPACK_TYPE, KDL_BFLOAT, KDL_UINT, DataType

LEGACY_NAME = b"dltensor"
VERSIONED_NAME = b"dltensor_versioned"
FLAG_READ_ONLY = 1 << 0
FLAG_IS_COPIED = 1 << 1
# Triton's own words (python backend), which its QA compares whole.
STRING_EXPORT_REFUSED = "DLPack does not have support for string tensors."
NOT_CONTIGUOUS = (
    "DLPack tensor is not contiguous. Only contiguous DLPack tensors that are stored in C-Order are supported."
)


class DLDeviceType(enum.IntEnum):
    kDLCPU = 1
    kDLCUDA = 2
    kDLCUDAHost = 3
    kDLOpenCL = 4
    kDLVulkan = 7
    kDLMetal = 8
    kDLVPI = 9
    kDLROCM = 10
    kDLROCMHost = 11
    kDLExtDev = 12
    kDLCUDAManaged = 13
    kDLOneAPI = 14
    kDLWebGPU = 15
    kDLHexagon = 16


HOST_DEVICES = (DLDeviceType.kDLCPU, DLDeviceType.kDLCUDAHost)


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _Device),
        ("ndim", ctypes.c_int32),
        ("dtype", _DType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _Managed(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _ManagedVersioned(ctypes.Structure):
    _fields_ = [
        ("version", _Version),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


_api = ctypes.pythonapi
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def is_capsule(obj: Any) -> bool:
    return type(obj).__name__ == "PyCapsule"


def _tensor_struct(capsule: Any) -> tuple[_DLTensor, int]:
    """The DLTensor inside an unconsumed capsule and the capsule's flags."""
    if _api.PyCapsule_IsValid(capsule, VERSIONED_NAME):
        managed = _ManagedVersioned.from_address(_api.PyCapsule_GetPointer(capsule, VERSIONED_NAME))
        return managed.dl_tensor, int(managed.flags)
    if _api.PyCapsule_IsValid(capsule, LEGACY_NAME):
        legacy = _Managed.from_address(_api.PyCapsule_GetPointer(capsule, LEGACY_NAME))
        return legacy.dl_tensor, 0
    raise BufferError("not an unconsumed DLPack capsule (was it already used?)")


def capsule_device(capsule: Any) -> tuple[int, int]:
    tensor, _ = _tensor_struct(capsule)
    return int(tensor.device.device_type), int(tensor.device.device_id)


def capsule_dtype(capsule: Any) -> tuple[int, int, int]:
    dtype = _tensor_struct(capsule)[0].dtype
    return int(dtype.code), int(dtype.bits), int(dtype.lanes)


def set_dtype_code(capsule: Any, code: int) -> None:
    _tensor_struct(capsule)[0].dtype.code = code


class CapsuleHolder:
    """Presents a raw capsule through the ``__dlpack__`` protocol (it is handed out once)."""

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule
        self._device = capsule_device(capsule)

    def __dlpack__(self, **_kwargs: Any) -> Any:
        capsule, self._capsule = self._capsule, None
        if capsule is None:
            raise BufferError("this DLPack capsule has already been consumed")
        return capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._device


def request_capsule(obj: Any, max_version: tuple[int, int] | None = (1, 0)) -> Any:
    """Ask a producer for a capsule, preferring a versioned one, falling back to legacy."""
    if is_capsule(obj):
        return obj
    if max_version is not None:
        try:
            return obj.__dlpack__(max_version=max_version)
        except TypeError:
            pass  # producer predates the keyword
    return obj.__dlpack__()


def device_of(obj: Any) -> tuple[int, int]:
    if is_capsule(obj):
        return capsule_device(obj)
    if isinstance(obj, CapsuleHolder) or hasattr(obj, "__dlpack_device__"):
        device = obj.__dlpack_device__()
        return int(device[0]), int(device[1])
    raise TypeError(f"{type(obj).__name__} does not implement the DLPack protocol")


def host_array_from_dlpack(obj: Any) -> tuple[np.ndarray, DataType]:
    """Import a host (CPU) DLPack object without copying: (storage array, data type).

    BF16 comes back as a ``uint16`` array tagged ``DataType.BF16``.
    """
    capsule = request_capsule(obj)
    code, bits, lanes = capsule_dtype(capsule)
    if lanes != 1:
        raise BufferError(f"DLPack tensors with {lanes} lanes are not supported")
    data_type = FROM_DLPACK_TYPE.get((code, bits))
    if data_type is None:
        raise BufferError(f"DLPack dtype (code {code}, {bits} bits) has no Triton data type")
    if data_type is DataType.BF16:
        set_dtype_code(capsule, KDL_UINT)
    handed_legacy = capsule is obj and bool(_api.PyCapsule_IsValid(capsule, LEGACY_NAME))
    array = np.from_dlpack(CapsuleHolder(capsule))
    if handed_legacy and not array.flags.writeable and array.size:
        # A legacy capsule has no read-only flag; numpy 2 imports one read-only. One the
        # caller made (torch's to_dlpack, pb_utils' to_dlpack) is taken as writable, as
        # Triton takes it. (A producer asked for a versioned capsule that answers with a
        # legacy one stays read-only: jax's immutable arrays do that.)
        # (The strides travel too: a transposed tensor must stay transposed, for the
        # contiguity check that follows to see it.)
        array = exposed(
            array.__array_interface__["data"][0], array.shape, array.dtype.str, array, strides=array.strides
        )
    return array, data_type


class _Exposure:
    """What :func:`exposed` hands numpy: its ``__array_interface__``, and as the
    array's base, the owner of the memory."""

    def __init__(self, interface: dict[str, Any], owner: Any) -> None:
        self.__array_interface__ = interface
        self.owner = owner


def exposed(
    address: int,
    shape: tuple[int, ...],
    typestr: str,
    owner: Any,
    readonly: bool = False,
    strides: tuple[int, ...] | None = None,
) -> np.ndarray:
    """An array over the memory at ``address`` (C-contiguous unless ``strides`` says
    otherwise), which ``owner`` keeps alive for as long as the array (or a view of it) lives."""
    interface = {"data": (address, readonly), "shape": shape, "typestr": typestr, "version": 3}
    if strides is not None:
        interface["strides"] = strides
    return np.asarray(_Exposure(interface, owner))


def export_host_array(
    array: np.ndarray,
    data_type: DataType,
    *,
    stream: Any = None,
    max_version: tuple[int, int] | None = None,
    dl_device: tuple[int, int] | None = None,
    copy: bool | None = None,
    keep_alive: Any = None,
    share_read_only: bool = True,
) -> Any:
    """``__dlpack__`` for a host tensor whose bits are in ``array`` (BF16 as uint16).
    The capsule holds ``keep_alive`` too, for as long as it (or what imported it) lives.

    A legacy capsule cannot say read-only: read-only memory goes in one as it is (as
    Triton hands out a model's: jax's arrays, np.frombuffer of bytes), but for memory
    others read that must not change (``share_read_only`` False: a response-cache
    entry), which goes as a copy."""
    if data_type is DataType.BYTES:
        raise BufferError(STRING_EXPORT_REFUSED)
    if stream is not None and stream != -1:
        raise BufferError("a CPU tensor takes no stream (pass stream=None)")
    if dl_device is not None and tuple(dl_device) != (DLDeviceType.kDLCPU, 0):
        raise BufferError(f"cannot export a CPU tensor to device {tuple(dl_device)}")
    kwargs: dict[str, Any] = {"copy": copy}
    if max_version is not None:
        kwargs["max_version"] = tuple(max_version)
    legacy = max_version is None or tuple(max_version)[0] < 1
    read_only = not array.flags.writeable
    if read_only and legacy and not share_read_only:
        array, read_only = np.array(array), False  # a copy of its own
    if keep_alive is not None and array.flags.c_contiguous or read_only and legacy:
        # numpy's capsule holds the array it exports: one whose base holds both (and
        # numpy refuses a legacy capsule of read-only memory).
        address = array.__array_interface__["data"][0]
        array = exposed(
            address, array.shape, array.dtype.str, (array, keep_alive), read_only and not legacy,
            array.strides,
        )
    capsule = array.__dlpack__(**kwargs)
    if data_type is DataType.BF16:
        set_dtype_code(capsule, KDL_BFLOAT)
    return capsule
