"""dlserve.memory.shm and dlserve.memory.arena: segments, anchors, arenas, the memory space.

Everything here maps real POSIX shared memory under /dev/shm; every test uses its own
name prefix and checks that nothing with that prefix is left behind.
"""

from __future__ import annotations

import ctypes
import gc
import glob
import mmap
import os
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from dlserve.errors import InvalidArgumentError, UnavailableError
from dlserve.memory.arena import ALIGNMENT, Arena, MemorySpace
from dlserve.memory.shm import SHM_DIR, SPARE_MIN, Segment, shm_path

PAGE = mmap.PAGESIZE


def shm_entries(prefix: str) -> list[str]:
    return sorted(glob.glob(f"{SHM_DIR}/{prefix}*"))


@pytest.fixture
def prefix() -> Iterator[str]:
    name = f"dlserve_{os.getpid()}_test_{uuid.uuid4().hex[:12]}"
    yield name
    leaked = shm_entries(name)
    if leaked:  # a reference cycle may still hold a view
        gc.collect()
        leaked = shm_entries(name)
    for path in leaked:  # clean up before failing, so one failure does not leak
        os.unlink(path)
    assert not leaked, f"shared memory left behind: {leaked}"


@pytest.fixture
def make_arena(prefix: str) -> Iterator[Callable[..., Arena]]:
    arenas: list[Arena] = []

    def make(space: MemorySpace | None = None, name: str | None = None, **kwargs) -> Arena:
        arena = Arena(space or MemorySpace(), name or prefix, **kwargs)
        arenas.append(arena)
        return arena

    yield make
    for arena in arenas:
        arena.close()


@pytest.fixture
def segment(prefix: str) -> Iterator[Segment]:
    seg = Segment.create(f"{prefix}_seg", 3 * PAGE)
    yield seg
    seg.unlink()


def address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def u8(anchor) -> np.ndarray:
    return np.frombuffer(anchor, dtype=np.uint8)


# -- names ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["../x", "/", "", "a" * 201, "a/b", "..", ".", "/..", "/../x", "x y", "x\x00", "dir/../x", "é"],
    ids=repr,
)
def test_bad_names_are_rejected(name):
    with pytest.raises(InvalidArgumentError, match="invalid shared memory key"):
        shm_path(name)
    with pytest.raises(InvalidArgumentError):
        Segment.create(name, PAGE)
    with pytest.raises(InvalidArgumentError):
        Segment.open(name)


def test_good_names_map_into_dev_shm():
    assert shm_path("abc") == f"{SHM_DIR}/abc"
    assert shm_path("/abc") == f"{SHM_DIR}/abc"  # shm_open's leading slash is accepted
    assert shm_path("a" * 200) == f"{SHM_DIR}/{'a' * 200}"
    assert shm_path("A-z_0.9") == f"{SHM_DIR}/A-z_0.9"
    assert shm_path("...") == f"{SHM_DIR}/..."


def test_create_with_leading_slash(prefix):
    seg = Segment.create(f"/{prefix}_slash", PAGE)
    try:
        assert shm_entries(prefix) == [f"{SHM_DIR}/{prefix}_slash"]
        other = Segment.open(f"/{prefix}_slash")
        assert other.size == PAGE
    finally:
        seg.unlink()
    assert shm_entries(prefix) == []


# -- segments ------------------------------------------------------------------------------


def test_create_makes_a_sized_owned_segment(prefix, segment):
    assert segment.owned
    assert segment.size == 3 * PAGE
    assert segment.address != 0
    assert os.stat(shm_path(segment.name)).st_size == 3 * PAGE
    assert shm_entries(prefix) == [f"{SHM_DIR}/{prefix}_seg"]


def test_create_never_clobbers_an_existing_segment(segment):
    with pytest.raises(FileExistsError):
        Segment.create(segment.name, PAGE)


def test_unlink_removes_the_name_and_is_idempotent(prefix):
    seg = Segment.create(f"{prefix}_u", PAGE)
    seg.unlink()
    assert shm_entries(prefix) == []
    seg.unlink()  # no error the second time


