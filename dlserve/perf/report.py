"""Reports: perf_analyzer's console text and CSV, JSON, a plot, and the live progress line.

CSV columns are perf_analyzer's, in its order, values in µs (integers) and inferences per
second with 6 significant digits, rows sorted by throughput::

    Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,
    Server Compute Input,Server Compute Infer,Server Compute Output,Client Recv,
    p50 latency,p90 latency,p95 latency,p99 latency

(``Request Rate`` instead of ``Concurrency`` in request-rate mode; the five server columns
only when the server has the statistics extension; a ``--percentile`` outside 50/90/95/99
adds its own ``pNN latency`` column in order.)
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import sys
import time
from typing import Any, TextIO

from dlserve.perf.gpu_metrics import UNITS
from dlserve.perf.measure import ClientWindow, LevelResult

SERVER_COLUMNS = [
    "Network+Server Send/Recv",
    "Server Queue",
    "Server Compute Input",
    "Server Compute Infer",
    "Server Compute Output",
]
PROTOCOL_NAMES = {"http": "HTTP", "grpc": "gRPC", "inprocess": "in-process"}


def pa_number(value: float) -> str:
    """A double as C++'s ``ostream <<`` prints it (6 significant digits)."""
    return f"{value:.6g}"


def level_label(mode: str, value: float) -> str:
    return str(int(value)) if mode == "concurrency" else pa_number(value)


# -- console -----------------------------------------------------------------------------
def settings_text(settings: Any, server_stats: bool) -> str:
    lines = ["*** Measurement Settings ***", f"  Batch size: {settings.batch_size}"]
    if settings.protocol == "inprocess":
        lines.append("  Service Kind: dlserve in-process API")
    else:
        lines.append("  Service Kind: TRITON")  # (perf_analyzer's line, which scripts match whole)
        lines.append(f"  Server: {PROTOCOL_NAMES[settings.protocol]} {settings.url}")
    if settings.request_count:  # (perf_analyzer's line: one window, nothing to stabilize)
        lines.append(f"  Sending {settings.request_count} benchmark requests")
    else:
        if settings.count_windows:  # (perf_analyzer's lines)
            lines.append('  Using "count_windows" mode for stabilization')
            lines.append(f"  Minimum number of samples in each window: {settings.count_windows}")
        else:
            lines.append('  Using "time_windows" mode for stabilization')
        metric = "average latency" if settings.percentile < 0 else f"p{settings.percentile}latency"
        if settings.throughput_only:
            lines.append("  Stabilizing using average throughput")
        else:
            lines.append(f"  Stabilizing using {metric} and throughput")
    if not settings.count_windows:
        lines.append(f"  Measurement window: {settings.measurement_interval_ms} msec")
    if settings.periodic_range:
        start, end, step = settings.periodic_range
        lines.append(f"  Periodic concurrency: {start} to {end} requests, {step} more each time the latest "
                     f"have had {settings.request_period} responses")
    elif settings.mode == "concurrency":
        lines.append(f"  Latency limit: {settings.latency_threshold_ms} msec")
        top = "no limit" if settings.sweep_unbounded else f"{int(max(settings.levels))} concurrent requests"
        lines.append(f"  Concurrency limit: {top}")
    elif settings.request_intervals_us:
        lines.append(f"  Using {len(settings.request_intervals_us)} request intervals from --request-intervals")
    else:
        kind = "uniform" if settings.distribution == "constant" else "poisson"
        lines.append(f"  Using {kind} distribution on request generation")
    if settings.binary_search:  # (perf_analyzer's line)
        lines.append("  Using Binary Search algorithm")
    if settings.streaming:
        lines.append("  Using gRPC streaming (ModelStreamInfer) for inference")
    lines.append(
        f"  Using asynchronous calls for inference (asyncio, {settings.processes} "
        f"process{'es' if settings.processes > 1 else ''})"
    )
    if settings.shared_memory != "none":
        lines.append(f"  Using {settings.shared_memory} shared memory for inputs and outputs")
    if not server_stats:
        lines.append("  Server-side statistics: not available from this server")
    return "\n".join(lines) + "\n"


def periodic_text(window: ClientWindow, export_file: str) -> str:
    """The periodic run, in a line (perf_analyzer prints nothing after its settings)."""
    return (f"Periodic concurrency: {window.count} requests, {window.responses} responses in "
            f"{pa_number(window.duration_ns / 1e9)} sec; every one of them is in {export_file}")


