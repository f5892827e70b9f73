"""The KServe v2 HTTP frontend (``dlserve.frontends.KServeHttp``) against clients
nobody here wrote: ``tritonclient.http`` (sync and aio), ``http.client``, raw
sockets and ``curl``.

Covered: every endpoint; inference with JSON and binary tensors, every data type,
parameters, compression, keep-alive and pipelining; error statuses and texts
(compared byte for byte with what real Triton 2.51 answered, recorded in
tests/data/triton_reference/http_cases.json, wherever dlserve means to match);
malformed input at the byte level, each followed by a good request; restricted
APIs; the service lifecycle. Known bugs are ``xfail(strict=True)`` with the reason.

Servers are module-scoped (a main NONE-mode server with three HTTP services on it,
an EXPLICIT-mode one, a bare one for lifecycle tests); the harness from conftest
checks at the end that no worker, shared-memory segment or descriptor leaked.
"""

from __future__ import annotations

import ast
import asyncio
import base64
import concurrent.futures
import contextlib
import gc
import gzip
import http.client
import json
import os
import shutil
import socket
import subprocess
import time
import types
import warnings
import zlib
from multiprocessing import resource_tracker
from pathlib import Path

import gevent
import ml_dtypes
import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aioclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

import dlserve
from dlserve import ModelControlMode
from dlserve.frontends import KServeGrpc, KServeHttp, Metrics
from dlserve.memory.dtypes import DataType, numpy_dtype

from ..conftest import MODELS, ServerHarness, wait_until
from .http_helpers import (
    Reply,
    binary_infer_body,
    bytes_tensor,
    exchange,
    fp32,
    http_request,
    parse_responses,
    request,
    split_binary_response,
)
from .test_model_control import HeldRequest

REFERENCE = Path(__file__).parent.parent / "data" / "triton_reference"
TRITON_CASES = {
    case["label"]: case for case in json.loads((REFERENCE / "http_cases.json").read_text())
}
LOADED = ["add_sub", "identity", "dtypes_echo", "bytes_model", "faulty", "params_echo", "versioned"]
SMALL_MAX = 1 << 20
RESTRICTION = "inference,model-config:x-key=secret"
A = np.arange(16, dtype=np.float32)
B = np.ones(16, dtype=np.float32)


# -- servers -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def harness():
    # Process-lifetime descriptors of the clients, opened before the leak check's snapshot:
    # tritonclient's gevent hub, and the resource tracker that tritonclient's shared-memory
    # utilities (multiprocessing.shared_memory) start.
    gevent.sleep(0)
    resource_tracker.ensure_running()
    h = ServerHarness()
    yield h
    h.close()


def _http(server: dlserve.Server, **options) -> KServeHttp:
    service = KServeHttp(server, KServeHttp.Options(address="127.0.0.1", port=0, **options))
    service.start()
    return service


@pytest.fixture(scope="module")
def main(harness, tmp_path_factory):
    """A NONE-mode server with three HTTP services: the main one (client shm allowed),
    one with a 1 MiB body limit and client shm off, one with restricted APIs."""
    repo = tmp_path_factory.mktemp("http_repo")
    for name in LOADED:
        shutil.copytree(MODELS / name, repo / name)
    server = harness.start(repo)
    assert server.ready()
    services = [
        _http(server, allow_client_shm=True),
        _http(server, max_input_size=SMALL_MAX),
        _http(server, restricted_apis=[RESTRICTION], header_forward_pattern="x-fwd-.*"),
    ]
    yield types.SimpleNamespace(
        server=server,
        port=services[0].port,
        small_port=services[1].port,
        restricted_port=services[2].port,
        url=f"127.0.0.1:{services[0].port}",
    )
    for service in services:
        service.stop()
    gc.collect()
    assert _arena_settles(server, 0), f"{server.engine.arena.bytes_in_use} arena bytes still held"


@pytest.fixture(scope="module")
def port(main) -> int:
    return main.port


@pytest.fixture(scope="module")
def client(main):
    c = httpclient.InferenceServerClient(main.url, connection_timeout=10, network_timeout=30)
    yield c
    c.close()


@pytest.fixture(scope="module")
def explicit(harness, tmp_path_factory):
    repo = tmp_path_factory.mktemp("explicit_repo")
    for name in ("identity", "add_sub", "init_fail"):
        shutil.copytree(MODELS / name, repo / name)
    server = harness.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    service = _http(server)
    c = httpclient.InferenceServerClient(f"127.0.0.1:{service.port}", network_timeout=30)
    yield types.SimpleNamespace(server=server, port=service.port, client=c)
    c.close()
    service.stop()


def _arena_settles(server: dlserve.Server, expected: int, within: float = 2.0) -> bool:
    deadline = time.monotonic() + within
    while server.engine.arena.bytes_in_use != expected:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# -- small helpers ---------------------------------------------------------------------------
def add_sub_inputs(binary: tuple[bool, bool] = (True, True)) -> list[httpclient.InferInput]:
    inputs = []
    for name, value, as_binary in (("INPUT0", A, binary[0]), ("INPUT1", B, binary[1])):
        item = httpclient.InferInput(name, [16], "FP32")
        item.set_data_from_numpy(value, binary_data=as_binary)
        inputs.append(item)
    return inputs


def json_infer(inputs: list[dict], **fields) -> str:
    return json.dumps({"inputs": inputs, **fields})


def identity_input(values=(1.0, 2.0), **extra) -> dict:
    return {
        "name": "INPUT0",
        "datatype": "FP32",
        "shape": [len(values)],
        "data": list(values),
        **extra,
    }


def assert_serving(port: int) -> None:
    """The server still answers a good inference after whatever came before."""
    reply = request(
        port, "POST", "/v2/models/identity/infer", json_infer([identity_input((4.0, 5.0))])
    )
    assert reply.status == 200, reply.body
    assert reply.json()["outputs"][0]["data"] == [4.0, 5.0]


def assert_error(reply: Reply, status: int, *fragments: str) -> str:
    assert reply.status == status, (reply.status, reply.body)
    body = reply.json()
    assert set(body) == {"error"}, body
    for fragment in fragments:
        assert fragment in body["error"], body["error"]
    return body["error"]


def client_error(call, *args, **kwargs) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call(*args, **kwargs)
    return info.value


# ==========================================================================================
# Endpoints
# ==========================================================================================
def test_health_through_tritonclient(client):
    assert client.is_server_live()
    assert client.is_server_ready()


def test_health_and_metadata_through_curl(port):
    base = f"http://127.0.0.1:{port}"
    code = subprocess.run(
        ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", f"{base}/v2/health/live"],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout
    assert code == "200"
    out = subprocess.run(
        ["curl", "-s", "-f", f"{base}/v2/models/add_sub"],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout
    assert json.loads(out)["inputs"][0] == {"name": "INPUT0", "datatype": "FP32", "shape": [16]}
    body = json_infer([identity_input((1.5, -2.0))])
    out = subprocess.run(
        [
            "curl",
            "-s",
            "-f",
            "-H",
            "Content-Type: application/json",
            "-d",
            body,
            f"{base}/v2/models/identity/infer",
        ],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout
    assert json.loads(out)["outputs"][0]["data"] == [1.5, -2.0]


def test_health_replies_have_empty_bodies(port):
    for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/add_sub/ready"):
        reply = request(port, "GET", path)
        assert (reply.status, reply.body) == (200, b""), path


def test_model_ready(client, port):
    assert client.is_model_ready("add_sub")
    assert client.is_model_ready("add_sub", "1")
    assert client.is_model_ready("versioned", "3")
    assert not client.is_model_ready("versioned", "1")  # the default policy serves the latest only
    assert not client.is_model_ready("nope")
    assert not client.is_model_ready("add_sub", "7")
    for path in ("/v2/models/nope/ready", "/v2/models/add_sub/versions/7/ready"):
        assert request(port, "GET", path).body == b'{"error":"Model version not ready"}'


def test_server_metadata(client, port):
    meta = client.get_server_metadata()
    assert meta["name"] == "dlserve" and meta["version"] == dlserve.__version__
    assert isinstance(meta["extensions"], list) and "statistics" in meta["extensions"]
    assert request(port, "GET", "/v2").json() == meta


def test_server_metadata_lists_the_http_extensions_it_implements(client):
    extensions = client.get_server_metadata()["extensions"]
    for name in ("binary_tensor_data", "system_shared_memory", "logging", "trace"):
        assert name in extensions
    # CUDA shared memory only where a GPU is (tests/gpu checks it is listed there)
    assert ("cuda_shared_memory" in extensions) == (dlserve.memory.cuda.device_count() > 0)


def test_model_metadata_matches_triton(client, port):
    for model in ("add_sub", "bytes_model"):
        expected = json.loads((REFERENCE / f"metadata_{model}.json").read_text())
        assert client.get_model_metadata(model) == expected
        assert (
            request(port, "GET", f"/v2/models/{model}").body
            == (REFERENCE / f"metadata_{model}.json").read_bytes()
        )
    assert client.get_model_metadata("add_sub", "1") == client.get_model_metadata("add_sub")


def test_versioned_model_metadata(client, port):
    meta = client.get_model_metadata("versioned", "3")
    assert meta["name"] == "versioned" and meta["versions"] == ["3"]
    assert meta["outputs"] == [{"name": "VERSION", "datatype": "INT32", "shape": [1]}]
    reply = request(port, "GET", "/v2/models/versioned/versions/1")
    assert_error(reply, 404)
    assert reply.error == "Request for unknown model: 'versioned' version 1 is not found"
    assert_error(request(port, "GET", "/v2/models/versioned/versions/abc"), 400, "abc")


def test_model_config_is_rendered_as_triton_renders_it(client, port):
    """Same config.pbtxt as the reference repository: the same bytes, key order included."""
    reply = request(port, "GET", "/v2/models/add_sub/config")
    assert reply.status == 200
    assert reply.body == (REFERENCE / "config_add_sub.json").read_bytes()
    assert client.get_model_config("add_sub") == json.loads(reply.body)
    assert request(port, "GET", "/v2/models/add_sub/versions/1/config").body == reply.body
    config = client.get_model_config("params_echo")
    assert config["parameters"] == {"greeting": {"string_value": "hello"}}
    assert config["instance_group"][0]["name"] == "params_echo"


def test_statistics_of_all_models(client, port):
    everything = client.get_inference_statistics()
    names = sorted({row["name"] for row in everything["model_stats"]})
    assert names == sorted(LOADED)
    order = [(row["name"], int(row["version"])) for row in everything["model_stats"]]
    assert order == sorted(order)  # by name, then version, as Triton lists them
    reply = request(port, "GET", "/v2/models/stats")
    assert reply.status == 200 and sorted(r["name"] for r in reply.json()["model_stats"]) == names


def test_statistics_of_a_model_and_a_version(client, port):
    reference = json.loads((REFERENCE / "stats_add_sub.json").read_text())["model_stats"][0]
    row = client.get_inference_statistics("add_sub")["model_stats"][0]
    assert set(row) == set(reference)
    assert set(row["inference_stats"]) == set(reference["inference_stats"])
    versioned = client.get_inference_statistics("versioned", "3")["model_stats"]
    assert [(r["name"], r["version"]) for r in versioned] == [("versioned", "3")]
    assert (
        request(port, "GET", "/v2/models/versioned/versions/3/stats").json()["model_stats"]
        == versioned
    )
    error = client_error(client.get_inference_statistics, "nope")
    assert error.status() == "400" and error.message() == "requested model 'nope' is not available"
    error = client_error(client.get_inference_statistics, "versioned", "9")
    assert error.status() == "400"
    assert error.message() == "requested model version is not available for model 'versioned'"


def test_statistics_count_inferences(client):
    def counts():
        row = client.get_inference_statistics("versioned")["model_stats"][0]
        return (
            row["inference_count"],
            row["execution_count"],
            row["inference_stats"]["success"]["count"],
        )

    before = counts()
    x = httpclient.InferInput("INPUT0", [1], "FP32")
    x.set_data_from_numpy(np.ones(1, dtype=np.float32))
    for _ in range(3):
        assert client.infer("versioned", [x]).as_numpy("VERSION").tolist() == [3]
    after = counts()
    assert [a - b for a, b in zip(after, before)] == [3, 3, 3]
    row = client.get_inference_statistics("versioned")["model_stats"][0]
    assert row["last_inference"] > 0 and row["inference_stats"]["compute_infer"]["ns"] > 0


def _faulty_stats(client) -> dict:
    row = client.get_inference_statistics("faulty")["model_stats"][0]
    stats = row["inference_stats"]
    return {
        "inference_count": row["inference_count"],
        "execution_count": row["execution_count"],
        "success": stats["success"]["count"],
        "fail": stats["fail"]["count"],
        # (Triton's batch_stats count every execution, failed ones too)
        "batch_executions": sum(batch["compute_infer"]["count"] for batch in row["batch_stats"]),
    }


def _faulty_infer(client, mode: str) -> None:
    x = httpclient.InferInput("INPUT0", [2], "FP32")
    x.set_data_from_numpy(np.ones(2, dtype=np.float32))
    try:
        client.infer("faulty", [x], parameters={"mode": mode})
    except InferenceServerException:
        pass


def _stats_delta(client, mode: str) -> dict:
    before = _faulty_stats(client)
    _faulty_infer(client, mode)
    after = _faulty_stats(client)
    return {key: after[key] - before[key] for key in before}


def test_statistics_count_a_raising_execute_as_a_failure(client):
    delta = _stats_delta(client, "raise")
    assert (delta["inference_count"], delta["success"], delta["fail"]) == (0, 0, 1)


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("error:NOT_FOUND", {"inference_count": 1, "execution_count": 1, "success": 1, "fail": 0, "batch_executions": 1}),
        ("raise", {"inference_count": 0, "execution_count": 1, "success": 0, "fail": 1, "batch_executions": 1}),
    ],
)
def test_statistics_count_errors_as_triton_does(client, mode, expected):
    assert _stats_delta(client, mode) == expected


def test_repository_index(client, port):
    index = client.get_model_repository_index()
    assert index == [
        {"name": n, "version": "3" if n == "versioned" else "1", "state": "READY"}
        for n in sorted(LOADED)
    ]
    assert request(port, "POST", "/v2/repository/index", '{"ready": true}').json() == index
    assert request(port, "POST", "/v2/repository/index", '{"ready": false}').json() == index
    assert_error(request(port, "POST", "/v2/repository/index", '{"ready": "yes"}'), 400, "ready")
    assert_error(request(port, "GET", "/v2/repository/index"), 405)


def test_load_and_unload_refused_outside_explicit_mode(client):
    for call in (client.load_model, client.unload_model):
        error = client_error(call, "add_sub")
        assert error.status() == "503"
        assert (
            "explicit model load / unload is not allowed if polling is enabled" in error.message()
        )


def test_log_settings(client, port):
    original = client.get_log_settings()
    assert set(original) == {
        "log_file",
        "log_info",
        "log_warning",
        "log_error",
        "log_verbose_level",
        "log_format",
    }
    try:
        updated = client.update_log_settings({"log_verbose_level": 2, "log_info": True})
        assert updated == {**original, "log_verbose_level": 2, "log_info": True}
        assert client.get_log_settings() == updated
        for bad in (
            {"log_verbose_level": "x"},
            {"log_format": "xml"},
            {"bogus": 1},
            {"log_verbose_level": 2**32},  # (Triton keeps it in 32 bits)
        ):
            error = client_error(client.update_log_settings, bad)
            assert error.status() == "400", bad
        # Triton's status and words for the one setting fixed at start-up
        error = client_error(client.update_log_settings, {"log_file": "/tmp/elsewhere.log"})
        assert error.status() == "501"
        assert error.message() == "log file location can not be updated through network protocol"
        assert client.get_log_settings() == updated, "a refused update must change nothing"
        # null leaves a setting as it is (Triton's reading): clients send whole objects
        assert client.update_log_settings({"log_info": None, "log_verbose_level": 3})["log_info"] is True
        client.update_log_settings({"log_verbose_level": 2})
        assert_error(request(port, "POST", "/v2/logging", "[]"), 400)
    finally:
        client.update_log_settings({k: v for k, v in original.items() if k != "log_file"})
    assert client.get_log_settings() == original


# -- system shared memory ---------------------------------------------------------------------
@pytest.fixture
def regions():
    """Client shared-memory objects made with tritonclient's own utilities, destroyed after."""
    made = []

    def make(name: str, byte_size: int):
        key = f"/httptest_{os.getpid()}_{name}"
        handle = shm.create_shared_memory_region(name, key, byte_size)
        made.append(handle)
        return key, handle

    yield make
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def test_system_shared_memory_round_trip(client, regions):
    in_key, in_handle = regions("in_r", 64)
    out_key, out_handle = regions("out_r", 128)
    shm.set_shared_memory_region(in_handle, [A])
    client.register_system_shared_memory("in_r", in_key, 64)
    client.register_system_shared_memory("out_r", out_key, 64, offset=64)
    try:
        status = {row["name"]: row for row in client.get_system_shared_memory_status()}
        assert set(status) == {"in_r", "out_r"}
        assert status["out_r"]["offset"] == 64 and status["out_r"]["byte_size"] == 64
        assert status["in_r"]["offset"] == 0 and status["in_r"]["byte_size"] == 64
        x = httpclient.InferInput("INPUT0", [16], "FP32")
        x.set_shared_memory("in_r", 64)
        out = httpclient.InferRequestedOutput("OUTPUT0")
        out.set_shared_memory("out_r", 64)
        result = client.infer("identity", [x], outputs=[out])
        entry = result.get_output("OUTPUT0")
        # Like Triton: neither data nor parameters (perf_analyzer's C++ client reads any
        # output "parameters" as binary data and fails without binary_data_size).
        assert "data" not in entry and "parameters" not in entry
        np.testing.assert_array_equal(
            shm.get_contents_as_numpy(out_handle, np.float32, [16], offset=64), A
        )
        # The model reads the client's memory as it is at request time.
        shm.set_shared_memory_region(in_handle, [A * 3])
        client.infer("identity", [x], outputs=[out])
        np.testing.assert_array_equal(
            shm.get_contents_as_numpy(out_handle, np.float32, [16], offset=64), A * 3
        )
        # A shm input with a JSON output: the output comes back in the response.
        plain = client.infer(
            "identity", [x], outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)]
        )
        np.testing.assert_array_equal(plain.as_numpy("OUTPUT0"), A * 3)
        client.unregister_system_shared_memory("in_r")
        assert [row["name"] for row in client.get_system_shared_memory_status()] == ["out_r"]
        error = client_error(client.infer, "identity", [x])
        assert (
            error.status() == "404"  # (Triton's)
            and "Unable to find shared memory region: 'in_r'" in error.message()
        )
    finally:
        client.unregister_system_shared_memory()
    assert client.get_system_shared_memory_status() == []


