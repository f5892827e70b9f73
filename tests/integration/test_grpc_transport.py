"""The gRPC frontend's own HTTP/2 transport (dlserve.frontends.grpc_transport), driven by a
raw HTTP/2 client over a real TCP socket: the framing, flow-control, keepalive, abuse
and shutdown behaviours real gRPC clients rarely exercise. The RPCs themselves are
covered by test_grpc.py with tritonclient and grpcio."""

from __future__ import annotations

import contextlib
import gzip
import socket
import struct
import threading
import time
import urllib.parse
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import grpc
import hpack
import numpy as np
import pytest

from dlserve.frontends import KServeGrpc
from dlserve.frontends.grpc_stream import STREAM_BACKLOG
from dlserve.frontends.proto import grpc_service_pb2 as pb
from dlserve.frontends.proto import grpc_service_pb2_grpc as pb_grpc

from ..conftest import open_fds, serve, wait_until

# RFC 9113, written out here so the test does not share the server's constants
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    0, 1, 3, 4, 6, 7, 8, 9
)  # fmt: skip
END_STREAM = ACK = 0x1
END_HEADERS, PADDED = 0x4, 0x8
MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE = 0x3, 0x4
NO_ERROR, PROTOCOL_ERROR, REFUSED_STREAM, CANCEL, ENHANCE_YOUR_CALM = 0x0, 0x1, 0x7, 0x8, 0xB
FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR = 0x3, 0x6
PRIORITY = 2
HEAD = struct.Struct(">IBI")  # (length << 8 | type), flags, stream id

INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
A = np.arange(16, dtype=np.float32)
B = np.full(16, 0.5, dtype=np.float32)


class Frame(NamedTuple):
    kind: int
    flags: int
    stream: int
    payload: bytes


def frame(kind: int, flags: int = 0, stream: int = 0, payload: bytes = b"") -> bytes:
    return HEAD.pack((len(payload) << 8) | kind, flags, stream) + payload


def prefixed(message: bytes, flag: int = 0, length: int | None = None) -> bytes:
    """A gRPC length-prefixed message (the length announced may lie)."""
    return bytes([flag]) + struct.pack(">I", len(message) if length is None else length) + message


@dataclass
class Answer:
    """What came back on one stream."""

    headers: dict[str, str] = field(default_factory=dict)
    data: bytes = b""
    trailers: dict[str, str] = field(default_factory=dict)

    @property
    def status(self) -> int:
        return int(self.trailers["grpc-status"])

    @property
    def message(self) -> str:
        return urllib.parse.unquote(self.trailers.get("grpc-message", ""))

    def messages(self) -> list[bytes]:
        out, pos = [], 0
        while pos < len(self.data):
            flag, length = self.data[pos], struct.unpack_from(">I", self.data, pos + 1)[0]
            body = self.data[pos + 5 : pos + 5 + length]
            assert len(body) == length, "truncated gRPC message"
            out.append(zlib.decompress(body, 47) if flag else body)  # (gzip or zlib)
            pos += 5 + length
        return out

    def response(self) -> pb.ModelInferResponse:
        assert self.headers.get(":status") == "200", self.headers
        assert self.status == 0, (self.status, self.message)
        (message,) = self.messages()
        return pb.ModelInferResponse.FromString(message)


class H2Client:
    """A raw HTTP/2 client: frames out, frames in, HPACK on both sides."""

    def __init__(self, port: int, settings: dict[int, int] | None = None, timeout: float = 5.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.timeout = timeout
        self.encoder, self.decoder = hpack.Encoder(), hpack.Decoder()
        self.buffer = b""
        self.last_stream = -1
        self.connection_window = 65535  # what we may send, as the server's updates grow it
        payload = b"".join(struct.pack(">HI", k, v) for k, v in (settings or {}).items())
        self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0, payload))

    def handshake(self) -> dict[int, int]:
        """Read the server's SETTINGS (ACK them) and its ACK of ours; the server's settings."""
        theirs: dict[int, int] | None = None
        acked = False
        while theirs is None or not acked:
            f = self.recv()
            assert f is not None, "connection closed during the handshake"
            if f.kind == SETTINGS and f.flags & ACK:
                acked = True
            elif f.kind == SETTINGS:
                theirs = dict(struct.iter_unpack(">HI", f.payload))
                self.send(SETTINGS, ACK)
            elif f.kind == WINDOW_UPDATE and f.stream == 0:
                self.connection_window += struct.unpack(">I", f.payload)[0]
        return theirs

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> H2Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- frames ----------------------------------------------------------------------------
    def send(self, kind: int, flags: int = 0, stream: int = 0, payload: bytes = b"") -> None:
        self.sock.sendall(frame(kind, flags, stream, payload))

    def recv(self, timeout: float | None = None) -> Frame | None:
        """The next frame; None once the server has closed the connection. A frame that
        does not come within ``timeout`` raises TimeoutError."""
        self.sock.settimeout(self.timeout if timeout is None else timeout)
        while len(self.buffer) < 9 + int.from_bytes(self.buffer[:3], "big"):
            try:
                chunk = self.sock.recv(1 << 20)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                assert not self.buffer, f"connection closed inside a frame: {self.buffer!r}"
                return None
            self.buffer += chunk
        word, flags, stream = HEAD.unpack_from(self.buffer)
        end = 9 + (word >> 8)
        payload, self.buffer = self.buffer[9:end], self.buffer[end:]
        return Frame(word & 0xFF, flags, stream & 0x7FFFFFFF, payload)

    def wait_closed(self, timeout: float) -> list[Frame]:
        """Read until the server closes the connection (fails after ``timeout``); the frames."""
        frames, deadline = [], time.monotonic() + timeout
        while (f := self.recv(max(0.01, deadline - time.monotonic()))) is not None:
            frames.append(f)
        return frames

    # -- calls -----------------------------------------------------------------------------
    def header_block(self, path: str = INFER, extra: list[tuple[str, str]] = ()) -> bytes:
        return self.encoder.encode(
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", "127.0.0.1"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                *extra,
            ]
        )

    def new_stream(self) -> int:
        self.last_stream += 2
        return self.last_stream

    def start_call(
        self,
        message: bytes,
        path: str = INFER,
        extra: list[tuple[str, str]] = (),
        flag: int = 0,
    ) -> int:
        """HEADERS and one DATA frame (in 16 KiB frames if bigger) ending the stream."""
        stream = self.new_stream()
        out = [frame(HEADERS, END_HEADERS, stream, self.header_block(path, extra))]
        body = prefixed(message, flag)
        for pos in range(0, len(body), 16384):
            last = pos + 16384 >= len(body)
            out.append(frame(DATA, END_STREAM if last else 0, stream, body[pos : pos + 16384]))
        self.sock.sendall(b"".join(out))
        return stream

    def collect(self, *streams: int, timeout: float = 5.0) -> dict[int, Answer]:
        """Read until each of ``streams`` has ended; their answers. Other frames (window
        updates, a reset after an answer, SETTINGS) are passed over."""
        answers = {stream: Answer() for stream in streams}
        pending = set(streams)
        deadline = time.monotonic() + timeout
        while pending:
            f = self.recv(max(0.01, deadline - time.monotonic()))
            assert f is not None, f"connection closed with streams {pending} open"
            if f.kind == HEADERS:
                headers = dict(self.decoder.decode(f.payload, raw=False))
                assert f.flags & END_HEADERS  # the server sends no CONTINUATION
                if f.stream in pending:
                    answer = answers[f.stream]
                    if not answer.headers:
                        answer.headers = headers
                    if f.flags & END_STREAM:
                        answer.trailers = headers
            elif f.kind == DATA and f.stream in pending:
                answers[f.stream].data += f.payload
            elif f.kind == RST_STREAM:
                assert f.stream not in pending, f"stream {f.stream} reset: {f.payload!r}"
            elif f.kind == GOAWAY:
                pytest.fail(f"unexpected GOAWAY {f.payload!r}")
            if f.kind in (HEADERS, DATA) and f.flags & END_STREAM:
                pending.discard(f.stream)
        return answers

    def call(self, message: bytes, **kwargs) -> Answer:
        return self.collect(self.start_call(message, **kwargs))[self.last_stream]