def test_mapping_survives_unlink(prefix):
    seg = Segment.create(f"{prefix}_u", PAGE)
    view = u8(seg.anchor(0, 16))
    seg.unlink()
    view[:] = 7
    assert u8(seg.anchor(0, 16)).tolist() == [7] * 16


def test_anchor_is_a_view_over_the_segment(segment):
    anchor = segment.anchor(128, 64)
    assert isinstance(anchor, ctypes.Array)
    assert len(anchor) == 64
    assert ctypes.addressof(anchor) == segment.address + 128
    u8(anchor)[:] = np.arange(64, dtype=np.uint8)
    again = segment.anchor(128, 64)
    assert u8(again).tolist() == list(range(64))
    assert u8(segment.anchor(100, 40))[28:].tolist() == list(range(12))


def test_writes_visible_through_a_second_mapping(segment):
    peer = Segment.open(segment.name)
    assert not peer.owned
    assert peer.size == segment.size
    assert peer.address != segment.address  # a separate mapping of the same memory
    mine = u8(segment.anchor(PAGE + 5, 10))
    theirs = u8(peer.anchor(PAGE + 5, 10))
    mine[:] = np.frombuffer(b"0123456789", dtype=np.uint8)
    assert theirs.tobytes() == b"0123456789"
    theirs[0] = ord("X")
    assert mine.tobytes() == b"X123456789"


def test_open_a_range_at_an_unaligned_offset(segment):
    u8(segment.anchor(0, segment.size))[:] = np.arange(segment.size, dtype=np.uint64).astype(np.uint8)
    part = Segment.open(segment.name, offset=PAGE + 100, size=50)
    assert part.size == 50
    assert u8(part.anchor(0, 50)).tolist() == [(PAGE + 100 + i) % 256 for i in range(50)]
    with pytest.raises(InvalidArgumentError):
        part.anchor(1, 50)


@pytest.mark.parametrize(
    "offset,size",
    [(-1, None), (0, 0), (0, 3 * PAGE + 1), (3 * PAGE, None), (3 * PAGE - 1, 2), (0, -5)],
)
def test_open_out_of_range_rejected(segment, offset, size):
    with pytest.raises(InvalidArgumentError, match="outside the object's"):
        Segment.open(segment.name, offset=offset, size=size)


def test_open_missing_segment(prefix):
    """Its owner died and the server removed what it left: UNAVAILABLE, naming it."""
    with pytest.raises(UnavailableError, match=f"shared memory segment {prefix}_missing is gone"):
        Segment.open(f"{prefix}_missing")


@pytest.mark.parametrize("offset,nbytes", [(-1, 4), (0, -1), (0, 3 * PAGE + 1), (3 * PAGE, 1), (3 * PAGE - 3, 4)])
def test_out_of_range_anchor_rejected(segment, offset, nbytes):
    with pytest.raises(InvalidArgumentError, match="is outside a"):
        segment.anchor(offset, nbytes)


def test_anchor_up_to_the_last_byte(segment):
    assert len(segment.anchor(3 * PAGE - 4, 4)) == 4
    assert len(segment.anchor(0, 3 * PAGE)) == 3 * PAGE


# -- arena: blocks -------------------------------------------------------------------------


def test_arena_creates_its_first_segment(prefix, make_arena):
    arena = make_arena(initial_size=1000)
    assert shm_entries(prefix) == [f"{SHM_DIR}/{prefix}_0"]
    assert arena.bytes_reserved == PAGE  # rounded up to whole pages
    assert arena.bytes_in_use == 0