def test_an_output_named_twice_is_answered_as_its_first_entry_asks(client, regions):
    """Triton 2.51 (side by side): over HTTP the first entry for an output decides
    whether it goes into shared memory; the later one is ignored."""
    in_key, in_handle = regions("dup_in", 64)
    out_key, out_handle = regions("dup_out", 64)
    shm.set_shared_memory_region(in_handle, [A])
    client.register_system_shared_memory("dup_in", in_key, 64)
    client.register_system_shared_memory("dup_out", out_key, 64)
    try:
        x = httpclient.InferInput("INPUT0", [16], "FP32")
        x.set_shared_memory("dup_in", 64)
        into_shm = httpclient.InferRequestedOutput("OUTPUT0")
        into_shm.set_shared_memory("dup_out", 64)
        plain = httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)

        shm.set_shared_memory_region(out_handle, [np.zeros(16, np.float32)])
        result = client.infer("identity", [x], outputs=[plain, into_shm])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A)
        untouched = shm.get_contents_as_numpy(out_handle, np.float32, [16])
        np.testing.assert_array_equal(untouched, np.zeros(16, np.float32))

        result = client.infer("identity", [x], outputs=[into_shm, plain])
        assert "data" not in result.get_output("OUTPUT0")
        np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.float32, [16]), A)
    finally:
        client.unregister_system_shared_memory()


def test_a_zero_class_count_over_http_is_no_classification(port):
    """Triton 2.51 answers the plain tensor to ``"classification": 0`` in JSON (gRPC
    refuses 0: tests/integration/test_classification.py)."""
    body = json_infer(
        [identity_input()], outputs=[{"name": "OUTPUT0", "parameters": {"classification": 0}}]
    )
    reply = request(port, "POST", "/v2/models/identity/infer", body)
    assert reply.status == 200, reply.body
    (output,) = json.loads(reply.body)["outputs"]
    assert (output["datatype"], output["data"]) == ("FP32", [1.0, 2.0])


def test_system_shared_memory_status_lists_regions_by_name_as_triton(client, regions):
    """Triton 2.51 (side by side, tritonclient's shm example): sorted by name, not in the
    order they were registered."""
    for name in ("out_s", "in_s", "mid_s"):
        key, _ = regions(name, 64)
        client.register_system_shared_memory(name, key, 64)
    try:
        names = [row["name"] for row in client.get_system_shared_memory_status()]
        assert names == ["in_s", "mid_s", "out_s"]
    finally:
        client.unregister_system_shared_memory()


def test_system_shared_memory_status_echoes_the_key_as_registered(client, regions):
    key, _ = regions("echo_r", 64)
    client.register_system_shared_memory("echo_r", key, 64)
    try:
        assert client.get_system_shared_memory_status("echo_r") == [
            {"name": "echo_r", "key": key, "offset": 0, "byte_size": 64}
        ]
    finally:
        client.unregister_system_shared_memory("echo_r")


def test_system_shared_memory_registration_errors(client, port, regions):
    key, _ = regions("err_r", 64)
    client.register_system_shared_memory("err_r", key, 64)
    try:
        cases = [
            (("err_r", key, 64), "shared memory region 'err_r' already in manager"),
            # (upstream shared_memory_test matches "failed to register shared memory region.*invalid args")
            (("big", key, 128), "failed to register shared memory region 'big': invalid args: [0, 128) is outside the 64-byte object"),
            (("off", key, 32, 48), "failed to register shared memory region 'off': invalid args: [48, 80) is outside the 64-byte object"),
        ]
        for args, message in cases:
            error = client_error(client.register_system_shared_memory, *args)
            assert error.status() == "400" and message in error.message(), (args, error)
        # a key that cannot be opened is Triton 2.51's 500, before any other check
        for args in (("missing", f"/httptest_{os.getpid()}_missing", 64), ("nokey", "", 0), ("slash", "/", 16)):
            error = client_error(client.register_system_shared_memory, *args)
            assert error.status() == "500", (args, error)
            assert error.message() == f"Unable to open shared memory region: '{args[1]}'"
        error = client_error(client.get_system_shared_memory_status, "nope")
        assert error.status() == "404"
        assert error.message() == "Unable to find system shared memory region: 'nope'"
        bad_bodies = [
            "",
            "[]",
            '{"key": 5, "byte_size": 16}',
            '{"key": "x", "byte_size": "16"}',
            json.dumps({"key": key, "offset": -1, "byte_size": 16}),
            json.dumps({"key": key, "offset": 0, "byte_size": 0}),
        ]
        for body in bad_bodies:
            assert_error(
                request(port, "POST", "/v2/systemsharedmemory/region/bad/register", body), 400
            )
        # without a region in the path: Triton 2.51's 400 and words, not a 404 (side by side)
        for kind in ("system", "cuda"):
            reply = request(port, "POST", f"/v2/{kind}sharedmemory/register", json.dumps({"key": key}))
            assert (reply.status, reply.json()["error"]) == (
                400, f"'region name' is necessary to register {kind} shared memory region"
            )
        # Unregistering something unknown is not an error (as in Triton).
        assert request(port, "POST", "/v2/systemsharedmemory/region/nope/unregister").status == 200
        assert [row["name"] for row in client.get_system_shared_memory_status()] == ["err_r"]
    finally:
        client.unregister_system_shared_memory()


@pytest.mark.parametrize(
    "key",
    ["dlserve_x", "/dlserve_x", "dlserve_", "/dlserve_"],
)
def test_reserved_keys_are_refused(main, port, key):
    reply = request(
        port,
        "POST",
        "/v2/systemsharedmemory/region/evil/register",
        json.dumps({"key": key, "offset": 0, "byte_size": 16}),
    )
    message = assert_error(reply, 400, "reserved namespace")
    assert (
        message == f"shared memory key '{key}' is in a reserved namespace and cannot be registered"
    )
    assert main.server.engine.segment_prefix not in message


def test_the_servers_own_segments_cannot_be_registered(main, port):
    for key in (
        f"{main.server.engine.segment_prefix}_s_0",
        f"/{main.server.engine.segment_prefix}_s_0",
    ):
        reply = request(
            port,
            "POST",
            "/v2/systemsharedmemory/region/evil/register",
            json.dumps({"key": key, "offset": 0, "byte_size": 16}),
        )
        assert_error(reply, 400, "reserved namespace")
    assert request(port, "GET", "/v2/systemsharedmemory/status").json() == []


@pytest.mark.parametrize("key", ["../x", "/../x", "x/../../etc/passwd", "//dlserve_x"])
def test_shm_keys_with_path_characters_are_refused(port, key):
    reply = request(
        port,
        "POST",
        "/v2/systemsharedmemory/region/trav/register",
        json.dumps({"key": key, "offset": 0, "byte_size": 16}),
    )
    assert_error(reply, 400, "invalid shared memory key")
    assert request(port, "GET", "/v2/systemsharedmemory/status").json() == []


def test_shared_memory_references_are_bounds_checked(client, port, regions):
    key, handle = regions("ref_r", 64)
    shm.set_shared_memory_region(handle, [A])
    client.register_system_shared_memory("ref_r", key, 64)

    def infer(in_params: dict, out_params: dict | None = None) -> Reply:
        body = {
            "inputs": [
                {"name": "INPUT0", "datatype": "FP32", "shape": [16], "parameters": in_params}
            ]
        }
        if out_params is not None:
            body["outputs"] = [{"name": "OUTPUT0", "parameters": out_params}]
        return request(port, "POST", "/v2/models/identity/infer", json.dumps(body))

    ok = {"shared_memory_region": "ref_r", "shared_memory_byte_size": 64}
    try:
        assert infer(ok).status == 200
        unknown = {"shared_memory_region": "nope", "shared_memory_byte_size": 64}
        for in_params, out_params in ((unknown, None), (ok, unknown)):  # (Triton's 404)
            assert_error(infer(in_params, out_params), 404, "Unable to find shared memory region: 'nope'")
        cases = [
            # (Triton's words, which upstream shared_memory_test looks for)
            ({**ok, "shared_memory_offset": 8}, None, "Invalid offset + byte size for shared memory region: 'ref_r'"),
            ({**ok, "shared_memory_offset": 1 << 62}, None, "Invalid offset for shared memory region: 'ref_r'"),
            ({**ok, "shared_memory_byte_size": 1 << 40}, None, "Invalid offset + byte size for shared memory region: 'ref_r'"),
            ({**ok, "shared_memory_offset": -8}, None, "shared_memory_offset"),
            ({**ok, "shared_memory_byte_size": -1}, None, "shared_memory_byte_size"),
            ({**ok, "shared_memory_offset": "8"}, None, "shared_memory_offset"),
            ({"shared_memory_region": "ref_r"}, None, "shared_memory_byte_size"),
            ({"shared_memory_byte_size": 64}, None, "shared_memory_region"),
            ({**ok, "shared_memory_byte_size": 32}, None, "input byte size mismatch"),
            (
                ok,
                {"shared_memory_region": "ref_r", "shared_memory_byte_size": 16},
                # (Triton's words)
                "shared memory size specified with the request for output 'OUTPUT0' (16 bytes) "
                "should be at least 64 bytes to hold the results",
            ),
            (
                ok,
                {
                    "shared_memory_region": "ref_r",
                    "shared_memory_byte_size": 64,
                    "shared_memory_offset": 32,
                },
                "Invalid offset + byte size for shared memory region: 'ref_r': [32, 96) is outside its 64 bytes",
            ),
            (  # an empty reference at the region's end (Triton's words)
                ok,
                {
                    "shared_memory_region": "ref_r",
                    "shared_memory_byte_size": 0,
                    "shared_memory_offset": 64,
                },
                "Invalid offset for shared memory region: 'ref_r'",
            ),
        ]
        for in_params, out_params, message in cases:
            assert_error(infer(in_params, out_params), 400, message)
        both = {
            "name": "INPUT0",
            "datatype": "FP32",
            "shape": [16],
            "data": A.tolist(),
            "parameters": ok,
        }
        assert_error(
            request(port, "POST", "/v2/models/identity/infer", json_infer([both])),
            400,
            "only one of",
        )
        np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.float32, [16]), A)
    finally:
        client.unregister_system_shared_memory("ref_r")
    assert_serving(port)


