"""``dlserve perf`` reports: perf_analyzer's CSV columns exactly, JSON, console text,
the plot (when matplotlib is there) and the progress line."""

from __future__ import annotations

import csv
import io
import json

import pytest

from dlserve.cli import build_parser
from dlserve.perf import report
from dlserve.perf.cli import settings_from_args
from dlserve.perf.gpu_metrics import merge, parse
from dlserve.perf.measure import LevelResult

PA_COLUMNS = (
    "Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,"
    "Server Compute Input,Server Compute Infer,Server Compute Output,Client Recv,"
    "p50 latency,p90 latency,p95 latency,p99 latency"
).split(",")
SERVER = {
    "inference_count": 300, "execution_count": 300, "success_count": 300,
    "avg_request_latency_us": 263.4, "overhead_us": 9.2, "queue_us": 31.7,
    "compute_input_us": 2.1, "compute_infer_us": 200.4, "compute_output_us": 20.0,
}


def result(value: float, throughput: float, mode: str = "concurrency", server: dict | None = SERVER,
           percentile: int = -1, stable: bool = True) -> LevelResult:
    percentiles = {50: 517.6, 90: 589.2, 95: 612.0, 99: 672.9}
    if percentile > 0:
        percentiles[percentile] = 555.5
    return LevelResult(
        mode=mode, value=value, batch_size=1, stable=stable, windows=3, request_count=6970,
        duration_s=3.6, throughput=throughput, avg_latency_us=516.8, std_latency_us=147.3,
        percentiles_us=percentiles, avg_send_us=48.6, avg_recv_us=0.4, server=server,
        stability_percentile=percentile,
    )


def settings(*argv: str):
    return settings_from_args(build_parser().parse_args(["perf", "-m", "add_sub", *argv]))


def read_csv(path) -> list[list[str]]:
    return list(csv.reader(io.StringIO(path.read_text())))


def test_csv_has_perf_analyzers_columns_sorted_by_throughput(tmp_path):
    path = tmp_path / "out.csv"
    report.write_csv(str(path), [result(2, 3796.01), result(1, 1924.37)], "concurrency", True)
    rows = read_csv(path)
    assert rows[0] == PA_COLUMNS
    assert path.read_text().splitlines()[0] == ",".join(PA_COLUMNS)  # no quoting, no spaces added
    assert [r[0] for r in rows[1:]] == ["1", "2"]  # ascending throughput
    # latency 516.8 - send 48.6 - recv 0.4 = 467 wait; minus queue+compute (31+2+200+20) = 214
    assert rows[1] == ["1", "1924.37", "48", "214", "31", "2", "200", "20", "0", "517", "589", "612", "672"]


def test_csv_without_server_statistics_and_in_rate_mode(tmp_path):
    path = tmp_path / "out.csv"
    report.write_csv(str(path), [result(500.0, 499.993, mode="request_rate", server=None)], "request_rate", False)
    rows = read_csv(path)
    assert rows[0] == ["Request Rate", "Inferences/Second", "Client Send", "Client Recv",
                       "p50 latency", "p90 latency", "p95 latency", "p99 latency"]
    assert rows[1] == ["500", "499.993", "48", "0", "517", "589", "612", "672"]


def test_csv_with_an_extra_percentile(tmp_path):
    path = tmp_path / "out.csv"
    report.write_csv(str(path), [result(1, 100.0, percentile=75)], "concurrency", True)
    header = read_csv(path)[0]
    assert header[-5:] == ["p50 latency", "p75 latency", "p90 latency", "p95 latency", "p99 latency"]


def test_verbose_csv_adds_perf_analyzers_three_columns(tmp_path):
    path = tmp_path / "out.csv"
    report.write_csv(str(path), [result(1, 1924.37)], "concurrency", True, verbose=True)
    header, row = read_csv(path)
    assert header == [*PA_COLUMNS, "Avg latency", "request/response", "response wait"]
    # average 516.8; sending + receiving 48.6 + 0.4 = 49; waiting for the answer 467
    assert row[-3:] == ["516", "49", "467"]
    assert settings("--verbose-csv").verbose_csv and not settings().verbose_csv


def test_a_decoupled_models_response_throughput_follows_inferences_per_second(tmp_path):
    path = tmp_path / "out.csv"
    streamed = result(1, 15.2596)
    streamed.decoupled, streamed.responses = True, 165  # 3 per request, over 3.6 s
    report.write_csv(str(path), [streamed], "concurrency", True)
    header, row = read_csv(path)
    assert header[:3] == ["Concurrency", "Inferences/Second", "Response Throughput"]
    assert row[1:3] == ["15.2596", "45.8333"]
    assert "Response Throughput: 45.8333 infer/sec" in report.level_text(streamed, "grpc")


def test_numbers_print_like_cpp_streams():
    assert report.pa_number(1924.3712) == "1924.37"
    assert report.pa_number(500.0) == "500"
    assert report.pa_number(12345678.9) == "1.23457e+07"
    assert report.level_label("request_rate", 0.5) == "0.5"