# -- requests --------------------------------------------------------------------------------
def add_sub_request(a: np.ndarray = A, b: np.ndarray = B, id: str = "") -> bytes:
    request = pb.ModelInferRequest(model_name="add_sub", id=id)
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="FP32", shape=[16])
    request.raw_input_contents.extend([a.tobytes(), b.tobytes()])
    return request.SerializeToString()


def identity_request(values: int, scale: float = 1.0) -> bytes:
    request = pb.ModelInferRequest(model_name="identity")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[values])
    request.raw_input_contents.append((np.arange(values, dtype=np.float32) * scale).tobytes())
    return request.SerializeToString()


def sleep_request(seconds: float) -> bytes:
    """The ``faulty`` model, sleeping ``seconds`` in execute()."""
    request = pb.ModelInferRequest(model_name="faulty")
    request.parameters["mode"].string_param = f"sleep:{seconds}"
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[2])
    request.raw_input_contents.append(np.ones(2, np.float32).tobytes())
    return request.SerializeToString()


def faulty_request(values: int, mode: str = "ok") -> bytes:
    """The ``faulty`` model echoing ``values`` floats (after misbehaving as ``mode`` says)."""
    request = pb.ModelInferRequest(model_name="faulty")
    request.parameters["mode"].string_param = mode
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[values])
    request.raw_input_contents.append(np.ones(values, np.float32).tobytes())
    return request.SerializeToString()


class CreditedSender:
    """Sends one stream's bytes only as the server's flow-control windows allow,
    reading the server's frames (its window updates, the call's answer) meanwhile."""

    def __init__(self, client: H2Client, stream: int, stream_window: int) -> None:
        self.client, self.stream = client, stream
        self.stream_credit, self.connection_credit = stream_window, client.connection_window
        self.answer = Answer()
        self.data = bytearray()  # the answer's DATA (joined into it at the end: megabytes)

    def send(self, data: bytes, quiet: float) -> int:
        """Send ``data``; returns how much went out before the server granted nothing
        more for ``quiet`` seconds (all of it if it never stopped)."""
        sent = 0
        while sent < len(data):
            allowed = min(self.stream_credit, self.connection_credit, 1 << 16, len(data) - sent)
            if allowed > 0:
                self.client.send(DATA, 0, self.stream, data[sent : sent + allowed])
                sent += allowed
                self.stream_credit -= allowed
                self.connection_credit -= allowed
                continue
            try:
                self.read(quiet)
            except TimeoutError:
                return sent
        return sent

    def read(self, timeout: float) -> Frame:
        f = self.client.recv(timeout)
        assert f is not None, "connection closed"
        if f.kind == WINDOW_UPDATE:
            increment = struct.unpack(">I", f.payload)[0]
            if f.stream == 0:
                self.connection_credit += increment
            elif f.stream == self.stream:
                self.stream_credit += increment
        elif f.kind == DATA and f.stream == self.stream:
            self.data += f.payload
        elif f.kind == HEADERS and f.stream == self.stream:
            headers = dict(self.client.decoder.decode(f.payload, raw=False))
            if f.flags & END_STREAM:
                self.answer.trailers = headers
                self.answer.data = bytes(self.data)
            else:
                self.answer.headers = headers
        return f

    def finish(self, timeout: float) -> Answer:
        """End our side of the call; the whole answer."""
        self.client.send(DATA, END_STREAM, self.stream)
        deadline = time.monotonic() + timeout
        while not self.answer.trailers:
            self.read(max(0.01, deadline - time.monotonic()))
        return self.answer


def wait_until_faulty_is_idle(client: H2Client) -> None:
    """Sleeps of earlier tests may still run in ``faulty``'s one instance: wait them out,
    so that the next call executes at once."""
    assert client.call(sleep_request(0)).status == 0


def output(response: pb.ModelInferResponse, name: str) -> np.ndarray:
    index = [o.name for o in response.outputs].index(name)
    return np.frombuffer(response.raw_output_contents[index], dtype=np.float32)


def check_add_sub(answer: Answer, a: np.ndarray = A, b: np.ndarray = B) -> None:
    response = answer.response()
    assert response.model_name == "add_sub"
    np.testing.assert_array_equal(output(response, "OUTPUT0"), a + b)
    np.testing.assert_array_equal(output(response, "OUTPUT1"), a - b)


# -- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    yield from serve(tmp_path_factory, ["add_sub", "identity", "faulty"])


@contextlib.contextmanager
def grpc_service(server, **options) -> Iterator[int]:
    """A KServeGrpc service with these options on a free 127.0.0.1 port; its port."""
    service = KServeGrpc(server, KServeGrpc.Options(address="127.0.0.1", port=0, **options))
    service.start()
    try:
        yield service.port
    finally:
        service.stop()


@pytest.fixture(scope="module")
def port(server) -> Iterator[int]:
    """A service with default options for the tests that need no special ones."""
    with grpc_service(server) as p:
        yield p


@pytest.fixture(scope="module", autouse=True)
def fds_before(port) -> set[int]:
    """The descriptors open once the server and the default service are up."""
    return open_fds()


@pytest.fixture
def h2(port) -> Iterator[H2Client]:
    with H2Client(port) as client:
        client.handshake()
        yield client


# -- tests -----------------------------------------------------------------------------------
def test_unary_call_by_hand(h2):
    stream = h2.start_call(add_sub_request())
    answer = h2.collect(stream)[stream]
    assert answer.headers[":status"] == "200"
    assert answer.headers["content-type"] == "application/grpc"
    assert answer.trailers == {"grpc-status": "0"}
    check_add_sub(answer)
    # again on the same connection, the header block now all table references, and
    # alternating with another method (another :path) whose blocks become so too
    live = pb.ServerLiveRequest().SerializeToString()
    live_path = "/inference.GRPCInferenceService/ServerLive"
    for a, b in ((B, A), (A, A), (B, B)):
        check_add_sub(h2.call(add_sub_request(a, b)), a, b)
        (reply,) = h2.call(live, path=live_path).messages()
        assert pb.ServerLiveResponse.FromString(reply).live


def test_server_settings_and_window(port):
    with H2Client(port) as client:
        settings = client.handshake()
    # streams' receive windows are bounded (flow control that reaches the client) and
    # wide enough for big tensors; the connection's is opened wide
    assert 1 << 20 <= settings[INITIAL_WINDOW_SIZE] <= 1 << 26
    assert settings[0x5] >= 16384  # MAX_FRAME_SIZE


def test_messages_split_across_frames_and_interleaved(h2):
    first, second = h2.new_stream(), h2.new_stream()
    one, two = prefixed(add_sub_request()), prefixed(add_sub_request(B, A))
    h2.send(HEADERS, END_HEADERS, first, h2.header_block())
    h2.send(HEADERS, END_HEADERS, second, h2.header_block())
    # cuts inside the 5-byte prefix, right after it, and inside the body; the two
    # streams' frames alternate
    cuts_one, cuts_two = [0, 2, 5, 40, len(one)], [0, 1, 4, 9, 100, len(two)]
    pieces_one = [one[a:b] for a, b in zip(cuts_one, cuts_one[1:])]
    pieces_two = [two[a:b] for a, b in zip(cuts_two, cuts_two[1:])]
    for i in range(max(len(pieces_one), len(pieces_two))):
        for stream, pieces in ((second, pieces_two), (first, pieces_one)):
            if i < len(pieces):
                last = i == len(pieces) - 1
                h2.send(DATA, END_STREAM if last else 0, stream, pieces[i])
    answers = h2.collect(first, second)
    check_add_sub(answers[first])
    check_add_sub(answers[second], B, A)


