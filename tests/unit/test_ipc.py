"""dlserve.ipc.protocol (frames) and dlserve.ipc.tensors (Peer: tensors across processes).

The two Peers live in one process but are set up as two processes would be: each side
has its own MemorySpace and Arena, and maps the other's segments by name.
"""

from __future__ import annotations

import ctypes
import gc
import glob
import marshal
import os
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from dlserve.errors import InternalError
from dlserve.ipc.protocol import HEADER, MAX_FRAME, FrameBuffer, Kind, decode, encode
from dlserve.ipc.tensors import INLINE_MAX, Peer
from dlserve.memory.arena import Arena, MemorySpace
from dlserve.memory.dlpack import exposed
from dlserve.memory.dtypes import DataType
from dlserve.memory.tensor import Tensor


def ptr(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


# -- protocol ------------------------------------------------------------------------------

MESSAGES = [
    (Kind.EXECUTE, 7, [("id", 0, 0, 0, "{}", ["OUT"], [("IN", 11, (4,), b"\x00" * 16)])]),
    (Kind.REPLY, 7, [([("OUT", 11, (2, 2), ("seg_0", 128, 4096, 3))], None, "{}")]),
    (Kind.ERROR, 3, (3, "bad input é")),
    (Kind.RELEASE, 0, [1, 2, 3]),
    (Kind.RETIRE, 0, ["seg_1"]),
    (Kind.LOG, 0, (1, "warning line", "model.py", 12)),
    (Kind.INIT, 1, {"args": {"model_name": "m"}, "float": 1.5, "none": None, "neg": -(2**40)}),
    (Kind.FINALIZE, 9, None),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: Kind.name_of(m[0]))
def test_encode_decode_round_trip(message):
    kind, corr, body = message
    frame = encode(kind, corr, body)
    (length,) = HEADER.unpack_from(frame, 0)
    assert length == len(frame) - 4
    decoded = decode(frame[4:])
    assert decoded == (int(kind), corr, body)
    assert type(decoded[0]) is int
    assert decode(memoryview(frame)[4:]) == decoded


def test_frame_is_little_endian_length_then_marshal():
    frame = encode(Kind.RELEASE, 0, [5, 6])
    length = int.from_bytes(frame[:4], "little")
    assert length == len(frame) - 4
    assert marshal.loads(frame[4:]) == (20, 0, [5, 6])


def test_encode_refuses_objects_marshal_cannot_carry():
    with pytest.raises(ValueError):
        encode(Kind.REPLY, 1, object())


def all_frames() -> bytes:
    return b"".join(encode(*m) for m in MESSAGES)


def expected() -> list[tuple]:
    return [(int(k), c, b) for k, c, b in MESSAGES]


def test_frame_buffer_byte_by_byte():
    fb = FrameBuffer()
    out = []
    for byte in all_frames():
        out.extend(fb.feed(bytes([byte])))
    assert out == expected()
    assert fb.feed(b"") == []


def test_frame_buffer_all_at_once():
    assert FrameBuffer().feed(all_frames()) == expected()


@pytest.mark.parametrize("chunk", [2, 3, 5, 7, 64, 1000])
def test_frame_buffer_arbitrary_chunks(chunk):
    data = all_frames()
    fb = FrameBuffer()
    out = []
    for i in range(0, len(data), chunk):
        out.extend(fb.feed(data[i : i + chunk]))
    assert out == expected()


def test_frame_buffer_keeps_a_partial_frame_between_feeds():
    first, second = encode(Kind.RELEASE, 0, [1]), encode(Kind.RELEASE, 0, [2])
    fb = FrameBuffer()
    assert fb.feed(first + second[:6]) == [(20, 0, [1])]
    assert fb.feed(second[6:]) == [(20, 0, [2])]


def test_frame_buffer_header_alone_yields_nothing_yet():
    fb = FrameBuffer()
    frame = encode(Kind.REPLY, 1, None)
    assert fb.feed(frame[:4]) == []
    assert fb.feed(frame[4:]) == [(1, 1, None)]


def test_frame_buffer_rejects_oversize_frames():
    fb = FrameBuffer()
    with pytest.raises(ValueError, match="exceeds the"):
        fb.feed(HEADER.pack(MAX_FRAME + 1))
    # Exactly the limit is allowed (it just waits for the payload).
    assert FrameBuffer().feed(HEADER.pack(MAX_FRAME) + b"x") == []


# -- Peer ----------------------------------------------------------------------------------


@dataclass
class Side:
    space: MemorySpace
    arena: Arena
    peer: Peer
    sent: list[list[int]]  # what send_releases received, call by call


@pytest.fixture
def sides() -> Iterator[tuple[Side, Side]]:
    prefix = f"dlserve_{os.getpid()}_test_{uuid.uuid4().hex[:12]}"
    made = []
    for role in ("s", "w"):
        space = MemorySpace()
        arena = Arena(space, f"{prefix}_{role}", initial_size=1 << 20, growth_size=1 << 20)
        sent: list[list[int]] = []
        peer = Peer(space, arena, sent.append, copy_on_write=role == "w")  # (as a worker's)
        made.append(Side(space, arena, peer, sent))
    yield made[0], made[1]
    for side in made:
        side.peer.close()
        side.arena.close()
    leaked = glob.glob(f"/dev/shm/{prefix}*")
    if leaked:
        gc.collect()
        leaked = glob.glob(f"/dev/shm/{prefix}*")
    for path in leaked:
        os.unlink(path)
    assert not leaked, f"shared memory left behind: {leaked}"


def leases_sent(side: Side) -> list[int]:
    return [lease for call in side.sent for lease in call]


def mappings(segment: str) -> int:
    """How many mappings of a segment (in /dev/shm, or a memfd) this process has."""
    name = re.escape(segment.split("@")[0])
    with open("/proc/self/maps") as maps:
        return sum(bool(re.search(rf"[/:]{name}( \(deleted\))?$", line.rstrip())) for line in maps)


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(16, dtype=np.float32),
        np.arange(INLINE_MAX // 8, dtype=np.int64).reshape(2, -1),  # exactly INLINE_MAX bytes
        np.zeros((0, 3), dtype=np.int32),
        np.array(3.5, dtype=np.float64),
        np.array([True, False]),
    ],
    ids=["small", "at-limit", "empty", "scalar", "bool"],
)
def test_small_tensors_travel_inline_and_import_writable(sides, arr):
    server, worker = sides
    wire = server.peer.export("X", Tensor.from_numpy(arr))
    name, dtype, shape, ref = wire
    assert (name, dtype, shape) == ("X", int(DataType.from_numpy(arr.dtype)), arr.shape)
    assert type(ref) is bytes and ref == arr.tobytes()
    assert server.peer.lease_count == 0
    assert server.arena.bytes_in_use == 0  # nothing copied to shared memory
    got_name, tensor = worker.peer.import_(wire)
    out = tensor.as_numpy()
    assert got_name == "X" and out.dtype == arr.dtype and out.shape == arr.shape
    assert out.tolist() == arr.tolist()
    assert out.flags.writeable
    if out.size:
        out.reshape(-1)[0] = out.reshape(-1)[-1]  # writable like shared memory
    del tensor, out
    assert worker.sent == []  # inline data has no lease to return


