"""``dlserve perf --collect-metrics``: perf_analyzer's GPU gauges per level, read from a
metrics endpoint while a real ``dlserve serve`` answers the requests.

This machine has no GPU, so the gauges come from a small Prometheus endpoint of the
test's own (two GPUs; GPU-a's figures move with every read, so what a level merged can
be checked against which reads it took); the console and CSV formats are the ones real
perf_analyzer 2.51 wrote against the same endpoint.
"""

from __future__ import annotations

import http.server
import itertools
import re
import shutil
import threading
from collections.abc import Iterator

import pytest

from ..conftest import MODELS
from .test_perf_cli import QUICK, free_port, perf, read_csv, run_server, url


class _Gauges(http.server.BaseHTTPRequestHandler):
    reads = itertools.count()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        i = next(self.reads)
        body = "\n".join([
            "# HELP nv_gpu_utilization GPU utilization rate [0.0 - 1.0)",
            "# TYPE nv_gpu_utilization gauge",
            f'nv_gpu_utilization{{gpu_uuid="GPU-a"}} {i / 100}',
            'nv_gpu_utilization{gpu_uuid="GPU-b"} 0.125',
            'nv_gpu_power_usage{gpu_uuid="GPU-a"} 120.5',
            'nv_gpu_power_usage{gpu_uuid="GPU-b"} 60',
            f'nv_gpu_memory_used_bytes{{gpu_uuid="GPU-a"}} {i}',
            'nv_gpu_memory_used_bytes{gpu_uuid="GPU-b"} 2048',
            f'nv_gpu_memory_total_bytes{{gpu_uuid="GPU-a"}} {1000 + i}',
            'nv_gpu_memory_total_bytes{gpu_uuid="GPU-b"} 4096',
            'nv_inference_count{model="add_sub",version="1"} 7',
        ]).encode() + b"\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def gauges() -> Iterator[int]:
    endpoint = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Gauges)
    thread = threading.Thread(target=endpoint.serve_forever, daemon=True)
    thread.start()
    yield endpoint.server_address[1]
    endpoint.shutdown()
    endpoint.server_close()
    thread.join()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("perf_gpu")
    shutil.copytree(MODELS / "add_sub", work / "repo" / "add_sub")
    yield from run_server(work, work / "repo")


def _section(stdout: str) -> list[list[str]]:
    """Each level's "Server Prometheus Metrics" lines."""
    blocks = stdout.split("  Server Prometheus Metrics: \n")[1:]
    return [block.split("\nRequest concurrency")[0].split("\n\n")[0].splitlines() for block in blocks]


def test_each_level_reports_the_gauges_read_during_its_windows(server, gauges, tmp_path):
    out = tmp_path / "out.csv"
    result = perf("-m", "add_sub", *url(server, "http"), *QUICK, "-r", "10", "--concurrency-range", "1:2",
                  "--collect-metrics", "--metrics-url", f"127.0.0.1:{gauges}/metrics", "--metrics-interval", "50",
                  "-f", str(out), "--verbose-csv")
    sections = _section(result.stdout)
    assert len(sections) == 2, result.stdout
    for lines in sections:
        titles = [line for line in lines if not line.startswith("      ")]
        assert titles == ["    Avg GPU Utilization:", "    Avg GPU Power Usage:", "    Max GPU Memory Usage:",
                          "    Total GPU Memory:"]
        assert "      GPU-b : 12.5%" in lines and "      GPU-b : 60 watts" in lines
        assert "      GPU-b : 2048 bytes" in lines and "      GPU-b : 4096 bytes" in lines
        assert "      GPU-a : 120.5 watts" in lines
        # GPU-a's reads were numbered: its figures say which reads the level merged
        first = int(re.search(r"GPU-a : 1(\d{3}) bytes", "\n".join(lines[-3:])).group(1))
        last = int(re.search(r"GPU-a : (\d+) bytes", lines[lines.index("    Max GPU Memory Usage:") + 1]).group(1))
        utilization = float(re.search(r"GPU-a : ([\d.]+)%", "\n".join(lines)).group(1))
        assert last - first >= 3  # 3 windows of 200 ms, a read every 50 ms
        assert utilization == pytest.approx((first + last) / 2, abs=0.01)  # the average of every read between
    rows = read_csv(out)
    assert list(rows[0])[-4:] == ["Avg GPU Utilization", "Avg GPU Power Usage", "Max GPU Memory Usage",
                                  "Total GPU Memory"]
    for row in rows:
        assert re.fullmatch(r"GPU-a:0\.\d+;GPU-b:0\.125;", row["Avg GPU Utilization"]), row
        assert row["Avg GPU Power Usage"] == "GPU-a:120.5;GPU-b:60;"
        assert re.fullmatch(r"GPU-a:\d+;GPU-b:2048;", row["Max GPU Memory Usage"]), row
        assert re.fullmatch(r"GPU-a:1\d{3};GPU-b:4096;", row["Total GPU Memory"]), row


