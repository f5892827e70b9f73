"""OpenTelemetry trace mode (``--trace-config mode=opentelemetry``): the spans a real
OTLP/HTTP receiver (a socket server here) gets, in the shape Triton 2.51 exports them
(captured side by side: InferRequest > model > compute, BLS calls under their caller's
model span, the client's W3C traceparent honoured), what a model's
``request.trace().get_context()`` returns, and the trace-setting endpoints in that mode."""

from __future__ import annotations

import contextlib
import http.server
import json
import logging
import shutil
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import dlserve
from dlserve.engine.otel import OtelSettings
from dlserve.engine.tracing import Tracer
from dlserve.frontends import KServeGrpc, KServeHttp

from ..conftest import EXAMPLES, MODELS, ServerHarness, frontend

A = np.arange(4, dtype=np.float32)
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Receiver(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP collector that keeps every POST's path, content type and JSON body."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, str, dict]] = []
        received = self.posts

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.append((self.path, self.headers["Content-Type"], json.loads(body)))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    def spans(self) -> list[dict]:
        return [
            span
            for _, _, body in self.posts
            for resource in body["resourceSpans"]
            for scope in resource["scopeSpans"]
            for span in scope["spans"]
        ]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def start(
    tmp_path: Path, receiver: Receiver, delay_ms: int, extra: tuple = (),
    test_models: tuple[str, ...] = ("bls_traced",), **trace: object,
) -> tuple[ServerHarness, dlserve.Server]:
    repo = tmp_path / "repo"
    for name in ("add_sub", "identity", "pipeline"):
        shutil.copytree(EXAMPLES / name, repo / name)
    for name in test_models:
        shutil.copytree(MODELS / name, repo / name)
    settings = dlserve.TraceSettings(
        mode="opentelemetry", level=("TIMESTAMPS",), **{"rate": 1, **trace},
        opentelemetry=OtelSettings((
            ("url", f"127.0.0.1:{receiver.server_address[1]}/v1/traces"),
            ("resource", "service.name=otel-test"),
            ("resource", "deployment=ci"),
            ("bsp_schedule_delay", str(delay_ms)),
            *extra,
        )),
    )
    harness = ServerHarness()
    server = harness.start(repo, trace=settings)
    deadline = time.monotonic() + 60
    while not server.ready():
        assert time.monotonic() < deadline, "models not ready"
        time.sleep(0.05)
    return harness, server


@contextlib.contextmanager
def client_of(
    tmp_path: Path, receiver: Receiver, protocol: str, delay_ms: int = 20, extra: tuple = (),
    **trace: object,
) -> Iterator[httpclient.InferenceServerClient | grpcclient.InferenceServerClient]:
    """A tritonclient of a server exporting to ``receiver`` (``extra`` OpenTelemetry
    settings); the server stops on leaving (so what it still held has been sent)."""
    harness, server = start(tmp_path, receiver, delay_ms, extra, **trace)
    module, service = (httpclient, KServeHttp) if protocol == "http" else (grpcclient, KServeGrpc)
    try:
        for port in frontend(service, server):
            with module.InferenceServerClient(f"127.0.0.1:{port}") as client:
                yield client
    finally:
        harness.close()


def inputs(module):
    tensors = [module.InferInput(name, [4], "FP32") for name in ("INPUT0", "INPUT1")]
    for tensor in tensors:
        tensor.set_data_from_numpy(A)
    return tensors


def by_name(spans: list[dict]) -> dict[str, dict]:
    return {span["name"]: span for span in spans}


def attributes(span: dict) -> dict[str, object]:
    return {a["key"]: next(iter(a["value"].values())) for a in span.get("attributes", [])}


def events(span: dict) -> list[str]:
    return [event["name"] for event in span["events"]]


def test_spans_reach_the_collector_as_triton_exports_them(tmp_path, receiver):
    # A long schedule delay: the spans are sent when the server stops, not before.
    harness, server = start(tmp_path, receiver, delay_ms=60_000)
    try:
        for http_port in frontend(KServeHttp, server):
            for grpc_port in frontend(KServeGrpc, server):
                with httpclient.InferenceServerClient(f"127.0.0.1:{http_port}") as client:
                    client.infer(
                        "add_sub", inputs(httpclient), request_id="h1",
                        headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
                                 "tracestate": "vendor=1"},
                    )
                with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}") as client:
                    result = client.infer("bls_traced", inputs(grpcclient), request_id="g1")
                    context = json.loads(result.as_numpy("TRACE_CONTEXT")[0])
                time.sleep(0.5)
                assert receiver.posts == []  # (still batched)
    finally:
        harness.close()
    path, content_type, body = receiver.posts[0]
    assert (path, content_type) == ("/v1/traces", "application/json")
    resource = attributes(body["resourceSpans"][0]["resource"])
    assert resource["service.name"] == "otel-test" and resource["deployment"] == "ci"
    assert body["resourceSpans"][0]["scopeSpans"][0]["scope"] == {"name": "triton-server"}

    spans = receiver.spans()
    assert all(span["kind"] == 2 and "status" not in span for span in spans)
    http_trace = [span for span in spans if span["traceId"] == CLIENT_TRACE]
    named = by_name(http_trace)
    request, model, compute = named["InferRequest"], named["add_sub"], named["compute"]
    assert len(http_trace) == 3
    assert request["parentSpanId"] == CLIENT_SPAN  # the client's span, from its traceparent
    assert all(span["traceState"] == "vendor=1" for span in http_trace)
    assert model["parentSpanId"] == request["spanId"] and compute["parentSpanId"] == model["spanId"]
    assert events(request) == [
        "HTTP_RECV_START", "HTTP_RECV_END", "INFER_RESPONSE_COMPLETE", "HTTP_SEND_START",
        "HTTP_SEND_END",
    ]
    assert events(model) == ["REQUEST_START", "QUEUE_START", "REQUEST_END"]
    assert events(compute) == [
        "COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END",
    ]
    assert attributes(model) == {
        "triton.model_name": "add_sub", "triton.model_version": "1",
        "triton.trace_id": attributes(model)["triton.trace_id"], "triton.trace_parent_id": "0",
        "triton.request_id": "h1",
    }
    starts = {span["name"]: int(span["startTimeUnixNano"]) for span in http_trace}
    ends = {span["name"]: int(span["endTimeUnixNano"]) for span in http_trace}
    assert starts["InferRequest"] <= starts["add_sub"] <= starts["compute"]
    assert ends["compute"] <= ends["add_sub"] <= ends["InferRequest"]
    assert model["startTimeUnixNano"] == model["events"][0]["timeUnixNano"]
    for span in http_trace:  # every event within its span
        times = [int(event["timeUnixNano"]) for event in span["events"]]
        begins, ends_at = int(span["startTimeUnixNano"]), int(span["endTimeUnixNano"])
        assert begins <= min(times) <= max(times) <= ends_at
    assert abs(ends["InferRequest"] - time.time_ns()) < 120e9  # Unix time, not monotonic

    # The BLS request: its call to add_sub is in the same trace, under the caller's model span.
    grpc_trace = [span for span in spans if span["traceId"] != CLIENT_TRACE]
    assert len({span["traceId"] for span in grpc_trace}) == 1 and len(grpc_trace) == 5
    root = by_name(grpc_trace)["InferRequest"]
    assert "parentSpanId" not in root and events(root)[0] == "GRPC_WAITREAD_START"
    caller = by_name(grpc_trace)["bls_traced"]
    callee = by_name(grpc_trace)["add_sub"]
    assert caller["parentSpanId"] == root["spanId"] and callee["parentSpanId"] == caller["spanId"]
    assert attributes(callee)["triton.trace_parent_id"] == attributes(caller)["triton.trace_id"]
    assert attributes(caller)["triton.request_id"] == "g1"
    assert attributes(callee)["triton.request_id"] == "child-of-g1"
    computes = [span for span in grpc_trace if span["name"] == "compute"]
    parents = sorted(span["parentSpanId"] for span in computes)
    assert parents == sorted([caller["spanId"], callee["spanId"]])
    # What the model's get_context() returned: its own span, in W3C form.
    assert context == {"traceparent": f"00-{root['traceId']}-{caller['spanId']}-01"}


