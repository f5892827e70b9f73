"""A small HTTP/1.1 server on asyncio + httptools, written for inference traffic.

Why not uvicorn or aiohttp: a hand-written protocol costs about half the CPU per
request (measured: ~35 µs vs ~70 µs for uvicorn's raw ASGI, ~200 µs for FastAPI),
and it can do what they cannot: read a large request body straight from the socket
into a shared-memory block (``BufferedProtocol.get_buffer``), so a tensor sent over
HTTP reaches the model with no copy after the kernel's, and send outputs from the
worker's shared memory without copying them first.

Per connection, requests are handled in order (pipelining-safe); a handler is an
``async`` callable from :class:`HttpRequest` to :class:`HttpResponse`. A response
may instead stream its body (chunked transfer encoding, e.g. server-sent events).
A client that disconnects cancels the handler serving it, so work done for nobody
stops. Limits: a maximum body size (checked before anything is allocated), a
header-size limit, back-pressure — reading pauses while a slow client's
responses pile up, and a stream waits for a slow reader — a bound on the connections
held (:mod:`dlserve.frontends.connection_cap`), and a request timeout: a request's
headers must arrive within it of its first byte, and its body may not stall for as long
(408 Request Timeout), and a client that reads nothing of its answer for as long is cut
off, so that clients sending or reading a byte now and then cannot hold connections and
memory for good. An idle keep-alive connection is kept (clients pool them) until the
connection bound needs its place.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import gzip
import json
import logging
import time
import zlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import httptools
import numpy as np

from dlserve.frontends.connection_cap import FRESH_GRACE, ConnectionCap
from dlserve.frontends.lingering import Lingering, linger
from dlserve.frontends.stalls import SendProgress, Sweeper
from dlserve.ipc.polling import PollWindow, loop_poller

if TYPE_CHECKING:
    from dlserve.engine.tracing import Trace

log = logging.getLogger("dlserve.http")

DIRECT_BODY_MIN = 64 * 1024  # bodies at least this big are read straight into shared memory
MAX_HEADER_BYTES = 64 * 1024
REQUEST_TIMEOUT = 60.0  # seconds (see HttpServer): nginx's client_header/body_timeout
_SCRATCH = 64 * 1024
_COALESCE_MAX = 64 * 1024  # response parts up to this size are copied into one write
REASONS = {
    200: "OK",
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    413: "Payload Too Large",
    417: "Expectation Failed",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
}


@dataclasses.dataclass
class HttpRequest:
    method: str
    path: str  # as sent, percent-encoded: a router decodes the parts it captures
    query: str
    headers: dict[str, str]  # by lower-cased name
    body: Any  # bytes, or a uint8 numpy view of shared memory for large bodies
    connection: HttpConnection | None = None
    received_ns: tuple[int, int] = (0, 0)  # monotonic: first byte read, message complete
    # Set by a handler that wants to know when its response went out: called once with
    # the write's start and end (monotonic ns), or (0, 0) if it never did.
    on_sent: Callable[[int, int], None] | None = None
    header_names: dict[str, str] = dataclasses.field(default_factory=dict)  # lower-cased -> as sent, where they differ

    def sent(self, start_ns: int, end_ns: int) -> None:
        on_sent, self.on_sent = self.on_sent, None
        if on_sent is not None:
            on_sent(start_ns, end_ns)

    def header(self, name: str, default: str = "") -> str:
        return self.headers.get(name, default)

    def traced(self, trace: Trace) -> None:
        """This request was picked for tracing: when it was read, and (the trace held
        until then) when its response was written."""
        start, end = self.received_ns
        trace.record("HTTP_RECV_START", start)
        trace.record("HTTP_RECV_END", end)
        trace.hold()

        def sent(start_ns: int, end_ns: int) -> None:
            if start_ns:
                trace.record("HTTP_SEND_START", start_ns)
                trace.record("HTTP_SEND_END", end_ns)
            trace.release()

        self.on_sent = sent


@dataclasses.dataclass
class HttpResponse:
    status: int = 200
    body: list[Any] = dataclasses.field(default_factory=list)  # buffers written in order
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    # Instead of ``body``: chunks sent as they come (chunked transfer encoding).
    stream: AsyncGenerator[bytes, None] | None = None


Handler = Callable[[HttpRequest], Awaitable[HttpResponse]]
BodyAllocator = Callable[[int], np.ndarray]  # nbytes -> writable uint8 view (shared memory)


class HttpError(Exception):
    """A protocol-level error answered before the request reaches a handler."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_body(message: str) -> bytes:
    return json.dumps({"error": message}, separators=(",", ":")).encode()  # (as the others)


