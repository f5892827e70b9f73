"""Everything dlserve asks of CUDA, through cupy: the probe, device arrays, copies, IPC.

cupy is optional (the ``gpu-cuda12``/``gpu-cuda13`` extras, or a preinstalled build):
:func:`cuda_problem` says why CUDA cannot be used, and every other function here
is called only where it can (a tensor already on a GPU, a server with a device).
This is the only module that imports cupy, so the rest of dlserve speaks of device
arrays (cupy's, imported without a copy from any DLPack producer) and pointers.

Stream order follows DLPack: an import asks its producer for a capsule on cupy's
current stream, so the producer's pending work is ordered before anything done
with the array here; copies to and from host memory are synchronous.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any

import numpy as np

from dlserve.errors import InvalidArgumentError, UnsupportedError
from dlserve.memory.dlpack import CapsuleHolder, capsule_dtype, is_capsule, set_dtype_code
from dlserve.memory.dtypes import FROM_DLPACK_TYPE, KDL_BFLOAT, KDL_UINT, DataType

log = logging.getLogger(__name__)
IPC_HANDLE_SIZE = 64  # sizeof(cudaIpcMemHandle_t)
_HOST_TO_DEVICE = 1  # cudaMemcpyKind
_DEVICE_TO_DEVICE = 3
_LEGACY_DEFAULT_STREAM = 1  # what DLPack's stream argument calls CUDA's legacy default stream


def cuda_problem() -> str | None:
    """Why CUDA cannot be used in this process, or None when it can."""
    try:
        import cupy
    except ImportError:
        return "cupy is not installed (pip install 'dlserve[gpu-cuda12]' or 'dlserve[gpu-cuda13]')"
    except Exception as exc:  # noqa: BLE001 - a broken CUDA install raises anything
        return f"cupy does not import: {exc}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - no driver, no device: CUDA's own words
        return f"no CUDA device: {exc}"
    return None if count > 0 else "no CUDA device"


@functools.cache
def device_count() -> int:
    """CUDA devices visible to this process (0 without cupy or a driver)."""
    if cuda_problem() is not None:
        return 0
    import cupy

    return int(cupy.cuda.runtime.getDeviceCount())


def cupy_module() -> Any:
    """cupy, or UnsupportedError saying why CUDA cannot be used."""
    if device_count() == 0:
        raise UnsupportedError(f"GPU tensors need CUDA: {cuda_problem()}")
    import cupy

    return cupy


def import_device_array(obj: Any) -> tuple[Any, DataType]:
    """A CUDA DLPack object (or capsule) as a cupy array over the same memory, and its
    Triton data type (BF16, which cupy lacks, comes as ``uint16`` bits)."""
    cupy = cupy_module()
    if is_capsule(obj):
        capsule = obj
    else:
        stream = cupy.cuda.get_current_stream().ptr or _LEGACY_DEFAULT_STREAM
        try:
            capsule = obj.__dlpack__(stream=stream, max_version=(1, 0))
        except TypeError:  # a producer that predates max_version
            capsule = obj.__dlpack__(stream=stream)
    code, bits, lanes = capsule_dtype(capsule)
    data_type = FROM_DLPACK_TYPE.get((code, bits)) if lanes == 1 else None
    if data_type is None:
        raise InvalidArgumentError(
            f"DLPack dtype (code {code}, {bits} bits, {lanes} lanes) has no Triton data type"
        )
    if data_type is DataType.BF16:
        set_dtype_code(capsule, KDL_UINT)
    try:
        array = cupy.from_dlpack(CapsuleHolder(capsule))
    except (BufferError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"cannot import DLPack tensor: {exc}") from None
    return array, data_type


def export_device_array(array: Any, data_type: DataType, **protocol: Any) -> Any:
    """``__dlpack__`` of a device array (the protocol's keywords that were given)."""
    capsule = array.__dlpack__(**{k: v for k, v in protocol.items() if v is not None})
    if data_type is DataType.BF16:
        set_dtype_code(capsule, KDL_BFLOAT)
    return capsule


def copy_to_host(array: Any, out: np.ndarray) -> None:
    """The device array's bytes into ``out`` (contiguous host memory of its size)."""
    flat = array.reshape(-1).view(np.uint8)
    flat.get(out=out.reshape(-1).view(np.uint8))


def to_device(host: np.ndarray, device_id: int) -> Any:
    """A new device array on ``device_id`` holding a copy of ``host``."""
    cupy = cupy_module()
    _check_device(device_id)
    with cupy.cuda.Device(device_id):
        return cupy.asarray(host)


def _check_device(device_id: int) -> None:
    if not 0 <= device_id < device_count():
        raise InvalidArgumentError(f"GPU {device_id} does not exist (this machine has {device_count()})")


def device_of_array(array: Any) -> int:
    return int(array.device.id)


def address_of(array: Any) -> int:
    return int(array.data.ptr)


def synchronize_default_stream(device_id: int | None = None) -> None:
    """Wait for the work queued on the legacy default stream (of ``device_id``, or the
    current device), where DLPack imports order a producer's work (module docstring)."""
    cupy = cupy_module()
    if device_id is None:
        cupy.cuda.Stream.null.synchronize()
        return
    with cupy.cuda.Device(device_id):
        cupy.cuda.Stream.null.synchronize()


def device_view(address: int, nbytes: int, device_id: int, owner: Any) -> Any:
    """A uint8 device array over ``nbytes`` at ``address``, which keeps ``owner`` alive."""
    cupy = cupy_module()
    memory = cupy.cuda.UnownedMemory(address, nbytes, owner, device_id)
    return cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))


