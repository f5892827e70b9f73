"""Decoupled models, the response sender in both modes, and ``async def execute``,
through the in-process API and tritonclient's gRPC streaming (sync and aio)."""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import InferenceServerException

import dlserve
from dlserve.frontends import KServeGrpc
from dlserve.frontends.grpc_stream import STREAM_BACKLOG

from ..conftest import frontend, serve, wait_until

MODELS = ["decoupled", "default_sender", "async_overlap", "add_sub", "gather"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    yield from serve(tmp_path_factory, MODELS)


@pytest.fixture(scope="module")
def grpc_url(server):
    for port in frontend(KServeGrpc, server):
        yield f"127.0.0.1:{port}"


def stream(server, mode: str, values, **parameters):
    """Every response of one request to the decoupled model, in order."""
    return list(
        server.model("decoupled").infer(
            inputs={"IN": np.array(values, np.int32)},
            parameters={"mode": mode, **parameters},
            raise_on_error=False,
        )
    )


def value_of(response) -> int | None:
    out = response.outputs.get("OUT")
    return None if out is None else int(np.from_dlpack(out)[0])


def notes(server) -> list[str]:
    (response,) = stream(server, "notes", [0])
    return json.loads(response.outputs["INFO"].to_bytes_array()[0])


# -- in-process ---------------------------------------------------------------------------
def test_responses_in_order_then_a_flag_only_final(server):
    responses = stream(server, "stream", [5, 6, 7])
    assert [value_of(r) for r in responses] == [5, 6, 7, None]
    assert [r.final for r in responses] == [False, False, False, True]
    assert responses[-1].outputs == {} and responses[-1].error is None


def test_final_flag_on_the_last_response(server):
    responses = stream(server, "final_with_last", [1, 2])
    assert [(value_of(r), r.final) for r in responses] == [(1, False), (2, True)]


def test_responses_from_a_thread_after_execute_returned(server):
    responses = stream(server, "thread", list(range(20)), delay_ms=1)
    assert [value_of(r) for r in responses] == list(range(20)) + [None]


def test_a_streamed_request_counts_as_a_success_when_its_execute_ends(server):
    """Triton's statistics (measured on 2.51, and what perf_analyzer's server section
    reads): a request its model answers through the response sender is a success when
    execute returns, timed up to then, however long the stream goes on after."""
    model = server.model("decoupled")

    def success() -> dict:
        return model.statistics()["model_stats"][0]["inference_stats"]["success"]

    before = success()
    responses = model.infer(
        inputs={"IN": np.array([1, 2, 3], np.int32)}, parameters={"mode": "thread", "delay_ms": 150}
    )
    first = next(responses)  # execute returned before it: the model's thread sends it
    during = success()
    assert value_of(first) == 1
    assert during["count"] == before["count"] + 1
    rest = list(responses)
    assert [value_of(r) for r in rest] == [2, 3, None]
    after = success()
    assert after == during  # counted once, and not for the stream's ~450 ms
    assert after["ns"] - before["ns"] < 300_000_000


def test_error_mid_stream_is_final_and_keeps_its_code(server):
    responses = stream(server, "error_mid", [3, 4])
    assert value_of(responses[0]) == 3 and not responses[0].final
    assert isinstance(responses[1].error, dlserve.InvalidArgumentError)
    assert responses[1].error.message == "failed halfway" and responses[1].final
    assert len(responses) == 2


def test_exception_after_a_response_fails_the_request(server):
    responses = stream(server, "raise_after_one", [9])
    assert value_of(responses[0]) == 9 and not responses[0].final
    assert responses[-1].final and isinstance(responses[-1].error, dlserve.InternalError)
    assert "execute broke after one response" in responses[-1].error.message


def test_decoupled_execute_returning_a_list_is_an_error(server):
    (response,) = stream(server, "return_list", [1])
    assert response.final and "must return None" in response.error.message


def test_dropped_sender_sends_a_final_error(server):
    """A model that lets go of a request without its final must not hang the caller."""
    responses = stream(server, "drop_sender", [2])
    assert value_of(responses[0]) == 2
    assert responses[-1].final
    assert "without sending its final response" in responses[-1].error.message


def test_sending_after_the_final_raises_in_the_model(server):
    (response,) = stream(server, "send_after_final", [1])
    assert value_of(response) == 1 and response.final
    assert "Unable to send response. Response sender has been closed." in notes(server)


def test_never_final_request_ends_when_cancelled(server):
    iterator = server.model("decoupled").infer(
        inputs={"IN": np.array([1], np.int32)}, parameters={"mode": "never_final"}, raise_on_error=False
    )
    first = next(iterator)
    assert value_of(first) == 1 and not first.final
    iterator.cancel()
    (last,) = list(iterator)
    assert last.final and isinstance(last.error, dlserve.CancelledError)


def test_many_concurrent_streams(server):
    async def run():
        async def one(i):
            responses = [
                r
                async for r in server.model("decoupled").async_infer(
                    inputs={"IN": np.arange(i, i + 10, dtype=np.int32)},
                    parameters={"mode": "thread"},
                )
            ]
            return [value_of(r) for r in responses]

        return await asyncio.gather(*(one(i) for i in range(30)))

    results = asyncio.run(run())
    assert results == [list(range(i, i + 10)) + [None] for i in range(30)]


# -- the response sender in default mode -------------------------------------------------------
def sender_mode(server, mode: str):
    return list(
        server.model("default_sender").infer(
            inputs={"IN": np.array([1, 2], np.int32)}, parameters={"mode": mode}, raise_on_error=False
        )
    )


@pytest.mark.parametrize("mode", ["send_final", "send_then_flag"])
def test_default_mode_sender_gives_one_final_response(server, mode):
    (response,) = sender_mode(server, mode)
    assert response.final and response.error is None
    np.testing.assert_array_equal(np.from_dlpack(response.outputs["OUT"]), [2, 4])


def test_default_mode_sender_refuses_a_second_response_and_an_early_final(server):
    def errors_of(mode):
        (response,) = sender_mode(server, mode)
        assert response.final and response.error is None  # the one allowed response went out
        return json.loads(sender_mode(server, "last_errors")[0].outputs["INFO"].to_bytes_array()[0])

    twice = errors_of("twice")
    early = errors_of("final_first")
    assert twice == ["Unable to send response. Non-decoupled model cannot send more than one response."]
    assert early == [
        "Unable to send response. Non-decoupled model cannot send complete final before sending a response."
    ]


def test_default_mode_execute_returning_none_without_answering_fails_the_request(server):
    (response,) = sender_mode(server, "silent")
    assert response.final and "without sending its final response" in response.error.message


def test_default_mode_execute_raising_after_a_response_answers_with_that_response(server, caplog):
    """As Triton 2.51 (its QA response_sender test, over a gRPC stream): the one response
    a default-mode model sent is its request's answer, and the execute that then raised
    (sending a second one) reaches the log only."""
    with caplog.at_level(logging.ERROR, logger="dlserve"):
        (response,) = sender_mode(server, "send_then_raise")
    assert response.final and response.error is None
    np.testing.assert_array_equal(np.from_dlpack(response.outputs["OUT"]), [2, 4])
    assert any("Non-decoupled model cannot send more than one response" in r.getMessage() for r in caplog.records)
    for instance in server.engine.instances():
        assert not instance._held, instance.name


def test_default_mode_execute_returning_a_response_its_sender_is_sending_is_refused(server, caplog):
    """The sender sends from another thread while execute returns an answer too: the send
    in progress finishes first and is the answer; execute's fails with the error that says
    why (its check used to pass in the middle of the send: then one answer was dropped and
    nobody told)."""
    both = "answered both through its response sender and in the list execute returned"
    with caplog.at_level(logging.ERROR, logger="dlserve"):
        (response,) = sender_mode(server, "racing_return")
        assert response.final and response.error is None
        np.testing.assert_array_equal(np.from_dlpack(response.outputs["OUT"]), [2, 4])
        # (logged when the execute's reply comes, just after the sender's answer)
        wait_until(lambda: any(both in r.getMessage() for r in caplog.records))
    for instance in server.engine.instances():
        assert not instance._held, instance.name


# -- async execute ---------------------------------------------------------------------------
def test_async_execute_overlaps_up_to_the_configured_bound(server):
    """ASYNC_EXECUTE_CONCURRENCY is 4: eight 200 ms requests take two rounds, not eight."""

    async def run():
        calls = [
            server.model("async_overlap").async_infer(inputs={"IN": np.array([200], np.int32)})
            for _ in range(8)
        ]

        async def first(iterator):
            return [r async for r in iterator][0]

        started = time.monotonic()
        responses = await asyncio.gather(*(first(c) for c in calls))
        return responses, time.monotonic() - started

    responses, elapsed = asyncio.run(run())
    peaks = [int(np.from_dlpack(r.outputs["OUT"])[0]) for r in responses]
    assert max(peaks) == 4  # never more than the bound at once
    assert elapsed < 8 * 0.2  # and they did overlap


def test_overlapping_async_executes_are_counted_as_compute_not_queue_time(server):
    """A 100 ms and a 600 ms execute that overlap: neither waited for the other, so
    their compute time is about 700 ms and their queue time near nothing (the time the
    second ran after the first ended was booked as queue time)."""
    model = server.model("async_overlap")
    before = model.statistics()["model_stats"][0]["inference_stats"]

    async def run():
        async def one(ms):
            return [r async for r in model.async_infer(inputs={"IN": np.array([ms], np.int32)})]

        await asyncio.gather(one(100), one(600))

    asyncio.run(run())
    after = model.statistics()["model_stats"][0]["inference_stats"]
    queue_s = (after["queue"]["ns"] - before["queue"]["ns"]) / 1e9
    infer_s = (after["compute_infer"]["ns"] - before["compute_infer"]["ns"]) / 1e9
    assert queue_s < 0.2 and infer_s > 0.65


# -- gRPC streaming ---------------------------------------------------------------------------
def stream_input(values) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("IN", [len(values)], "INT32")
    tensor.set_data_from_numpy(np.array(values, np.int32))
    return tensor


def collect(results: queue.Queue, until_final: bool, count: int | None = None) -> list:
    got = []
    while True:
        result, error = results.get(timeout=20)
        got.append((result, error))
        response = result.get_response() if result is not None else None
        final = (
            response is not None
            and "triton_final_response" in response.parameters
            and response.parameters["triton_final_response"].bool_param
        )
        if (until_final and final) or (count is not None and len(got) == count):
            return got


def test_grpc_stream_without_empty_finals(grpc_url):
    results: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(grpc_url) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("decoupled", [stream_input([1, 2, 3])], request_id="a")
        got = collect(results, until_final=False, count=3)
        client.stop_stream()
    assert [r.as_numpy("OUT").tolist() for r, _ in got] == [[1], [2], [3]]
    assert all(r.get_response().id == "a" for r, _ in got)
    assert results.empty()  # the flag-only final was not sent


def test_grpc_stream_with_empty_final(grpc_url):
    results: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(grpc_url) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer(
            "decoupled", [stream_input([4, 5])], enable_empty_final_response=True
        )
        got = collect(results, until_final=True)
        client.stop_stream()
    assert [r.as_numpy("OUT") is not None for r, _ in got] == [True, True, False]
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r, _ in got]
    assert finals == [False, False, True]


