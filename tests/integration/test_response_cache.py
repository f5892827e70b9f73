"""The response cache (``--cache-config local,size=N`` + ``response_cache { enable:
true }``): hits skip the model, statistics and metrics as Triton counts them, LRU
eviction, what is not cached, configs Triton refuses, and hits through tritonclient
over HTTP, including outputs into a client's shared memory."""

from __future__ import annotations

import logging
import os
import re
from multiprocessing import resource_tracker

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm

import dlserve
from dlserve.engine.request import Request
from dlserve.engine.response_cache import _entry_size, cache_size
from dlserve.frontends import KServeHttp, Metrics
from dlserve.memory.dtypes import DataType
from dlserve.memory.tensor import Tensor

from ..conftest import MODELS, wait_until
from .test_metrics import scrape, value

CACHE = {"local": {"size": str(1 << 20)}}
X = np.arange(4, dtype=np.float32).reshape(1, 4)


def infer(server: dlserve.Server, x: np.ndarray, **kwargs) -> dlserve.InferenceResponse:
    return list(server.model("cached").infer(inputs={"INPUT0": x}, raise_on_error=False, **kwargs))[0]


def executed(response) -> int:
    return int(np.from_dlpack(response.outputs["EXECUTED"])[0])


def inference_stats(server: dlserve.Server) -> dict:
    return server.model("cached").statistics()["model_stats"][0]


def test_a_hit_skips_the_model_and_counts_as_triton_does(servers, make_repo):
    server = servers.start(make_repo("cached"), cache_config=CACHE)
    first = infer(server, X, request_id="a")
    second = infer(server, X, request_id="b")
    assert executed(first) == executed(second) == 1  # the second never reached the model
    assert second.request_id == "b"  # the hit answers the request that asked
    np.testing.assert_array_equal(np.from_dlpack(second.outputs["OUTPUT0"]), X * 2)
    stats = inference_stats(server)
    assert stats["inference_count"] == 1 and stats["execution_count"] == 1
    inference = stats["inference_stats"]
    assert inference["success"]["count"] == 2
    assert inference["cache_hit"]["count"] == 1 and inference["cache_hit"]["ns"] > 0
    assert inference["cache_miss"]["count"] == 1 and inference["cache_miss"]["ns"] > 0
    assert inference["queue"]["count"] == 2  # the hit's wait before its lookup is queue time
    assert inference["compute_infer"]["count"] == 1
    # A hit's outputs are read-only: nobody can change what later hits get, not even
    # through a legacy capsule, which cannot say read-only (it gets a copy).
    with pytest.raises(ValueError):
        np.from_dlpack(second.outputs["OUTPUT0"])[0] = 5
    dlserve.Tensor.from_dlpack(second.outputs["OUTPUT0"].__dlpack__()).as_numpy()[0] = 5
    third = infer(server, X)
    assert executed(third) == 1
    np.testing.assert_array_equal(np.from_dlpack(third.outputs["OUTPUT0"]), X * 2)


def test_what_makes_another_entry(servers, make_repo):
    server = servers.start(make_repo("cached"), cache_config=CACHE)
    assert executed(infer(server, X)) == 1
    assert executed(infer(server, X + 1)) == 2  # other bytes
    # The same bytes under another shape, or asking for other outputs, are other
    # entries (Triton's key has neither: it answers them with the first one's outputs).
    assert executed(infer(server, X.reshape(2, 2))) == 3
    only = infer(server, X, requested_output_names=["EXECUTED"])
    assert set(only.outputs) == {"EXECUTED"} and executed(only) == 4
    assert set(infer(server, X).outputs) == {"OUTPUT0", "EXECUTED"}
    # Request ids and parameters are not part of the key.
    assert executed(infer(server, X, request_id="z", parameters={"p": 1})) == 1


def test_errors_are_not_cached(servers, make_repo):
    server = servers.start(make_repo("cached"), cache_config=CACHE)
    bad = -np.ones((1, 2), dtype=np.float32)
    for _ in range(2):
        response = infer(server, bad)
        assert response.error is not None and "negative input" in response.error.message
    assert executed(infer(server, X)) == 3  # both errors ran the model
    assert inference_stats(server)["inference_stats"]["cache_hit"]["count"] == 0


def test_least_recently_used_entries_go_first(servers, make_repo):
    # Room for two of this model's entries (one size for all), not three.
    size = _entry_size(
        (("OUTPUT0", DataType.FP32, (1, 4), X), ("EXECUTED", DataType.INT64, (1,), np.zeros(1, np.int64)))
    )
    server = servers.start(make_repo("cached"), cache_config={"local": {"size": str(size * 2)}})
    a, b, c = X, X + 1, X + 2
    infer(server, a)
    infer(server, b)
    assert executed(infer(server, a)) == 1  # a hit, and now the most recently used
    infer(server, c)  # evicts b
    assert executed(infer(server, a)) == 1
    assert executed(infer(server, b)) == 4
    cache = server.engine.response_cache
    assert cache is not None and len(cache) == 2 and cache.evictions == 2 and cache.used <= size * 2


