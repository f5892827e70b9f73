"""One gRPC call on an HTTP/2 stream: its metadata, its messages in, its answer out.

A :class:`CallContext` is also what the call's handler gets as its context: the part
of grpc's servicer context the servicer uses (``invocation_metadata()``,
``await abort(code, details)``, ``set_compression(name)``), and ``on_server_stop(hook)``.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import logging
import re
import time
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
import numpy as np

from dlserve.errors import ErrorCode, TritonError
from dlserve.frontends.http2 import END_HEADERS, GRPC_ENCODING_WBITS, HEAD, HEADERS, literal

if TYPE_CHECKING:
    from dlserve.frontends.grpc_transport import Connection

log = logging.getLogger("dlserve.frontends.grpc")
Buffer = bytes | memoryview  # a received message

_TIMEOUT = re.compile(r"([0-9]{1,8})([HMSmun])")
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
_CODECS = ("gzip", "deflate")
MAX_PROTOBUF_MESSAGE = 2**31 - 1  # the largest message protobuf serializes or parses
# :status 200 (static 8), content-type, and the encodings the server reads (as grpc's servers say)
_OK_HEADERS = (
    b"\x88" + literal(31, "application/grpc") + literal("grpc-accept-encoding", ", ".join(("identity", *_CODECS)))
)
_HEADER_BLOCKS = {
    name: _OK_HEADERS + literal("grpc-encoding", name) for name in ("identity", *_CODECS)
}
_OK_TRAILERS = literal("grpc-status", "0")
# HTTP/2 header fields that are transport, not call metadata (grpc hides them as well)
_NOT_METADATA = frozenset(
    ("content-type", "te", "grpc-timeout", "grpc-encoding", "grpc-accept-encoding")
)


class HttpRefusal(Exception):
    """Not a gRPC call at all: answered with an HTTP status (the header ``block``)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.block = literal(8, str(status))  # :status (static 8)


# dlserve's error codes as gRPC status codes (Triton's table)
GRPC_CODES = {
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.INVALID_ARG: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorCode.UNKNOWN: grpc.StatusCode.UNKNOWN,
}


def status_of(error: TritonError) -> grpc.StatusCode:
    return GRPC_CODES.get(error.code, grpc.StatusCode.UNKNOWN)


class Abort(Exception):
    """Ends a call with a non-OK status (what ``await context.abort(...)`` raises)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


@dataclass(frozen=True)
class Method:
    """One RPC: how its messages are read and written and which coroutine serves it."""

    behaviour: Callable[..., Any]
    decode: Callable[[Buffer], Any]
    encode: Callable[[Any], bytes | list[bytes | memoryview]]
    client_streaming: bool
    server_streaming: bool


def _percent_encode(text: str) -> bytes:
    """grpc-message's encoding: printable ASCII but '%' as is, the rest as %XX of UTF-8."""
    return b"".join(
        bytes([byte]) if 0x20 <= byte <= 0x7E and byte != 0x25 else b"%%%02X" % byte
        for byte in text.encode()
    )


def _timeout(value: str) -> float | None:
    """grpc-timeout's seconds: 1 to 8 ASCII digits and a unit (None if malformed)."""
    match = _TIMEOUT.fullmatch(value)
    return int(match[1]) * _TIMEOUT_UNITS[match[2]] if match else None


def trailers(code: grpc.StatusCode, details: str) -> bytes:
    block = literal("grpc-status", str(code.value[0]))
    if details:
        block += literal("grpc-message", _percent_encode(details))
    return block