def test_grpc_stream_error_mid_stream(grpc_url):
    results: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(grpc_url) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer(
            "decoupled", [stream_input([7, 8])], parameters={"mode": "error_mid"}
        )
        got = collect(results, until_final=False, count=2)
        # the stream stays usable after an error
        client.async_stream_infer("decoupled", [stream_input([1])])
        after = collect(results, until_final=False, count=1)
        client.stop_stream()
    (first, error0), (second, error1) = got
    assert first.as_numpy("OUT").tolist() == [7] and error0 is None
    assert second is None and isinstance(error1, InferenceServerException)
    assert "failed halfway" in error1.message()
    assert after[0][0].as_numpy("OUT").tolist() == [1]


def test_a_stream_keeps_reading_while_a_model_holds_its_requests_open(grpc_url):
    """The model answers every request only when a later one says so: more open
    requests than a stream keeps unsent answers must not stop it reading that one."""
    count = STREAM_BACKLOG + 72
    results: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(grpc_url) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        for i in range(count):
            tensor = grpcclient.InferInput("IN", [1], "INT32")
            tensor.set_data_from_numpy(np.array([i], np.int32))
            client.async_stream_infer("gather", [tensor], parameters={"flush": i == count - 1})
        got = collect(results, until_final=False, count=count)
        client.stop_stream()
    assert sorted(int(r.as_numpy("OUT")[0]) for r, _ in got) == list(range(count))