def test_client_shared_memory_can_be_disabled(main, regions):
    key, _ = regions("off_r", 64)
    small = httpclient.InferenceServerClient(f"127.0.0.1:{main.small_port}")
    try:
        error = client_error(small.register_system_shared_memory, "off_r", key, 64)
        assert error.status() == "400"
        assert error.message() == (
            "Client shared memory is disabled. Start the server with '--allow-client-shm=true' to enable."
        )
        x = httpclient.InferInput("INPUT0", [16], "FP32")
        x.set_shared_memory("off_r", 64)
        error = client_error(small.infer, "identity", [x])
        assert error.status() == "400" and "Client shared memory is disabled" in error.message()
        assert small.get_system_shared_memory_status() == []
        # Clean-up code unregisters everything first: nothing to do, not an error.
        small.unregister_system_shared_memory()
        small.unregister_system_shared_memory("off_r")
        small.unregister_cuda_shared_memory()
    finally:
        small.close()


@pytest.mark.skipif(dlserve.memory.cuda.device_count() > 0, reason="CUDA is here (tests/gpu)")
def test_cuda_shared_memory_without_cuda_gives_a_clear_error(client, port):
    # tritonclient expects the handle base64-encoded, as cuda_shared_memory.get_raw_handle gives it
    handle = base64.b64encode(b"\0" * 64)
    error = client_error(client.register_cuda_shared_memory, "cuda_r", handle, 0, 64)
    assert error.status() == "501"
    assert "CUDA shared memory is not available" in error.message()
    assert client.get_cuda_shared_memory_status() == []
    client.unregister_cuda_shared_memory()


def test_cuda_status_of_an_unknown_region_is_not_found(port):
    reply = request(port, "GET", "/v2/cudasharedmemory/region/nope/status")
    assert_error(reply, 404)
    assert reply.error == "Unable to find cuda shared memory region: 'nope'"


@pytest.mark.parametrize(
    "body",
    [
        {"raw_handle": {"b64": "AAAA"}, "device_id": "x", "byte_size": 64},
        {"raw_handle": {"b64": "AAAA"}, "device_id": 0, "byte_size": {"a": 1}},
        {"raw_handle": {"b64": "A"}, "device_id": 0, "byte_size": 64},
    ],
)
def test_malformed_cuda_register_is_a_client_error(port, body):
    reply = request(port, "POST", "/v2/cudasharedmemory/region/cuda_r/register", json.dumps(body))
    assert 400 <= reply.status < 500 and reply.status != 404, reply.body


# -- model control in EXPLICIT mode ------------------------------------------------------------
def test_explicit_mode_index_load_and_unload(explicit):
    c, port = explicit.client, explicit.port
    assert c.get_model_repository_index() == [
        {"name": "add_sub"},
        {"name": "identity"},
        {"name": "init_fail"},
    ]
    assert request(port, "POST", "/v2/repository/index", '{"ready": true}').json() == []
    assert not c.is_model_ready("identity")
    c.load_model("identity")
    assert c.is_model_ready("identity")
    assert request(port, "POST", "/v2/repository/index", '{"ready": true}').json() == [
        {"name": "identity", "version": "1", "state": "READY"}
    ]
    assert {"name": "add_sub"} in request(
        port, "POST", "/v2/repository/index", '{"ready": false}'
    ).json()
    x = httpclient.InferInput("INPUT0", [2], "FP32")
    x.set_data_from_numpy(np.array([1, 2], dtype=np.float32))
    assert c.infer("identity", [x]).as_numpy("OUTPUT0").tolist() == [1, 2]
    c.unload_model("identity")
    assert not c.is_model_ready("identity")
    error = client_error(c.infer, "identity", [x])
    assert error.status() == "404"
    error = client_error(c.load_model, "nope")
    assert error.status() in ("400", "404") and "nope" in error.message()
    assert_error(
        request(
            port,
            "POST",
            "/v2/repository/models/identity/unload",
            '{"parameters": {"unload_dependents": "x"}}',
        ),
        400,
        "unload_dependents",
    )


def test_unloaded_model_is_listed_as_unavailable(explicit):
    c = explicit.client
    c.load_model("add_sub")
    c.unload_model("add_sub")  # (answered once the unload began, as Triton's)

    def rows() -> list[dict[str, str]]:
        return [row for row in c.get_model_repository_index() if row["name"] == "add_sub"]

    wait_until(lambda: rows() != [{"name": "add_sub", "version": "1", "state": "UNLOADING"}])
    assert rows() == [
        {"name": "add_sub", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}
    ]


def test_failed_load_is_a_400(explicit):
    error = client_error(explicit.client.load_model, "init_fail")
    assert "cannot initialize: weights file is missing" in error.message()
    assert error.status() == "400"


def test_failed_load_is_reported_and_the_server_keeps_serving(explicit):
    error = client_error(explicit.client.load_model, "init_fail")
    assert "cannot initialize: weights file is missing" in error.message()
    assert not explicit.client.is_model_ready("init_fail")
    assert explicit.client.is_server_live()


def test_explicit_load_with_config_override(explicit):
    c = explicit.client
    config = json.dumps(
        {
            "backend": "python",
            "max_batch_size": 8,
            "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
            "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
        }
    )
    c.load_model("identity", config=config)
    try:
        assert c.get_model_config("identity")["max_batch_size"] == 8
        assert c.get_model_metadata("identity")["inputs"][0]["shape"] == [-1, -1]
        x = httpclient.InferInput("INPUT0", [2, 3], "FP32")
        batch = np.arange(6, dtype=np.float32).reshape(2, 3)
        x.set_data_from_numpy(batch)
        np.testing.assert_array_equal(c.infer("identity", [x]).as_numpy("OUTPUT0"), batch)
    finally:
        c.unload_model("identity")


def test_explicit_load_from_uploaded_files(explicit, tmp_path):
    c = explicit.client
    config = json.dumps(
        {
            "backend": "python",
            "input": [
                {"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [16]},
                {"name": "INPUT1", "data_type": "TYPE_FP32", "dims": [16]},
            ],
            "output": [
                {"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [16]},
                {"name": "OUTPUT1", "data_type": "TYPE_FP32", "dims": [16]},
            ],
        }
    )
    code = (MODELS / "add_sub" / "1" / "model.py").read_bytes()
    c.load_model("uploaded", config=config, files={"file:1/model.py": code})
    try:
        result = c.infer("uploaded", add_sub_inputs())
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)
    finally:
        c.unload_model("uploaded")
    # Uploaded paths stay inside the model folder; a bad upload is a client error.
    for files in ({"file:../escape.py": b"x = 1"}, {"file:/etc/evil.py": b"x = 1"}):
        error = client_error(
            c.load_model, "evil", config=json.dumps({"backend": "python"}), files=files
        )
        assert error.status() == "400", error
    assert not Path("/etc/evil.py").exists()
    reply = request(
        explicit.port,
        "POST",
        "/v2/repository/models/evil/load",
        json.dumps({"parameters": {"config": "{}", "file:1/model.py": "***not base64***"}}),
    )
    assert_error(reply, 400, "base64")
    reply = request(explicit.port, "POST", "/v2/repository/models/evil/load", '{"parameters": [1]}')
    assert_error(reply, 400, "parameters")


def test_model_names_cannot_traverse_paths(explicit, port):
    for path in ("/v2/repository/models/..%2Fx/load", "/v2/repository/models/..%2F..%2Fetc/load"):
        reply = request(explicit.port, "POST", path)
        assert 400 <= reply.status < 500, (path, reply.body)
    reply = request(explicit.port, "POST", "/v2/repository/models/%2E%2E/load")
    assert_error(reply, 400, "model name")
    for path in ("/v2/models/..%2F..%2Fetc/infer", "/v2/models/%2E%2E/infer"):
        reply = request(port, "POST", path, json_infer([identity_input()]))
        assert reply.status == 404, (path, reply.body)
    names = {row["name"] for row in explicit.client.get_model_repository_index()}
    assert names <= {"add_sub", "identity", "init_fail", "uploaded"}, names
    # Routed as sent, then decoded: %2F is part of a name, never a separator (as Triton).
    assert request(port, "GET", "/v2/models/identity%2Fready").status == 404
    assert request(port, "GET", "/v2/models/identity%2Fconfig").status == 404
    assert request(port, "GET", "/v2/models/%69dentity/ready").status == 200  # tritonclient quotes names
    assert_serving(port)


# ==========================================================================================
# Inference
# ==========================================================================================
def test_infer_json_in_json_out(client):
    outputs = [
        httpclient.InferRequestedOutput(n, binary_data=False) for n in ("OUTPUT0", "OUTPUT1")
    ]
    result = client.infer("add_sub", add_sub_inputs((False, False)), outputs=outputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)
    assert result.get_output("OUTPUT0")["data"] == (A + B).tolist()
    assert result.get_response()["model_version"] == "1"


def test_infer_binary_and_json_mixed_on_the_wire(port):
    body, header_length = binary_infer_body(
        [("INPUT0", "FP32", [16], fp32(A), None), ("INPUT1", "FP32", [16], None, B.tolist())],
        outputs=[{"name": "OUTPUT0", "parameters": {"binary_data": True}}, {"name": "OUTPUT1"}],
    )
    reply = request(
        port,
        "POST",
        "/v2/models/add_sub/infer",
        body,
        {
            "Inference-Header-Content-Length": str(header_length),
            "Content-Type": "application/octet-stream",
        },
    )
    assert reply.status == 200, reply.body
    assert reply.headers["content-type"] == "application/octet-stream"
    header, blobs = split_binary_response(reply)
    assert int(reply.headers["inference-header-content-length"]) == len(
        json.dumps(header, separators=(",", ":"))
    )
    out0, out1 = header["outputs"]
    assert out0 == {
        "name": "OUTPUT0",
        "datatype": "FP32",
        "shape": [16],
        "parameters": {"binary_data_size": 64},
    }
    assert out1["data"] == (A - B).tolist() and "parameters" not in out1
    assert blobs == {"OUTPUT0": fp32(A + B)}


def test_binary_inputs_with_json_outputs_get_a_json_reply(port):
    body, header_length = binary_infer_body(
        [("INPUT0", "FP32", [16], fp32(A), None), ("INPUT1", "FP32", [16], fp32(B), None)],
    )
    reply = request(
        port,
        "POST",
        "/v2/models/add_sub/infer",
        body,
        {"Inference-Header-Content-Length": str(header_length)},
    )
    assert reply.status == 200
    assert reply.headers["content-type"] == "application/json"
    assert "inference-header-content-length" not in reply.headers
    assert [o["data"] for o in reply.json()["outputs"]] == [(A + B).tolist(), (A - B).tolist()]


def test_binary_outputs_of_no_bytes_get_a_json_reply(port):
    """As Triton 2.51 (side by side): nothing binary to send, so no binary framing."""
    body = json.dumps({
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [0], "data": []}],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
    })
    reply = request(port, "POST", "/v2/models/identity/infer", body)
    assert reply.status == 200, reply.body
    assert reply.headers["content-type"] == "application/json"
    assert "inference-header-content-length" not in reply.headers
    (output,) = reply.json()["outputs"]
    assert output["shape"] == [0] and output["parameters"] == {"binary_data_size": 0}


def test_binary_data_output_request_parameter(port, client):
    body = json_infer(
        [identity_input((1.0, 2.0, 3.0))],
        parameters={"binary_data_output": True},
    )
    reply = request(port, "POST", "/v2/models/identity/infer", body)
    header, blobs = split_binary_response(reply)
    assert header["outputs"][0]["parameters"] == {"binary_data_size": 12}
    assert blobs["OUTPUT0"] == fp32([1, 2, 3])
    # A per-output binary_data=false overrides the request-level default.
    body = json_infer(
        [identity_input((1.0, 2.0))],
        parameters={"binary_data_output": True},
        outputs=[{"name": "OUTPUT0", "parameters": {"binary_data": False}}],
    )
    reply = request(port, "POST", "/v2/models/identity/infer", body)
    assert reply.headers["content-type"] == "application/json"
    assert reply.json()["outputs"][0]["data"] == [1.0, 2.0]
    # tritonclient's default: binary outputs, parsed back into arrays.
    result = client.infer(
        "add_sub", add_sub_inputs(), outputs=[httpclient.InferRequestedOutput("OUTPUT1")]
    )
    assert [o["name"] for o in result.get_response()["outputs"]] == ["OUTPUT1"]
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)


def test_request_id_is_echoed(client, port):
    result = client.infer("add_sub", add_sub_inputs(), request_id="my-req-1")
    assert result.get_response()["id"] == "my-req-1"
    result = client.infer("add_sub", add_sub_inputs())
    assert "id" not in result.get_response()
    reply = request(
        port, "POST", "/v2/models/identity/infer", json_infer([identity_input()], id="")
    )
    assert list(reply.json()) == ["model_name", "model_version", "outputs"]
    assert_error(
        request(port, "POST", "/v2/models/identity/infer", json_infer([identity_input()], id=5)),
        400,
        "'id'",
    )
    error = client_error(client.infer, "add_sub", add_sub_inputs()[:1], request_id="rid-9")
    assert error.message().startswith("[request id: rid-9] expected 2 inputs but got 1 inputs")


