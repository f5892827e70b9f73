"""``--metrics-config`` and ``--metrics-interval-ms`` (``Options.metrics_configuration``,
``Options.metrics_interval``) on a real server's metrics port, next to what Triton 2.51
shows with the same settings, measured side by side: with ``summary_latencies=true``
five ``nv_inference_*_summary_us`` summaries per model version (no request summary for
a model using the response cache, which has ``nv_cache_{hit,miss}_summary_per_model``
instead), there from the start with count 0, sum 0 and NaN quantiles; count and sum equal
the statistics and the ``*_duration_us`` counters; ``summary_quantiles`` picks the
quantiles; ``counter_latencies=false`` drops the duration counters and the per-model cache
counters; unknown keys and bad values are errors (Triton ignores them); nv_cpu_* stay the
same between refreshes, however often they are scraped; a reload keeps the counters going
(requests the replaced versions still answer included).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import dlserve
from dlserve.frontends import Metrics

from ..conftest import MODELS, ServerHarness
from .test_cli import run_cli
from .test_metrics import A16, families, scrape, stats, value
from .test_model_control import HeldRequest, reload_with

SUMMARIES = {  # Triton 2.51's help texts, the compute ones' "Cumulative" included
    "nv_inference_request_summary_us": "Summary of inference request duration in microseconds (includes cached requests)",
    "nv_inference_queue_summary_us": "Summary of inference queuing duration in microseconds (includes cached requests)",
    "nv_inference_compute_input_summary_us":
        "Cumulative compute input duration in microseconds (does not include cached requests)",
    "nv_inference_compute_infer_summary_us":
        "Cumulative compute inference duration in microseconds (does not include cached requests)",
    "nv_inference_compute_output_summary_us":
        "Cumulative inference compute output duration in microseconds (does not include cached requests)",
}
CACHE_SUMMARIES = {
    "nv_cache_hit_summary_per_model": "Summary of cache hit counts/durations per model, in microseconds.",
    "nv_cache_miss_summary_per_model": "Summary of cache miss counts/durations per model, in microseconds.",
}
COUNTERPARTS = {  # summary: (statistics field, counter)
    "nv_inference_request_summary_us": ("success", "nv_inference_request_duration_us"),
    "nv_inference_queue_summary_us": ("queue", "nv_inference_queue_duration_us"),
    "nv_inference_compute_input_summary_us": ("compute_input", "nv_inference_compute_input_duration_us"),
    "nv_inference_compute_infer_summary_us": ("compute_infer", "nv_inference_compute_infer_duration_us"),
    "nv_inference_compute_output_summary_us": ("compute_output", "nv_inference_compute_output_duration_us"),
    "nv_cache_hit_summary_per_model": ("cache_hit", "nv_cache_hit_duration_per_model"),
    "nv_cache_miss_summary_per_model": ("cache_miss", "nv_cache_miss_duration_per_model"),
}
QUANTILES = ["0.5", "0.9", "0.95", "0.99", "0.999"]
CACHE_HELP = {  # Triton 2.51's words
    "nv_cache_num_hits_per_model": "Number of cache hits per model",
    "nv_cache_miss_duration_per_model": "Total cache miss (insert+lookup) duration per model, in microseconds",
    "nv_cache_util": "Cache utilization [0.0 - 1.0]",
    "nv_cache_num_entries": "Number of responses stored in response cache",
    "nv_cache_num_hits": "Number of cache hits in response cache",
    "nv_cache_num_misses": "Number of cache misses in response cache",
    "nv_cache_num_lookups": "Number of cache lookups in response cache",
    "nv_cache_num_evictions": "Number of cache evictions in response cache",
    "nv_cache_lookup_duration": "Total cache lookup duration (hit and miss), in microseconds",
    "nv_cache_insertion_duration": "Total cache insertion duration, in microseconds",
}
X = np.ones((1, 2), dtype=np.float32)


@pytest.fixture(scope="module")
def start(tmp_path_factory) -> Iterator[Callable[..., tuple[dlserve.Server, int]]]:
    """Starts a server over add_sub and cached (with a response cache) with these
    options, and its metrics port; all stop with the module."""
    harness = ServerHarness()
    services: list[Metrics] = []

    def started(**options: object) -> tuple[dlserve.Server, int]:
        repo = tmp_path_factory.mktemp("metrics_config_repo")
        for name in ("add_sub", "cached"):
            shutil.copytree(MODELS / name, repo / name)
        server = harness.start(repo, cache_config={"local": {"size": str(1 << 20)}}, **options)
        assert server.ready()
        services.append(Metrics(server, Metrics.Options(address="127.0.0.1", port=0)))
        services[-1].start()
        return server, services[-1].port

    yield started
    for service in services:
        service.stop()
    harness.close()


def summary_samples(fams: dict, name: str, model: str) -> dict[str, float]:
    """A summary's samples for one model: "count", "sum" and each quantile."""
    out = {}
    for s in fams[name].samples:
        if s.labels.get("model") != model:
            continue
        assert s.labels.get("version") == "1"
        out[s.labels["quantile"] if "quantile" in s.labels else s.name.rpartition("_")[2]] = s.value
    return out