def test_grpc_unary_infer_refuses_a_decoupled_model(grpc_url):
    with grpcclient.InferenceServerClient(grpc_url) as client:
        with pytest.raises(InferenceServerException) as info:
            client.infer("decoupled", [stream_input([1])])
    assert "doesn't support models with decoupled transaction policy" in info.value.message()
    assert info.value.status() == "StatusCode.UNIMPLEMENTED"


def test_grpc_aio_stream_interleaves_requests(grpc_url):
    """Five requests streaming at once on one stream; each one's responses stay in order.
    (The aio client cannot ask for empty finals, so it counts the responses.)"""

    async def run():
        async with aioclient.InferenceServerClient(grpc_url) as client:

            async def requests():
                for i in range(5):
                    yield {
                        "model_name": "decoupled",
                        "inputs": [stream_input([i, i + 10, i + 20])],
                        "request_id": str(i),
                        "parameters": {"mode": "thread", "delay_ms": 2},
                    }

            by_id: dict[str, list] = {}
            received = 0
            async for result, error in client.stream_infer(requests()):
                assert error is None
                by_id.setdefault(result.get_response().id, []).append(int(result.as_numpy("OUT")[0]))
                received += 1
                if received == 15:
                    break
            return by_id

    by_id = asyncio.run(run())
    assert by_id == {str(i): [i, i + 10, i + 20] for i in range(5)}


