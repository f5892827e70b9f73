"""gRPC's HTTP/2 transport, served from the event loop: connections, frames, flow control.

Why not grpcio: its asyncio server spends about 300 µs of CPU per unary call on this
class of machine (completion-queue thread, Cython callbacks, a future per call), about
as much as everything else the server does for a small inference. Here one
:class:`asyncio.Protocol` per connection parses frames, and a call costs a header-block
lookup, a protobuf parse, one task and one ``write`` for the answer's HEADERS, DATA and
trailers together.

What a gRPC server owes its clients, and where it is done:

* HTTP/2 (RFC 9113): the preface, SETTINGS both ways, PING answers, flow control in
  both directions (the connection's receive window is opened wide, each stream's is
  bounded and reopened as its messages are read: :data:`STREAM_WINDOW`; sends wait for
  the peer's windows; a peer is not read while what we write it piles up unread),
  CONTINUATION, padding, RST_STREAM, GOAWAY on stop (calls in flight get the grace
  period, then are cancelled; a stream ends once it has nothing in flight); a frame on a
  stream it cannot be on, of the wrong size, or a window past 2^31-1 is an error with
  RFC 9113's code.
* gRPC over HTTP/2 (one call per stream, in :mod:`dlserve.frontends.grpc_calls`):
  length-prefixed messages split across DATA frames or sharing one, ``grpc-timeout``
  (the call is cancelled and answered DEADLINE_EXCEEDED), ``grpc-encoding`` and
  ``grpc-accept-encoding`` (gzip and deflate), status and percent-encoded message in
  the trailers (or a trailers-only answer), ``-bin`` metadata, message-size limits
  (RESOURCE_EXHAUSTED, with grpc's wording).
* Keepalive and abuse policy as grpc's server options describe them: pings every
  ``keepalive_time_ms`` and the connection closed when one goes unanswered for
  ``keepalive_timeout_ms`` (``http2_max_pings_without_data`` limits clients only, in
  grpc as here); a client that pings more often than
  ``http2_min_recv_ping_interval_without_data_ms`` while we send nothing (calls open
  or not; two hours with no call open, unless ``keepalive_permit_without_calls``) gets
  a strike, and after ``http2_max_ping_strikes`` a GOAWAY ``too_many_pings``;
  ``max_connection_age_ms`` (+ grace) ends a connection with GOAWAY.
* A bound on the connections held (``max_connections``,
  :mod:`dlserve.frontends.connection_cap`): past it, a new connection takes the place of
  the one idle longest (GOAWAY and close), or is refused with a GOAWAY
  ``ENHANCE_YOUR_CALM`` when none is idle.
* TLS and mutual TLS through :mod:`ssl` with ALPN ``h2``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from dlserve.frontends.connection_cap import FRESH_GRACE, ConnectionCap
from dlserve.frontends.grpc_calls import Abort, CallContext, HttpRefusal, Method
from dlserve.frontends.http2 import (
    ACK,
    CANCEL,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEAD,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    MAX_CONCURRENT_STREAMS,
    MAX_FRAME,
    MAX_FRAME_SIZE,
    MAX_HEADER_LIST_SIZE,
    MAX_WINDOW,
    NO_ERROR,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    RST_STREAM,
    SETTING,
    SETTINGS,
    U32,
    WINDOW_UPDATE,
    HeaderDecoder,
    HPACKError,
    frame,
)
from dlserve.frontends.lingering import Lingering, linger
from dlserve.frontends.stalls import SendProgress, Sweeper

log = logging.getLogger("dlserve.frontends.grpc")

RECEIVE_FRAME = 1 << 20  # the DATA frame size we accept: fewer frames for big tensors
MAX_FRAME_LIMIT = (1 << 24) - 1  # the largest frame HTTP/2 can describe
MAX_STREAMS = 1000  # calls open at once on one connection (SETTINGS_MAX_CONCURRENT_STREAMS)
HEADER_LIST_LIMIT = 1 << 16  # a call's metadata, as SETTINGS_MAX_HEADER_LIST_SIZE counts it
INLINE_SEND = 1 << 16  # answers up to this size are joined into one write; larger stay views
BLOCK_LIMIT = 1 << 20  # past this a header block ends the connection (HPACK state is shared)
TOP_UP = 1 << 30  # received bytes after which the connection's window is opened again
FLUSH_FRAMES = 256  # frames owed to the peer after one read past which they go at once
# A stream's receive window. What a stream took is given back once it comes to half
# the window: at once for a unary call's bytes and for a message still being cut (so
# one bigger than the window arrives, and a 64 MiB request never waits), but for the
# whole messages a streaming call holds only once its coroutine has read them. So a
# streaming call that stops reading (its client reads no answers, grpc_stream.InferStream)
# holds the client back by flow control instead of filling the server's memory.
STREAM_WINDOW = 8 << 20


@dataclass(frozen=True)
class Settings:
    """The transport's share of ``KServeGrpc.Options`` (same names; defaults there)."""

    max_message_size: int
    keepalive_time_ms: int
    keepalive_timeout_ms: int
    keepalive_permit_without_calls: bool
    http2_min_recv_ping_interval_without_data_ms: int
    http2_max_ping_strikes: int
    max_connection_age_ms: int
    max_connection_age_grace_ms: int
    max_connections: int  # 0: connection_cap.default_limit()
    message_timeout: int  # seconds a request message begun may go without a byte (0: no limit)