def traffic(server: dlserve.Server) -> None:
    """3 add_sub successes; cached: a miss, two hits."""
    for i in range(3):
        (response,) = server.model("add_sub").infer(inputs={"INPUT0": A16 * i, "INPUT1": A16})
        assert response.error is None
    for _ in range(3):
        (response,) = server.model("cached").infer(inputs={"INPUT0": X})
        assert response.error is None


# -- summary_latencies=true ----------------------------------------------------------------
@pytest.fixture(scope="module")
def summarized(start):
    server, port = start(metrics_configuration={"": {"summary_latencies": "true"}})
    text, before = scrape(port)
    traffic(server)
    _, after = scrape(port)
    return {"server": server, "port": port, "text": text, "before": before, "after": after}


def test_summaries_exist_before_traffic_with_zero_counts_and_nan_quantiles(summarized):
    fams, text = summarized["before"], summarized["text"]
    for name, help_text in {**SUMMARIES, **CACHE_SUMMARIES}.items():
        assert f"# HELP {name} {help_text}\n# TYPE {name} summary\n" in text
        assert fams[name].type == "summary"
    for model, names in (
        ("add_sub", set(SUMMARIES)),
        ("cached", set(SUMMARIES) - {"nv_inference_request_summary_us"} | set(CACHE_SUMMARIES)),
    ):
        shown = {name for name in {**SUMMARIES, **CACHE_SUMMARIES} if summary_samples(fams, name, model)}
        assert shown == names, model
        for name in names:
            series = summary_samples(fams, name, model)
            assert sorted(series) == sorted(["count", "sum", *QUANTILES])
            assert (series["count"], series["sum"]) == (0, 0)
            assert all(math.isnan(series[q]) for q in QUANTILES)
    # the quantile label comes last and NaN is spelled "Nan", as Triton 2.51 writes them
    assert 'nv_inference_queue_summary_us{model="add_sub",version="1",quantile="0.999"} Nan\n' in text


def test_summary_counts_and_sums_are_the_statistics_and_the_counters(summarized):
    fams, server = summarized["after"], summarized["server"]
    for model, names, counts in (
        ("add_sub", SUMMARIES, {"success": 3, "queue": 3, "compute_input": 3}),
        ("cached", {**SUMMARIES, **CACHE_SUMMARIES}, {"queue": 3, "compute_input": 1, "cache_hit": 2}),
    ):
        inference = stats(server, model)["inference_stats"]
        for name in names:
            series = summary_samples(fams, name, model)
            if not series:
                continue
            field, counter = COUNTERPARTS[name]
            assert series["count"] == inference[field]["count"], (model, name)
            assert series["sum"] == inference[field]["ns"] // 1000, (model, name)
            assert series["sum"] == value(fams, counter, model=model, version="1"), (model, name)
            if field in counts:
                assert series["count"] == counts[field], (model, name)


def test_quantiles_are_ranks_of_the_observations(summarized):
    """Over three observations, as prometheus-cpp's estimate over exact data: 0.5 is the
    smallest, 0.9 up to 0.999 the middle one (the floor(q * n)-th smallest)."""
    for name in SUMMARIES:
        series = summary_samples(summarized["after"], name, "add_sub")
        assert series["count"] == 3
        q50, q90 = series["0.5"], series["0.9"]
        assert series["0.95"] == series["0.99"] == series["0.999"] == q90, name
        # smallest + 2 x middle <= smallest + middle + largest
        assert 0 <= q50 <= q90 and q50 + 2 * q90 <= series["sum"], name


