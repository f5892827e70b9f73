"""Both ends of the control channel: a Unix socket carrying :mod:`protocol` frames.

:class:`ServerChannel` is an asyncio ``Protocol`` on the server's event loop; its
end of file means the worker died, which the server learns at once.
:class:`WorkerChannel` is the blocking end inside the worker. Any worker thread
may wait for a reply (a BLS call, a decoupled send) while the main thread waits
for the next command, so reading is a role, not a thread: whichever waiter finds
no reader reads one frame and hands it to whoever it belongs to (leader/follower).
The common case — one thread, one execute at a time — costs no thread switch.

Both ends bundle pending RELEASE messages into the next write, so returning
shared memory costs no extra system call in steady state.

Both ends poll for a while before they sleep (:mod:`dlserve.ipc.polling`): the
server's loop while a request it sent is unanswered, the worker before it blocks
in ``recv``.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from dlserve.errors import ErrorCode, TritonError, UnavailableError
from dlserve.ipc.polling import PollWindow, loop_poller, recv_polling
from dlserve.ipc.protocol import HEADER, FrameBuffer, Kind, Message, encode

log = logging.getLogger("dlserve.worker")

# What gets a request's reply: called with (body, None), or (None, the error).
ReplyCallback = Callable[[Any, "BaseException | None"], None]


class WorkerGoneError(UnavailableError):
    """The worker's end of the channel is closed: the process died or is going.

    Distinct from an UNAVAILABLE error a live worker sends back (say, no shared memory
    left for an output), which fails one call and leaves the worker serving."""


def _raise_error(body: Any) -> TritonError:
    code, message = body
    return TritonError.from_code(code, message)


class ServerChannel(asyncio.Protocol):
    """The server's end of one worker's channel."""

    def __init__(
        self,
        on_message: Callable[[Message], None],
        on_lost: Callable[[], None],
        poll_limit: float = 0.0,
    ) -> None:
        self._on_message = on_message
        self._on_lost = on_lost
        self._frames = FrameBuffer()
        self._transport: asyncio.Transport | None = None
        self._pending: dict[int, ReplyCallback] = {}
        self._corr = itertools.count(1)
        self._releases: list[int] = []
        self._flush_scheduled = False
        self._loop = asyncio.get_running_loop()
        self._poller = loop_poller(self._loop)
        self._reply_wait = PollWindow(poll_limit)
        self._waiting_since = 0.0  # when a request went out with none other pending
        self.on_release: Callable[[list[int]], None] = lambda leases: None
        self.on_retire: Callable[[list[str]], None] = lambda names: None

    # -- asyncio.Protocol -------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        for kind, corr, body in self._frames.feed(data):
            if kind == Kind.REPLY or kind == Kind.ERROR:
                on_reply = self._pending.pop(corr, None)
                if not self._pending:
                    self._reply_wait.record(time.perf_counter() - self._waiting_since)
                    self._poller.done(self)
                if on_reply is not None:
                    if kind == Kind.REPLY:
                        self._answer(on_reply, body, None)
                    else:
                        self._answer(on_reply, None, _raise_error(body))
            elif kind == Kind.RELEASE:
                # Now, in order: the worker sends it behind the messages that may refer to
                # the very memory it releases (lease 0; WorkerChannel.reply_letting_go), and
                # those (an execute's reply, a streamed response, a BLS call) were read into
                # their own objects above. A caller answered above finds its memory back.
                self.on_release(body)
            elif kind == Kind.RETIRE:
                self._loop.call_soon(self.on_retire, body)
            else:
                self._on_message((kind, corr, body))

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._poller.done(self)
        pending, self._pending = self._pending, {}
        for on_reply in pending.values():
            self._answer(on_reply, None, WorkerGoneError("worker process connection closed"))
        self._on_lost()

    @staticmethod
    def _answer(on_reply: ReplyCallback, body: Any, error: BaseException | None) -> None:
        """Hand a reply on. A failing callback is logged, not raised: raised out of the
        protocol's callbacks, it would close the channel to a worker that is fine."""
        try:
            on_reply(body, error)
        except Exception:  # noqa: BLE001
            log.exception("handling a worker's reply failed")

    # -- sending ------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._transport is not None

    def _write(self, frame: bytes) -> None:
        """Send a frame now, any releases waiting to go back bundled behind it.

        Now, not at the end of the loop turn: the rest of the turn can be long (a batch
        that just finished writes all its HTTP responses in it), and the worker would sit
        idle that long before it saw its next execute."""
        if self._transport is None:
            raise WorkerGoneError("worker process is not running")
        if self._releases:  # after the message: it may still refer to what is released
            frame += encode(Kind.RELEASE, 0, self._take_releases())
        self._transport.write(frame)

    def request(self, kind: int, body: Any) -> asyncio.Future[Any]:
        """Send a request; the future resolves to the reply body or raises its error."""
        future = self._loop.create_future()

        def resolve(reply: Any, error: BaseException | None) -> None:
            if not future.done():
                if error is None:
                    future.set_result(reply)
                else:
                    future.set_exception(error)

        self.call(kind, body, resolve)
        return future

    def call(self, kind: int, body: Any, on_reply: ReplyCallback) -> None:
        """Send a request; ``on_reply(body, None)`` or ``on_reply(None, error)`` is called
        as its reply is read (or the channel is lost), in that same loop turn: the hot
        path's execute, without a future's extra turn of the loop."""
        corr = next(self._corr)
        self._write(encode(kind, corr, body))
        if not self._pending:
            self._waiting_since = time.perf_counter()
            self._poller.poll(self, self._reply_wait.seconds)
        self._pending[corr] = on_reply

    def reply(self, corr: int, body: Any) -> None:
        self._write(encode(Kind.REPLY, corr, body))

    def reply_error(self, corr: int, error: TritonError) -> None:
        self._write(encode(Kind.ERROR, corr, (int(error.code), error.message)))

    def notify(self, kind: int, body: Any) -> None:
        self._write(encode(kind, 0, body))

    def send(self, kind: int, corr: int, body: Any) -> None:
        """A message that answers the worker's ``corr`` without being a reply (a stream)."""
        self._write(encode(kind, corr, body))

    def queue_releases(self, leases: list[int]) -> None:
        """Thread-safe: hand leases back with the next write, or soon on its own."""
        self._releases.extend(leases)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            try:
                self._loop.call_soon_threadsafe(self._flush)
            except RuntimeError:
                pass  # loop closed: the worker is going away with it

    def _take_releases(self) -> list[int]:
        taken, self._releases = self._releases, []
        return taken

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._releases and self._transport is not None:
            self._transport.write(encode(Kind.RELEASE, 0, self._take_releases()))

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class _Slot:
    __slots__ = ("done", "ok", "body")

    def __init__(self) -> None:
        self.done = False
        self.ok = False
        self.body: Any = None


