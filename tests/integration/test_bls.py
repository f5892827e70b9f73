"""BLS (models calling models) and the model-loading API from inside models.

Through the in-process API and tritonclient: results, zero-copy hand-over,
errors returned in the response, decoupled calls and their cancellation, async
calls, and calls that would wait on themselves (cycles, self-calls).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient

import dlserve
from dlserve import ModelControlMode
from dlserve.frontends import KServeHttp

from ..conftest import MODELS, serve, wait_until

LOADED = [
    "bls",
    "bls_peer",
    "bls_pool",
    "bls_async",
    "async_decoupled_bls",
    "identity",
    "decoupled",
    "async_overlap",
    "add_sub",
    "stream_double",
    "double",
]
BIG = np.arange(64 * 1024, dtype=np.float32)  # 256 KiB: travels by reference


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    yield from serve(tmp_path_factory, LOADED)


def call(server, model: str, data=BIG, **parameters):
    (response,) = server.model(model).infer(
        inputs={"INPUT0": data}, parameters=parameters, raise_on_error=False
    )
    info = None
    if "INFO" in response.outputs:
        info = json.loads(response.outputs["INFO"].to_bytes_array()[0])
    return response, info


def test_bls_result_and_zero_copy(server):
    response, info = call(server, "bls", route="identity")
    np.testing.assert_array_equal(np.from_dlpack(response.outputs["OUTPUT0"]), BIG)
    # identity returned its input by reference; the caller got it back in the very
    # memory it sent: no copy on the way there or back.
    assert info == {"same_memory": True, "via": "identity"}


def test_a_model_name_given_as_bytes_is_its_utf8_text(server):
    """Triton's BLS example passes the name it read from a BYTES input (``b'add_sub'``)."""
    response, info = call(server, "bls", route="identity", mode="bytes_name")
    assert response.error is None and info["via"] == "identity"


def test_bls_chain_of_models(server):
    response, info = call(server, "bls", route="bls_peer,identity")
    assert response.error is None and info["via"] == "bls_peer"
    np.testing.assert_array_equal(np.from_dlpack(response.outputs["OUTPUT0"]), BIG)


def test_bls_errors_come_back_in_the_response(server):
    response, _ = call(server, "bls", route="no_such_model")
    assert isinstance(response.error, dlserve.InternalError)  # (Triton 2.51's code for every refusal)
    assert response.error.message.endswith(  # (Triton 2.51's words; tests/data/triton_reference)
        "Model no_such_model - Error when running inference: Failed for execute the inference "
        "request. Model 'no_such_model' is not ready."
    ), response.error.message
    response, _ = call(server, "bls", route="identity", mode="empty_name")  # (as in Triton, too)
    assert response.error.message.endswith(
        "Model  - Error when running inference: Failed for execute the inference request. Model '' is not ready."
    ), response.error.message
    response, _ = call(server, "bls", route="identity", mode="missing_input")
    assert isinstance(response.error, dlserve.InternalError)
    assert "missing required input(s) ['INPUT0']" in response.error.message


def test_bls_call_cycle_is_refused(server):
    response, _ = call(server, "bls", route="bls_peer,bls,identity")
    assert isinstance(response.error, dlserve.InternalError)
    assert "BLS call cycle bls -> bls_peer -> bls" in response.error.message


def test_bls_self_call_without_a_free_instance_is_refused(server):
    response, _ = call(server, "bls", route="bls,identity")
    assert isinstance(response.error, dlserve.InternalError)
    assert "called itself" in response.error.message and "no other instance free" in response.error.message


def test_bls_self_call_with_a_free_instance_runs(server):
    response, info = call(server, "bls_pool", route="bls_pool,identity")
    assert response.error is None and info["via"] == "bls_pool"
    # one level deeper there is no free instance left
    response, _ = call(server, "bls_pool", route="bls_pool,bls_pool,identity")
    assert "no other instance free" in response.error.message


