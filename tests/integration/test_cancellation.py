"""Request cancellation at every stage — queued, executing, streaming — from every
caller: the in-process API, a gRPC cancel or deadline, a closed gRPC stream, an
HTTP client that disconnects (unary and server-sent events); and a soak of streamed
responses and BLS calls that must not grow shared memory, descriptors or stub memory."""

from __future__ import annotations

import asyncio
import glob
import json
import queue
import socket
import time

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import InferenceServerException

import dlserve
from dlserve.frontends import KServeGrpc, KServeHttp

from ..conftest import frontend, open_fds, serve

LOADED = ["decoupled", "default_sender", "faulty", "bls", "identity"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    yield from serve(tmp_path_factory, LOADED)


@pytest.fixture(scope="module")
def grpc_url(server):
    for port in frontend(KServeGrpc, server):
        yield f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def http_port(server):
    yield from frontend(KServeHttp, server)


def decoupled_notes(server) -> list[str]:
    (response,) = server.model("decoupled").infer(
        inputs={"IN": np.array([0], np.int32)}, parameters={"mode": "notes"}
    )
    return json.loads(response.outputs["INFO"].to_bytes_array()[0])


def sender_notes(server) -> list[str]:
    (response,) = server.model("default_sender").infer(
        inputs={"IN": np.array([0], np.int32)}, parameters={"mode": "last_errors"}
    )
    return json.loads(response.outputs["INFO"].to_bytes_array()[0])


def eventually(check, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return False


def count_note(server, note: str) -> int:
    return decoupled_notes(server).count(note)


# -- in-process -------------------------------------------------------------------------------
def test_cancelling_a_queued_request_means_it_never_runs(server):
    model = server.model("faulty")
    before = model.statistics()["model_stats"][0]["execution_count"]
    busy = [
        model.infer(inputs={"INPUT0": np.ones(2, np.float32)}, parameters={"mode": "sleep:0.5"})
        for _ in range(3)  # one executing, one pipelined in the worker, one queued
    ]
    queued = model.infer(inputs={"INPUT0": np.ones(2, np.float32)}, parameters={"mode": "ok"}, raise_on_error=False)
    time.sleep(0.1)
    queued.cancel()
    (response,) = list(queued)
    assert isinstance(response.error, dlserve.CancelledError) and response.final
    for iterator in busy:
        list(iterator)
    after = model.statistics()["model_stats"][0]["execution_count"]
    assert after - before == 3  # the cancelled one never executed


def test_cancelling_a_request_waiting_in_the_worker_means_it_never_runs(server):
    """With one instance the next request is sent to the worker while the one before
    runs; cancelled before its turn, it is dropped there as a queued one is: it never
    runs, and counts in no execution."""
    model = server.model("faulty")
    before = model.statistics()["model_stats"][0]["execution_count"]
    busy = model.infer(inputs={"INPUT0": np.ones(2, np.float32)}, parameters={"mode": "sleep:0.6"})
    time.sleep(0.1)
    waiting = model.infer(
        inputs={"INPUT0": np.ones(2, np.float32)}, parameters={"mode": "raise"}, raise_on_error=False
    )
    time.sleep(0.1)  # sent on to the worker by now, behind the sleeping one
    waiting.cancel()
    (response,) = list(waiting)
    assert isinstance(response.error, dlserve.CancelledError)
    list(busy)
    time.sleep(0.2)  # (its turn came and went)
    after = model.statistics()["model_stats"][0]
    assert after["execution_count"] - before == 1
    assert after["inference_stats"]["fail"]["count"] >= 1


@pytest.mark.parametrize("mode", ["wait_cancel", "wait_cancel_sender"])
def test_executing_model_sees_is_cancelled(server, mode):
    note = f"{mode}: cancelled=True"
    seen = count_note(server, note)
    iterator = server.model("decoupled").infer(
        inputs={"IN": np.array([1], np.int32)}, parameters={"mode": mode}, raise_on_error=False
    )
    time.sleep(0.1)  # executing now
    started = time.monotonic()
    iterator.cancel()
    (response,) = list(iterator)
    assert isinstance(response.error, dlserve.CancelledError)
    assert time.monotonic() - started < 2  # answered at once, not when the model gave up
    assert eventually(lambda: count_note(server, note) == seen + 1)


def test_cancelling_a_stream_stops_the_model(server):
    seen = count_note(server, "cancelled while streaming")
    iterator = server.model("decoupled").infer(
        inputs={"IN": np.arange(200, dtype=np.int32)},
        parameters={"mode": "thread", "delay_ms": 10},
        raise_on_error=False,
    )
    first = next(iterator)
    assert int(np.from_dlpack(first.outputs["OUT"])[0]) == 0
    iterator.cancel()
    rest = list(iterator)
    assert rest[-1].final and isinstance(rest[-1].error, dlserve.CancelledError)
    assert len(rest) < 50
    assert eventually(lambda: count_note(server, "cancelled while streaming") == seen + 1)


def test_main_thread_model_sees_cancellation_without_anyone_reading(server):
    """A sync execute polling is_cancelled() from the main thread: the check itself
    must pick the cancellation up from the channel (no round trip per poll)."""
    iterator = server.model("default_sender").infer(
        inputs={"IN": np.array([1], np.int32)}, parameters={"mode": "wait_cancel"}, raise_on_error=False
    )
    time.sleep(0.1)
    iterator.cancel()
    (response,) = list(iterator)
    assert isinstance(response.error, dlserve.CancelledError)
    assert eventually(lambda: sender_notes(server) == ["wait_cancel: cancelled=True"])


# -- gRPC ---------------------------------------------------------------------------------
def test_grpc_deadline_cancels_an_executing_request(server, grpc_url):
    tensor = grpcclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([1], np.int32))
    with grpcclient.InferenceServerClient(grpc_url) as client:
        with pytest.raises(InferenceServerException) as info:
            client.infer("default_sender", [tensor], parameters={"mode": "wait_cancel"}, client_timeout=0.3)
    assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert eventually(lambda: sender_notes(server) == ["wait_cancel: cancelled=True"])


def test_grpc_aio_cancel_cancels_the_request(server, grpc_url):
    async def run():
        async with aioclient.InferenceServerClient(grpc_url) as client:
            tensor = grpcclient.InferInput("IN", [1], "INT32")
            tensor.set_data_from_numpy(np.array([2], np.int32))
            call = asyncio.ensure_future(
                client.infer("default_sender", [tensor], parameters={"mode": "wait_cancel"})
            )
            await asyncio.sleep(0.2)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call

    asyncio.run(run())
    assert eventually(lambda: sender_notes(server) == ["wait_cancel: cancelled=True"])


def test_closing_a_grpc_stream_cancels_its_requests(server, grpc_url):
    seen = count_note(server, "cancelled while streaming")
    results: queue.Queue = queue.Queue()
    tensor = grpcclient.InferInput("IN", [200], "INT32")
    tensor.set_data_from_numpy(np.arange(200, dtype=np.int32))
    with grpcclient.InferenceServerClient(grpc_url) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("decoupled", [tensor], parameters={"mode": "thread", "delay_ms": 10})
        result, error = results.get(timeout=10)
        assert error is None and result.as_numpy("OUT").tolist() == [0]
        client.stop_stream(cancel_requests=True)
    assert eventually(lambda: count_note(server, "cancelled while streaming") == seen + 1)


# -- HTTP -----------------------------------------------------------------------------------
def post(port: int, path: str, body: dict) -> socket.socket:
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload
    )
    return sock