def _request_parser(protocol: Any) -> httptools.HttpRequestParser:
    """A request parser that, as Triton's server and RFC 9112 do, reads a body sent with both
    Content-Length and Transfer-Encoding: chunked as chunked (python-requests sends such)."""
    parser = httptools.HttpRequestParser(protocol)
    parser.set_dangerous_leniencies(lenient_chunked_length=True)
    return parser


class HttpConnection(asyncio.BufferedProtocol):
    """One client connection."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self._parser = _request_parser(self)
        self._direct: np.ndarray | None = None  # body block being filled straight from the socket
        self._filled = 0
        self._reserved = 0  # bytes of the server's body reserve this connection's block holds
        self._reset_message()
        self._begun_ns = 0
        # For the server's sweep (HttpServer._sweep): reads so far, and the reads and
        # time it last saw progress at (see check_progress).
        self._reads = 0
        self._seen_reads = 0
        self._progress_at = 0.0
        self._held_at = 0.0  # when the sweep last found reading paused by this server
        self._sending = SendProgress()  # whether the client reads its answers (the sweep)
        self._admitted = False  # counted against the connection bound (see connection_made)
        self._settling: asyncio.TimerHandle | None = None  # (see _settled)
        self._pending: collections.deque[HttpRequest | HttpError] = collections.deque()
        self._busy = False
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._broken = False  # a parse error was queued; ignore whatever follows
        self._lingering: Lingering | None = None  # (see _linger)
        self._writable = asyncio.Event()
        self._writable.set()
        # After answering a keep-alive client, the loop polls for its next request
        # (dlserve.ipc.polling), as long as such waits have been short.
        self._next_request = PollWindow(server.poll_limit)
        self._poller = loop_poller(asyncio.get_running_loop())
        self._idle_since = 0.0
        # An HTTP/1.0 client keeps its connection only if told so (ApacheBench's -k waits
        # for a close otherwise); its version is the one of its latest request.
        self._http10 = False

    # -- message state ---------------------------------------------------------------
    def _reset_message(self) -> None:
        self._url = b""
        self._path = self._query = ""  # (the URL's, parsed at the end of the headers)
        self._headers: dict[str, str] = {}
        self._header_names: dict[str, str] = {}
        self._header_bytes = 0
        self._last_name = ""
        self._body_parts: list[bytes] = []
        self._body_size = 0
        self._block: np.ndarray | None = None
        self._expected = -1
        self._upgrade_body = 0  # body bytes of an upgrade request still to read by hand
        self._method = ""  # (read at the end of the headers: the parser may be replaced after)
        self._keep_alive = True
        self._receiving = False  # a request has begun and is not complete yet
        self._headers_done = False

    # -- httptools callbacks ---------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._admitted:
            self.server.cap.busy(self)
        self._reset_message()
        self._begun_ns = time.monotonic_ns()
        self._receiving = True

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_HEADER_BYTES:
            raise HttpError(400, "request URL is too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > MAX_HEADER_BYTES:
            raise HttpError(400, "request headers are too large")
        raw = name.decode("latin-1")
        key = raw.lower()
        if key != raw:
            self._header_names[key] = raw
        text = value.decode("latin-1")
        self._headers[key] = f"{self._headers[key]},{text}" if key in self._headers else text

    def on_headers_complete(self) -> None:
        self._headers_done = True
        self._method = self._parser.get_method().decode()
        try:  # (at the headers: a bad URL is answered before any body is read)
            url = httptools.parse_url(self._url)
        except httptools.HttpParserInvalidURLError:
            raise HttpError(400, "malformed HTTP request: invalid URL") from None
        self._path = url.path.decode("latin-1")
        self._query = (url.query or b"").decode("latin-1")
        self._keep_alive = self._parser.should_keep_alive()
        self._http10 = self._parser.get_http_version() == "1.0"
        upgrade = self._parser.should_upgrade()
        coding = self._headers.get("transfer-encoding")
        if coding is not None and coding.strip().lower() != "chunked":  # (RFC 9112 6.1)
            raise HttpError(501, f"unsupported Transfer-Encoding '{coding}': only chunked is")
        expect = self._headers.get("expect")
        if expect is not None and expect.strip().lower() != "100-continue":  # (RFC 9110 10.1.1)
            raise HttpError(417, f"unsupported Expect '{expect}'")
        if upgrade and "transfer-encoding" in self._headers:
            raise HttpError(400, "an Upgrade request with a chunked body is not supported")
        self._prepare_body(upgrade)
        # (RFC 9110 10.1.1: a body to come, by length or chunked; never to an HTTP/1.0 client)
        body = self._expected > 0 or "transfer-encoding" in self._headers
        if expect is not None and body and not self._http10 and self.transport is not None and not self.in_flight:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _prepare_body(self, upgrade: bool) -> None:
        """Where the body goes, by its framing: a block allocated at its declared size
        (read straight into place), or parts gathered as they come."""
        length = self._headers.get("content-length")
        if length is not None and "transfer-encoding" in self._headers:
            # Read as chunked, and the connection closed after the answer (RFC 9112 6.3: no
            # request can be smuggled behind it for a proxy that went by the length).
            self._keep_alive = False
            return
        if length is None:
            return
        try:
            expected = int(length)
        except ValueError:
            raise HttpError(400, "invalid Content-Length") from None
        if expected > self.server.max_body:
            raise HttpError(
                413,
                f"request body of {expected} bytes exceeds the maximum of {self.server.max_body} "
                "bytes (--http-max-input-size)",
            )
        self._expected = expected
        if upgrade:  # see _feed: its body is read by hand
            self._upgrade_body = expected
            return
        if expected >= DIRECT_BODY_MIN and "content-encoding" not in self._headers and self.server.reserve(expected):
            self._reserved = expected
            try:
                self._block = self.server.allocate_body(expected)
            except BaseException:
                self._unreserve()
                raise

    def on_body(self, body: bytes) -> None:
        if self._block is not None:
            self._block[self._body_size : self._body_size + len(body)] = np.frombuffer(body, np.uint8)
        else:
            self._body_parts.append(body)
        self._body_size += len(body)
        if self._body_size > self.server.max_body:
            raise HttpError(
                413,
                f"request body exceeds the maximum of {self.server.max_body} bytes "
                "(--http-max-input-size)",
            )

    def on_message_complete(self) -> None:
        if self._upgrade_body:
            return  # the parser ended an upgrade request at its headers: its body comes next
        if self._block is not None:
            body: Any = self._block
            self._unreserve()
        else:
            body = b"".join(self._body_parts)
        self._queue_request(body)

    def _drop_body(self) -> None:
        self._block = self._direct = None
        self._unreserve()
        self._body_parts = []

    def _unreserve(self) -> None:
        """The block is full (or dropped): it no longer waits for bytes to come."""
        self.server.reserved -= self._reserved
        self._reserved = 0

    def _queue_request(self, body: Any) -> None:
        request = HttpRequest(
            method=self._method,
            path=self._path,
            query=self._query,
            headers=self._headers,
            header_names=self._header_names,
            body=body,
            connection=self,
            received_ns=(self._begun_ns, time.monotonic_ns()),
        )
        request.headers["_keep_alive"] = "1" if self._keep_alive else "0"
        self._reset_message()  # (the body is the request's now: an idle connection keeps none)
        self._pending.append(request)
        self._serve_soon()
        if len(self._pending) > 16 and self.transport is not None:
            self.transport.pause_reading()

    # -- asyncio.BufferedProtocol ----------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        server = self.server
        server.connections.add(self)
        self._admitted = server.cap.admit()
        if not self._admitted:  # (answered, and closed without counting against the bound)
            self._fail(503, server.cap.refusal())
            return
        self._settling = asyncio.get_running_loop().call_later(FRESH_GRACE, self._settled)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._direct is not None:
            return memoryview(self._direct)[self._filled :]  # type: ignore[arg-type]
        return self.server.scratch

    def _feed(self, data: memoryview) -> None:
        """Parse these bytes. HTTP/1.1 lets a server ignore ``Upgrade`` (``curl --http2``
        asks every request, bodies included, to switch to h2c), but httptools stops at
        an upgrade request's headers: its body, if any, is read here by hand, and the
        bytes after it go to a fresh parser."""
        while data:
            if self._upgrade_body:
                take = min(len(data), self._upgrade_body)
                self.on_body(bytes(data[:take]))
                self._upgrade_body -= take
                data = data[take:]
                if not self._upgrade_body:
                    self.on_message_complete()
                continue
            try:
                self._parser.feed_data(data)
                return
            except httptools.HttpParserUpgrade as upgrade:
                self._parser = _request_parser(self)
                data = data[upgrade.args[0] :]

    def buffer_updated(self, nbytes: int) -> None:
        self._reads += 1
        if self._idle_since:
            self._next_request.record(time.perf_counter() - self._idle_since)
            self._idle_since = 0.0
            self._poller.done(self)
        if self._broken:
            if self._lingering is not None:  # dropped unread (see _linger)
                self._lingering.received(nbytes)
            return
        if self._direct is not None:
            self._filled += nbytes
            if self._filled == self._direct.nbytes:
                block, self._direct = self._direct, None
                self._unreserve()
                self._queue_request(block)
                self._parser = _request_parser(self)  # the old one stopped mid-body
            return
        try:
            self._feed(self.server.scratch[:nbytes])
        except HttpError as exc:
            self._fail(exc.status, exc.message)
            return
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            if isinstance(cause, HttpError):
                self._fail(cause.status, cause.message)
            else:
                self._fail(400, f"malformed HTTP request: {exc}")
            return
        if self._block is not None and self._body_size < self._expected:
            # The rest of a large body goes from the socket straight into its block.
            self._direct = self._block
            self._filled = self._body_size

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self.transport = None
        self._poller.done(self)
        self.server.connections.discard(self)
        if self._admitted:
            self._admitted = False
            self.server.cap.left(self)
        if self._settling is not None:
            self._settling.cancel()
        self._writable.set()
        if self._lingering is not None:
            self._lingering.cancel()
        # Drop a half-received body now (it may be a 64 MiB shared-memory block) rather
        # than when the garbage collector breaks the parser <-> connection cycle.
        self._drop_body()
        self._pending.clear()
        self._parser = None  # type: ignore[assignment]
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the client is gone: stop working for it

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # -- limits ----------------------------------------------------------------------
    def sheddable(self) -> bool:
        """Idle: nothing in flight or partly received (for the connection bound,
        :mod:`dlserve.frontends.connection_cap`)."""
        busy = self._busy or self._pending or self._receiving or self._broken
        return not busy and self.transport is not None

    def _settled(self) -> None:
        """A new connection that has sent nothing for FRESH_GRACE seconds is idle."""
        self._settling = None
        if not self._begun_ns and self.sheddable():  # (bytes that begin no request count not)
            self.server.cap.idle(self)

    def shed(self) -> None:
        """Close this idle connection to make room for a new one, after what its last
        answer still has to send (a client that reads none of it is cut off by the
        sweep, see check_progress)."""
        self._broken = True
        if self.transport is not None:
            self.transport.close()

    def check_progress(self, now: float, timeout: float) -> None:
        """The server's sweep: a request whose headers are not complete ``timeout``
        seconds after its first byte, or whose body got nothing for that long, is
        answered 408 and its connection closed. Time while this server does not read
        (back-pressure) does not count. A client that reads nothing of what it is sent
        for ``timeout`` seconds (what waits to be sent does not shrink) is cut off; one
        that reads slowly is not."""
        if self.transport is None:
            return
        if self._sending.stalled_for(self.transport.get_write_buffer_size(), now) >= timeout:
            log.info("HTTP client read nothing for %g s; closing its connection", timeout)
            self.transport.abort()
            return
        if not self._receiving or self._broken:
            return
        reading = self.transport.is_reading()
        if self._reads != self._seen_reads or not reading:
            self._seen_reads = self._reads
            self._progress_at = now
        if not reading:
            self._held_at = now
        if not self._headers_done:
            if now - max(self._begun_ns / 1e9, self._held_at) >= timeout:
                self._fail(408, f"request headers not received within {timeout:g} s")
        elif now - self._progress_at >= timeout:
            self._fail(408, f"request body stalled: nothing received for {timeout:g} s")

    # -- serving ---------------------------------------------------------------------
    @property
    def in_flight(self) -> bool:
        """A request is being handled or waits its turn on this connection."""
        return self._busy or bool(self._pending)

    def _fail(self, status: int, message: str) -> None:
        """Answer a request we could not parse — after the answers to the requests
        before it on this connection — then close: the stream is out of sync."""
        self._broken = True
        self._receiving = False
        if self.transport is not None:
            self.transport.pause_reading()
        self._pending.append(HttpError(status, message))
        self._serve_soon()

    def _linger(self) -> None:
        """Close after answering a request whose client may still be sending (a body
        refused at its headers or midway, a stream out of sync) without a reset
        (:mod:`dlserve.frontends.lingering`). The server's stop closes it at once."""
        if self.transport is not None:
            self._drop_body()
            self._lingering = linger(self.transport)

    def _serve_soon(self) -> None:
        if not self._busy:
            self._busy = True
            self._task = asyncio.get_running_loop().create_task(self._serve_pending())

    async def _serve_pending(self) -> None:
        try:
            while self._pending and not self._closing:
                request = self._pending.popleft()
                if isinstance(request, HttpError):
                    self._write(HttpResponse(request.status, [error_body(request.message)]), False)
                    self._linger()
                    return
                try:
                    response = await self.server.dispatch(request)
                except BaseException:
                    request.sent(0, 0)
                    raise
                keep_alive = request.headers.get("_keep_alive") == "1"
                if response.stream is not None:
                    request.sent(0, 0)
                    if not await self._write_stream(response, keep_alive):
                        return
                elif request.on_sent is None:
                    self._write(response, keep_alive)
                else:  # someone wants to know when it went out
                    start, written = time.monotonic_ns(), False
                    try:
                        written = self._write(response, keep_alive)
                    finally:
                        request.sent(start if written else 0, time.monotonic_ns() if written else 0)
                if not keep_alive:
                    if self.transport is not None:
                        self.transport.close()
                    return
                await self._writable.wait()
                if self.transport is not None and len(self._pending) <= 16:
                    self.transport.resume_reading()
        finally:
            self._busy = False
            if self._admitted and self.sheddable():
                self.server.cap.idle(self)

    def _head(self, response: HttpResponse, keep_alive: bool, framing: str) -> bytearray:
        head = [f"HTTP/1.1 {response.status} {REASONS.get(response.status, 'Unknown')}", framing]
        if response.stream is not None or response.body:
            head.append(f"Content-Type: {response.content_type}")
        head.extend(f"{k}: {v}" for k, v in response.headers)
        if not keep_alive:
            head.append("Connection: close")
        elif self._http10:
            head.append("Connection: keep-alive")
        return bytearray(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))

    async def _write_stream(self, response: HttpResponse, keep_alive: bool) -> bool:
        """Send chunks as the stream yields them, waiting for a slow reader; a client
        that goes away closes the stream (and so cancels what feeds it). False when the
        connection cannot go on: gone, or the stream failed after its head was sent (no
        status can be sent any more, so the connection is closed rather than left with a
        response that never ends)."""
        stream = response.stream
        assert stream is not None
        try:
            if self.transport is None:
                return False
            self.transport.write(self._head(response, keep_alive, "Transfer-Encoding: chunked"))
            async for chunk in stream:
                if self.transport is None:
                    return False
                if chunk:
                    self.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
                    await self._writable.wait()
            if self.transport is None:
                return False
            self.transport.write(b"0\r\n\r\n")
            return True
        except Exception:  # noqa: BLE001 - a stream bug must end this response, not hang it
            log.exception("a streamed response failed after its head was sent")
            if self.transport is not None:
                self.transport.close()
            return False
        finally:
            await stream.aclose()

    def _write(self, response: HttpResponse, keep_alive: bool) -> bool:
        """Send a response: small ones in one write (one system call, one wake-up of
        the client); large parts are handed to the transport as they are, uncopied.
        False if the client is gone."""
        transport = self.transport
        if transport is None:
            return False
        views = [memoryview(part).cast("B") for part in response.body]
        length = sum(v.nbytes for v in views)
        out = self._head(response, keep_alive, f"Content-Length: {length}")
        large: list[memoryview] = []
        for view in views:
            if large or view.nbytes > _COALESCE_MAX:
                large.append(view)
            else:
                out += view
        transport.write(out)
        for view in large:
            if view.nbytes:
                transport.write(view)
        if keep_alive and not self._pending and self._next_request.seconds:
            self._idle_since = time.perf_counter()
            self._poller.poll(self, self._next_request.seconds)
        return True


