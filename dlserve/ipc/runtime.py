"""The worker side of what a model asks of the server: responses, cancellation, BLS, logs.

:class:`WorkerRuntime` is what ``pb_utils`` reaches through ``_runtime.current()``
inside a worker. Everything here may be called from any thread of the model: the
channel is thread-safe and nothing here blocks the event loop of an ``async def
execute`` model except where the model asked to wait (``exec``).

A response travels as ``(outputs, error, parameters)``: outputs are wire tensors
(:mod:`dlserve.ipc.tensors`), error is None or ``(code, message)``, parameters a
JSON object string. A flag-only final response travels as None.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import threading
import time
import weakref
from typing import Any

from dlserve.errors import ErrorCode, TritonError
from dlserve.ipc.channel import Stream, WorkerChannel
from dlserve.ipc.inline import InlineCalls
from dlserve.ipc.model_code import ABANDONED
from dlserve.ipc.protocol import Kind
from dlserve.ipc.tensors import Peer
from dlserve.memory.arena import Arena
from dlserve.memory.regions import output_too_small
from dlserve.memory.tensor import DestinationTooSmall
from dlserve.pb_utils.errors import TritonError as ModelError
from dlserve.pb_utils.errors import TritonModelException
from dlserve.pb_utils.inference import InferenceRequest, InferenceResponse
from dlserve.pb_utils.sender import Exchange
from dlserve.pb_utils.tensor import Tensor

# The handles of the requests the current code runs for (set around execute), so a
# BLS call names its callers and the server can see call cycles.
current_handles: contextvars.ContextVar[tuple[int, ...] | None] = contextvars.ContextVar(
    "dlserve_current_handles", default=None
)
_FIRST_SWEEP = 1024  # exchanges known before the dead ones are first swept out


def encode_response(
    peer: Peer,
    response: InferenceResponse,
    requested: list[str],
    destinations: dict[str, Any] | None,
) -> tuple[Any, ...]:
    """A model's response on the wire: requested outputs only, written into the
    server's shared memory where it named a destination."""
    error = response.error()
    if error is not None:
        return ((), (int(error.code()), error.message()), response.parameters())
    with peer.exports() as out:
        for tensor in response.output_tensors():
            name = tensor.name()
            if name not in requested:
                continue
            destination = None if destinations is None else destinations.get(name)
            if destination is None:
                out.add(name, tensor._tensor)
                continue
            try:
                placed = tensor._tensor.write_into(destination)
            except DestinationTooSmall as small:
                out.revoke()
                message = output_too_small(name, small.holds, small.needed)
                return ((), (int(ErrorCode.INVALID_ARG), message), response.parameters())
            out.add(name, placed, by_reference=True)
    return (out.wires, None, response.parameters())


def _error_response(message: str, code: int = int(ErrorCode.INTERNAL)) -> InferenceResponse:
    return InferenceResponse._received([], ModelError(message, code), "{}")