def test_settings_in_opentelemetry_mode(tmp_path, receiver):
    with client_of(tmp_path, receiver, "http") as client:
        settings = client.get_trace_settings()
        assert settings == {
            "trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "-1",
            "trace_mode": "opentelemetry",
            "url": f"127.0.0.1:{receiver.server_address[1]}/v1/traces",
            "resource": ["service.name=otel-test", "deployment=ci"],
            "bsp_schedule_delay": "20", "bsp_max_export_batch_size": "512",
            "bsp_max_queue_size": "2048",
        }
        updated = client.update_trace_settings(settings={"trace_rate": "2"})
        assert updated["trace_rate"] == "2"
        for change in ({"url": "elsewhere:4318"}, {"trace_mode": "triton"}):
            with pytest.raises(InferenceServerException, match="can not be updated"):
                client.update_trace_settings(settings=change)
        # Every second request is sampled now; with a short delay the spans
        # arrive while the server runs.
        for _ in range(4):
            client.infer("add_sub", inputs(httpclient))
        assert sorted(span["name"] for span in wait_for_spans(receiver, 6)) == sorted(
            ["InferRequest", "add_sub", "compute"] * 2
        )


def test_an_unreachable_collector_loses_spans_not_requests(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(EXAMPLES / "add_sub", repo / "add_sub")
    settings = dlserve.TraceSettings(
        mode="opentelemetry", level=("TIMESTAMPS",), rate=1,
        opentelemetry=OtelSettings(
            (("url", "127.0.0.1:9/v1/traces"), ("bsp_schedule_delay", "10"))
        ),
    )
    harness = ServerHarness()
    try:
        server = harness.start(repo, trace=settings)
        for http_port in frontend(KServeHttp, server):
            with httpclient.InferenceServerClient(f"127.0.0.1:{http_port}") as client:
                for _ in range(3):
                    result = client.infer("add_sub", inputs(httpclient))
                    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + A)
    finally:
        harness.close()