def test_every_block_is_64_byte_aligned_and_disjoint(make_arena):
    arena = make_arena(initial_size=1 << 20)
    anchors = [arena.allocate(n) for n in (1, 63, 64, 65, 100, 127, 128, 1000, 3, 4097)]
    spans = []
    for anchor, n in zip(anchors, (1, 63, 64, 65, 100, 127, 128, 1000, 3, 4097)):
        assert len(anchor) == n
        assert ctypes.addressof(anchor) % ALIGNMENT == 0
        assert anchor.offset % ALIGNMENT == 0
        spans.append((anchor.offset, anchor.offset + n))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    # Each block is rounded up to the alignment in the books.
    assert arena.bytes_in_use == sum(max(64, -(-n // 64) * 64) for n in (1, 63, 64, 65, 100, 127, 128, 1000, 3, 4097))
    assert ALIGNMENT == 64


def test_blocks_do_not_share_bytes(make_arena):
    arena = make_arena()
    a, b = arena.allocate(64), arena.allocate(64)
    u8(a)[:] = 1
    u8(b)[:] = 2
    assert set(u8(a).tolist()) == {1}


def test_block_is_freed_when_its_anchor_dies(make_arena):
    arena = make_arena()
    anchor = arena.allocate(1000)
    assert arena.bytes_in_use == 1024
    del anchor
    assert arena.bytes_in_use == 0


def test_numpy_view_keeps_the_block_alive(make_arena):
    arena = make_arena()
    anchor = arena.allocate(256)
    alive = weakref.ref(anchor)
    view = np.frombuffer(anchor, dtype=np.float32)[10:20]
    del anchor
    assert alive() is not None
    assert arena.bytes_in_use == 256
    view[:] = 1.5  # still mapped and writable
    del view
    assert alive() is None
    assert arena.bytes_in_use == 0


def test_dlpack_capsule_keeps_the_block_alive(make_arena):
    arena = make_arena()
    anchor = arena.allocate(128)
    alive = weakref.ref(anchor)
    capsule = np.frombuffer(anchor, dtype=np.uint8).__dlpack__()
    del anchor
    assert alive() is not None and arena.bytes_in_use == 128
    del capsule
    assert alive() is None and arena.bytes_in_use == 0


def test_dlpack_consumer_keeps_the_block_alive(make_arena):
    arena = make_arena()
    anchor = arena.allocate(128)
    alive = weakref.ref(anchor)
    source = np.frombuffer(anchor, dtype=np.int32)
    source[:] = np.arange(32)
    imported = np.from_dlpack(source)
    assert address(imported) == ctypes.addressof(anchor)
    del anchor, source
    assert alive() is not None
    assert imported.tolist() == list(range(32))
    del imported
    assert alive() is None and arena.bytes_in_use == 0


def test_torch_tensor_keeps_the_block_alive(make_arena):
    torch = pytest.importorskip("torch")
    arena = make_arena()
    anchor = arena.allocate(256)
    alive = weakref.ref(anchor)
    tensor = torch.from_dlpack(np.frombuffer(anchor, dtype=np.float32))
    assert tensor.data_ptr() == ctypes.addressof(anchor)
    del anchor
    assert alive() is not None and arena.bytes_in_use == 256
    tensor.fill_(2.0)
    del tensor
    assert alive() is None and arena.bytes_in_use == 0


def test_freed_space_is_reused(make_arena):
    arena = make_arena(initial_size=PAGE)
    first = arena.allocate(PAGE)  # the whole segment
    offset = first.offset
    del first
    again = arena.allocate(PAGE)
    assert again.offset == offset
    assert arena.bytes_reserved == PAGE  # no growth was needed


def test_adjacent_free_blocks_coalesce(make_arena):
    arena = make_arena(initial_size=PAGE)
    a, b, c = arena.allocate(1024), arena.allocate(1024), arena.allocate(2048)
    assert (a.offset, b.offset, c.offset) == (0, 1024, 2048)
    del b
    del a
    big = arena.allocate(2048)  # fits only in the merged hole at 0
    assert big.offset == 0
    assert big.segment is c.segment
    assert arena.bytes_reserved == PAGE


def test_arena_grows_by_extra_segments_when_full(prefix, make_arena):
    arena = make_arena(initial_size=PAGE, growth_size=2 * PAGE)
    first = arena.allocate(PAGE)
    second = arena.allocate(64)
    assert first.segment.name == f"{prefix}_0"
    assert second.segment.name == f"{prefix}_1"
    assert shm_entries(prefix) == [f"{SHM_DIR}/{prefix}_0", f"{SHM_DIR}/{prefix}_1"]
    assert arena.bytes_reserved == 3 * PAGE
    # A block larger than the growth size gets a segment of its own size.
    huge = arena.allocate(5 * PAGE + 1)
    assert huge.segment.name == f"{prefix}_2"
    assert huge.segment.size == 6 * PAGE
    assert arena.bytes_in_use == PAGE + 64 + 5 * PAGE + 64


def test_emptied_extra_segments_are_unlinked_and_reported(prefix, make_arena):
    # One empty extra segment is kept as a spare; a second empty one retires the
    # smaller of the two (unlinked from /dev/shm, on_retire told, space forgets it).
    retired: list[str] = []
    space = MemorySpace()
    arena = make_arena(space, initial_size=PAGE, growth_size=PAGE, on_retire=retired.append)
    keep = arena.allocate(PAGE)  # fills the first segment
    small1 = arena.allocate(100)
    small2 = arena.allocate(100)
    big = arena.allocate(3 * PAGE)
    small_name, big_name = f"{prefix}_1", f"{prefix}_2"
    assert small1.segment.name == small2.segment.name == small_name
    assert big.segment.name == big_name
    small_segment = small1.segment

    view = u8(big)
    del big
    assert retired == []  # the view keeps the block
    view[:] = 3  # still mapped
    del view
    assert retired == []  # the only empty extra segment: kept as the spare
    assert shm_entries(prefix) == [f"{SHM_DIR}/{prefix}_{i}" for i in range(3)]

    del small1
    assert retired == []  # half used
    del small2
    assert retired == [small_name]  # two empty extras: the smaller goes
    assert shm_entries(prefix) == [f"{SHM_DIR}/{prefix}_0", f"{SHM_DIR}/{big_name}"]
    assert arena.bytes_reserved == PAGE + 3 * PAGE
    assert arena.bytes_in_use == PAGE
    # The space no longer tracks the retired segment.
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * 8).from_address(small_segment.address))
    assert space.locate(raw) is None
    assert space.find(small_segment, 0, 1) is None

    # The spare is used before any new segment is made.
    again = arena.allocate(2 * PAGE)
    assert again.segment.name == big_name
    assert len(shm_entries(prefix)) == 2

    # The first segment is never retired, even when empty.
    del keep, again
    assert retired == [small_name]
    assert shm_entries(prefix) == [f"{SHM_DIR}/{prefix}_0", f"{SHM_DIR}/{big_name}"]


def test_close_unlinks_everything_and_views_stay_valid(prefix):
    retired: list[str] = []
    arena = Arena(MemorySpace(), prefix, initial_size=PAGE, growth_size=PAGE, on_retire=retired.append)
    try:
        a = arena.allocate(PAGE)
        b = arena.allocate(8)
        assert len(shm_entries(prefix)) == 2
    finally:
        arena.close()
    assert shm_entries(prefix) == []
    assert arena.bytes_reserved == 0
    view = u8(b)
    view[:] = 9  # the mapping lives on until the last view dies
    assert u8(b).tolist() == [9] * 8
    del a, b, view
    assert retired == []  # close() is not a retirement
    with pytest.raises(UnavailableError, match="closed"):
        arena.allocate(1)
    arena.close()  # idempotent


def test_copy_puts_c_order_bytes_in_a_new_block(make_arena):
    arena = make_arena()
    data = np.arange(12, dtype=np.int16).reshape(3, 4).T  # not C-contiguous
    anchor = arena.copy(data)
    assert len(anchor) == data.nbytes
    assert np.frombuffer(anchor, dtype=np.int16).tolist() == np.ascontiguousarray(data).ravel().tolist()
    data[0, 0] = 99  # a copy, not a view
    assert np.frombuffer(anchor, dtype=np.int16)[0] == 0


# -- memory space --------------------------------------------------------------------------


def test_locate_finds_the_anchor_of_a_slice(make_arena):
    space = MemorySpace()
    arena = make_arena(space)
    keep = arena.allocate(64)  # so the block of interest does not start at offset 0
    anchor = arena.allocate(4096)
    floats = np.frombuffer(anchor, dtype=np.float32)
    for view, byte_offset in [(floats, 0), (floats[100:200], 400), (floats[5:6], 20), (floats.reshape(32, 32)[3:5], 384)]:
        found = space.locate(view)
        assert found is not None
        got_anchor, offset = found
        assert got_anchor is anchor
        assert offset == anchor.offset + byte_offset
        assert ctypes.addressof(anchor.segment.anchor(offset, 1)) == address(view)
    assert keep is not None


def test_locate_via_an_address_uses_the_segment_table(make_arena):
    space = MemorySpace()
    arena = make_arena(space)
    anchor = arena.allocate(1024)
    # Arrays whose base chain does not end in the anchor: memoryview and raw address.
    via_memoryview = np.frombuffer(memoryview(anchor), dtype=np.uint8)[16:32]
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * 32).from_address(ctypes.addressof(anchor) + 64))
    for view, byte_offset in [(via_memoryview, 16), (raw, 64)]:
        found = space.locate(view)
        assert found is not None
        assert found[0] is anchor
        assert found[1] == anchor.offset + byte_offset


