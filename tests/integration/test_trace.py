"""Triton's request tracing (``--trace-config``, the trace extension) through unmodified
tritonclient HTTP and gRPC and the in-process API: the trace files and the setting
endpoints, checked against what Triton 2.51 wrote and answered for the same requests
(tests/data/triton_reference/trace.json, made with scripts/probe_trace.py)."""

from __future__ import annotations

import copy
import glob
import json
import queue
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import dlserve
from dlserve.frontends import KServeGrpc, KServeHttp

from ..conftest import EXAMPLES, MODELS, ServerHarness, frontend, wait_until

REFERENCE_FILE = Path(__file__).parents[1] / "data" / "triton_reference" / "trace.json"
REFERENCE = json.loads(REFERENCE_FILE.read_text())
A = np.arange(4, dtype=np.float32)
ORDER = [  # the order a request passes these points in
    "HTTP_RECV_START", "HTTP_RECV_END", "GRPC_WAITREAD_START", "GRPC_WAITREAD_END",
    "REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START",
    "COMPUTE_END", "INFER_RESPONSE_COMPLETE", "REQUEST_END", "GRPC_SEND_START", "GRPC_SEND_END",
    "HTTP_SEND_START", "HTTP_SEND_END",
]


def start(tmp_path: Path, **trace: object) -> tuple[ServerHarness, dlserve.Server, Path]:
    repo = tmp_path / "repo"
    for name in ("pipeline", "add_sub", "identity", "string_upper"):
        shutil.copytree(EXAMPLES / name, repo / name)
    for name in ("bls_traced", "decoupled", "async_overlap"):
        shutil.copytree(MODELS / name, repo / name)
    file = tmp_path / "trace.json"
    harness = ServerHarness()
    settings = dlserve.TraceSettings(file=str(file), level=("TIMESTAMPS",), rate=1, **trace)
    server = harness.start(repo, trace=settings)
    deadline = time.monotonic() + 60
    while not server.ready():
        assert time.monotonic() < deadline, "models not ready"
        time.sleep(0.05)
    return harness, server, file


@pytest.fixture
def traced(tmp_path):
    """A server tracing every request, each trace in a file of its own (log_frequency 1),
    with HTTP and gRPC frontends: (server, urls, trace file)."""
    harness, server, file = start(tmp_path, log_frequency=1)
    try:
        for http_port in frontend(KServeHttp, server):
            for grpc_port in frontend(KServeGrpc, server):
                urls = {"http": f"127.0.0.1:{http_port}", "grpc": f"127.0.0.1:{grpc_port}"}
                yield server, urls, file
        # Every trace was let go: written, or dropped for a request refused before it ran.
        deadline = time.monotonic() + 5
        while server.engine.tracer._open and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not server.engine.tracer._open, sorted(server.engine.tracer._open)
    finally:
        harness.close()


def infer(urls: dict, protocol: str, model: str, request_id: str = "") -> object:
    module = httpclient if protocol == "http" else grpcclient
    with module.InferenceServerClient(urls[protocol]) as client:
        inputs = [module.InferInput(name, [4], "FP32") for name in ("INPUT0", "INPUT1")]
        for tensor in inputs:
            tensor.set_data_from_numpy(A)
        return client.infer(model, inputs, request_id=request_id)


def read_traces(paths: list[str]) -> list[dict]:
    """The traces in trace files: per id its header fields and its (name, ns) events."""
    traces: dict[int, dict] = {}
    for path in paths:
        for entry in json.loads(Path(path).read_text()):
            trace = traces.setdefault(entry["id"], {"id": entry["id"], "events": []})
            if "model_name" in entry:
                trace.update({k: v for k, v in entry.items() if k != "id"})
            trace["events"] += [(s["name"], s["ns"]) for s in entry.get("timestamps", [])]
    return list(traces.values())


def numbered(file: Path, count: int, timeout: float = 10) -> list[str]:
    """The first ``count`` numbered trace files (file.0, file.1, ...), once written."""
    deadline = time.monotonic() + timeout
    while True:
        paths = sorted(glob.glob(f"{file}.*"), key=lambda p: int(p.rsplit(".", 1)[1]))
        if len(paths) >= count or time.monotonic() > deadline:
            return paths
        time.sleep(0.02)


def in_order(trace: dict) -> None:
    stamps = dict(trace["events"])
    assert len(stamps) == len(trace["events"]), f"an event twice: {trace['events']}"
    seen = [(name, stamps[name]) for name in ORDER if name in stamps]
    assert [ns for _, ns in seen] == sorted(ns for _, ns in seen), seen


