"""NVIDIA's perf_analyzer (from the tritonclient 2.50.0 wheel, unmodified) against a
``dlserve serve`` process: HTTP and gRPC, with and without system shared memory, and an
ensemble; and dlserve perf's ``--profile-export-file`` and ``--version`` beside its own.

perf_analyzer reads the model's metadata and config, then the statistics extension
before and after each measurement window; the "Server ..." columns of its CSV come
from those statistics, so non-zero compute-infer times prove they feed it.

Needs ``scripts/setup_perf_analyzer.sh`` (installs ``.venv/perf_analyzer``); without it
every test here skips. The server is SIGTERMed at the end and must exit 0, leaving no
shared-memory segment and no worker process behind.
"""

from __future__ import annotations

import csv
import glob
import http.client
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from ..conftest import MODELS, pid_alive

ROOT = Path(__file__).resolve().parents[2]
# scripts/setup_perf_analyzer.sh installs into the venv ($VENV, default .venv of the checkout)
PERF_ANALYZER = next(
    (
        path
        for path in (
            Path(sys.prefix) / "perf_analyzer" / "perf_analyzer",
            ROOT / ".venv" / "perf_analyzer" / "perf_analyzer",
        )
        if path.exists()
    ),
    ROOT / ".venv" / "perf_analyzer" / "perf_analyzer",
)
DLSERVE = Path(sys.executable).parent / "dlserve"
# --max-trials must be at least 3: perf_analyzer calls a measurement stable by comparing
# the last 3 windows, so with 2 it always fails "to obtain stable measurement".
QUICK = [
    "--concurrency-range", "1",
    "--measurement-interval", "500",
    "--stability-percentage", "1000",
    "--max-trials", "3",
]
SERVER_COLUMNS = [
    "Server Queue", "Server Compute Input", "Server Compute Infer", "Server Compute Output",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_status(port: int, path: str) -> int | None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    except OSError:
        return None
    finally:
        conn.close()


@pytest.fixture(scope="module")
def perf_analyzer() -> Path:
    if not PERF_ANALYZER.exists():
        pytest.skip(f"{PERF_ANALYZER} missing: run scripts/setup_perf_analyzer.sh")
    try:
        probe = subprocess.run(
            [PERF_ANALYZER, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"perf_analyzer does not start: {exc}")
    if probe.returncode != 0:
        pytest.skip(f"perf_analyzer does not start: {(probe.stdout + probe.stderr).strip()[-300:]}")
    return PERF_ANALYZER


@pytest.fixture(scope="module")
def server(perf_analyzer, tmp_path_factory: pytest.TempPathFactory):
    """``dlserve serve`` on free ports; stopped with SIGTERM and checked at the end."""
    work = tmp_path_factory.mktemp("pa")
    repo = work / "repo"
    for name in ("add_sub", "identity", "pipeline"):
        shutil.copytree(MODELS / name, repo / name)
    ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
    log = (work / "serve.log").open("w")
    proc = subprocess.Popen(
        [
            DLSERVE, "serve", "--model-repository", str(repo),
            "--http-address", "127.0.0.1", "--http-port", str(ports["http"]),
            "--grpc-address", "127.0.0.1", "--grpc-port", str(ports["grpc"]),
            "--metrics-address", "127.0.0.1", "--metrics-port", str(ports["metrics"]),
            "--allow-client-shm", "true",
            # a trace file for perf_analyzer's --trace-* options to turn tracing on into
            "--trace-config", f"triton,file={work / 'trace.json'}",
        ],
        stdout=log, stderr=subprocess.STDOUT, cwd=work,
    )

    def output() -> str:
        return (work / "serve.log").read_text()

    try:
        deadline = time.monotonic() + 60
        while "dlserve: ready" not in output():  # printed once every service listens
            assert proc.poll() is None, f"dlserve serve exited with {proc.returncode}:\n{output()}"
            assert time.monotonic() < deadline, f"dlserve serve not ready in 60 s:\n{output()}"
            time.sleep(0.05)
        for name, port in (("KServeHttp", ports["http"]), ("KServeGrpc", ports["grpc"])):
            assert f"dlserve: {name} listening on port {port}" in output()
        assert http_status(ports["http"], "/v2/health/ready") == 200
        workers = [child.pid for child in psutil.Process(proc.pid).children(recursive=True)]
        assert len(workers) == 2, workers  # one instance each of add_sub and identity
        yield {"ports": ports, "work": work}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = "killed after 40 s"
        log.close()
    assert code == 0, f"dlserve serve exited with {code}:\n{output()}"
    leaked = glob.glob(f"/dev/shm/dlserve_{proc.pid}_*")
    assert not leaked, f"shared memory left behind: {leaked}"
    deadline = time.monotonic() + 2
    while any(pid_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in workers if pid_alive(pid)], "worker processes left behind"


def run_perf_analyzer(
    perf_analyzer: Path, server: dict, model: str, protocol: str, *extra: str
) -> dict[str, str]:
    """Run it; assert it succeeded; return the CSV row for concurrency 1."""
    port = server["ports"][protocol]
    out = server["work"] / f"{model}_{protocol}_{len(extra)}.csv"
    result = subprocess.run(
        [
            perf_analyzer, "-m", model, "-u", f"127.0.0.1:{port}", "-i", protocol,
            *QUICK, *extra, "-f", str(out),
        ],
        capture_output=True, text=True, timeout=60, cwd=server["work"], check=False,
    )
    report = f"perf_analyzer exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    assert result.returncode == 0, report
    with out.open() as f:
        rows = [row for row in csv.DictReader(f) if row.get("Concurrency") == "1"]
    assert len(rows) == 1, f"{out.read_text()}\n{report}"
    row = rows[0]
    assert float(row["Inferences/Second"]) > 0, row
    for column in SERVER_COLUMNS:  # filled from the statistics extension
        assert row.get(column, "").strip().isdigit(), (column, row)
    assert int(row["Server Compute Infer"]) > 0, row
    assert "Server:" in result.stdout and "Inference count:" in result.stdout, report
    return row


def test_add_sub_over_http(perf_analyzer, server):
    run_perf_analyzer(perf_analyzer, server, "add_sub", "http")


def test_add_sub_over_grpc(perf_analyzer, server):
    run_perf_analyzer(perf_analyzer, server, "add_sub", "grpc")


def test_identity_over_grpc_with_system_shared_memory(perf_analyzer, server):
    run_perf_analyzer(
        perf_analyzer, server, "identity", "grpc",
        "--shape", "INPUT0:1024",
        "--shared-memory", "system", "--output-shared-memory-size", "4096",
    )


def test_identity_over_http_with_system_shared_memory(perf_analyzer, server):
    run_perf_analyzer(
        perf_analyzer, server, "identity", "http",
        "--shape", "INPUT0:1024", "--shared-memory", "system",
    )


def test_an_ensemble_over_grpc(perf_analyzer, server):
    """perf_analyzer reads an ensemble's config, then the statistics of the ensemble and of
    its step models (add_sub, identity) for its server-side columns."""
    run_perf_analyzer(perf_analyzer, server, "pipeline", "grpc")


def test_perf_analyzers_trace_options_set_the_servers_tracing(perf_analyzer, server):
    """perf_analyzer's --trace-level/--trace-rate/--trace-count/--log-frequency go through
    the trace extension; the server then writes Triton's trace files (as Triton 2.51 does
    for the same flags: files of --log-frequency traces until the count is spent)."""
    run_perf_analyzer(
        perf_analyzer, server, "add_sub", "http",
        "--trace-level", "TIMESTAMPS", "--trace-rate", "10", "--trace-count", "6",
        "--log-frequency", "3",
    )
    port = server["ports"]["http"]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/v2/trace/setting")
        settings = json.loads(conn.getresponse().read())
        # back off, so that no other test here is traced
        conn.request("POST", "/v2/trace/setting", body=json.dumps({"trace_level": ["OFF"]}))
        assert conn.getresponse().status == 200
    finally:
        conn.close()
    assert settings["trace_level"] == ["TIMESTAMPS"] and settings["trace_rate"] == "10"
    assert settings["trace_count"] == "0" and settings["log_frequency"] == "3"
    files = [server["work"] / f"trace.json.{index}" for index in (0, 1)]
    deadline = time.monotonic() + 5
    while not all(f.exists() for f in files) and time.monotonic() < deadline:
        time.sleep(0.05)
    for path in files:
        entries = json.loads(path.read_text())
        heads = [e for e in entries if "model_name" in e]
        assert [h["model_name"] for h in heads] == ["add_sub"] * 3, path
        names = {e["timestamps"][0]["name"] for e in entries if "timestamps" in e}
        assert {"HTTP_RECV_START", "COMPUTE_START", "HTTP_SEND_END"} <= names
    assert not (server["work"] / "trace.json.2").exists()


def _layout(value: Any) -> Any:
    """A JSON document's shape: its keys and the types of its values (a list's first item)."""
    if isinstance(value, dict):
        return {key: _layout(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_layout(value[0])] if value else []
    return type(value).__name__


def test_dlserve_perfs_profile_export_has_perf_analyzers_layout(perf_analyzer, server, tmp_path):
    """The same run by both, each with --profile-export-file: the same keys (in the same
    order, but for the tensors', which perf_analyzer writes in no fixed order), the same
    types, and times on the same clock (nanoseconds since the epoch)."""
    before = time.time_ns()
    run_perf_analyzer(perf_analyzer, server, "add_sub", "http", "--profile-export-file", str(tmp_path / "pa.json"))
    ours = tmp_path / "dlserve.json"
    port = server["ports"]["http"]
    result = subprocess.run(
        [DLSERVE, "perf", "-m", "add_sub", "-u", f"127.0.0.1:{port}", *QUICK, "--profile-export-file", str(ours)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    after = time.time_ns()
    documents = [json.loads((tmp_path / "pa.json").read_text()), json.loads(ours.read_text())]
    assert _layout(documents[0]) == _layout(documents[1])
    for document in documents:
        assert list(document) == ["experiments", "version", "service_kind", "endpoint"]
        (experiment,) = document["experiments"]
        assert list(experiment) == ["experiment", "requests", "window_boundaries"]
        assert experiment["experiment"] == {"mode": "concurrency", "value": 1}
        assert list(experiment["requests"][0]) == ["timestamp", "request_inputs", "response_timestamps",
                                                   "response_outputs"]
        bounds = experiment["window_boundaries"]
        assert before < bounds[0] < experiment["requests"][0]["response_timestamps"][0] < bounds[-1] < after


def test_dlserve_perf_prints_perf_analyzers_version_line(perf_analyzer):
    lines = [
        subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
        for command in ([perf_analyzer, "--version"], [DLSERVE, "perf", "--version"])
    ]
    for result in lines:
        assert result.returncode == 0 and result.stdout == "", result
        assert re.fullmatch(r"Perf Analyzer Version \S* \(commit \S+\)\n", result.stderr), result.stderr