def is_device_array(obj: Any) -> bool:
    """Whether ``obj`` is device memory (a cupy array) rather than a numpy array."""
    return hasattr(obj, "__cuda_array_interface__")


def copy_into_device(destination: Any, source: Any) -> None:
    """``source`` (host memory, contiguous, or a device array) into the device array
    ``destination`` of at least its size, finished before this returns: another process
    (a client reading its region) may look at it next."""
    cupy = cupy_module()
    with cupy.cuda.Device(device_of_array(destination)):
        if is_device_array(source):
            nbytes = int(source.nbytes)
            cupy.cuda.runtime.memcpy(address_of(destination), address_of(source), nbytes, _DEVICE_TO_DEVICE)
        else:
            nbytes = int(source.nbytes)
            cupy.cuda.runtime.memcpy(address_of(destination), source.ctypes.data, nbytes, _HOST_TO_DEVICE)
        # The copy ran on the legacy default stream, which DLPack imports are ordered on
        # (see the module docstring): wait for that stream only, not the whole device.
        cupy.cuda.Stream.null.synchronize()


class IpcMemory:
    """Device memory another process shared through a ``cudaIpcMemHandle`` (a client's
    CUDA shared-memory region of ``size`` bytes), opened once and seen through
    :meth:`view`. ``key`` names it to the processes that open the same handle (the
    server and its workers)."""

    def __init__(self, key: str, raw_handle: bytes, device_id: int, size: int) -> None:
        cupy = cupy_module()
        if len(raw_handle) != IPC_HANDLE_SIZE:
            raise InvalidArgumentError(
                f"a CUDA IPC handle is {IPC_HANDLE_SIZE} bytes, got {len(raw_handle)}"
            )
        _check_device(device_id)
        self.key = key
        self.raw_handle = bytes(raw_handle)
        self.device_id = device_id
        self.size = size
        self._cupy = cupy
        with cupy.cuda.Device(device_id):
            try:
                self.address: int | None = int(cupy.cuda.runtime.ipcOpenMemHandle(self.raw_handle))
            except cupy.cuda.runtime.CUDARuntimeError as exc:
                raise InvalidArgumentError(f"failed to open CUDA IPC handle: {exc}") from None

    def allocation_bytes(self) -> int | None:
        """The bytes of the exporter's allocation from where the handle opens it (the
        driver's ``cuMemGetAddressRange``; cupy does not offer it), or None where the
        driver does not say."""
        if self.address is None:
            return None
        try:
            driver = ctypes.CDLL("libcuda.so.1")
            base, size = ctypes.c_uint64(), ctypes.c_size_t()
            with self._cupy.cuda.Device(self.device_id):
                code = driver.cuMemGetAddressRange_v2(
                    ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(self.address)
                )
        except (OSError, AttributeError):
            return None
        return int(base.value + size.value - self.address) if code == 0 else None

    def view(self, offset: int, nbytes: int, holder: Any = None) -> Any:
        """``nbytes`` at ``offset`` as a uint8 device array, which keeps this mapping's
        object (and ``holder``) alive; closing the mapping still ends it (:meth:`close`)."""
        if self.address is None:
            raise InvalidArgumentError("the CUDA shared memory region was unregistered")
        owner = self if holder is None else (self, holder)
        return device_view(self.address + offset, nbytes, self.device_id, owner)

    def offset_of(self, array: Any) -> int | None:
        """Where the device array ``array`` starts in this memory, if it lies wholly in it."""
        if self.address is None:
            return None
        offset = address_of(array) - self.address
        return offset if 0 <= offset and offset + int(array.nbytes) <= self.size else None

    def close(self) -> None:
        """Unmap. No view may be touched afterwards: the server refuses to unregister a
        region a request uses, as Triton does."""
        if self.address is not None:
            address, self.address = self.address, None
            try:
                with self._cupy.cuda.Device(self.device_id):
                    self._cupy.cuda.runtime.ipcCloseMemHandle(address)
            except Exception as exc:  # noqa: BLE001 - a broken context must not stop clean-up
                log.warning("closing the CUDA IPC mapping '%s' failed: %s", self.key, exc)