def setting(url: str, method: str, path: str, body: object = None) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://{url}{path}", data=data, method=method)
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# -- the trace files ------------------------------------------------------------------------
def test_traces_have_tritons_events_in_order_for_http_grpc_an_ensemble_and_bls(traced):
    server, urls, file = traced
    infer(urls, "http", "add_sub", "http-add_sub")
    infer(urls, "grpc", "add_sub", "grpc-add_sub")
    infer(urls, "http", "pipeline", "http-pipeline")
    # bls_traced passes trace=request.trace() to its add_sub call, which makes it a child
    context = infer(urls, "http", "bls_traced", "http-bls").as_numpy("TRACE_CONTEXT")[0].decode()
    assert context == REFERENCE["bls_trace_context"] == "None"  # get_context(): no OpenTelemetry
    traces = read_traces(numbered(file, 8))
    assert len(traces) == 8
    expected = copy.deepcopy(REFERENCE["traces"])
    parents = {t["id"] for t in traces if t["model_name"] in ("pipeline", "bls_traced")}
    pipeline = next(t for t in traces if t["model_name"] == "pipeline")
    got = []
    for trace in traces:
        in_order(trace)
        assert trace.get("parent_id") in (None, *parents)
        entry = {k: v for k, v in trace.items() if k not in ("id", "events", "parent_id")}
        entry["events"] = sorted(name for name, _ in trace["events"])
        if "parent_id" in trace:
            entry["parent_id"] = "set"
        got.append(entry)
    key = lambda t: (t["request_id"], t["model_name"], "parent_id" in t)  # noqa: E731
    assert sorted(got, key=key) == sorted(expected, key=key)
    # The steps ran inside their ensemble's time.
    stamps = dict(pipeline["events"])
    for step in (t for t in traces if t.get("parent_id") == pipeline["id"]):
        inner = dict(step["events"])
        assert stamps["REQUEST_START"] <= inner["REQUEST_START"]
        assert inner["REQUEST_START"] <= inner["REQUEST_END"] <= stamps["REQUEST_END"]


def test_requests_on_a_grpc_stream_are_traced_like_unary_calls(traced):
    """Each request on a ModelStreamInfer stream gets the events of a unary gRPC call:
    waiting for its message (from the end of the one before), and its answer sent."""
    _, urls, file = traced
    answers: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(urls["grpc"]) as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        for i in range(2):
            inputs = [grpcclient.InferInput(name, [4], "FP32") for name in ("INPUT0", "INPUT1")]
            for tensor in inputs:
                tensor.set_data_from_numpy(A)
            client.async_stream_infer("add_sub", inputs, request_id=f"stream-{i}")
            result, error = answers.get(timeout=10)
            assert error is None, error
        client.stop_stream()
    traces = sorted(read_traces(numbered(file, 2)), key=lambda t: t["request_id"])
    unary = next(t for t in REFERENCE["traces"] if t["request_id"] == "grpc-add_sub")
    assert [t["request_id"] for t in traces] == ["stream-0", "stream-1"]
    for trace in traces:
        in_order(trace)
        assert sorted(name for name, _ in trace["events"]) == sorted(unary["events"])
    first, second = (dict(t["events"]) for t in traces)
    assert first["GRPC_WAITREAD_END"] <= second["GRPC_WAITREAD_START"]


def test_a_cancelled_stream_lets_go_of_the_trace_of_an_answer_waiting_its_turn(traced):
    """An answer made while an earlier request's is not (answers go out in request order)
    holds its trace until it is sent; the stream cancelled then lets the trace go, and it
    is written, without the send it never had."""
    server, urls, file = traced
    tracer = server.engine.tracer

    def waiting() -> bool:
        quick = [t for t in list(tracer._open.values()) if t.request_id == "quick"]
        return bool(quick) and "GRPC_SEND_START" in dict(quick[0].events)

    with grpcclient.InferenceServerClient(urls["grpc"]) as client:
        client.start_stream(callback=lambda result, error: None)
        for request_id, delay_ms in (("slow", 2000), ("quick", 0)):  # (async_overlap sleeps)
            tensor = grpcclient.InferInput("IN", [1], "INT32")
            tensor.set_data_from_numpy(np.array([delay_ms], np.int32))
            client.async_stream_infer("async_overlap", [tensor], request_id=request_id)
        wait_until(waiting, timeout=10)
        client.stop_stream(cancel_requests=True)
    wait_until(lambda: not tracer._open, timeout=10)
    traces = read_traces(glob.glob(f"{file}.*"))
    (quick,) = [t for t in traces if t["request_id"] == "quick"]
    names = {name for name, _ in quick["events"]}
    assert "GRPC_SEND_START" in names and "GRPC_SEND_END" not in names


