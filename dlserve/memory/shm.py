"""POSIX shared-memory segments mapped without ``multiprocessing.shared_memory``.

``multiprocessing.shared_memory`` registers every segment it opens with Python 3.11's
resource tracker, which unlinks segments it did not create when the process exits
(measured), and its ``close()`` unmaps memory under live numpy/torch views (a
segfault, measured). We open ``/dev/shm/<name>`` ourselves and keep each mapping
for as long as any view can reach it; Python unmaps it when the last reference to
the ``mmap`` goes away.

A view of a byte range is an *anchor*: a ctypes array built over the mapping.
numpy arrays made from an anchor keep it alive through ``.base``, and DLPack
consumers keep those arrays alive through their capsules, so an anchor dies
exactly when the last view of its bytes does. Arenas hang their lifetimes on that.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
from typing import Any

from dlserve.errors import InvalidArgumentError, UnavailableError

SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")


def shm_path(name: str) -> str:
    """Path of segment ``name`` (with or without the leading ``/`` of shm_open)."""
    bare = name[1:] if name.startswith("/") else name
    if not _NAME_RE.match(bare) or bare in (".", ".."):
        raise InvalidArgumentError(f"invalid shared memory key '{name}'")
    return os.path.join(SHM_DIR, bare)


def _anchor_type(nbytes: int) -> type[ctypes.Array[Any]]:
    return ctypes.c_char * nbytes  # ctypes caches array types per length


class Segment:
    """One mapped shared-memory object; the same class serves owner and peers."""

    __slots__ = ("name", "size", "owned", "inode", "_mm", "_skip", "address", "__weakref__")

    def __init__(
        self, name: str, mm: mmap.mmap, owned: bool, skip: int = 0, inode: int = 0
    ) -> None:
        """Wrap ``mm``; the segment's byte 0 is byte ``skip`` of the mapping.

        ``skip`` exists because mappings start on a page boundary while a client's
        registered region may start anywhere inside its shared-memory object.
        """
        self.name = name
        self.size = len(mm) - skip
        self.owned = owned
        self.inode = inode  # tells a re-created object of the same name from the old one
        self._mm = mm
        self._skip = skip
        probe = ctypes.c_char.from_buffer(mm, skip)
        self.address = ctypes.addressof(probe)
        del probe  # a lingering export would pin the mapping forever

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        """Create, size and pre-fault a new segment; fails early if /dev/shm is full."""
        path = shm_path(name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                os.unlink(path)
                raise UnavailableError(
                    f"failed to allocate {size} bytes of shared memory in {SHM_DIR}: "
                    f"{exc.strerror}; in a container, raise --shm-size"
                ) from None
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        return cls(name, mm, owned=True)

    @classmethod
    def open(cls, name: str, offset: int = 0, size: int | None = None) -> Segment:
        """Map an existing segment (read-write) created by another process."""
        path = shm_path(name)
        fd = os.open(path, os.O_RDWR)
        try:
            stat = os.fstat(fd)
            total = stat.st_size
            length = total - offset if size is None else size
            if offset < 0 or length <= 0 or offset + length > total:
                raise InvalidArgumentError(
                    f"shared memory range [{offset}, {offset + max(length, 0)}) is outside "
                    f"the object's {total} bytes"
                )
            page = mmap.ALLOCATIONGRANULARITY
            start = offset - offset % page
            mm = mmap.mmap(fd, length + (offset - start), flags=mmap.MAP_SHARED, offset=start)
        finally:
            os.close(fd)
        return cls(name, mm, owned=False, skip=offset - start, inode=stat.st_ino)

    def anchor(self, offset: int, nbytes: int) -> ctypes.Array[Any]:
        """A new view object over ``[offset, offset + nbytes)`` of this segment."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise InvalidArgumentError(
                f"range [{offset}, {offset + nbytes}) is outside a {self.size}-byte region"
            )
        return _anchor_type(nbytes).from_buffer(self._mm, offset + self._skip)

    def current_size(self) -> int:
        """The object's size now (its owner may have shrunk it since it was mapped)."""
        return self._mm.size() - self._skip

    def unlink(self) -> None:
        """Remove the name; existing mappings stay valid until their views die."""
        try:
            os.unlink(shm_path(self.name))
        except FileNotFoundError:
            pass