def level_header(mode: str, value: float) -> str:
    if mode == "concurrency":
        return f"Request concurrency: {int(value)}"
    return f"Request Rate: {pa_number(value)} inference requests per seconds"


def pass_text(trial: int, throughput: float, avg_us: float, std_us: float) -> str:
    """perf_analyzer's verbose line for one measurement window."""
    return (f"  Pass [{trial}] throughput: {pa_number(throughput)} infer/sec. "
            f"Avg latency: {int(avg_us)} usec (std {int(std_us)} usec). ")


def level_text(result: LevelResult, protocol: str, header: bool = True) -> str:
    lines = [level_header(result.mode, result.value)] if header else []
    lines += ["  Client: ", f"    Request count: {result.request_count}"]
    if result.sequences is not None:  # (perf_analyzer's line for a sequence model)
        lines.append(f"    Sequence count: {result.sequences} ({pa_number(result.sequence_throughput)} seq/sec)")
    lines.append(f"    Throughput: {pa_number(result.throughput)} infer/sec")
    if result.decoupled:  # (perf_analyzer's line for a decoupled model)
        lines.append(f"    Response Throughput: {pa_number(result.response_throughput)} infer/sec")
    if result.stability_percentile < 0:
        lines.append(
            f"    Avg latency: {int(result.avg_latency_us)} usec "
            f"(standard deviation {int(result.std_latency_us)} usec)"
        )
    for p, value in sorted(result.percentiles_us.items()):
        lines.append(f"    p{p} latency: {int(value)} usec")
    send_recv = result.avg_send_us + result.avg_recv_us
    wait = max(0.0, result.avg_latency_us - send_recv)
    if protocol == "http":
        lines.append(
            f"    Avg HTTP time: {int(result.avg_latency_us)} usec "
            f"(send/recv {int(send_recv)} usec + response wait {int(wait)} usec)"
        )
    elif protocol == "grpc":
        lines.append(
            f"    Avg gRPC time: {int(result.avg_latency_us)} usec "
            f"((un)marshal request/response {int(send_recv)} usec + response wait {int(wait)} usec)"
        )
    else:
        lines.append(f"    Avg in-process time: {int(result.avg_latency_us)} usec")
    if result.mode == "request_rate" and result.delayed:
        pct = 100.0 * result.delayed / max(result.sent, 1)
        lines.append(f"    Delayed request count: {result.delayed} ({pct:.1f}%)")
    if result.server is not None:
        lines += ["  Server: ", *server_lines(result.server, "    ")]
    if result.gpu_metrics is not None:
        lines += ["", "  Server Prometheus Metrics: "]
        for title, per_gpu in result.gpu_metrics.items():
            lines.append(f"    {title}:")
            lines += [f"      {uuid} : {_gpu_figure(title, value)}" for uuid, value in per_gpu.items()]
    if not result.stable:
        lines.append("  (not stable: these are the last 3 windows)")
    return "\n".join(lines) + "\n"


def _gpu_figure(title: str, value: float, for_csv: bool = False) -> str:
    """One GPU's figure as perf_analyzer writes it: utilization a fraction in the CSV and
    a percentage on the console, bytes whole, units on the console only."""
    unit = UNITS[title]
    if unit == "bytes":
        return str(int(value)) if for_csv else f"{int(value)} bytes"
    if for_csv:
        return pa_number(value)
    return f"{pa_number(value * 100)}%" if unit == "fraction" else f"{pa_number(value)} {unit}"


def server_lines(server: dict[str, Any], indent: str) -> list[str]:
    """perf_analyzer's server block for a model (with its composing models' below)."""
    if not server["success_count"]:
        return [f"{indent}Request count: 0"]
    lines = [
        f"{indent}Inference count: {server['inference_count']}",
        f"{indent}Execution count: {server['execution_count']}",
        f"{indent}Successful request count: {server['success_count']}",
    ]
    latency = f"{indent}Avg request latency: {int(server['avg_request_latency_us'])} usec "
    if "composing_models" not in server:
        return lines + [
            latency + f"(overhead {int(server['overhead_us'])} usec + queue {int(server['queue_us'])} usec + "
            f"compute input {int(server['compute_input_us'])} usec + compute infer "
            f"{int(server['compute_infer_us'])} usec + compute output {int(server['compute_output_us'])} usec)",
        ]
    lines += [
        latency + f"(overhead {int(server['composing_overhead_us'])} usec + queue "
        f"{int(server['composing_queue_us'])} usec + compute {int(server['composing_compute_us'])} usec)",
        "",
        f"{indent[2:]}Composing models: ",
    ]
    for model in server["composing_models"]:
        lines.append(f"{indent[2:]}{model['model']}, version: {model['version']}")
        lines += server_lines(model, indent + "  ")
    return lines