def test_json(tmp_path):
    path = tmp_path / "out.json"
    report.write_json(str(path), settings("--concurrency-range", "1:2"), [result(1, 1924.37), result(2, 3796.01)], True)
    document = json.loads(path.read_text())
    assert document["model"] == "add_sub" and document["mode"] == "concurrency"
    assert document["csv_columns"] == PA_COLUMNS
    first = document["results"][0]
    assert first["value"] == 1 and first["throughput"] == 1924.37 and first["stable"] is True
    assert first["percentiles_us"] == {"p50": 517.6, "p90": 589.2, "p95": 612.0, "p99": 672.9}
    assert first["server"]["compute_infer_us"] == 200.4
    assert first["csv"]["Server Compute Infer"] == "200" and first["csv"]["Concurrency"] == "1"
    assert document["settings"]["levels"] == [1, 2]


def test_console_text():
    text = report.level_text(result(1, 1924.37), "http")
    for line in (
        "Request concurrency: 1", "  Client: ", "    Request count: 6970", "    Throughput: 1924.37 infer/sec",
        "    Avg latency: 516 usec (standard deviation 147 usec)", "    p50 latency: 517 usec",
        "    p99 latency: 672 usec", "    Avg HTTP time: 516 usec (send/recv 49 usec + response wait 467 usec)",
        "  Server: ", "    Inference count: 300", "    Successful request count: 300",
        "    Avg request latency: 263 usec (overhead 9 usec + queue 31 usec + compute input 2 usec + "
        "compute infer 200 usec + compute output 20 usec)",
    ):
        assert line in text.splitlines(), (line, text)
    grpc = report.level_text(result(2, 10.0, server=None, percentile=95, stable=False), "grpc")
    assert "Avg latency" not in grpc and "Server:" not in grpc and "not stable" in grpc
    assert "Avg gRPC time: 516 usec ((un)marshal request/response 49 usec" in grpc
    rate = report.level_text(result(500.0, 499.9, mode="request_rate"), "inprocess")
    assert rate.startswith("Request Rate: 500 inference requests per seconds")
    assert not report.level_text(result(1, 1.0), "http", header=False).startswith("Request")
    assert report.pass_text(2, 1437.76, 691.4, 226.9) == (
        "  Pass [2] throughput: 1437.76 infer/sec. Avg latency: 691 usec (std 226 usec). ")
    summary = report.summary_text([result(1, 1924.37)], -1)
    assert summary.splitlines() == ["Inferences/Second vs. Client Average Batch Latency",
                                    "Concurrency: 1, throughput: 1924.37 infer/sec, latency 516 usec"]
    assert "Client p95 Batch Latency" in report.summary_text([result(1, 1.0, percentile=95)], 95)
    head = report.settings_text(settings("--percentile", "95", "--shared-memory", "system"), False)
    assert "Stabilizing using p95latency and throughput" in head and "system shared memory" in head
    assert "Server-side statistics: not available" in head
    assert "\n  Service Kind: TRITON\n" in head  # the whole line, as perf_analyzer's


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plot.png"
    report.write_plot(str(path), settings("--concurrency-range", "1:2"), [result(1, 1924.37), result(2, 3796.01)])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_line():
    stream = io.StringIO()
    off = report.Progress(False, stream)
    off.update("hello", force=True)
    off.clear()
    assert stream.getvalue() == ""
    on = report.Progress(True, stream)
    on.update("window 1/10", force=True)
    on.update("window 2/10")  # too soon after the last: skipped
    on.clear()
    assert stream.getvalue() == "\rwindow 1/10\x1b[K\r\x1b[K"


# -- --collect-metrics --------------------------------------------------------------------------
def test_gpu_gauges_are_read_per_gpu_and_merged_as_perf_analyzer_merges_them():
    def text(i: int) -> str:
        return "\n".join([
            "# TYPE nv_gpu_utilization gauge",
            f'nv_gpu_utilization{{gpu_uuid="GPU-b",other="x"}} {i / 10}',
            'nv_gpu_utilization{gpu_uuid="GPU-a"} 0.5',
            f'nv_gpu_power_usage{{gpu_uuid="GPU-b"}} {100 + i}',
            f'nv_gpu_memory_used_bytes{{gpu_uuid="GPU-b"}} {[5, 9, 7][i]}',
            f'nv_gpu_memory_total_bytes{{gpu_uuid="GPU-b"}} {1000 + i}',
            'nv_gpu_power_limit{gpu_uuid="GPU-b"} 300',
            'nv_gpu_utilization_other{gpu_uuid="GPU-b"} 9',
            "nv_gpu_utilization 1",  # (no GPU named: not a GPU's figure)
        ])

    reads = [parse(text(i)) for i in range(3)]
    assert reads[0] == {
        "nv_gpu_utilization": {"GPU-b": 0.0, "GPU-a": 0.5},
        "nv_gpu_power_usage": {"GPU-b": 100.0},
        "nv_gpu_memory_used_bytes": {"GPU-b": 5.0},
        "nv_gpu_memory_total_bytes": {"GPU-b": 1000.0},
    }
    assert merge(reads) == {
        "Avg GPU Utilization": {"GPU-a": 0.5, "GPU-b": pytest.approx(0.1)},
        "Avg GPU Power Usage": {"GPU-b": 101.0},
        "Max GPU Memory Usage": {"GPU-b": 9.0},
        "Total GPU Memory": {"GPU-b": 1000.0},  # the first read's
    }
    assert merge([]) == dict.fromkeys(
        ["Avg GPU Utilization", "Avg GPU Power Usage", "Max GPU Memory Usage", "Total GPU Memory"], {}
    )