def test_the_in_process_api_traces_without_frontend_events(traced):
    server, _, file = traced
    model = server.model("add_sub")
    responses = list(model.infer(inputs={"INPUT0": A, "INPUT1": A}, request_id="local"))
    assert responses[0].error is None
    (trace,) = read_traces(numbered(file, 1))
    assert trace["request_id"] == "local" and trace["model_version"] == 1
    names = {name for name, _ in trace["events"]}
    assert names == {
        "REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END",
        "COMPUTE_OUTPUT_START", "COMPUTE_END", "INFER_RESPONSE_COMPLETE", "REQUEST_END",
    }
    in_order(trace)


def test_a_decoupled_model_that_answers_inside_execute_keeps_its_compute_times(traced):
    """Its final response reaches the server before execute's own reply does."""
    server, _, file = traced
    responses = list(server.model("decoupled").infer(inputs={"IN": np.array([1, 2, 3], np.int32)}))
    assert [r.final for r in responses][-1] and len(responses) >= 3
    (trace,) = read_traces(numbered(file, 1))
    names = [name for name, _ in trace["events"]]
    for event in ("COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END"):
        assert names.count(event) == 1, names
    assert names.count("INFER_RESPONSE_COMPLETE") == len(responses)
    assert names.count("REQUEST_END") == 1


def test_level_tensors_writes_the_tensors_as_triton_does(traced):
    _, urls, file = traced
    with httpclient.InferenceServerClient(urls["http"]) as client:
        # (Triton lists the levels in this order, whatever order they were given in)
        level = client.update_trace_settings(settings={"trace_level": ["TENSORS", "TIMESTAMPS"]})
        assert level["trace_level"] == ["TIMESTAMPS", "TENSORS"]
        x = np.array([0.5, 1.25, -3.0, 1e-7], np.float32)
        inputs = [httpclient.InferInput(name, [4], "FP32") for name in ("INPUT0", "INPUT1")]
        inputs[0].set_data_from_numpy(x)
        inputs[1].set_data_from_numpy(x * 3)
        client.infer("add_sub", inputs, request_id="tensors-add_sub")
        text = httpclient.InferInput("INPUT0", [2], "BYTES")
        text.set_data_from_numpy(np.array([b"ab", b"c,d"], dtype=np.object_))
        client.infer("string_upper", [text], request_id="tensors-string_upper")
    entries = [e for path in numbered(file, 2) for e in json.loads(Path(path).read_text())]
    tensors = [{k: v for k, v in e.items() if k != "id"} for e in entries if "tensor" in e]
    assert tensors == REFERENCE["tensors"]
    assert sum("timestamps" in e for e in entries) > 10  # TIMESTAMPS is still on


def test_one_file_holds_every_trace_as_a_json_array_at_stop(tmp_path):
    harness, server, file = start(tmp_path)  # log_frequency 0: one file
    try:
        for http_port in frontend(KServeHttp, server):
            for n in range(3):
                infer({"http": f"127.0.0.1:{http_port}"}, "http", "add_sub", f"r{n}")
    finally:
        harness.close()  # stops the server: the array is closed
    traces = read_traces([str(file)])
    assert sorted(t["request_id"] for t in traces) == ["r0", "r1", "r2"]
    assert not glob.glob(f"{file}.*")


def test_a_refused_request_leaves_no_trace_and_the_next_is_traced(traced):
    server, urls, file = traced
    with httpclient.InferenceServerClient(urls["http"]) as client:
        wrong = httpclient.InferInput("INPUT0", [3], "FP32")
        wrong.set_data_from_numpy(np.zeros(3, np.float32))
        with pytest.raises(InferenceServerException):
            client.infer("add_sub", [wrong], request_id="refused")
    infer(urls, "http", "add_sub", "accepted")
    time.sleep(0.2)
    assert [t["request_id"] for t in read_traces(numbered(file, 1))] == ["accepted"]