def test_locate_torch_tensor_memory(make_arena):
    torch = pytest.importorskip("torch")
    space = MemorySpace()
    arena = make_arena(space)
    anchor = arena.allocate(1024)
    tensor = torch.from_dlpack(np.frombuffer(anchor, dtype=np.float32))[8:16]
    found = space.locate(np.from_dlpack(tensor))
    assert found is not None and found[0] is anchor and found[1] == anchor.offset + 32


def test_locate_returns_none_outside_shared_memory(make_arena):
    space = MemorySpace()
    arena = make_arena(space)
    anchor = arena.allocate(1024)
    assert space.locate(np.zeros(16)) is None
    assert space.locate(np.arange(10)[2:5]) is None
    # Non-contiguous views of arena memory must be copied to be shared.
    floats = np.frombuffer(anchor, dtype=np.float32)
    assert space.locate(floats[::2]) is None
    assert space.locate(floats.reshape(16, 16).T) is None
    # Memory of a segment this space does not know (found by address, not by anchor).
    other = MemorySpace()
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * 16).from_address(ctypes.addressof(anchor)))
    assert other.locate(raw) is None


def test_locate_needs_a_live_anchor_over_the_range(make_arena):
    space = MemorySpace()
    arena = make_arena(space, initial_size=PAGE)
    anchor = arena.allocate(128)
    base = ctypes.addressof(anchor)
    # Memory past the block (free space of the segment): no anchor covers it.
    past = np.ctypeslib.as_array((ctypes.c_uint8 * 64).from_address(base + 256))
    assert space.locate(past) is None
    # Straddling the end of the block is not covered either.
    straddle = np.ctypeslib.as_array((ctypes.c_uint8 * 64).from_address(base + 100))
    assert space.locate(straddle) is None