def test_an_async_model_calls_itself_on_its_one_instance(server):
    """An ``async def execute`` instance runs several executes at once, so its own call
    has room on it: not refused as a self-call with no free instance."""
    response, info = call(server, "bls_async", mode="self", depth=2)
    assert response.error is None
    assert info == {"depth": 2, "inner": {"depth": 1, "inner": {"bottom": True}}}


def test_bls_decoupled_iterates_every_response(server):
    response, info = call(server, "bls", data=np.array([3, 4, 5], np.float32), route="decoupled", mode="decoupled")
    assert info["values"] == [3, 4, 5]
    # like Triton, the flag-only final comes out as an empty last response
    assert [r["outputs"] for r in info["responses"]] == [["OUT"], ["OUT"], ["OUT"], []]
    assert info["again"] == info["responses"]  # iterated again once ended: every response again


def test_bls_non_decoupled_call_into_a_decoupled_model_is_an_error(server):
    response, _ = call(server, "bls", data=np.array([1], np.float32), route="decoupled")
    assert isinstance(response.error, dlserve.InternalError)
    assert response.error.message.endswith(  # (Triton 2.51's words, side by side)
        "Model decoupled - Error when running inference: Model decoupled is using the decoupled. The "
        "current BLS request call doesn't support models using the decoupled transaction policy. Please "
        "use 'decoupled=True' argument to the 'exec' or 'async_exec' calls for decoupled models.'"
    ), response.error.message


def test_bls_decoupled_call_into_a_plain_model_gives_one_response(server):
    response, info = call(server, "bls", data=np.array([1], np.float32), route="add_sub", mode="decoupled")
    # add_sub wants two inputs of 4: the error response is the only, final one
    assert len(info["responses"]) == 1 and info["responses"][0]["error"] is not None


def test_bls_cancel_reaches_the_callee_which_ends_its_stream(server):
    """As in Triton, ``ResponseIterator.cancel()`` cancels the callee's request; the
    iterator then gives what the callee still sends, here its early final response."""
    before = notes_of(server).count("cancelled while streaming")
    response, info = call(
        server,
        "bls",
        data=np.arange(100, dtype=np.float32),
        route="decoupled",
        mode="cancel",
        inner_mode="thread",
        delay_ms=20,
    )
    seen = info["responses"]
    assert seen[0]["outputs"] == ["OUT"]
    assert seen[-1] == {"outputs": [], "error": None}  # the callee's own (flags-only) final
    assert len(seen) < 10  # it did not stream all 100
    # the callee saw the cancellation (at its next check) and stopped early
    assert wait_for_note(server, "cancelled while streaming", before)


def test_bls_cancel_of_an_ensemble_reaches_its_streaming_step(server):
    """The cancellation goes on to the ensemble's running steps; the ensemble's answer
    then ends as its steps end it (the decoupled step stops early, with no error)."""
    before = notes_of(server).count("cancelled while streaming")
    response, info = call(
        server,
        "bls",
        data=np.arange(100, dtype=np.float32),
        route="stream_double",
        mode="cancel",
        inner_mode="thread",
        delay_ms=20,
    )
    assert info["values"][0] == 0 and info["values"][1:] == [2 * v for v in range(1, len(info["values"]))]
    assert len(info["responses"]) < 10
    assert all(r["error"] is None for r in info["responses"])
    assert wait_for_note(server, "cancelled while streaming", before)


def test_bls_cancel_that_the_callee_ignores_lets_its_stream_run_on(server):
    """Upstream's QA (decoupled_bls_cancel with IGNORE_CANCEL): a callee that never
    checks ``is_cancelled()`` still reaches its caller with every response."""
    response, info = call(
        server,
        "bls",
        data=np.arange(20, dtype=np.float32),
        route="decoupled",
        mode="cancel",
        inner_mode="thread",
        delay_ms=10,
        ignore_cancel=True,
    )
    assert info["values"] == list(range(20))
    assert all(r["error"] is None for r in info["responses"])
    assert len(info["responses"]) == 21  # the 20 values and the flags-only final


