"""The Prometheus endpoint (``dlserve.frontends.Metrics``) scraped over HTTP and parsed
with prometheus-client, next to what real Triton 2.51 exposes
(tests/data/triton_reference/metrics_after_3_add_sub.txt and README section 7).

Covered: Triton's families with their TYPE and HELP texts, labels, counts after
successes / an execute exception / a per-request error, durations against the
statistics extension, the pending-request gauge, nv_cpu_*; custom metrics that a
model declares with ``pb_utils.MetricFamily`` (counter, gauge, histogram), read back
with ``value()`` and seen on /metrics, and the errors pb_utils raises in the model;
the application's own metrics (``dlserve.MetricFamily``, Triton's ``tritonserver``
ones) on /metrics and in ``Server.metrics()``, gone with their objects; the service's options and its answers to other paths and verbs.
Known bugs are ``xfail(strict=True)`` with the reason.
"""

from __future__ import annotations

import http.client
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import dlserve
from dlserve.frontends import KServeHttp, Metrics

from ..conftest import MODELS, ServerHarness

REFERENCE_DIR = Path(__file__).parent.parent / "data" / "triton_reference"
REFERENCE = REFERENCE_DIR / "metrics_after_3_add_sub.txt"
FAILURE_REASONS = {"REJECTED", "CANCELED", "BACKEND", "OTHER"}
DURATIONS = {
    "nv_inference_queue_duration_us": "queue",
    "nv_inference_compute_input_duration_us": "compute_input",
    "nv_inference_compute_infer_duration_us": "compute_infer",
    "nv_inference_compute_output_duration_us": "compute_output",
}
A16 = np.arange(16, dtype=np.float32)
ONE = np.ones(1, dtype=np.float32)