def test_the_gpu_columns_need_verbose_csv_as_in_perf_analyzer(server, gauges, tmp_path):
    out = tmp_path / "out.csv"
    perf("-m", "add_sub", *url(server, "grpc"), *QUICK, "-r", "10", "--collect-metrics",
         "--metrics-url", f"http://127.0.0.1:{gauges}/metrics", "-f", str(out))
    assert "Avg GPU Utilization" not in out.read_text()


def test_a_server_without_gpu_gauges_is_warned_about_once_and_the_run_goes_on(server):
    metrics = f"127.0.0.1:{server['ports']['metrics']}/metrics"  # dlserve's own, on a machine with no GPU
    result = perf("-m", "add_sub", *url(server, "http"), *QUICK, "-r", "10", "--concurrency-range", "1:2",
                  "--collect-metrics", "--metrics-url", metrics, "--metrics-interval", "50")
    for gauge in ("nv_gpu_utilization", "nv_gpu_power_usage", "nv_gpu_memory_used_bytes", "nv_gpu_memory_total_bytes"):
        assert result.stderr.count(f"WARNING: Unable to parse '{gauge}' metric.") == 1, result.stderr
    assert _section(result.stdout) == [["    Avg GPU Utilization:", "    Avg GPU Power Usage:",
                                        "    Max GPU Memory Usage:", "    Total GPU Memory:"]] * 2


def test_an_unreachable_metrics_endpoint_is_said_once_and_the_run_goes_on(server):
    nowhere = f"127.0.0.1:{free_port()}/metrics"
    result = perf("-m", "add_sub", *url(server, "http"), *QUICK, "-r", "10", "--collect-metrics", "--metrics-url", nowhere,
                  "--metrics-interval", "50")
    assert result.stderr.count(f"Unable to connect to Metrics endpoint {nowhere}") == 1, result.stderr
    assert "Concurrency: 1, throughput: " in result.stdout


@pytest.mark.parametrize("flags, message", [
    (["--metrics-url", "localhost:8002/metrics"], "must specify --collect-metrics when using the --metrics-url option"),
    (["--metrics-interval", "100"], "must specify --collect-metrics when using the --metrics-interval option"),
    (["--collect-metrics", "--metrics-interval", "0"], "--metrics-interval: must be at least 1"),
    (["-i", "inprocess", "--model-repository", "x", "--collect-metrics", "--metrics-url", "h:1/metrics"],
     "--metrics-url is for a server over the network"),
])
def test_metrics_flags_are_checked(flags, message):
    result = perf("-m", "add_sub", *flags, expect=99)
    assert message in result.stderr


def test_in_process_reads_the_servers_own_metrics(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(MODELS / "add_sub", repo / "add_sub")
    result = perf("-m", "add_sub", "-i", "inprocess", "--model-repository", str(repo), *QUICK, "-r", "10", "--collect-metrics",
                  "--metrics-interval", "50")
    assert "WARNING: Unable to parse 'nv_gpu_utilization' metric." in result.stderr  # read, and no GPU in it
    assert "Unable to connect" not in result.stderr
    assert _section(result.stdout) == [["    Avg GPU Utilization:", "    Avg GPU Power Usage:",
                                        "    Max GPU Memory Usage:", "    Total GPU Memory:"]]