def test_an_entry_bigger_than_the_cache_is_not_kept(servers, make_repo, caplog):
    server = servers.start(make_repo("cached"), cache_config={"local": {"size": "64"}})
    with caplog.at_level("ERROR", logger="dlserve.engine.response_cache"):
        assert executed(infer(server, X)) == 1
        assert executed(infer(server, X)) == 2
    assert len(server.engine.response_cache) == 0
    # each miss says so in Triton's words (upstream L0_response_cache greps them)
    failures = [r.getMessage() for r in caplog.records if "Failed to insert key" in r.getMessage()]
    assert len(failures) == 2
    assert re.fullmatch(
        r"Failed to insert key \[\d+\] into response cache: Requested byte_size: \d+ is greater "
        r"than total cache size: 64",
        failures[0],
    ), failures[0]


def test_without_a_server_cache_the_model_runs_every_time(servers, make_repo):
    server = servers.start(make_repo("cached"))
    assert executed(infer(server, X)) == 1
    assert executed(infer(server, X)) == 2
    text = server.metrics()
    assert 'nv_cache_num_hits_per_model{model="cached",version="1"} 0' in text
    assert "nv_cache_util" not in text  # no cache, no cache gauges


def test_metrics(servers, make_repo):
    server = servers.start(make_repo("cached", "identity"), cache_config=CACHE)
    infer(server, X)
    infer(server, X)
    text = server.metrics()
    assert 'nv_cache_num_hits_per_model{model="cached",version="1"} 1' in text
    assert 'nv_cache_num_misses_per_model{model="cached",version="1"} 1' in text
    assert 'nv_cache_hit_duration_per_model{model="cached",version="1"}' in text
    assert 'model="identity"' not in "\n".join(line for line in text.splitlines() if "nv_cache" in line)
    assert "nv_cache_num_entries 1" in text
    assert "nv_cache_num_lookups 2" in text and "nv_cache_num_hits 1" in text
    assert 'nv_inference_request_success{model="cached",version="1"} 2' in text
    assert 'nv_inference_count{model="cached",version="1"} 1' in text


def test_identical_requests_that_miss_together_count_one_miss_as_triton_does(servers, make_repo):
    """Side by side with Triton 2.51: identical requests that all miss all run, but only
    the response that went into the cache counts a miss (in the statistics and in
    nv_cache_num_misses_per_model); the others' found their entry there. dlserve
    counted a miss for each."""
    server = servers.start(make_repo("cached"), cache_config=CACHE)
    answered: list[object] = []

    def submit_two(engine) -> None:  # (both looked up before either runs)
        for name in ("a", "b"):
            inputs = {"INPUT0": Tensor.from_numpy(X.copy())}
            engine.submit(Request("cached", inputs, on_response=answered.append, request_id=name))

    server._call_sync(submit_two)
    wait_until(lambda: len(answered) == 2)
    assert executed(infer(server, X)) == 1  # a hit on the first one's response
    stats = inference_stats(server)
    assert stats["inference_count"] == 2 and stats["execution_count"] == 2
    inference = stats["inference_stats"]
    assert inference["success"]["count"] == 3
    assert inference["cache_hit"]["count"] == 1
    assert inference["cache_miss"]["count"] == 1
    text = server.metrics()
    assert 'nv_cache_num_misses_per_model{model="cached",version="1"} 1' in text
    assert "nv_cache_num_lookups 3" in text and "nv_cache_num_misses 2" in text  # the cache's own


@pytest.mark.parametrize(
    ("extra", "unsupported"),
    [
        ("model_transaction_policy { decoupled: true }", "with 'decoupled' transaction policy"),
        ("sequence_batching { }", "with sequence batching scheduler"),
    ],
)
def test_decoupled_and_sequence_models_cannot_use_it(servers, make_repo, extra, unsupported):
    config = (MODELS / "cached" / "config.pbtxt").read_text() + extra + "\n"
    repo = make_repo("cached", extra={"cached": {"config.pbtxt": config}})
    server = servers.start(repo, exit_on_error=False)  # refused with or without a cache
    (row,) = [m for (name, _), m in server.models().items() if name == "cached"]
    assert row.state == "UNAVAILABLE"
    assert f"Response Cache does not currently support model cached {unsupported}. Please disable the response cache." in row.reason


