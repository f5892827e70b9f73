"""The HTTP server on its own (a real socket, handlers of the test's making): a chunked
response whose stream fails after its head went out, bodies and their memory, the request
timeout and the connection bound."""

from __future__ import annotations

import asyncio
import gc
import socket
import time
import tracemalloc
import weakref
from collections.abc import AsyncGenerator

import numpy as np

from dlserve.frontends import lingering
from dlserve.frontends.http_server import DIRECT_BODY_MIN, HttpRequest, HttpResponse, HttpServer


async def _failing_stream() -> AsyncGenerator[bytes, None]:
    yield b"data: first\n\n"
    raise RuntimeError("encoding broke")


async def _handler(request: HttpRequest) -> HttpResponse:
    if request.path == "/stream":
        return HttpResponse(content_type="text/event-stream", stream=_failing_stream())
    if request.path == "/big":
        return HttpResponse(body=[bytes(32 << 20)])
    return HttpResponse(body=[b'{"ok":true}'])


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_stream_that_fails_after_its_head_closes_the_connection() -> None:
    """No status can follow a sent head: the connection is closed (the client sees the
    response end early) instead of hanging, and the server keeps serving others."""

    async def main() -> None:
        server = HttpServer(_handler)
        port = await server.start("127.0.0.1", 0)
        loop = asyncio.get_running_loop()
        try:

            def client() -> tuple[bytes, bytes]:
                with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                    # a second request pipelined behind the stream: it must not be served on a
                    # connection whose previous response was cut off
                    sock.sendall(
                        b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n"
                        b"GET /other HTTP/1.1\r\nHost: x\r\n\r\n"
                    )
                    broken = _read_until_closed(sock)
                with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                    sock.sendall(b"GET /other HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    fine = _read_until_closed(sock)
                return broken, fine

            broken, fine = await loop.run_in_executor(None, client)
        finally:
            await server.stop()
        head, _, body = broken.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        assert b"Transfer-Encoding: chunked" in head
        assert b"data: first" in body
        assert not body.endswith(b"0\r\n\r\n")  # never terminated as if complete
        assert b'{"ok":true}' not in body
        assert fine.startswith(b"HTTP/1.1 200") and fine.endswith(b'{"ok":true}')

    asyncio.run(main())


def test_blocks_for_bodies_still_to_come_stay_within_the_reserve() -> None:
    """Clients that declare large bodies and send nothing get at most ``body_reserve``
    bytes of pre-allocated blocks; the other bodies are gathered as they arrive, and
    every request is answered with its whole body either way."""
    size = 1 << 20
    allocated: list[int] = []

    def allocate(nbytes: int) -> np.ndarray:
        allocated.append(nbytes)
        return np.empty(nbytes, dtype=np.uint8)

    async def echo_size(request: HttpRequest) -> HttpResponse:
        body = request.body
        ok = len(body) == size and bytes(body[:4]) == b"abcd" and bytes(body[-4:]) == b"wxyz"
        return HttpResponse(body=[str(len(body) if ok else -1).encode()])

    async def main() -> None:
        server = HttpServer(echo_size, allocate, max_body=size, body_reserve=2 * size)
        port = await server.start("127.0.0.1", 0)
        loop = asyncio.get_running_loop()
        head = f"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\nConnection: close\r\n\r\n".encode()
        body = b"abcd" + b"." * (size - 8) + b"wxyz"
        socks = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(5)]
        try:
            for sock in socks:
                sock.sendall(head)  # headers only, for now
            for _ in range(100):
                await asyncio.sleep(0.01)
                if len(allocated) >= 2 and server.reserved == 2 * size:
                    break
            assert allocated == [size, size] and server.reserved == 2 * size

            def finish() -> list[bytes]:
                for sock in socks:
                    sock.sendall(body)
                return [_read_until_closed(sock) for sock in socks]

            answers = await loop.run_in_executor(None, finish)
        finally:
            for sock in socks:
                sock.close()
            await server.stop()
        assert all(a.startswith(b"HTTP/1.1 200") and a.endswith(str(size).encode()) for a in answers), answers
        assert allocated == [size, size] and server.reserved == 0

    asyncio.run(main())