# -- a model with custom metrics ------------------------------------------------------------
METRICS_CONFIG = """
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_FP64 dims: [ -1 ] } ]
output [
  { name: "COUNTER" data_type: TYPE_FP64 dims: [ 1 ] },
  { name: "GAUGE" data_type: TYPE_FP64 dims: [ 1 ] }
]
"""
METRICS_MODEL = '''
import json

import numpy as np
import triton_python_backend_utils as pb_utils

COUNTER = "dlserve_test_requests"
GAUGE = "dlserve_test_level"
HISTOGRAM = "dlserve_test_sizes"
COUNTER_HELP = "Requests seen by the test model"


class TritonPythonModel:
    def initialize(self, args):
        self.counters = pb_utils.MetricFamily(
            name=COUNTER, description=COUNTER_HELP, kind=pb_utils.MetricFamily.COUNTER
        )
        self.gauges = pb_utils.MetricFamily(
            name=GAUGE, description="Last level set", kind=pb_utils.MetricFamily.GAUGE
        )
        self.histograms = pb_utils.MetricFamily(
            name=HISTOGRAM, description="Observed sizes", kind=pb_utils.MetricFamily.HISTOGRAM
        )
        self.counter = self.counters.Metric(labels={"model": "metrics_model", "kind": "plain"})
        self.other = self.counters.Metric(labels={"model": "metrics_model", "kind": "other"})
        self.gauge = self.gauges.Metric(labels={"model": "metrics_model"})
        self.histogram = self.histograms.Metric(
            labels={"model": "metrics_model"}, buckets=[1.0, 2.5, 10.0]
        )

    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _one(self, request):
        op = json.loads(request.parameters()).get("op", "update")
        x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
        if op == "update":  # x = [counter increment, gauge value, observations...]
            self.counter.increment(float(x[0]))
            self.gauge.set(float(x[1]))
            for value in x[2:]:
                self.histogram.observe(float(value))
            return self._values(self.counter.value(), self.gauge.value())
        if op == "free_names":  # as in Triton: nv_ names the server does not use; no buckets
            # (the families kept: as Triton's, a metric whose family is gone refuses to work)
            self.thing = pb_utils.MetricFamily(
                name="nv_custom_thing", description="a model's", kind=pb_utils.MetricFamily.COUNTER
            )
            self.thing.Metric(labels={"model": "metrics_model"}).increment(2.0)
            self.open = pb_utils.MetricFamily(
                name="dlserve_test_open", description="no buckets", kind=pb_utils.MetricFamily.HISTOGRAM
            )
            self.open.Metric(labels={}, buckets=[]).observe(3.0)
            return self._values(0.0, 0.0)
        if op == "drop_counters":  # the model lets go of its counter family
            del self.counter, self.other, self.counters
            return self._values(0.0, 0.0)
        if op == "drop_family":  # a family the model lets go of takes its metrics along
            dropped = pb_utils.MetricFamily(
                name="dlserve_test_dropped", description="let go", kind=pb_utils.MetricFamily.COUNTER
            )
            metric = dropped.Metric(labels={"model": "metrics_model"})
            metric.increment(float(x[0]))
            seen = metric.value()
            self.empty = pb_utils.MetricFamily(  # (kept, with no metric: Triton shows nothing)
                name="dlserve_test_empty", description="no metrics", kind=pb_utils.MetricFamily.GAUGE
            )
            del metric, dropped
            return self._values(seen, 0.0)
        if op == "shared":  # the same family and labels declared again share the value
            family = pb_utils.MetricFamily(  # (worded otherwise: the first description stays)
                name=COUNTER, description="Reworded", kind=pb_utils.MetricFamily.COUNTER
            )
            metric = family.Metric(labels={"kind": "plain", "model": "metrics_model"})
            metric.increment(float(x[0]))
            return self._values(self.counter.value(), self.other.value())
        try:
            ERRORS[op](self)
        except pb_utils.TritonModelException as exc:
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError(f"TritonModelException: {exc}")
            )
        except Exception as exc:  # the wrong kind of exception
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError(f"{type(exc).__name__}: {exc}")
            )
        return pb_utils.InferenceResponse(error=pb_utils.TritonError("no exception"))

    def _values(self, counter, gauge):
        return pb_utils.InferenceResponse([
            pb_utils.Tensor("COUNTER", np.array([counter], dtype=np.float64)),
            pb_utils.Tensor("GAUGE", np.array([gauge], dtype=np.float64)),
        ])


ERRORS = {
    "negative_increment": lambda m: m.counter.increment(-1.0),
    "set_counter": lambda m: m.counter.set(3.0),
    "observe_gauge": lambda m: m.gauge.observe(1.0),
    "histogram_without_buckets": lambda m: m.histograms.Metric(labels={"model": "x"}),
    "redeclare_other_kind": lambda m: pb_utils.MetricFamily(
        name=COUNTER, description=COUNTER_HELP, kind=pb_utils.MetricFamily.GAUGE
    ),
    "reserved_name": lambda m: pb_utils.MetricFamily(
        name="nv_inference_custom_thing", description="reserved", kind=pb_utils.MetricFamily.COUNTER
    ),
    "unsorted_buckets": lambda m: m.histograms.Metric(labels={"model": "x"}, buckets=[5.0, 1.0]),
    "repeated_bucket": lambda m: m.histograms.Metric(labels={"model": "x"}, buckets=[1.0, 1.0, 2.0]),
    "no_kind": lambda m: pb_utils.MetricFamily(name="dlserve_test_kindless", description="no kind"),
    "bad_kind": lambda m: pb_utils.MetricFamily("dlserve_test_kindless", "bad kind", 7),
    "bad_family_name": lambda m: pb_utils.MetricFamily("dlserve test", "x", m.counters.COUNTER),
    "bad_label_name": lambda m: m.counters.Metric(labels={"bad-label": "v"}),
    "label_not_text": lambda m: m.counters.Metric(labels={"model": 1}),
    "counter_buckets": lambda m: m.counters.Metric(labels={"model": "x"}, buckets=[1.0]),
    "increment_histogram": lambda m: m.histogram.increment(1.0),
    "set_histogram": lambda m: m.histogram.set(1.0),
    "observe_counter": lambda m: m.counter.observe(1.0),
    "histogram_value": lambda m: m.histogram.value(),
    "set_text": lambda m: m.gauge.set("1.5"),
    "app_owned": lambda m: pb_utils.MetricFamily(
        name="dlserve_test_app_owned", description="the application's", kind=pb_utils.MetricFamily.COUNTER
    ),
}
'''


# -- helpers -----------------------------------------------------------------------------
def get(port: int, path: str = "/metrics", method: str = "GET") -> tuple[int, dict[str, str], str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path)
        response = conn.getresponse()
        body = response.read().decode()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, body
    finally:
        conn.close()


def families(text: str) -> dict[str, object]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def scrape(port: int) -> tuple[str, dict[str, object]]:
    status, _, body = get(port)
    assert status == 200, body
    return body, families(body)


def value(fams: dict, name: str, **labels: str) -> float:
    """The one sample of family ``name`` whose labels are exactly ``labels``
    (counters: prometheus-client reports samples as <name>_total)."""
    found = [s.value for s in fams[name].samples if s.labels == labels]
    assert len(found) == 1, (name, labels, fams[name].samples)
    (result,) = found
    return result