def test_stream_call_messages_within_and_across_frames(h2):
    first, second, third = (prefixed(add_sub_request(A + i, B, id=str(i))) for i in range(3))
    stream = h2.new_stream()
    h2.send(HEADERS, END_HEADERS, stream, h2.header_block(STREAM_INFER))
    h2.send(DATA, 0, stream, first + second[:7])
    # the first answer comes while the client's side is still open
    answer = Answer()
    while not answer.data:
        f = h2.recv()
        assert f.stream in (0, stream), f
        if f.kind == HEADERS:
            answer.headers = dict(h2.decoder.decode(f.payload, raw=False))
            assert not f.flags & END_STREAM, answer.headers
        elif f.kind == DATA:
            answer.data = f.payload
    assert answer.headers[":status"] == "200"
    h2.send(DATA, 0, stream, second[7:] + third[:2])
    h2.send(DATA, 0, stream, third[2:])
    # the client ends its side with trailers instead of an empty DATA frame
    h2.send(HEADERS, END_HEADERS | END_STREAM, stream, h2.encoder.encode([("x-end", "1")]))
    rest = h2.collect(stream)[stream]
    answer.data += rest.data
    assert rest.status == 0, rest.message
    replies = [pb.ModelStreamInferResponse.FromString(m) for m in answer.messages()]
    assert sorted(r.infer_response.id for r in replies) == ["0", "1", "2"]
    for reply in replies:
        assert not reply.error_message
        i = int(reply.infer_response.id)
        np.testing.assert_array_equal(output(reply.infer_response, "OUTPUT0"), A + i + B)


def test_two_messages_in_one_frame_are_refused_for_a_unary_call(h2):
    stream = h2.new_stream()
    h2.send(HEADERS, END_HEADERS, stream, h2.header_block())
    message = prefixed(add_sub_request())
    h2.send(DATA, END_STREAM, stream, message + message)
    answer = h2.collect(stream)[stream]
    assert answer.status == grpc.StatusCode.UNIMPLEMENTED.value[0]
    check_add_sub(h2.call(add_sub_request()))


def test_continuation_and_padding(h2):
    # HEADERS split in three: HEADERS (padded) + CONTINUATION + CONTINUATION
    stream = h2.new_stream()
    block = h2.header_block()
    parts = [block[:5], block[5:11], block[11:]]
    padding = 7
    h2.send(HEADERS, PADDED, stream, bytes([padding]) + parts[0] + b"\0" * padding)
    h2.send(CONTINUATION, 0, stream, parts[1])
    h2.send(CONTINUATION, END_HEADERS, stream, parts[2])
    # the message in two PADDED DATA frames, one with padding only after a split prefix
    message = prefixed(add_sub_request())
    h2.send(DATA, PADDED, stream, bytes([3]) + message[:3] + b"\0" * 3)
    h2.send(DATA, PADDED | END_STREAM, stream, bytes([0]) + message[3:])
    check_add_sub(h2.collect(stream)[stream])
    # HEADERS with padding and END_HEADERS in one frame
    stream = h2.new_stream()
    h2.send(HEADERS, PADDED | END_HEADERS, stream, b"\x02" + h2.header_block() + b"\0\0")
    h2.send(DATA, END_STREAM, stream, message)
    check_add_sub(h2.collect(stream)[stream])


def test_unknown_method_is_unimplemented_and_the_connection_lives_on(h2):
    path = "/inference.GRPCInferenceService/NoSuchMethod"
    stream = h2.start_call(b"", path=path)
    frames = []
    while not frames or not (frames[-1].kind == HEADERS and frames[-1].stream == stream):
        frames.append(h2.recv())
    # trailers-only: one HEADERS frame ending the stream, carrying :status and grpc-status
    answer_frame = frames[-1]
    assert answer_frame.flags & END_STREAM
    headers = dict(h2.decoder.decode(answer_frame.payload, raw=False))
    assert headers[":status"] == "200"
    assert headers["grpc-status"] == str(grpc.StatusCode.UNIMPLEMENTED.value[0])
    assert path in urllib.parse.unquote(headers["grpc-message"])
    assert not any(f.kind == DATA for f in frames)
    check_add_sub(h2.call(add_sub_request()))


def test_reset_stream_while_executing(h2):
    wait_until_faulty_is_idle(h2)
    stream = h2.start_call(sleep_request(0.5))
    time.sleep(0.15)  # the model is executing now
    h2.send(RST_STREAM, 0, stream, struct.pack(">I", CANCEL))
    # nothing more on that stream, even after the model is done
    deadline = time.monotonic() + 0.8
    while (left := deadline - time.monotonic()) > 0:
        try:
            f = h2.recv(left)
        except TimeoutError:
            break
        assert f is not None, "the server closed the connection"
        assert f.stream != stream, f"{f} on the reset stream"
    check_add_sub(h2.call(add_sub_request()))


def test_grpc_timeout_answers_deadline_exceeded_at_the_deadline(h2):
    started = time.monotonic()
    stream = h2.start_call(sleep_request(1.5), extra=[("grpc-timeout", "300m")])
    answer = h2.collect(stream)[stream]
    elapsed = time.monotonic() - started
    assert answer.status == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], answer.message
    assert 0.28 <= elapsed < 1.0, elapsed  # at the deadline, not when the model is done
    # a call whose request never finishes arriving gets the same answer
    stream = h2.new_stream()
    h2.send(HEADERS, END_HEADERS, stream, h2.header_block(extra=[("grpc-timeout", "150000u")]))
    h2.send(DATA, 0, stream, prefixed(add_sub_request())[:10])
    started = time.monotonic()
    answer = h2.collect(stream)[stream]
    assert answer.status == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert time.monotonic() - started < 0.6
    check_add_sub(h2.call(add_sub_request()))


def test_grpcio_client_deadline(port):
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        request = pb.ModelInferRequest.FromString(sleep_request(1.0))
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request, timeout=0.3)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 0.8
        reply = stub.ModelInfer(pb.ModelInferRequest.FromString(add_sub_request()), timeout=5)
        np.testing.assert_array_equal(output(reply, "OUTPUT0"), A + B)


def test_ping_is_answered_with_the_same_payload(h2):
    h2.send(PING, 0, 0, b"\x01\x02\x03\x04dl\xffs")
    f = h2.recv()
    assert f == Frame(PING, ACK, 0, b"\x01\x02\x03\x04dl\xffs")


def answer_pings(client: H2Client, seconds: float) -> int:
    """ACK the server's pings for ``seconds``; how many came. Fails if the connection ends."""
    pings, deadline = 0, time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            f = client.recv(left)
        except TimeoutError:
            break
        assert f is not None, f"connection closed after {pings} pings"
        if f.kind == PING and not f.flags & ACK:
            pings += 1
            client.send(PING, ACK, 0, f.payload)
    return pings


# pings every 100 ms, idle or not, with no limit on pings while no data is sent
KEEPALIVE = dict(
    keepalive_time_ms=100,
    keepalive_timeout_ms=300,
    keepalive_permit_without_calls=True,
    http2_max_pings_without_data=0,  # (servers ignore it: see the test below)
)


def test_keepalive_pings_answered_keep_the_connection(server):
    with grpc_service(server, **KEEPALIVE) as p, H2Client(p) as client:
        client.handshake()
        assert answer_pings(client, 1.1) >= 5
        check_add_sub(client.call(add_sub_request()))


def test_keepalive_ignores_max_pings_without_data(server):
    # grpc's servers apply http2_max_pings_without_data to clients only: a server's
    # keepalive must go on probing through a long call that sends nothing
    options = dict(KEEPALIVE, http2_max_pings_without_data=2)
    with grpc_service(server, **options) as p, H2Client(p) as client:
        client.handshake()
        assert answer_pings(client, 0.8) >= 4


def test_keepalive_pings_unanswered_close_the_connection(server):
    with grpc_service(server, **KEEPALIVE) as p, H2Client(p) as client:
        client.handshake()
        started = time.monotonic()
        frames = client.wait_closed(timeout=1.5)
        elapsed = time.monotonic() - started
        assert any(f.kind == PING for f in frames)
        assert 0.3 <= elapsed < 1.0, elapsed