class CallContext:
    """One call on one stream: its metadata, and its state on the way in and out."""

    __slots__ = (
        "connection", "stream_id", "method", "metadata", "encoding", "accepts", "compression",
        "window", "outbox", "started", "finished", "remote_closed", "task", "messages",
        "prefix", "flag", "body", "filled", "received", "held", "timer", "expired",
        "started_ns", "after_send", "sender", "stop_hook", "total", "seen", "still_since",
    )  # fmt: skip

    def __init__(self, connection: Connection, stream_id: int) -> None:
        self.connection = connection
        self.stream_id = stream_id
        self.method: Method | None = None
        self.metadata: list[tuple[str, str | bytes]] = []
        self.encoding = "identity"  # of the client's messages
        self.accepts: tuple[str, ...] = ()
        self.compression: str | None = None  # of ours, once set and accepted
        self.window = connection.peer_window
        # DATA still waiting for window (views), then possibly the trailers (bytes)
        self.outbox: collections.deque[bytes | memoryview] = collections.deque()
        self.started = False  # response headers sent
        self.finished = False  # trailers queued
        self.remote_closed = False
        self.task: asyncio.Task[None] | None = None
        # a unary call's one message; a client-streaming call's as they came (body,
        # compressed, size on the wire), until its coroutine reads them
        self.messages: asyncio.Queue[tuple[Buffer, int, int] | None] | list[Buffer] = []
        self.prefix = b""  # a message prefix split across frames
        self.flag = 0  # of the message being filled: compressed or not
        self.body: memoryview | None = None  # a message being received
        self.filled = 0  # its bytes so far
        self.received = 0  # DATA bytes since this stream's window was last opened
        self.held = 0  # of them, the bytes of messages waiting unread in ``messages``
        self.timer: asyncio.TimerHandle | None = None
        self.expired = False
        self.started_ns = time.monotonic_ns()  # when the call's HEADERS came
        # called with True once the answer is handed to the connection (False: it never was)
        self.after_send: Callable[[bool], None] | None = None
        self.sender: asyncio.Future[None] | None = None  # waits until the outbox is empty
        self.stop_hook: Callable[[], None] | None = None  # (see on_server_stop)
        self.total = 0  # DATA bytes received in all
        self.seen = -1  # ``total`` at the last sweep (see stalled), -1: not watched
        self.still_since = 0.0

    # -- requests in ----------------------------------------------------------------------
    def read_headers(self, headers: list[tuple[str, str]]) -> tuple[str, float | None]:
        """Take the call's settings and metadata from its request headers; returns
        the method's path and the timeout in seconds, if any. Raises
        :class:`HttpRefusal` for a request that is not a gRPC call (gRPC over HTTP/2:
        405 for a method other than POST, 415 for a content-type not application/grpc)."""
        path = method = content_type = ""
        seconds = None
        metadata = self.metadata
        for name, value in headers:
            if name.startswith(":"):
                if name == ":path":
                    path = value
                elif name == ":method":
                    method = value
            elif name in _NOT_METADATA:
                if name == "content-type":
                    content_type = value
                elif name == "grpc-timeout":
                    seconds = _timeout(value)
                elif name == "grpc-encoding":
                    self.encoding = value
                elif name == "grpc-accept-encoding":
                    self.accepts = tuple(part.strip() for part in value.split(","))
            elif name.endswith("-bin"):
                try:
                    metadata.append((name, base64.b64decode(value + "==")))
                except ValueError:
                    metadata.append((name, value.encode()))
            else:
                metadata.append((name, value))
        if method != "POST":
            raise HttpRefusal(405)
        if not content_type.startswith("application/grpc"):
            raise HttpRefusal(415)
        return path, seconds

    def stalled(self, now: float, timeout: float, held_back: bool) -> bool:
        """The transport's sweep: whether the call has received nothing for ``timeout``
        seconds while a request message of it is under way (a message begun, or a unary
        call from its headers to its end). Not while the server holds the client back
        (``held_back``: its connection is not read; or messages wait unread here), nor
        while a streaming call waits for its next message."""
        unary = isinstance(self.messages, list) and not self.remote_closed and self.task is None
        if held_back or self.held or not (unary or self.body is not None or self.prefix):
            self.seen = -1
            return False
        if self.total != self.seen:
            self.seen, self.still_since = self.total, now
            return False
        return now - self.still_since >= timeout

    def feed(self, view: memoryview, start: int, end: int) -> None:
        """Cut gRPC messages (1-byte flag, 4-byte length, body) out of a DATA payload."""
        while start < end:
            if self.body is not None:
                take = min(len(self.body) - self.filled, end - start)
                self.body[self.filled : self.filled + take] = view[start : start + take]
                self.filled += take
                start += take
                if self.filled == len(self.body):
                    body, self.body = self.body, None
                    self._deliver(self.flag, body, 5 + len(body))
                continue
            if not self.prefix and end - start >= 5:
                prefix = bytes(view[start : start + 5])
                start += 5
            else:
                take = min(5 - len(self.prefix), end - start)
                self.prefix += bytes(view[start : start + take])
                start += take
                if len(self.prefix) < 5:
                    return
                prefix, self.prefix = self.prefix, b""
            length = int.from_bytes(prefix[1:5], "big")
            limit = self.connection.settings.max_message_size
            if length > limit:
                raise Abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"Received message larger than max ({length} vs. {limit})",
                )
            if end - start >= length:
                self._deliver(prefix[0], bytes(view[start : start + length]), 5 + length)
                start += length
            else:
                self.flag = prefix[0]
                self.filled = 0
                try:
                    # uninitialized: memory is committed as the bytes come, not at the
                    # size a client announces, and they are copied once, to where they stay
                    self.body = memoryview(np.empty(length, dtype=np.uint8))
                except MemoryError:
                    raise Abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED, f"no memory for {length} bytes"
                    ) from None

    def _deliver(self, compressed: int, body: Buffer, wire_size: int) -> None:
        messages = self.messages
        if isinstance(messages, list):
            if messages:  # refused now, not kept until the client ends its side
                raise Abort(
                    grpc.StatusCode.UNIMPLEMENTED, "a unary call takes one request message"
                )
            messages.append(self._inflated(body) if compressed else body)
        else:
            # Kept as it came (a compressed one is inflated when read): the bytes the
            # stream's window holds back are the bytes held here.
            self.held += wire_size
            messages.put_nowait((body, compressed, wire_size))

    def take(self, message: tuple[Buffer, int, int]) -> Buffer:
        """A queued message, read by the call's coroutine: its bytes no longer count
        against the stream's window."""
        body, compressed, wire_size = message
        self.held -= wire_size
        self.connection.reopen(self)
        return self._inflated(body) if compressed else body

    def _inflated(self, body: Buffer) -> Buffer:
        if self.encoding == "identity":  # (a protocol error, INTERNAL by gRPC's spec)
            raise Abort(grpc.StatusCode.INTERNAL, "a message flagged compressed on a call without grpc-encoding")
        if self.encoding not in GRPC_ENCODING_WBITS:
            raise Abort(
                grpc.StatusCode.UNIMPLEMENTED,
                f"Compressed message with grpc-encoding '{self.encoding}' is not supported",
            )
        limit = self.connection.settings.max_message_size
        inflater = zlib.decompressobj(wbits=GRPC_ENCODING_WBITS[self.encoding])
        try:
            body = inflater.decompress(body, limit + 1)
        except zlib.error as exc:
            raise Abort(grpc.StatusCode.INTERNAL, f"bad compressed message: {exc}") from None
        if len(body) > limit:
            raise Abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"Received message larger than max ({len(body)} vs. {limit})",
            )
        if not inflater.eof or inflater.unused_data:
            raise Abort(
                grpc.StatusCode.INTERNAL,
                "bad compressed message: "
                + ("cut short" if not inflater.eof else "bytes after its end"),
            )
        return body

    # -- what handlers use ---------------------------------------------------------------
    def invocation_metadata(self) -> list[tuple[str, str | bytes]]:
        return self.metadata

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        raise Abort(code, details)

    def set_compression(self, name: str) -> None:
        """Compress the answers with ``name``, or, as gRPC core does, with the other
        algorithm when the client accepts only that one (none when it accepts neither)."""
        usable = [codec for codec in (name, *_CODECS) if codec in self.accepts]
        if usable:
            self.compression = usable[0]

    def on_server_stop(self, hook: Callable[[], None]) -> None:
        """Have ``hook`` called when the server begins to stop (now if it has): a call
        its client keeps open (ModelStreamInfer) ends once it has nothing in flight,
        rather than holding the stop until the grace period runs out."""
        if self.connection.server.stopping:
            hook()
        else:
            self.stop_hook = hook

    def server_stopping(self) -> None:
        hook, self.stop_hook = self.stop_hook, None
        if hook is not None:
            hook()

    # -- answers ---------------------------------------------------------------------------
    def send_message(self, payload: bytes | list[bytes | memoryview], last: bool = False) -> None:
        """Queue one response message (after the response headers, if not yet sent);
        a list is one serialized message in pieces, sent without joining them. ``last``:
        the call ends with it, OK, the trailers going out in the same write."""
        if self.finished:
            return
        pieces = [payload] if isinstance(payload, bytes) else payload
        size = sum(memoryview(piece).nbytes for piece in pieces)
        # What the server sends is limited by protobuf's ceiling only: --grpc-max-message-size
        # guards what it takes in, and an answer already computed is not refused (Triton's
        # clients take up to that ceiling too).
        limit = MAX_PROTOBUF_MESSAGE
        if size > limit:
            raise Abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"Sent message larger than max ({size} vs. {limit})",
            )
        flag = b"\x00"
        if self.compression is not None:
            compressor = zlib.compressobj(wbits=GRPC_ENCODING_WBITS[self.compression])
            pieces = [b"".join(compressor.compress(piece) for piece in pieces) + compressor.flush()]
            size = len(pieces[0])
            flag = b"\x01"
        head = b""
        if not self.started:
            self.started = True
            block = _HEADER_BLOCKS[self.compression or "identity"]
            head = HEAD.pack((len(block) << 8) | HEADERS, END_HEADERS, self.stream_id) + block
        if last:
            self.finished = True  # (the deadline still holds until the answer is out)
        self.connection.send_data(
            self, head, flag + size.to_bytes(4, "big"), pieces, size, _OK_TRAILERS if last else None
        )

    def finish(self, code: grpc.StatusCode = grpc.StatusCode.OK, details: str = "") -> None:
        """Queue the trailers (a trailers-only answer if nothing was sent): the call is over."""
        if self.finished:
            return
        self.finished = True
        if code == grpc.StatusCode.OK:
            block = _OK_TRAILERS
        else:
            block = trailers(code, details)
        if not self.started:
            self.started = True
            block = _OK_HEADERS + block
        self.connection.send_trailers(self, block)

    async def run(self) -> None:
        """Decode, call the behaviour, answer: the whole call, as the stream's task."""
        method = self.method
        assert method is not None
        messages = self.messages
        try:
            try:
                if isinstance(messages, asyncio.Queue):
                    request: Any = _requests(self, method.decode)
                else:
                    request = method.decode(messages[0])
                    messages.clear()
            except Exception as exc:  # noqa: BLE001 - a client's bytes, not our bug
                raise Abort(grpc.StatusCode.INTERNAL, f"unparsable request: {exc}") from None
            if method.server_streaming:
                # closed on the way out, so that a call cancelled while it waits to send
                # runs the behaviour's clean-up now, not when the collector finds it
                async with contextlib.aclosing(method.behaviour(request, self)) as responses:
                    async for response in responses:
                        self.send_message(method.encode(response))
                        if self.outbox:  # the client's window is shut: wait until it opens
                            await self._sent_out()
            else:
                response = await method.behaviour(request, self)
                self.send_message(method.encode(response), last=True)
                self._sent(True)
            self.finish()
        except Abort as abort:
            self.finish(abort.code, abort.details)
        except asyncio.CancelledError:
            if self.expired:
                self.finish(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            elif not self.finished:
                self.finish(grpc.StatusCode.CANCELLED, "Cancelled")
        except Exception as exc:  # noqa: BLE001 - a bug must still answer the call
            log.exception("gRPC call %s failed", self.stream_id)
            self.finish(grpc.StatusCode.UNKNOWN, f"Exception calling application: {exc}")
        finally:
            self._sent(False)

    async def _sent_out(self) -> None:
        """Until what the call has sent is all out of its outbox (or the call is dropped)."""
        self.sender = asyncio.get_running_loop().create_future()
        try:
            await self.sender
        finally:
            self.sender = None

    def wake_sender(self) -> None:
        """The outbox is empty (or dropped): a stream waiting to send goes on."""
        if self.sender is not None and not self.sender.done():
            self.sender.set_result(None)

    def _sent(self, sent: bool) -> None:
        hook, self.after_send = self.after_send, None
        if hook is not None:
            hook(sent)


async def _requests(call: CallContext, decode: Callable[[Buffer], Any]) -> AsyncIterator[Any]:
    messages = call.messages
    assert isinstance(messages, asyncio.Queue)
    while True:
        item = await messages.get()
        if item is None:
            return
        message = call.take(item)
        try:
            request = decode(message)
        except Exception as exc:  # noqa: BLE001 - a client's bytes, not our bug
            raise Abort(grpc.StatusCode.INTERNAL, f"unparsable request: {exc}") from None
        yield request