def decode_body(request: HttpRequest) -> Any:
    """The request body with any Content-Encoding (gzip, deflate) removed, size-capped."""
    encoding = request.header("content-encoding").strip().lower()
    if not encoding or encoding == "identity":
        return request.body
    server = request.connection.server if request.connection else None
    limit = server.max_body if server else 1 << 26
    data = bytes(request.body)
    try:
        if encoding == "gzip":
            decompressor = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif encoding == "deflate":
            decompressor = zlib.decompressobj()
        else:
            raise HttpError(501, f"unsupported Content-Encoding '{encoding}'")  # (Triton's status)
        out = decompressor.decompress(data, limit + 1)
    except zlib.error as exc:
        raise HttpError(400, f"cannot decode {encoding} body: {exc}") from None
    if len(out) > limit or decompressor.unconsumed_tail:
        raise HttpError(413, f"decompressed body exceeds the maximum of {limit} bytes")
    if not decompressor.eof:  # (cut short: the checksum at its end was never checked)
        raise HttpError(
            400, f"cannot decode {encoding} body: it ends before its compressed data does"
        )
    return out


def accepted_compression(accept_encoding: str) -> str | None:
    """gzip or deflate, whichever ``Accept-Encoding`` weighs more (on a tie the one listed
    first, as Triton picks), or None when it accepts neither (absent, or ``q=0``)."""
    weights: dict[str, float] = {}
    for item in accept_encoding.lower().split(","):
        coding, _, parameters = item.partition(";")
        coding = coding.strip()
        if coding not in ("gzip", "deflate"):
            continue
        weight = 1.0
        for parameter in parameters.split(";"):
            key, _, value = parameter.partition("=")
            if key.strip() == "q":
                try:
                    weight = float(value)
                except ValueError:
                    weight = 0.0
        weights[coding] = weight
    best = max(weights, key=weights.__getitem__, default=None)  # (the first of equals)
    return best if best is not None and weights[best] > 0 else None