def test_keepalive_timeout_is_per_ping(server):
    # pings every 100 ms, each ACKed 60 ms after it came: well inside the 250 ms timeout
    options = dict(KEEPALIVE, keepalive_timeout_ms=250)
    with grpc_service(server, **options) as p, H2Client(p) as client:
        client.handshake()
        due: list[tuple[float, bytes]] = []
        deadline = time.monotonic() + 1.0
        while (now := time.monotonic()) < deadline:
            while due and due[0][0] <= now:
                client.send(PING, ACK, 0, due.pop(0)[1])
            wait = min([deadline] + [d for d, _ in due[:1]]) - now
            try:
                f = client.recv(max(0.001, wait))
            except TimeoutError:
                continue
            assert f is not None, "connection closed though every ping was answered in time"
            if f.kind == PING and not f.flags & ACK:
                due.append((time.monotonic() + 0.06, f.payload))


def test_too_many_pings_get_goaway(server):
    with grpc_service(server, http2_max_ping_strikes=2) as p, H2Client(p) as client:
        client.handshake()
        client.sock.sendall(b"".join(frame(PING, 0, 0, b"%08d" % i) for i in range(5)))
        frames = client.wait_closed(timeout=2)
    acks = [f for f in frames if f.kind == PING]
    assert [f.flags for f in acks] == [ACK] * 3  # the first is free, then two strikes
    (goaway,) = [f for f in frames if f.kind == GOAWAY]
    last_stream, code = struct.unpack_from(">II", goaway.payload)
    assert (last_stream, code) == (0, ENHANCE_YOUR_CALM)
    assert goaway.payload[8:] == b"too_many_pings"
    assert frames[-1] == goaway


def test_too_many_pings_get_goaway_with_a_call_open(server):
    # as grpc: an open call that sends nothing does not make a ping flood acceptable
    with grpc_service(server, http2_max_ping_strikes=2) as p, H2Client(p) as client:
        client.handshake()
        stream = client.new_stream()
        client.send(HEADERS, END_HEADERS, stream, client.header_block(STREAM_INFER))
        client.sock.sendall(b"".join(frame(PING, 0, 0, b"%08d" % i) for i in range(5)))
        frames = client.wait_closed(timeout=2)
    assert [f.payload for f in frames if f.kind == PING] == [b"%08d" % i for i in range(3)]
    (goaway,) = [f for f in frames if f.kind == GOAWAY]
    assert struct.unpack_from(">II", goaway.payload) == (stream, ENHANCE_YOUR_CALM)
    assert goaway.payload[8:] == b"too_many_pings"


def test_an_answer_sent_as_the_window_opens_forgives_pings_piece_by_piece(server):
    # as grpc: each DATA frame sent starts the count again, also those of an answer paced
    # by the client's window (a client may ping, as grpc's do, as it reads)
    options = dict(http2_max_ping_strikes=2)
    with grpc_service(server, **options) as p, H2Client(p, {INITIAL_WINDOW_SIZE: 0}) as client:
        client.handshake()
        client.send(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1 << 20))
        stream = client.start_call(identity_request(16 * 1024))  # 64 KiB back
        answer, credit, pings = Answer(), 0, 0
        while not answer.trailers:
            f = client.recv()
            assert f is not None and f.kind != GOAWAY, f
            if f.kind == HEADERS:
                headers = dict(client.decoder.decode(f.payload, raw=False))
                if f.flags & END_STREAM:
                    answer.trailers = headers
                else:
                    answer.headers = headers
            elif f.kind == DATA:
                answer.data += f.payload
                credit -= len(f.payload)
            if answer.headers and credit == 0 and not answer.trailers:
                client.send(PING, 0, 0, b"%08d" % pings)  # a ping, then 8 KiB more window
                client.send(WINDOW_UPDATE, 0, stream, struct.pack(">I", 8192))
                credit, pings = 8192, pings + 1
        assert pings > 8
        assert len(answer.response().raw_output_contents[0]) == 64 * 1024


def test_answers_sent_forgive_earlier_pings(server):
    # as grpc: sending data or headers starts the count again, so the first ping on an
    # idle connection after an answer is free, whatever came before it
    with grpc_service(server, http2_max_ping_strikes=2) as p, H2Client(p) as client:
        client.handshake()
        client.sock.sendall(frame(PING, 0, 0, b"before00"))
        check_add_sub(client.call(add_sub_request()))
        client.sock.sendall(b"".join(frame(PING, 0, 0, b"%08d" % i) for i in range(5)))
        frames = client.wait_closed(timeout=2)
    acks = [f.payload for f in frames if f.kind == PING and f.payload != b"before00"]
    assert acks == [b"00000000", b"00000001", b"00000002"]  # free, then two strikes
    assert frames[-1].kind == GOAWAY


def test_a_client_that_reads_nothing_is_read_no_more(server):
    """SETTINGS sent in a loop by a client that reads nothing (each owes it an ACK, and no
    ping policy counts them): once what the server writes it piles up, the server stops
    reading it, so it holds a bounded backlog of ACKs, and serves other clients meanwhile.
    Once the client reads, every frame is answered and the connection serves on."""
    count = 400_000  # 3.6 MiB of SETTINGS, owed as much of ACKs
    service = KServeGrpc(server, KServeGrpc.Options(address="127.0.0.1", port=0))
    with service, H2Client(service.port) as client:
        client.handshake()
        (connection,) = service._grpc._transport.connections
        client.sock.settimeout(60)  # (for the flood: it blocks until the client reads)
        flood = threading.Thread(target=client.sock.sendall, args=(frame(SETTINGS) * count,))
        flood.start()
        try:
            wait_until(lambda: not connection.transport.is_reading(), timeout=10)
            held = connection.transport.get_write_buffer_size()
            assert held <= 1 << 20, held  # (about one read's worth)
            with H2Client(service.port) as other:
                other.handshake()
                check_add_sub(other.call(add_sub_request()))
            acks, expected = bytearray(client.buffer), frame(SETTINGS, ACK) * count
            while len(acks) < len(expected):
                chunk = client.sock.recv(1 << 20)
                assert chunk, "connection closed"
                acks += chunk
            assert acks == expected
            flood.join(timeout=10)
        finally:
            if flood.is_alive():
                client.sock.shutdown(socket.SHUT_RDWR)  # (wakes it)
                flood.join()
        client.buffer = b""
        check_add_sub(client.call(add_sub_request()))


def test_max_connection_age(server):
    options = dict(max_connection_age_ms=200, max_connection_age_grace_ms=300)
    with grpc_service(server, **options) as p, H2Client(p) as client:
        started = time.monotonic()
        client.handshake()
        check_add_sub(client.call(add_sub_request()))
        f = client.recv()
        while f.kind != GOAWAY:
            f = client.recv()
        aged = time.monotonic() - started
        assert 0.15 <= aged < 0.6, aged
        last_stream, code = struct.unpack_from(">II", f.payload)
        assert (last_stream, code) == (1, NO_ERROR)
        client.wait_closed(timeout=1.5)
        closed = time.monotonic() - started
        assert 0.45 <= closed < 1.2, closed



def test_past_the_connection_bound_the_idle_connection_makes_room(server):
    """At the bound a new connection takes the place of the one idle longest: a GOAWAY
    (NO_ERROR, nothing refused) and a close; a grpcio client so shed reconnects for its
    next call."""
    with grpc_service(server, max_connections=1) as p:
        with H2Client(p) as first:
            first.handshake()
            check_add_sub(first.call(add_sub_request()))
            with H2Client(p) as second:
                second.handshake()
                check_add_sub(second.call(add_sub_request()))
                frames = first.wait_closed(timeout=2)
                goaway = [f for f in frames if f.kind == GOAWAY]
                assert goaway and struct.unpack_from(">II", goaway[0].payload) == (1, NO_ERROR)
        channels = [grpc.insecure_channel(f"127.0.0.1:{p}") for _ in range(2)]
        try:
            stubs = [pb_grpc.GRPCInferenceServiceStub(c) for c in channels]
            request = pb.ModelInferRequest.FromString(add_sub_request())
            for _ in range(3):  # each call sheds the other channel's connection
                for stub in stubs:
                    reply = stub.ModelInfer(request, timeout=5)
                    np.testing.assert_array_equal(output(reply, "OUTPUT0"), A + B)
        finally:
            for channel in channels:
                channel.close()