def test_find(make_arena):
    space = MemorySpace()
    arena = make_arena(space)
    anchor = arena.allocate(256)
    seg = anchor.segment
    start = anchor.offset
    assert space.find(seg, start, 256) is anchor
    assert space.find(seg, start + 10, 100) is anchor
    assert space.find(seg, start + 200, 57) is None  # runs past the block
    assert space.find(seg, start + 300, 4) is None
    del anchor
    assert space.find(seg, start, 1) is None  # dead anchors are gone


def test_anchor_on_death_runs_once_when_the_last_view_dies(segment):
    space = MemorySpace()
    space.add_segment(segment)
    deaths: list[int] = []
    anchor = space.anchor(segment, 64, 32, lambda: deaths.append(1))
    assert anchor.segment is segment and anchor.offset == 64
    assert space.find(segment, 70, 4) is anchor
    view = u8(anchor)
    del anchor
    assert deaths == []
    del view
    assert deaths == [1]
    assert space.find(segment, 70, 4) is None


def test_space_maps_a_peer_segment_by_name_once(make_arena):
    owner_space, peer_space = MemorySpace(), MemorySpace()
    arena = make_arena(owner_space)
    anchor = arena.allocate(64)
    u8(anchor)[:] = 42
    name = anchor.segment.name
    seg = peer_space.segment(name)
    assert not seg.owned
    assert peer_space.segment(name) is seg  # mapped on first use only
    peer_anchor = peer_space.anchor(seg, anchor.offset, 64)
    assert u8(peer_anchor).tolist() == [42] * 64
    found = peer_space.locate(u8(peer_anchor)[8:16])
    assert found is not None and found[0] is peer_anchor
    # Forgetting the segment drops the mapping from the tables, not from live views.
    peer_space.forget_segment(name)
    assert peer_space.find(seg, anchor.offset, 1) is None
    assert u8(peer_anchor)[0] == 42
    peer_space.forget_segment(name)  # unknown names are ignored