def infer(server: dlserve.Server, model: str, inputs: dict, **kwargs):
    (response,) = server.model(model).infer(inputs=inputs, raise_on_error=False, **kwargs)
    return response


def stats(server: dlserve.Server, model: str) -> dict:
    return server.model(model).statistics()["model_stats"][0]


# -- servers -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def harness():
    h = ServerHarness()
    yield h
    h.close()


@pytest.fixture(scope="module")
def env(harness, tmp_path_factory):
    repo = tmp_path_factory.mktemp("metrics_repo")
    for name in ("add_sub", "faulty", "identity"):
        shutil.copytree(MODELS / name, repo / name)
    shutil.copytree(MODELS / "faulty", repo / "slow")  # for the load test only
    (repo / "metrics_model" / "1").mkdir(parents=True)
    (repo / "metrics_model" / "config.pbtxt").write_text(METRICS_CONFIG)
    (repo / "metrics_model" / "1" / "model.py").write_text(METRICS_MODEL)
    server = harness.start(repo)
    assert server.ready()
    service = Metrics(server, Metrics.Options(address="127.0.0.1", port=0))
    service.start()
    yield server, service.port
    service.stop()


@pytest.fixture(scope="module")
def server(env) -> dlserve.Server:
    return env[0]


@pytest.fixture(scope="module")
def port(env) -> int:
    return env[1]


@pytest.fixture(scope="module")
def traffic(server, port):
    """3 add_sub successes; faulty: 1 success, 2 execute exceptions, 1 per-request error."""
    for i in range(3):
        assert infer(server, "add_sub", {"INPUT0": A16 * i, "INPUT1": A16}).error is None
    assert infer(server, "faulty", {"INPUT0": ONE}).error is None
    for _ in range(2):
        error = infer(server, "faulty", {"INPUT0": ONE}, parameters={"mode": "raise"}).error
        assert isinstance(error, dlserve.InternalError) and "ValueError: boom" in str(error)
    error = infer(server, "faulty", {"INPUT0": ONE}, parameters={"mode": "error:INVALID_ARG"}).error
    assert isinstance(error, dlserve.InvalidArgumentError)
    text, fams = scrape(port)
    return {
        "text": text,
        "fams": fams,
        "stats": {name: stats(server, name) for name in ("add_sub", "faulty", "identity")},
    }


# -- Triton's families ---------------------------------------------------------------------
REFERENCE_FAMILIES = families(REFERENCE.read_text())


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name)
        for name in REFERENCE_FAMILIES
    ],
)
def test_every_triton_family_is_present_with_its_type_and_help(traffic, name):
    reference = REFERENCE_FAMILIES[name]
    ours = traffic["fams"].get(name)
    assert ours is not None, f"family {name} is missing"
    assert (ours.type, ours.documentation) == (reference.type, reference.documentation)
    help_line = rf"^# HELP {name} {re.escape(reference.documentation)}$"
    assert re.search(help_line, traffic["text"], re.MULTILINE)
    assert re.search(rf"^# TYPE {name} {reference.type}$", traffic["text"], re.MULTILINE)


def test_content_type_and_no_unexpected_nv_families(traffic, port):
    status, headers, _ = get(port)
    assert status == 200
    content_type = headers["content-type"]
    assert content_type.startswith("text/plain") and "charset=utf-8" in content_type
    extra = {n for n in traffic["fams"] if n.startswith("nv_") and not n.startswith("nv_gpu_")}
    assert extra <= set(REFERENCE_FAMILIES), extra - set(REFERENCE_FAMILIES)


def test_per_model_labels_and_all_zero_lines_from_start(traffic):
    fams = traffic["fams"]
    models = {"add_sub", "faulty", "identity", "slow", "metrics_model"}
    for name, family in fams.items():
        if not name.startswith("nv_inference_"):
            continue
        seen = {}
        for sample in family.samples:
            expected_keys = {"model", "version"}
            if name == "nv_inference_request_failure":
                expected_keys.add("reason")
            assert set(sample.labels) == expected_keys, (name, sample)
            assert sample.labels["version"] == "1"
            seen.setdefault(sample.labels["model"], set()).add(sample.labels.get("reason"))
        assert set(seen) == models, (name, seen)
        if name == "nv_inference_request_failure":
            assert all(reasons == FAILURE_REASONS for reasons in seen.values()), seen
    # a loaded model nobody called has every line, at 0
    for name, family in fams.items():
        if name.startswith("nv_inference_"):
            idle = [s.value for s in family.samples if s.labels["model"] == "identity"]
            assert idle and set(idle) == {0}, name
    # labels in alphabetical order, as Triton writes them
    failure = 'nv_inference_request_failure{model="faulty",reason="BACKEND",version="1"} 2'
    assert failure in traffic["text"]
    assert 'nv_inference_request_success{model="add_sub",version="1"} 3' in traffic["text"]


