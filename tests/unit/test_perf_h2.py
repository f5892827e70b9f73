"""``dlserve perf``'s own HTTP/2 gRPC client, against scripted server frames: framing,
HPACK of the request headers, success and failure, SETTINGS/PING/WINDOW_UPDATE/
RST_STREAM/GOAWAY, flow control, frames split across reads."""

from __future__ import annotations

import asyncio
import struct

import pytest

from dlserve.perf.clients import RequestError
from dlserve.frontends.http2 import (
    DATA, END_HEADERS, END_STREAM, GOAWAY, HEADERS, PING, PREFACE, RST_STREAM, SETTINGS,
    WINDOW_UPDATE, frame, hpack_int,
)
from dlserve.perf.clients.h2 import H2Connection, grpc_message, request_headers

HEADERS_BLOCK = request_headers("/inference.GRPCInferenceService/ModelInfer", "127.0.0.1:8001")


class FakeTransport:
    def __init__(self) -> None:
        self.written = bytearray()
        self.closed = False

    def write(self, data) -> None:
        self.written += bytes(data)

    def get_extra_info(self, name, default=None):
        return default

    def close(self) -> None:
        self.closed = True

    def frames(self) -> list[tuple[int, int, int, bytes]]:
        """Frames written after the preface: (type, flags, stream, payload); then forget them."""
        data = bytes(self.written)
        if data.startswith(PREFACE):
            data = data[len(PREFACE):]
        out = []
        pos = 0
        while pos < len(data):
            word, flags, stream = struct.unpack_from(">IBI", data, pos)
            length = word >> 8
            out.append((word & 0xFF, flags, stream, data[pos + 9 : pos + 9 + length]))
            pos += 9 + length
        self.written.clear()
        return out


def connect() -> tuple[H2Connection, FakeTransport]:
    connection = H2Connection()
    transport = FakeTransport()
    connection.connection_made(transport)  # type: ignore[arg-type]
    return connection, transport


def answer(stream: int, message: bytes = b"\x00\x00\x00\x00\x02hi") -> bytes:
    """Response headers, one DATA frame, trailers (header blocks are never decoded)."""
    return (frame(HEADERS, END_HEADERS, stream, b"\x88") + frame(DATA, 0, stream, message)
            + frame(HEADERS, END_HEADERS | END_STREAM, stream, b"\x40\x0bgrpc-status\x010"))


def test_hpack_integers():
    assert hpack_int(10, 5, 0) == b"\x0a"
    assert hpack_int(1337, 5, 0) == b"\x1f\x9a\x0a"  # RFC 7541 C.1.2
    assert hpack_int(31, 4, 0) == b"\x0f\x10"
    assert grpc_message(b"abc") == b"\x00\x00\x00\x00\x03abc"


def test_request_headers_block():
    block = HEADERS_BLOCK
    assert block.startswith(b"\x83\x86")  # :method POST, :scheme http (static table)
    assert b"\x04\x2a/inference.GRPCInferenceService/ModelInfer" in block  # :path, 42 bytes, no Huffman
    assert b"\x01\x0e127.0.0.1:8001" in block  # :authority
    assert b"\x0f\x10\x10application/grpc" in block  # content-type (static 31)
    assert b"\x00\x02te\x08trailers" in block


def test_connection_start_and_a_call():
    async def go():
        connection, transport = connect()
        assert bytes(transport.written).startswith(PREFACE)
        (settings, window) = transport.frames()
        assert settings[:3] == (SETTINGS, 0, 0)
        assert struct.unpack(">HIHI", settings[3]) == (2, 0, 4, 2**31 - 1)  # no push, wide windows
        assert window[0] == WINDOW_UPDATE and struct.unpack(">I", window[3])[0] == 2**31 - 1 - 65535
        message = grpc_message(b"request")
        first = connection.call(HEADERS_BLOCK, message)
        second = connection.call(HEADERS_BLOCK, message)
        written = transport.frames()
        assert [(k, f, s) for k, f, s, _ in written] == [
            (HEADERS, END_HEADERS, 1), (DATA, END_STREAM, 1), (HEADERS, END_HEADERS, 3), (DATA, END_STREAM, 3)]
        assert written[0][3] == HEADERS_BLOCK and written[1][3] == message
        raw = answer(3) + answer(1)
        connection.data_received(raw[:5])  # frames split across reads
        connection.data_received(raw[5:40])
        assert not first.done() and not second.done()
        connection.data_received(raw[40:])
        assert second.result() is True and first.result() is True
        assert not connection.streams

    asyncio.run(go())