def test_forget_segments_by_prefix(segment, prefix):
    space = MemorySpace()
    space.add_segment(segment)
    other = Segment.create(f"{prefix}_other", PAGE)
    try:
        space.add_segment(other)
        space.forget_segments(f"{prefix}_seg")
        assert space.locate(u8(segment.anchor(0, 8))) is None
        keep = space.anchor(other, 0, 8)
        assert space.find(other, 0, 8) is keep
    finally:
        other.unlink()


# -- private views: kept mappings ---------------------------------------------------------
def _present_pages(array: np.ndarray) -> int:
    """How many pages of ``array`` this process's page table maps now (no fault needed)."""
    first = address(array) // PAGE
    count = (array.nbytes + PAGE - 1) // PAGE
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(8 * first)
        entries = np.frombuffer(pagemap.read(8 * count), dtype=np.uint64)
    return int(np.count_nonzero(entries >> np.uint64(63)))


def _mappings_of(segment: Segment) -> int:
    with open("/proc/self/maps") as maps:
        return sum(line.rstrip().endswith(shm_path(segment.name)) for line in maps)


@pytest.fixture
def big_segment(prefix: str) -> Iterator[Segment]:
    seg = Segment.create(f"{prefix}_big", 2 * SPARE_MIN)
    yield seg
    seg.unlink()


def test_a_private_view_read_again_skips_the_page_faults_and_sees_new_writes(big_segment):
    """The mapping of a private view nobody wrote is kept for the next view of its range:
    its pages are mapped already, and they still show what the owner writes there."""
    owner = u8(big_segment.anchor(0, big_segment.size))
    owner[:] = 1
    view = u8(big_segment.view(0, SPARE_MIN, private=True))
    assert _present_pages(view) == 0  # a new mapping: every first read faults
    assert int(view.sum()) == SPARE_MIN
    del view
    owner[:] = 2
    again = u8(big_segment.view(0, SPARE_MIN, private=True))
    assert _present_pages(again) == SPARE_MIN // PAGE
    assert int(again.sum()) == 2 * SPARE_MIN


def test_a_private_view_written_into_is_not_kept(big_segment):
    owner = u8(big_segment.anchor(0, big_segment.size))
    owner[:] = 1
    view = u8(big_segment.view(0, SPARE_MIN, private=True))
    view[7] = 99
    del view
    again = u8(big_segment.view(0, SPARE_MIN, private=True))
    assert _present_pages(again) == 0  # (a new mapping)
    assert again[7] == 1 and owner[7] == 1


def test_small_views_and_other_ranges_get_new_mappings(big_segment):
    for offset, nbytes in ((0, PAGE), (0, SPARE_MIN)):
        view = u8(big_segment.view(offset, nbytes, private=True))
        int(view.sum())
        del view
    small = u8(big_segment.view(0, PAGE, private=True))
    other = u8(big_segment.view(SPARE_MIN, SPARE_MIN, private=True))
    assert _present_pages(small) == 0 and _present_pages(other) == 0