def test_with_no_connection_idle_a_new_one_is_refused(server):
    """At the bound with a call open on every connection, a new connection gets a GOAWAY
    ENHANCE_YOUR_CALM that gives the bound, and is closed; the open call finishes."""
    with grpc_service(server, max_connections=1) as p, H2Client(p) as busy:
        busy.handshake()
        stream = busy.new_stream()
        busy.send(HEADERS, END_HEADERS, stream, busy.header_block())  # open, its message to come
        time.sleep(0.1)
        with H2Client(p) as refused:
            frames = refused.wait_closed(timeout=2)
        (goaway,) = [f for f in frames if f.kind == GOAWAY]
        last_stream, code = struct.unpack_from(">II", goaway.payload)
        assert (last_stream, code) == (0, ENHANCE_YOUR_CALM)
        assert goaway.payload[8:] == b"the server holds its maximum of 1 connections; try again later"
        busy.send(DATA, END_STREAM, stream, prefixed(add_sub_request()))
        check_add_sub(busy.collect(stream)[stream])


def test_a_connection_holding_a_frame_begun_is_still_idle_after_the_grace(server):
    """Bytes of a frame, without a call open, do not hold a place at the bound: a
    connection that sent a byte and stopped is shed for a new client once it has had
    FRESH_GRACE to start its first call, and the refused ones take no place."""
    from dlserve.frontends.connection_cap import FRESH_GRACE

    with grpc_service(server, max_connections=1) as p, H2Client(p) as holder:
        holder.handshake()
        holder.sock.sendall(b"\x00")  # the first byte of a frame header, then nothing
        with H2Client(p) as early:  # within the grace: the holder keeps its place
            frames = early.wait_closed(timeout=2)
            assert [f for f in frames if f.kind == GOAWAY], frames
        time.sleep(FRESH_GRACE)
        with grpc.insecure_channel(f"127.0.0.1:{p}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            reply = stub.ModelInfer(pb.ModelInferRequest.FromString(add_sub_request()), timeout=5)
            np.testing.assert_array_equal(output(reply, "OUTPUT0"), A + B)
        assert any(f.kind == GOAWAY for f in holder.wait_closed(timeout=2))


def test_a_request_message_that_stops_coming_ends_its_call(server):
    """A message begun that gets no byte for the message timeout ends its call
    DEADLINE_EXCEEDED (with the stream's end, the client need send no more), and the
    connection serves on; a streaming call waiting for its next message is not stalled,
    nor is a message that keeps coming, however slowly."""
    with grpc_service(server, message_timeout=1) as p, H2Client(p) as client:
        client.handshake()
        stalled, waiting, slow = client.new_stream(), client.new_stream(), client.new_stream()
        message = prefixed(add_sub_request())
        client.send(HEADERS, END_HEADERS, stalled, client.header_block())
        client.send(DATA, 0, stalled, message[:10])  # then nothing
        client.send(HEADERS, END_HEADERS, waiting, client.header_block(STREAM_INFER))
        client.send(HEADERS, END_HEADERS, slow, client.header_block())
        started = time.monotonic()
        for piece in range(0, len(message), 16):  # 16 bytes every 0.15 s: over the timeout
            client.send(DATA, END_STREAM if piece + 16 >= len(message) else 0, slow,
                        message[piece : piece + 16])
            time.sleep(0.15)
        assert time.monotonic() - started > 1.2
        answers = client.collect(stalled, slow, timeout=5)
        assert answers[stalled].status == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert answers[stalled].message == "request message stalled: nothing received for 1 s"
        check_add_sub(answers[slow])
        time.sleep(1.5)  # the streaming call, waiting between messages, is still open
        client.send(DATA, 0, waiting, prefixed(add_sub_request(id="late")))
        f = client.recv()
        while not (f.kind == DATA and f.stream == waiting):  # (its answer)
            if f.kind == HEADERS:
                client.decoder.decode(f.payload)
            f = client.recv()
        check_add_sub(client.call(add_sub_request()))


@pytest.mark.parametrize("sent", ["headers", "message without its end"])
def test_a_unary_call_that_never_ends_ends(server, sent):
    """A unary call runs once its client ends its side: one whose message, or whose end,
    never comes would hold its place (and its message) for good."""
    with grpc_service(server, message_timeout=1) as p, H2Client(p) as client:
        client.handshake()
        stream = client.new_stream()
        client.send(HEADERS, END_HEADERS, stream, client.header_block())
        if sent != "headers":
            client.send(DATA, 0, stream, prefixed(add_sub_request()))  # no END_STREAM
        answer = client.collect(stream, timeout=5)[stream]
        assert answer.status == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        check_add_sub(client.call(add_sub_request()))


def test_a_client_that_said_goaway_is_closed_once_its_calls_are_over(h2):
    """It opens no more calls: its connection would only hold a place."""
    h2.send(GOAWAY, 0, 0, struct.pack(">II", 0, NO_ERROR))
    h2.wait_closed(timeout=2)


def test_a_shed_connection_whose_client_reads_nothing_is_cut_off(server):
    """Shedding closes after the GOAWAY is written; a client that reads nothing would keep
    the close waiting, and the connection counted, for good: it is cut off a second later."""
    service = KServeGrpc(server, KServeGrpc.Options(address="127.0.0.1", port=0, max_connections=1))
    service.start()
    try:
        cap = service._grpc._transport.cap
        with H2Client(service.port) as deaf:
            deaf.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            deaf.handshake()
            deaf.sock.settimeout(0.2)
            try:  # SETTINGS, each answered with an ACK it never reads, until the server stops
                while True:  # reading it (its answers pile up)
                    deaf.sock.send(frame(SETTINGS) * 4096)
            except (TimeoutError, socket.timeout, BlockingIOError):
                pass
            time.sleep(1.2)  # (idle once the grace has passed)
            with grpc.insecure_channel(f"127.0.0.1:{service.port}") as channel:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                assert stub.ServerLive(pb.ServerLiveRequest(), timeout=5).live
                wait_until(lambda: cap.held == 1, timeout=3)  # the deaf one is gone
    finally:
        service.stop()

def test_message_size_limits(server):
    limit = 1 << 14  # (a response just over it fits the client's default flow-control window)
    with grpc_service(server, max_message_size=limit) as p, H2Client(p) as client:
        client.handshake()
        # a prefix announcing too much is refused before the body comes
        stream = client.new_stream()
        client.send(HEADERS, END_HEADERS, stream, client.header_block())
        client.send(DATA, 0, stream, prefixed(b"", length=limit + 1))
        answer = client.collect(stream)[stream]
        assert answer.status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert answer.message == f"Received message larger than max ({limit + 1} vs. {limit})"
        client.send(DATA, END_STREAM, stream, b"\0" * 100)  # the rest, ignored
        check_add_sub(client.call(add_sub_request()))
        # a request just under the limit whose response is just over it: the limit is
        # for what comes in; an answer already computed goes out (as from Triton)
        values = (limit - 64) // 4
        while len(identity_request(values + 1)) <= limit:
            values += 1
        request = identity_request(values)
        response = pb.ModelInferResponse(model_name="identity", model_version="1")
        response.outputs.add(name="OUTPUT0", datatype="FP32", shape=[values])
        response.raw_output_contents.append(b"\0" * 4 * values)
        assert len(response.SerializeToString()) > limit
        reply = client.call(request).response()
        assert len(reply.raw_output_contents[0]) == 4 * values


def test_compressed_requests(h2):
    message = add_sub_request()
    for encoding, packed in (
        ("gzip", gzip.compress(message)),
        ("deflate", zlib.compress(message)),  # gRPC's deflate is the zlib format
    ):
        extra = [("grpc-encoding", encoding)]
        check_add_sub(h2.call(packed, extra=extra, flag=1))
    answer = h2.call(zlib.compress(message), extra=[("grpc-encoding", "snappy")], flag=1)
    assert answer.status == grpc.StatusCode.UNIMPLEMENTED.value[0]
    assert "snappy" in answer.message
    answer = h2.call(b"not gzip at all", extra=[("grpc-encoding", "gzip")], flag=1)
    assert answer.status == grpc.StatusCode.INTERNAL.value[0]
    # flag 0 under a grpc-encoding header: the message is not compressed
    answer = h2.call(message, extra=[("grpc-encoding", "gzip")])
    check_add_sub(answer)
    assert answer.headers["grpc-accept-encoding"] == "identity, gzip, deflate"  # what it reads, as grpc says
    # flag 1 with no grpc-encoding: a protocol error, INTERNAL by gRPC's spec
    answer = h2.call(gzip.compress(message), flag=1)
    assert answer.status == grpc.StatusCode.INTERNAL.value[0]
    assert answer.message == "a message flagged compressed on a call without grpc-encoding"


@pytest.mark.parametrize(
    "encoding, packed",
    [
        ("gzip", gzip.compress(add_sub_request())[:-8]),  # no trailer (CRC-32 and size)
        ("deflate", zlib.compress(add_sub_request()) + b"junk"),  # bytes after the end
    ],
    ids=["gzip-cut-short", "deflate-trailing-bytes"],
)
def test_damaged_compressed_request_is_refused(h2, encoding, packed):
    answer = h2.call(packed, extra=[("grpc-encoding", encoding)], flag=1)
    assert answer.status == grpc.StatusCode.INTERNAL.value[0]


def test_compressed_request_inflating_past_the_limit(server):
    limit = 1 << 16
    with grpc_service(server, max_message_size=limit) as p, H2Client(p) as client:
        client.handshake()
        bomb = gzip.compress(identity_request(limit // 4))  # ~256 KiB of zeros, inflated
        answer = client.call(bomb, extra=[("grpc-encoding", "gzip")], flag=1)
        assert answer.status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert answer.message.startswith("Received message larger than max (")


def test_compressed_responses(server):
    level = KServeGrpc.Grpc_compression_level.LOW  # gzip
    with grpc_service(server, infer_compression_level=level) as p, H2Client(p) as client:
        client.handshake()
        answer = client.call(add_sub_request(), extra=[("grpc-accept-encoding", "identity,gzip")])
        assert answer.headers["grpc-encoding"] == "gzip"
        assert answer.data[0] == 1  # the compressed flag
        check_add_sub(answer)
        answer = client.call(add_sub_request())  # a client that accepts no compression
        assert answer.data[0] == 0
        check_add_sub(answer)
        # Only the other algorithm accepted: that one, as gRPC core (and so Triton) answers.
        deflate_only = [("grpc-accept-encoding", "identity,deflate")]
        answer = client.call(add_sub_request(), extra=deflate_only)
        assert answer.headers["grpc-encoding"] == "deflate" and answer.data[0] == 1
        check_add_sub(answer)


def test_flow_control_of_responses(port):
    values = 64 * 1024  # 256 KiB of response
    window = 1000
    with H2Client(port, settings={INITIAL_WINDOW_SIZE: window}) as client:
        client.handshake()
        stream = client.start_call(identity_request(values))
        expected = np.arange(values, dtype=np.float32)
        stream_credit, connection_credit = window, 65535
        answer, stalled_checked = Answer(), False
        while not answer.trailers:
            if stream_credit == 0:
                if not stalled_checked:  # out of credit: nothing comes until we grant more
                    with pytest.raises(TimeoutError):
                        client.recv(timeout=0.3)
                    stalled_checked = True
                    # meanwhile, other calls of that size (whose buffers the waiting
                    # response must not share) on another connection
                    with H2Client(port, settings={INITIAL_WINDOW_SIZE: 1 << 24}) as other:
                        other.handshake()
                        other.send(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1 << 24))
                        for scale in (-1.0, 3.0):
                            reply = other.call(identity_request(values, scale)).response()
                            np.testing.assert_array_equal(
                                output(reply, "OUTPUT0"), expected * scale
                            )
                grant = 16000  # not a multiple of the frame size: partial frames too
                client.send(WINDOW_UPDATE, 0, stream, struct.pack(">I", grant))
                client.send(WINDOW_UPDATE, 0, 0, struct.pack(">I", grant))
                stream_credit += grant
                connection_credit += grant
            f = client.recv()
            assert f is not None
            if f.kind == DATA:
                assert f.stream == stream
                assert len(f.payload) <= min(stream_credit, connection_credit), (
                    len(f.payload),
                    stream_credit,
                    connection_credit,
                )
                stream_credit -= len(f.payload)
                connection_credit -= len(f.payload)
                answer.data += f.payload
            elif f.kind == HEADERS and f.stream == stream:
                headers = dict(client.decoder.decode(f.payload, raw=False))
                if f.flags & END_STREAM:
                    answer.trailers = headers
                else:
                    answer.headers = headers
        assert stalled_checked
        np.testing.assert_array_equal(output(answer.response(), "OUTPUT0"), expected)


def test_a_stalled_stream_does_not_block_the_others(port):
    window = 1000
    with H2Client(port, settings={INITIAL_WINDOW_SIZE: window}) as client:
        client.handshake()
        client.send(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1 << 24))  # connection: wide open
        client.start_call(identity_request(16 * 1024))  # 64 KiB; its window stays shut
        time.sleep(0.2)  # its first 1000 bytes are out; the rest waits for a window
        moving = client.start_call(identity_request(1024))  # 4 KiB > 1000 bytes
        time.sleep(0.2)
        client.send(WINDOW_UPDATE, 0, moving, struct.pack(">I", 1 << 20))
        answers = {}
        with contextlib.suppress(TimeoutError):
            answers = client.collect(moving, timeout=1.0)
        assert answers, "the call with an open window got nothing"
        assert len(answers[moving].response().raw_output_contents[0]) == 4096


def test_compressed_messages_on_a_stream_are_inflated_as_they_are_read(h2):
    gzipped = [("grpc-encoding", "gzip")]
    stream = h2.new_stream()
    h2.send(HEADERS, END_HEADERS, stream, h2.header_block(STREAM_INFER, gzipped))
    packed = [gzip.compress(add_sub_request(A + i, B, id=str(i))) for i in range(3)]
    h2.send(DATA, END_STREAM, stream, b"".join(prefixed(p, flag=1) for p in packed))
    answer = h2.collect(stream)[stream]
    assert answer.status == 0, answer.message
    replies = [pb.ModelStreamInferResponse.FromString(m) for m in answer.messages()]
    assert sorted(r.infer_response.id for r in replies) == ["0", "1", "2"]
    # a damaged one ends the call when it is read
    stream = h2.new_stream()
    h2.send(HEADERS, END_HEADERS, stream, h2.header_block(STREAM_INFER, gzipped))
    h2.send(DATA, END_STREAM, stream, prefixed(b"not gzip at all", flag=1))
    answer = h2.collect(stream)[stream]
    assert answer.status == grpc.StatusCode.INTERNAL.value[0]
    assert "bad compressed message" in answer.message


def answered(server) -> int:
    """Requests the ``faulty`` model has answered so far."""
    stats = server.model("faulty").statistics()["model_stats"][0]["inference_stats"]
    return stats["success"]["count"] + stats["fail"]["count"]


@pytest.mark.parametrize("message_timeout", [None, 1])
def test_a_stream_whose_client_reads_no_answers_is_held_back(server, port, message_timeout):
    """Answers the client grants no window for wait in the server, but only a bounded
    number: then the call reads no more requests and the window shuts on the client.
    Once the client reads, every answer comes. With a message timeout, the message the
    shut window cut is not the client's stall but the server's holding back: it is kept
    however long the client waits before it reads."""
    with contextlib.ExitStack() as stack:
        if message_timeout is not None:
            port = stack.enter_context(grpc_service(server, message_timeout=message_timeout))
        _held_back_stream(server, port, 2.5 if message_timeout else 0)


def _held_back_stream(server, port: int, wait: float) -> None:
    with H2Client(port) as client:  # the default 65,535-byte windows, never opened further
        settings = client.handshake()
        wait_until_faulty_is_idle(client)
        echo = prefixed(faulty_request(16 * 1024))  # 64 KiB, and as much back
        stream = client.new_stream()
        client.send(HEADERS, END_HEADERS, stream, client.header_block(STREAM_INFER))
        sender = CreditedSender(client, stream, settings[INITIAL_WINDOW_SIZE])
        base, sent = answered(server), 0
        # One request at a time, each answered before the next goes, until answers stop
        # coming: the call has stopped reading.
        while True:
            assert sender.send(echo, quiet=5) == len(echo)
            sent += 1
            deadline = time.monotonic() + 1
            while answered(server) < base + sent and time.monotonic() < deadline:
                time.sleep(0.002)
            if answered(server) < base + sent:
                break
            assert sent <= 2 * STREAM_BACKLOG, "answers nobody reads keep being made"
        assert STREAM_BACKLOG <= answered(server) - base <= STREAM_BACKLOG + 2
        # What the client may still send is what is left of the stream's window.
        more = sender.send(echo * (settings[INITIAL_WINDOW_SIZE] // len(echo) + 8), quiet=0.5)
        assert more <= settings[INITIAL_WINDOW_SIZE]
        sent_bytes = sent * len(echo) + more
        time.sleep(wait)
        # now the client reads
        client.send(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1 << 30))
        client.send(WINDOW_UPDATE, 0, stream, struct.pack(">I", 1 << 30))
        rest = -sent_bytes % len(echo)  # the message cut by the shut window
        assert sender.send(echo[len(echo) - rest :] if rest else b"", quiet=10) == rest
        answer = sender.finish(timeout=30)
    assert answer.status == 0, answer.message
    assert len(answer.messages()) == (sent_bytes + rest) // len(echo)


def test_garbage_instead_of_the_preface(port):
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        received = b""
        while chunk := sock.recv(4096):
            received += chunk
    # the server's SETTINGS (sent on connect) may come first; then GOAWAY PROTOCOL_ERROR
    frames = []
    while received:
        length, kind = int.from_bytes(received[:3], "big"), received[3]
        frames.append((kind, received[9 : 9 + length]))
        received = received[9 + length :]
    assert frames[-1][0] == GOAWAY
    assert struct.unpack_from(">II", frames[-1][1]) == (0, PROTOCOL_ERROR)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ServerLive(pb.ServerLiveRequest(), timeout=5).live


@pytest.mark.parametrize(
    "bad,code,why",
    [
        (frame(PING, 0, 1, b"12345678"), PROTOCOL_ERROR, "PING frame on stream 1"),
        (frame(SETTINGS, 0, 1), PROTOCOL_ERROR, "SETTINGS frame on stream 1"),
        (frame(GOAWAY, 0, 1, bytes(8)), PROTOCOL_ERROR, "GOAWAY frame on stream 1"),
        (frame(RST_STREAM, 0, 0, bytes(4)), PROTOCOL_ERROR, "RST_STREAM frame on stream 0"),
        (frame(PRIORITY, 0, 0, bytes(5)), PROTOCOL_ERROR, "PRIORITY frame on stream 0"),
        (frame(PING, 0, 0, b"1234"), FRAME_SIZE_ERROR, "frame of type 6 with a 4-byte payload"),
        (frame(WINDOW_UPDATE, 0, 0, b"\x00\x01"), FRAME_SIZE_ERROR, "type 8 with a 2-byte"),
        (frame(SETTINGS, ACK, 0, bytes(6)), FRAME_SIZE_ERROR, "type 4 with a 6-byte"),
        (frame(WINDOW_UPDATE, 0, 0, bytes(4)), PROTOCOL_ERROR, "connection WINDOW_UPDATE of 0"),
        (frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 2**31 - 1)), FLOW_CONTROL_ERROR,
         "connection WINDOW_UPDATE of 2147483647"),
        (frame(DATA, 0, 0, b"x"), PROTOCOL_ERROR, "DATA on stream 0, which is not open"),
        (frame(DATA, 0, 5, b"x"), PROTOCOL_ERROR, "DATA on stream 5, which is not open"),
    ],
)
def test_a_frame_out_of_place_is_a_connection_error(port, bad, code, why):
    """RFC 9113 §6: a frame on a stream it cannot be on, or of the wrong size, or a
    window that would pass 2^31-1, ends the connection with the right GOAWAY code."""
    with H2Client(port) as client:
        client.handshake()
        client.sock.sendall(bad)
        frames = client.wait_closed(timeout=3)
    goaway = [f for f in frames if f.kind == GOAWAY]
    assert goaway, frames
    assert struct.unpack_from(">I", goaway[-1].payload, 4)[0] == code
    assert why in goaway[-1].payload[8:].decode()