def test_parameters_reach_the_model_and_response_parameters_come_back(client):
    x = httpclient.InferInput("INPUT0", [2], "FP32")
    x.set_data_from_numpy(np.array([1, 2], dtype=np.float32))
    result = client.infer(
        "params_echo",
        [x],
        request_id="rid-42",
        parameters={"p_int": 5, "p_str": "sé", "p_bool": True, "p_float": 1.5, "p_neg": -(2**40)},
    )
    info = json.loads(result.as_numpy("INFO")[0])
    assert info["parameters"] == {
        "p_int": 5,
        "p_str": "sé",
        "p_bool": True,
        "p_float": 1.5,
        "p_neg": -(2**40),
    }
    # (text as UTF-8, not \u escapes, as Triton's core writes it)
    assert info["parameters_text"] == '{"p_int":5,"p_str":"sé","p_bool":true,"p_float":1.5,"p_neg":-1099511627776}'
    assert info["request_id"] == "rid-42"
    assert info["requested_output_names"] == ["INFO", "OUTPUT0"]
    assert result.get_response()["parameters"] == {
        "echoed": True,
        "count": 1,
        "model": "params_echo",
    }
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [2, 4])


def test_headers_parameter_reaches_the_model_and_binary_data_output_does_not(port):
    """As Triton 2.51 does (measured side by side): its documentation reserves both
    names, but it hands ``headers`` to the model and consumes ``binary_data_output``,
    which it reads only when no outputs are listed."""
    body = json_infer(
        [{"name": "INPUT0", "shape": [2], "datatype": "FP32", "data": [1, 2]}],
        parameters={"headers": "h", "binary_data_output": True, "x": 1},
        outputs=[{"name": "INFO"}],
    )
    reply = request(port, "POST", "/v2/models/params_echo/infer", body)
    assert reply.status == 200 and reply.headers["content-type"] == "application/json"
    info = json.loads(reply.json()["outputs"][0]["data"][0])
    assert info["parameters"] == {"headers": "h", "x": 1}


def test_reserved_parameters_are_consumed(client):
    x = httpclient.InferInput("INPUT0", [2], "FP32")
    x.set_data_from_numpy(np.array([1, 2], dtype=np.float32))
    result = client.infer(
        "params_echo",
        [x],
        sequence_id=7,
        sequence_start=True,
        priority=1,
        timeout=123456,
        outputs=[httpclient.InferRequestedOutput("INFO")],
    )
    info = json.loads(result.as_numpy("INFO")[0])
    assert info["parameters"] == {}
    assert (info["correlation_id"], info["flags"], info["timeout"]) == (7, 1, 123456)
    assert info["requested_output_names"] == ["INFO"]
    result = client.infer("params_echo", [x], sequence_id="session-a", sequence_end=True)
    info = json.loads(result.as_numpy("INFO")[0])
    assert (info["correlation_id"], info["flags"]) == ("session-a", 2)


@pytest.mark.parametrize(
    "parameters,fragment",
    [
        ({"obj": {"a": 1}}, "'obj'"),
        ({"lst": [1, 2]}, "'lst'"),
        ({"nothing": None}, "'nothing'"),
        ({"priority": "high"}, "'priority'"),
        ({"priority": -1}, "'priority'"),
        ({"timeout": 1.5}, "'timeout'"),
        ({"timeout": True}, "'timeout'"),
        ({"sequence_id": 1.5}, "'sequence_id'"),
        ("not an object", "'parameters'"),
    ],
)
def test_parameters_of_bad_types_are_refused(port, parameters, fragment):
    body = json_infer([identity_input()], parameters=parameters)
    assert_error(request(port, "POST", "/v2/models/params_echo/infer", body), 400, fragment)


DTYPES = [
    ("BOOL", np.array([[True, False, True]])),
    ("UINT8", np.array([[0, 7, 255]], dtype=np.uint8)),
    ("UINT16", np.array([[0, 7, 65535]], dtype=np.uint16)),
    ("UINT32", np.array([[0, 7, 2**32 - 1]], dtype=np.uint32)),
    ("UINT64", np.array([[0, 7, 2**64 - 1]], dtype=np.uint64)),
    ("INT8", np.array([[-128, 0, 127]], dtype=np.int8)),
    ("INT16", np.array([[-(2**15), 0, 2**15 - 1]], dtype=np.int16)),
    ("INT32", np.arange(-3, 3, dtype=np.int32).reshape(2, 3)),
    ("INT64", np.array([[-(2**63), 0, 2**63 - 1]], dtype=np.int64)),
    ("FP16", np.array([[1.5, -2.25, 65504]], dtype=np.float16)),
    ("FP32", np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2)),
    ("FP64", np.array([[np.pi, -np.e, 1e300]], dtype=np.float64)),
    ("BF16", np.array([[1.5, -2.25, 3.0]], dtype=ml_dtypes.bfloat16)),
    ("BYTES", np.array([[b"hello", b"", b"\x00\xff\xfe"]], dtype=np.object_)),
]


@pytest.mark.parametrize("name,array", DTYPES, ids=[d[0] for d in DTYPES])
def test_every_dtype_round_trips_binary(client, name, array):
    suffix = "STRING" if name == "BYTES" else name
    x = httpclient.InferInput(f"IN_{suffix}", list(array.shape), name)
    x.set_data_from_numpy(array, binary_data=True)
    result = client.infer("dtypes_echo", [x])
    out = result.get_output(f"OUT_{suffix}")
    assert out["datatype"] == name and out["shape"] == list(array.shape)
    got = result.as_numpy(f"OUT_{suffix}")
    assert got.dtype == array.dtype
    if name == "BYTES":
        assert got.tolist() == array.tolist()
    else:
        assert got.tobytes() == array.tobytes()


def test_bf16_travels_as_its_uint16_bits(port):
    array = np.array([[1.5, -2.25, 3.0, -0.0]], dtype=ml_dtypes.bfloat16)
    bits = array.view(np.uint16)
    body, header_length = binary_infer_body(
        [("IN_BF16", "BF16", [1, 4], bits.tobytes(), None)], parameters={"binary_data_output": True}
    )
    reply = request(
        port,
        "POST",
        "/v2/models/dtypes_echo/infer",
        body,
        {"Inference-Header-Content-Length": str(header_length)},
    )
    header, blobs = split_binary_response(reply)
    assert header["outputs"][0]["datatype"] == "BF16"
    assert np.frombuffer(blobs["OUT_BF16"], dtype=np.uint16).tolist() == bits.reshape(-1).tolist()
    # Half-precision types travel as JSON numbers too, both ways (the KServe v2 protocol
    # allows it; Triton refuses both directions): rounded to the type on the way in.
    for datatype in ("BF16", "FP16"):
        body = json_infer(
            [{"name": f"IN_{datatype}", "datatype": datatype, "shape": [1, 3],
              "data": [1.5, -2.25, 0.1]}],
            outputs=[{"name": f"OUT_{datatype}"}],
        )
        reply = request(port, "POST", "/v2/models/dtypes_echo/infer", body)
        assert reply.status == 200, reply.body
        output = json.loads(reply.body)["outputs"][0]
        assert output["datatype"] == datatype and output["shape"] == [1, 3]
        half = numpy_dtype(DataType[datatype])
        rounded = np.array([1.5, -2.25, 0.1], dtype=half)
        assert np.array(output["data"], dtype=half).tobytes() == rounded.tobytes()
        assert output["data"][2] != 0.1  # (0.1 has no exact half-precision value)