def test_http_client_disconnect_cancels_a_unary_request(server, http_port):
    body = {
        "inputs": [{"name": "IN", "datatype": "INT32", "shape": [1], "data": [3]}],
        "parameters": {"mode": "wait_cancel"},
    }
    sock = post(http_port, "/v2/models/default_sender/infer", body)
    time.sleep(0.2)
    sock.close()
    assert eventually(lambda: sender_notes(server) == ["wait_cancel: cancelled=True"])


def test_http_disconnect_during_generate_stream_cancels_it(server, http_port):
    seen = count_note(server, "cancelled while streaming")
    sock = post(
        http_port,
        "/v2/models/decoupled/generate_stream",
        {"IN": list(range(200)), "parameters": {"mode": "thread", "delay_ms": 10}},
    )
    received = b""
    while b"data: " not in received:
        received += sock.recv(4096)
    assert received.startswith(b"HTTP/1.1 200 OK")
    sock.close()
    assert eventually(lambda: count_note(server, "cancelled while streaming") == seen + 1)


# -- soak -----------------------------------------------------------------------------------
def stub_rss(server) -> dict[str, int]:
    return {i.name: psutil.Process(i.pid).memory_info().rss for i in server.engine.instances() if i.pid}


def segments(server) -> int:
    return len(glob.glob(f"/dev/shm/{server.engine.segment_prefix}*"))


def soak(server, grpc_url) -> None:
    results: queue.Queue = queue.Queue()
    tensor = grpcclient.InferInput("IN", [100], "INT32")
    tensor.set_data_from_numpy(np.arange(100, dtype=np.int32))
    with grpcclient.InferenceServerClient(grpc_url) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        for _ in range(10):
            client.async_stream_infer("decoupled", [tensor])
        for _ in range(1000):
            result, error = results.get(timeout=20)
            assert error is None
        client.stop_stream()
    big = np.ones(64 * 1024, np.float32)  # 256 KiB each way, by reference
    for _ in range(300):
        (response,) = server.model("bls").infer(inputs={"INPUT0": big}, parameters={"route": "identity"})
        assert response.error is None


def test_streams_and_bls_calls_leak_nothing(server, grpc_url):
    soak(server, grpc_url)  # warm up: arenas, slabs, caches reach their working size
    fds, shm, rss = open_fds(), segments(server), stub_rss(server)
    for _ in range(3):
        soak(server, grpc_url)  # 3000 streamed responses and 900 BLS calls
    assert segments(server) <= shm
    assert len(open_fds() - fds) <= 2  # gRPC may keep a socket or two around
    grown = {name: stub_rss(server)[name] - before for name, before in rss.items()}
    assert all(growth < 16 << 20 for growth in grown.values()), grown
    for instance in server.engine.instances():
        assert instance.worker.peer.lease_count == 0, instance.name