def test_forgetting_a_segment_unmaps_the_mappings_it_kept(big_segment):
    space = MemorySpace()
    space.add_segment(big_segment)
    views = [u8(space.view(big_segment, o, SPARE_MIN, True)) for o in (0, SPARE_MIN)]
    for view in views:
        int(view.sum())
    before = _mappings_of(big_segment)
    del view, views
    assert _mappings_of(big_segment) == before  # kept, for the next views of those ranges
    space.forget_segment(big_segment.name)
    assert _mappings_of(big_segment) == before - 2
    late = u8(big_segment.view(0, SPARE_MIN, private=True))  # still works, just not kept
    int(late.sum())
    del late
    assert _mappings_of(big_segment) == before - 2


# -- memfd segments (where /dev/shm cannot hold one) -------------------------------------
def _write_in_another_process(name: str, offset: int, data: bytes) -> None:
    """Open segment ``name`` the way a worker does, in a new process, and write ``data``."""
    import subprocess
    import sys

    code = (
        "import sys; from dlserve.memory.shm import Segment; "
        "s = Segment.open(sys.argv[1]); a = s.anchor(int(sys.argv[2]), len(sys.argv[3])); "
        "a[:] = sys.argv[3].encode()"
    )
    subprocess.run([sys.executable, "-c", code, name, str(offset), data.decode()], check=True)


def test_memfd_segments_live_outside_dev_shm_and_peers_open_them(prefix, monkeypatch):
    monkeypatch.setenv("DLSERVE_SHM", "memfd")
    segment = Segment.create(f"{prefix}_m", 2 * PAGE)
    assert segment.name.startswith(f"{prefix}_m@{os.getpid()}.") and segment.owned
    assert segment.size == 2 * PAGE
    assert shm_entries(prefix) == []  # nothing of it in /dev/shm
    _write_in_another_process(segment.name, PAGE + 3, b"written by a peer")
    view = segment.anchor(PAGE + 3, 17)
    assert bytes(view) == b"written by a peer"
    segment.unlink()
    segment.unlink()  # idempotent, as for /dev/shm names
    with pytest.raises(UnavailableError, match="cannot open shared memory segment"):
        Segment.open(segment.name)  # its descriptor is closed: no peer can open it any more
    assert bytes(view) == b"written by a peer"  # while mappings stay valid
    # Its number, taken by another file now, does not pass for the segment.
    number = int(segment.name.rpartition("@")[2].split(".")[1])
    null = os.open("/dev/null", os.O_RDWR)
    if null != number:
        os.dup2(null, number)
        os.close(null)
    try:
        with pytest.raises(UnavailableError, match="is gone"):
            Segment.open(segment.name)
    finally:
        os.close(number)


def test_a_segment_dev_shm_cannot_hold_becomes_a_memfd(prefix, monkeypatch):
    import logging

    import dlserve.memory.shm as shm

    monkeypatch.setattr(shm, "SHM_DIR", "/nonexistent/dev/shm")
    monkeypatch.setattr(shm, "_told_fallback", False)
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    # (servers started before may have set dlserve's log level and stopped propagation)
    level = shm.log.level
    shm.log.setLevel(logging.WARNING)
    shm.log.addHandler(handler)
    try:
        segment = Segment.create(f"{prefix}_fallback", PAGE)
        second = Segment.create(f"{prefix}_fallback2", PAGE)
    finally:
        shm.log.removeHandler(handler)
        shm.log.setLevel(level)
    second.unlink()
    # said once, naming why, so that an operator knows /dev/shm is too small
    assert len(said) == 1 and "does not fit in /nonexistent/dev/shm" in said[0], said
    try:
        assert "@" in segment.name
        _write_in_another_process(segment.name, 0, b"ok")
        assert bytes(segment.anchor(0, 2)) == b"ok"
    finally:
        segment.unlink()