@pytest.mark.parametrize(
    "name,array",
    [d for d in DTYPES if d[0] not in ("FP16", "BF16")],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_json_dtypes_round_trip(client, name, array):
    suffix = "STRING" if name == "BYTES" else name
    if name == "UINT64":  # values >= 2**63 next to small ones: see the xfail test below
        array = np.array([[0, 7, 2**63 - 1]], dtype=np.uint64)
    if name == "BYTES":
        array = np.array([["hello", "", "\u00fcn\u00ef"]], dtype=np.object_)
    x = httpclient.InferInput(f"IN_{suffix}", list(array.shape), name)
    x.set_data_from_numpy(array, binary_data=False)
    result = client.infer(
        "dtypes_echo",
        [x],
        outputs=[httpclient.InferRequestedOutput(f"OUT_{suffix}", binary_data=False)],
    )
    got = result.as_numpy(f"OUT_{suffix}")
    if name == "BYTES":
        assert [
            v.decode() if isinstance(v, bytes) else v for v in got.reshape(-1)
        ] == array.reshape(-1).tolist()
    else:
        np.testing.assert_array_equal(got, array)


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
@pytest.mark.parametrize(
    "name,datatype,data",
    [
        ("IN_UINT8", "UINT8", [-1, 2]),
        ("IN_INT32", "INT32", [1.5, 2]),
        ("IN_FP32", "FP32", [True, 2.0]),
        ("IN_INT64", "INT64", [2**70, 1]),
    ],
    ids=["negative-unsigned", "float-in-int", "bool-in-float", "int64-overflow"],
)
def test_json_values_that_do_not_fit_the_datatype_are_refused(port, name, datatype, data):
    body = json_infer([{"name": name, "datatype": datatype, "shape": [1, 2], "data": data}])
    reply = request(port, "POST", "/v2/models/dtypes_echo/infer", body)
    assert 400 <= reply.status < 500, reply.body


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("data", [[0, 7, 2**64 - 1], [2**63 + 1, 1, 2]])
def test_json_uint64_values_are_exact(client, data):
    array = np.array([data], dtype=np.uint64)
    x = httpclient.InferInput("IN_UINT64", list(array.shape), "UINT64")
    x.set_data_from_numpy(array, binary_data=False)
    result = client.infer(
        "dtypes_echo",
        [x],
        outputs=[httpclient.InferRequestedOutput("OUT_UINT64", binary_data=False)],
    )
    assert result.as_numpy("OUT_UINT64").tolist() == array.tolist()


@pytest.mark.parametrize("datatype", ["FP32", "FP64"])
def test_nan_and_infinities_round_trip_as_json(client, port, datatype):
    """Spelled NaN / Infinity / -Infinity both ways, as Triton and tritonclient do (orjson
    alone writes them as null and refuses to read them)."""
    array = np.array([[np.nan, np.inf, -np.inf, 1.5]], dtype=np.float32 if datatype == "FP32" else np.float64)
    x = httpclient.InferInput(f"IN_{datatype}", [1, 4], datatype)
    x.set_data_from_numpy(array, binary_data=False)
    result = client.infer(
        "dtypes_echo", [x], outputs=[httpclient.InferRequestedOutput(f"OUT_{datatype}", binary_data=False)]
    )
    np.testing.assert_array_equal(result.as_numpy(f"OUT_{datatype}"), array)
    reply = request(port, "POST", "/v2/models/dtypes_echo/infer", json_infer(
        [{"name": f"IN_{datatype}", "datatype": datatype, "shape": [1, 4], "data": [1, 2, 3, 4]}]))
    assert reply.status == 200 and b"null" not in reply.body  # finite values: orjson's path


def test_bytes_through_json_and_binary(client, port):
    x = httpclient.InferInput("INPUT0", [3], "BYTES")
    x.set_data_from_numpy(np.array(["abc", "d\u00e9f", ""], dtype=np.object_), binary_data=False)
    result = client.infer(
        "bytes_model", [x], outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)]
    )
    assert result.get_output("OUTPUT0")["data"] == ["ABC", "D\u00e9F", ""]
    def post_binary(body: bytes, header_length: int) -> Reply:
        headers = {"Inference-Header-Content-Length": str(header_length)}
        return request(port, "POST", "/v2/models/bytes_model/infer", body, headers)

    # Binary in, binary out, bytes that are not UTF-8 included.
    values = [b"xy", b"\x00\xff\x01", b""]
    reply = post_binary(*binary_infer_body(
        [("INPUT0", "BYTES", [3], bytes_tensor(values), None)],
        outputs=[{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
    ))
    _, blobs = split_binary_response(reply)
    assert blobs["OUTPUT0"] == bytes_tensor([b"XY", b"\x00\xff\x01", b""])
    # A binary BYTES tensor whose data ends inside an element is refused, in Triton 2.51's
    # words (side by side)
    cases = [
        (b"\x10\x00\x00\x00abc", "incomplete string data for inference input 'INPUT0', "
         "expecting string of length 16 but only 3 bytes available"),
        (bytes_tensor([b"ab"]) + b"\x01\x00\x00", "incomplete string length indicator for "
         "inference input 'INPUT0' for model 'bytes_model', expecting 4 bytes but only 3 bytes "
         "available. Please make sure the string length indicator is in one buffer."),
    ]
    for data, message in cases:
        reply = post_binary(*binary_infer_body([("INPUT0", "BYTES", [1], data, None)]))
        assert_error(reply, 400, message)
    body = json_infer([{"name": "INPUT0", "datatype": "BYTES", "shape": [2], "data": ["a", 1]}])
    assert_error(request(port, "POST", "/v2/models/bytes_model/infer", body), 400, "INPUT0")
    assert_serving(port)


def test_large_binary_tensor(client):
    data = np.random.default_rng(7).standard_normal(4 << 20).astype(np.float32)  # 16 MiB
    x = httpclient.InferInput("INPUT0", [data.size], "FP32")
    x.set_data_from_numpy(data)
    result = client.infer("identity", [x])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data)


@pytest.mark.parametrize("count", [1025, 2000, 100_000])
def test_model_returns_a_json_input_by_reference(port, count):
    """Above the inline size the input is copied into the server's arena and leased to
    the worker; identity hands it back by reference after releasing its own views, so
    the server must still hold it when the reply is read (a past race: 500 'no longer held')."""
    values = [float(i) for i in range(count)]
    reply = request(port, "POST", "/v2/models/identity/infer", json_infer([identity_input(values)]))
    assert reply.status == 200, reply.body
    assert json.loads(reply.body)["outputs"][0]["data"] == values


def test_large_binary_tensor_on_a_raw_connection(port):
    """A body above the direct-read threshold lands in shared memory; the next request
    on the same connection, sent in the same write, is parsed normally."""
    data = np.arange(1 << 18, dtype=np.float32)  # 1 MiB
    big, big_length = binary_infer_body(
        [("INPUT0", "FP32", [data.size], data.tobytes(), None)],
        parameters={"binary_data_output": True},
    )
    small = json_infer([identity_input((9.0,))], id="after")
    stream = http_request(
        "POST",
        "/v2/models/identity/infer",
        big,
        {"Inference-Header-Content-Length": str(big_length)},
    )
    stream += http_request("POST", "/v2/models/identity/infer", small.encode())
    stream += http_request("GET", "/v2/health/live", headers={"Connection": "close"})
    received, closed = exchange(port, stream, timeout=10)
    first, second, third = parse_responses(received)
    _, blobs = split_binary_response(first)
    assert blobs["OUTPUT0"] == data.tobytes()
    assert second.json()["id"] == "after" and second.json()["outputs"][0]["data"] == [9.0]
    assert third.status == 200 and closed


@pytest.mark.parametrize(
    "request_algorithm,response_algorithm",
    [("gzip", None), ("deflate", None), (None, "gzip"), (None, "deflate"), ("gzip", "deflate")],
)
def test_compressed_bodies_through_tritonclient(client, request_algorithm, response_algorithm):
    result = client.infer(
        "add_sub",
        add_sub_inputs((True, False)),
        request_compression_algorithm=request_algorithm,
        response_compression_algorithm=response_algorithm,
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)


def test_compression_on_the_wire(port):
    body, header_length = binary_infer_body(
        [("INPUT0", "FP32", [16], fp32(A), None), ("INPUT1", "FP32", [16], fp32(B), None)],
        outputs=[{"name": "OUTPUT0", "parameters": {"binary_data": True}}, {"name": "OUTPUT1"}],
    )
    plain = request(
        port,
        "POST",
        "/v2/models/add_sub/infer",
        body,
        {"Inference-Header-Content-Length": str(header_length)},
    )
    for encoding, compress, decompress in (
        ("gzip", gzip.compress, gzip.decompress),
        ("deflate", zlib.compress, zlib.decompress),
    ):
        reply = request(
            port,
            "POST",
            "/v2/models/add_sub/infer",
            compress(body),
            {
                "Inference-Header-Content-Length": str(header_length),
                "Content-Encoding": encoding,
                "Accept-Encoding": encoding,
            },
        )
        assert reply.status == 200
        assert reply.headers["content-encoding"] == encoding
        assert (
            reply.headers["inference-header-content-length"]
            == plain.headers["inference-header-content-length"]
        )
        assert decompress(reply.body) == plain.body
    # Weights as Triton reads them: q=0 refuses a coding; the heavier one wins, the first
    # listed of equals.
    for accept, expected in (("gzip;q=0, identity", None), ("deflate;q=0.5, gzip;q=0.1", "deflate"),
                             ("gzip;q=0, deflate", "deflate"), ("identity", None), ("GZIP", "gzip"),
                             ("deflate, gzip", "deflate"), ("gzip, deflate", "gzip")):
        reply = request(port, "POST", "/v2/models/add_sub/infer", body,
                        {"Inference-Header-Content-Length": str(header_length), "Accept-Encoding": accept})
        assert reply.status == 200 and reply.headers.get("content-encoding") == expected, accept
        assert (zlib.decompress(reply.body, 47) if expected else reply.body) == plain.body
    for encoding, data, status in (
        ("gzip", b"not gzip", 400),
        ("br", b"x", 501),  # (Triton's status)
        ("deflate", b"\x78\x9c garbage", 400),
    ):
        reply = request(
            port, "POST", "/v2/models/add_sub/infer", data, {"Content-Encoding": encoding}
        )
        assert_error(reply, status)
    # Cut short (its checksum and size missing): refused, not taken as it came.
    whole = json_infer([identity_input((1.0,))]).encode()
    for encoding, compress in (("gzip", gzip.compress), ("deflate", zlib.compress)):
        reply = request(port, "POST", "/v2/models/identity/infer", compress(whole)[:-4],
                        {"Content-Encoding": encoding})
        assert_error(reply, 400, "ends before its compressed data does")
        assert reply.body.startswith(b'{"error":"cannot decode')  # (compact, as every answer)
    assert_serving(port)


def test_decompression_is_capped_by_the_max_input_size(main):
    bomb = gzip.compress(b"\0" * (4 * SMALL_MAX))
    assert len(bomb) < SMALL_MAX
    reply = request(
        main.small_port, "POST", "/v2/models/identity/infer", bomb, {"Content-Encoding": "gzip"}
    )
    assert_error(reply, 413, "exceeds the maximum")
    assert_serving(main.small_port)


def test_keep_alive_serves_many_requests_on_one_connection(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        local = None
        for i in range(6):
            body = json_infer([identity_input((float(i),))], id=f"k{i}")
            conn.request("POST", "/v2/models/identity/infer", body=body)
            response = conn.getresponse()
            data = json.loads(response.read())
            assert (
                response.status == 200
                and data["id"] == f"k{i}"
                and data["outputs"][0]["data"] == [float(i)]
            )
            assert response.getheader("Connection") != "close"
            local = local or conn.sock.getsockname()
            assert conn.sock.getsockname() == local, "the server closed a keep-alive connection"
        conn.request("GET", "/v2/models/nope")  # an error does not end the connection either
        response = conn.getresponse()
        response.read()
        assert response.status == 404 and conn.sock.getsockname() == local
    finally:
        conn.close()


def test_pipelined_requests_are_answered_in_order(port):
    stream = b""
    expected = []
    for i in range(8):
        if i == 3:
            stream += http_request("GET", "/v2/models/add_sub/infer")
            expected.append(("405", None))
        elif i == 5:
            stream += http_request("GET", "/v2/health/ready")
            expected.append(("200", None))
        body = json_infer(
            [identity_input((float(i), float(-i)))], id=f"p{i}", parameters={"mode": "ok"}
        )
        model = "faulty" if i % 2 else "identity"
        stream += http_request("POST", f"/v2/models/{model}/infer", body.encode())
        expected.append(("200", f"p{i}"))
    stream += http_request("GET", "/v2/health/live", headers={"Connection": "close"})
    expected.append(("200", None))
    received, closed = exchange(port, stream, timeout=10)
    replies = parse_responses(received)
    assert closed
    assert [
        (str(r.status), r.json().get("id") if r.body and r.status == 200 else None) for r in replies
    ] == expected


def test_many_pipelined_requests_and_a_slow_reader(port):
    """More requests than the connection queues before it pauses reading, then large
    responses the client does not read for a while: all arrive, complete and in order."""
    stream = b"".join(
        http_request(
            "POST",
            "/v2/models/identity/infer",
            json_infer([identity_input((float(i),))], id=f"q{i}").encode(),
        )
        for i in range(60)
    )
    received, _ = exchange(
        port, stream + http_request("GET", "/v2/health/live", headers={"Connection": "close"})
    )
    replies = parse_responses(received)
    assert [r.json()["id"] for r in replies[:-1]] == [f"q{i}" for i in range(60)]
    data = np.arange(1 << 20, dtype=np.float32)  # 4 MiB out per request
    body, length = binary_infer_body(
        [("INPUT0", "FP32", [data.size], data.tobytes(), None)],
        parameters={"binary_data_output": True},
    )
    one = http_request(
        "POST", "/v2/models/identity/infer", body, {"Inference-Header-Content-Length": str(length)}
    )
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(10)
    try:
        sock.sendall(one * 3)
        time.sleep(0.3)  # the server's writes back up meanwhile
        received = b""
        while len(parse_responses(received, strict=False)) < 3:
            chunk = sock.recv(1 << 20)
            assert chunk, "connection closed early"
            received += chunk
    finally:
        sock.close()
    for reply in parse_responses(received):
        assert split_binary_response(reply)[1]["OUTPUT0"] == data.tobytes()


def test_http_1_0_closes_after_the_response(port):
    received, closed = exchange(port, b"GET /v2/health/live HTTP/1.0\r\n\r\n")
    (reply,) = parse_responses(received)
    assert reply.status == 200 and closed
    # ...unless it asks to keep it, and then it is told so (ApacheBench -k waits for it)
    keep = b"GET /v2/health/live HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"
    received, closed = exchange(port, keep + b"GET /v2/health/live HTTP/1.0\r\n\r\n")
    first, second = parse_responses(received)
    assert first.headers.get("connection") == "keep-alive" and second.headers.get("connection") == "close"
    assert closed


def test_aio_client(main):
    async def run():
        async with aioclient.InferenceServerClient(main.url) as c:
            assert await c.is_server_live() and await c.is_server_ready()
            assert await c.is_model_ready("add_sub")
            inputs = []
            for name, value in (("INPUT0", A), ("INPUT1", B)):
                item = aioclient.InferInput(name, [16], "FP32")
                item.set_data_from_numpy(value)
                inputs.append(item)
            results = await asyncio.gather(
                *[c.infer("add_sub", inputs, request_id=str(i)) for i in range(16)]
            )
            assert [r.get_response()["id"] for r in results] == [str(i) for i in range(16)]
            for r in results:
                np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), A + B)
            r = await c.infer(
                "add_sub",
                inputs,
                request_compression_algorithm="gzip",
                response_compression_algorithm="gzip",
            )
            np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), A - B)
            with pytest.raises(InferenceServerException) as info:
                await c.infer("nope", inputs)
            assert info.value.status() == "404"

    asyncio.run(run())


def test_aio_client_metadata_calls(main):
    async def run():
        async with aioclient.InferenceServerClient(main.url) as c:
            assert (await c.get_server_metadata())["name"] == "dlserve"
            assert (await c.get_model_metadata("add_sub"))["name"] == "add_sub"
            assert (await c.get_model_config("add_sub"))["max_batch_size"] == 0
            assert (await c.get_inference_statistics("add_sub"))["model_stats"][0][
                "name"
            ] == "add_sub"
            assert await c.get_system_shared_memory_status() == []

    asyncio.run(run())


def test_only_successful_infer_responses_are_compressed(main, port):
    """As Triton: metadata and errors go uncompressed whatever the client accepts, so
    tritonclient's aio client (which decompresses only successful infer answers, as
    aiohttp asks for gzip by default) reads a model's error."""
    reply = request(port, "GET", "/v2/models/add_sub", headers={"Accept-Encoding": "gzip, deflate"})
    assert reply.status == 200 and "content-encoding" not in reply.headers
    assert reply.json()["name"] == "add_sub"
    body = json.dumps({
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1], "data": [1.0]}],
        "parameters": {"mode": "error:INVALID_ARG"},
    }).encode()
    reply = request(port, "POST", "/v2/models/faulty/infer", body, {"Accept-Encoding": "gzip, deflate"})
    assert reply.status == 400 and "content-encoding" not in reply.headers
    assert reply.json() == {"error": "custom error"}

    async def run():
        async with aioclient.InferenceServerClient(main.url) as c:
            x = aioclient.InferInput("INPUT0", [1], "FP32")
            x.set_data_from_numpy(np.ones(1, dtype=np.float32))
            with pytest.raises(InferenceServerException) as info:
                await c.infer("faulty", [x], parameters={"mode": "error:INVALID_ARG"})
            assert (info.value.status(), info.value.message()) == ("400", "custom error")

    asyncio.run(run())


# ==========================================================================================
# Errors: statuses and texts
# ==========================================================================================
# Recorded Triton cases dlserve answers byte for byte the same (status and body).
SAME_AS_TRITON = [
    "add_sub ok (json)",
    "add_sub ok with id + parameters",
    "add_sub ok, outputs requested with binary_data=true",
    "add_sub ok, request-level binary_data_output=true",
    "add_sub ok, only OUTPUT1 requested",
    "add_sub ok, versioned path /versions/1",
    "add_sub ok, binary input",
    "add_sub ok, nested data list [[..]] for shape [16]",
    "add_sub ok, integer JSON values in FP32 data",
    "unknown model infer",
    "unknown version infer",
    "wrong datatype (INT32 for FP32 input)",
    "wrong shape ([2,8] for [16])",
    "wrong shape ([8] with 8 elems for [16])",
    "missing input",
    "unknown datatype string",
    "input missing 'data'",
    "unknown output requested",
    "duplicate input name",
    "ready add_sub",
    "ready nope",
    "ready add_sub version 7",
    "ready add_sub version 1",
    "metadata nope",
    "config nope",
    "metadata add_sub version 7",
    "stats unknown model",
    "GET on infer path",
    "PUT on infer path",
    "POST on metadata path",
    "unknown path",
    "unknown path /",
    "health live",
    "index GET (not POST)",
]


def _recorded_body(text: str) -> bytes:
    return ast.literal_eval(text) if text.startswith("b'") else text.encode()


@pytest.mark.parametrize("label", SAME_AS_TRITON)
def test_same_answer_as_triton(port, label):
    case = TRITON_CASES[label]
    headers = dict(case["request_headers"])
    body = case["request_body"]
    if label == "add_sub ok, binary input":  # recorded lossily: rebuild the binary tail
        length = int(headers["Inference-Header-Content-Length"])
        payload = body[:length].encode() + np.arange(16, dtype=np.float32).tobytes()
    else:
        payload = body.encode() if body is not None else None
    reply = request(port, case["method"], case["path"], payload, headers)
    assert reply.status == case["status"]
    assert reply.body == _recorded_body(case["response_body"])
    recorded = {k.lower(): v for k, v in case["response_headers"]}
    if "inference-header-content-length" in recorded:
        assert (
            reply.headers["inference-header-content-length"]
            == recorded["inference-header-content-length"]
        )