def test_summaries_in_server_metrics_too(summarized):
    text = summarized["server"].metrics()
    assert 'nv_inference_request_summary_us_count{model="add_sub",version="1"} 3\n' in text


def test_cache_help_texts_are_tritons(summarized):
    for name, help_text in CACHE_HELP.items():
        assert f"# HELP {name} {help_text}\n" in summarized["text"], name


def test_no_summaries_by_default(start):
    _, port = start()
    text, fams = scrape(port)
    assert not [name for name in fams if "summary" in name]
    assert "nv_inference_queue_duration_us" in fams


# -- summary_quantiles, counter_latencies ----------------------------------------------------
def test_quantiles_and_no_latency_counters(start):
    settings = {"summary_latencies": "true", "summary_quantiles": "0.5:0.05,0.75:0.01", "counter_latencies": "false"}
    server, port = start(metrics_configuration={"": settings})
    traffic(server)
    _, fams = scrape(port)
    series = summary_samples(fams, "nv_inference_queue_summary_us", "add_sub")
    assert sorted(series) == ["0.5", "0.75", "count", "sum"] and series["count"] == 3
    dropped = {
        "nv_inference_request_duration_us", "nv_inference_queue_duration_us", "nv_inference_compute_input_duration_us",
        "nv_inference_compute_infer_duration_us", "nv_inference_compute_output_duration_us",
        "nv_cache_num_hits_per_model", "nv_cache_hit_duration_per_model", "nv_cache_num_misses_per_model",
        "nv_cache_miss_duration_per_model",
    }
    assert not dropped & set(fams)
    assert value(fams, "nv_inference_request_success", model="add_sub", version="1") == 3
    assert summary_samples(fams, "nv_cache_hit_summary_per_model", "cached")["count"] == 2


# -- nv_cpu_* refreshed once per interval ----------------------------------------------------
def test_cpu_gauges_hold_between_refreshes(start):
    _, port = start(metrics_interval=3_600_000)
    cpu = ("nv_cpu_utilization", "nv_cpu_memory_total_bytes", "nv_cpu_memory_used_bytes")
    scrapes = []
    for _ in range(3):
        _, fams = scrape(port)
        scrapes.append([value(fams, name) for name in cpu])
        sum(i * i for i in range(200_000))  # CPU time and allocations between scrapes
    assert scrapes[0] == scrapes[1] == scrapes[2]


def test_cpu_gauges_refresh_after_the_interval(start):
    _, port = start(metrics_interval=1)
    cpu = ("nv_cpu_utilization", "nv_cpu_memory_used_bytes")
    first = [value(scrape(port)[1], name) for name in cpu]
    sum(i * i for i in range(500_000))  # CPU time (over a millisecond) between scrapes
    second = [value(scrape(port)[1], name) for name in cpu]
    assert first != second


# -- errors --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options,message",
    [
        ({"metrics_configuration": {"": {"summary_latency": "true"}}}, "unknown metrics config key 'summary_latency'"),
        ({"metrics_configuration": {"": {"summary_latencies": "yes please"}}}, "must be true or false, got 'yes please'"),
        ({"metrics_configuration": {"": {"summary_quantiles": "0.5"}}}, "must look like QUANTILE:ERROR"),
        ({"metrics_configuration": {"": {"summary_quantiles": "0.5:0.05,2:0.1"}}}, "must look like QUANTILE:ERROR"),
        ({"metrics_configuration": {"gpu": {"summary_latencies": "true"}}}, "group 'gpu' is not supported"),
        ({"metrics_interval": 0}, "metrics interval must be a positive number"),
    ],
)
def test_bad_settings_are_refused(tmp_path, options, message):
    with pytest.raises(dlserve.InvalidArgumentError, match=message):
        dlserve.Options(model_repository=str(tmp_path), **options).engine_settings()