def encode_body(request: HttpRequest, response: HttpResponse) -> HttpResponse:
    """Compress a response when the client accepts gzip or deflate."""
    name = accepted_compression(request.header("accept-encoding"))
    if not response.body or name is None:
        return response
    raw = b"".join(bytes(part) for part in response.body)
    if name == "gzip":
        data = gzip.compress(raw, compresslevel=1)
    else:
        data = zlib.compress(raw, 1)
    headers = [(k, v) for k, v in response.headers if k.lower() != "inference-header-content-length"]
    headers.append(("Content-Encoding", name))
    for k, v in response.headers:
        if k.lower() == "inference-header-content-length":
            headers.append((k, v))
    return HttpResponse(response.status, [data], response.content_type, headers)


class HttpServer:
    """Accepts connections on one address and dispatches requests to ``handler``."""

    def __init__(
        self,
        handler: Handler,
        allocate_body: BodyAllocator | None = None,
        max_body: int = 1 << 26,
        poll_limit: float = 0.0,
        body_reserve: int | None = None,
        max_connections: int | None = None,
        request_timeout: float = REQUEST_TIMEOUT,
    ) -> None:
        """``allocate_body(n)`` gives the memory a large body is read into (default:
        ordinary memory; the KServe frontend passes shared memory). ``poll_limit``:
        the most the loop polls for a keep-alive client's next request (seconds).

        A large body's block is allocated when its headers arrive, so that it is read
        straight into place; ``body_reserve`` bounds the bytes such blocks may hold
        while their bodies are still to come (default: twice ``max_body``, at least
        256 MiB). Beyond it, bodies are gathered as their bytes arrive, so clients
        that declare large bodies and send nothing cannot claim memory.

        ``max_connections``: the most connections held at once (None or 0:
        :func:`~dlserve.frontends.connection_cap.default_limit`); ``request_timeout``:
        seconds a request's headers may take from its first byte, and its body may go
        without a byte (0: no limit)."""
        self.handler = handler
        self.allocate_body = allocate_body or (lambda nbytes: np.empty(nbytes, dtype=np.uint8))
        self.max_body = max_body
        self.body_reserve = max(2 * max_body, 256 << 20) if body_reserve is None else body_reserve
        self.reserved = 0
        self.poll_limit = poll_limit
        self.cap = ConnectionCap(max_connections, "HTTP")
        # What every connection reads into (one at a time, on this loop), each read parsed
        # before the next: a buffer per connection cost 64 KiB for each one kept open.
        self.scratch = memoryview(bytearray(_SCRATCH))
        self.request_timeout = request_timeout
        self._sweeper = Sweeper(request_timeout, self._sweep)
        self.connections: set[HttpConnection] = set()
        self._server: asyncio.AbstractServer | None = None

    def reserve(self, nbytes: int) -> bool:
        """Whether a block of ``nbytes`` for a body still to come fits the reserve (it
        is then counted until the connection gives it back)."""
        if self.reserved + nbytes > self.body_reserve:
            return False
        self.reserved += nbytes
        return True

    async def dispatch(self, request: HttpRequest) -> HttpResponse:
        try:
            return await self.handler(request)
        except HttpError as exc:
            return HttpResponse(exc.status, [error_body(exc.message)])
        except Exception:  # noqa: BLE001 - a handler bug must not kill the connection
            log.exception("unhandled error serving %s %s", request.method, request.path)
            return HttpResponse(500, [error_body("internal server error")])

    async def start(self, host: str, port: int, reuse_port: bool = False, ssl: Any = None) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: HttpConnection(self), host, port, reuse_port=reuse_port or None, ssl=ssl,
            backlog=1024,
        )
        self._sweeper.start()
        return int(self._server.sockets[0].getsockname()[1])

    def _sweep(self, now: float) -> None:
        for connection in list(self.connections):
            connection.check_progress(now, self.request_timeout)

    async def stop(self, grace: float = 0.0) -> None:
        """Stop accepting, give in-flight requests up to ``grace`` seconds, then close."""
        if self._server is None:
            return
        self._server.close()
        self._sweeper.stop()
        deadline = asyncio.get_running_loop().time() + grace
        while any(c.in_flight for c in self.connections):
            if asyncio.get_running_loop().time() >= deadline:
                break
            await asyncio.sleep(0.02)
        for connection in list(self.connections):
            if connection.transport is not None:
                connection.transport.close()
        await self._server.wait_closed()
        self._server = None
