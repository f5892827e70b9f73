"""Client shared memory for ``--shared-memory system|cuda``.

One segment per process holds every distinct request's inputs and one area per output
(``--output-shared-memory-size`` bytes; like perf_analyzer, all requests in flight share
the output areas — their contents are not read, except with ``validation_data``, where
each distinct request has areas of its own). The segment is registered as ONE region
and tensors are addressed inside it with ``shared_memory_offset``.

System memory is a POSIX segment (``/dev/shm``); CUDA memory is a cupy allocation whose
``cudaIpcMemHandle`` is registered (only when cupy and a CUDA device are present).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from typing import Any

ALIGN = 64


@dataclasses.dataclass(frozen=True)
class ShmRef:
    region: str
    offset: int
    byte_size: int


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Layout:
    """Offsets of input blobs and output areas in one region."""

    def __init__(self) -> None:
        self.size = 0
        self.blobs: list[tuple[int, bytes]] = []

    def add_blob(self, data: bytes) -> tuple[int, int]:
        offset = self.size
        self.blobs.append((offset, data))
        self.size = offset + _aligned(max(len(data), 1))
        return offset, len(data)

    def add_area(self, nbytes: int) -> tuple[int, int]:
        offset = self.size
        self.size = offset + _aligned(max(nbytes, 1))
        return offset, nbytes


class SystemRegion:
    """A POSIX shared-memory segment filled with a :class:`Layout`'s blobs."""

    kind = "system"

    def __init__(self, layout: Layout) -> None:
        from multiprocessing import shared_memory

        self.name = f"perf_client_{os.getpid()}_{secrets.token_hex(4)}"
        self.key = "/" + self.name
        self.byte_size = max(layout.size, ALIGN)
        self._shm = shared_memory.SharedMemory(name=self.name, create=True, size=self.byte_size)
        for offset, data in layout.blobs:
            self._shm.buf[offset : offset + len(data)] = data

    def read(self, offset: int, size: int) -> bytes:
        assert self._shm is not None
        return bytes(self._shm.buf[offset : offset + size])

    def close(self) -> None:
        shm, self._shm = self._shm, None
        if shm is None:
            return
        try:
            shm.close()
        finally:
            try:
                shm.unlink()
            except FileNotFoundError:
                pass


class CudaRegion:
    """Device memory (cupy) filled with a :class:`Layout`'s blobs; registered by IPC handle."""

    kind = "cuda"

    def __init__(self, layout: Layout, device_id: int = 0) -> None:
        import cupy
        import numpy as np

        self.name = f"perf_client_{os.getpid()}_{secrets.token_hex(4)}"
        self.device_id = device_id
        self.byte_size = max(layout.size, ALIGN)
        with cupy.cuda.Device(device_id):
            self._memory: Any = cupy.cuda.alloc(self.byte_size)
            for offset, data in layout.blobs:
                host = np.frombuffer(data, dtype=np.uint8)
                (self._memory + offset).copy_from_host(host.ctypes.data, host.nbytes)
            self.raw_handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(self._memory.ptr))

    def close(self) -> None:
        self._memory = None


def make_region(kind: str, layout: Layout) -> SystemRegion | CudaRegion:
    return SystemRegion(layout) if kind == "system" else CudaRegion(layout)