class Connection(asyncio.Protocol):
    """One client connection: frames in, calls dispatched, answers framed out."""

    def __init__(self, server: GrpcTransport) -> None:
        self.server = server
        self.settings = server.settings
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.preface = False
        self.decoder = HeaderDecoder(BLOCK_LIMIT)
        self.calls: dict[int, CallContext] = {}
        self.last_stream = 0
        self.send_window = DEFAULT_WINDOW
        self.peer_window = DEFAULT_WINDOW
        self.peer_frame = MAX_FRAME
        self.received = 0
        self.blocked: collections.deque[CallContext] = collections.deque()
        # (stream, flags, block so far) of a header block awaiting CONTINUATION frames
        self.headers_of: tuple[int, int, bytearray] | None = None
        self.going_away = False
        self.closed = False
        self.lingering: Lingering | None = None  # (see _fail)
        self.ping_strikes = 0
        self.last_ping_received = 0.0
        self.ping_sent_at: float | None = None
        self.timers: dict[str, asyncio.TimerHandle] = {}
        self.outgoing: list[bytes | memoryview] = []
        self.send_pending = False
        self.admitted = False  # counted against the connection bound (see connection_made)
        self.peer_gone = False  # the client sent GOAWAY

    # -- lifetime --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        server = self.server
        server.connections.add(self)  # (asyncio and uvloop set TCP_NODELAY themselves)
        settings = b"".join(
            SETTING.pack(key, value)
            for key, value in (
                (MAX_CONCURRENT_STREAMS, MAX_STREAMS),
                (INITIAL_WINDOW_SIZE, STREAM_WINDOW),
                (MAX_FRAME_SIZE, RECEIVE_FRAME),
                (MAX_HEADER_LIST_SIZE, HEADER_LIST_LIMIT),
            )
        )
        self._out(
            frame(SETTINGS, 0, 0, settings)
            + frame(WINDOW_UPDATE, 0, 0, U32.pack(MAX_WINDOW - DEFAULT_WINDOW))
        )
        self.admitted = server.cap.admit()
        if not self.admitted:  # (told so, and closed without counting against the bound)
            self._fail(ENHANCE_YOUR_CALM, server.cap.refusal())
            return
        s = self.settings
        if s.keepalive_time_ms > 0:
            self._later("keepalive", s.keepalive_time_ms, self._keepalive)
        if s.max_connection_age_ms > 0:
            self._later("age", s.max_connection_age_ms, self._aged)
        self._later("settle", int(FRESH_GRACE * 1000), self._settled)

    def sheddable(self) -> bool:
        """Idle: no call open (for the connection bound, :mod:`dlserve.frontends.
        connection_cap`). Bytes of a frame or header block do not make it busy: a client
        that sends a byte and stops would hold its place for good."""
        return not (self.calls or self.closed or self.going_away or self.transport is None)

    def _settled(self) -> None:
        """A new connection that opened no call in FRESH_GRACE seconds is idle."""
        if not self.last_stream and self.sheddable():
            self.server.cap.idle(self)

    def shed(self) -> None:
        """End this idle connection to make room for a new one: GOAWAY and close, cut
        off if a client that reads nothing still holds it open (see _abort_if_stuck)."""
        self.go_away()
        self.close()
        self.loop.call_later(1.0, self._abort_if_stuck, SendProgress())

    def _abort_if_stuck(self, sending: SendProgress) -> None:
        """A shed connection still open, looked at every second: cut off once it has
        nothing left to send, or what it has did not shrink since the last look (a client
        reading its last answer slowly gets all of it)."""
        if self.transport is None:
            return
        unsent = self.transport.get_write_buffer_size()
        if unsent and sending.stalled_for(unsent, self.loop.time()) < 0.5:
            self.loop.call_later(1.0, self._abort_if_stuck, sending)
        else:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.server.connections.discard(self)
        if self.admitted:
            self.admitted = False
            self.server.cap.left(self)
        for timer in self.timers.values():
            timer.cancel()
        if self.lingering is not None:
            self.lingering.cancel()
        for call in list(self.calls.values()):
            self._drop(call)

    def pause_writing(self) -> None:
        # A peer that reads nothing of what we write is not read either: each of its PINGs
        # and SETTINGS (or calls) would queue an answer for it, in our memory, without end.
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None:
            self.transport.resume_reading()

    def _later(self, name: str, ms: int, action: Callable[..., None], *args: Any) -> None:
        """Run ``action`` in ``ms`` milliseconds: the connection's one timer of that name."""
        self.timers[name] = self.loop.call_later(ms / 1000, action, *args)

    def _keepalive(self) -> None:
        """Every keepalive_time_ms: a PING, unless one is still out (grpc's servers
        ignore http2_max_pings_without_data, and so does this one)."""
        s = self.settings
        if self.transport is None:
            return
        self._later("keepalive", s.keepalive_time_ms, self._keepalive)
        if self.ping_sent_at is not None:
            return  # the last one is still out; its own timer closes if it stays so
        if not self.calls and not s.keepalive_permit_without_calls:
            return
        sent = self.ping_sent_at = time.monotonic()
        self._out(frame(PING, 0, 0, b"dlserve\x00"))
        self._later("ping", s.keepalive_timeout_ms, self._ping_overdue, sent)

    def _ping_overdue(self, sent: float) -> None:
        if self.ping_sent_at == sent and self.transport is not None:
            log.info("gRPC keepalive ping unanswered; closing the connection")
            self.transport.abort()

    def _aged(self) -> None:
        self.go_away()
        grace = self.settings.max_connection_age_grace_ms
        if grace > 0:
            self._later("grace", grace, self.close)

    def go_away(self, code: int = NO_ERROR, debug: bytes = b"") -> None:
        """No new calls on this connection; those in flight go on."""
        if self.transport is not None and not self.going_away:
            self.going_away = True
            payload = U32.pack(self.last_stream) + U32.pack(code) + debug
            self._out(frame(GOAWAY, 0, 0, payload))

    def close(self, lingering: bool = False) -> None:
        """Drop the calls, send what is queued and close (``lingering``: see _fail)."""
        self.closed = True
        for call in list(self.calls.values()):
            self._drop(call)
        for timer in self.timers.values():
            timer.cancel()  # (a keepalive ping's would reset a lingering connection)
        if self.transport is not None:
            self._send_out()
            if lingering:
                self.lingering = linger(self.transport)
            else:
                self.transport.close()

    def _out(self, data: bytes | memoryview) -> None:
        """Queue bytes for the socket, sent at the end of this turn of the event loop:
        the answers of calls that complete together (16 streams share perf_analyzer's
        one connection) leave in one system call, which on loopback also pays for the
        receiver's side of TCP. Nothing more goes out once the connection is closed."""
        if self.closed:
            return
        self.outgoing.append(data)
        if not self.send_pending:
            self.send_pending = True
            self.loop.call_soon(self._send_out)

    def _send_out(self) -> None:
        self.send_pending = False
        outgoing, self.outgoing = self.outgoing, []
        if self.transport is None or not outgoing:
            return
        if len(outgoing) == 1:
            self.transport.write(outgoing[0])
        elif sum(len(part) for part in outgoing) <= 1 << 16:
            self.transport.write(b"".join(outgoing))
        else:
            self.transport.writelines(outgoing)

    def _fail(self, code: int, debug: str) -> None:
        """A connection error (RFC 9113 §5.4.1): GOAWAY and close. The client may still
        be sending (the rest of what held the bad frame, a request's DATA): a lingering
        close, so that its kernel gets a FIN after the GOAWAY, not a reset that may lose it."""
        log.info("gRPC connection error: %s", debug)
        self.going_away = False
        self.go_away(code, debug.encode())
        self.close(lingering=True)

    # -- frames in -------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.closed:  # (lingering after a connection error: dropped unread)
            if self.lingering is not None:
                self.lingering.received(len(data))
            return
        if self.buffer:
            self.buffer += data
            data = self.buffer  # type: ignore[assignment]
        if not self.preface:
            if len(data) < len(PREFACE):
                if not PREFACE.startswith(bytes(data)):
                    self._fail(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                elif not self.buffer:
                    self.buffer += data
                return
            if bytes(data[: len(PREFACE)]) != PREFACE:
                self._fail(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                return
            self.preface = True
            data = data[len(PREFACE) :]
            self.buffer = bytearray()
        view = memoryview(data)
        size = len(data)
        pos = 0
        unpack = HEAD.unpack_from
        try:
            while size - pos >= 9 and not self.closed:
                word, flags, stream_id = unpack(data, pos)
                length = word >> 8
                end = pos + 9 + length
                if end > size and length <= RECEIVE_FRAME:
                    break
                if length > RECEIVE_FRAME:
                    self._fail(FRAME_SIZE_ERROR, f"frame of {length} bytes")
                    return
                kind = word & 0xFF
                stream_id &= 0x7FFFFFFF
                if kind == DATA:
                    self._data(flags, stream_id, view, pos + 9, end)
                elif kind == HEADERS or kind == CONTINUATION:
                    self._headers(kind, flags, stream_id, bytes(view[pos + 9 : end]))
                elif self.headers_of is not None:
                    self._fail(PROTOCOL_ERROR, "a frame inside a header block")
                else:
                    self._control(kind, flags, stream_id, bytes(view[pos + 9 : end]))
                pos = end
        except Exception as exc:  # noqa: BLE001 - a malformed frame: the peer's error, not ours
            self._fail(PROTOCOL_ERROR, f"malformed frame: {type(exc).__name__}: {exc}")
            return
        finally:
            view.release()
        if data is self.buffer:
            del self.buffer[:pos]
        elif pos < size:
            self.buffer = bytearray(data[pos:])
        if self.received > TOP_UP and self.transport is not None:
            self._out(frame(WINDOW_UPDATE, 0, 0, U32.pack(self.received)))
            self.received = 0
        if len(self.outgoing) > FLUSH_FRAMES:
            # Written now, not at the end of the loop's turn: the event loop may read
            # the socket many times in one turn, and a peer that reads nothing is to be
            # paused (pause_writing) before the next read, not after megabytes of them.
            self._send_out()

    def _data(self, flags: int, stream_id: int, view: memoryview, start: int, end: int) -> None:
        if self.headers_of is not None:
            self._fail(PROTOCOL_ERROR, "a frame inside a header block")
            return
        self.received += end - start
        call = self.calls.get(stream_id)
        if call is not None:
            call.received += end - start  # padding included, as the windows count it
            call.total += end - start
        if flags & PADDED and end > start:
            end -= view[start]
            start += 1
            if end < start:
                self._fail(PROTOCOL_ERROR, "padding longer than the frame")
                return
        if call is None and (stream_id == 0 or stream_id > self.last_stream):
            self._fail(PROTOCOL_ERROR, f"DATA on stream {stream_id}, which is not open")
            return
        if call is None or call.remote_closed:
            return  # answered already (or reset): the bytes only count for the window
        try:
            call.feed(view, start, end)
        except Abort as abort:
            self._refuse(call, abort.code, abort.details)
            return
        if flags & END_STREAM:
            self._remote_end(call)
        else:
            self.reopen(call)

    def reopen(self, call: CallContext) -> None:
        """Give a stream back the window its bytes took, but for messages it holds
        unread, once that comes to half the window (one WINDOW_UPDATE per half)."""
        free = call.received - call.held
        if free >= STREAM_WINDOW // 2 and self.transport is not None and not call.remote_closed:
            self._out(frame(WINDOW_UPDATE, 0, call.stream_id, U32.pack(free)))
            call.received -= free

    def _headers(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if kind == CONTINUATION:
            pending = self.headers_of
            if pending is None or pending[0] != stream_id:
                self._fail(PROTOCOL_ERROR, "unexpected CONTINUATION frame")
                return
            pending[2].extend(payload)
            if len(pending[2]) > BLOCK_LIMIT:
                # a header block that never ends must not grow without bound
                self._fail(ENHANCE_YOUR_CALM, "header block too large")
                return
            if not flags & END_HEADERS:
                return
            self.headers_of = None
            stream_flags, block = pending[1], bytes(pending[2])
        else:
            if flags & PADDED and payload:
                payload = payload[1 : len(payload) - payload[0]]
            if flags & PRIORITY_FLAG:
                payload = payload[5:]
            if not flags & END_HEADERS:
                self.headers_of = (stream_id, flags, bytearray(payload))
                return
            stream_flags, block = flags, payload
        try:
            headers = self.decoder.decode(block)
        except HPACKError as exc:
            self._fail(COMPRESSION_ERROR, f"bad header block: {exc}")
            return
        call = self.calls.get(stream_id)
        if call is not None:  # trailers from the client end its half of the call
            if stream_flags & END_STREAM:
                self._remote_end(call)
            return
        if stream_id % 2 == 0:
            self._fail(PROTOCOL_ERROR, f"HEADERS on stream {stream_id}, which a client cannot open")
            return
        if stream_id <= self.last_stream:
            return  # a stream we have ended and forgotten: its late frames are ignored
        self.last_stream = stream_id
        if self.going_away or len(self.calls) >= MAX_STREAMS:
            self._reset(stream_id, REFUSED_STREAM)  # the client may retry (elsewhere)
            return
        self._start(stream_id, headers, bool(stream_flags & END_STREAM))

    def _start(self, stream_id: int, headers: list[tuple[str, str]], ended: bool) -> None:
        if self.admitted:
            self.server.cap.busy(self)
        call = CallContext(self, stream_id)
        call.remote_closed = ended  # (a refusal below needs no RST_STREAM then)
        self.calls[stream_id] = call
        try:
            path, seconds = call.read_headers(headers)
        except HttpRefusal as refusal:
            self._send_trailers(call, refusal.block)
            return
        if sum(len(name) + len(value) + 32 for name, value in headers) > HEADER_LIST_LIMIT:
            self._refuse(call, grpc.StatusCode.RESOURCE_EXHAUSTED, "header list too large")
            return
        if seconds is not None:
            call.timer = self.loop.call_later(seconds, self._expire, call)
        method = self.server.methods.get(path)
        if method is None:
            self._refuse(call, grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {path}")
            return
        call.remote_closed = False
        call.method = method
        if method.client_streaming:
            call.messages = asyncio.Queue()
            call.task = self.loop.create_task(call.run())
        if ended:
            self._remote_end(call)

    def _remote_end(self, call: CallContext) -> None:
        """The client has sent all it will: a unary call can run now."""
        if call.remote_closed:
            return
        call.remote_closed = True
        if call.body is not None or call.prefix:
            self._refuse(call, grpc.StatusCode.INTERNAL, "the call ended inside a message")
            return
        messages = call.messages
        if isinstance(messages, asyncio.Queue):
            messages.put_nowait(None)
        elif call.task is None and not call.finished:
            if not messages:  # (a second one was refused as it came)
                self._refuse(call, grpc.StatusCode.INTERNAL, "a unary call without a message")
                return
            call.task = self.loop.create_task(call.run())

    def _expire(self, call: CallContext) -> None:
        call.expired = True
        if call.finished:  # answered, but the answer still waits for window: give up on it
            self._reset(call.stream_id, CANCEL)
            self._drop(call)
        elif call.task is not None and not call.task.done():
            call.task.cancel()
        else:
            self._refuse(call, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    def _control(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        transport = self.transport
        if transport is None:
            return
        problem = _misplaced(kind, flags, stream_id, len(payload))
        if problem is not None:
            self._fail(*problem)
            return
        if kind == SETTINGS:
            if flags & ACK:
                return
            if len(payload) % 6:
                self._fail(FRAME_SIZE_ERROR, "SETTINGS frame size")
                return
            for i in range(0, len(payload), 6):
                key, value = SETTING.unpack_from(payload, i)
                if key == INITIAL_WINDOW_SIZE and value > MAX_WINDOW:
                    self._fail(FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE above 2^31-1")
                    return
                if key == MAX_FRAME_SIZE and not MAX_FRAME <= value <= MAX_FRAME_LIMIT:
                    self._fail(PROTOCOL_ERROR, f"SETTINGS_MAX_FRAME_SIZE {value}")
                    return
                if key == INITIAL_WINDOW_SIZE:  # applies to open streams too
                    delta = value - self.peer_window
                    self.peer_window = value
                    for call in self.calls.values():
                        call.window += delta
                elif key == MAX_FRAME_SIZE:
                    self.peer_frame = value
            self._out(frame(SETTINGS, ACK, 0))
            self._flush()
        elif kind == PING:
            if flags & ACK:
                self.ping_sent_at = None
                return
            if self._ping_abuse():
                self._fail(ENHANCE_YOUR_CALM, "too_many_pings")
                return
            self._out(frame(PING, ACK, 0, payload))
        elif kind == WINDOW_UPDATE:
            increment = U32.unpack_from(payload)[0] & 0x7FFFFFFF
            if stream_id == 0:
                if not increment or self.send_window + increment > MAX_WINDOW:
                    code = FLOW_CONTROL_ERROR if increment else PROTOCOL_ERROR
                    self._fail(code, f"connection WINDOW_UPDATE of {increment}")
                    return
                self.send_window += increment
            else:
                call = self.calls.get(stream_id)
                if call is not None:
                    if not increment or call.window + increment > MAX_WINDOW:  # a stream error
                        self._reset(stream_id, FLOW_CONTROL_ERROR if increment else PROTOCOL_ERROR)
                        self._drop(call)
                        return
                    call.window += increment
            self._flush()
        elif kind == RST_STREAM:
            call = self.calls.get(stream_id)
            if call is not None:
                self._drop(call)
        elif kind == GOAWAY:
            self.going_away = self.peer_gone = True  # the client opens no more calls here
            if not self.calls:
                self.close()
        elif kind == PRIORITY and len(payload) != 5:  # (RFC 9113 6.3: a stream error)
            self._reset(stream_id, FRAME_SIZE_ERROR)
            call = self.calls.get(stream_id)
            if call is not None:
                self._drop(call)
        # PRIORITY, PUSH_PROMISE (never from a client), unknown types: nothing to do

    def _ping_abuse(self) -> bool:
        """grpc's policy (see the module docstring): pings closer together than the
        allowed interval, while we send nothing, are strikes; too many strikes end the
        connection, whether calls are open on it or not."""
        now = time.monotonic()
        last, self.last_ping_received = self.last_ping_received, now
        s = self.settings
        if s.http2_max_ping_strikes <= 0:
            return False
        interval = (
            s.http2_min_recv_ping_interval_without_data_ms / 1000
            if self.calls or s.keepalive_permit_without_calls
            else 7200.0
        )
        if last and now - last < interval:
            self.ping_strikes += 1
        return self.ping_strikes > s.http2_max_ping_strikes

    # -- frames out ------------------------------------------------------------------------
    def send_data(
        self,
        call: CallContext,
        head: bytes,
        prefix: bytes,
        pieces: list[bytes | memoryview],
        size: int,
        trailers: bytes | None = None,
    ) -> None:
        """Send ``head`` (frames that need no window), then a message's 5-byte prefix
        and its ``size`` bytes in ``pieces`` as DATA, then the ``trailers`` block if
        given: now if the windows allow (all in one write), else as they open. Pieces
        are sent as they are: views stay views until the socket."""
        transport = self.transport
        if transport is None:
            return
        self.ping_strikes, self.last_ping_received = 0, 0.0  # (as grpc: data forgives pings)
        size += len(prefix)
        if (
            not call.outbox
            and size <= min(self.peer_frame, INLINE_SEND)
            and size <= self.send_window
            and size <= call.window
        ):
            self.send_window -= size
            call.window -= size
            data = HEAD.pack((size << 8) | DATA, 0, call.stream_id)
            if trailers is None:
                self._out(b"".join((head, data, prefix, *pieces)))
            else:
                end = self._end_frames(call, trailers)
                self._out(b"".join((head, data, prefix, *pieces, end)))
                self._forget(call)
            return
        if head:
            self._out(head)
        step = self.peer_frame
        queued = not call.outbox
        outbox = call.outbox
        outbox.append(memoryview(prefix))  # (a bytes entry would be the trailers)
        for piece in pieces:
            view = memoryview(piece).cast("B")
            outbox.extend(view[i : i + step] for i in range(0, view.nbytes, step))
        if trailers is not None:
            outbox.append(trailers)
        if queued:
            self.blocked.append(call)
        self._flush()

    def send_trailers(self, call: CallContext, block: bytes) -> None:
        if call.outbox:
            # after the data still waiting for window; the deadline still holds for it
            call.outbox.append(block)
            return
        self._send_trailers(call, block)

    def _send_trailers(self, call: CallContext, block: bytes) -> None:
        transport = self.transport
        self.ping_strikes = 0
        if transport is not None:
            self._out(self._end_frames(call, block))
        self._forget(call)

    @staticmethod
    def _end_frames(call: CallContext, block: bytes) -> bytes:
        """The trailers' HEADERS frame that ends a call's stream on our side."""
        flags = END_HEADERS | END_STREAM
        out = HEAD.pack((len(block) << 8) | HEADERS, flags, call.stream_id) + block
        if not call.remote_closed:
            # the answer is complete; the client need send no more (RFC 9113 §8.1)
            out += frame(RST_STREAM, 0, call.stream_id, U32.pack(NO_ERROR))
        return out

    def _flush(self) -> None:
        """Send what the windows allow of the calls waiting, in order; a call whose
        stream window is closed waits without holding up the others."""
        transport = self.transport
        if transport is None:
            return
        waiting: collections.deque[CallContext] = collections.deque()
        for call in self.blocked:
            outbox = call.outbox
            while outbox:
                chunk = outbox[0]
                if isinstance(chunk, bytes):  # the trailers
                    outbox.popleft()
                    self._send_trailers(call, chunk)
                    break
                allowed = min(self.send_window, call.window)
                if allowed <= 0:
                    break
                if len(chunk) > allowed:
                    outbox[0] = chunk[allowed:]
                    chunk = chunk[:allowed]
                else:
                    outbox.popleft()
                self.send_window -= len(chunk)
                call.window -= len(chunk)
                self._out(HEAD.pack((len(chunk) << 8) | DATA, 0, call.stream_id))
                self._out(chunk)
                self.ping_strikes, self.last_ping_received = 0, 0.0  # (as in send_data)
            if outbox:
                waiting.append(call)
            else:
                call.wake_sender()
        self.blocked = waiting

    def drop_stalled(self, call: CallContext, timeout: float) -> None:
        """A request message that stopped coming: the call ends DEADLINE_EXCEEDED and
        what it had received goes."""
        log.info("gRPC call on stream %d: its request message stalled", call.stream_id)
        call.body, call.prefix = None, b""
        self._refuse(
            call,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"request message stalled: nothing received for {timeout:g} s",
        )

    def _refuse(self, call: CallContext, code: grpc.StatusCode, details: str) -> None:
        """End a call from the transport (bad message, deadline, unknown method), unless
        its answer is complete already (its trailers may still wait for window). With a
        message part-sent, trailers would follow a cut message: the stream is reset."""
        if call.finished:
            return
        if call.task is not None and not call.task.done():
            call.task.cancel()
        if call.outbox:
            self._reset(call.stream_id, CANCEL)
            self._drop(call)
            return
        call.finish(code, details)

    def _reset(self, stream_id: int, code: int) -> None:
        if self.transport is not None:
            self._out(frame(RST_STREAM, 0, stream_id, U32.pack(code)))

    def _drop(self, call: CallContext) -> None:
        """The client reset the call or went away: stop it, send nothing more."""
        call.finished = True
        call.outbox.clear()
        call.wake_sender()
        if call.task is not None and not call.task.done():
            call.task.cancel()
        self._forget(call)

    def _forget(self, call: CallContext) -> None:
        if call.timer is not None:
            call.timer.cancel()
        self.calls.pop(call.stream_id, None)
        if self.peer_gone and not self.calls:
            self.close()  # (its last call is over, and the client said it opens no more)
        elif self.admitted and self.sheddable():
            self.server.cap.idle(self)
        self.server.ended(self)


# RFC 9113 §6: the frames that belong to the connection (stream 0) or to a stream, and the
# payload sizes each must have (None: any); a frame out of place is a connection error.
_CONNECTION_FRAMES = {SETTINGS: "SETTINGS", PING: "PING", GOAWAY: "GOAWAY"}
_STREAM_FRAMES = {RST_STREAM: "RST_STREAM", PRIORITY: "PRIORITY"}
_PAYLOAD_SIZES = {PING: 8, WINDOW_UPDATE: 4, RST_STREAM: 4}  # (PRIORITY's: a stream error)


def _misplaced(kind: int, flags: int, stream_id: int, size: int) -> tuple[int, str] | None:
    """(error code, why) for a control frame on the wrong stream or of the wrong size."""
    if stream_id and kind in _CONNECTION_FRAMES:
        return PROTOCOL_ERROR, f"{_CONNECTION_FRAMES[kind]} frame on stream {stream_id}"
    if not stream_id and kind in _STREAM_FRAMES:
        return PROTOCOL_ERROR, f"{_STREAM_FRAMES[kind]} frame on stream 0"
    expected = _PAYLOAD_SIZES.get(kind)
    if kind == SETTINGS and flags & ACK:
        expected = 0
    if (expected is not None and size != expected) or (kind == GOAWAY and size < 8):
        return FRAME_SIZE_ERROR, f"frame of type {kind} with a {size}-byte payload"
    return None


def tls_context(cert: bytes | str, key: str, root: str | None, mutual: bool) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    if root:
        context.load_verify_locations(root)
    if mutual:
        context.verify_mode = ssl.CERT_REQUIRED
    context.set_alpn_protocols(["h2"])
    return context


class GrpcTransport:
    """A listening socket and its connections, serving ``methods`` (by path)."""

    def __init__(self, methods: dict[str, Method], settings: Settings) -> None:
        self.methods = methods
        self.settings = settings
        self.connections: set[Connection] = set()
        self.cap = ConnectionCap(settings.max_connections, "gRPC")
        self._sweeper = Sweeper(settings.message_timeout, self._sweep)
        self._server: asyncio.AbstractServer | None = None
        self._idle: asyncio.Event | None = None
        self.stopping = False

    async def listen(
        self, host: str, port: int, tls: ssl.SSLContext | None, reuse_port: bool
    ) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: Connection(self),
            host or None,
            port,
            ssl=tls,
            reuse_port=reuse_port or None,
            reuse_address=True,
        )
        self._sweeper.start()
        return int(self._server.sockets[0].getsockname()[1])

    def _sweep(self, now: float) -> None:
        for connection in list(self.connections):
            transport = connection.transport
            held_back = transport is None or not transport.is_reading()
            for call in list(connection.calls.values()):
                if call.stalled(now, self._sweeper.timeout, held_back):
                    connection.drop_stalled(call, self._sweeper.timeout)

    def ended(self, connection: Connection) -> None:
        if self._idle is not None and not any(c.calls for c in self.connections):
            self._idle.set()

    async def stop(self, grace: float | None) -> None:
        """Refuse new calls (GOAWAY), give those in flight ``grace`` seconds, cancel the rest.
        Calls kept open by their clients are told (CallContext.on_server_stop): a stream
        with nothing in flight ends now rather than holding the stop for all of ``grace``."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        self._sweeper.stop()
        self.stopping = True
        for connection in list(self.connections):
            connection.go_away()
            for call in list(connection.calls.values()):
                call.server_stopping()
        if grace and any(c.calls for c in self.connections):
            self._idle = asyncio.Event()
            try:
                await asyncio.wait_for(self._idle.wait(), grace)
            except asyncio.TimeoutError:
                pass
        tasks = [
            call.task
            for connection in self.connections
            for call in connection.calls.values()
            if call.task is not None
        ]
        for connection in list(self.connections):
            connection.close()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        await server.wait_closed()


__all__ = ["Connection", "GrpcTransport", "Settings", "tls_context"]
