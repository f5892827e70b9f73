"""``dlserve perf --profile-export-file`` and ``--version`` against a real ``dlserve serve``
process: the file has the layout perf_analyzer writes (observed with perf_analyzer 2.50:
top-level ``experiments``, ``version``, ``service_kind``, ``endpoint``; one experiment per
level with ``experiment`` {mode, value}, ``requests`` and ``window_boundaries``), every
request of every measured window with epoch-nanosecond times in order, its inputs and
each response's outputs, a decoupled model's responses one by one (its flag-only final
too), and the requests of every process with ``--processes``; and
``--periodic-concurrency-range``'s run, its concurrency stepping up as perf_analyzer's does.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dlserve import __version__

from ..conftest import MODELS
from .test_perf_cli import QUICK, perf, run_server, url

WINDOWS = 3  # QUICK's runs are stable after their first 3 windows
REQUEST_KEYS = ["timestamp", "request_inputs", "response_timestamps", "response_outputs"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("perf_export")
    for name in ("add_sub", "decoupled", "accumulate"):
        shutil.copytree(MODELS / name, work / "repo" / name)
    yield from run_server(work, work / "repo")


def exported(path: Path, *args: str) -> tuple[dict[str, Any], list[dict[str, Any]], int, int]:
    """Run ``dlserve perf ARGS --profile-export-file PATH --json``: the export, the levels
    reported, and the epoch nanoseconds before and after the run."""
    report = path.with_suffix(".report.json")
    before = time.time_ns()
    perf(*args, *QUICK, "--profile-export-file", str(path), "--json", str(report))
    after = time.time_ns()
    return json.loads(path.read_text()), json.loads(report.read_text())["results"], before, after


def check_experiment(experiment: dict[str, Any], level: dict[str, Any], before: int, after: int,
                     responses: int = 1) -> None:
    """One level's requests: as many as the level measured, each in a window, in order."""
    assert list(experiment) == ["experiment", "requests", "window_boundaries"]
    bounds = experiment["window_boundaries"]
    assert len(bounds) == WINDOWS + 1 and before < bounds[0] and bounds[-1] < after  # epoch ns
    assert bounds == sorted(bounds)
    requests = experiment["requests"]
    assert len(requests) == level["request_count"] > 0  # every request of the 3 windows
    window = 0
    for request in requests:
        times = request["response_timestamps"]
        assert len(times) == len(request["response_outputs"]) == responses, request
        assert request["timestamp"] <= times[0] and times == sorted(times), request
        while times[-1] > bounds[window + 1]:  # (requests come window by window)
            window += 1
        assert bounds[window] <= times[-1] <= bounds[window + 1], request


def test_concurrency_levels_over_http(server, tmp_path):
    document, levels, before, after = exported(
        tmp_path / "profile.json", "-m", "add_sub", *url(server, "http"), "--concurrency-range", "1:2"
    )
    assert list(document) == ["experiments", "version", "service_kind", "endpoint"]
    assert (document["version"], document["service_kind"], document["endpoint"]) == (__version__, "triton", "")
    assert [e["experiment"] for e in document["experiments"]] == [
        {"mode": "concurrency", "value": 1}, {"mode": "concurrency", "value": 2}
    ]
    for experiment, level in zip(document["experiments"], levels):
        check_experiment(experiment, level, before, after)
        for request in experiment["requests"]:
            assert list(request) == REQUEST_KEYS
            inputs, (outputs,) = request["request_inputs"], request["response_outputs"]
            assert sorted(inputs) == ["INPUT0", "INPUT1"] and len(inputs["INPUT0"]) == 16
            assert np.allclose(outputs["OUTPUT0"], np.add(inputs["INPUT0"], inputs["INPUT1"]), rtol=1e-6)
    assert (tmp_path / "profile.json").read_text()[:16] == '{"experiments":['  # compact, as perf_analyzer's


def test_request_rate_in_two_processes_over_grpc(server, tmp_path):
    document, (level,), before, after = exported(
        tmp_path / "profile.json", "-m", "add_sub", *url(server, "grpc"), "--request-rate-range", "100",
        "--processes", "2",
    )
    (experiment,) = document["experiments"]
    assert experiment["experiment"] == {"mode": "request_rate", "value": 100.0}
    assert '"value":100.0}' in (tmp_path / "profile.json").read_text()  # a float, as perf_analyzer's
    check_experiment(experiment, level, before, after)  # (both processes' requests)


