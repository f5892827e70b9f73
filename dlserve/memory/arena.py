"""Shared-memory arenas and the per-process map of every segment a process can see.

An :class:`Arena` belongs to one process, the only one that allocates or frees its
blocks (so no lock ever crosses a process). Blocks are 64-byte aligned because jax
copies unaligned buffers. Growth adds a segment and never remaps a live one; extra
segments that empty out are unlinked again (one is kept as a spare), so a burst
does not pin memory for good.

:class:`MemorySpace` is the process's view of all segments, its own and its peers',
and of every live *anchor* (see :mod:`dlserve.memory.shm`). It answers "does this
numpy array live in shared memory, and which anchor keeps it alive?" — the question
behind every zero-copy hand-off. It keeps track of *views* too (see
:meth:`dlserve.memory.shm.Segment.view`): anchors through mappings of their own.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import mmap
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from dlserve.errors import UnavailableError
from dlserve.memory.copying import copy_bytes
from dlserve.memory.shm import Segment

ALIGNMENT = 64
Anchor = ctypes.Array  # a ctypes char array over shared memory; see shm.py

_MIB = 1 << 20


def _round_up(n: int, to: int = ALIGNMENT) -> int:
    return max(to, (n + to - 1) // to * to)


class _Heap:
    """First-fit free list over one segment with O(1) coalescing."""

    __slots__ = ("segment", "free_at", "free_end", "used")

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.free_at: dict[int, int] = {0: segment.size}  # start -> size
        self.free_end: dict[int, int] = {segment.size: 0}  # end -> start
        self.used = 0

    def take(self, size: int) -> int | None:
        for start, avail in self.free_at.items():
            if avail >= size:
                del self.free_at[start]
                del self.free_end[start + avail]
                if avail > size:
                    self.free_at[start + size] = avail - size
                    self.free_end[start + avail] = start + size
                self.used += size
                return start
        return None

    def give(self, start: int, size: int) -> None:
        self.used -= size
        end = start + size
        prev_start = self.free_end.pop(start, None)
        if prev_start is not None:
            del self.free_at[prev_start]
            start = prev_start
        next_size = self.free_at.pop(end, None)
        if next_size is not None:
            del self.free_end[end + next_size]
            end += next_size
        self.free_at[start] = end - start
        self.free_end[end] = start


class MemorySpace:
    """Every segment this process has mapped, and every live anchor over them."""

    def __init__(self) -> None:
        # Re-entrant: an anchor can die (and retire a segment) from a GC pass that
        # runs while this thread is inside one of our methods.
        self._lock = threading.RLock()
        self._segments: dict[str, Segment] = {}
        self._starts: list[int] = []  # sorted segment base addresses
        self._by_start: dict[int, Segment] = {}
        # segment name -> {anchor id: (offset, nbytes, weakref)}
        self._anchors: dict[str, dict[int, tuple[int, int, weakref.ref[Any]]]] = {}
        self._view_starts: list[int] = []  # sorted addresses of live views
        self._views: dict[int, tuple[int, weakref.ref[Any]]] = {}  # address -> (nbytes, weakref)

    # -- segments -----------------------------------------------------------------
    def add_segment(self, segment: Segment) -> None:
        with self._lock:
            self._segments[segment.name] = segment
            bisect.insort(self._starts, segment.address)
            self._by_start[segment.address] = segment
            self._anchors.setdefault(segment.name, {})

    def known_segment(self, name: str) -> Segment | None:
        return self._segments.get(name)

    def segment(self, name: str) -> Segment:
        """The segment called ``name``, mapping a peer's segment on first use."""
        seg = self._segments.get(name)
        if seg is None:
            seg = Segment.open(name)
            self.add_segment(seg)
        return seg

    def forget_segment(self, name: str) -> None:
        """Stop tracking a segment; live anchors keep its mapping until they die."""
        with self._lock:
            seg = self._segments.pop(name, None)
            if seg is None:
                return
            self._starts.remove(seg.address)
            del self._by_start[seg.address]
            self._anchors.pop(name, None)
        seg.drop_spares()

    def forget_segments(self, prefix: str) -> list[str]:
        """Forget every segment whose name starts with ``prefix``; their names."""
        names = [n for n in self._segments if n.startswith(prefix)]
        for name in names:
            self.forget_segment(name)
        return names

    # -- anchors ------------------------------------------------------------------
    def anchor(
        self,
        segment: Segment,
        offset: int,
        nbytes: int,
        on_death: Callable[[], None] | None = None,
    ) -> Anchor:
        """A tracked view of a segment's bytes; ``on_death`` runs when its last view dies."""
        obj = segment.anchor(offset, nbytes)
        obj.segment = segment
        obj.offset = offset
        key = id(obj)
        table = self._anchors.get(segment.name)
        if table is None:
            table = self._anchors.setdefault(segment.name, {})

        def died(_ref: Any, table: dict[int, Any] = table) -> None:
            table.pop(key, None)
            if on_death is not None:
                on_death()

        table[key] = (offset, nbytes, weakref.ref(obj, died))
        return obj

    def view(
        self,
        segment: Segment,
        offset: int,
        nbytes: int,
        private: bool,
        on_death: Callable[[], None] | None = None,
    ) -> Anchor:
        """A tracked view of a segment's bytes through a mapping of its own, shared or
        private (``view.private`` says which); ``on_death`` runs when its last view dies."""
        obj = segment.view(offset, nbytes, private)
        obj.segment = segment
        obj.offset = offset
        obj.private = private
        address = ctypes.addressof(obj)

        def died(_ref: Any) -> None:
            with self._lock:
                del self._views[address]
                self._view_starts.remove(address)
            if on_death is not None:
                on_death()

        with self._lock:
            bisect.insort(self._view_starts, address)
            self._views[address] = (nbytes, weakref.ref(obj, died))
        return obj

    def make_private(self, view: Anchor) -> None:
        """Turn a shared view copy-on-write (see Segment.make_private)."""
        view.segment.make_private(view)
        view.private = True

    def locate(self, array: np.ndarray) -> tuple[Anchor, int] | None:
        """The live anchor holding ``array``'s bytes and the array's offset in its segment.

        Returns None when the array is not in shared memory (or not C-contiguous),
        in which case it has to be copied to be shared.
        """
        if not array.flags.c_contiguous:
            return None
        base: Any = array
        while isinstance(base, np.ndarray):
            base = base.base
        address = array.__array_interface__["data"][0]
        if isinstance(base, ctypes.Array) and hasattr(base, "segment"):
            return base, base.offset + (address - ctypes.addressof(base))
        with self._lock:
            i = bisect.bisect_right(self._starts, address) - 1
            seg = self._by_start[self._starts[i]] if i >= 0 else None
        if seg is None or address - seg.address + array.nbytes > seg.size:
            return self._in_view(address, array.nbytes)
        offset = address - seg.address
        anchor = self.find(seg, offset, array.nbytes)
        return None if anchor is None else (anchor, offset)

    def _in_view(self, address: int, nbytes: int) -> tuple[Anchor, int] | None:
        """The live view holding ``[address, address + nbytes)``, and that range's
        offset in the view's segment."""
        with self._lock:
            i = bisect.bisect_right(self._view_starts, address) - 1
            if i < 0:
                return None
            start = self._view_starts[i]
            size, ref = self._views[start]
        view = ref()
        if view is None or address + nbytes > start + size:
            return None
        return view, view.offset + (address - start)

    def find(self, segment: Segment, offset: int, nbytes: int) -> Anchor | None:
        """A live anchor of ``segment`` that covers ``[offset, offset + nbytes)``."""
        with self._lock:
            table = list(self._anchors.get(segment.name, {}).values())
        for start, size, ref in table:
            if start <= offset and offset + nbytes <= start + size:
                anchor = ref()
                if anchor is not None:
                    return anchor
        return None