def test_counts_match_the_requests_sent(traffic):
    fams = traffic["fams"]
    add_sub = {"model": "add_sub", "version": "1"}
    faulty = {"model": "faulty", "version": "1"}
    assert value(fams, "nv_inference_request_success", **add_sub) == 3
    assert value(fams, "nv_inference_count", **add_sub) == 3
    assert value(fams, "nv_inference_exec_count", **add_sub) == 3
    for reason in FAILURE_REASONS:
        assert value(fams, "nv_inference_request_failure", reason=reason, **add_sub) == 0
    # faulty: the exceptions are BACKEND failures that still count as executions (not
    # inferences); the per-request error is a success, as in Triton's statistics
    assert value(fams, "nv_inference_request_success", **faulty) == 2
    assert value(fams, "nv_inference_request_failure", reason="BACKEND", **faulty) == 2
    for reason in FAILURE_REASONS - {"BACKEND"}:
        assert value(fams, "nv_inference_request_failure", reason=reason, **faulty) == 0
    assert value(fams, "nv_inference_count", **faulty) == 2
    assert value(fams, "nv_inference_exec_count", **faulty) == 4
    stats = traffic["stats"]["faulty"]
    inference = stats["inference_stats"]
    assert inference["success"]["count"] == 2 and inference["fail"]["count"] == 2
    assert stats["execution_count"] == 4 and stats["inference_count"] == 2


def test_durations_are_positive_and_match_the_statistics_extension(traffic):
    fams = traffic["fams"]
    for model in ("add_sub", "faulty"):
        labels = {"model": model, "version": "1"}
        inference = traffic["stats"][model]["inference_stats"]
        for metric, field in DURATIONS.items():
            us = value(fams, metric, **labels)
            assert us > 0, (model, metric)
            assert us == inference[field]["ns"] // 1000, (model, metric, us, inference[field])
    add_sub = traffic["stats"]["add_sub"]["inference_stats"]
    us = value(fams, "nv_inference_request_duration_us", model="add_sub", version="1")
    assert us > 0 and us == add_sub["success"]["ns"] // 1000
    # end to end includes the queue and the three compute phases
    parts = sum(value(fams, m, model="add_sub", version="1") for m in DURATIONS)
    assert us >= parts - 4  # each is rounded down on its own


def test_request_duration_counts_only_successful_requests(traffic):
    faulty = traffic["stats"]["faulty"]["inference_stats"]
    assert faulty["fail"]["ns"] >= 1000
    us = value(traffic["fams"], "nv_inference_request_duration_us", model="faulty", version="1")
    assert us == faulty["success"]["ns"] // 1000


def test_pending_count_is_zero_when_idle(traffic, port):
    _, fams = scrape(port)
    assert [s.value for s in fams["nv_inference_pending_request_count"].samples] == [0] * 5


def test_requests_waiting_for_a_busy_instance_are_pending_and_queued(server, port):
    before = stats(server, "slow")["inference_stats"]
    running = [
        server.model("slow").infer(inputs={"INPUT0": ONE}, parameters={"mode": mode})
        for mode in ("sleep:0.4", "sleep:0.2", "sleep:0.2")
    ]
    time.sleep(0.15)
    _, fams = scrape(port)
    pending = value(fams, "nv_inference_pending_request_count", model="slow", version="1")
    for responses in running:
        assert all(response.error is None for response in responses)
    after = stats(server, "slow")["inference_stats"]
    queue_s = (after["queue"]["ns"] - before["queue"]["ns"]) / 1e9
    infer_s = (after["compute_infer"]["ns"] - before["compute_infer"]["ns"]) / 1e9
    # Triton: the 2nd request waits 0.4 s, the 3rd 0.6 s; each computes only its own sleep
    assert (pending, queue_s >= 0.9, infer_s < 1.1) == (2, True, True), (pending, queue_s, infer_s)


def test_cpu_metrics_are_sane(traffic):
    fams = traffic["fams"]
    utilization = value(fams, "nv_cpu_utilization")
    total = value(fams, "nv_cpu_memory_total_bytes")
    used = value(fams, "nv_cpu_memory_used_bytes")
    assert 0.0 <= utilization <= 1.0
    with open("/proc/meminfo") as f:
        mem_total = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024
    assert total == mem_total
    assert 0 < used < total