def wait_for_spans(receiver: Receiver, count: int) -> list[dict]:
    deadline = time.monotonic() + 10
    while len(receiver.spans()) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return receiver.spans()


def test_spans_go_out_as_requests_end_whatever_the_count_and_log_frequency(tmp_path, receiver):
    """Unlike trace files, spans are not held for a count or a log frequency; the count
    still says how many requests are sampled, and a client's traceparent is traced past it."""
    with client_of(tmp_path, receiver, "http", count=2) as client:
        client.update_trace_settings(settings={"log_frequency": "10"})
        client.infer("add_sub", inputs(httpclient))
        assert len(wait_for_spans(receiver, 3)) == 3  # (count 2, one used: not held)
        for _ in range(3):
            client.infer("add_sub", inputs(httpclient))
        parent = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
        client.infer("add_sub", inputs(httpclient), headers=parent)
        spans = wait_for_spans(receiver, 9)
        assert client.get_trace_settings()["trace_count"] == "0"
    assert len(spans) == 9  # two sampled by the count, one by its traceparent
    assert sum(span["traceId"] == CLIENT_TRACE for span in spans) == 3


def test_an_ensemble_s_steps_sit_under_its_model_span(tmp_path, receiver):
    with client_of(tmp_path, receiver, "grpc") as client:
        client.infer("pipeline", inputs(grpcclient))
        spans = wait_for_spans(receiver, 8)
    ensemble = by_name(spans)["pipeline"]
    assert by_name(spans)["InferRequest"]["spanId"] == ensemble["parentSpanId"]
    steps = [span for span in spans if span["name"] in ("add_sub", "identity")]
    assert len(steps) == 3 and all(s["parentSpanId"] == ensemble["spanId"] for s in steps)
    computes = [span for span in spans if span["name"] == "compute"]
    assert sorted(c["parentSpanId"] for c in computes) == sorted(s["spanId"] for s in steps)
    assert len(spans) == 8  # (an ensemble has no compute span of its own)