class Arena:
    """The blocks this process owns: segments ``<prefix>_<n>`` carved into aligned blocks."""

    def __init__(
        self,
        space: MemorySpace,
        prefix: str,
        initial_size: int = 16 * _MIB,
        growth_size: int = 16 * _MIB,
        on_retire: Callable[[str], None] | None = None,
    ) -> None:
        """``on_retire(name)`` is told when an emptied extra segment is unlinked, so
        peers that mapped it can drop their mappings too."""
        self.space = space
        self.on_retire = on_retire
        self.prefix = prefix
        self.initial_size = _round_up(initial_size, mmap.PAGESIZE)
        self.growth_size = _round_up(growth_size, mmap.PAGESIZE)
        self._lock = threading.Lock()
        self._heaps: list[_Heap] = []
        self._serial = 0
        self._closed = False
        self._holder = 0  # thread id inside allocate(), see _free
        self._deferred: list[tuple[_Heap, int, int]] = []
        self._grow(self.initial_size)

    def _grow(self, size: int) -> _Heap:
        seg = Segment.create(f"{self.prefix}_{self._serial}", size)
        self._serial += 1
        self.space.add_segment(seg)
        heap = _Heap(seg)
        self._heaps.append(heap)
        return heap

    def allocate(self, nbytes: int) -> Anchor:
        """A new block of at least ``nbytes``; it is freed when its anchor dies."""
        size = _round_up(nbytes)
        with self._holding():
            if self._closed:
                raise UnavailableError("shared memory arena is closed")
            for heap in self._heaps:
                offset = heap.take(size)
                if offset is not None:
                    break
            else:
                heap = self._grow(max(self.growth_size, _round_up(size, mmap.PAGESIZE)))
                offset = heap.take(size)
                assert offset is not None
        return self.space.anchor(
            heap.segment, offset, nbytes, lambda: self._free(heap, offset, size)
        )

    def allocate_apart(self, nbytes: int) -> Anchor:
        """A new block seen through a shared view of its own, for memory its user fills and
        may go on writing after sending it (pb_utils.Tensor.empty): a send by reference
        turns the view copy-on-write (dlserve.ipc.tensors), so the receiver keeps what was
        sent. The block is freed when the view dies."""
        block = self.allocate(nbytes)
        view = self.space.view(block.segment, block.offset, nbytes, private=False)
        view.block = block
        return view

    def copy(self, data: np.ndarray) -> Anchor:
        """A new block holding a copy of ``data``'s bytes (C order)."""
        anchor = self.allocate(data.nbytes)
        if data.nbytes:
            copy_bytes(
                np.frombuffer(anchor, dtype=np.uint8),
                np.ascontiguousarray(data).reshape(-1).view(np.uint8),
            )
        return anchor

    def _free(self, heap: _Heap, offset: int, size: int) -> None:
        if self._holder == threading.get_ident():
            # An anchor died in a GC pass while this thread holds the lock: see _holding.
            self._deferred.append((heap, offset, size))
            return
        with self._holding():
            victim = self._give(heap, offset, size)
        if victim is not None:
            self.space.forget_segment(victim.segment.name)
            victim.segment.unlink()
            if self.on_retire is not None:
                self.on_retire(victim.segment.name)

    @contextlib.contextmanager
    def _holding(self) -> Iterator[None]:
        """The lock, held by this thread: a free that a GC pass starts meanwhile (on this
        thread: both hold it while they allocate objects) is deferred, then done once
        the lock is let go (see _free)."""
        with self._lock:
            self._holder = threading.get_ident()
            try:
                yield
            finally:
                self._holder = 0
            deferred, self._deferred = self._deferred, []
        for args in deferred:
            self._free(*args)

    def _give(self, heap: _Heap, offset: int, size: int) -> _Heap | None:
        """Take a block back (the lock held); the extra segment to retire, if any."""
        heap.give(offset, size)
        if self._closed or heap.used or heap is self._heaps[0]:
            return None
        # Keep one empty extra segment as a spare, so a steady stream of requests
        # that overflow the first segment does not create (and page-fault) a new
        # one each time; a second empty one retires the smaller of the two.
        empty = [h for h in self._heaps[1:] if not h.used]
        if len(empty) < 2:
            return None
        victim = min(empty, key=lambda h: h.segment.size)
        self._heaps.remove(victim)
        return victim

    @property
    def bytes_in_use(self) -> int:
        return sum(h.used for h in self._heaps)

    @property
    def bytes_reserved(self) -> int:
        return sum(h.segment.size for h in self._heaps)

    def close(self) -> None:
        """Unlink every segment; mappings live on until the last view dies."""
        with self._holding():
            self._closed = True
            for heap in self._heaps:
                self.space.forget_segment(heap.segment.name)
                heap.segment.unlink()
            self._heaps.clear()