# -- custom metrics --------------------------------------------------------------------------
def outputs(response) -> tuple[float, float]:
    assert response.error is None, response.error
    return (
        float(np.from_dlpack(response.outputs["COUNTER"])[0]),
        float(np.from_dlpack(response.outputs["GAUGE"])[0]),
    )


def test_custom_metrics_through_the_model_and_metrics(server, port):
    model = "metrics_model"
    first = infer(server, model, {"INPUT0": np.array([2.0, 7.5, 0.5, 1.0, 3.0, 100.0])})
    assert outputs(first) == (2.0, 7.5)
    second = infer(server, model, {"INPUT0": np.array([3.0, -1.25, 2.5])})
    assert outputs(second) == (5.0, -1.25)
    # the same family and labels declared again from execute: one shared value
    shared = infer(server, model, {"INPUT0": np.array([1.0])}, parameters={"op": "shared"})
    assert outputs(shared) == (6.0, 0.0)

    text, fams = scrape(port)
    counter = fams["dlserve_test_requests"]
    assert (counter.type, counter.documentation) == ("counter", "Requests seen by the test model")
    assert value(fams, "dlserve_test_requests", kind="plain", model="metrics_model") == 6.0
    assert value(fams, "dlserve_test_requests", kind="other", model="metrics_model") == 0.0
    assert 'dlserve_test_requests{kind="plain",model="metrics_model"} 6' in text
    gauge = fams["dlserve_test_level"]
    assert (gauge.type, gauge.documentation) == ("gauge", "Last level set")
    assert value(fams, "dlserve_test_level", model="metrics_model") == -1.25

    histogram = fams["dlserve_test_sizes"]
    assert (histogram.type, histogram.documentation) == ("histogram", "Observed sizes")
    samples = {(s.name, s.labels.get("le")): s.value for s in histogram.samples}
    assert all(s.labels["model"] == "metrics_model" for s in histogram.samples)
    # observed 0.5, 1.0, 3.0, 100.0, 2.5: buckets are cumulative and 'le' is inclusive;
    # bounds are written as Triton's prometheus-cpp writes them ("1", not "1.0")
    assert samples == {
        ("dlserve_test_sizes_bucket", "1"): 2,
        ("dlserve_test_sizes_bucket", "2.5"): 3,
        ("dlserve_test_sizes_bucket", "10"): 4,
        ("dlserve_test_sizes_bucket", "+Inf"): 5,
        ("dlserve_test_sizes_sum", None): 107.0,
        ("dlserve_test_sizes_count", None): 5,
    }, samples


# Triton 2.51's words, side by side (its backend names the model instance that asked)
ASKED = "Failed to process the request for model 'metrics_model_0', message: "
FAMILY = f"Error when creating MetricFamily: {ASKED}"
METRIC = f"Error when creating Metric: {ASKED}"
UNSORTED = f"{METRIC}Bucket Boundaries must be strictly sorted"


def refused(operation: str, kind: str, method: str) -> str:
    reason = f"TRITONSERVER_METRIC_KIND_{kind} does not support {method}"
    return f"Failed to {operation} metric value: {ASKED}{reason}"


