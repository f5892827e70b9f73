"""A process's own device memory that its peers map by CUDA IPC: GPU tensors between the
server and its workers without a trip through host memory.

A GPU tensor a process sends (a model's torch output, a BLS input, an in-process cupy
input) is copied once, device to device, into a block of this pool; the peer opens the
block's chunk once by its IPC handle (``cudaIpcGetMemHandle`` gives the handle of a
whole allocation, so a reference carries the offset) and sees the block as a device
array over the same memory. The block is held for the peer under a lease, as host
blocks are (:mod:`dlserve.ipc.tensors`), and freed when the lease comes back.

Chunks are plain ``cudaMalloc`` allocations (not cupy's memory pool, whose blocks share
allocations with other arrays), carved into 512-byte aligned blocks first fit; a chunk
is added when none has room (each twice the last, from 32 MiB up to 1 GiB, or the tensor's
size; the tensor's size alone where the device has no room for more), and kept while the
process lives. There is one pool per process (:func:`process_pool`),
shared by all its peers.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from typing import Any

from dlserve.errors import UnavailableError
from dlserve.memory import cuda
from dlserve.memory.cuda_regions import CudaRef, device_ref

ALIGNMENT = 512
FIRST_CHUNK_BYTES = 32 << 20
LAST_CHUNK_BYTES = 1 << 30  # (chunks stop doubling here)


class _Chunk:
    """One allocation: free ranges by offset, first fit, merged on free."""

    def __init__(self, key: str, device_id: int, size: int) -> None:
        cupy = cuda.cupy_module()
        with cupy.cuda.Device(device_id):
            try:
                self.address = int(cupy.cuda.runtime.malloc(size))
            except cupy.cuda.runtime.CUDARuntimeError as exc:
                raise UnavailableError(
                    f"no GPU memory for a {size}-byte transfer chunk on GPU {device_id}: {exc}"
                ) from None
            try:
                self.raw_handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(self.address))
            except cupy.cuda.runtime.CUDARuntimeError as exc:
                cupy.cuda.runtime.free(self.address)
                raise UnavailableError(f"cannot share GPU memory with other processes: {exc}") from None
        self.key, self.device_id, self.size = key, device_id, size
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, size), by offset

    def take(self, nbytes: int) -> int | None:
        size = max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)
        for index, (offset, room) in enumerate(self._free):
            if room >= size:
                if room == size:
                    del self._free[index]
                else:
                    self._free[index] = (offset + size, room - size)
                return offset
        return None

    def give(self, offset: int, nbytes: int) -> None:
        size = max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)
        free = self._free
        index = next((i for i, (start, _) in enumerate(free) if start > offset), len(free))
        free.insert(index, (offset, size))
        if index + 1 < len(free) and offset + size == free[index + 1][0]:  # merge the next
            free[index] = (offset, size + free.pop(index + 1)[1])
        if index > 0 and free[index - 1][0] + free[index - 1][1] == offset:  # and the previous
            start, room = free.pop(index - 1)
            free[index - 1] = (start, room + free[index - 1][1])


class PoolBlock:
    """``nbytes`` of a chunk, given back to it when this object dies."""

    def __init__(self, pool: DevicePool, chunk: _Chunk, offset: int, nbytes: int) -> None:
        self.pool, self.chunk, self.offset, self.nbytes = pool, chunk, offset, nbytes

    def view(self) -> Any:
        """The block as a uint8 device array that keeps this block alive."""
        return cuda.device_view(self.chunk.address + self.offset, self.nbytes, self.chunk.device_id, self)

    def ref(self, lease: int) -> CudaRef:
        """The block as a reference a peer imports."""
        return device_ref(self.chunk, self.offset, self.nbytes, lease)

    def __del__(self) -> None:
        self.pool._give(self.chunk, self.offset, self.nbytes)


class DevicePool:
    """This process's pool; chunk keys begin with ``pool:<pid>:`` (no shared-memory key or
    client region key looks like that)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunks: list[_Chunk] = []
        self._serials = itertools.count()
        self._blocks: weakref.WeakValueDictionary[tuple[str, int], PoolBlock] = (
            weakref.WeakValueDictionary()
        )
        self.prefix = f"pool:{os.getpid()}:"
        # Blocks that died, given back at the next allocation: a block may die inside a
        # garbage-collector pass anywhere, also while this pool's lock is held.
        self._given: list[tuple[_Chunk, int, int]] = []

    def copy(self, array: Any) -> PoolBlock:
        """A new block holding a device-to-device copy of the device array ``array``."""
        nbytes = int(array.nbytes)
        block = self._allocate(cuda.device_of_array(array), nbytes)
        cuda.copy_into_device(block.view(), array.reshape(-1).view("uint8"))
        return block

    def owns(self, key: str) -> bool:
        return key.startswith(self.prefix)

    def locate(self, array: Any) -> tuple[_Chunk, int] | None:
        """The chunk of ours the device array ``array`` lies in, and its offset there."""
        address, nbytes = cuda.address_of(array), int(array.nbytes)
        for chunk in list(self._chunks):
            offset = address - chunk.address
            if 0 <= offset and offset + nbytes <= chunk.size:
                return chunk, offset
        return None

    def view_of(self, key: str, offset: int, nbytes: int, holder: Any = None) -> Any:
        """A device array over ``nbytes`` at ``offset`` of our chunk ``key`` (memory a peer
        hands back), keeping the live block it lies in (and ``holder``) alive; None if no
        live block holds it."""
        with self._lock:
            blocks = list(self._blocks.items())
        for (block_key, start), block in blocks:
            if block_key == key and start <= offset and offset + nbytes <= start + block.nbytes:
                chunk = block.chunk
                return cuda.device_view(chunk.address + offset, nbytes, chunk.device_id, (block, holder))
        return None

    def _allocate(self, device_id: int, nbytes: int) -> PoolBlock:
        with self._lock:
            while self._given:
                chunk, offset, size = self._given.pop()
                chunk.give(offset, size)
            for chunk in self._chunks:
                if chunk.device_id == device_id:
                    offset = chunk.take(nbytes)
                    if offset is not None:
                        break
            else:
                mine = [c.size for c in self._chunks if c.device_id == device_id]
                grown = min(2 * mine[-1], LAST_CHUNK_BYTES) if mine else FIRST_CHUNK_BYTES
                needed = max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)
                key = f"{self.prefix}{next(self._serials)}"
                try:
                    chunk = _Chunk(key, device_id, max(grown, needed))
                except UnavailableError:
                    if grown <= needed:
                        raise
                    chunk = _Chunk(key, device_id, needed)  # (a nearly full device)
                self._chunks.append(chunk)
                offset = chunk.take(nbytes)
                assert offset is not None
            block = PoolBlock(self, chunk, offset, nbytes)
            self._blocks[(chunk.key, offset)] = block
        return block

    def _give(self, chunk: _Chunk, offset: int, nbytes: int) -> None:
        self._given.append((chunk, offset, nbytes))  # (atomic: no lock, see __init__)


_process_pool: DevicePool | None = None
_process_pool_lock = threading.Lock()


def process_pool() -> DevicePool:
    """This process's pool (made at first use; its chunks are allocated only when needed)."""
    global _process_pool
    with _process_pool_lock:
        if _process_pool is None or not _process_pool.owns(f"pool:{os.getpid()}:"):
            _process_pool = DevicePool()  # (anew in a forked child: the parent's is not its own)
        return _process_pool