def test_trailers_only_answer_is_a_failure():
    async def go():
        connection, transport = connect()
        call = connection.call(HEADERS_BLOCK, grpc_message(b"x"))
        connection.data_received(frame(HEADERS, END_HEADERS | END_STREAM, 1, b"\x88\x40..."))
        return call.result()

    assert asyncio.run(go()) is False


def test_settings_ping_and_rst_stream():
    async def go():
        connection, transport = connect()
        transport.frames()
        call = connection.call(HEADERS_BLOCK, grpc_message(b"x"))
        transport.frames()
        connection.data_received(
            frame(SETTINGS, 0, 0, struct.pack(">HIHI", 4, 1 << 20, 3, 100))
            + frame(PING, 0, 0, b"12345678")
            + frame(RST_STREAM, 0, 1, struct.pack(">I", 8))
        )
        replies = transport.frames()
        assert (SETTINGS, 1, 0, b"") in replies  # ACK
        assert (PING, 1, 0, b"12345678") in replies
        assert connection.stream_window == 1 << 20 and connection.max_streams == 100
        with pytest.raises(RequestError, match="reset the stream"):
            call.result()

    asyncio.run(go())


def test_flow_control_waits_for_the_servers_window():
    async def go():
        connection, transport = connect()
        transport.frames()
        message = bytes(100_000)
        call = connection.call(HEADERS_BLOCK, message)
        sent = transport.frames()
        assert sent[0][0] == HEADERS
        data = [f for f in sent if f[0] == DATA]
        assert sum(len(f[3]) for f in data) == 65535 and all(len(f[3]) <= 16384 for f in data)
        assert not any(f[1] & END_STREAM for f in data)
        connection.data_received(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 50_000)))
        assert not transport.frames()  # the stream's own window is still closed
        connection.data_received(frame(WINDOW_UPDATE, 0, 1, struct.pack(">I", 50_000)))
        rest = transport.frames()
        assert sum(len(f[3]) for f in rest) == 100_000 - 65535
        assert rest[-1][1] & END_STREAM and not any(f[1] & END_STREAM for f in rest[:-1])
        connection.data_received(answer(1))
        return call.result()

    assert asyncio.run(go()) is True


def test_goaway_and_connection_loss():
    async def go():
        connection, transport = connect()
        first = connection.call(HEADERS_BLOCK, grpc_message(b"a"))
        second = connection.call(HEADERS_BLOCK, grpc_message(b"b"))
        connection.data_received(frame(GOAWAY, 0, 0, struct.pack(">II", 1, 0) + b"bye"))
        assert not connection.usable
        with pytest.raises(RequestError, match="GOAWAY"):
            second.result()
        later = connection.call(HEADERS_BLOCK, grpc_message(b"c"))
        with pytest.raises(RequestError):
            later.result()
        connection.connection_lost(None)
        with pytest.raises(RequestError, match="connection lost"):
            first.result()

    asyncio.run(go())


def test_receive_window_is_topped_up():
    async def go():
        connection, transport = connect()
        call = connection.call(HEADERS_BLOCK, grpc_message(b"x"))
        transport.frames()
        connection.received = (1 << 30) - 5
        connection.data_received(answer(1, b"\x00\x00\x00\x00\x05hello"))
        (update,) = transport.frames()
        assert update[:3] == (WINDOW_UPDATE, 0, 0)
        assert struct.unpack(">I", update[3])[0] == (1 << 30) + 5
        assert connection.received == 0 and call.result() is True

    asyncio.run(go())