# -- sampling ---------------------------------------------------------------------------------
def test_rate_and_count_pick_which_requests_are_traced(traced):
    _, urls, file = traced
    with httpclient.InferenceServerClient(urls["http"]) as client:
        assert client.update_trace_settings(settings={"trace_rate": "2"})["trace_rate"] == "2"
        for n in range(4):
            infer(urls, "http", "add_sub", f"rate-{n}")
        assert [t["request_id"] for t in read_traces(numbered(file, 2))] == ["rate-1", "rate-3"]
        settings = client.update_trace_settings(settings={"trace_rate": "1", "trace_count": "1"})
        assert settings["trace_count"] == "1"
        for n in range(3):
            infer(urls, "http", "add_sub", f"count-{n}")
        traced_ids = [t["request_id"] for t in read_traces(numbered(file, 3))]
        assert traced_ids == ["rate-1", "rate-3", "count-0"]
        assert client.get_trace_settings()["trace_count"] == "0"  # what is left, as Triton


def test_a_models_own_level_turns_its_tracing_off(traced):
    _, urls, file = traced
    with grpcclient.InferenceServerClient(urls["grpc"]) as client:
        answer = client.update_trace_settings("add_sub", {"trace_level": ["OFF"]}, as_json=True)
        assert answer["settings"]["trace_level"]["value"] == ["OFF"]
    infer(urls, "grpc", "add_sub", "off")
    infer(urls, "http", "pipeline", "on")
    traces = read_traces(numbered(file, 4))
    assert {t["request_id"] for t in traces} == {"on"}  # the pipeline's add_sub step too


def test_a_models_own_log_frequency_gathers_its_traces_apart(traced):
    """As in Triton, log_frequency may be set per model: requests to that model are
    written N to a file, the others as the server's setting says (here one to a file),
    each with its steps' traces."""
    _, urls, file = traced
    with httpclient.InferenceServerClient(urls["http"]) as client:
        assert client.update_trace_settings("add_sub", {"log_frequency": "2"})["log_frequency"] == "2"
        assert client.get_trace_settings()["log_frequency"] == "1"
    infer(urls, "http", "add_sub", "a0")
    infer(urls, "http", "pipeline", "p0")  # its steps (add_sub, identity twice) go with it
    (first,) = numbered(file, 1)
    assert sorted(t["model_name"] for t in read_traces([first])) == ["add_sub", "identity", "identity", "pipeline"]
    time.sleep(0.2)
    assert len(numbered(file, 2, timeout=0)) == 1  # a0 waits for its partner
    infer(urls, "http", "add_sub", "a1")
    second = numbered(file, 2)[1]
    assert [(t["model_name"], t["request_id"]) for t in read_traces([second])] == [("add_sub", "a0"), ("add_sub", "a1")]


# -- the setting endpoints ------------------------------------------------------------------
def test_http_settings_answer_as_triton(traced):
    _, urls, file = traced
    for method, path, body, status, answer in REFERENCE["settings"]:
        got_status, got = setting(urls["http"], method, path, body)
        if isinstance(answer, dict) and "trace_file" in answer:
            answer = {**answer, "trace_file": str(file)}
        assert (got_status, got) == (status, answer), (method, path, body)


def test_grpc_settings_and_errors(traced):
    _, urls, file = traced
    with grpcclient.InferenceServerClient(urls["grpc"]) as client:
        settings = client.get_trace_settings(as_json=True)["settings"]
        assert settings["trace_file"]["value"] == [str(file)]
        assert settings["trace_level"]["value"] == ["TIMESTAMPS"]
        updated = client.update_trace_settings("add_sub", {"trace_rate": "9"}, as_json=True)
        assert updated["settings"]["trace_rate"]["value"] == ["9"]
        identity = client.get_trace_settings("identity", as_json=True)["settings"]
        assert identity["trace_rate"]["value"] == ["1"]
        cleared = client.update_trace_settings("add_sub", {"trace_rate": None}, as_json=True)
        assert cleared["settings"]["trace_rate"]["value"] == ["1"]
        cases = [
            (None, {"trace_file": "/tmp/elsewhere"}, "UNIMPLEMENTED", "can not be updated"),
            ("nosuch", {"trace_rate": "2"}, "INVALID_ARGUMENT", "unknown model : nosuch"),
            (None, {"trace_rate": "x"}, "INVALID_ARGUMENT", "Unable to parse 'trace_rate'"),
            (None, {"trace_level": ["LOUD"]}, "INVALID_ARGUMENT", "unknown trace level 'LOUD'"),
            (None, {"trace_mode": "opentelemetry"}, "UNIMPLEMENTED", "'trace_mode' can not be"),
            (None, {"sampling": "1"}, "INVALID_ARGUMENT", "unknown trace setting 'sampling'"),
        ]
        for model, changes, code, message in cases:
            with pytest.raises(InferenceServerException) as info:
                client.update_trace_settings(model, changes)
            assert code in str(info.value.status()) and message in info.value.message(), changes
        assert client.is_server_live()