@pytest.mark.parametrize(
    "op,message",
    [
        (
            "negative_increment",
            f"Failed to increment metric value: {ASKED}TRITONSERVER_METRIC_KIND_COUNTER can only "
            "be incremented monotonically by non-negative values.",
        ),
        ("set_counter", refused("set", "COUNTER", "Set")),
        ("observe_gauge", refused("observe", "GAUGE", "Observe")),
        ("observe_counter", refused("observe", "COUNTER", "Observe")),
        ("increment_histogram", refused("increment", "HISTOGRAM", "Increment")),
        ("set_histogram", refused("set", "HISTOGRAM", "Set")),
        ("histogram_value", refused("get", "HISTOGRAM", "Value")),
        ("histogram_without_buckets", "Failed to create metric. Missing required buckets."),
        ("counter_buckets", "Failed to create metric. Unexpected buckets found."),
        ("redeclare_other_kind", f"{FAMILY}Family name already exists with different type"),
        ("bad_family_name", f"{FAMILY}Invalid metric name"),
        (  # (a refusal of dlserve's own, in its words under Triton's)
            "reserved_name",
            f"{FAMILY}metric family name 'nv_inference_custom_thing' is reserved",
        ),
        ("unsorted_buckets", UNSORTED),
        ("repeated_bucket", UNSORTED),
        ("bad_label_name", f"{METRIC}Invalid label name"),
        ("label_not_text", f"{METRIC}attempt to access JSON non-string as string"),
        ("no_kind", "TypeError: MetricFamily.__init__() missing 1 required positional argument: 'kind'"),
        (
            "bad_kind",
            "TypeError: __init__(): incompatible constructor arguments. The following argument "
            "types are supported:\n    1. c_python_backend_utils.MetricFamily(name: str, "
            "description: str, kind: c_python_backend_utils.MetricKind)\n\nInvoked with: "
            "'dlserve_test_kindless', 'bad kind', 7",
        ),
        (
            "set_text",
            "TypeError: set(): incompatible function arguments. The following argument types are "
            "supported:\n    1. (self: c_python_backend_utils.Metric, arg0: float) -> None\n\n"
            "Invoked with: <",
        ),
    ],
)
def test_metric_misuse_raises_triton_model_exception_in_the_model(server, port, op, message):
    """As Triton 2.51 raises them, compared side by side."""
    before = scrape(port)[0]
    response = infer(server, "metrics_model", {"INPUT0": np.array([1.0])}, parameters={"op": op})
    assert response.error is not None
    expected = message if message.startswith("TypeError") else f"TritonModelException: {message}"
    assert str(response.error).startswith(expected), str(response.error)
    text, fams = scrape(port)
    # nothing was applied or declared
    assert "nv_inference_custom_thing" not in text and "dlserve_test_kindless" not in text
    assert fams["dlserve_test_requests"].type == "counter"
    def custom(t: str) -> list[str]:
        return [line for line in t.splitlines() if line.startswith("dlserve_test_")]

    assert custom(text) == custom(before)


def test_models_may_name_families_nv_and_leave_histograms_without_buckets(server, port):
    response = infer(server, "metrics_model", {"INPUT0": np.array([1.0])}, parameters={"op": "free_names"})
    assert response.error is None, response.error
    text = scrape(port)[0]
    assert 'nv_custom_thing{model="metrics_model"} 2' in text.splitlines()
    assert [line for line in text.splitlines() if line.startswith("dlserve_test_open_")] == [
        "dlserve_test_open_count 1", "dlserve_test_open_sum 3", 'dlserve_test_open_bucket{le="+Inf"} 1',
    ]  # (in Triton 2.51's order)


def test_a_family_the_model_lets_go_of_leaves_with_its_metrics_as_in_triton(server, port):
    """Triton 2.51, measured side by side: once a model drops its last MetricFamily object
    of a name, the family's samples leave /metrics, and declared again, its metrics start
    from zero; a family without metrics shows no lines at all."""
    for _ in range(2):  # (the second time from zero again, not 2.5 + 2.5)
        response = infer(server, "metrics_model", {"INPUT0": np.array([2.5])}, parameters={"op": "drop_family"})
        assert response.error is None, response.error
        assert outputs(response)[0] == 2.5
        text = scrape(port)[0]
        assert "dlserve_test_dropped" not in text
        assert "dlserve_test_empty" not in text
    assert 'dlserve_test_requests{kind="plain",model="metrics_model"}' in text  # (the others stay)


def explicit_metrics_server(servers: Any, tmp_path: Path) -> dlserve.Server:
    """A server in explicit mode with metrics_model loaded, which the test may reload."""
    (tmp_path / "metrics_model" / "1").mkdir(parents=True)
    (tmp_path / "metrics_model" / "config.pbtxt").write_text(METRICS_CONFIG)
    (tmp_path / "metrics_model" / "1" / "model.py").write_text(METRICS_MODEL)
    return servers.start(
        tmp_path, model_control_mode=dlserve.ModelControlMode.EXPLICIT, startup_models=["metrics_model"]
    )


def test_a_model_s_metrics_outlive_its_unload_and_reload_as_in_triton(servers, tmp_path):
    """Upstream custom_metrics_reload_test, as Triton 2.51 passes it: the worker's own
    end (its objects torn down after finalize) is not the model letting its families go."""
    server = explicit_metrics_server(servers, tmp_path)
    line = 'dlserve_test_requests{kind="plain",model="metrics_model"}'
    for expected in (2, 4):
        response = infer(server, "metrics_model", {"INPUT0": np.array([2.0, 0.0])})
        assert response.error is None, response.error
        assert f"{line} {expected}" in server.metrics()
        server.unload("metrics_model", wait_until_unloaded=True)
        assert f"{line} {expected}" in server.metrics()
        server.load("metrics_model")