def delayed_warning(result: LevelResult) -> str | None:
    if result.mode != "request_rate" or not result.delayed:
        return None
    pct = 100.0 * result.delayed / max(result.sent, 1)
    if pct < 10:
        return None
    return (
        f"WARNING: dlserve perf was not able to keep up with the desired request rate. "
        f"{pct:.2f}% of the requests were delayed."
    )


def summary_text(results: list[LevelResult], percentile: int) -> str:
    metric = "Average" if percentile < 0 else f"p{percentile}"
    lines = [f"Inferences/Second vs. Client {metric} Batch Latency"]
    for r in results:
        label = "Concurrency" if r.mode == "concurrency" else "Request Rate"
        lines.append(
            f"{label}: {level_label(r.mode, r.value)}, throughput: {pa_number(r.throughput)} infer/sec, "
            f"latency {int(r.latency_us)} usec"
        )
    return "\n".join(lines) + "\n"


# -- CSV ---------------------------------------------------------------------------------
def csv_columns(results: list[LevelResult], mode: str, server_stats: bool, verbose: bool = False) -> list[str]:
    columns = ["Concurrency" if mode == "concurrency" else "Request Rate", "Inferences/Second"]
    if results and results[0].decoupled:
        columns.append("Response Throughput")
    columns.append("Client Send")
    if server_stats:
        columns += SERVER_COLUMNS
    columns.append("Client Recv")
    percentiles = sorted(results[0].percentiles_us) if results else [50, 90, 95, 99]
    columns += [f"p{p} latency" for p in percentiles]
    if verbose:  # (--verbose-csv, as perf_analyzer's)
        columns += ["Avg latency", "request/response", "response wait"]
        if results and results[0].gpu_metrics is not None:
            columns += list(results[0].gpu_metrics)
    return columns


def csv_rows(results: list[LevelResult], server_stats: bool, verbose: bool = False) -> list[list[str]]:
    rows = []
    for r in sorted(results, key=lambda r: r.throughput):
        row = [level_label(r.mode, r.value), pa_number(r.throughput)]
        if r.decoupled:
            row.append(pa_number(r.response_throughput))
        row.append(str(int(r.avg_send_us)))
        if server_stats:
            s = r.server or {}
            queue = int(s.get("queue_us", 0))
            c_in, c_infer, c_out = (
                int(s.get(k, 0)) for k in ("compute_input_us", "compute_infer_us", "compute_output_us")
            )
            wait = int(r.avg_latency_us - r.avg_send_us - r.avg_recv_us)
            network = max(0, wait - (queue + c_in + c_infer + c_out))
            row += [str(network), str(queue), str(c_in), str(c_infer), str(c_out)]
        row.append(str(int(r.avg_recv_us)))
        row += [str(int(v)) for _, v in sorted(r.percentiles_us.items())]
        if verbose:  # the average; sending and receiving; the rest of it, waiting for the answer
            exchange = r.avg_send_us + r.avg_recv_us
            row += [str(int(r.avg_latency_us)), str(int(exchange)), str(int(r.avg_latency_us - exchange))]
            for title, per_gpu in (r.gpu_metrics or {}).items():  # "uuid:value;" per GPU
                row.append("".join(f"{uuid}:{_gpu_figure(title, value, for_csv=True)};" for uuid, value in per_gpu.items()))
        rows.append(row)
    return rows


