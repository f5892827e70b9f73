"""Client-registered CUDA shared-memory regions (Triton's CUDA shared-memory extension).

A client allocates device memory, registers its ``cudaIpcMemHandle`` as ``(name,
raw handle, device id, byte_size)``, and points inputs and outputs at ``(region,
offset, size)``. The server opens the handle once, at registration, and so does each
worker that is sent a reference into the region (:class:`IpcImports`); both close it
when the region is unregistered (or the server stops).

Nothing here copies: an input in a region becomes a device array over the client's
memory, which travels to the worker as a reference (:data:`CudaRef`) and reaches the
model on the GPU when its config says ``FORCE_CPU_ONLY_INPUT_TENSORS: "no"``, or copied
once into host memory by the worker otherwise (Triton's default). A worker writes an
output bound for a region straight into it (from the device, or from host memory) and
refers to it in its response. Every reference is checked against the region's size, in
the words of :func:`dlserve.memory.regions.check_reference`.
"""

from __future__ import annotations

import gc
import itertools
import threading
from typing import Any

from dlserve.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    NotFoundError,
    UnsupportedError,
)
from dlserve.memory.cuda import IpcMemory, cuda_problem
from dlserve.memory.regions import check_reference, refuse_busy

# A reference into device memory on the wire: ("cuda", key, raw handle, device id, size
# of the memory the handle opens, offset, nbytes, lease); told from a host reference
# (segment, offset, nbytes, lease) by its length. Keys: "cuda:N" for a client's region
# (lease 0: it lives while registered), "pool:PID:N" for a chunk of a process's
# DevicePool (dlserve.memory.cuda_pool).
CudaRef = tuple[str, str, bytes, int, int, int, int, int]
CUDA_REF_LENGTH = 8


def is_cuda_ref(ref: Any) -> bool:
    return type(ref) is tuple and len(ref) == CUDA_REF_LENGTH


def device_ref(memory: Any, offset: int, nbytes: int, lease: int) -> CudaRef:
    """A reference to ``nbytes`` at ``offset`` of ``memory``: an IPC mapping or a pool
    chunk (anything with the ``key``, ``raw_handle``, ``device_id`` and ``size`` a peer
    opens it by)."""
    return ("cuda", memory.key, memory.raw_handle, memory.device_id, memory.size, offset,
            nbytes, lease)


class IpcTable:
    """The IPC mappings of one process by key, and the references into them."""

    def __init__(self) -> None:
        # Re-entrant: a view's death (counted by CudaRegions) may come inside a call.
        self._lock = threading.RLock()
        self._memories: dict[str, IpcMemory] = {}

    def locate(self, array: Any) -> CudaRef | None:
        """A reference to the device array ``array``, if it lies in a mapping here."""
        with self._lock:
            memories = list(self._memories.values())
        for memory in memories:
            offset = memory.offset_of(array)
            if offset is not None:
                return device_ref(memory, offset, int(array.nbytes), 0)
        return None

    def view(self, ref: CudaRef, holder: Any = None) -> Any:
        """The device array a reference means (uint8), which keeps ``holder`` alive."""
        _, key, raw_handle, device_id, size, offset, nbytes, _ = ref
        return self._memory(key, raw_handle, device_id, size).view(offset, nbytes, holder)

    def _memory(self, key: str, raw_handle: bytes, device_id: int, size: int) -> IpcMemory:
        with self._lock:
            memory = self._memories.get(key)
        if memory is None:
            raise InvalidArgumentError("the CUDA shared memory region was unregistered")
        return memory

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._memories)

    def forget(self, keys: list[str]) -> None:
        with self._lock:
            gone = [self._memories.pop(key) for key in keys if key in self._memories]
        for memory in gone:
            memory.close()


class IpcImports(IpcTable):
    """A mapping is opened the first time a reference names it (a worker's view of
    clients' regions; every peer's view of the other side's device pool)."""

    def _memory(self, key: str, raw_handle: bytes, device_id: int, size: int) -> IpcMemory:
        with self._lock:
            memory = self._memories.get(key)
            if memory is None:
                memory = self._memories[key] = IpcMemory(key, raw_handle, device_id, size)
        return memory