class WorkerRuntime:
    """What pb_utils reaches through :mod:`dlserve.pb_utils._runtime` in a worker."""

    def __init__(
        self, channel: WorkerChannel, peer: Peer, arena: Arena, instance_name: str
    ) -> None:
        self.channel = channel
        self.instance_name = instance_name
        self.peer = peer
        self.arena = arena
        # The model's own event loop (``async def execute``); the main thread always
        # reads the channel for it, so its coroutines can wait without a thread each.
        self.loop: asyncio.AbstractEventLoop | None = None
        # handle -> the exchange of a request the model may still answer. Weak: a request
        # nobody holds is done with. Plain weak references, the dead ones swept when the
        # table has doubled, not a WeakValueDictionary: its Python-level bookkeeping
        # cost every request a few microseconds.
        self._exchanges: dict[int, weakref.ref[Exchange]] = {}
        self._sweep_at = _FIRST_SWEEP
        self._early_cancels: set[int] = set()  # cancelled before their execute was read
        self._cancel_lock = threading.Lock()
        # False while the model's initialize or finalize runs: BLS is execute's, as in Triton.
        self.bls_allowed = True
        self.finalized = False  # (the model's finalize returned: the worker is ending)
        self._pid = os.getpid()
        self._next_poll = 0.0  # (look_at_channel)
        self._no_bls = threading.local()  # (bls_refused_here)
        self.inline = InlineCalls(self)  # models run here on their BLS callers' threads
        channel.on_inline_drop = self.inline.forget
        channel.on_cancel = self._cancelled
        channel.on_bls_response = self._received
        channel.on_release = peer.release

    # -- logs, metrics, model control --------------------------------------------------
    def log(self, level: int, message: str, filename: str, line: int) -> None:
        self.channel.send(Kind.LOG, 0, (level, message, filename, line))

    def request(self, kind: int, body: Any) -> Any:
        try:
            return self.channel.request(kind, body)
        except TritonError as exc:
            raise TritonModelException(exc.message) from None
        except EOFError:
            raise TritonModelException("the server closed the connection") from None

    def notify(self, kind: int, body: Any) -> None:
        self.channel.send(kind, 0, body)

    def release_metric_family(self, name: str) -> None:
        """The model let a MetricFamily go (not the worker's teardown after finalize, nor a
        process the model forked, whose copy of the channel is not its to write to)."""
        if not self.finalized and os.getpid() == self._pid:
            self.notify(Kind.METRIC, ("release", name, {}, 0.0))

    # -- received requests -------------------------------------------------------------
    def exchange(
        self, handle: int, requested: list[str], destinations: dict[str, Any] | None, decoupled: bool
    ) -> Exchange:
        """The link back to the server for a request about to be handed to execute: a
        rescheduled request's own again (its handle is kept) while the model holds its
        sender from an earlier execute, so that sender and this execute answer as one."""
        with self._cancel_lock:
            exchange = self._exchange(handle)
            if exchange is None:
                exchange = Exchange(handle, requested, destinations, decoupled)
                if len(self._exchanges) >= self._sweep_at:
                    self._sweep_exchanges()
                self._exchanges[handle] = weakref.ref(exchange)
            exchange.rescheduled = False
            if self._early_cancels:
                if handle in self._early_cancels:
                    exchange.cancelled = True
                # New handles arrive in increasing order: smaller ones are long gone (a
                # rescheduled request's cancel while queued is the server's to answer).
                self._early_cancels = {h for h in self._early_cancels if h > handle}
        return exchange

    def _cancelled(self, handles: list[int]) -> None:
        """CANCEL from the server (on whichever thread reads the channel)."""
        with self._cancel_lock:
            for handle in handles:
                exchange = self._exchange(handle)
                if exchange is not None:
                    exchange.cancelled = True
                else:
                    self._early_cancels.add(handle)

    def _exchange(self, handle: int) -> Exchange | None:
        ref = self._exchanges.get(handle)
        return None if ref is None else ref()

    def _sweep_exchanges(self) -> None:
        """Forget the exchanges gone; the next sweep once the table has doubled again."""
        self._exchanges = {h: ref for h, ref in self._exchanges.items() if ref() is not None}
        self._sweep_at = max(_FIRST_SWEEP, 2 * len(self._exchanges))

    def is_cancelled(self, exchange: Exchange) -> bool:
        if not exchange.cancelled:
            self.channel.poll()  # nobody may be reading: look at what has arrived
        return exchange.cancelled

    def send_response(self, exchange: Exchange, response: InferenceResponse | None, final: bool) -> None:
        wire = None
        if response is not None:
            wire = encode_response(self.peer, response, exchange.requested, exchange.destinations)
        self.channel.send(Kind.RESPONSE, 0, (exchange.handle, wire, final))
        # A model streaming from execute's own thread keeps anyone from reading: the
        # server's releases of the responses it sent would wait until execute returned.
        self.look_at_channel()

    def look_at_channel(self) -> None:
        """Route what the server has sent, without blocking, every millisecond at most:
        for code that runs long on the thread that would otherwise read it."""
        now = time.monotonic()
        if now >= self._next_poll:
            self._next_poll = now + 0.001
            self.channel.poll()

    def abandon(self, exchange: Exchange) -> None:
        exchange.closed = True
        try:
            wire = ((), (int(ErrorCode.INTERNAL), ABANDONED), "{}")
            self.channel.send(Kind.RESPONSE, 0, (exchange.handle, wire, True))
        except Exception:  # noqa: BLE001 - runs in a finalizer: the server may be gone
            pass

    # -- BLS ---------------------------------------------------------------------------
    def _call_body(self, request: InferenceRequest, decoupled: bool) -> tuple[Any, ...]:
        with self.peer.exports() as out:
            inputs = [out.add(tensor.name(), tensor._tensor) for tensor in request._inputs]
        return (
            request._model_name,
            request._model_version,
            inputs,
            list(request._requested) or None,
            request._request_id,
            request._correlation_id,
            request._flags,
            request._timeout,
            request._parameters,
            decoupled,
            current_handles.get(),
            request._trace._id if request._trace is not None else 0,
        )

    def _start(self, request: InferenceRequest, decoupled: bool, stream: Stream) -> int:
        """Send the call; its correlation id, or 0 when it could not even be sent: then
        its one response, an error, is in ``stream`` already."""
        try:
            return self.channel.call(Kind.BLS, self._call_body(request, decoupled), stream)
        except (EOFError, OSError):
            error = (int(ErrorCode.UNAVAILABLE), "the server closed the connection")
        except (TritonError, ValueError, MemoryError) as exc:
            error = (int(ErrorCode.INTERNAL), f"cannot send the BLS request: {exc}")
        stream.items.append((_error_response(error[1], error[0]), True))
        return 0

    def discard(self, body: Any) -> None:
        """A BLS_RESPONSE message nobody will read: its outputs' memory goes back now
        (the worker may be idle, with no reply about to carry the releases)."""
        wire = body[0]
        if wire is not None and wire[0]:
            self.peer.discard(wire[0])
            self.channel.flush_releases()

    def _received(self, body: Any) -> tuple[InferenceResponse, bool]:
        """A BLS_RESPONSE message as the response the model sees, and its final flag;
        made as it arrives (on the reading thread), so that its outputs hold their
        memory before the server's RELEASE behind it is applied: an output may be the
        caller's own input, returned by reference (lease 0), whose hold that drops."""
        wire, final = body
        if wire is None:
            return InferenceResponse._received([], None, "{}"), final
        outputs_wire, error, parameters = wire
        if error is not None:
            return InferenceResponse._received([], ModelError(error[1], error[0]), parameters), final
        outputs: list[Tensor] = []
        try:
            for w in outputs_wire:
                outputs.append(Tensor._received(*self.peer.import_(w)))
        except TritonError as exc:  # (say, a client's region shrunk meanwhile)
            self.peer.discard(outputs_wire[len(outputs):])  # (those mapped go back as they die)
            return _error_response(exc.message, int(exc.code)), final
        return InferenceResponse._received(outputs, None, parameters), final

    def bls_refused_here(self, refused: bool) -> None:
        """While True, BLS calls from this thread are refused (an inline instance's
        initialize or finalize runs on it), as they are for the worker's own."""
        self._no_bls.refused = refused

    def _check_bls_allowed(self) -> None:
        if not self.bls_allowed or getattr(self._no_bls, "refused", False):  # (Triton's words)
            raise TritonModelException("BLS is only supported during the 'execute' function.")

    def infer(self, request: InferenceRequest, decoupled: bool) -> Any:
        self._check_bls_allowed()
        answered = self.inline.call(request, decoupled)
        if answered is not None:
            return answered
        iterator = ResponseIterator(self, Stream())
        iterator.corr = self._start(request, decoupled, iterator.stream)
        return iterator if decoupled else iterator.single()

    async def async_infer(self, request: InferenceRequest, decoupled: bool) -> Any:
        """As Triton's: awaited, a decoupled call returns once its first response is in
        (so a model that then reads them with a plain ``for`` does not hold up its loop
        waiting for a stream that has not begun)."""
        self._check_bls_allowed()
        answered = self.inline.call(request, decoupled)
        if answered is not None:
            return answered
        loop = asyncio.get_running_loop()
        if loop is not self.loop:
            # A loop of the model's own making: nobody is sure to read the channel
            # while it waits, so wait (and read) on a pool thread, as Triton does.
            return await loop.run_in_executor(None, self.infer, request, decoupled)
        iterator = ResponseIterator(self, Stream(), loop)
        iterator.corr = self._start(request, decoupled, iterator.stream)
        if not decoupled:
            return await iterator.__anext__()
        await iterator.arrival()
        return iterator