def test_an_ensemble_made_decoupled_by_its_step_cannot_use_it(servers, make_repo):
    # The config does not say decoupled: the streaming step makes it so, and the cache
    # is refused then, as Triton refuses it.
    config = (MODELS / "stream_double" / "config.pbtxt").read_text()
    config = config.replace("model_transaction_policy { decoupled: true }", "response_cache { enable: true }")
    repo = make_repo("decoupled", "double", extra={"stream_double": {"config.pbtxt": config, "1/.keep": ""}})
    server = servers.start(repo, exit_on_error=False, cache_config=CACHE)
    rows = {name: m for (name, _), m in server.models().items()}
    assert rows["decoupled"].state == rows["double"].state == "READY"
    assert rows["stream_double"].state == "UNAVAILABLE"
    assert (
        "Response Cache does not currently support model stream_double with 'decoupled' "
        "transaction policy. Please disable the response cache." in rows["stream_double"].reason
    )


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"redis": {"size": "10"}}, "unknown response cache 'redis'"),
        ({"local": {}}, "needs a 'size'"),
        ({"local": {"size": "abc"}}, "size must be a positive number of bytes, got 'abc'"),
        ({"local": {"size": "0"}}, "size must be a positive number of bytes"),
        ({"local": {"size": "10", "x": "1"}}, "has no setting 'x'"),
    ],
)
def test_bad_cache_configs(config, message):
    with pytest.raises(dlserve.InvalidArgumentError, match=message):
        cache_size(config)


# -- through tritonclient over HTTP ---------------------------------------------------------------
@pytest.fixture(scope="module")
def resource_tracker_running() -> None:
    """tritonclient's shared-memory utilities start multiprocessing's resource tracker,
    whose pipe lives as long as the process: opened before the leak check's snapshot."""
    resource_tracker.ensure_running()


def test_hits_over_http_with_outputs_into_client_shared_memory(resource_tracker_running, servers, make_repo):
    server = servers.start(make_repo("cached"), cache_config=CACHE)
    service = KServeHttp(server, KServeHttp.Options(address="127.0.0.1", port=0, allow_client_shm=True))
    service.start()
    metrics = Metrics(server, Metrics.Options(address="127.0.0.1", port=0))
    metrics.start()
    key = f"/cachetest_{os.getpid()}"
    region = shm.create_shared_memory_region("out", key, 64)
    client = httpclient.InferenceServerClient(f"127.0.0.1:{service.port}")
    try:
        x = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        x.set_data_from_numpy(X)
        first = client.infer("cached", [x], request_id="1")
        second = client.infer("cached", [x], request_id="2")
        assert second.get_response()["id"] == "2"
        np.testing.assert_array_equal(second.as_numpy("OUTPUT0"), X * 2)
        assert first.as_numpy("EXECUTED")[0] == second.as_numpy("EXECUTED")[0] == 1
        # A hit whose request wants OUTPUT0 in the client's memory writes it there.
        client.register_system_shared_memory("out", key, 64)
        wanted = [httpclient.InferRequestedOutput("OUTPUT0"), httpclient.InferRequestedOutput("EXECUTED")]
        wanted[0].set_shared_memory("out", 16)
        client.infer("cached", [x], outputs=wanted)  # a miss (other outputs asked for): runs
        shm.set_shared_memory_region(region, [np.zeros(4, dtype=np.float32)])
        hit = client.infer("cached", [x], outputs=wanted)
        assert hit.as_numpy("EXECUTED")[0] == 2
        np.testing.assert_array_equal(shm.get_contents_as_numpy(region, np.float32, [1, 4]), X * 2)
        # A region too small for a hit's output: a clear error, the server serves on.
        client.unregister_system_shared_memory("out")
        client.register_system_shared_memory("out", key, 8)
        wanted[0].set_shared_memory("out", 8)
        with pytest.raises(Exception, match="OUTPUT0"):
            client.infer("cached", [x], outputs=wanted)
        assert client.infer("cached", [x]).as_numpy("EXECUTED")[0] == 1
        _, fams = scrape(metrics.port)
        assert value(fams, "nv_cache_num_hits_per_model", model="cached", version="1") == 4  # the refused one too
        assert value(fams, "nv_cache_num_hits") == 4
    finally:
        client.close()
        shm.destroy_shared_memory_region(region)
        service.stop()
        metrics.stop()