def notes_of(server) -> list[str]:
    """What the decoupled test model has observed so far."""
    (response,) = server.model("decoupled").infer(
        inputs={"IN": np.array([0], np.int32)}, parameters={"mode": "notes"}
    )
    return json.loads(response.outputs["INFO"].to_bytes_array()[0])


def wait_for_note(server, note: str, seen_before: int, timeout: float = 5.0) -> bool:
    """Whether the decoupled test model records ``note`` once more than ``seen_before``
    times within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if notes_of(server).count(note) > seen_before:
            return True
        time.sleep(0.02)
    return False


def test_async_bls_calls_overlap(server):
    response, info = call(server, "bls_async", mode="gather", count=4, sleep_ms=200)
    assert info["errors"] == []
    assert info["peak"] == 4  # all four calls ran at once in async_overlap


@pytest.mark.parametrize("mode", ["stream", "cancel"])
def test_async_bls_into_a_decoupled_model(server, mode):
    data = np.arange(5, dtype=np.float32) if mode == "stream" else np.arange(100, dtype=np.float32)
    before = notes_of(server).count("cancelled while streaming")
    response, info = call(server, "bls_async", data=data, mode=mode, delay_ms=10)
    if mode == "stream":
        assert info == {"values": [0, 1, 2, 3, 4], "count": 6, "errors": []}
    else:  # the callee saw the cancellation and ended its stream early, with no error
        assert info["values"][0] == 0 and info["count"] < 20
        assert info["errors"] == []
        assert wait_for_note(server, "cancelled while streaming", before)


def test_async_bls_inside_a_decoupled_model(server):
    responses = list(
        server.model("async_decoupled_bls").infer(
            inputs={"INPUT0": np.zeros(3, np.float32)}, parameters={"count": 5}
        )
    )
    assert [r.final for r in responses] == [False] * 5 + [True]
    values = sorted(int(np.from_dlpack(r.outputs["OUTPUT0"])[0]) for r in responses[:-1])
    assert values == [0, 1, 2, 3, 4]


def test_bls_through_http_with_tritonclient(server):
    service = KServeHttp(server, KServeHttp.Options(address="127.0.0.1", port=0))
    service.start()
    try:
        with httpclient.InferenceServerClient(f"127.0.0.1:{service.port}") as client:
            tensor = httpclient.InferInput("INPUT0", list(BIG.shape), "FP32")
            tensor.set_data_from_numpy(BIG, binary_data=True)
            result = client.infer("bls", [tensor], parameters={"route": "bls_peer,identity"})
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), BIG)
    finally:
        service.stop()


def test_bls_leaves_no_leases_behind(server):
    for _ in range(50):
        call(server, "bls", route="identity")
    engine = server.engine
    for instance in engine.instances():
        worker = instance.worker
        assert worker is not None and worker.peer is not None
    # Every lease the server granted a worker was returned once the calls were done.
    leases = {i.name: i.worker.peer.lease_count for i in engine.instances()}
    assert all(count == 0 for count in leases.values()), leases


def test_bls_stream_left_early_gives_back_what_it_never_read(server):
    """A model that leaves ``for r in exec(decoupled=True)`` after one response: the call
    goes on (as Triton's) and the responses it never read (already delivered, or still
    coming) return their memory, so no lease stays granted to any worker."""
    for _ in range(20):
        response, info = call(
            server, "bls", data=np.arange(200, dtype=np.float32), route="decoupled", mode="first_only"
        )
        assert response.error is None and info == {"first": 0.0}
    engine = server.engine

    def leases() -> dict[str, int]:
        return {i.name: i.worker.peer.lease_count for i in engine.instances()}

    deadline = time.monotonic() + 5
    while any(leases().values()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(leases().values()), leases()


# -- model control from a model ----------------------------------------------------------------
# Triton's backend names the model instance that asked
ASKED = "Failed to process the request for model 'model_control_0', message: "


def control(server, **parameters):
    (response,) = server.model("model_control").infer(
        inputs={"INPUT0": np.zeros(1, np.float32)}, parameters=parameters
    )
    return json.loads(response.outputs["INFO"].to_bytes_array()[0])


def test_model_loading_api_in_explicit_mode(make_repo, servers):
    srv = servers.start(
        make_repo("model_control", "identity"),
        model_control_mode=ModelControlMode.EXPLICIT,
        startup_models=["model_control"],
    )
    srv.model("model_control")  # loaded
    assert control(srv, op="ready", target="identity") == {"ready": False}
    assert control(srv, op="load", target="identity") == {"ok": True}
    assert control(srv, op="ready", target="identity") == {"ready": True}
    assert control(srv, op="ready", target="identity", version="1") == {"ready": True}
    assert control(srv, op="ready", target="identity", version="7") == {"ready": False}
    # As Triton 2.51 answers them (measured side by side): no name is not ready, and a
    # version is read as C's stol reads it ("1.5" is 1), a number >= 0.
    assert control(srv, op="ready", target="") == {"ready": False}
    assert control(srv, op="load", target="")["error"] == (  # (dlserve's reason: Triton's untried)
        f"Failed to load model: {ASKED}model name '' is empty or has surrounding spaces"
    )
    assert control(srv, op="ready", target="identity", version="1.5") == {"ready": True}
    assert control(srv, op="ready", target="identity", version="-1")["error"] == (
        f"Failed to check model readiness: {ASKED}failed to get model version from specified "
        "version string '-1', version should be an integral value > 0"
    )
    assert control(srv, op="ready", target="identity", version="x")["error"] == (
        f"Failed to check model readiness: {ASKED}failed to get model version from specified "
        "version string 'x' (details: stol), version should be an integral value > 0"
    )
    assert srv.model("identity").ready()
    assert control(srv, op="unload", target="identity") == {"ok": True}
    assert control(srv, op="ready", target="identity") == {"ready": False}
    assert control(srv, op="load", target="no_such_model")["error"] == (
        f"Failed to load model: {ASKED}failed to load 'no_such_model', failed to poll from model "
        "repository"
    )
    # dlserve's reasons where Triton's say less, under Triton's words
    assert control(srv, op="load_config", target="identity", config="{bad")["error"].startswith(
        f"Failed to load model: {ASKED}failed to load model 'identity': Invalid config override: "
    )
    assert control(srv, op="load", target="model_control")["error"] == (
        f"Failed to load model: {ASKED}model 'model_control' cannot load itself: its own load "
        "would wait for the very call asking for it"
    )
    # A model may unload itself (vLLM's backend does when its engine is unhealthy): as
    # Triton's, the unload returns once it began, the request asking for it is answered,
    # then the model goes.
    assert control(srv, op="unload", target="model_control") == {"ok": True}
    wait_until(lambda: not srv.model("model_control").ready())
    wait_until(lambda: srv.models()[("model_control", 1)].state == "UNAVAILABLE")
    assert srv.models()[("model_control", 1)].reason == "unloaded"


def test_model_loading_api_needs_explicit_mode(make_repo, servers):
    srv = servers.start(make_repo("model_control", "identity"))
    srv.model("model_control")
    # Triton 2.51's words (side by side), dlserve's advice after them
    polling = "explicit model load / unload is not allowed if polling is enabled"
    assert control(srv, op="load", target="identity")["error"].startswith(
        f"Failed to load model: {ASKED}{polling} ("
    )
    assert control(srv, op="unload", target="identity")["error"].startswith(
        f"Failed to unload model: {ASKED}{polling} ("
    )


FORKING_MODEL = """
import json
import multiprocessing