def test_quantiles_are_read_as_triton_reads_them(tmp_path, caplog):
    # (upstream L0_metrics passes "0.1:0.0.1": Triton's std::stod reads 0.0 and goes on)
    with caplog.at_level("WARNING", logger="dlserve.engine.metrics_settings"):
        settings = dlserve.Options(
            model_repository=str(tmp_path),
            metrics_configuration={"": {"summary_quantiles": "0.1:0.0.1, 0.7:0.01,.75:1e-2"}},
        ).engine_settings()
    assert settings.metrics.summary_quantiles == ((0.1, 0.0), (0.7, 0.01), (0.75, 0.01))
    assert "'0.0.1' read as 0.0" in caplog.text


def test_histogram_latencies_is_accepted(tmp_path):
    settings = dlserve.Options(
        model_repository=str(tmp_path), metrics_configuration={"": {"histogram_latencies": "true"}}
    ).engine_settings()
    assert settings.metrics.histogram_latencies is True and not settings.without_effect


@pytest.mark.parametrize(
    "flag,message",
    [
        ("bogus_key=1", "unknown metrics config key 'bogus_key'"),
        (
            "summary_latencies",
            "--metrics-config option format is '<setting>=<value>'. Got summary_latencies",
        ),
    ],
)
def test_cli_exits_on_a_bad_metrics_config(tmp_path, flag, message):
    result = run_cli("serve", "--model-repository", str(tmp_path), "--metrics-config", flag)
    assert result.returncode == 1 and message in result.stderr, result.stderr


# -- reloads ---------------------------------------------------------------------------------
def test_a_reload_keeps_the_counters_going_and_an_unload_ends_them(start):
    """As Triton 2.51, side by side: a reload (a load that changes a serving model) starts
    the statistics API again at 0 but the Prometheus counters and summaries go on from
    the replaced version's; after an unload and load they start again at 0."""
    server, port = start(
        metrics_configuration={"": {"summary_latencies": "true"}},
        model_control_mode=dlserve.ModelControlMode.EXPLICIT, startup_models=["add_sub"],
    )

    def run(count: int) -> None:
        for _ in range(count):
            (response,) = server.model("add_sub").infer(inputs={"INPUT0": A16, "INPUT1": A16})
            assert response.error is None

    def counted() -> tuple[int, float, float, float, float]:
        _, fams = scrape(port)
        labels = {"model": "add_sub", "version": "1"}
        return (
            stats(server, "add_sub")["inference_count"],
            value(fams, "nv_inference_request_success", **labels),
            value(fams, "nv_inference_count", **labels),
            value(fams, "nv_inference_exec_count", **labels),
            summary_samples(fams, "nv_inference_request_summary_us", "add_sub")["count"],
        )

    run(3)
    assert counted() == (3, 3, 3, 3, 3)
    config = server.model("add_sub").config()
    # (not an instance_group change alone: that updates the version in place, as Triton
    # does, and its statistics go on; see test_instance_update)
    config["parameters"] = {"X": {"string_value": "1"}}
    server.load("add_sub", {"config": json.dumps(config)})
    assert counted() == (0, 3, 3, 3, 3)
    run(2)
    assert counted() == (2, 5, 5, 5, 5)
    server.unload("add_sub")
    server.load("add_sub")
    assert counted() == (0, 0, 0, 0, 0)


def test_reloads_while_replaced_versions_still_answer_count_every_request(servers, make_repo, tmp_path):
    """Three reloads while each replaced version still holds a request: the counters count
    every request answered, whichever version answered it and however many reloads came
    after it (as Triton 2.51's, side by side)."""
    server = servers.start(
        make_repo("faulty"), model_control_mode=dlserve.ModelControlMode.EXPLICIT, startup_models=["faulty"]
    )
    held = []
    for generation in range(3):
        held.append(HeldRequest(server, tmp_path / f"release{generation}"))
        reload_with(server, "faulty", generation)
    assert [request.answer().error for request in held] == [None, None, None]
    list(server.model("faulty").infer(inputs={"INPUT0": X[0]}))
    fams = families(server.metrics())
    labels = {"model": "faulty", "version": "1"}
    assert value(fams, "nv_inference_request_success", **labels) == 4
    assert value(fams, "nv_inference_count", **labels) == 4