def test_a_reloaded_model_letting_go_of_a_family_takes_its_metrics_along(servers, tmp_path):
    """The unloaded worker's objects held the family no more once it ended (its metrics
    stay, as above): the reloaded model letting go of its own clears them, as in Triton.
    They used to count as holding it for good, and the metrics stayed."""
    server = explicit_metrics_server(servers, tmp_path)
    line = 'dlserve_test_requests{kind="plain",model="metrics_model"}'
    assert infer(server, "metrics_model", {"INPUT0": np.array([2.0, 0.0])}).error is None
    server.unload("metrics_model", wait_until_unloaded=True)
    server.load("metrics_model")
    assert f"{line} 2" in server.metrics()
    response = infer(server, "metrics_model", {"INPUT0": np.array([0.0])}, parameters={"op": "drop_counters"})
    assert response.error is None, response.error
    assert "dlserve_test_requests{" not in server.metrics()
    assert 'dlserve_test_level{model="metrics_model"}' in server.metrics()  # (still held)


def test_without_a_loaded_model_there_are_no_inference_families_as_in_triton(servers, make_repo):
    # (upstream checks assertNotIn("nv_inference_count", ...) once the last model is unloaded)
    server = servers.start(make_repo("identity"), model_control_mode=dlserve.ModelControlMode.EXPLICIT)
    assert "nv_inference" not in server.metrics()
    server.load("identity")
    assert '# TYPE nv_inference_count counter\nnv_inference_count{model="identity",version="1"} 0' in server.metrics()
    server.unload("identity", wait_until_unloaded=True)
    assert "nv_inference" not in server.metrics()


# -- the application's metrics (dlserve.MetricFamily, as tritonserver.MetricFamily) ------------
def test_application_metrics_on_the_endpoint_and_in_server_metrics(server, port):
    requests = dlserve.MetricFamily(dlserve.MetricKind.COUNTER, "app_test_requests", "Requests the app saw")
    level = dlserve.MetricFamily(dlserve.MetricKind.GAUGE, "app_test_level", "A level")
    sizes = dlserve.MetricFamily(dlserve.MetricKind.HISTOGRAM, "app_test_sizes", "Sizes")
    ok = dlserve.Metric(requests, labels={"outcome": "ok"})
    failed = dlserve.Metric(requests, labels={"outcome": "failed"})
    gauge = dlserve.Metric(level)
    histogram = dlserve.Metric(sizes, buckets=[1.0, 10.0])
    ok.increment(3)
    ok.increment(0.5)
    gauge.set_value(7)
    gauge.increment(-2.5)
    for observed in (0.5, 5.0, 50.0):
        histogram.observe(observed)
    assert (ok.value, failed.value, gauge.value, histogram.value) == (3.5, 0.0, 4.5, 55.5)
    assert ok.kind is dlserve.MetricKind.COUNTER

    text, fams = scrape(port)
    assert (fams["app_test_requests"].type, fams["app_test_requests"].documentation) == (
        "counter", "Requests the app saw",
    )
    assert value(fams, "app_test_requests", outcome="ok") == 3.5
    assert value(fams, "app_test_requests", outcome="failed") == 0.0
    assert value(fams, "app_test_level") == 4.5
    buckets = {s.labels.get("le"): s.value for s in fams["app_test_sizes"].samples if s.name.endswith("_bucket")}
    assert buckets == {"1": 1, "10": 2, "+Inf": 3}
    assert 'app_test_requests{outcome="ok"} 3.5' in server.metrics()

    # a second family object of the name shares it; another kind is refused
    again = dlserve.MetricFamily(dlserve.MetricKind.COUNTER, "app_test_requests", "Reworded")
    assert dlserve.Metric(again, labels={"outcome": "ok"}).value == 3.5
    with pytest.raises(dlserve.InvalidArgumentError, match="already exists with different type"):
        dlserve.MetricFamily(dlserve.MetricKind.GAUGE, "app_test_requests", "x")
    # a model's family name is the model's
    infer(server, "metrics_model", {"INPUT0": np.array([1.0])})
    with pytest.raises(dlserve.InvalidArgumentError, match="declared by a model"):
        dlserve.MetricFamily(dlserve.MetricKind.COUNTER, "dlserve_test_requests", "x")

    # gone with their objects, as in Triton (the last holder of a name takes it along)
    del failed
    assert 'outcome="failed"' not in scrape(port)[0]
    del requests, again, ok, level, gauge, sizes, histogram
    text = scrape(port)[0]
    assert "app_test_" not in text, text