import numpy as np
import triton_python_backend_utils as pb_utils


def call_from_child(x):
    pb_utils.Logger.log_info(f"child {x} logging")
    request = pb_utils.InferenceRequest(
        model_name="identity", inputs=[pb_utils.Tensor("INPUT0", np.array([x], np.float32))],
        requested_output_names=["OUTPUT0"],
    )
    try:
        request.exec()
        return "answered"
    except pb_utils.TritonModelException as exc:
        return str(exc)


class TritonPythonModel:
    def execute(self, requests):
        with multiprocessing.get_context("fork").Pool(2) as pool:
            said = pool.map_async(call_from_child, [1.0, 2.0]).get(timeout=30)
        out = np.array([json.dumps(said).encode()], dtype=np.object_)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", out)]) for _ in requests]
"""


def test_a_bls_call_from_a_forked_child_fails_at_once_instead_of_hanging(servers, make_repo):
    """Triton's BLS QA (test_multiprocess) calls models from a multiprocessing.Pool; a
    forked child shares the worker's channel, which is not its to use: its calls are
    refused with a message that says so (the call waited forever), and it logs to stderr."""
    config = 'backend: "python"\noutput [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ 1 ] } ]\n'
    server = servers.start(make_repo("identity", extra={"forker": {"config.pbtxt": config, "1/model.py": FORKING_MODEL}}))
    (response,) = server.model("forker").infer(inputs={})
    said = json.loads(response.outputs["OUTPUT0"].to_bytes_array()[0])
    assert len(said) == 2 and all("a process the model forked (multiprocessing) cannot reach the server" in s for s in said)
    (again,) = server.model("identity").infer(inputs={"INPUT0": np.ones(4, np.float32)})  # the channel is whole
    np.testing.assert_array_equal(np.from_dlpack(again.outputs["OUTPUT0"]), np.ones(4))


AWAITING_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        try:  # BLS is execute's, as in Triton
            pb_utils.InferenceRequest(
                model_name="identity", inputs=[pb_utils.Tensor("INPUT0", np.ones(1, np.float32))],
                requested_output_names=["OUTPUT0"],
            ).exec()
            self.in_initialize = "allowed"
        except pb_utils.TritonModelException as exc:
            self.in_initialize = str(exc)

    async def execute(self, requests):
        answers = []
        for request in requests:
            call = pb_utils.InferenceRequest(
                model_name="decoupled", inputs=[pb_utils.Tensor("IN", np.array([7], np.int32))],
                requested_output_names=["OUT"], parameters={"mode": "thread", "delay_ms": 1000},
            )
            got = []
            for response in await call.async_exec(decoupled=True):  # a plain for, as Triton's QA model reads them
                out = pb_utils.get_output_tensor_by_name(response, "OUT")
                if out is not None:
                    got.append(int(out.as_numpy()[0]))
            note = np.array([self.in_initialize.encode()], dtype=np.object_)
            answers.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", np.array(got, np.int32)), pb_utils.Tensor("NOTE", note)]
            ))
        return answers
"""


