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

Where ``/dev/shm`` cannot hold a new segment (Docker gives containers 64 MiB unless
told ``--shm-size``; Kubernetes and SageMaker often no way to change it), the segment
is a memfd instead: anonymous shared memory, limited only by the process's memory,
named ``<name>@<pid>.<fd>.<inode>`` so that the other processes of the server open it
through ``/proc/<pid>/fd/<fd>`` (and know it is still that memfd). It needs no
clean-up: the kernel frees it once the last process that has it open or mapped lets
go, crashes included. ``DLSERVE_SHM=memfd`` makes every segment a memfd (nothing of
dlserve's in ``/dev/shm`` at all). A client's object that a region is registered on is
held open the same way (``<key>%<pid>.<fd>.<inode>``, :meth:`Segment.pin`).

A *view* (:meth:`Segment.view`) is an anchor through a mapping of its own: private, it
is copy-on-write (reads share the object's pages; a write copies the page it touches,
for that view alone), which is how a worker sees memory it does not own, so that a
model writing into its inputs changes them for itself only, as in Triton, where the
stub has inputs copied into its own memory.

A private view's first read of each page costs a page fault, twice a plain read of the
page (12.5 against 6.0 ms for 64 MiB here), and every request over a client's registered
region used to pay it again through a new mapping. So a private mapping of at least
:data:`SPARE_MIN` bytes whose view dies with no page written (the pages are still the
object's own, and show what its owner writes there later) is kept, a few per segment, for
the next view of the same range, until the segment is forgotten.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import re
import weakref
from stat import S_ISREG
from typing import Any

import numpy as np

from dlserve.errors import InvalidArgumentError, UnavailableError

SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")
# A segment another process of the server holds open: name@pid.fd.inode for a memfd,
# name%pid.fd.inode for a client's object in /dev/shm (see Segment.pin).
_HELD_NAME = re.compile(r"^([A-Za-z0-9_.\-]{1,200})([@%])(\d+)\.(\d+)\.(\d+)$")
BACKING_VARIABLE = "DLSERVE_SHM"  # "memfd": every segment is one; otherwise /dev/shm first
_LOCK_SUFFIX = "_lock"  # see hold_prefix

log = logging.getLogger("dlserve.memory")
_told_fallback = False  # the first memfd a full /dev/shm causes is logged, once per process


def shm_path(name: str) -> str:
    """Path of segment ``name`` (with or without the leading ``/`` of shm_open)."""
    bare = name[1:] if name.startswith("/") else name
    if not _NAME_RE.match(bare) or bare in (".", ".."):
        raise InvalidArgumentError(f"invalid shared memory key '{name}'")
    return os.path.join(SHM_DIR, bare)


def hold_prefix(prefix: str) -> int | None:
    """Mark the /dev/shm segments named ``prefix...`` as a live process's: it holds a lock
    on the empty file ``<prefix>_lock`` (flock: the kernel lets go when the process ends,
    crashes included), which any process sharing /dev/shm can test, whatever PID
    namespace it is in. The descriptor to close after unlinking them; None with nothing
    of dlserve's in /dev/shm (``DLSERVE_SHM=memfd``) or no room there for the file."""
    if os.environ.get(BACKING_VARIABLE) == "memfd":
        return None
    making = shm_path("." + prefix + _LOCK_SUFFIX)  # (a name no sweep reads, until held)
    try:
        fd = os.open(making, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.rename(making, shm_path(prefix + _LOCK_SUFFIX))
    except OSError:
        os.close(fd)
        os.unlink(making)
        return None
    return fd


def abandoned(prefix: str) -> bool:
    """Whether the segments named ``prefix...`` are a dead process's: their lock
    (:func:`hold_prefix`) is there and nobody holds it. Without one nothing tells whose
    they are, and they are left alone."""
    try:
        fd = os.open(shm_path(prefix + _LOCK_SUFFIX), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:  # held
        return False
    finally:
        os.close(fd)


def is_client_object(name: str) -> bool:
    """Whether segment ``name`` is a client's object (:meth:`Segment.pin`), which its
    owner may shrink at any time, rather than dlserve's own."""
    return "%" in name


def _open(name: str) -> int:
    """A descriptor of a peer's segment: in /dev/shm, or through /proc/<pid>/fd/<fd> for
    one a process of the server holds open (if that is still the same object: the
    number may have been reused). One that cannot be opened (its holder is gone, or is
    not dumpable) is UNAVAILABLE."""
    held = _HELD_NAME.match(name)
    if held is None:
        try:
            return os.open(shm_path(name), os.O_RDWR)
        except FileNotFoundError:  # (its owner died, and the server removed what it left)
            raise UnavailableError(f"shared memory segment {name} is gone") from None
    path = f"/proc/{held[3]}/fd/{held[4]}"
    kind = "/memfd:" if held[2] == "@" else f"{SHM_DIR}/"
    try:
        # what the number names now, before opening it: opening a terminal or a
        # device has effects of its own
        if not os.readlink(path).startswith(kind):
            raise UnavailableError(f"shared memory segment {name} is gone")
        fd = os.open(path, os.O_RDWR | os.O_NOCTTY)
    except OSError as exc:
        raise UnavailableError(
            f"cannot open shared memory segment {name} through {path}: {exc.strerror}"
        ) from None
    if os.fstat(fd).st_ino != int(held[5]):  # another object took the number
        os.close(fd)
        raise UnavailableError(f"shared memory segment {name} is gone")
    return fd


def _anchor_type(nbytes: int) -> type[ctypes.Array[Any]]:
    return ctypes.c_char * nbytes  # ctypes caches array types per length


_libc_mmap = ctypes.CDLL(None, use_errno=True).mmap
_libc_mmap.restype = ctypes.c_void_p
_libc_mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
]
_MAP_FIXED = 0x10
# /proc/self/pagemap: a page mapped or swapped, and whether it is the object's own page
_PAGE_TOUCHED = np.uint64(0b11 << 62)
_PAGE_OF_FILE = np.uint64(1 << 61)


# Below this a new mapping costs less than finding a spare one clean (see the module's docstring).
SPARE_MIN = 256 << 10
_SPARES_PER_SEGMENT = 4
# (No lock guards a segment's kept mappings: views die on any thread, inside a garbage
# collection too, and a lock taken there could wait on its own thread or on one waiting
# for MemorySpace's. Each step is one dict operation, which the GIL keeps whole.)
_pagemap: tuple[int, int] = (0, -1)  # (pid, descriptor): opened once per process


def _pagemap_fd() -> int:
    global _pagemap
    pid = os.getpid()
    if _pagemap[0] != pid:  # (a forked child must not read its parent's)
        _pagemap = (pid, os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC))
    return _pagemap[1]


def written(address: int, nbytes: int) -> bool:
    """Whether this process wrote to any page of ``[address, address + nbytes)`` of a
    private view: a page written there is anonymous memory, no longer the object's own
    (/proc/self/pagemap tells them apart). True where that cannot be read."""
    page = mmap.PAGESIZE
    first, end = address // page, (address + nbytes + page - 1) // page
    try:
        raw = os.pread(_pagemap_fd(), 8 * (end - first), 8 * first)
    except OSError:
        return True
    if len(raw) != 8 * (end - first):
        return True
    entries = np.frombuffer(raw, dtype=np.uint64)
    return bool(np.any(((entries & _PAGE_TOUCHED) != 0) & ((entries & _PAGE_OF_FILE) == 0)))


class Segment:
    """One mapped shared-memory object; the same class serves owner and peers."""

    __slots__ = (
        "name", "size", "owned", "inode", "_mm", "_skip", "_start", "address", "_memfd", "_fd",
        "_spares",
        "__weakref__",
    )  # fmt: skip

    def __init__(
        self,
        name: str,
        mm: mmap.mmap,
        owned: bool,
        skip: int = 0,
        inode: int = 0,
        memfd: int | None = None,
        start: int = 0,
    ) -> None:
        """Wrap ``mm``, a mapping of the object from its byte ``start``; the segment's
        byte 0 is byte ``skip`` of the mapping.

        ``skip`` exists because mappings start on a page boundary while a client's
        registered region may start anywhere inside its shared-memory object.
        """
        self.name = name
        self.size = len(mm) - skip
        self.owned = owned
        self.inode = inode  # tells a re-created object of the same name from the old one
        self._mm = mm
        self._skip = skip
        self._start = start
        self._memfd = memfd  # the owner's descriptor of a memfd segment, open until unlink
        self._fd: int | None = None  # for views (see view), opened at the first
        # clean private mappings for reuse, by (start, length) in the object; None once
        # the segment is forgotten (see the module's docstring)
        self._spares: dict[tuple[int, int], mmap.mmap] | None = {}
        probe = ctypes.c_char.from_buffer(mm, skip)
        self.address = ctypes.addressof(probe)
        del probe  # a lingering export would pin the mapping forever

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        """Create, size and pre-fault a new segment: in /dev/shm, or a memfd where
        /dev/shm cannot hold it (see the module's docstring). The memory is
        reserved now, so a full machine fails here, not with a SIGBUS later."""
        path = shm_path(name)
        if os.environ.get(BACKING_VARIABLE) == "memfd":
            return cls._create_memfd(name, size, "")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError:
            raise
        except OSError as exc:  # no /dev/shm, or not ours to write
            return cls._create_memfd(name, size, f"{SHM_DIR}: {exc.strerror}")
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                os.unlink(path)
                return cls._create_memfd(name, size, f"{SHM_DIR}: {exc.strerror}")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        return cls(name, mm, owned=True)

    @classmethod
    def _create_memfd(cls, name: str, size: int, why_not_shm: str) -> Segment:
        global _told_fallback
        if why_not_shm and not _told_fallback:
            _told_fallback = True
            log.warning(
                "a %d-byte shared memory segment does not fit in %s; using memfd segments "
                "instead (a larger --shm-size puts them back in /dev/shm)", size, why_not_shm
            )
        fd = -1
        try:
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            shm = f" (nor in {why_not_shm})" if why_not_shm else ""
            raise UnavailableError(
                f"failed to allocate {size} bytes of shared memory: {exc.strerror}{shm}"
            ) from None
        inode = os.fstat(fd).st_ino
        return cls(f"{name}@{os.getpid()}.{fd}.{inode}", mm, owned=True, inode=inode, memfd=fd)

    @classmethod
    def open(cls, name: str, offset: int = 0, size: int | None = None) -> Segment:
        """Map an existing segment (read-write) created by another process."""
        fd = _open(name)
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
        return cls(name, mm, owned=False, skip=offset - start, inode=stat.st_ino, start=start)

    @classmethod
    def pin(cls, key: str) -> Segment:
        """Map a client's object in /dev/shm and hold it open for as long as this
        segment lives, under a name the server's other processes open it by (through
        /proc/<pid>/fd/<fd>) that keeps meaning that object: its owner may remove it,
        or create another under the same key, and a region registered on it still
        means it, as in Triton, which maps a region once too."""
        bare = key[1:] if key.startswith("/") else key
        # Not through a symbolic link (shm_open's O_NOFOLLOW): a link in /dev/shm would
        # map any file the server may open.
        fd = os.open(shm_path(key), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            stat = os.fstat(fd)
            if not S_ISREG(stat.st_mode):
                raise OSError(errno.EINVAL, "not a shared memory object")
            if stat.st_size == 0:
                raise InvalidArgumentError(f"shared memory object '{key}' is empty")
            mm = mmap.mmap(fd, stat.st_size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        segment = cls(f"{bare}%{os.getpid()}.{fd}.{stat.st_ino}", mm, owned=False, inode=stat.st_ino)
        weakref.finalize(segment, os.close, fd)
        return segment

    def anchor(self, offset: int, nbytes: int) -> ctypes.Array[Any]:
        """A new view object over ``[offset, offset + nbytes)`` of this segment."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise InvalidArgumentError(
                f"range [{offset}, {offset + nbytes}) is outside a {self.size}-byte region"
            )
        return _anchor_type(nbytes).from_buffer(self._mm, offset + self._skip)

    def view(self, offset: int, nbytes: int, private: bool) -> ctypes.Array[Any]:
        """A new view object over ``[offset, offset + nbytes)`` through a mapping of its
        own, shared or private (see the module's docstring), unmapped when the view dies."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise InvalidArgumentError(
                f"range [{offset}, {offset + nbytes}) is outside a {self.size}-byte region"
            )
        position = self._start + self._skip + offset  # in the object
        start = position - position % mmap.ALLOCATIONGRANULARITY
        length = position - start + max(nbytes, 1)
        spare = private and length >= SPARE_MIN
        mm = self._take_spare(start, length) if spare else None
        if mm is None:
            # (a private view is not pre-faulted: that would copy every page)
            flags = mmap.MAP_PRIVATE if private else mmap.MAP_SHARED | mmap.MAP_POPULATE
            mm = mmap.mmap(self._descriptor(), length, flags=flags, offset=start)
        view = _anchor_type(nbytes).from_buffer(mm, position - start)
        view.mapping = (ctypes.addressof(view) - (position - start), length, start)
        if spare:
            weakref.finalize(view, self._keep_spare, mm, view.mapping).atexit = False
        return view

    def _take_spare(self, start: int, length: int) -> mmap.mmap | None:
        spares = self._spares
        return None if spares is None else spares.pop((start, length), None)

    def _keep_spare(self, mm: mmap.mmap, mapping: tuple[int, int, int]) -> None:
        """A private view died: keep its mapping for the next view of its range if no
        page of it was written (and the segment is still in use), else let it go."""
        address, length, start = mapping
        spares = self._spares
        if spares is None or written(address, length):
            return
        if len(spares) >= _SPARES_PER_SEGMENT:
            spares.clear()  # (the ranges in use have changed: start again)
        spares.setdefault((start, length), mm)

    def drop_spares(self) -> None:
        """Let go of the mappings kept for reuse, and keep none from now on: the segment
        is forgotten, and a mapping of it would keep its memory from being freed. (Each
        is unmapped once the last export of it goes: the view that died last may not have
        let go of its own yet.)"""
        self._spares = None

    def make_private(self, view: ctypes.Array[Any]) -> None:
        """Turn a shared view copy-on-write where it is: arrays over it keep their
        addresses, and what is written through them from now on stays this process's own."""
        address, length, start = view.mapping
        flags = mmap.MAP_PRIVATE | _MAP_FIXED
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        if _libc_mmap(address, length, prot, flags, self._descriptor(), start) != address:
            error = ctypes.get_errno()
            raise UnavailableError(f"cannot remap shared memory: {os.strerror(error)}")

    def _descriptor(self) -> int:
        """A descriptor of the object, for views: opened once, closed with the segment."""
        if self._fd is None:
            fd = os.dup(self._memfd) if self._memfd is not None else _open(self.name)
            if self.inode and os.fstat(fd).st_ino != self.inode:
                os.close(fd)
                raise UnavailableError(f"shared memory segment {self.name} is gone")
            self._fd = fd
            weakref.finalize(self, os.close, fd)
        return self._fd

    def current_size(self) -> int:
        """The object's size now (its owner may have shrunk it since it was mapped)."""
        return self._mm.size() - self._skip

    def unlink(self) -> None:
        """Remove the name; existing mappings stay valid until their views die."""
        if "@" in self.name:  # closing the owner's descriptor is a memfd's unlink
            fd, self._memfd = self._memfd, None
            if fd is not None:
                os.close(fd)
            return
        try:
            os.unlink(shm_path(self.name))
        except FileNotFoundError:
            pass