def test_grpc_settings_refuse_changes_but_take_back_what_they_showed(tmp_path, receiver):
    with client_of(tmp_path, receiver, "grpc") as client:
        shown = client.get_trace_settings(as_json=True)["settings"]
        assert shown["resource"]["value"] == ["service.name=otel-test", "deployment=ci"]
        with pytest.raises(InferenceServerException, match="'resource' can not be updated"):
            client.update_trace_settings(settings={"resource": ["a=1", "b=2"]})
        again = client.update_trace_settings(
            settings={"resource": shown["resource"]["value"], "trace_rate": "3"},
            as_json=True,
        )
        assert again["settings"]["trace_rate"]["value"] == ["3"]


def test_level_tensors_alone_exports_a_bare_request_span(tmp_path, receiver):
    with client_of(tmp_path, receiver, "http") as client:
        client.update_trace_settings(settings={"trace_level": ["TENSORS"]})
        result = client.infer("bls_traced", inputs(httpclient))
        assert result.as_numpy("TRACE_CONTEXT")[0] == b"None"  # (no timestamps)
        wait_for_spans(receiver, 1)
        time.sleep(0.2)  # (nothing else comes)
    assert [(s["name"], s["events"], "attributes" in s) for s in receiver.spans()] == [
        ("InferRequest", [], False)
    ]


def test_half_a_small_queue_starts_an_export(tmp_path, receiver):
    """As OpenTelemetry's batch span processor: an export starts once half the queue waits,
    not only a full batch (512 by default) or the schedule delay (a minute here)."""
    queue = (("bsp_max_queue_size", "10"),)
    with client_of(tmp_path, receiver, "http", 60_000, queue) as client:
        for _ in range(2):
            client.infer("add_sub", inputs(httpclient))
        assert len(wait_for_spans(receiver, 6)) == 6


def test_a_stop_cuts_short_a_post_the_collector_does_not_answer(tmp_path):
    silent = socket.create_server(("127.0.0.1", 0))  # connects (its backlog), never answers
    repo = tmp_path / "repo"
    shutil.copytree(EXAMPLES / "add_sub", repo / "add_sub")
    settings = dlserve.TraceSettings(
        mode="opentelemetry", level=("TIMESTAMPS",), rate=1,
        opentelemetry=OtelSettings((
            ("url", f"127.0.0.1:{silent.getsockname()[1]}/v1/traces"),
            ("bsp_schedule_delay", "10"),
        )),
    )
    harness = ServerHarness()
    try:
        server = harness.start(repo, trace=settings)
        for http_port in frontend(KServeHttp, server):
            with httpclient.InferenceServerClient(f"127.0.0.1:{http_port}") as client:
                client.infer("add_sub", inputs(httpclient))
        time.sleep(0.2)  # (the post under way)
    finally:
        harness.close()
        silent.close()
    assert not [t for t in threading.enumerate() if t.name == "dlserve-otlp"]


def test_generate_takes_the_client_s_traceparent(tmp_path, receiver):
    harness, server = start(tmp_path, receiver, 20)
    try:
        for http_port in frontend(KServeHttp, server):
            body = json.dumps({"INPUT0": A.tolist(), "INPUT1": A.tolist()})
            request = urllib.request.Request(
                f"http://127.0.0.1:{http_port}/v2/models/add_sub/generate", body.encode(),
                {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
            )
            with urllib.request.urlopen(request, timeout=30) as reply:
                assert json.loads(reply.read())["OUTPUT0"] == (A + A).tolist()
            spans = wait_for_spans(receiver, 3)
    finally:
        harness.close()
    root = by_name(spans)["InferRequest"]
    assert all(span["traceId"] == CLIENT_TRACE for span in spans)
    assert root["parentSpanId"] == CLIENT_SPAN
    assert events(root)[:2] == ["HTTP_RECV_START", "HTTP_RECV_END"]


def test_a_cancelled_request_s_spans_still_nest(tmp_path, receiver):
    """A request the client gave up on ends (REQUEST_END) before its execute does: its
    model span still holds its compute span, as a trace viewer expects."""
    harness, server = start(tmp_path, receiver, 20, test_models=("faulty",))
    try:
        for grpc_port in frontend(KServeGrpc, server):
            with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}") as client:
                tensor = grpcclient.InferInput("INPUT0", [2], "FP32")
                tensor.set_data_from_numpy(A[:2])
                with pytest.raises(InferenceServerException, match="Deadline"):
                    client.infer(
                        "faulty", [tensor], parameters={"mode": "sleep:1"}, client_timeout=0.2
                    )
                spans = wait_for_spans(receiver, 3)
    finally:
        harness.close()
    model, compute = by_name(spans)["faulty"], by_name(spans)["compute"]
    assert int(model["endTimeUnixNano"]) >= int(compute["endTimeUnixNano"])
    assert int(compute["endTimeUnixNano"]) - int(compute["startTimeUnixNano"]) >= 0.9e9