def test_awaited_decoupled_calls_return_with_their_first_response_and_bls_is_executes(servers, make_repo):
    """As Triton 2.51 (its QA async_execute concurrency test): ``await async_exec(decoupled=True)``
    returns once the first response is in, so four executes reading their streams with a
    plain ``for`` still overlap (they ran one after another: the await returned at once
    and the ``for`` waited with the model's loop held). And a BLS call from initialize is
    refused in Triton's words."""
    config = (
        'backend: "python"\n'
        'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] }, { name: "NOTE" data_type: TYPE_STRING dims: [ 1 ] } ]\n'
    )
    repo = make_repo("decoupled", "identity", extra={"awaiting": {"config.pbtxt": config, "1/model.py": AWAITING_MODEL}})
    server = servers.start(repo)

    async def run() -> Any:
        async def one() -> Any:
            return [r async for r in server.model("awaiting").async_infer(inputs={})][0]

        started = time.monotonic()
        answers = await asyncio.gather(*(one() for _ in range(4)))
        return answers, time.monotonic() - started

    answers, took = asyncio.run(run())
    assert [np.from_dlpack(a.outputs["OUT"]).tolist() for a in answers] == [[7]] * 4
    assert took < 3.0, f"four 1 s streams took {took:.1f} s: the executes did not overlap"
    note = answers[0].outputs["NOTE"].to_bytes_array()[0].decode()
    assert note == "BLS is only supported during the 'execute' function."