@pytest.mark.parametrize("mode, responses", [("stream", 4), ("final_with_last", 3)])
def test_a_decoupled_models_responses_each_have_their_time(server, tmp_path, mode, responses):
    """Three values per request; in mode "stream" a flag-only final follows them, which
    perf_analyzer times as a response too (with no outputs)."""
    document, (level,), before, after = exported(
        tmp_path / "profile.json", "-m", "decoupled", *url(server, "grpc"), "--streaming", "--shape", "IN:3",
        "--input-data", "zero", "--request-parameter", f"mode:{mode}:string",
    )
    (experiment,) = document["experiments"]
    check_experiment(experiment, level, before, after, responses)
    for request in experiment["requests"]:
        assert request["request_inputs"] == {"IN": [0, 0, 0]}
        assert request["response_outputs"][:3] == [{"OUT": 0}] * 3
        assert request["response_outputs"][3:] == ([{}] if mode == "stream" else [])


@pytest.mark.parametrize("periodic_range, groups", [("1:5:2", [1, 2, 2]), ("3:5:2", [3, 2])])
def test_periodic_concurrency_steps_up_every_request_period(server, tmp_path, periodic_range, groups):
    """--periodic-concurrency-range START:END:STEP --request-period 2: START requests, then
    STEP more once every request of the latest group has had its 2nd answer (long before
    its last), END in all (perf_analyzer sends 7 for 3:5:2), each once; one experiment
    (perf_analyzer's: concurrency 1) whose one window holds the run."""
    path = tmp_path / "profile.json"
    before = time.time_ns()
    result = perf("-m", "decoupled", *url(server, "grpc"), "--streaming", "--shape", "IN:4", "--input-data", "zero",
                  "--request-parameter", "mode:thread:string", "--request-parameter", "delay_ms:50:int",
                  "--periodic-concurrency-range", periodic_range, "--request-period", "2",
                  "--profile-export-file", str(path))
    after = time.time_ns()
    assert "Periodic concurrency: 5 requests, 20 responses in " in result.stdout, result.stdout
    (experiment,) = json.loads(path.read_text())["experiments"]
    assert experiment["experiment"] == {"mode": "concurrency", "value": 1}
    requests = sorted(experiment["requests"], key=lambda request: request["timestamp"])
    assert len(requests) == sum(groups) == 5
    start, end = experiment["window_boundaries"]
    assert before < start <= requests[0]["timestamp"] and requests[-1]["response_timestamps"][-1] <= end < after
    for request in requests:  # 4 values and a flag-only final
        assert request["response_outputs"] == [{"OUT": 0}] * 4 + [{}]
    sent = 0
    for size, step in zip(groups, groups[1:]):
        latest, following = requests[sent:sent + size], requests[sent + size:sent + size + step]
        second_answers = [request["response_timestamps"][1] for request in latest]
        finals = [request["response_timestamps"][-1] for request in latest]
        assert max(second_answers) <= min(r["timestamp"] for r in following) < min(finals)
        sent += size


def test_periodic_concurrency_fails_when_a_request_ends_before_its_period(server, tmp_path):
    """perf_analyzer's reason, exit 99 and no file: 4 answers (3 values and a flag-only
    final) cannot reach --request-period 5."""
    path = tmp_path / "profile.json"
    result = perf("-m", "decoupled", *url(server, "grpc"), "--streaming", "--shape", "IN:3", "--input-data", "zero",
                  "--periodic-concurrency-range", "1:2", "--request-period", "5", "--profile-export-file", str(path),
                  expect=99)
    assert "Request received final response before request period was reached." in result.stderr
    assert not path.exists()


def test_sequence_models_requests_name_their_sequence(server, tmp_path):
    document, (level,), before, after = exported(
        tmp_path / "profile.json", "-m", "accumulate", *url(server, "http"), "--input-data", "zero",
        "--sequence-length", "3", "--sequence-length-variation", "0", "--concurrency-range", "2",
    )
    (experiment,) = document["experiments"]
    check_experiment(experiment, level, before, after)
    for request in experiment["requests"]:
        assert list(request) == ["timestamp", "sequence_id", *REQUEST_KEYS[1:]]
        (outputs,) = request["response_outputs"]
        assert outputs["CONTROLS"][3] == request["sequence_id"] > 0  # (CORRID, as the model saw it)


def test_no_file_when_nothing_is_reported(server, tmp_path):
    """As perf_analyzer: a first level that never became stable ends the run (exit 2)
    without the file; a path that exists already is refused up front."""
    path = tmp_path / "profile.json"
    perf("-m", "add_sub", *url(server, "http"), "-p", "100", "-s", "0.0001", "-r", "3",
         "--profile-export-file", str(path), expect=2)
    assert not path.exists()
    path.write_text("kept")
    result = perf("-m", "add_sub", *url(server, "http"), *QUICK, "--profile-export-file", str(path), expect=99)
    assert "already exists" in result.stderr and path.read_text() == "kept"


def test_version():
    """perf_analyzer's line, on stderr, exit 0 (no -m needed)."""
    result = perf("--version")
    assert re.fullmatch(r"Perf Analyzer Version \S+ \(commit \S+\)\n", result.stderr), result.stderr
    assert __version__ in result.stderr and result.stdout == ""