def test_a_trace_that_cannot_become_spans_loses_only_itself(receiver, caplog):
    """The exporter's thread outlives a bug in one trace's conversion (every later span
    would be lost with it)."""
    caplog.set_level(logging.WARNING, logger="dlserve.trace")  # (whatever servers set)
    url = f"127.0.0.1:{receiver.server_address[1]}/v1/traces"
    settings = dlserve.TraceSettings(
        mode="opentelemetry", level=("TIMESTAMPS",), rate=1,
        opentelemetry=OtelSettings((("url", url), ("bsp_schedule_delay", "10"))),
    )
    tracer = Tracer(settings, has_model=lambda name: True)
    try:
        broken = tracer.start("m", "")
        broken.span_ids = None  # (what a bug could leave)
        broken.release()
        trace = tracer.start("m", "r")
        trace.record("REQUEST_START")
        trace.record("REQUEST_END")
        trace.release()
        names = sorted(span["name"] for span in wait_for_spans(receiver, 2))
    finally:
        tracer.close()
    assert names == ["InferRequest", "m"]
    assert "could not be made into spans" in caplog.text


def finished_trace(tracer: Tracer) -> None:
    trace = tracer.start("m", "")
    trace.record("REQUEST_START")
    trace.record("REQUEST_END")
    trace.release()


def test_a_host_that_cannot_be_named_loses_spans_not_the_exporter(caplog):
    caplog.set_level(logging.WARNING, logger="dlserve.trace")  # (whatever servers set)
    settings = dlserve.TraceSettings(
        mode="opentelemetry", level=("TIMESTAMPS",), rate=1,
        opentelemetry=OtelSettings((("url", "a..b:4318/v1/traces"), ("bsp_schedule_delay", "10"))),
    )
    tracer = Tracer(settings, has_model=lambda name: True)
    try:
        for _ in range(3):
            finished_trace(tracer)
            time.sleep(0.1)
        exporters = [t for t in threading.enumerate() if t.name == "dlserve-otlp"]
        assert exporters and all(t.is_alive() for t in exporters)
    finally:
        tracer.close()
    assert "span(s) not exported to http://a..b:4318/v1/traces" in caplog.text


def test_traces_waiting_on_a_silent_collector_are_bounded_by_the_queue(caplog):
    caplog.set_level(logging.WARNING, logger="dlserve.trace")  # (whatever servers set)
    silent = socket.create_server(("127.0.0.1", 0))  # connects (its backlog), never answers
    url = f"127.0.0.1:{silent.getsockname()[1]}/v1/traces"
    settings = dlserve.TraceSettings(
        mode="opentelemetry", level=("TIMESTAMPS",), rate=1,
        opentelemetry=OtelSettings((
            ("url", url), ("bsp_schedule_delay", "10"), ("bsp_max_export_batch_size", "2"),
            ("bsp_max_queue_size", "9"),
        )),
    )
    tracer = Tracer(settings, has_model=lambda name: True)
    try:
        finished_trace(tracer)
        time.sleep(0.3)  # (its post hangs)
        for _ in range(200):
            finished_trace(tracer)
        assert len(tracer._writer._traces) <= 3  # (9 spans' worth: the rest dropped)
    finally:
        tracer.close()
        silent.close()
    assert "trace(s) dropped: more than bsp_max_queue_size waited" in caplog.text
    # The stop cut the hung post short, and posted none of the batches behind it.
    assert not [t for t in threading.enumerate() if t.name == "dlserve-otlp"]