@pytest.mark.parametrize(
    "kind,payload,code",
    [(WINDOW_UPDATE, bytes(4), PROTOCOL_ERROR), (PRIORITY, bytes(4), FRAME_SIZE_ERROR)],
)
def test_a_stream_error_resets_only_that_stream(h2, kind, payload, code):
    """A WINDOW_UPDATE of 0 or a PRIORITY of the wrong size on a stream (RFC 9113 6.9, 6.3)."""
    stream = h2.new_stream()
    h2.send(HEADERS, END_HEADERS, stream, h2.header_block())  # open, its message to come
    h2.send(kind, 0, stream, payload)
    f = h2.recv()
    while f.kind != RST_STREAM:
        f = h2.recv()
    assert (f.stream, struct.unpack(">I", f.payload)[0]) == (stream, code)
    check_add_sub(h2.call(add_sub_request()))  # the connection lives on

def test_stop_lets_calls_in_flight_finish(server):
    service = KServeGrpc(server, KServeGrpc.Options(address="127.0.0.1", port=0))
    service.start()
    try:
        with H2Client(service.port) as client:
            client.handshake()
            wait_until_faulty_is_idle(client)
            stream = client.start_call(sleep_request(0.4))
            time.sleep(0.1)
            started = time.monotonic()
            stopper = threading.Thread(target=service.stop, args=(time.monotonic() + 5,))
            stopper.start()
            f = client.recv()
            assert f.kind == GOAWAY, f
            assert struct.unpack_from(">II", f.payload) == (stream, NO_ERROR)
            assert time.monotonic() - started < 0.3
            # no new calls here now; the one in flight is answered
            refused = client.start_call(add_sub_request())
            f = client.recv()
            assert f == Frame(RST_STREAM, 0, refused, struct.pack(">I", REFUSED_STREAM))
            answer = client.collect(stream)[stream]
            assert answer.status == 0
            client.wait_closed(timeout=2)
            stopper.join(timeout=5)
            assert not stopper.is_alive()
            assert time.monotonic() - started < 1.5  # the call ended: no waiting out the grace
    finally:
        service.stop()