class Stream:
    """Where the messages the server sends for one BLS call collect (see :meth:`WorkerChannel.call`),
    each as :attr:`WorkerChannel.on_bls_response` made it on arrival.

    ``on_item`` runs on the reading thread, under the channel's lock, for every message
    (and once with None if the channel closes): it must only hand the news on.
    """

    __slots__ = ("items", "closed", "on_item", "discard")

    def __init__(self) -> None:
        self.items: collections.deque[Any] = collections.deque()
        self.closed = False
        self.on_item: Callable[[Any], None] | None = None
        self.discard: Callable[[Any], None] | None = None  # set: nobody reads any more

    def abandon(self, discard: Callable[[Any], None]) -> None:
        """Nobody will read this stream again: what it holds is dropped, and whatever
        still arrives for it goes to ``discard`` as it came. Takes no lock (it runs in
        finalizers): an item the reader adds meanwhile goes with the stream."""
        self.discard = discard
        self.items.clear()


class WorkerChannel:
    """The worker's blocking end of the channel; safe to use from any thread."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._read_window: PollWindow | None = None
        self._quiet_threads = 0
        # Re-entrant: a finalizer that sends (an abandoned response sender) may run
        # in the middle of this thread's own send.
        self._send_lock = threading.RLock()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._waiters = 0  # threads in self._cond.wait() (none: nobody to notify)
        self._reading = False
        self._closed = False
        self._inbox: collections.deque[Message] = collections.deque()
        self._slots: dict[int, _Slot] = {}
        self._streams: dict[int, Stream] = {}
        self.on_cancel: Callable[[list[int]], None] = lambda handles: None
        self.on_inline_drop: Callable[[list[str]], None] = lambda names: None
        # What a BLS_RESPONSE becomes on arrival (the runtime maps its tensors then, before
        # a RELEASE behind it can drop memory it refers to), and how releases are applied.
        self.on_bls_response: Callable[[Any], Any] = lambda body: body
        self.on_release: Callable[[list[int]], None] = lambda leases: None
        self._command_thread = 0  # the thread that takes the commands (next_command)
        # Set while the command thread runs a command whose references it has imported
        # (a sync execute): then any thread that reads may apply the releases, which
        # the command thread, busy in the model, would not (see _apply_releases).
        self.releases_anywhere = False
        self._frames = FrameBuffer()
        self._ready: collections.deque[Message] = collections.deque()
        self._corr = itertools.count(1)
        self._releases: list[int] = []

    # -- sending ------------------------------------------------------------------------
    def send(self, kind: int, corr: int, body: Any) -> None:
        frame = encode(kind, corr, body)
        with self._send_lock:
            if self._releases:  # after the reply: its outputs may refer to released memory
                frame += encode(Kind.RELEASE, 0, self._take_releases())
            self._sock.sendall(frame)

    def reply_letting_go(self, corr: int, body: Any, held: list[Any]) -> None:
        """Reply, and let go of ``held`` (what the reply's tensors may refer to) only
        under the send lock: the releases its views queue as they die then go out behind
        the reply, in its frame. Let go of before, another thread's send (a log line, a
        response sender, the reader's flush) could carry them ahead of the reply, and the
        server would free memory the reply still names. Let go of after the reply, they
        would come in a frame of their own, which the server may read after it has
        answered: a client answered could find what its request held still held (a
        registered region still in use)."""
        with self._send_lock:
            held.clear()
            self.send(Kind.REPLY, corr, body)

    def queue_releases(self, leases: list[int]) -> None:
        """Hand leases back with the next message (see :meth:`flush_releases`)."""
        self._releases.extend(leases)

    def _take_releases(self) -> list[int]:
        taken, self._releases = self._releases, []
        return taken

    def flush_releases(self) -> None:
        """Send queued releases now (used when no reply is about to carry them)."""
        with self._send_lock:
            if self._releases and not self._closed:
                try:
                    self._sock.sendall(encode(Kind.RELEASE, 0, self._take_releases()))
                except OSError:
                    pass

    # -- receiving ----------------------------------------------------------------------
    def _read_message(self) -> Message:
        """Read one message from the socket; only the thread in the reader role calls it.
        Releases queued meanwhile (views the model's threads let go) go first, so that an
        idle worker does not hold them until its next message."""
        if self._releases:
            self.flush_releases()
        while not self._ready:
            window = self._read_window
            if window is not None and threading.active_count() <= self._quiet_threads:
                data = recv_polling(self._sock, window)
            else:
                data = self._sock.recv(1 << 16)
            if not data:
                raise EOFError("server closed the channel")
            self._ready.extend(self._frames.feed(data))
        return self._ready.popleft()

    def poll_reads(self, limit: float) -> None:
        """Poll up to ``limit`` seconds before blocking for a message (ipc.polling), but
        only while no thread runs beyond those running now. Polling holds the GIL
        between its reads, so it would keep the model's own threads (a decoupled
        model's sender, an async model's loop) waiting for it for up to the
        interpreter's 5 ms switch interval."""
        if limit > 0:
            self._read_window = PollWindow(limit)
            self._quiet_threads = threading.active_count()

    def _route(self, message: Message) -> None:
        """Hand a message to whoever it belongs to (called with the lock held)."""
        kind, corr, body = message
        if kind == Kind.REPLY or kind == Kind.ERROR:
            slot = self._slots.pop(corr, None)
            if slot is not None:
                slot.done, slot.ok, slot.body = True, kind == Kind.REPLY, body
        elif kind == Kind.BLS_RESPONSE:
            stream = self._streams.get(corr)
            if stream is not None:
                if body[1]:  # final
                    del self._streams[corr]
                if stream.discard is not None:
                    stream.discard(body)
                else:
                    item = self.on_bls_response(body)
                    stream.items.append(item)
                    if stream.on_item is not None:
                        stream.on_item(item)
        elif kind == Kind.CANCEL:
            # Now, not in turn: the request it cancels may be executing this very moment.
            self.on_cancel(body)
        elif kind == Kind.INLINE_DROP:
            # Taken out of use now (an execute running may call the model again), and
            # finalized in turn, as the command it also is.
            self.on_inline_drop(body)
            self._inbox.append(message)
        else:
            # RELEASE/RETIRE go through the inbox too, so they are applied in order
            # with the commands around them (a command may still use what they drop).
            self._inbox.append(message)

    def _apply_releases(self) -> None:
        """(Lock held) Apply the RELEASE messages that no command precedes, on the
        command thread (between commands, or while it waits inside an execute: a long
        execute making many calls would otherwise hold every block it ever sent until it
        ends), or on any thread while ``releases_anywhere`` (a sync execute waiting on
        its own threads' BLS calls, or streaming from the main thread)."""
        if not self.releases_anywhere and threading.get_ident() != self._command_thread:
            return
        inbox = self._inbox
        while inbox and inbox[0][0] == Kind.RELEASE:
            self.on_release(inbox.popleft()[2])

    def _close_streams(self) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.closed = True
            if stream.on_item is not None:
                stream.on_item(None)

    def _wait(self, ready: Callable[[], bool]) -> None:
        """Block until ``ready()``; read frames for everybody while no one else does."""
        lock = self._lock  # (the condition's: taken as itself, one call less per message)
        with lock:
            inbox = self._inbox
            while True:
                if inbox and inbox[0][0] == Kind.RELEASE:
                    self._apply_releases()
                if ready():
                    return
                if self._closed:
                    raise EOFError("server closed the channel")
                if self._reading:
                    self._waiters += 1
                    try:
                        self._cond.wait()
                    finally:
                        self._waiters -= 1
                    continue
                self._reading = True
                lock.release()
                try:
                    message: Message | None = self._read_message()
                except (EOFError, OSError):
                    message = None
                finally:
                    lock.acquire()
                    self._reading = False
                    # Whoever waits wakes once this thread lets go of the lock: to what is
                    # routed below, or to read in its place (a read that raised, too).
                    if self._waiters:
                        self._cond.notify_all()
                if message is None:
                    self._closed = True
                    self._close_streams()
                else:
                    self._route(message)

    def next_command(self) -> Message:
        """The next server-initiated message but a RELEASE (those go to ``on_release``);
        raises EOFError when the server is gone."""
        self._command_thread = threading.get_ident()
        self._wait(lambda: bool(self._inbox))
        return self._inbox.popleft()

    def request(self, kind: int, body: Any) -> Any:
        """Send a request to the server and block for its reply."""
        corr = next(self._corr)
        slot = _Slot()
        with self._cond:
            self._slots[corr] = slot
        self._send_awaited(kind, corr, body, self._slots)
        self._wait(lambda: slot.done)
        if not slot.ok:
            raise _raise_error(slot.body)
        return slot.body

    def call(self, kind: int, body: Any, stream: Stream) -> int:
        """Send a request whose answers arrive as a series of messages into ``stream``
        (the last one final); returns its correlation id."""
        corr = next(self._corr)
        with self._cond:
            if self._closed:
                raise EOFError("server closed the channel")
            self._streams[corr] = stream
        self._send_awaited(kind, corr, body, self._streams)
        return corr

    def _send_awaited(self, kind: int, corr: int, body: Any, waiting: dict[int, Any]) -> None:
        """Send a request whose answers ``waiting`` awaits under ``corr``; if it could not
        go, nothing awaits them (and a socket that failed is a server gone: EOFError)."""
        try:
            self.send(kind, corr, body)
        except BaseException as exc:
            with self._cond:
                waiting.pop(corr, None)
            if isinstance(exc, OSError):
                raise EOFError("server closed the channel") from exc
            raise

    def wait_stream(self, stream: Stream) -> None:
        """Block until ``stream`` has a message or the channel closed."""
        self._wait(lambda: bool(stream.items) or stream.closed)

    def serve_until(self, done: Callable[[], bool]) -> None:
        """Read for everybody until ``done()``: for a helper thread standing in for a
        main thread that waits on something other than the channel."""
        try:
            self._wait(done)
        except EOFError:
            pass

    def route_received(self) -> None:
        """Hand on the messages already read but not yet routed (a CANCEL that came in
        right behind the command just taken), without reading the socket."""
        if self._ready:
            with self._cond:
                if not self._reading:
                    while self._ready:
                        self._route(self._ready.popleft())

    def poll(self) -> None:
        """Route whatever has already arrived, without blocking: cancellation checks
        from a model that keeps the main thread busy, so that nobody is reading."""
        with self._cond:
            if self._reading or self._closed:
                return
            self._reading = True
        closed = False
        try:
            while True:
                try:
                    data = self._sock.recv(1 << 16, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    break
                if not data:
                    closed = True
                    break
                self._ready.extend(self._frames.feed(data))
        except OSError:
            closed = True
        finally:
            with self._cond:
                try:
                    while self._ready:
                        self._route(self._ready.popleft())
                    self._apply_releases()
                    if closed:
                        self._closed = True
                        self._close_streams()
                finally:  # (the next reader must not wait for one that is gone)
                    self._reading = False
                    if self._waiters:
                        self._cond.notify_all()

    def reply(self, corr: int, body: Any) -> None:
        self.send(Kind.REPLY, corr, body)

    def reply_error(self, corr: int, code: ErrorCode, message: str) -> None:
        self.send(Kind.ERROR, corr, (int(code), message))

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass


__all__ = ["HEADER", "ServerChannel", "Stream", "WorkerChannel", "WorkerGoneError"]