@pytest.mark.parametrize(
    "label,fragment",
    [
        ("wrong number of elements in data (15 for shape [16])", "15 elements"),
        ("too many elements in data (17 for shape [16])", "17 elements"),
        ("string in FP32 data", "INPUT0"),
        ("malformed JSON", "failed to parse the request JSON buffer"),
        ("JSON without inputs", "Unable to parse 'inputs'"),
        ("empty body", ""),
        ("unexpected extra input", "INPUT9"),
    ],
)
def test_recorded_client_mistakes_are_400(port, label, fragment):
    """Recorded cases where dlserve deliberately differs from Triton: Triton answers 500
    for the first five (blaming itself for a client's mistake) and other texts for the
    last two; dlserve answers 400 with its own message."""
    case = TRITON_CASES[label]
    reply = request(
        port,
        case["method"],
        case["path"],
        (case["request_body"] or "").encode(),
        case["request_headers"],
    )
    assert_error(reply, 400, fragment)


def test_unknown_model_and_version_through_tritonclient(client):
    error = client_error(client.infer, "nope", add_sub_inputs())
    assert (error.status(), error.message()) == (
        "404",
        "Request for unknown model: 'nope' is not found",
    )
    error = client_error(client.infer, "add_sub", add_sub_inputs(), model_version="7")
    assert (error.status(), error.message()) == (
        "404",
        "Request for unknown model: 'add_sub' version 7 is not found",
    )
    error = client_error(client.get_model_metadata, "nope")
    assert (error.status(), error.message()) == (
        "404",
        "Request for unknown model: 'nope' is not found",
    )
    error = client_error(client.get_model_config, "add_sub", "7")
    assert error.status() == "404"


def test_input_errors_through_tritonclient(client):
    wrong_type = httpclient.InferInput("INPUT0", [16], "INT32")
    wrong_type.set_data_from_numpy(np.arange(16, dtype=np.int32))
    error = client_error(client.infer, "add_sub", [wrong_type, add_sub_inputs()[1]])
    assert (error.status(), error.message()) == (
        "400",
        "[request id: <id_unknown>] inference input 'INPUT0' data-type is 'INT32', but model 'add_sub' expects 'FP32'",
    )
    wrong_shape = httpclient.InferInput("INPUT0", [2, 8], "FP32")
    wrong_shape.set_data_from_numpy(A.reshape(2, 8))
    error = client_error(client.infer, "add_sub", [wrong_shape, add_sub_inputs()[1]])
    assert error.message() == (
        "[request id: <id_unknown>] unexpected shape for input 'INPUT0' for model 'add_sub'. "
        "Expected [16], got [2,8]. "
    )
    error = client_error(
        client.infer,
        "add_sub",
        add_sub_inputs(),
        outputs=[httpclient.InferRequestedOutput("OUTPUT9")],
    )
    assert (error.status(), error.message()) == (
        "400",
        "unexpected inference output 'OUTPUT9' for model 'add_sub'",
    )


@pytest.mark.parametrize(
    "code,status",
    [
        ("NOT_FOUND", 404),
        ("INVALID_ARG", 400),
        ("UNAVAILABLE", 503),
        ("UNSUPPORTED", 501),
        ("INTERNAL", 500),
        ("ALREADY_EXISTS", 400),
        ("UNKNOWN", 400),
        ("CANCELLED", 400),
    ],
)
def test_per_request_error_codes(client, code, status):
    x = httpclient.InferInput("INPUT0", [2], "FP32")
    x.set_data_from_numpy(np.ones(2, dtype=np.float32))
    error = client_error(client.infer, "faulty", [x], parameters={"mode": f"error:{code}"})
    assert (error.status(), error.message()) == (str(status), "custom error")


def test_execute_exceptions_are_500(client, port):
    x = httpclient.InferInput("INPUT0", [2], "FP32")
    x.set_data_from_numpy(np.ones(2, dtype=np.float32))
    error = client_error(client.infer, "faulty", [x], parameters={"mode": "raise"})
    assert error.status() == "500"
    assert error.message().startswith(
        "Failed to process the request(s) for model 'faulty_0', message: ValueError: boom"
    )
    error = client_error(client.infer, "faulty", [x], parameters={"mode": "not_list"})
    assert error.message() == (
        "Failed to process the request(s) for model 'faulty_0', message: Expected a list in the "
        "execute return, found type '<class 'dict'>'."
    )
    error = client_error(client.infer, "faulty", [x], parameters={"mode": "wrong_length"})
    assert (
        error.status() == "500"
        and "Number of InferenceResponse objects do not match" in error.message()
    )
    assert client.infer("faulty", [x], parameters={"mode": "ok"}).as_numpy("OUTPUT0").tolist() == [
        1,
        1,
    ]


@pytest.mark.parametrize(
    "method,path,status",
    [
        ("GET", "/v2/foo", 404),
        ("GET", "/", 404),
        ("GET", "/v2/models", 404),
        ("GET", "/v2/trace/settings", 404),
        ("PUT", "/v2/trace/setting", 405),
        ("POST", "/v2/health/live", 405),
        ("DELETE", "/v2/models/add_sub", 405),
        ("GET", "/v2/models/add_sub/infer", 405),
        ("PUT", "/v2/models/add_sub/infer", 405),
        ("HEAD", "/v2/health/live", 405),
        ("GET", "/v2/repository/models/add_sub/load", 405),
        ("GET", "/v2/systemsharedmemory/region/r/register", 405),
        ("POST", "/v2/systemsharedmemory/status", 405),
        ("PUT", "/v2/logging", 405),
    ],
)
def test_unknown_paths_and_wrong_verbs(port, method, path, status):
    reply = request(port, method, path)
    assert reply.status == status
    if method != "HEAD":
        assert reply.body == (
            b'{"error":"Not Found"}' if status == 404 else b'{"error":"Method Not Allowed"}'
        )


def test_query_strings_are_ignored_for_routing(port):
    assert request(port, "GET", "/v2/models/add_sub?x=1").json()["name"] == "add_sub"


# ==========================================================================================
# Bad input at the byte level: a clear 4xx, the server serving afterwards
# ==========================================================================================
BAD_INFER_BODIES = {
    "malformed JSON": ("{not json", "failed to parse the request JSON buffer"),
    "JSON array": ("[1, 2]", "must be a JSON object"),
    "JSON string": ('"inputs"', "must be a JSON object"),
    # (Triton 2.51's words, side by side; it answers 500 to these, dlserve 400 as to all bad JSON)
    "inputs not a list": (
        '{"inputs": {"name": "INPUT0"}}',
        "Unable to parse 'inputs': attempt to access JSON non-array as array",
    ),
    "inputs missing": (
        '{"outputs": []}',
        "Unable to parse 'inputs': attempt to access non-existing object member 'inputs'",
    ),
    "input not an object": ('{"inputs": [5]}', "each input must be a JSON object"),
    "input without shape": (
        '{"inputs": [{"name": "INPUT0", "datatype": "FP32", "data": [1]}]}',
        "Unable to parse 'shape': attempt to access non-existing object member 'shape'",
    ),
    "input without datatype": (
        '{"inputs": [{"name": "INPUT0", "shape": [1], "data": [1]}]}',
        "Unable to parse 'datatype': attempt to access non-existing object member 'datatype'",
    ),
    "input name a number": (
        '{"inputs": [{"name": 5, "datatype": "FP32", "shape": [1], "data": [1]}]}',
        "Unable to parse 'name': attempt to access JSON non-string as string",
    ),
    "negative shape": (json_infer([{**identity_input(), "shape": [-2]}]), "shape"),
    "shape of strings": (json_infer([{**identity_input(), "shape": ["2"]}]), "shape"),
    "huge shape": (json_infer([{**identity_input(), "shape": [2**40, 2**40]}]), "elements"),
    "outputs not a list": (
        json_infer([identity_input()], outputs="OUTPUT0"),
        "Unable to parse 'outputs': attempt to access JSON non-array as array",
    ),
    "outputs null": (
        json_infer([identity_input()], outputs=None),
        "Unable to parse 'outputs': attempt to access JSON non-array as array",
    ),
    "output without name": (
        json_infer([identity_input()], outputs=[{}]),
        "Unable to parse 'name': attempt to access non-existing object member 'name'",
    ),
    "deeply nested JSON": ("[" * 5000 + "]" * 5000, "failed to parse the request JSON buffer"),
    "deeply nested data": (
        '{"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1], "data": '
        + "[" * 500
        + "1"
        + "]" * 500
        + "}]}",
        "INPUT0",
    ),
    "invalid UTF-8": (b'{"id": "\xff\xfe", "inputs": []}', "failed to parse"),
    # Triton 2.51's words for these (with its 500)
    "negative classification": (
        json_infer(
            [identity_input()], outputs=[{"name": "OUTPUT0", "parameters": {"classification": -2}}]
        ),
        "Unable to set 'classification': attempt to access JSON non-unsigned-integer as "
        "unsigned-integer",
    ),
    "classification a string": (
        json_infer(
            [identity_input()], outputs=[{"name": "OUTPUT0", "parameters": {"classification": "2"}}]
        ),
        "Unable to set 'classification': attempt to access JSON non-unsigned-integer as "
        "unsigned-integer",
    ),
    "classification into shared memory": (
        json_infer(
            [identity_input()],
            outputs=[
                {
                    "name": "OUTPUT0",
                    "parameters": {
                        "classification": 2,
                        "shared_memory_region": "r",
                        "shared_memory_byte_size": 64,
                    },
                }
            ],
        ),
        "Output can't set both 'shared_memory_region' and 'classification'",
    ),
    "lone surrogate in a string": (
        '{"id": "\\ud800", "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1], "data": [NaN]}]}',
        "failed to parse the request JSON buffer",
    ),
    # Found comparing with Triton 2.51, which refuses these too (400, or 500 for a wrong type).
    "reserved triton_ parameter": (
        json_infer([identity_input()], parameters={"triton_foo": 1}),
        "parameter keys starting with 'triton_' are reserved for Triton usage",
    ),
    "headers parameter, an object": (
        json_infer([identity_input()], parameters={"headers": {"a": "b"}}),
        "parameter 'headers' has invalid type. It should be either 'int', 'bool', or 'string'.",
    ),
    "sequence_start not a bool": (
        json_infer([identity_input()], parameters={"sequence_start": "true"}),
        "parameter 'sequence_start' must be a boolean",
    ),
    "negative sequence_id": (
        json_infer([identity_input()], parameters={"sequence_id": -5}),
        "parameter 'sequence_id' must be a non-negative integer or a string",
    ),
    "binary_data_output not a bool": (
        json_infer([identity_input()], parameters={"binary_data_output": "yes"}),
        "parameter 'binary_data_output' must be a boolean",
    ),
    "output binary_data not a bool": (
        json_infer([identity_input()], outputs=[{"name": "OUTPUT0", "parameters": {"binary_data": "x"}}]),
        "'binary_data' must be a boolean",
    ),
    "data not an array": (
        '{"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1], "data": 1}]}',
        "'data' must be a JSON array",
    ),
    "more dimensions than a tensor has": (
        '{"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [' + ",".join(["1"] * 65) + '], "data": [1]}]}',
        "has a shape no tensor can have",
    ),
    "more elements than an int64 counts (one dimension 0)": (
        '{"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [4611686018427387904, 4, 0], "data": []}]}',
        "at most 64 dimensions, of at most 9223372036854775807 elements in all",
    ),
    "output in shared memory and binary": (
        json_infer(
            [identity_input()],
            outputs=[{"name": "OUTPUT0", "parameters": {
                "binary_data": True, "shared_memory_region": "r", "shared_memory_byte_size": 64}}],
        ),
        "Output can't set both 'shared_memory_region' and 'binary_data'",
    ),
}


@pytest.mark.parametrize("label", list(BAD_INFER_BODIES))
def test_bad_infer_bodies(port, label):
    body, fragment = BAD_INFER_BODIES[label]
    reply = request(port, "POST", "/v2/models/identity/infer", body)
    assert_error(reply, 400, fragment)
    assert_serving(port)


def _binary(header: dict, tail: bytes, length: int | str | None = None) -> tuple[bytes, dict]:
    text = json.dumps(header).encode()
    return text + tail, {
        "Inference-Header-Content-Length": str(len(text) if length is None else length)
    }


def _fp32_input(size: int) -> dict:
    return {
        "inputs": [
            {
                "name": "INPUT0",
                "datatype": "FP32",
                "shape": [4],
                "parameters": {"binary_data_size": size},
            }
        ]
    }