class ResponseIterator:
    """The responses of a BLS call with ``decoupled=True``, in order, the last one
    final; ``for`` blocks between them, ``async for`` (inside the model's event loop)
    lets other coroutines run. Like Triton's, it yields the flag-only final response
    as an empty one, and once it has ended, iterating it again yields every response
    again (it keeps them)."""

    def __init__(
        self, runtime: WorkerRuntime, stream: Stream, loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        self.runtime = runtime
        self.corr = 0  # the call's correlation id, once sent (0: it never was)
        self.stream = stream
        self._done = False
        self._seen: list[InferenceResponse] = []
        self._next = 0  # index in _seen of the response to hand out next
        self._arrived: asyncio.Event | None = None
        if loop is not None:
            arrived = self._arrived = asyncio.Event()
            stream.on_item = lambda item: loop.call_soon_threadsafe(arrived.set)

    def _take(self) -> InferenceResponse:
        if self.stream.items:
            response, final = self.stream.items.popleft()
            self._done = final
        else:
            self._done = True
            response = _error_response("the server closed the connection", int(ErrorCode.UNAVAILABLE))
        self._seen.append(response)
        self._next = len(self._seen)
        return response

    def _replayed(self) -> InferenceResponse | None:
        """The next response of an iteration again over responses already handed out."""
        if self._next >= len(self._seen):
            return None
        self._next += 1
        return self._seen[self._next - 1]

    def __iter__(self) -> ResponseIterator:
        if self._done and self._next >= len(self._seen):
            self._next = 0  # iterated again after its end: from the first response (as
            # Triton's; a loop left before the end resumes where it left off)
        return self

    def __next__(self) -> InferenceResponse:
        again = self._replayed()
        if again is not None:
            return again
        if self._done:
            raise StopIteration
        if not self.stream.items:
            try:
                self.runtime.channel.wait_stream(self.stream)
            except EOFError:
                pass
        return self._take()

    def __aiter__(self) -> ResponseIterator:
        return self.__iter__()

    async def __anext__(self) -> InferenceResponse:
        again = self._replayed()
        if again is not None:
            return again
        if self._done:
            raise StopAsyncIteration
        if self._arrived is None:  # made by a blocking exec(): wait on a pool thread
            return await asyncio.get_running_loop().run_in_executor(None, self.__next__)
        await self.arrival()
        return self._take()

    async def arrival(self) -> None:
        """Until a response is here to take, or the stream has ended (a call made on
        the model's event loop)."""
        stream, arrived = self.stream, self._arrived
        assert arrived is not None
        while not stream.items and not stream.closed:
            arrived.clear()
            if stream.items or stream.closed:
                break
            await arrived.wait()

    def __del__(self) -> None:
        # The model stopped reading before the final response (a ``break``, a cancelled
        # coroutine): as Triton's, the call is not cancelled (the callee runs to its end),
        # and the memory of every response nobody will read goes back, those already here
        # and those still to come. Triton's destructor waits for them all; this one does
        # not (it may run on the thread that reads the channel, or on the model's loop).
        if not self._done:
            self.stream.abandon(self.runtime.discard)

    def single(self) -> InferenceResponse:
        """The one response of a non-decoupled call."""
        return self.__next__()

    def cancel(self) -> None:
        """Cancel the call, as Triton does: queued, the request is dropped and this
        iterator ends with a CANCELLED response; executing, its ``is_cancelled()`` turns
        True and the iterator goes on with what the callee still sends, until its final
        response (a callee that ignores the cancellation sends all it would have)."""
        if not self._done and self.corr:
            self.runtime.channel.send(Kind.BLS_CANCEL, 0, self.corr)