def test_inline_tensors_survive_marshal(sides):
    server, worker = sides
    wire = server.peer.export("X", Tensor.from_numpy(np.arange(4, dtype=np.int16)))
    wire = decode(encode(Kind.EXECUTE, 1, wire)[4:])[2]
    _, tensor = worker.peer.import_(wire)
    assert tensor.as_numpy().tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("count", [4, INLINE_MAX], ids=["inline", "by-reference"])
def test_a_shape_set_as_a_list_arrives_as_a_tuple(sides, count):
    """tritonserver's Tensor lets its user set ``shape`` to a list; the peer gets a tuple,
    as every tensor it makes has (batch shapes are compared as tuples)."""
    server, worker = sides
    tensor = Tensor.from_numpy(np.zeros(count, np.float32))
    tensor.shape = [2, count // 2]
    wire = decode(encode(Kind.EXECUTE, 1, server.peer.export("X", tensor))[4:])[2]
    _, received = worker.peer.import_(wire)
    assert type(received.shape) is tuple and received.shape == (2, count // 2)
    assert received.as_numpy().shape == (2, count // 2)
    del received


def test_large_tensor_travels_by_reference_with_a_lease(sides):
    server, worker = sides
    arr = np.arange(INLINE_MAX // 4 + 1, dtype=np.float32)  # one element past inline
    wire = server.peer.export("BIG", Tensor.from_numpy(arr))
    name, dtype, shape, ref = wire
    segment, offset, nbytes, lease = ref
    assert segment == f"{server.arena.prefix}_0"
    assert nbytes == arr.nbytes and lease >= 1 and offset % 64 == 0
    assert server.peer.lease_count == 1
    assert server.arena.bytes_in_use >= arr.nbytes  # copied once into the arena

    wire = decode(encode(Kind.EXECUTE, 1, wire)[4:])[2]  # what really crosses
    _, tensor = worker.peer.import_(wire)
    view = tensor.as_numpy()
    assert view.dtype == np.float32 and view.shape == arr.shape
    assert view.tolist() == arr.tolist()
    assert view.flags.writeable
    # It is the server's block, mapped by the worker copy-on-write: a write stays the worker's.
    view[0] = -1.0
    held = server.space.find(server.space.segment(segment), offset, nbytes)
    assert held is not None
    assert np.frombuffer(held, dtype=np.float32)[0] == 0.0 and view[0] == -1.0


def test_releasing_the_importers_views_returns_the_lease(sides):
    server, worker = sides
    wire = server.peer.export("BIG", Tensor.from_numpy(np.ones(5000, dtype=np.float32)))
    lease = wire[3][3]
    _, tensor = worker.peer.import_(wire)
    view = tensor.as_numpy()[10:20]
    del tensor
    assert worker.sent == []  # a view is still alive
    del view
    assert worker.sent == [[lease]]
    # The channel would carry it back; the exporter drops its hold.
    assert server.peer.lease_count == 1
    assert server.arena.bytes_in_use == 20032  # 5000 * 4 bytes, rounded to 64
    server.peer.release(leases_sent(worker))
    assert server.peer.lease_count == 0
    assert server.arena.bytes_in_use == 0  # the copy is freed
    server.peer.release([lease, 999])  # unknown or repeated leases are ignored


def test_each_export_gets_its_own_lease(sides):
    server, worker = sides
    big = Tensor.from_numpy(np.ones(3000, dtype=np.float32))
    wires = [server.peer.export(f"T{i}", big) for i in range(3)]
    leases = [w[3][3] for w in wires]
    assert len(set(leases)) == 3 and server.peer.lease_count == 3
    imported = [worker.peer.import_(w)[1] for w in wires]
    del imported
    assert sorted(leases_sent(worker)) == sorted(leases)
    server.peer.release(leases_sent(worker))
    assert server.peer.lease_count == 0


def test_tensor_already_in_shared_memory_is_not_copied(sides):
    server, worker = sides
    anchor = server.arena.allocate(16384)
    arr = np.frombuffer(anchor, dtype=np.float64)
    arr[:] = np.arange(2048)
    used = server.arena.bytes_in_use
    wire = server.peer.export("IN", Tensor.from_numpy(arr[1024:]))
    segment, offset, nbytes, lease = wire[3]
    assert server.arena.bytes_in_use == used  # no copy
    assert (segment, offset, nbytes) == (anchor.segment.name, anchor.offset + 8192, 8192)
    _, tensor = worker.peer.import_(wire)
    assert tensor.as_numpy().tolist() == list(range(1024, 2048))


def test_lease_zero_round_trip_resolves_to_the_owners_memory(sides):
    server, worker = sides
    arr = np.arange(4096, dtype=np.float32)
    wire = server.peer.export("IN", Tensor.from_numpy(arr))
    segment, offset, nbytes, lease = wire[3]
    held = server.space.find(server.space.segment(segment), offset, nbytes)
    server_address = ctypes.addressof(held)
    del held

    # The worker (an identity model) sends a view of what it received straight back.
    _, received = worker.peer.import_(wire)
    back = worker.peer.export("OUT", Tensor.from_numpy(received.as_numpy()[1024:]))
    b_segment, b_offset, b_nbytes, b_lease = back[3]
    assert (b_segment, b_offset, b_nbytes, b_lease) == (segment, offset + 4096, 3 * 4096, 0)
    assert worker.peer.lease_count == 0  # no new hold for memory the server owns
    assert worker.arena.bytes_in_use == 0  # and no copy

    _, returned = server.peer.import_(back)
    out = returned.as_numpy()
    assert ptr(out) == server_address + 4096  # the server's own block, no copy
    assert out.tolist() == arr[1024:].tolist()
    assert server.peer.lease_count == 1

    # The worker lets go; the server's returned view keeps its block alive.
    del received
    assert worker.sent == [[lease]]
    server.peer.release(leases_sent(worker))
    assert server.peer.lease_count == 0
    assert out[0] == 1024.0
    assert server.arena.bytes_in_use == 4096 * 4
    del returned, out
    assert server.arena.bytes_in_use == 0


def test_lease_zero_for_memory_no_longer_held_is_an_internal_error(sides):
    server, worker = sides
    wire = server.peer.export("IN", Tensor.from_numpy(np.zeros(2048, dtype=np.float32)))
    segment, offset, nbytes, _ = wire[3]
    server.peer.release([wire[3][3]])  # nothing holds the block any more
    with pytest.raises(InternalError, match="no longer held"):
        server.peer.import_(("OUT", int(DataType.FP32), (2048,), (segment, offset, nbytes, 0)))


def test_worker_output_in_its_own_arena(sides):
    server, worker = sides
    anchor = worker.arena.allocate(10000)
    out = np.frombuffer(anchor, dtype=np.uint8)
    out[:] = 7
    wire = worker.peer.export("OUT", Tensor.from_numpy(out))
    segment, offset, nbytes, lease = wire[3]
    assert segment == anchor.segment.name and lease >= 1
    del anchor, out
    assert worker.arena.bytes_in_use == 10048  # held for the server under the lease
    _, got = server.peer.import_(wire)
    assert set(got.as_numpy().tolist()) == {7}
    del got
    assert server.sent == [[lease]]
    worker.peer.release([lease])
    assert worker.arena.bytes_in_use == 0


def test_what_a_worker_writes_into_what_it_received_is_its_own(sides):
    server, worker = sides
    arr = np.arange(8192, dtype=np.float32)  # 32 KiB: eight pages
    wire = server.peer.export("IN", Tensor.from_numpy(arr))
    segment, offset, nbytes, lease = wire[3]
    _, first = worker.peer.import_(wire)
    _, second = worker.peer.import_(wire)  # (as an ensemble's second step, or a BLS callee)
    a = first.as_numpy()
    a[:1024] += 1000  # the first page only
    assert second.as_numpy().tolist() == arr.tolist()
    held = server.space.find(server.space.segment(segment), offset, nbytes)
    assert np.frombuffer(held, np.float32).tolist() == arr.tolist()
    assert mappings(segment) == 4  # the server's, the worker's, and its two views

    # Sent back, what it wrote is copied; what it did not write is referred to, as before.
    changed = worker.peer.export("OUT", Tensor.from_numpy(a))
    assert changed[3][0].startswith(worker.arena.prefix) and changed[3][3] >= 1
    _, got = server.peer.import_(changed)
    assert got.as_numpy().tolist() == (arr + np.repeat([1000, 0], [1024, 7168])).tolist()
    untouched = worker.peer.export("OUT", Tensor.from_numpy(a[2048:]))
    assert untouched[3] == (segment, offset + 8192, nbytes - 8192, 0)
    # A view the producer's array does not lead back to (as one through DLPack) too.
    alias = exposed(ptr(a) + 8192, (6144,), "<f4", a)
    assert worker.peer.export("OUT", Tensor.from_numpy(alias))[3] == untouched[3]

    del first, second, a, alias, got, held
    assert mappings(segment) == 2  # the views are unmapped
    server.peer.release(leases_sent(worker))
    worker.peer.release(leases_sent(server))
    assert server.peer.lease_count == worker.peer.lease_count == 0
    assert server.arena.bytes_in_use == worker.arena.bytes_in_use == 0


def test_an_output_destination_is_written_where_the_server_reads_it(sides):
    server, worker = sides
    anchor = server.arena.allocate(16384)
    destination = Tensor(DataType.UINT8, (16384,), data=np.frombuffer(anchor, np.uint8))
    wire = server.peer.export("OUT", destination, by_reference=True)
    _, imported = worker.peer.import_(wire, shared=True)
    placed = Tensor.from_numpy(np.full(4096, 7.0, np.float32)).write_into(imported.storage())
    assert worker.peer.export("OUT", placed, by_reference=True)[3] == (*wire[3][:3], 0)
    assert set(np.frombuffer(anchor, np.float32).tolist()) == {7.0}


def test_a_block_a_worker_sent_is_sent_as_it_was_whatever_it_writes_next(sides):
    """pb_utils.Tensor.empty: one buffer refilled between a decoupled model's sends."""
    server, worker = sides
    view = worker.arena.allocate_apart(16384)
    buffer = np.frombuffer(view, np.float32)
    buffer[:] = 1.0
    used = worker.arena.bytes_in_use
    first = worker.peer.export("OUT", Tensor.from_numpy(buffer))
    assert first[3][:2] == (view.segment.name, view.offset)  # by reference, not copied
    assert worker.arena.bytes_in_use == used
    buffer[:] = 2.0
    second = worker.peer.export("OUT", Tensor.from_numpy(buffer))
    assert second[3][:2] != first[3][:2]  # a copy
    got = [server.peer.import_(wire)[1].as_numpy() for wire in (first, second)]
    assert [set(values.tolist()) for values in got] == [{1.0}, {2.0}]

    del view, buffer, got
    server.peer.release(leases_sent(worker))
    worker.peer.release(leases_sent(server))
    assert worker.arena.bytes_in_use == 0


@pytest.mark.parametrize("size", [3, 500], ids=["inline", "by-reference"])
def test_bytes_tensors_both_ways(sides, size):
    server, worker = sides
    items = np.array([f"item-{i}".encode() + b"\x00\xff" for i in range(size)], dtype=object).reshape(-1, 1)
    wire = server.peer.export("B", Tensor.from_numpy(items))
    assert wire[1] == int(DataType.BYTES) and wire[2] == (size, 1)
    assert (type(wire[3]) is bytes) == (size == 3)
    _, received = worker.peer.import_(wire)
    assert received.data_type is DataType.BYTES
    assert received.to_bytes_array().tolist() == items.tolist()
    # And back from the worker, as a new BYTES output built from the decoded objects.
    reply = worker.peer.export("B2", Tensor.from_numpy(received.to_bytes_array()[::-1].copy()))
    _, back = server.peer.import_(reply)
    assert back.shape == (size, 1)
    assert back.to_bytes_array().tolist() == items[::-1].tolist()
    del received, back
    gc.collect()
    server.peer.release(leases_sent(worker))
    worker.peer.release(leases_sent(server))
    assert server.peer.lease_count == worker.peer.lease_count == 0


def test_import_rejects_a_size_that_does_not_fit_the_shape(sides):
    _, worker = sides
    with pytest.raises(InternalError, match=r"tensor 'X' has 12 bytes, but shape \[4\] of FP32 needs 16"):
        worker.peer.import_(("X", int(DataType.FP32), (4,), b"\x00" * 12))


def test_bf16_and_every_fixed_type_cross(sides):
    import ml_dtypes

    server, worker = sides
    for dtype in [np.uint8, np.int16, np.uint32, np.int64, np.float16, np.float64, ml_dtypes.bfloat16]:
        arr = np.arange(3000).astype(dtype)
        _, got = worker.peer.import_(server.peer.export("X", Tensor.from_numpy(arr)))
        assert got.data_type is DataType.from_numpy(arr.dtype)
        assert got.as_numpy().dtype == arr.dtype
        assert got.as_numpy().tobytes() == arr.tobytes()


def test_close_clears_leases_and_stops_releases(sides):
    server, worker = sides
    big = Tensor.from_numpy(np.ones(4000, dtype=np.float32))
    wire = server.peer.export("A", big)
    server.peer.export("B", big)
    assert server.peer.lease_count == 2
    _, tensor = worker.peer.import_(wire)
    worker.peer.close()
    assert worker.peer.closed
    del tensor
    assert worker.sent == []  # a closed peer sends nothing
    server.peer.close()
    assert server.peer.closed and server.peer.lease_count == 0
    assert server.arena.bytes_in_use == 0  # the holds were the only references


def test_a_message_that_fails_to_build_drops_the_holds_of_its_tensors(sides):
    server, _ = sides
    big = Tensor.from_numpy(np.ones(4000, dtype=np.float32))
    with pytest.raises(RuntimeError):
        with server.peer.exports() as out:
            out.add("A", big)
            out.add("B", big)
            assert server.peer.lease_count == 2
            raise RuntimeError("the third output could not be placed")
    assert server.peer.lease_count == 0  # the peer never saw them: nothing left held for it
    assert server.arena.bytes_in_use == 0
    with server.peer.exports() as out:  # built and sent: the holds stay for the peer
        wire = out.add("A", big)
    assert out.wires == [wire] and server.peer.lease_count == 1


def test_discarded_wires_send_their_leases_back_unmapped(sides):
    server, worker = sides
    big = Tensor.from_numpy(np.ones(4000, dtype=np.float32))
    small = Tensor.from_numpy(np.ones(4, dtype=np.float32))
    wires = [server.peer.export("A", big), server.peer.export("B", small), server.peer.export("C", big)]
    worker.peer.discard(wires)
    assert leases_sent(worker) == [wires[0][3][3], wires[2][3][3]]  # the inline one has none
    server.peer.release(leases_sent(worker))
    assert server.peer.lease_count == 0


def test_a_request_to_a_worker_without_its_channel_names_the_instance():
    """Its channel's end seen, its exit not yet: the error says which stub (it was a
    bare 'worker process is not running')."""
    from dlserve.ipc.channel import WorkerGoneError
    from dlserve.ipc.supervisor import WorkerProcess

    worker = WorkerProcess(
        instance_name="add_sub_0", segment_prefix="unused", arena_bytes=1 << 20,
        space=MemorySpace(), arena=None, on_message=lambda message: None,  # type: ignore[arg-type]
        on_exit=lambda description: None,
    )
    with pytest.raises(WorkerGoneError) as gone:
        worker.call(Kind.EXECUTE, [], lambda reply, error: None)
    assert str(gone.value) == "Stub process 'add_sub_0' is not healthy: its worker process is not running"