UNSENDABLE_MODEL = '''
import resource

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        sender = requests[0].get_response_sender()
        # No shared memory for the output (as with a full /dev/shm)
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
        big = pb_utils.Tensor("OUT", np.zeros(8 << 20, np.float32))
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            sender.send(pb_utils.InferenceResponse([big]), flags=final)
        except pb_utils.TritonModelException as exc:  # the model still answers, with the reason
            error = pb_utils.TritonError(f"could not send: {exc}")
            sender.send(pb_utils.InferenceResponse(error=error), flags=final)
        return None
'''


def test_a_final_response_that_could_not_be_sent_leaves_the_request_open(servers, make_repo):
    """A send that fails (here: no shared memory for its output) raises and sends nothing;
    the model can then answer the request. The sender used to count itself closed, so
    that the model's error answer was refused and the request never answered."""
    config = (
        'backend: "python"\ninput [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        "model_transaction_policy { decoupled: true }\n"
    )
    repo = make_repo(extra={"unsendable": {"config.pbtxt": config, "1/model.py": UNSENDABLE_MODEL}})
    server = servers.start(repo)
    (answer,) = server.model("unsendable").infer(
        inputs={"IN": np.array([1], np.int32)}, raise_on_error=False, timeout=30
    )
    assert answer.error is not None and answer.final
    message = answer.error.message
    assert "could not send:" in message and "failed to allocate" in message, message


RACING_MODEL = '''
import sys
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def response(values):
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array(values, np.int32))])


class TritonPythonModel:
    def initialize(self, args):
        self.rounds = []  # per request: 10 * finals that went + responses that went

    def execute(self, requests):
        (request,) = requests
        sender = request.get_response_sender()
        if pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0] < 0:
            sender.send(response(self.rounds), flags=FINAL)
            return None
        start = threading.Barrier(4)
        went = []

        def send(i):  # thread 0 a response, the others each a final one
            start.wait()
            try:
                sender.send(response([i]), flags=FINAL if i else 0)
                went.append(10 if i else 1)
            except pb_utils.TritonModelException:
                pass

        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # (threads switch between any two bytecodes, about)
        threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        sys.setswitchinterval(interval)
        self.rounds.append(sum(went))
        return None
'''


def test_threads_racing_to_send_the_final_response(servers, make_repo):
    """Threads sending for one request at once: one final goes, the others raise (as
    Triton's), and a response that went did so before the final. The sender checked and
    counted apart from sending: two finals could pass the check, or a response counted
    before a final went after it (the server dropped it), and the model was told neither."""
    config = (
        'backend: "python"\ninput [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]\n'
        "model_transaction_policy { decoupled: true }\n"
    )
    repo = make_repo(extra={"racing": {"config.pbtxt": config, "1/model.py": RACING_MODEL}})
    model = servers.start(repo).model("racing")
    received = []
    for _ in range(100):
        answers = list(model.infer(inputs={"IN": np.array([0], np.int32)}, timeout=30))
        assert answers[-1].final and sum(a.final for a in answers) == 1
        received.append(10 + len(answers) - 1)
    (report,) = model.infer(inputs={"IN": np.array([-1], np.int32)}, timeout=30)
    assert np.from_dlpack(report.outputs["OUT"]).tolist() == received