def composing_csv_rows(results: list[LevelResult], index: int) -> list[list[str]]:
    """perf_analyzer's rows for composing model ``index``: its share of the throughput
    (its requests per request of the model benchmarked), no client columns, and its own
    overhead, queue and compute."""
    rows = []
    for r in sorted(results, key=lambda r: r.throughput):
        parent = r.server or {}
        model = parent["composing_models"][index]
        share = model["success_count"] / parent["success_count"] if parent["success_count"] else 0.0
        rows.append([
            level_label(r.mode, r.value), pa_number(share * r.throughput), "0",
            *(str(int(model[k])) for k in ("overhead_us", "queue_us", "compute_input_us", "compute_infer_us",
                                           "compute_output_us")),
            "0",
        ])
    return rows


def write_csv(path: str, results: list[LevelResult], mode: str, server_stats: bool, verbose: bool = False) -> None:
    """The CSV; with composing models, one more beside it per model, as perf_analyzer
    writes them (``NAME_vVERSION.FILE``, :func:`composing_csv_rows`)."""
    _write_rows(path, csv_columns(results, mode, server_stats, verbose), csv_rows(results, server_stats, verbose))
    composing = (results[0].server or {}).get("composing_models", []) if results else []
    folder, name = os.path.split(path)
    columns = [csv_columns(results, mode, False)[0], "Inferences/Second", "Client Send", *SERVER_COLUMNS, "Client Recv"]
    for index, model in enumerate(composing):
        path = os.path.join(folder, f"{model['model']}_v{model['version']}.{name}")
        _write_rows(path, columns, composing_csv_rows(results, index))


def _write_rows(path: str, columns: list[str], rows: list[list[str]]) -> None:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(columns)
    writer.writerows(rows)
    with open(path, "w", encoding="utf-8") as f:
        f.write(buffer.getvalue())


# -- JSON ------------------------------------------------------------------------------------
def json_document(settings: Any, results: list[LevelResult], server_stats: bool) -> dict[str, Any]:
    columns = csv_columns(results, settings.mode, server_stats)
    return {
        "tool": "dlserve perf",
        "model": settings.model,
        "model_version": settings.version,
        "protocol": settings.protocol,
        "url": settings.url,
        "mode": settings.mode,
        "batch_size": settings.batch_size,
        "settings": settings.as_dict(),
        "server_statistics": server_stats,
        "csv_columns": columns,
        "results": [
            {**r.as_dict(), "csv": dict(zip(columns, csv_rows([r], server_stats)[0]))} for r in results
        ],
    }


def write_json(path: str, settings: Any, results: list[LevelResult], server_stats: bool) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(json_document(settings, results, server_stats), f, indent=2)
        f.write("\n")


# -- plot ----------------------------------------------------------------------------------
def write_plot(path: str, settings: Any, results: list[LevelResult]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted(results, key=lambda r: r.value)
    throughput = [r.throughput for r in points]
    figure, axes = plt.subplots(figsize=(8, 5))
    axes.plot(throughput, [r.avg_latency_us / 1000 for r in points], "o-", label="avg")
    for p, style in ((50, "s--"), (90, "^--"), (99, "v--")):
        axes.plot(throughput, [r.percentiles_us[p] / 1000 for r in points], style, label=f"p{p}")
    label = "concurrency" if settings.mode == "concurrency" else "rate"
    for r in points:
        axes.annotate(f"{label} {level_label(r.mode, r.value)}", (r.throughput, r.avg_latency_us / 1000),
                      textcoords="offset points", xytext=(4, 4), fontsize=8)
    axes.set_xlabel("throughput (infer/sec)")
    axes.set_ylabel("latency (ms)")
    axes.set_title(f"{settings.model} ({PROTOCOL_NAMES[settings.protocol]}): latency vs throughput")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# -- live progress ---------------------------------------------------------------------------
class Progress:
    """One stderr line, rewritten in place; silent when disabled (stderr not a terminal)."""

    def __init__(self, enabled: bool, stream: TextIO | None = None, every: float = 0.2) -> None:
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.every = every
        self._shown = False
        self._last = 0.0

    def update(self, text: str, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self.every:
            return
        self._last = now
        width = shutil.get_terminal_size((100, 20)).columns - 1
        self.stream.write("\r" + text[:width] + "\x1b[K")
        self.stream.flush()
        self._shown = True

    def clear(self) -> None:
        if self.enabled and self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False


def print_out(text: str, progress: Progress | None = None) -> None:
    if progress is not None:
        progress.clear()
    sys.stdout.write(text)
    sys.stdout.flush()
