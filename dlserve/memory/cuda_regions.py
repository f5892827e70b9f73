"""Client-registered CUDA shared-memory regions (Triton's CUDA shared-memory extension).

A client allocates device memory, registers its ``cudaIpcMemHandle`` as ``(name,
raw handle, device id, byte_size)``, and points inputs and outputs at ``(region,
offset, size)``. The server opens the handle once, at registration, and closes it
when the region is unregistered (or the server stops).

Inputs are copied from the region into host shared memory once, on their way to the
model, and outputs from host memory into the region once, when the response is
made: models see their inputs in host memory, as Triton's Python backend gives them by
default (``FORCE_CPU_ONLY_INPUT_TENSORS``). Every reference is checked against the
region's size, in the words of :func:`dlserve.memory.regions.check_reference`.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from dlserve.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    NotFoundError,
    UnsupportedError,
)
from dlserve.memory.cuda import IpcMemory, cuda_problem
from dlserve.memory.regions import check_reference


class CudaRegions:
    """The registry of client CUDA shared-memory regions of one server."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[str, tuple[IpcMemory, int]] = {}  # name -> (memory, byte size)

    def __contains__(self, name: object) -> bool:
        return name in self._regions

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
            if name in self._regions:
                raise AlreadyExistsError(f"shared memory region '{name}' already in manager")
            try:
                memory = IpcMemory(raw_handle, device_id)
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(
                    f"failed to register CUDA shared memory region '{name}': {exc}"
                ) from None
            self._regions[name] = (memory, byte_size)

    def unregister(self, name: str | None = None) -> None:
        """Forget one region (``name``) or all; unknown names are no error (as Triton)."""
        with self._lock:
            names = list(self._regions) if name is None else [name]
            removed = [self._regions.pop(n) for n in names if n in self._regions]
        for memory, _ in removed:
            memory.close()

    def status(self, name: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            if name is None:
                found = sorted(self._regions.items())
            elif name in self._regions:
                found = [(name, self._regions[name])]
            else:
                raise NotFoundError(f"Unable to find cuda shared memory region: '{name}'")
        return [
            {"name": n, "device_id": memory.device_id, "byte_size": size} for n, (memory, size) in found
        ]

    def check(self, name: str, offset: int, byte_size: int) -> None:
        """Raise unless ``[offset, offset + byte_size)`` lies inside region ``name``."""
        self._region(name, offset, byte_size)

    def read(self, name: str, offset: int, out: np.ndarray) -> None:
        """``out.nbytes`` bytes at ``offset`` of region ``name`` into ``out`` (host memory)."""
        self._region(name, offset, out.nbytes).read(offset, out)

    def write(self, name: str, offset: int, data: np.ndarray) -> None:
        """``data`` (contiguous host memory) into region ``name`` at ``offset``."""
        self._region(name, offset, data.nbytes).write(offset, data)

    def _region(self, name: str, offset: int, byte_size: int) -> IpcMemory:
        with self._lock:
            found = self._regions.get(name)
        if found is None:
            raise NotFoundError(f"Unable to find shared memory region: '{name}'")
        memory, size = found
        check_reference(name, offset, byte_size, size)
        return memory