def test_bad_http_settings_are_clear_errors(traced):
    _, urls, _ = traced
    cases = [
        ({"trace_level": "TIMESTAMPS"}, 400, "must be an array of strings"),
        ({"trace_rate": 3}, 400, "must be a string"),
        # (with tracing on; Triton takes 0 while the level is OFF)
        ({"trace_rate": "0"}, 400, "Attempting to set invalid trace setting :sample rate must be non-zero"),
        ({"log_frequency": "-1"}, 400, "Expecting value >= 0"),
        ({"trace_level": ["OFF", "OFF"]}, 400, "Expect only one trace level 'OFF' is specified"),
        # Triton keeps them in 32 bits and refuses more, in these words
        ({"trace_count": "2147483648"}, 400, "Unable to parse 'trace_count', value is out of range [ -1, 2147483647 ], got: 2147483648"),
        ({"trace_rate": "4294967296"}, 400, "value is out of range [ 0, 4294967295 ]"),
        ([1], 400, "JSON object"),
    ]
    for body, status, message in cases:
        got_status, got = setting(urls["http"], "POST", "/v2/trace/setting", body)
        assert got_status == status and message in got["error"], (body, got)
    assert setting(urls["http"], "GET", "/v2/trace/setting")[0] == 200


def test_a_level_without_a_trace_file_is_refused_as_in_triton(make_repo, servers):
    """Traces go to the trace file: with none, a level would trace nothing (it answered
    200 and did nothing); Triton 2.51 refuses it with these words."""
    server = servers.start(make_repo("identity"))
    message = "Attempting to set invalid trace setting :trace file name is not given"
    with pytest.raises(dlserve.InvalidArgumentError, match=message):
        server.engine.tracer.update(None, {"trace_level": ["TIMESTAMPS"]})
    with pytest.raises(dlserve.InvalidArgumentError, match=message):
        server.engine.tracer.update("identity", {"trace_level": ["TENSORS"]})
    assert server.engine.tracer.update(None, {"trace_level": ["OFF"], "trace_rate": "5"})["trace_rate"] == "5"
    for model in (None, "identity"):  # clearing a level sets none (tritonclient sends null; Triton: 200)
        assert server.engine.tracer.update(model, {"trace_level": None})["trace_level"] == ["OFF"]


def test_an_unloaded_models_trace_settings_are_refused_as_triton_does(make_repo, servers):
    server = servers.start(make_repo("identity"), model_control_mode=dlserve.ModelControlMode.EXPLICIT)
    message = "Request for unknown model : identity"
    with pytest.raises(dlserve.InvalidArgumentError, match=message):
        server.engine.tracer.settings("identity")  # in the repository, not loaded
    server.load("identity")
    assert server.engine.tracer.update("identity", {"trace_rate": "3"})["trace_rate"] == "3"
    server.unload("identity", wait_until_unloaded=True)
    for call in (lambda: server.engine.tracer.settings("identity"),
                 lambda: server.engine.tracer.update("identity", {"trace_rate": "2"})):
        with pytest.raises(dlserve.InvalidArgumentError, match=message):
            call()
    server.load("identity")  # its own settings are still there, as in Triton
    assert server.engine.tracer.settings("identity")["trace_rate"] == "3"


def test_trace_is_listed_as_an_extension(traced):
    _, urls, _ = traced
    with httpclient.InferenceServerClient(urls["http"]) as client:
        assert "trace" in client.get_server_metadata()["extensions"]


def test_options_refuse_bad_trace_settings(tmp_path):
    for settings, message in [
        (dlserve.TraceSettings(rate=-1), "trace_rate"),
        (dlserve.TraceSettings(level=("SOMETIMES",)), "unknown trace level"),
        (dlserve.TraceSettings(mode="jaeger"), "invalid value for trace mode option: jaeger"),
    ]:
        with pytest.raises(dlserve.TritonError, match=message):
            dlserve.Options(model_repository=str(tmp_path), trace=settings).engine_settings()