THREADED_SELF_CALLER = '''
import threading, time
import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def text(value):
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([value.encode()], np.object_))])


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            threading.Thread(target=self.work, args=(request.get_response_sender(), n)).start()
        return None  # the one instance is free from here on

    def work(self, sender, n):
        if n == 0:
            sender.send(text("leaf"), flags=FINAL)
            return
        time.sleep(0.3)  # (execute returned long ago)
        call = pb_utils.InferenceRequest(
            model_name="threaded", requested_output_names=["OUT"],
            inputs=[pb_utils.Tensor("N", np.array([0], np.int32))],
        )
        said = []
        for response in call.exec(decoupled=True):
            if response.has_error():
                said.append("error: " + response.error().message())
            elif response.output_tensors():
                said.append(response.output_tensors()[0].as_numpy()[0].decode())
        sender.send(text("; ".join(said)), flags=FINAL)
'''
THREADED_CONFIG = """
backend: "python"
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_STRING dims: [ 1 ] } ]
"""


def test_a_models_thread_may_call_its_idle_instance(servers, make_repo):
    """A call from a thread of a one-instance model, its execute long returned, runs on
    that idle instance, as in Triton (it was refused as a self-call with no instance free)."""
    repo = make_repo(extra={"threaded": {"config.pbtxt": THREADED_CONFIG, "1/model.py": THREADED_SELF_CALLER}})
    server = servers.start(repo)
    (response,) = list(server.model("threaded").infer(inputs={"N": np.array([1], np.int32)}))
    assert response.outputs["OUT"].to_bytes_array()[0] == b"leaf"


def test_a_cycle_into_a_model_with_an_instance_free_is_served(server):
    """bls_pool has two instances: a call that comes back to it while one of them waits
    runs on the other (refused as a cycle before; only a model with no instance free
    would wait on itself)."""
    response, info = call(server, "bls_pool", route="bls,bls_pool")
    assert response.error is None, response.error
    np.testing.assert_array_equal(np.from_dlpack(response.outputs["OUTPUT0"]), BIG)


def cycle_into(servers, make_repo, pa_extra: str) -> str:
    """The error of a call pa -> pb -> pa, pa being the bls test model with ``pa_extra``
    added to its config."""
    config = (MODELS / "bls" / "config.pbtxt").read_text()
    code = (MODELS / "bls" / "1" / "model.py").read_text()
    server = servers.start(make_repo("identity", extra={
        "pa": {"config.pbtxt": config + pa_extra, "1/model.py": code},
        "pb": {"config.pbtxt": config, "1/model.py": code},
    }))
    (response,) = server.model("pa").infer(
        inputs={"INPUT0": np.arange(4, dtype=np.float32)}, parameters={"route": "pb,pa,identity"},
        raise_on_error=False,
    )
    return str(response.error)


def test_a_passive_instance_does_not_count_as_free_for_a_cycle(servers, make_repo):
    """pa -> pb -> pa where pa's other instance is passive (given no work): refused at
    once, not let in to wait for ever."""
    passive = (
        "instance_group [ { count: 1 kind: KIND_CPU }, { count: 1 kind: KIND_CPU passive: true } ]\n"
    )
    assert "BLS call cycle pa -> pb -> pa" in cycle_into(servers, make_repo, passive)


def test_a_cycle_into_a_batching_model_is_refused_even_with_an_instance_free(servers, make_repo):
    """A dynamic batcher may let a later request (a higher priority, one that waited out
    the delay) take the free instance first, and that one may wait on the call: a call
    back into such a model is refused, never let in to wait for ever."""
    batching = "instance_group [ { count: 2 kind: KIND_CPU } ]\ndynamic_batching { }\n"
    error = cycle_into(servers, make_repo, batching)
    assert "BLS call cycle pa -> pb -> pa" in error
    assert "no instance of it is sure to run the call first" in error