def test_an_ensemble_caches_its_own_responses(servers, make_repo):
    config = (MODELS / "pipeline" / "config.pbtxt").read_text() + "response_cache { enable: true }\n"
    repo = make_repo("add_sub", "identity", extra={"pipeline": {"config.pbtxt": config}})
    (repo / "pipeline" / "1").mkdir()
    server = servers.start(repo, cache_config=CACHE)
    a = np.arange(16, dtype=np.float32)
    for _ in range(3):
        (response,) = server.model("pipeline").infer(inputs={"A": a, "B": a})
        np.testing.assert_array_equal(np.from_dlpack(response.outputs["SUM"]), a * 2)
    stats = server.model("pipeline").statistics()["model_stats"][0]["inference_stats"]
    assert stats["cache_hit"]["count"] == 2 and stats["cache_miss"]["count"] == 1
    # Its steps ran once: the hits never reached them.
    assert server.model("add_sub").statistics()["model_stats"][0]["execution_count"] == 1


_ORDERED = """
name: "ordered" backend: "python" max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
dynamic_batching { preserve_ordering: true }
response_cache { enable: true }
instance_group [ { count: 2 kind: KIND_CPU } ]
"""
_SLOW_ON_ONE = """
import threading, time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            if x[0, 0] == 1:
                time.sleep(1.0)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
        return out
"""


def test_a_hit_keeps_its_place_when_the_batcher_preserves_ordering(servers, make_repo):
    repo = make_repo(extra={"ordered": {"config.pbtxt": _ORDERED, "1/model.py": _SLOW_ON_ONE}})
    server = servers.start(repo, cache_config=CACHE)
    list(server.model("ordered").infer(inputs={"X": np.array([[2.0]], np.float32)}))  # cached
    answered: list[str] = []  # in the order the engine delivers them (on its loop)

    def send(value: float, name: str) -> None:
        def submit(engine) -> None:
            x = Tensor.from_numpy(np.array([[value]], np.float32))
            engine.submit(Request("ordered", {"X": x}, on_response=lambda _: answered.append(name), request_id=name))

        server._call_sync(submit)

    send(1.0, "slow miss")
    wait_until(lambda: server.engine.response_cache.misses == 2)  # looked up: it is executing
    send(2.0, "later hit")
    wait_until(lambda: len(answered) == 2)
    assert answered == ["slow miss", "later hit"]


def test_a_reloaded_model_does_not_answer_with_its_old_outputs(servers, make_repo):
    repo = make_repo("cached")
    server = servers.start(repo, cache_config=CACHE, model_control_mode=dlserve.ModelControlMode.EXPLICIT,
                           startup_models=["cached"])
    np.testing.assert_array_equal(np.from_dlpack(infer(server, X).outputs["OUTPUT0"]), X * 2)
    assert len(server.engine.response_cache) == 1
    code = repo / "cached" / "1" / "model.py"
    code.write_text(code.read_text().replace("x * 2", "x * 3"))
    server.load("cached")  # the new code's load replaces the old
    np.testing.assert_array_equal(np.from_dlpack(infer(server, X).outputs["OUTPUT0"]), X * 3)
    wait_until(lambda: len(server.engine.response_cache) == 1)  # the old load's entry goes with it
    server.unload("cached")
    assert len(server.engine.response_cache) == 0


def test_a_hit_on_one_ensemble_step_while_another_is_still_to_start(servers, make_repo, caplog):
    """The cached step answers inside its own start on the second request, before the
    step beside it has started: the ensemble answers, each step's work done once, and
    nothing fails on the engine's loop (it raised there, after answering)."""
    ensemble = """
name: "both" platform: "ensemble" max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1, -1 ] } ]
output [ { name: "A" data_type: TYPE_FP32 dims: [ -1, -1 ] },
         { name: "B" data_type: TYPE_FP32 dims: [ -1, -1 ] } ]
ensemble_scheduling { step [
  { model_name: "cached" model_version: -1
    input_map { key: "INPUT0" value: "X" } output_map { key: "OUTPUT0" value: "A" } },
  { model_name: "uncached" model_version: -1
    input_map { key: "INPUT0" value: "X" } output_map { key: "OUTPUT0" value: "B" } }
] }
"""
    cached = MODELS / "cached"
    uncached = (cached / "config.pbtxt").read_text().replace('"cached"', '"uncached"')
    uncached = uncached.replace("response_cache { enable: true }", "")
    repo = make_repo("cached", extra={
        "uncached": {"config.pbtxt": uncached, "1/model.py": (cached / "1/model.py").read_text()},
        "both": {"config.pbtxt": ensemble},
    })
    (repo / "both" / "1").mkdir()
    server = servers.start(repo, cache_config=CACHE)
    for _ in range(3):
        (response,) = server.model("both").infer(inputs={"X": X})
        np.testing.assert_array_equal(np.from_dlpack(response.outputs["A"]), X * 2)
        np.testing.assert_array_equal(np.from_dlpack(response.outputs["B"]), X * 2)
    assert server.model("cached").statistics()["model_stats"][0]["execution_count"] == 1
    assert server.model("uncached").statistics()["model_stats"][0]["execution_count"] == 3
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