def test_stop_cancels_calls_after_the_grace(server):
    service = KServeGrpc(server, KServeGrpc.Options(address="127.0.0.1", port=0))
    service.start()
    try:
        with H2Client(service.port) as client:
            client.handshake()
            wait_until_faulty_is_idle(client)
            client.start_call(sleep_request(1.0))
            time.sleep(0.1)
            started = time.monotonic()
            service.stop(deadline=time.monotonic() + 0.2)
            stopped = time.monotonic() - started
            assert 0.15 <= stopped < 1.0, stopped
            frames = client.wait_closed(timeout=1)
            assert frames and frames[0].kind == GOAWAY
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", service.port), timeout=1).close()
    finally:
        service.stop()


def test_stop_ends_a_stream_once_nothing_of_it_is_in_flight(server):
    """A ModelStreamInfer call its client keeps open does not hold the stop for the whole
    grace: one with nothing in flight ends at once, one with a request executing gets its
    answer first; each ends with UNAVAILABLE, after the GOAWAY."""
    service = KServeGrpc(server, KServeGrpc.Options(address="127.0.0.1", port=0))
    service.start()
    try:
        with H2Client(service.port) as client:
            client.handshake()
            wait_until_faulty_is_idle(client)
            idle, busy = client.new_stream(), client.new_stream()
            for stream, request in ((idle, add_sub_request(id="idle")), (busy, sleep_request(1))):
                client.send(HEADERS, END_HEADERS, stream, client.header_block(STREAM_INFER))
                client.send(DATA, 0, stream, prefixed(request))
            answers = {idle: Answer(), busy: Answer()}
            while not answers[idle].data:  # (the idle stream's one request is answered)
                f = client.recv()
                if f.kind == DATA:
                    answers[f.stream].data += f.payload
            started = time.monotonic()
            stopper = threading.Thread(target=service.stop, args=(time.monotonic() + 30,))
            stopper.start()
            frames = client.wait_closed(timeout=10)
            stopper.join(timeout=10)
            assert not stopper.is_alive()
            assert time.monotonic() - started < 10  # the busy stream's second, not the grace
            assert frames[0].kind == GOAWAY, frames
            ends = {}
            for f in frames:
                if f.kind == DATA:
                    assert f.stream not in ends, "an answer after the end of its stream"
                    answers[f.stream].data += f.payload
                elif f.kind == HEADERS and f.flags & END_STREAM:
                    ends[f.stream] = dict(client.decoder.decode(f.payload, raw=False))
            assert list(ends) == [idle, busy]  # the idle one did not wait for the busy one
            for stream, trailers in ends.items():
                answers[stream].trailers = trailers
                assert answers[stream].status == grpc.StatusCode.UNAVAILABLE.value[0]
                assert answers[stream].message == "The server is shutting down"
            (reply,) = answers[busy].messages()  # its request was answered
            assert not pb.ModelStreamInferResponse.FromString(reply).error_message
    finally:
        service.stop()