def test_a_family_without_a_description_has_no_help_line_as_in_triton(server, port):
    """Triton 2.51, measured side by side with a pb_utils family of description "": its
    prometheus-cpp writes no HELP line at all, not an empty one."""
    family = dlserve.MetricFamily(dlserve.MetricKind.GAUGE, "app_test_helpless", "")
    metric = dlserve.Metric(family)
    metric.set_value(3)
    text = scrape(port)[0]
    assert "# HELP app_test_helpless" not in text
    assert "\n# TYPE app_test_helpless gauge\napp_test_helpless 3\n" in text
    assert "# HELP app_test_helpless" not in server.metrics()
    del metric, family


@pytest.mark.parametrize(
    "make,error,message",
    [
        (lambda f: f.increment(-1), dlserve.InvalidArgumentError, "cannot be incremented by a negative"),
        (lambda f: f.set_value(1), dlserve.UnsupportedError, "only gauge metrics can be set"),
        (lambda f: f.observe(1), dlserve.UnsupportedError, "only histogram metrics observe"),
        (lambda f: f.increment("x"), dlserve.InvalidArgumentError, "must be a number"),
    ],
)
def test_application_metric_misuse_raises(make, error, message):
    family = dlserve.MetricFamily(dlserve.MetricKind.COUNTER, "app_test_misuse", "x")
    metric = dlserve.Metric(family)
    with pytest.raises(error, match=message):
        make(metric)
    assert metric.value == 0.0


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: dlserve.MetricFamily(dlserve.MetricKind.COUNTER, "nv_inference_app", "x"), "is reserved"),
        (lambda: dlserve.MetricFamily(dlserve.MetricKind.COUNTER, "1bad", "x"), "invalid metric family name"),
        (lambda: dlserve.MetricFamily(7, "app_x", "x"), "unknown metric kind"),
        (
            lambda: dlserve.Metric(dlserve.MetricFamily(dlserve.MetricKind.HISTOGRAM, "app_h", "x")),
            "needs buckets",
        ),
        (
            lambda: dlserve.Metric(dlserve.MetricFamily(dlserve.MetricKind.HISTOGRAM, "app_h", "x"), buckets=[2, 1]),
            "strictly increasing",
        ),
        (
            lambda: dlserve.Metric(dlserve.MetricFamily(dlserve.MetricKind.GAUGE, "app_g", "x"), {"__x": "1"}),
            "invalid metric label name",
        ),
    ],
)
def test_application_metric_families_are_checked(make, message):
    with pytest.raises(dlserve.InvalidArgumentError, match=message):
        make()


def test_a_model_cannot_declare_an_application_family(server):
    family = dlserve.MetricFamily(dlserve.MetricKind.COUNTER, "dlserve_test_app_owned", "x")
    response = infer(server, "metrics_model", {"INPUT0": np.array([1.0])}, parameters={"op": "app_owned"})
    assert "is the application's" in str(response.error), response.error
    del family


# -- the service -------------------------------------------------------------------------------
def test_other_paths_and_verbs(port):
    assert get(port, "/")[0] == 404
    assert get(port, "/metricsx")[0] == 404
    assert get(port, "/v2/health/ready")[0] == 404
    assert get(port, "/metrics", "POST")[0] == 405
    assert get(port, "/metrics", "PUT")[0] == 405
    status, _, body = get(port, "/metrics?name[]=nv_inference_count")
    assert status == 200 and "nv_inference_count" in body
    status, _, body = get(port, "/metrics/")
    assert status == 200 and "nv_inference_count" in body


@pytest.mark.parametrize(
    "kwargs",
    [
        {"port": 70000}, {"port": -1}, {"port": "x8002"}, {"port": True}, {"thread_count": "two"},
        {"thread_count": 0}, {"thread_count": -2},
    ],
)
def test_options_are_validated(kwargs):
    with pytest.raises(dlserve.InvalidArgumentError):
        Metrics.Options(address="127.0.0.1", **kwargs)


def test_service_lifecycle(server):
    with pytest.raises(dlserve.InvalidArgumentError, match=r"Metrics\.Options"):
        Metrics(server, KServeHttp.Options())
    service = Metrics(server, Metrics.Options(address="127.0.0.1", port=0))
    service.start()
    try:
        with pytest.raises(dlserve.AlreadyExistsError):
            service.start()
        assert get(service.port)[0] == 200
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            options = Metrics.Options(address="127.0.0.1", port=busy.getsockname()[1])
            taken = Metrics(server, options)
            with pytest.raises(dlserve.UnavailableError):
                taken.start()
    finally:
        service.stop()
    service.stop()  # a second stop is harmless
    with pytest.raises(ConnectionRefusedError):
        get(service.port)
