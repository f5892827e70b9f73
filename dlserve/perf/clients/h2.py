"""Unary gRPC calls over a hand-driven HTTP/2 connection: the leanest client Python allows.

Python's grpcio costs about 250 µs of CPU per unary call on a small request and adds a
thread hop to every answer, which makes a Python load generator the bottleneck at low
concurrency. A benchmark sends the same few requests over and over, so most of HTTP/2
can be done once, up front:

* the request's HEADERS block is HPACK-encoded once, with literals that never touch the
  dynamic table (so the server's decoder state never changes), and the gRPC message is
  framed once (``0`` + 4-byte length + the serialized ``ModelInferRequest``) and cut into
  DATA frames of at most 16 KiB (a size every server accepts);
* per request only the 9-byte frame headers carrying the stream id are built, and the
  HEADERS and DATA frames go out in one ``transport.write``;
* answers are not decoded: a stream that ends after a DATA frame carrying the response
  message succeeded; one that ends without (a trailers-only answer, RST_STREAM) failed,
  and the slot asks grpcio for that request's error message once, to report it. (With
  ``--profile-export-file`` the response message is kept, to be decoded after the run.)

The connection honours what a peer may require: SETTINGS (acknowledged; the server's
initial window and stream limit applied), PING (answered), flow control both ways (our
receive windows are opened wide and topped up; sends wait for the server's window),
GOAWAY (streams above its last id fail; the next request opens a new connection).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import struct
import time
import zlib
from typing import Any

from dlserve.frontends.http2 import (
    ACK,
    DATA,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    GRPC_ENCODING_WBITS,
    HEAD,
    HEADERS,
    MAX_FRAME,
    MAX_WINDOW,
    PING,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
    hpack_int,
    hpack_string,
)
from dlserve.perf.clients.base import RequestError, Slot, no_delay


def request_headers(path: str, authority: str, encoding: str | None = None, tls: bool = False) -> bytes:
    """The HPACK block of a gRPC call: static-table entries and literals without indexing
    (``encoding``: the messages' compression, gzip or deflate)."""
    return b"".join([
        b"\x83",  # :method POST (static 3)
        b"\x87" if tls else b"\x86",  # :scheme https (static 7) or http (6)
        hpack_int(4, 4, 0x00) + hpack_string(path),  # :path (name: static 4)
        hpack_int(1, 4, 0x00) + hpack_string(authority),  # :authority (static 1)
        hpack_int(31, 4, 0x00) + hpack_string("application/grpc"),  # content-type (static 31)
        b"\x00" + hpack_string("te") + hpack_string("trailers"),
        hpack_int(58, 4, 0x00) + hpack_string("dlserve-perf"),  # user-agent (static 58)
        b"\x00" + hpack_string("grpc-encoding") + hpack_string(encoding) if encoding else b"",
    ])


def unframe(framed: bytes) -> bytes:
    """The serialized message inside :func:`grpc_message`'s framing."""
    return zlib.decompress(framed[5:], wbits=47) if framed[:1] == b"\x01" else framed[5:]  # (47: either)


def grpc_message(serialized: bytes, encoding: str | None = None) -> bytes:
    """A length-prefixed gRPC message, compressed with ``encoding`` if given."""
    if encoding:
        packer = zlib.compressobj(wbits=GRPC_ENCODING_WBITS[encoding])
        packed = packer.compress(serialized) + packer.flush()
        return b"\x01" + len(packed).to_bytes(4, "big") + packed
    return b"\x00" + len(serialized).to_bytes(4, "big") + serialized


class _Stream:
    __slots__ = ("waiter", "got_data", "pending", "window", "body")

    def __init__(self, waiter: asyncio.Future[bool], window: int, body: list[bytes] | None) -> None:
        self.waiter = waiter
        self.got_data = False
        self.body = body  # where the DATA received goes, if anywhere
        self.pending: collections.deque[memoryview] = collections.deque()  # DATA not yet sent
        self.window = window


class H2Connection(asyncio.Protocol):
    """One HTTP/2 connection carrying many concurrent unary calls."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.streams: dict[int, _Stream] = {}
        self.next_stream = 1
        self.send_window = DEFAULT_WINDOW  # connection-level, towards the server
        self.stream_window = DEFAULT_WINDOW  # the server's SETTINGS_INITIAL_WINDOW_SIZE
        self.max_streams = 2**31
        self.received = 0  # DATA bytes since our last connection WINDOW_UPDATE
        self.closed: str | None = None
        self.blocked: collections.deque[int] = collections.deque()  # streams waiting for window
        self.slot_freed: asyncio.Event | None = None

    # -- connection -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        no_delay(transport)
        settings = struct.pack(">HI", 0x2, 0) + struct.pack(">HI", 0x4, MAX_WINDOW)  # no push; wide windows
        self.transport.write(
            PREFACE + frame(SETTINGS, 0, 0, settings)
            + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", MAX_WINDOW - DEFAULT_WINDOW))
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._close(f"connection lost{f': {exc}' if exc else ''}")

    def _close(self, reason: str) -> None:
        if self.closed is None:
            self.closed = reason
        for stream_id in list(self.streams):
            self._end(stream_id, RequestError(f"gRPC connection: {reason}"))
        self._wake()

    @property
    def usable(self) -> bool:
        return self.transport is not None and self.closed is None and self.next_stream < 2**31 - 2

    # -- sending ------------------------------------------------------------------------------
    def call(self, headers: bytes, message: bytes, body: list[bytes] | None = None) -> asyncio.Future[bool]:
        """Start one call; the future says whether a response message came back (whose
        DATA goes to ``body`` when one is given)."""
        waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        if not self.usable or self.transport is None:
            waiter.set_exception(RequestError(f"gRPC connection: {self.closed or 'not connected'}"))
            return waiter
        stream_id = self.next_stream
        self.next_stream += 2
        stream = _Stream(waiter, self.stream_window, body)
        self.streams[stream_id] = stream
        size = len(message)
        if size <= MAX_FRAME and size <= self.send_window and size <= stream.window:
            self.send_window -= size
            stream.window -= size
            self.transport.write(
                HEAD.pack((len(headers) << 8) | HEADERS, END_HEADERS, stream_id) + headers
                + HEAD.pack((size << 8) | DATA, END_STREAM, stream_id) + message
            )
            return waiter
        self.transport.write(HEAD.pack((len(headers) << 8) | HEADERS, END_HEADERS, stream_id) + headers)
        view = memoryview(message)
        stream.pending.extend(view[i : i + MAX_FRAME] for i in range(0, size, MAX_FRAME))
        self.blocked.append(stream_id)
        self._flush()
        return waiter

    def _flush(self) -> None:
        """Send what the windows allow of the streams waiting, in order; a stream whose
        own window is shut waits without holding up the others."""
        transport = self.transport
        if transport is None:
            return
        waiting: collections.deque[int] = collections.deque()
        for stream_id in self.blocked:
            stream = self.streams.get(stream_id)
            if stream is None:
                continue
            while stream.pending:
                chunk = stream.pending[0]
                allowed = min(self.send_window, stream.window)
                if allowed <= 0:
                    break
                if len(chunk) > allowed:
                    stream.pending[0] = chunk[allowed:]
                    chunk = chunk[:allowed]
                else:
                    stream.pending.popleft()
                last = not stream.pending
                self.send_window -= len(chunk)
                stream.window -= len(chunk)
                transport.write(HEAD.pack((len(chunk) << 8) | DATA, END_STREAM if last else 0, stream_id))
                transport.write(chunk)
            if stream.pending:
                waiting.append(stream_id)
        self.blocked = waiting

    # -- receiving ----------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        buffer = self.buffer + data if self.buffer else data
        size = len(buffer)
        pos = 0
        unpack = HEAD.unpack_from
        while size - pos >= 9:
            word, flags, stream_id = unpack(buffer, pos)
            length = word >> 8
            end = pos + 9 + length
            if end > size:
                break
            kind = word & 0xFF
            stream_id &= 0x7FFFFFFF
            if kind == DATA:
                self.received += length
                stream = self.streams.get(stream_id)
                if stream is not None:
                    if length:
                        stream.got_data = True
                        if stream.body is not None:
                            stream.body.append(buffer[pos + 9 : end])
                    if flags & END_STREAM:
                        self._end(stream_id)
            elif kind == HEADERS:
                if flags & END_STREAM:
                    self._end(stream_id)
            else:
                self._control(kind, flags, stream_id, buffer[pos + 9 : end])
            pos = end
        self.buffer = buffer[pos:] if pos < size else b""
        if self.received > 1 << 30 and self.transport is not None:
            self.transport.write(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self.received)))
            self.received = 0

    def _end(self, stream_id: int, error: RequestError | None = None) -> None:
        """A stream is over (answered, reset, or cut off with the connection): its call
        learns the outcome and a call waiting for a free stream slot wakes up."""
        stream = self.streams.pop(stream_id, None)
        if stream is not None and not stream.waiter.done():
            if error is None:
                stream.waiter.set_result(stream.got_data)
            else:
                stream.waiter.set_exception(error)
        self._wake()

    def _wake(self) -> None:
        if self.slot_freed is not None:
            self.slot_freed.set()

    def _control(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        transport = self.transport
        if kind == SETTINGS:
            if flags & ACK or transport is None:
                return
            for i in range(0, len(payload) - len(payload) % 6, 6):
                key, value = struct.unpack_from(">HI", payload, i)
                if key == 0x4:  # INITIAL_WINDOW_SIZE: applies to open streams too
                    delta = value - self.stream_window
                    self.stream_window = value
                    for stream in self.streams.values():
                        stream.window += delta
                elif key == 0x3:
                    self.max_streams = value
            transport.write(frame(SETTINGS, ACK, 0))
            self._flush()
        elif kind == PING:
            if not flags & ACK and transport is not None:
                transport.write(frame(PING, ACK, 0, payload))
        elif kind == WINDOW_UPDATE:
            (increment,) = struct.unpack_from(">I", payload)
            increment &= 0x7FFFFFFF
            if stream_id == 0:
                self.send_window += increment
            else:
                stream = self.streams.get(stream_id)
                if stream is not None:
                    stream.window += increment
            self._flush()
        elif kind == RST_STREAM:
            (code,) = struct.unpack_from(">I", payload)
            self._end(stream_id, RequestError(f"the server reset the stream (HTTP/2 error {code})"))
        elif kind == GOAWAY:
            last, code = struct.unpack_from(">II", payload)
            last &= 0x7FFFFFFF
            detail = payload[8:].decode(errors="replace")
            reason = f"the server sent GOAWAY (error {code}{', ' + detail if detail else ''})"
            self.closed = self.closed or reason
            for sid in [s for s in self.streams if s > last]:
                self._end(sid, RequestError(f"gRPC connection: {reason}"))
            self._wake()  # calls waiting for a slot go on to a new connection
        # PRIORITY, PUSH_PROMISE (disabled), CONTINUATION, unknown types: nothing to do


class H2Channel:
    """The process's connection (reopened after GOAWAY or loss) and error descriptions."""

    def __init__(self, url: str, path: str, encoding: str | None = None, tls: ssl.SSLContext | None = None) -> None:
        self.url = url
        host, _, port = url.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        self.tls = tls
        self.headers = request_headers(path, url, encoding, tls is not None)
        self.connection: H2Connection | None = None
        self._connecting: asyncio.Future[H2Connection] | None = None

    async def connect(self) -> H2Connection:
        connection = self.connection
        if connection is not None and connection.usable:
            return connection
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
        try:
            return await asyncio.shield(self._connecting)
        finally:
            if self._connecting is not None and self._connecting.done():
                self._connecting = None

    async def _open(self) -> H2Connection:
        old = self.connection
        loop = asyncio.get_running_loop()
        try:
            _, connection = await loop.create_connection(
                H2Connection, self.host, self.port, ssl=self.tls, server_hostname=self.host if self.tls else None
            )
        except OSError as exc:
            raise RequestError(f"cannot connect to {self.url}: {exc}") from None
        self.connection = connection
        if old is not None and old.transport is not None and not old.streams:
            old.transport.close()
        return connection

    def close(self) -> None:
        if self.connection is not None and self.connection.transport is not None:
            self.connection.transport.close()
        self.connection = None


class H2Slot(Slot):
    """A unary-call site on the shared :class:`H2Channel`."""

    def __init__(self, channel: H2Channel, describe: Any) -> None:
        self.channel = channel
        self.describe = describe  # async (framed message) -> error text, through grpcio

    async def infer(self, payload: bytes) -> tuple[int, int]:
        connection = self.channel.connection
        if connection is None or not connection.usable:
            connection = await self.channel.connect()
        while connection.usable and len(connection.streams) >= connection.max_streams:
            # the server's stream limit: wait for a stream to end (or the connection to)
            connection.slot_freed = connection.slot_freed or asyncio.Event()
            connection.slot_freed.clear()
            await connection.slot_freed.wait()
        body = None if self.captured is None else []
        ok = await connection.call(self.channel.headers, payload, body)
        if not ok:
            raise RequestError(await self.describe(payload))
        if body is not None:
            self.captured = [(time.perf_counter_ns(), unframe(b"".join(body)))]
        return 0, 0