def test_an_arena_grows_in_memfd_segments(prefix, monkeypatch):
    monkeypatch.setenv("DLSERVE_SHM", "memfd")
    space = MemorySpace()
    arena = Arena(space, prefix, initial_size=PAGE, growth_size=PAGE)
    blocks = [arena.copy(np.full(PAGE, i, dtype=np.uint8)) for i in range(3)]
    names = {block.segment.name for block in blocks}
    assert len(names) == 3 and all("@" in name for name in names)
    for i, block in enumerate(blocks):
        assert space.locate(np.frombuffer(block, dtype=np.uint8)) is not None
        assert bytes(block) == bytes([i]) * PAGE
    del blocks
    arena.close()
    assert shm_entries(prefix) == []


def test_a_memfd_name_from_a_client_is_just_an_invalid_key():
    with pytest.raises(InvalidArgumentError, match="invalid shared memory key"):
        shm_path("region@1.3")  # never read as another process's descriptor


# -- client regions -------------------------------------------------------------------------
def _held_descriptors(path: str) -> int:
    """This process's descriptors open on ``path`` (removed or not)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        count += target in (path, f"{path} (deleted)")
    return count


def test_a_region_holds_its_object_and_lets_go_when_unregistered_or_refused(prefix):
    from dlserve.memory.regions import SystemRegions

    key = f"client_{prefix}"
    path = os.path.join(SHM_DIR, key)
    with open(path, "wb") as f:
        f.write(b"\x01" * PAGE)
    regions = SystemRegions(MemorySpace(), reserved_prefix="dlserve_")
    try:
        regions.register("r", f"/{key}", 0, PAGE)
        assert _held_descriptors(path) > 0  # held open (and mapped) for the workers
        os.unlink(path)  # removed by its owner: the region still reads the object
        assert bytes(regions.view("r", 0, 4)) == b"\x01" * 4
        regions.unregister("r")
        gc.collect()
        assert _held_descriptors(path) == 0
        with open(path, "wb") as f:
            f.write(b"\x02" * PAGE)
        for _ in range(3):  # refused: bigger than the object; nothing is kept for it
            with pytest.raises(InvalidArgumentError, match="outside the"):
                regions.register("big", f"/{key}", 0, 2 * PAGE)
        gc.collect()
        assert _held_descriptors(path) == 0
    finally:
        regions.unregister()
        if os.path.exists(path):
            os.unlink(path)


def test_a_block_freed_by_a_gc_pass_inside_a_free_does_not_deadlock(prefix):
    """A garbage-collection pass may start wherever the free path allocates, with the
    arena's lock held, and free another block of the same arena on the same thread:
    that free waits (it deadlocked on the lock). Tried at every point of the path in
    turn, by the number of allocations before the pass."""
    threshold, enabled = gc.get_threshold(), gc.isenabled()
    stuck = []
    try:
        for allocations in range(1, 40):
            space = MemorySpace()
            arena = Arena(space, f"{prefix}_{allocations}", initial_size=1 << 20, growth_size=1 << 20)

            def free_an_extra_segment() -> None:
                first = np.frombuffer(arena.allocate(1 << 19), np.uint8)  # noqa: F841 (held)
                second = np.frombuffer(arena.allocate(900_000), np.uint8)  # an extra segment
                third = np.frombuffer(arena.allocate(900_000), np.uint8)  # another
                spare = np.frombuffer(arena.allocate(900_000), np.uint8)
                del spare  # its segment is empty: the spare
                gc.collect()
                gc.disable()
                cycle: list = [third]
                cycle.append(cycle)  # only the cycle holds the third block now
                del third, cycle
                gc.set_threshold(allocations)
                gc.enable()
                del second  # empties a second extra segment: one is retired

            thread = threading.Thread(target=free_an_extra_segment, daemon=True)
            thread.start()
            thread.join(5)
            gc.set_threshold(*threshold)
            if thread.is_alive():
                stuck.append(allocations)
                break
            gc.collect()
            arena.close()
    finally:
        gc.set_threshold(*threshold)
        (gc.enable if enabled else gc.disable)()
    assert not stuck, f"deadlocked with a GC pass after {stuck} allocations"