def test_a_body_cut_off_by_its_client_gives_its_reserve_back() -> None:
    size = 1 << 20

    async def never(request: HttpRequest) -> HttpResponse:
        raise AssertionError("an incomplete request was handled")

    async def main() -> None:
        server = HttpServer(never, max_body=size)
        port = await server.start("127.0.0.1", 0)
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(f"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n\r\n".encode())
                sock.sendall(b"." * (size // 2))  # half of it, straight into the block
                for _ in range(100):
                    await asyncio.sleep(0.01)
                    if server.reserved == size:
                        break
                assert server.reserved == size
            for _ in range(100):  # the client hung up mid-body
                await asyncio.sleep(0.01)
                if server.reserved == 0:
                    break
            assert server.reserved == 0
        finally:
            await server.stop()

    asyncio.run(main())


def test_an_idle_keep_alive_connection_keeps_no_body() -> None:
    """Once a request is answered, its connection, waiting for the next, holds nothing of
    its body: neither the block a large body was read into (shared memory, in the KServe
    frontend) nor the parts a chunked body was gathered in."""
    size = 4 << 20
    blocks: list[weakref.ref[np.ndarray]] = []

    def allocate(nbytes: int) -> np.ndarray:
        block = np.empty(nbytes, dtype=np.uint8)
        blocks.append(weakref.ref(block))
        return block

    async def length(request: HttpRequest) -> HttpResponse:
        return HttpResponse(body=[str(len(request.body)).encode()])

    def ask(sock: socket.socket, request: bytes) -> bytes:
        sock.sendall(request)
        answer = b""
        while not answer.endswith(str(size).encode()):
            chunk = sock.recv(65536)
            assert chunk, f"connection closed: {answer!r}"
            answer += chunk
        return answer

    sized = b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size + b"." * size
    piece = b"." * (64 << 10)
    chunked = (
        b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n%b\r\n" % (len(piece), piece) * (size // len(piece))
        + b"0\r\n\r\n"
    )

    async def main() -> None:
        server = HttpServer(length, allocate, max_body=size)
        port = await server.start("127.0.0.1", 0)
        loop = asyncio.get_running_loop()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                answer = await loop.run_in_executor(None, ask, sock, sized)
                assert answer.startswith(b"HTTP/1.1 200")
                gc.collect()
                assert len(blocks) == 1 and blocks[0]() is None, "the idle connection keeps it"
                tracemalloc.start()
                try:
                    answer = await loop.run_in_executor(None, ask, sock, chunked)
                    gc.collect()
                    held = tracemalloc.get_traced_memory()[0]
                finally:
                    tracemalloc.stop()
                assert answer.startswith(b"HTTP/1.1 200")
                assert held < size // 4, f"the idle connection keeps {held} bytes"
        finally:
            await server.stop()

    asyncio.run(main())


def test_a_url_that_does_not_parse_is_answered_400_whatever_the_body() -> None:
    """A request line the parser reads but whose URL does not parse (a port past 65535) is
    answered 400 with a message, whether its body is small or large enough to be read
    straight into a block; the connection closes and the server serves on."""

    async def main() -> None:
        server = HttpServer(_handler)
        port = await server.start("127.0.0.1", 0)
        loop = asyncio.get_running_loop()

        def ask(request: bytes) -> bytes:
            """The answer, read until the server closes (the body it refused, read and
            dropped: no reset)."""
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(request)
                return _read_until_closed(sock)

        try:
            for size in (1 << 20, DIRECT_BODY_MIN, 100):
                head = b"POST http://h:99999/x HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                answer = await loop.run_in_executor(None, ask, head % size + b"." * size)
                assert answer.startswith(b"HTTP/1.1 400 "), (size, answer)
                assert answer.endswith(b'{"error":"malformed HTTP request: invalid URL"}')
            fine = await loop.run_in_executor(
                None, ask, b"GET /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
            assert fine.startswith(b"HTTP/1.1 200")
        finally:
            await server.stop()

    asyncio.run(main())


def test_a_lingering_connection_closes_when_its_client_does_or_the_server_stops(
    monkeypatch,
) -> None:
    """After a refusal the connection drops what its client still sends (no reset under a
    client still writing) and is gone once the client closes; the server's stop closes a
    lingering one at once, however long it would linger."""
    monkeypatch.setattr(lingering, "LINGER_SECONDS", 600.0)
    monkeypatch.setattr(lingering, "LINGER_IDLE_SECONDS", 600.0)
    head = b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (4 << 20)

    def refused(sock: socket.socket) -> bytes:
        sock.sendall(head)
        answer = _read_until_closed(sock)  # (the answer, then FIN)
        sock.sendall(b"." * (4 << 20))  # dropped, not reset
        return answer

    async def gone(server: HttpServer) -> None:
        for _ in range(500):
            if not server.connections:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the lingering connection stayed")

    async def main() -> None:
        server = HttpServer(_handler, max_body=1024)
        port = await server.start("127.0.0.1", 0)
        loop = asyncio.get_running_loop()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            answer = await loop.run_in_executor(None, refused, sock)
            assert answer.startswith(b"HTTP/1.1 413 ") and len(server.connections) == 1
        await gone(server)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            answer = await loop.run_in_executor(None, refused, sock)
            assert answer.startswith(b"HTTP/1.1 413 ") and len(server.connections) == 1
            await asyncio.wait_for(server.stop(), 10)
            await gone(server)

    asyncio.run(main())


# -- the request timeout and the connection bound ----------------------------------------------
def _answer(sock: socket.socket) -> bytes:
    """One response with a Content-Length body (or what came before the close)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    fields = dict(line.lower().split(b":", 1) for line in head.split(b"\r\n")[1:])
    length = int(fields[b"content-length"])
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def _assert_served(sock: socket.socket) -> None:
    """A request on ``sock`` gets its answer: the connection is served."""
    sock.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _answer(sock).endswith(b'{"ok":true}')


def _serving(test, **options) -> None:
    """Run ``test(server, port)`` in a thread against an HttpServer with these options;
    afterwards the server holds no connection."""

    async def main() -> None:
        server = HttpServer(_handler, **options)
        port = await server.start("127.0.0.1", 0)
        try:
            await asyncio.get_running_loop().run_in_executor(None, test, server, port)
            for _ in range(200):
                if not server.connections:
                    break
                await asyncio.sleep(0.01)
            assert not server.connections, "connections left after their clients closed"
            assert server.cap.held == 0
        finally:
            await server.stop()

    asyncio.run(main())


def test_headers_that_do_not_arrive_in_time_are_answered_408() -> None:
    """A client that sends part of its headers and then nothing, or a byte now and then,
    gets 408 once the timeout has passed since its first byte, and the connection is
    closed; others are served as usual."""

    def test(server: HttpServer, port: int) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            started = time.monotonic()
            sock.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\n")
            for _ in range(3):  # a byte now and then is no excuse
                time.sleep(0.1)
                sock.sendall(b"X")
            answer = _read_until_closed(sock)
            waited = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 408 Request Timeout"), answer
        assert b"Connection: close" in answer
        assert answer.endswith(b'{"error":"request headers not received within 0.5 s"}')
        assert 0.45 <= waited < 2.0, waited
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            _assert_served(sock)

    _serving(test, request_timeout=0.5)


def test_a_stalled_body_is_answered_408_and_a_slow_one_is_served() -> None:
    """A body that stops coming gets 408 after the timeout without a byte; one that keeps
    coming, however slowly, is read to its end and answered, though it takes longer."""

    def test(server: HttpServer, port: int) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n12345")
            answer = _read_until_closed(sock)
        assert answer.startswith(b"HTTP/1.1 408 Request Timeout"), answer
        assert b"request body stalled: nothing received for 0.5 s" in answer
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            started = time.monotonic()
            sock.sendall(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 8\r\n\r\n")
            for byte in b"12345678":
                time.sleep(0.15)
                sock.sendall(bytes([byte]))
            answer = _answer(sock)
            assert time.monotonic() - started > 1.0  # twice the timeout, all of it moving
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"ok":true}')

    _serving(test, request_timeout=0.5)


def test_past_the_connection_bound_the_longest_idle_connection_makes_room() -> None:
    """At the bound, a new connection takes the place of the one idle longest, which is
    closed (a pooling client reconnects); the others keep theirs."""

    def test(server: HttpServer, port: int) -> None:
        first = socket.create_connection(("127.0.0.1", port), timeout=10)
        second = socket.create_connection(("127.0.0.1", port), timeout=10)
        with first, second:
            for sock in (first, second):
                _assert_served(sock)
                time.sleep(0.05)
            with socket.create_connection(("127.0.0.1", port), timeout=10) as third:
                _assert_served(third)
                assert first.recv(100) == b"", "the longest idle connection was kept"
                _assert_served(second)
                assert len(server.connections) == server.cap.held == 2

    _serving(test, max_connections=2)


def test_with_no_connection_idle_a_new_one_is_refused_503() -> None:
    """At the bound with every connection mid-request, a new one is answered 503 (the
    bound in its message) and closed; the requests under way finish as usual."""

    def test(server: HttpServer, port: int) -> None:
        busy = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
        for sock in busy:
            sock.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\n")  # headers under way
        time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as extra:
            extra.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
            refused = _read_until_closed(extra)
        assert refused.startswith(b"HTTP/1.1 503 Service Unavailable"), refused
        assert refused.endswith(
            b'{"error":"the server holds its maximum of 2 connections; try again later"}'
        )
        for sock in busy:
            with sock:
                sock.sendall(b"\r\n")
                assert _answer(sock).endswith(b'{"ok":true}')

    _serving(test, max_connections=2)


def test_a_new_connection_is_not_shed_before_it_could_send_its_first_request() -> None:
    """A client that has just connected is not idle: in a burst of new connections at the
    bound, the first takes the idle connection's place and the next is refused, instead
    of each closing the one before it under its first request."""

    def test(server: HttpServer, port: int) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as idle, \
                socket.create_connection(("127.0.0.1", port), timeout=10) as busy:
            _assert_served(idle)
            busy.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\n")  # headers under way
            time.sleep(0.1)
            first = socket.create_connection(("127.0.0.1", port), timeout=10)
            second = socket.create_connection(("127.0.0.1", port), timeout=10)
            with first, second:
                assert idle.recv(100) == b""  # the idle one made room for the first
                second.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
                assert _read_until_closed(second).startswith(b"HTTP/1.1 503")
                _assert_served(first)
            busy.sendall(b"\r\n")
            assert _answer(busy).endswith(b'{"ok":true}')

    _serving(test, max_connections=2)


def test_a_connection_that_says_nothing_is_idle_after_the_grace() -> None:
    """One that connects and sends nothing holds its place only for FRESH_GRACE: then a
    new connection takes it."""
    from dlserve.frontends.connection_cap import FRESH_GRACE

    def test(server: HttpServer, port: int) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as silent:
            time.sleep(FRESH_GRACE + 0.3)
            with socket.create_connection(("127.0.0.1", port), timeout=10) as newcomer:
                _assert_served(newcomer)
                assert silent.recv(100) == b""

    _serving(test, max_connections=1)


def test_refused_connections_do_not_count_against_the_bound() -> None:
    """Refused connections linger (what their clients still send is read and dropped) but
    take no place: once the busy connection is done, the next client is served, however
    many refused ones are still open."""

    def test(server: HttpServer, port: int) -> None:
        busy = socket.create_connection(("127.0.0.1", port), timeout=10)
        busy.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\n")
        time.sleep(0.1)
        refused = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(5)]
        for sock in refused:
            sock.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 503")
        assert server.cap.held == 1
        with busy:
            busy.sendall(b"\r\n")
            assert _answer(busy).endswith(b'{"ok":true}')
        time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            _assert_served(sock)
        for sock in refused:
            sock.close()

    _serving(test, max_connections=1)


def test_a_connection_that_sends_only_blank_lines_is_idle_after_the_grace() -> None:
    """Blank lines before a request line begin no request: such a connection is idle
    once the grace has passed, as one that sends nothing is (it held its place for good)."""
    from dlserve.frontends.connection_cap import FRESH_GRACE

    def test(server: HttpServer, port: int) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as holder:
            holder.sendall(b"\r\n")
            time.sleep(FRESH_GRACE + 0.3)
            with socket.create_connection(("127.0.0.1", port), timeout=10) as newcomer:
                _assert_served(newcomer)
            try:
                assert holder.recv(100) == b""
            except ConnectionResetError:
                pass  # (shed at once: it had nothing to be sent)

    _serving(test, max_connections=1)


def test_a_client_that_reads_nothing_of_its_answer_is_cut_off() -> None:
    """An answer the client does not read holds the connection busy: after the request
    timeout with nothing read, the connection is closed, and its place with it."""

    def test(server: HttpServer, port: int) -> None:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        started = time.monotonic()
        while not server.cap.held and time.monotonic() - started < 5:
            time.sleep(0.01)  # (accepted)
        while server.cap.held and time.monotonic() - started < 5:
            time.sleep(0.05)
        assert server.cap.held == 0, "the stalled connection was kept"
        assert time.monotonic() - started >= 0.5
        sock.close()

    _serving(test, request_timeout=0.5)


def _read_slowly(sock: socket.socket, size: int) -> bytes:
    """A whole response with a body of ``size`` bytes, read 64 KiB every 5 ms."""
    data = bytearray()
    while b"\r\n\r\n" not in data[:4096] or len(data) - data.index(b"\r\n\r\n") - 4 < size:
        chunk = sock.recv(64 << 10)
        if not chunk:
            break
        data += chunk
        time.sleep(0.005)
    return bytes(data)


def test_a_client_that_reads_its_answer_slowly_gets_all_of_it() -> None:
    """Reading steadily, however slowly, is progress: 32 MiB that take many times the
    request timeout to read are not cut off."""

    def test(server: HttpServer, port: int) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
            sock.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            started = time.monotonic()
            body = _read_slowly(sock, 32 << 20).partition(b"\r\n\r\n")[2]
            assert time.monotonic() - started > 1.5  # (the timeout, and more)
        assert len(body) == 32 << 20 and not any(body), len(body)

    _serving(test, request_timeout=1.0)

