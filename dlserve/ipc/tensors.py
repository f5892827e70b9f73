"""Tensors crossing a process boundary: by reference into shared memory, or inline if tiny.

A wire tensor is ``(name, data type, shape, ref)`` where ``ref`` is either the bytes
themselves or ``(segment, offset, nbytes, lease)``.

Tensors of at most :data:`INLINE_MAX` bytes travel inline in the control message.
At that size a reference is as long as the data, and the bookkeeping behind a
reference (locate, allocate, anchor, lease, release) costs ~10 µs per tensor
against well under 1 µs to copy the bytes (measured, benchmarks/RESULTS.md), so
"tensor bytes never travel through the socket" holds for every tensor where it
pays: anything bigger always moves by reference.

*Leases* make lifetimes explicit across processes. When a process sends a
reference to memory it keeps alive (its own block, or one it imported from a third
process), it files the anchor under a fresh lease id for that peer; the peer imports
the bytes as its own anchor and, when the last view of it dies, sends the lease id
back in a RELEASE message, which drops the sender's hold. Memory the *receiver* gave
us in the first place goes back with lease 0: the receiver still holds it (under the
lease it granted us) and finds its own anchor by address. So the identity model's
output is its input, returned by reference, with no copy and no new lease.

Bigger tensors that are not in shared memory yet are copied once into the sender's arena.

What a model writes into memory it was sent or has sent stays its own, as in Triton
(whose stub copies inputs in, and outputs out at send). A worker's peer imports
references as private views (copy-on-write: reads share the pages, a write copies the
page it touches); one it sends back is referred to as before unless the model wrote to
it, and then copied. A block of its own that a model sends by reference
(``pb_utils.Tensor.empty``, seen through a view of its own) turns copy-on-write for the
model at the send, so a buffer refilled between sends reaches each receiver as sent.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from dlserve.errors import InternalError, InvalidArgumentError
from dlserve.memory import cuda
from dlserve.memory.arena import ALIGNMENT, Anchor, Arena, MemorySpace
from dlserve.memory.cuda_pool import process_pool
from dlserve.memory.cuda_regions import CudaRef, IpcImports, IpcTable, device_ref, is_cuda_ref
from dlserve.memory.dtypes import DataType
from dlserve.memory.shm import is_client_object, written
from dlserve.memory.tensor import Tensor

INLINE_MAX = 4096
_DATA_TYPES = list(DataType)  # index = enum value; faster than DataType(value)
# index = enum value: the numpy dtype of the type's storage; None where it has none (BYTES)
_STORAGE_DTYPES = [t.storage_dtype if t.itemsize else None for t in _DATA_TYPES]
_UINT8 = np.dtype(np.uint8)
WireTensor = tuple[str, int, tuple[int, ...], Any]


class InlineSlab:
    """Aligned homes for inline tensors, carved from shared 64 KiB buffers.

    Arena blocks are 64-byte aligned; inline tensors must be too, or TensorFlow
    aborts the process (``IsAligned()`` check) and jax silently copies. Carving
    slices out of one buffer costs a fraction of a fresh aligned array per tensor;
    a buffer is freed once every tensor carved from it is gone.
    """

    SIZE = 64 * 1024

    def __init__(self) -> None:
        self._buffer = np.empty(0, dtype=np.uint8)
        self._bytes = memoryview(self._buffer)  # the buffer's bytes, to copy into in one step
        self._position = 0
        self._lock = threading.Lock()  # a worker imports on several threads (BLS, async execute)

    def _reserve(self, size: int) -> tuple[np.ndarray, memoryview, int]:
        """Room for ``size`` bytes: the buffer it is in (as an array and as bytes), and
        where it starts."""
        with self._lock:
            start = self._position
            if start + size > self._buffer.nbytes:
                fresh = np.empty(max(self.SIZE, size + ALIGNMENT), dtype=np.uint8)
                start = -fresh.ctypes.data % ALIGNMENT
                self._buffer = fresh
                self._bytes = memoryview(fresh)
            self._position = start + (size + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
            return self._buffer, self._bytes, start

    def copy(self, data: bytes) -> np.ndarray:
        """A writable, 64-byte aligned copy of ``data``."""
        return self.place(data, _UINT8, (len(data),))

    def place(self, data: bytes, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
        """A writable, 64-byte aligned array of ``dtype`` and ``shape`` holding ``data``,
        whose size the caller checked: made in one step (every small tensor received
        comes through here), not as a uint8 copy then viewed and reshaped."""
        buffer, raw, start = self._reserve(len(data))
        raw[start : start + len(data)] = data
        return np.ndarray(shape, dtype, buffer, start)

    def copy_many(self, chunks: list[bytes]) -> list[np.ndarray]:
        """Copies of ``chunks`` back to back in one aligned region, so that arrays
        made from them can be joined into one view without copying again."""
        buffer, raw, position = self._reserve(sum(len(c) for c in chunks))
        out = []
        for chunk in chunks:
            end = position + len(chunk)
            raw[position:end] = chunk
            out.append(buffer[position:end])
            position = end
        return out


def _inline_tensor(
    slab: InlineSlab, name: str, dtype: int, shape: tuple[int, ...], data: bytes
) -> Tensor:
    """A tensor over a copy of bytes that came inline, checked against its shape."""
    storage = _STORAGE_DTYPES[dtype]
    if storage is None:
        return _tensor(name, dtype, shape, slab.copy(data))
    data_type = _DATA_TYPES[dtype]
    if math.prod(shape) * storage.itemsize != len(data):
        _check_size(name, data_type, shape, len(data))  # (raises, saying so)
    return Tensor._of(data_type, shape, slab.place(data, storage, shape))


def _tensor(name: str, dtype: int, shape: tuple[int, ...], raw: np.ndarray) -> Tensor:
    """A tensor over received bytes, checked against its shape."""
    data_type = _DATA_TYPES[dtype]
    if data_type is DataType.BYTES:
        return Tensor(data_type, shape, data=raw)
    _check_size(name, data_type, shape, raw.nbytes)
    return Tensor(data_type, shape, data=raw.view(data_type.storage_dtype).reshape(shape))


def _check_size(name: str, data_type: DataType, shape: tuple[int, ...], nbytes: int) -> None:
    expected = math.prod(shape) * data_type.itemsize
    if expected != nbytes:
        raise InternalError(
            f"tensor '{name}' has {nbytes} bytes, but shape {list(shape)} of "
            f"{data_type.name} needs {expected}"
        )


def _shrunk() -> InvalidArgumentError:
    return InvalidArgumentError(
        "a shared memory region the request uses was shrunk by its owner; register it again"
    )


class Peer:
    """Our side of the shared-memory bookkeeping with one other process.

    ``send_releases`` is called (from any thread) with lease ids to hand back to the
    peer; the channel decides when and how to ship them. ``copy_on_write``: references
    are imported as private views (a worker's, whose model may write into its inputs).
    """

    def __init__(
        self,
        space: MemorySpace,
        arena: Arena,
        send_releases: Callable[[list[int]], None],
        copy_on_write: bool = False,
        cuda: IpcTable | None = None,
        settle_device: bool = False,
    ) -> None:
        """``cuda``: the mappings of clients' CUDA regions that references may name."""
        self.space = space
        self.cuda = cuda
        self.pool = process_pool()  # our GPU tensors for peers (allocated once one is sent)
        self.pool_imports = IpcImports()  # the peer's pool (and others'), opened as named
        # Whether device memory imported from the peer's pool is copied into ours at once (the
        # server's peers: what the server holds must not depend on a worker staying alive).
        self._settle = settle_device
        self.arena = arena
        self._send_releases = send_releases
        self._copy_on_write = copy_on_write
        self._leases = itertools.count(1)
        self._granted: dict[int, Anchor] = {}  # lease id -> anchor we keep for the peer
        self._slab = InlineSlab()
        self.closed = False

    # -- sending --------------------------------------------------------------------
    def export(self, name: str, tensor: Tensor, by_reference: bool = False) -> WireTensor:
        """Describe ``tensor`` to the peer, copying it into our arena only if needed.

        ``by_reference`` forces a reference even for a tiny tensor: for memory the
        peer must write into, or must recognise as memory it handed out. A GPU
        tensor goes by reference into device memory (see :meth:`_device_ref`); an
        empty one as any empty tensor.
        """
        shape = tensor.shape
        if type(shape) is not tuple:  # (a user may set a list: the peer gets a tuple)
            shape = tuple(shape)
        if tensor.device_array is not None:
            ref = self._device_ref(tensor)
            if ref is not None:
                return (name, int(tensor.data_type), shape, ref)
        data = tensor.storage()
        nbytes = data.nbytes
        if nbytes <= INLINE_MAX and not by_reference:
            return (name, int(tensor.data_type), shape, data.tobytes())
        found = self.space.locate(data)
        if found is not None and getattr(found[0], "private", False):  # (a view, copy-on-write)
            if written(data.__array_interface__["data"][0], nbytes):
                found = None  # what the model wrote is its own: copied
        if found is None:
            anchor = self.arena.copy(data)
            offset = anchor.offset
        else:
            anchor, offset = found
            if getattr(anchor, "private", True) is False:  # (a shared view: Tensor.empty's)
                self.space.make_private(anchor)  # what the model writes next is not sent
        if getattr(anchor, "origin", None) is self:
            lease = 0
        else:
            lease = next(self._leases)
            self._granted[lease] = anchor
        return (name, int(tensor.data_type), shape, (anchor.segment.name, offset, nbytes, lease))

    def _device_ref(self, tensor: Tensor) -> CudaRef | None:
        """A GPU tensor by reference, however small (so that it reaches the peer on its
        GPU): into a client's CUDA region (the server keeps it in use while its request
        runs), or held for the peer under a lease where it is already (our pool, one we
        opened), or copied once, device to device, into a new block of our pool. None for
        an empty one, which travels as any empty tensor does. Work queued on the default
        stream is finished first: the peer's reads are not ordered after it."""
        array = tensor.device_array
        if not array.nbytes:
            return None
        ref = self.cuda.locate(array) if self.cuda is not None else None
        if ref is not None:
            cuda.synchronize_default_stream(cuda.device_of_array(array))
            return ref
        lease = next(self._leases)
        ref = self.pool_imports.locate(array)
        found = None if ref is not None else self.pool.locate(array)
        if ref is None and found is not None:
            chunk, offset = found
            ref = device_ref(chunk, offset, int(array.nbytes), 0)
        if ref is not None:
            cuda.synchronize_default_stream(cuda.device_of_array(array))
            self._granted[lease] = array
            return ref[:-1] + (lease,)
        block = self.pool.copy(array)
        self._granted[lease] = block
        return block.ref(lease)

    def exports(self) -> Exports:
        """Build one message's tensors with ``with peer.exports() as out: out.add(...)``."""
        return Exports(self)

    def revoke(self, wires: list[WireTensor]) -> None:
        """Wires we made that the peer will never see: drop the holds filed for them."""
        self.release(_leases(wires))

    def release(self, leases: list[int]) -> None:
        """The peer no longer uses these leases."""
        granted = self._granted
        for lease in leases:
            granted.pop(lease, None)

    def close(self) -> None:
        """The peer is gone: drop every hold we kept for it, stop sending releases, and
        close our mappings of its device memory (a settling peer holds no view of it)."""
        self.closed = True
        self._granted.clear()
        if self._settle:
            self.pool_imports.forget(self.pool_imports.keys())

    @property
    def lease_count(self) -> int:
        return len(self._granted)

    # -- receiving ------------------------------------------------------------------
    def import_(self, wire: WireTensor, shared: bool = False, host: bool = False) -> tuple[str, Tensor]:
        """``shared``: memory the peer reads what we write into (an output's
        destination), never a private view. ``host``: a tensor in device memory is copied
        into host memory (a model's input, unless it takes GPU inputs)."""
        name, dtype, shape, ref = wire
        if type(ref) is bytes:
            return name, _inline_tensor(self._slab, name, dtype, shape, ref)
        if is_cuda_ref(ref):
            return name, self._import_cuda(name, dtype, shape, ref, host and not shared)
        raw, _ = self._import_ref(ref, shared)
        return name, _tensor(name, dtype, shape, raw)

    def import_many(self, wires: list[WireTensor], host: bool = False) -> list[tuple[str, Tensor]]:
        """Import the same input of several requests of a batch. Inline ones are
        placed back to back, so :func:`pb_utils.join_inputs` can join them as one
        view with no copy. ``host`` as for :meth:`import_`."""
        if len(wires) < 2 or any(type(wire[3]) is not bytes for wire in wires):
            return [self.import_(wire, host=host) for wire in wires]
        raws = self._slab.copy_many([wire[3] for wire in wires])
        return [(w[0], _tensor(w[0], w[1], w[2], raw)) for w, raw in zip(wires, raws)]

    def discard(self, wires: list[WireTensor]) -> None:
        """Received tensors nobody will look at: their leases go straight back, unmapped."""
        leases = _leases(wires)
        if leases and not self.closed:
            self._send_releases(leases)

    def _import_ref(self, ref: tuple[str, int, int, int], shared: bool) -> tuple[np.ndarray, int]:
        segment_name, offset, nbytes, lease = ref
        client_object = is_client_object(segment_name)
        try:
            segment = self.space.segment(segment_name)
        except InvalidArgumentError:  # (emptied before this process first mapped it)
            if not client_object:
                raise
            raise _shrunk() from None
        if client_object and segment.current_size() < offset + nbytes:
            # A client's object, shrunk since its region was checked: touching it is a SIGBUS.
            raise _shrunk()
        if lease:
            returned = functools.partial(self._returned, lease)
            if self._copy_on_write and not shared:
                anchor = self.space.view(segment, offset, nbytes, True, returned)
            else:
                anchor = self.space.anchor(segment, offset, nbytes, returned)
            anchor.origin = self
            return np.frombuffer(anchor, dtype=np.uint8), nbytes
        # Memory we hold for the peer already: find our anchor by address.
        held = self.space.find(segment, offset, nbytes)
        if held is None:
            raise InternalError("worker referred to shared memory that is no longer held")
        start = offset - held.offset
        return np.frombuffer(held, dtype=np.uint8)[start : start + nbytes], nbytes

    def _import_cuda(
        self, name: str, dtype: int, shape: tuple[int, ...], ref: CudaRef, host: bool
    ) -> Tensor:
        """A reference into device memory: a device tensor over it (which gives the lease
        back when it dies; a settling peer's is a copy in its own pool, and the lease goes
        back at once), or with ``host`` its bytes copied once into our arena."""
        key, offset, nbytes, lease = ref[1], ref[5], ref[6], ref[7]
        holder = _LeaseReturn(self, lease, ref[3]) if lease else None
        if self.pool.owns(key):  # ours, handed back: the block is still held for the peer
            view = self.pool.view_of(key, offset, nbytes, holder)
            if view is None:
                raise InternalError("worker referred to device memory that is no longer held")
        elif key.startswith("pool:"):
            view = self.pool_imports.view(ref, holder)
            if self._settle:  # copied into our own pool: the peer's block goes back at once
                view = self.pool.copy(view).view()
        elif self.cuda is not None:
            view = self.cuda.view(ref, holder)
        else:
            raise InternalError(f"tensor '{name}' refers to a CUDA region, which is not shared here")
        data_type = _DATA_TYPES[dtype]
        if data_type is not DataType.BYTES:
            _check_size(name, data_type, shape, int(view.nbytes))
            view = view.view(data_type.storage_dtype).reshape(shape)
        tensor = Tensor(data_type, shape, device_array=view)
        if not host:
            return tensor
        return tensor.write_into(np.frombuffer(self.arena.allocate(tensor.size), dtype=np.uint8))

    def forget_cuda(self, keys: list[str]) -> None:
        """These CUDA mappings are gone (their regions unregistered): close ours."""
        if self.cuda is not None:
            self.cuda.forget(keys)

    def _returned(self, lease: int) -> None:
        if not self.closed:
            self._send_releases([lease])


class _LeaseReturn:
    """Held by the device arrays imported under a lease: gives it back when they die."""

    __slots__ = ("peer", "lease", "device_id")

    def __init__(self, peer: Peer, lease: int, device_id: int) -> None:
        self.peer, self.lease, self.device_id = peer, lease, device_id

    def __del__(self) -> None:
        try:  # (kernels reading the memory may still be queued: the peer may reuse it next)
            cuda.synchronize_default_stream(self.device_id)
        except Exception:  # noqa: BLE001 - a finalizer: the context may be gone at exit
            pass
        self.peer._returned(self.lease)


def _leases(wires: list[WireTensor]) -> list[int]:
    """The lease ids of wire tensors (inline ones and memory handed back have none)."""
    return [wire[3][-1] for wire in wires if type(wire[3]) is not bytes and wire[3][-1]]


class Exports:
    """The tensors of one message being built. If building it fails, the holds filed
    for them are dropped: the peer never sees them, so it would never release them."""

    __slots__ = ("peer", "wires")

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.wires: list[WireTensor] = []

    def add(self, name: str, tensor: Tensor, by_reference: bool = False) -> WireTensor:
        wire = self.peer.export(name, tensor, by_reference)
        self.wires.append(wire)
        return wire

    def revoke(self) -> None:
        """The message will not be sent after all (it is replaced by an error)."""
        self.peer.revoke(self.wires)
        self.wires = []

    def __enter__(self) -> Exports:
        return self

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        if exc_type is not None:
            self.revoke()


__all__ = ["Exports", "Peer", "WireTensor"]