class _Use:
    """Held by a view of a region: the region is in use while any lives."""

    __slots__ = ("regions", "key")

    def __init__(self, regions: CudaRegions, key: str) -> None:
        self.regions, self.key = regions, key
        with regions._lock:
            regions._users[key] = regions._users.get(key, 0) + 1

    def __del__(self) -> None:
        with self.regions._lock:
            self.regions._users[self.key] -= 1


class CudaRegions(IpcTable):
    """The registry of client CUDA shared-memory regions of one server. ``on_forget(keys)``
    is told of unregistered regions, so that workers close their mappings too. A region
    is in use while a view of it lives (a request's input or output), and then cannot be
    unregistered, as in Triton: its workers' mappings would go under the request."""

    def __init__(self, on_forget: Any = lambda keys: None) -> None:
        super().__init__()
        self._names: dict[str, str] = {}  # region name -> key
        self._users: dict[str, int] = {}  # key -> views alive
        self._keys = (f"cuda:{n}" for n in itertools.count())  # (no shared-memory key has a colon)
        self._on_forget = on_forget

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def register(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        problem = cuda_problem()
        if problem is not None:
            raise UnsupportedError(
                f"CUDA shared memory is not available on this server: {problem} "
                "(use system shared memory)"
            )
        if not name:
            raise InvalidArgumentError("shared memory region name must not be empty")
        if byte_size <= 0:
            raise InvalidArgumentError(
                f"failed to register CUDA shared memory region '{name}': byte_size must be > 0"
            )
        with self._lock:
            if name in self._names:
                raise AlreadyExistsError(f"shared memory region '{name}' already in manager")
            key = next(self._keys)
            try:
                memory = IpcMemory(key, raw_handle, device_id, byte_size)
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(
                    f"failed to register CUDA shared memory region '{name}': {exc}"
                ) from None
            allocated = memory.allocation_bytes()
            if allocated is not None and byte_size > allocated:  # (a touch past it: a sticky CUDA error)
                memory.close()
                raise InvalidArgumentError(
                    f"failed to register shared memory region '{name}': invalid args: byte_size "
                    f"{byte_size} is more than the {allocated} bytes the handle's allocation holds"
                )
            self._names[name] = key
            self._memories[key] = memory

    def unregister(self, name: str | None = None, force: bool = False) -> None:
        """Forget one region (``name``) or all; unknown names are no error (as Triton). A
        region in use stays, in Triton's words; with ``force`` (the server stops) all go."""
        if not force and any(self._users.values()):
            gc.collect()  # a view only a reference cycle still holds is no use
        with self._lock:
            names = sorted(self._names) if name is None else [name]
            busy = [n for n in names if n in self._names and self._users.get(self._names[n]) and not force]
            keys = [self._names.pop(n) for n in names if n in self._names and n not in busy]
        self.forget(keys)
        if keys:
            self._on_forget(keys)
        refuse_busy(name, busy, "cuda")

    def status(self, name: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            if name is not None and name not in self._names:
                raise NotFoundError(f"Unable to find cuda shared memory region: '{name}'")
            names = sorted(self._names) if name is None else [name]
            found = [(n, self._memories[self._names[n]]) for n in names]
        return [{"name": n, "device_id": m.device_id, "byte_size": m.size} for n, m in found]

    def region_view(self, name: str, offset: int, byte_size: int) -> Any:
        """``byte_size`` bytes at ``offset`` inside region ``name``, as a uint8 device array."""
        with self._lock:
            key = self._names.get(name)
            memory = None if key is None else self._memories.get(key)
        if memory is None:
            raise NotFoundError(f"Unable to find shared memory region: '{name}'")
        check_reference(name, offset, byte_size, memory.size)
        return memory.view(offset, byte_size, _Use(self, memory.key))

    def view(self, ref: CudaRef, holder: Any = None) -> Any:
        """As :meth:`IpcTable.view`; the view keeps its region in use."""
        return super().view(ref, (holder, _Use(self, ref[1])))