# -- what a hostile or broken client gets ---------------------------------------------------------
def test_streams_above_the_advertised_limit_are_refused(port):
    with H2Client(port) as client:
        limit = client.handshake()[MAX_CONCURRENT_STREAMS]
        assert limit == 1000
        block = client.header_block()
        # open calls that never send their message: each holds a slot
        client.sock.sendall(
            b"".join(frame(HEADERS, END_HEADERS, 1 + 2 * i, block) for i in range(limit + 1))
        )
        refused = None
        while refused is None:
            f = client.recv()
            assert f is not None
            if f.kind == RST_STREAM:
                refused = f
        assert refused.stream == 1 + 2 * limit
        assert struct.unpack(">I", refused.payload)[0] == REFUSED_STREAM
        # ending one call frees its slot for a new one
        client.send(RST_STREAM, 0, 1, struct.pack(">I", CANCEL))
        client.last_stream = 1 + 2 * limit
        check_add_sub(client.call(add_sub_request()))


@pytest.mark.parametrize(
    "method, content_type, status",
    [("GET", "application/grpc", "405"), ("POST", "text/html", "415"), ("POST", None, "415")],
)
def test_requests_that_are_not_grpc_calls_get_an_http_status(h2, method, content_type, status):
    fields = [(":method", method), (":scheme", "http"), (":path", INFER), (":authority", "x")]
    if content_type is not None:
        fields.append(("content-type", content_type))
    stream = h2.new_stream()
    h2.send(HEADERS, END_HEADERS | END_STREAM, stream, h2.encoder.encode(fields))
    answer = h2.collect(stream)[stream]
    assert answer.headers == {":status": status} and not answer.data
    check_add_sub(h2.call(add_sub_request()))  # the connection serves on


def test_a_header_block_too_large_refuses_only_its_call(h2):
    big = [("x-big", "v" * 70_000)]
    answer = h2.call(add_sub_request(), extra=big)
    assert answer.status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], answer.trailers
    check_add_sub(h2.call(add_sub_request()))


def test_header_values_that_are_not_utf8_are_taken(h2):
    fields = [
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", INFER.encode()),
        (b":authority", b"x"), (b"content-type", b"application/grpc"),
        (b"x-raw", b"caf\xe9"),  # obs-text: legal in HTTP/2, not UTF-8
    ]  # fmt: skip
    stream = h2.new_stream()
    h2.send(HEADERS, END_HEADERS, stream, h2.encoder.encode(fields))
    h2.send(DATA, END_STREAM, stream, prefixed(add_sub_request()))
    check_add_sub(h2.collect(stream)[stream])


def test_an_unparsable_stream_message_ends_the_call_with_internal(h2):
    stream = h2.new_stream()
    h2.send(HEADERS, END_HEADERS, stream, h2.header_block(STREAM_INFER))
    h2.send(DATA, 0, stream, prefixed(add_sub_request(id="good")))
    h2.send(DATA, 0, stream, prefixed(b"\xff\xff\xff"))
    answer = h2.collect(stream)[stream]
    assert answer.status == grpc.StatusCode.INTERNAL.value[0]
    assert "unparsable request" in answer.message
    check_add_sub(h2.call(add_sub_request()))


def test_a_second_unary_message_is_refused_as_it_comes(h2):
    stream = h2.new_stream()
    h2.send(HEADERS, END_HEADERS, stream, h2.header_block())
    h2.send(DATA, 0, stream, prefixed(add_sub_request()) + prefixed(add_sub_request()))
    # no END_STREAM: the refusal does not wait for the client to finish
    answer = h2.collect(stream)[stream]
    assert answer.status == grpc.StatusCode.UNIMPLEMENTED.value[0]


@pytest.mark.parametrize("timeout", ["-5S", "123456789m", "5s", "1.5S"])
def test_a_malformed_grpc_timeout_sets_no_deadline(h2, timeout):
    check_add_sub(h2.call(add_sub_request(), extra=[("grpc-timeout", timeout)]))


@pytest.mark.parametrize(
    "bad",
    [
        frame(WINDOW_UPDATE, 0, 0, b"\x00\x00\x01"),  # 3 bytes, not 4
        frame(SETTINGS, 0, 0, struct.pack(">HI", 0x5, 100)),  # MAX_FRAME_SIZE below 16384
        frame(SETTINGS, 0, 0, b"\x00\x04\x00"),  # not a multiple of 6 bytes
        frame(HEADERS, END_HEADERS, 2, b"\x82"),  # an even stream id
    ],
    ids=["short-window-update", "tiny-max-frame", "ragged-settings", "even-stream"],
)
def test_a_malformed_frame_ends_the_connection_with_goaway(port, bad):
    with H2Client(port) as client:
        client.handshake()
        client.sock.sendall(bad)
        frames = client.wait_closed(timeout=3)
        assert any(f.kind == GOAWAY for f in frames), frames
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # the server serves on
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ServerLive(pb.ServerLiveRequest(), timeout=5).live


def test_a_connection_error_goes_away_without_a_reset_under_a_client_still_sending(port):
    """Closing a socket with unread bytes makes the kernel reset the connection (and drop
    what it had still to send): after a bad frame the client still sending must get the
    GOAWAY and then EOF, not ECONNRESET. What it sends meanwhile is read and dropped."""
    with H2Client(port) as client:
        client.handshake()
        bad = frame(WINDOW_UPDATE, 0, 0, b"\x00\x00\x01")  # 3 bytes, not 4
        client.sock.sendall(bad + frame(PING, 0, 0, b"8 bytes.") * (4 << 20 >> 4))  # (4 MiB)
        received = client.buffer
        while chunk := client.sock.recv(1 << 16):  # (ConnectionResetError fails the test)
            received += chunk
    frames = []
    while received:
        length = int.from_bytes(received[:3], "big")
        frames.append(Frame(received[3], received[4], 0, received[9 : 9 + length]))
        received = received[9 + length :]
    assert [f.kind for f in frames] == [GOAWAY], frames  # (no PING answered after the error)
    assert struct.unpack_from(">II", frames[0].payload) == (0, FRAME_SIZE_ERROR)


def test_an_answer_stuck_behind_flow_control_is_dropped_at_its_deadline(port):
    with H2Client(port, settings={INITIAL_WINDOW_SIZE: 0}) as client:
        client.handshake()
        stream = client.start_call(identity_request(1024), extra=[("grpc-timeout", "300m")])
        started = time.monotonic()
        while True:
            f = client.recv(3)
            assert f is not None and f.kind != DATA, f
            if f.kind == RST_STREAM and f.stream == stream:
                break
        assert struct.unpack(">I", f.payload)[0] == CANCEL
        assert 0.2 <= time.monotonic() - started < 2


def test_no_descriptors_left_behind(fds_before):
    """Last in the file: every connection and service above is gone."""
    deadline = time.monotonic() + 5
    while (extra := open_fds() - fds_before) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not extra, f"descriptors left open: {sorted(extra)}"