@pytest.mark.parametrize(
    "label,body_and_headers,status,fragment",
    [
        (
            "header length beyond the body",
            _binary(_fp32_input(16), fp32([1, 2, 3, 4]), 10_000),
            400,
            "Inference-Header-Content-Length",
        ),
        (
            "negative header length",
            _binary(_fp32_input(16), fp32([1, 2, 3, 4]), -3),
            400,
            "Inference-Header-Content-Length",
        ),
        (
            "header length not a number",
            _binary(_fp32_input(16), fp32([1, 2, 3, 4]), "abc"),
            400,
            "Inference-Header-Content-Length",
        ),
        (
            "header length cuts the JSON",
            _binary(_fp32_input(16), fp32([1, 2, 3, 4]), 20),
            400,
            "failed to parse",
        ),
        (
            "binary_data_size smaller than the shape",
            _binary(_fp32_input(12), fp32([1, 2, 3])),
            400,
            "input byte size mismatch for input 'INPUT0' for model 'identity'. Expected 16, got 12",
        ),
        (
            "binary_data_size larger than the data",
            _binary(_fp32_input(16), fp32([1, 2])),
            400,
            "unexpected end of binary data",
        ),
        (
            "negative binary_data_size",
            _binary(_fp32_input(-16), fp32([1, 2, 3, 4])),
            400,
            "binary_data_size",
        ),
        (
            "binary_data_size not an integer",
            _binary(_fp32_input("16"), fp32([1, 2, 3, 4])),
            400,
            "binary_data_size",
        ),
        (
            "extra unclaimed binary bytes",
            _binary(_fp32_input(16), fp32([1, 2, 3, 4]) + b"xx"),
            400,
            "no input claims",
        ),
        (
            "binary bytes but no binary input",
            _binary({"inputs": [identity_input()]}, b"\0" * 8),
            400,
            "no input claims",
        ),
        (
            "data and binary_data_size both",
            _binary(
                {"inputs": [{**identity_input(), "parameters": {"binary_data_size": 8}}]}, b"\0" * 8
            ),
            400,
            # (Triton 2.51's words, side by side)
            "in 'parameters'. But set 'data' 'binary_data_size'",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_bad_binary_bodies(port, label, body_and_headers, status, fragment):
    body, headers = body_and_headers
    assert_error(
        request(port, "POST", "/v2/models/identity/infer", body, headers), status, fragment
    )
    assert_serving(port)


def test_control_calls_answer_200_with_no_body_as_triton(port):
    for path in ("/v2/systemsharedmemory/unregister", "/v2/cudasharedmemory/unregister"):
        reply = request(port, "POST", path)
        assert (reply.status, reply.body) == (200, b""), (path, reply.body)


def test_raw_binary_requests_as_triton_deduces_them(port):
    """Inference-Header-Content-Length: 0: the body is the model's one input, its data
    type and shape from the config (compared with Triton 2.51), every output binary."""
    headers = {"Inference-Header-Content-Length": "0"}
    reply = request(port, "POST", "/v2/models/identity/infer", fp32([1, 2, 3, 4, 5]), headers)
    assert reply.status == 200, reply.body
    header, tail = split_binary_response(reply)
    assert header["outputs"] == [{"name": "OUTPUT0", "datatype": "FP32", "shape": [5],
                                  "parameters": {"binary_data_size": 20}}]
    assert np.frombuffer(tail["OUTPUT0"], np.float32).tolist() == [1, 2, 3, 4, 5]
    for model, body, fragment in [
        ("identity", b"abc", "input byte size mismatch for raw input 'INPUT0' for model 'identity'. Expected 0, got 3"),
        ("add_sub", fp32([1] * 16), "[request id: <id_unknown>] Raw request must only have 1 input (found 1) "
         "to be deduced but got 2 inputs in 'add_sub' model configuration"),
        ("bytes_model", b"hello", "For BYTE datatype raw input 'INPUT0', the model must have input shape [1]"),
    ]:
        assert_error(request(port, "POST", f"/v2/models/{model}/infer", body, headers), 400, fragment)
    # an empty body is a raw request too, as Triton takes it (upstream http_request_many_chunks)
    reply = request(port, "POST", "/v2/models/add_sub/infer", b"")
    assert_error(reply, 400, "Raw request must only have 1 input (found 1) to be deduced but got 2 inputs")
    assert_serving(port)


def test_raw_binary_requests_to_batching_and_bytes_models(servers, make_repo):
    """A batching model gets a batch of 1 in front (a variable dim deduced from the
    size); a BYTES input of dims [1] is the whole body, as Triton 2.51 does."""
    config = (MODELS / "bytes_model" / "config.pbtxt").read_text().replace("dims: [ -1 ]", "dims: [ 1 ]")
    model = (MODELS / "bytes_model" / "1" / "model.py").read_text()
    repo = make_repo("classifier", "batcher", extra={"bytes_model": {"config.pbtxt": config, "1/model.py": model}})
    server = servers.start(repo)
    headers = {"Inference-Header-Content-Length": "0"}
    with KServeHttp(server, KServeHttp.Options(address="127.0.0.1", port=0)) as service:
        replies = {
            name: request(service.port, "POST", f"/v2/models/{name}/infer", body, headers)
            for name, body in [("bytes_model", b"hello world"), ("classifier", fp32([1, 2, 3, 4, 5])),
                               ("batcher", fp32([1, 2, 3, 4]))]
        }
        short = request(service.port, "POST", "/v2/models/classifier/infer", fp32([1, 2, 3, 4]), headers)
    assert all(reply.status == 200 for reply in replies.values()), {n: r.body for n, r in replies.items()}
    header, blobs = split_binary_response(replies["bytes_model"])
    assert header["outputs"][0]["shape"] == [1]
    assert blobs["OUTPUT0"] == len(b"HELLO WORLD").to_bytes(4, "little") + b"HELLO WORLD"
    header, _ = split_binary_response(replies["classifier"])
    assert {o["name"]: o["shape"] for o in header["outputs"]} == {"PROBS": [1, 5], "LOGITS": [1, 5]}
    header, blobs = split_binary_response(replies["batcher"])
    assert header["outputs"][0]["shape"] == [1, 4]
    assert np.frombuffer(blobs["OUTPUT0"], np.float32).tolist() == [2, 4, 6, 8]  # batcher doubles
    assert_error(short, 400, "input byte size mismatch for raw input 'SCORES' for model 'classifier'. Expected 20, got 16")


@pytest.mark.parametrize(
    "declared,sent", [(1000, 200), (1 << 20, 300_000)], ids=["small", "direct-to-shm"]
)
def test_truncated_bodies_then_close(main, port, declared, sent):
    gc.collect()
    baseline = main.server.engine.arena.bytes_in_use
    head = http_request(
        "POST", "/v2/models/identity/infer", headers={"Content-Length": str(declared)}
    )
    for how in ("close", "shutdown"):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.settimeout(5)
        sock.sendall(head + b"x" * sent)
        if how == "shutdown":
            sock.shutdown(socket.SHUT_WR)
            assert sock.recv(1024) == b"", "nothing is answered for a body that never completed"
        sock.close()
    assert_serving(port)
    gc.collect()
    assert _arena_settles(main.server, baseline), "the half-read body's block was not freed"


def test_aborted_large_upload_frees_its_block_without_waiting_for_gc(main, port):
    gc.collect()
    baseline = main.server.engine.arena.bytes_in_use
    gc.disable()
    try:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(
            http_request(
                "POST", "/v2/models/identity/infer", headers={"Content-Length": str(8 << 20)}
            )
        )
        sock.sendall(b"x" * 100_000)
        time.sleep(0.1)
        sock.close()
        assert_serving(port)
        assert _arena_settles(main.server, baseline, within=1.0)
    finally:
        gc.enable()
        gc.collect()


def test_body_beyond_the_max_input_size_is_413_and_closes(main):
    head = http_request(
        "POST", "/v2/models/identity/infer", headers={"Content-Length": str(SMALL_MAX + 1)}
    )
    received, closed = exchange(main.small_port, head)
    (reply,) = parse_responses(received)
    assert_error(reply, 413, f"exceeds the maximum of {SMALL_MAX} bytes")
    assert reply.headers.get("connection") == "close" and closed
    received, closed = exchange(
        main.small_port,
        http_request(
            "POST", "/v2/models/identity/infer", headers={"Content-Length": "99999999999999"}
        ),
    )
    assert parse_responses(received)[0].status == 413 and closed
    # Exactly at the limit is fine.
    data = np.zeros(SMALL_MAX // 4 - 64, dtype=np.float32)
    body, length = binary_infer_body([("INPUT0", "FP32", [data.size], data.tobytes(), None)])
    assert SMALL_MAX - 1024 < len(body) <= SMALL_MAX
    reply = request(
        main.small_port,
        "POST",
        "/v2/models/identity/infer",
        body,
        {"Inference-Header-Content-Length": str(length)},
    )
    assert reply.status == 200
    assert_serving(main.small_port)


def test_oversize_chunked_body_is_413_and_closes(main):
    sock = socket.create_connection(("127.0.0.1", main.small_port))
    sock.settimeout(5)
    try:
        sock.sendall(
            http_request(
                "POST",
                "/v2/models/identity/infer",
                headers={"Transfer-Encoding": "chunked"},
                content_length=False,
            )
        )
        chunk = b"%x\r\n%s\r\n" % (1 << 16, b"a" * (1 << 16))
        try:
            for _ in range(2 * SMALL_MAX // (1 << 16)):
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        received = b""
        while True:
            try:
                data = sock.recv(1 << 16)
            except ConnectionResetError:
                break
            if not data:
                break
            received += data
    finally:
        sock.close()
    (reply,) = parse_responses(received)
    assert_error(reply, 413, "exceeds the maximum")
    assert_serving(main.small_port)


_PIECE = b"a" * (1 << 16)


@pytest.mark.parametrize(
    "path, headers, body, status, message",
    [
        (
            "/v2/models/identity/infer",
            {"Content-Length": str(16 * SMALL_MAX)},
            _PIECE * (16 * SMALL_MAX // len(_PIECE)),
            413,
            f"exceeds the maximum of {SMALL_MAX} bytes",
        ),
        (
            "/v2/models/identity/infer",
            {"Transfer-Encoding": "chunked"},
            b"%x\r\n%b\r\n" % (len(_PIECE), _PIECE) * (16 * SMALL_MAX // len(_PIECE)),
            413,
            "exceeds the maximum",
        ),
        (
            "http://h:99999/v2/models/identity/infer",
            {"Content-Length": str(16 * SMALL_MAX)},
            _PIECE * (16 * SMALL_MAX // len(_PIECE)),
            400,
            "invalid URL",
        ),
    ],
    ids=["content-length", "chunked", "bad-url"],
)
def test_a_client_that_sends_its_whole_refused_body_first_reads_the_answer(
    main, path, headers, body, status, message
):
    """A request refused before its body is read: the server reads and drops the rest of
    it instead of closing with it unread, which reset the connection under a client that
    writes its whole request before reading (http.client, this one); then FIN."""
    with socket.create_connection(("127.0.0.1", main.small_port), timeout=10) as sock:
        sock.sendall(http_request("POST", path, headers=headers, content_length=False) + body)
        received = b""
        while chunk := sock.recv(1 << 16):
            received += chunk
    (reply,) = parse_responses(received)
    assert_error(reply, status, message)
    assert reply.headers.get("connection") == "close"
    assert_serving(main.small_port)


def test_chunked_request_within_the_limit(port):
    body = json_infer([identity_input((3.0, 4.0))]).encode()
    chunked = (
        b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:10], body[10:]))
        + b"0\r\n\r\n"
    )
    stream = http_request(
        "POST",
        "/v2/models/identity/infer",
        chunked,
        {"Transfer-Encoding": "chunked"},
        content_length=False,
    )
    received, _ = exchange(port, stream, until_close=False)
    (reply,) = parse_responses(received)
    assert reply.json()["outputs"][0]["data"] == [3.0, 4.0]


def test_a_chunked_body_with_a_content_length_too_is_read_as_chunked_then_the_connection_closed(port):
    """As Triton 2.51 answers it (upstream http_test's test_content_encoding_chunked_manually;
    python-requests sends both headers): the chunks are the body (RFC 9112 6.3), and the
    connection closes after the answer, so that nothing can be smuggled behind the body for
    a proxy that went by the length."""
    body = json_infer([identity_input((5.0, 6.0))]).encode()
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:7], body[7:])) + b"0\r\n\r\n"
    stream = http_request(
        "POST", "/v2/models/identity/infer", chunked,
        {"Transfer-Encoding": "chunked", "Content-Length": str(len(body))}, content_length=False,
    )
    live = http_request("GET", "/v2/health/live", b"", {})
    received, closed = exchange(port, stream + live)
    (reply,) = parse_responses(received)  # (the request behind it is not read)
    assert reply.status == 200 and reply.json()["outputs"][0]["data"] == [5.0, 6.0]
    assert closed
    assert_serving(port)


@pytest.mark.parametrize(
    "label,data",
    [
        ("TLS hello", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(64)),
        ("text", b"HELLO WORLD\r\n\r\n"),
        ("binary noise", bytes(range(256)) * 4),
        ("bad request line", b"GET\r\n\r\n"),
        (
            "Content-Length not a number",
            b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        ),
        (
            "negative Content-Length",
            b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
        ),
        (
            "two Content-Lengths",
            b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
        ),
        (
            "bad chunk size",
            b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
        ),
        (
            "headers too large",
            b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n",
        ),
        ("URL too long", b"GET /v2/" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"),
        ("bare LF in header", b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-A: a\rb\r\n\r\n"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_garbage_is_answered_with_400_and_the_connection_closed(port, label, data):
    received, closed = exchange(port, data)
    replies = parse_responses(received)
    assert len(replies) == 1, received[:300]
    assert_error(replies[0], 400)
    assert closed
    assert_serving(port)


@pytest.mark.parametrize(
    "label,data,status,fragment",
    [
        (
            "a transfer coding besides chunked",
            b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked"
            b"\r\n\r\n0\r\n\r\n",
            501,
            "unsupported Transfer-Encoding 'gzip, chunked'",
        ),
        (
            "an expectation besides 100-continue",
            b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nExpect: 200-ok\r\n\r\n",
            417,
            "unsupported Expect '200-ok'",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_what_http_1_1_does_not_define_is_refused(port, label, data, status, fragment):
    """RFC 9112 6.1 (an unknown transfer coding: 501) and RFC 9110 10.1.1 (an
    unknown expectation: 417); both were served as if the header were not there."""
    received, _ = exchange(port, data)
    replies = parse_responses(received)
    assert len(replies) == 1, received[:300]
    assert_error(replies[0], status, fragment)
    assert_serving(port)


def test_a_chunked_body_that_expects_100_continue_gets_it(port):
    """As a body with a Content-Length does (curl sends Expect for a body of unknown size
    and waited out its own second for an answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as connection:
        connection.sendall(
            b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Expect: 100-continue\r\nContent-Type: application/json\r\n\r\n"
        )
        assert connection.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")


def test_no_100_continue_for_an_http_1_0_client(port):
    """RFC 9110 15.2: a server never sends a 1xx answer to an HTTP/1.0 client."""
    body = json.dumps({"inputs": [identity_input()]}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as connection:
        connection.sendall(
            b"POST /v2/models/identity/infer HTTP/1.0\r\nExpect: 100-continue\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        assert connection.recv(100).startswith(b"HTTP/1.1 200 OK\r\n")


def test_a_header_length_is_plain_digits(port):
    body = json.dumps({"inputs": [identity_input()]}).encode()
    reply = request(
        port, "POST", "/v2/models/identity/infer", body, {"Inference-Header-Content-Length": " +0"}
    )
    assert_error(reply, 400, "invalid Inference-Header-Content-Length '+0'")


def test_an_upgrade_request_is_answered_over_http_1_1_body_and_all(port):
    """``curl --http2`` asks every request, bodies included, to upgrade to h2c; HTTP/1.1
    lets a server ignore that, as Triton does (it was refused with 400)."""
    upgrade = {"Connection": "Upgrade, HTTP2-Settings", "Upgrade": "h2c", "HTTP2-Settings": "AAMAAABkAAQCAAAAAAIAAAAA"}
    body = json_infer([identity_input((1.0, 2.0))], id="u").encode()
    infer = http_request("POST", "/v2/models/identity/infer", body, upgrade)
    live = http_request("GET", "/v2/health/live", b"", {"connection": "upgrade", "UPGRADE": "websocket"})
    last = http_request("POST", "/v2/models/identity/infer", body, {**upgrade, "Connection": "Upgrade, close"})
    received, closed = exchange(port, infer + live + last)
    assert closed  # as the last one asked
    replies = parse_responses(received)
    assert [r.status for r in replies] == [200, 200, 200]
    assert json.loads(replies[0].body)["outputs"][0]["data"] == [1.0, 2.0]
    assert replies[2].body == replies[0].body
    # A body that comes later, and one bigger than a read: read by hand all the same.
    values = [float(i % 7) for i in range(40_000)]
    big = http_request("POST", "/v2/models/identity/infer", json_infer([identity_input(values)]).encode(), upgrade)
    head = infer.index(b"\r\n\r\n") + 4
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(10)
        sock.sendall(infer[:head])
        time.sleep(0.2)
        sock.sendall(infer[head:] + big + live)
        received, replies = b"", []
        while len(replies) < 3:
            received += sock.recv(1 << 16)
            with contextlib.suppress(AssertionError):  # (a response not all in yet)
                replies = parse_responses(received)
    assert [r.status for r in replies] == [200, 200, 200]
    assert json.loads(replies[0].body)["outputs"][0]["data"] == [1.0, 2.0]
    assert json.loads(replies[1].body)["outputs"][0]["data"] == values


def test_a_bad_request_after_good_ones_on_one_connection(port):
    good = http_request(
        "POST", "/v2/models/identity/infer", json_infer([identity_input((1.0,))], id="g").encode()
    )
    received, closed = exchange(port, good + good + b"NOT HTTP AT ALL\r\n\r\n")
    replies = parse_responses(received)
    assert [r.status for r in replies] == [200, 200, 400] and closed
    assert_serving(port)


def test_expect_100_continue_is_answered(port):
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(0.5)
    try:
        sock.sendall(
            http_request(
                "POST",
                "/v2/models/identity/infer",
                headers={"Content-Length": "2000000", "Expect": "100-continue"},
            )
        )
        try:
            interim = sock.recv(1024)
        except TimeoutError:
            interim = b""
        assert interim.startswith(b"HTTP/1.1 100 Continue\r\n")
    finally:
        sock.close()


def test_expect_100_continue_for_a_body_beyond_the_limit_is_refused_at_once(main):
    """curl sends Expect for bodies over 1 MiB: a too-large body is refused before it is sent."""
    data = np.zeros(SMALL_MAX // 2, dtype=np.float32)
    body, length = binary_infer_body([("INPUT0", "FP32", [data.size], data.tobytes(), None)])
    result = subprocess.run(
        [
            "curl",
            "-s",
            "-o",
            "-",
            "-w",
            "\n%{http_code}",
            "-H",
            f"Inference-Header-Content-Length: {length}",
            "--data-binary",
            "@-",
            f"http://127.0.0.1:{main.small_port}/v2/models/identity/infer",
        ],
        input=body,
        capture_output=True,
        timeout=20,
        check=True,
    )
    text, code = result.stdout.rsplit(b"\n", 1)
    assert code == b"413" and b"exceeds the maximum" in text
    assert_serving(main.small_port)


def test_odd_but_valid_paths(port):
    assert_error(request(port, "GET", "/v2/models/add%00sub"), 404, "unknown model")
    assert_error(request(port, "GET", "/v2/models/%ff%fe"), 404, "unknown model")
    assert_error(request(port, "GET", "/v2/models/add%20sub"), 404, "'add sub'")
    assert_error(request(port, "GET", "/v2/models/add_sub/versions/-1"), 400, "-1")
    assert_error(request(port, "GET", "/v2/models/add_sub/versions/99999999999999999999"), 404)
    assert_error(
        request(port, "POST", "/v2/models/add_sub/versions/abc/infer", json_infer([])), 400, "abc"
    )
    assert_serving(port)


# ==========================================================================================
# Restricted APIs
# ==========================================================================================
def test_restricted_apis(main):
    url = f"127.0.0.1:{main.restricted_port}"
    expected = "This API is restricted, expecting header 'x-key'"
    c = httpclient.InferenceServerClient(url)
    try:
        for call in (
            lambda **kw: c.infer("add_sub", add_sub_inputs(), **kw),
            lambda **kw: c.get_model_config("add_sub", **kw),
        ):
            error = client_error(call)
            assert (error.status(), error.message()) == ("403", expected)
            error = client_error(call, headers={"x-key": "wrong"})
            assert error.status() == "403"
        result = c.infer("add_sub", add_sub_inputs(), headers={"x-key": "secret"})
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)
        assert c.get_model_config("add_sub", headers={"X-Key": "secret"})["name"] == "add_sub"
        # Other categories are unaffected.
        assert c.is_server_live() and c.is_model_ready("add_sub")
        assert c.get_model_metadata("add_sub")["name"] == "add_sub"
        assert c.get_inference_statistics("add_sub")["model_stats"]
        assert c.get_model_repository_index()
        assert c.get_system_shared_memory_status() == []
        assert c.get_log_settings()
    finally:
        c.close()
    reply = request(main.restricted_port, "POST", "/v2/models/add_sub/infer", "{not json")
    assert (reply.status, reply.json()) == (
        403,
        {"error": expected},
    )  # refused before the body is read
    # The main service of the same server has no restriction.
    assert request(main.port, "GET", "/v2/models/add_sub/config").status == 200


def test_headers_are_forwarded_as_parameters(main):
    c = httpclient.InferenceServerClient(f"127.0.0.1:{main.restricted_port}")
    try:
        x = httpclient.InferInput("INPUT0", [1], "FP32")
        x.set_data_from_numpy(np.ones(1, dtype=np.float32))
        result = c.infer(
            "params_echo",
            [x],
            parameters={"p": 1},
            headers={
                "x-key": "secret",
                "x-fwd-user": "alice",
                "x-fwd-trace": "t-1",
                "x-other": "no",
            },
        )
        parameters = json.loads(result.as_numpy("INFO")[0])["parameters"]
        assert parameters == {"p": 1, "x-fwd-user": "alice", "x-fwd-trace": "t-1"}
    finally:
        c.close()
    # The main service has no pattern: nothing is forwarded.
    body = json_infer([identity_input((1.0,))])
    reply = request(
        main.port, "POST", "/v2/models/params_echo/infer", body, {"x-fwd-user": "alice"}
    )
    assert json.loads(reply.json()["outputs"][0]["data"][0])["parameters"] == {}


@pytest.mark.parametrize(
    "pattern,forwarded",
    [
        # Triton matches ignoring case and hands the name on as the client sent it
        ("^(x-case|priority|sequence_.*|timeout)$", {"X-Case", "priority", "sequence_id", "sequence_start", "timeout"}),
        # RE2's (?-i) at the front: case counts
        ("(?-i)^(X-Case|x-case-2|priority)$", {"X-Case", "priority"}),
    ],
)
def test_forwarded_headers_keep_their_case_and_never_act_as_reserved_parameters(main, pattern, forwarded):
    service = _http(main.server, header_forward_pattern=pattern)
    headers = {
        "X-Case": "kept",
        "X-Case-2": "other",
        "priority": "high",  # a priority parameter would have to be an integer
        "sequence_id": "42",  # ...and these would make it a sequence request
        "sequence_start": "false",
        "timeout": "soon",
    }
    try:
        body = json_infer([identity_input((1.0,))])
        reply = request(service.port, "POST", "/v2/models/params_echo/infer", body, headers)
        assert reply.status == 200, reply.body
        info = json.loads(reply.json()["outputs"][0]["data"][0])
        assert info["parameters"] == {name: headers[name] for name in forwarded}
        assert (info["correlation_id"], info["flags"], info["timeout"]) == (0, 0, 0)
    finally:
        service.stop()


@pytest.mark.parametrize(
    "restriction",
    ["inference", "bogus:x-key=1", ":x-key=1", "inference:=1", "inference:x-key"],
)
def test_bad_restrictions_are_refused(restriction):
    with pytest.raises(dlserve.InvalidArgumentError):
        KServeHttp.Options(restricted_apis=[restriction])


# ==========================================================================================
# Service lifecycle
# ==========================================================================================
@pytest.mark.parametrize(
    "options",
    [
        {"port": 70000},
        {"port": -1},
        {"port": "eighty"},
        {"port": "-1"},
        {"thread_count": 0},
        {"max_input_size": 0},
        {"header_forward_pattern": "("},
        {"address": 5},  # (tritonfrontend's Options check each field's type)
        {"reuse_port": "true"},
        {"restricted_apis": "inference"},
    ],
)
def test_options_validation(options):
    with pytest.raises(dlserve.InvalidArgumentError):
        KServeHttp.Options(**options)


def test_options_take_an_integer_given_as_text_and_check_every_services_types():
    assert KServeHttp.Options(port="8005").port == 8005  # (as from os.environ; so does tritonfrontend)
    assert KServeGrpc.Options(port=" 8006 ").port == 8006
    with pytest.raises(dlserve.InvalidArgumentError, match="^server_key must be str, got 10$"):
        KServeGrpc.Options(server_key=10)
    with pytest.raises(dlserve.InvalidArgumentError, match="^default_model must be str | None, got 3$"):
        dlserve.frontends.SageMaker.Options(default_model=3)


def test_options_of_the_wrong_type_are_refused(main):
    with pytest.raises(dlserve.InvalidArgumentError, match="KServeHttp.Options"):
        KServeHttp(main.server, KServeGrpc.Options())


def test_context_manager_and_starting_twice(main):
    service = KServeHttp(main.server, KServeHttp.Options(address="127.0.0.1", port=0))
    with service:
        port = service.port
        assert request(port, "GET", "/v2/health/live").status == 200
        with pytest.raises(dlserve.AlreadyExistsError):
            service.start()
        assert request(port, "GET", "/v2/health/live").status == 200
    with pytest.raises(ConnectionRefusedError):
        request(port, "GET", "/v2/health/live")
    service.stop()  # stopping again is a no-op
    assert request(main.port, "GET", "/v2/health/live").status == 200, "other services keep serving"


def test_port_in_use_is_a_triton_error(main):
    service = KServeHttp(main.server, KServeHttp.Options(address="127.0.0.1", port=main.port))
    try:
        with pytest.raises(dlserve.TritonError):
            service.start()
    finally:
        service.stop()


def test_port_in_use_leaves_everything_working(main):
    service = KServeHttp(main.server, KServeHttp.Options(address="127.0.0.1", port=main.port))
    with pytest.raises((OSError, dlserve.TritonError)):
        service.start()
    service.stop()
    assert_serving(main.port)


def test_server_stop_while_the_http_service_runs(harness, tmp_path_factory):
    repo = tmp_path_factory.mktemp("lifecycle_repo")
    shutil.copytree(MODELS / "identity", repo / "identity")
    server = harness.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    service = _http(server)
    port = service.port
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/v2/health/live")
        response = conn.getresponse()
        response.read()
        assert response.status == 200
        started = time.monotonic()
        harness.stop(server)  # checks that no worker, segment or descriptor is left
        assert time.monotonic() - started < 10
        with pytest.raises(ConnectionRefusedError):
            request(port, "GET", "/v2/health/live")
        with pytest.raises((http.client.RemoteDisconnected, ConnectionError, BrokenPipeError)):
            conn.request("GET", "/v2/health/live")
            conn.getresponse().read()
    finally:
        conn.close()
    service.stop()  # a no-op now
    service.stop()
    with pytest.raises(ConnectionRefusedError):
        request(port, "GET", "/v2/health/live")


@pytest.mark.parametrize("service_class", [KServeHttp, KServeGrpc, Metrics])
def test_a_service_on_a_stopped_or_unstarted_server_is_refused_and_holds_nothing(
    harness, tmp_path, service_class
):
    """As any call on a server not running: tritonserver's InvalidArgumentError, with no
    "coroutine ... was never awaited" warning (the service's start used to leave one),
    and no port held."""
    stopped = harness.start(tmp_path)
    harness.stop(stopped)
    for server in (stopped, dlserve.Server(dlserve.Options(model_repository=str(tmp_path)))):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        service = service_class(server, service_class.Options(address="127.0.0.1", port=port))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(dlserve.InvalidArgumentError, match="^Server not started$"):
                service.start()
            gc.collect()
        assert [str(w.message) for w in caught] == []
        socket.create_server(("127.0.0.1", port)).close()
        service.stop()  # a no-op


@pytest.mark.parametrize("service_class", [KServeHttp, KServeGrpc, Metrics])
def test_a_service_started_while_the_server_stops_is_refused_and_holds_no_port(
    harness, tmp_path, service_class
):
    """While stop() lets a request in flight finish, a service started was left out of the
    stop: neither drained nor stopped, its port bound until the loop closed. It is refused,
    UNAVAILABLE, and holds nothing."""
    repo = tmp_path / "repo"
    shutil.copytree(MODELS / "faulty", repo / "faulty")
    server = harness.start(repo)
    held = HeldRequest(server, tmp_path / "release")
    engine = server.engine
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stopping = pool.submit(harness.stop, server)
        wait_until(lambda: not engine.accepting)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        service = service_class(server, service_class.Options(address="127.0.0.1", port=port))
        refused = f"^{service_class.__name__} not started: the server is stopping$"
        with pytest.raises(dlserve.UnavailableError, match=refused):
            service.start()
        socket.create_server(("127.0.0.1", port)).close()  # (while the stop still waits)
        assert held.answer().error is None
        stopping.result(timeout=30)
    service.stop()  # a no-op
