"""Measurement windows, perf_analyzer's stability rule, and the summary of a load level.

* A window counts the requests that *ended* in it (perf_analyzer's rule); throughput is
  ``requests x batch size / window length``.
* Stable: the last 3 windows all have requests, and both their throughputs and their
  latencies (the average, or ``--percentile``'s) are within ``--stability-percentage``:
  ``max / min <= 1 + pct/100``.
* The reported result merges those last 3 windows: latencies pooled for percentiles,
  counts and durations summed, server statistics deltas summed.
* Percentiles use perf_analyzer's index: ``sorted[int(p/100 * (n - 1) + 0.5)]``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from dlserve.perf.gpu_metrics import Merged, Read, merge

if TYPE_CHECKING:
    from dlserve.perf.export import RequestLog

STABILITY_WINDOW = 3
REPORTED_PERCENTILES = (50, 90, 95, 99)
_DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


@dataclasses.dataclass
class ClientWindow:
    """What the load generator saw in one window (one process, or several merged)."""

    duration_ns: int
    latencies_ns: np.ndarray  # int64, one per request that ended in the window
    send_ns: int = 0  # summed over requests
    recv_ns: int = 0
    responses: int = 0  # responses with outputs (a decoupled model's: several per request)
    delayed: int = 0  # request-rate mode: requests sent late because every slot was busy
    sent: int = 0  # requests started in the window
    sequences: int = 0  # sequences whose last request ended in the window
    logs: list[RequestLog] = dataclasses.field(default_factory=list)  # --profile-export-file's, one per process

    @property
    def count(self) -> int:
        return int(self.latencies_ns.size)

    @classmethod
    def merge_processes(cls, parts: list[ClientWindow], duration_ns: int) -> ClientWindow:
        """Windows of several processes over the same time span."""
        return cls(
            duration_ns=duration_ns,
            latencies_ns=np.concatenate([p.latencies_ns for p in parts]) if parts else np.empty(0, np.int64),
            send_ns=sum(p.send_ns for p in parts),
            recv_ns=sum(p.recv_ns for p in parts),
            responses=sum(p.responses for p in parts),
            delayed=sum(p.delayed for p in parts),
            sent=sum(p.sent for p in parts),
            sequences=sum(p.sequences for p in parts),
            logs=[log for p in parts for log in p.logs],
        )


@dataclasses.dataclass
class ServerStats:
    """Counters of the statistics extension for one model (all its versions summed), and
    for each model it calls (``--bls-composing-models``) its own, by (name, version)."""

    inference_count: int = 0
    execution_count: int = 0
    counts: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(_DURATIONS, 0))
    ns: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(_DURATIONS, 0))
    versions: tuple[str, ...] = ()  # the versions summed
    composing: dict[tuple[str, str], ServerStats] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_json(cls, document: dict[str, Any], model: str, version: str = "") -> ServerStats | None:
        """From ``{"model_stats": [...]}`` (HTTP JSON or gRPC's message as a dict, where
        64-bit numbers are strings); None when the model is not in it."""
        found = None
        for entry in document.get("model_stats", []) or []:
            if entry.get("name") != model:
                continue
            if version and str(entry.get("version", "")) != version:
                continue
            found = found or cls()
            found.versions += (str(entry.get("version", "")),)
            found.inference_count += int(entry.get("inference_count", 0) or 0)
            found.execution_count += int(entry.get("execution_count", 0) or 0)
            stats = entry.get("inference_stats") or {}
            for key in _DURATIONS:
                duration = stats.get(key) or {}
                found.counts[key] += int(duration.get("count", 0) or 0)
                found.ns[key] += int(duration.get("ns", 0) or 0)
        return found

    def __sub__(self, other: ServerStats) -> ServerStats:
        return self._combine(other, -1)

    def __add__(self, other: ServerStats) -> ServerStats:
        return self._combine(other, 1)

    def _combine(self, other: ServerStats, sign: int) -> ServerStats:
        return ServerStats(
            self.inference_count + sign * other.inference_count,
            self.execution_count + sign * other.execution_count,
            {k: self.counts[k] + sign * other.counts[k] for k in _DURATIONS},
            {k: self.ns[k] + sign * other.ns[k] for k in _DURATIONS},
            self.versions,
            {key: stats._combine(other.composing[key], sign) for key, stats in self.composing.items()},
        )

    def avg_us(self, key: str) -> float:
        count = self.counts[key]
        return self.ns[key] / count / 1000 if count else 0.0

    def summary(self) -> dict[str, Any]:
        """perf_analyzer's "Server:" numbers (µs averages per request)."""
        queue = self.avg_us("queue")
        compute_input = self.avg_us("compute_input")
        compute_infer = self.avg_us("compute_infer")
        compute_output = self.avg_us("compute_output")
        request = self.avg_us("success")
        return {
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "success_count": self.counts["success"],
            "avg_request_latency_us": request,
            "overhead_us": max(0.0, request - queue - compute_input - compute_infer - compute_output),
            "queue_us": queue,
            "compute_input_us": compute_input,
            "compute_infer_us": compute_infer,
            "compute_output_us": compute_output,
            **self._composing_summary(request),
        }

    def _composing_summary(self, request_us: float) -> dict[str, Any]:
        """perf_analyzer's view of a model with composing models: its queue and compute
        are theirs, summed (averages per request of each), the rest its overhead."""
        if not self.composing:
            return {}
        models = [
            {"model": name, "version": version or ",".join(stats.versions), **stats.summary()}
            for (name, version), stats in self.composing.items()
        ]
        queue = sum(m["queue_us"] for m in models if m["success_count"])
        compute = sum(
            m["compute_input_us"] + m["compute_infer_us"] + m["compute_output_us"] for m in models if m["success_count"]
        )
        return {
            "composing_models": models,
            "composing_queue_us": queue,
            "composing_compute_us": compute,
            "composing_overhead_us": max(0.0, request_us - queue - compute),
        }


@dataclasses.dataclass
class Window:
    client: ClientWindow
    server: ServerStats | None
    batch_size: int = 1
    gpu: list[Read] | None = None  # --collect-metrics' reads in the window

    @property
    def throughput(self) -> float:
        if self.client.duration_ns <= 0:
            return 0.0
        return self.client.count * self.batch_size / (self.client.duration_ns / 1e9)

    def latency_ns(self, percentile: int = -1) -> float:
        """The stabilising latency: the average, or the given percentile."""
        latencies = self.client.latencies_ns
        if latencies.size == 0:
            return 0.0
        if percentile > 0:
            return float(percentile_ns(np.sort(latencies), percentile))
        return float(latencies.mean())


def percentile_ns(sorted_ns: np.ndarray, percentile: float) -> int:
    if sorted_ns.size == 0:
        return 0
    index = int(percentile / 100.0 * (sorted_ns.size - 1) + 0.5)
    return int(sorted_ns[min(index, sorted_ns.size - 1)])


def _within(values: list[float], pct: float) -> bool:
    low, high = min(values), max(values)
    if low <= 0:
        return False
    return high / low <= 1 + pct / 100.0


def is_stable(windows: list[Window], pct: float, percentile: int = -1, throughput_only: bool = False) -> bool:
    """perf_analyzer's rule over the last 3 windows (in its async and streaming modes, the
    throughput alone)."""
    if len(windows) < STABILITY_WINDOW:
        return False
    last = windows[-STABILITY_WINDOW:]
    if any(w.client.count == 0 for w in last):
        return False
    return _within([w.throughput for w in last], pct) and (
        throughput_only or _within([w.latency_ns(percentile) for w in last], pct)
    )


@dataclasses.dataclass
class LevelResult:
    """One point of the sweep: a concurrency or a request rate, measured."""

    mode: str  # "concurrency" or "request_rate"
    value: float
    batch_size: int
    stable: bool
    windows: int  # measurement windows it took
    request_count: int
    duration_s: float
    throughput: float  # inferences per second
    avg_latency_us: float
    std_latency_us: float
    percentiles_us: dict[int, float]
    avg_send_us: float
    avg_recv_us: float
    delayed: int = 0
    sent: int = 0
    server: dict[str, Any] | None = None
    stability_percentile: int = -1
    responses: int = 0  # responses with outputs over the level's windows
    decoupled: bool = False  # a decoupled model's: its response throughput is reported too
    sequences: int | None = None  # a sequence model's: the sequences that ended
    gpu_metrics: Merged | None = None  # --collect-metrics'

    @property
    def sequence_throughput(self) -> float:
        return (self.sequences or 0) / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def response_throughput(self) -> float:
        return self.responses / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def latency_us(self) -> float:
        """The latency perf_analyzer reports per level: average, or --percentile's."""
        if self.stability_percentile > 0:
            return self.percentiles_us[self.stability_percentile]
        return self.avg_latency_us

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["percentiles_us"] = {f"p{k}": v for k, v in sorted(self.percentiles_us.items())}
        out["latency_us"] = self.latency_us
        return out


def summarize(
    mode: str, value: float, windows: list[Window], stable: bool, percentile: int = -1, decoupled: bool = False,
    sequence: bool = False,
) -> LevelResult:
    """Merge the last 3 windows (fewer if there are fewer) into the level's result."""
    last = windows[-STABILITY_WINDOW:]
    batch = last[0].batch_size if last else 1
    latencies = np.sort(np.concatenate([w.client.latencies_ns for w in last])) if last else np.empty(0, np.int64)
    count = int(latencies.size)
    duration_ns = sum(w.client.duration_ns for w in last)
    wanted = sorted(set(REPORTED_PERCENTILES) | ({percentile} if percentile > 0 else set()))
    gpu = [w.gpu for w in last if w.gpu is not None]  # (none when not collecting)
    server = None
    if last and all(w.server is not None for w in last):
        total = last[0].server
        for w in last[1:]:
            total = total + w.server  # type: ignore[operator]
        server = total.summary() if total is not None else None
    return LevelResult(
        mode=mode,
        value=value,
        batch_size=batch,
        stable=stable,
        windows=len(windows),
        request_count=count,
        duration_s=duration_ns / 1e9,
        throughput=count * batch / (duration_ns / 1e9) if duration_ns > 0 else 0.0,
        avg_latency_us=float(latencies.mean()) / 1000 if count else 0.0,
        std_latency_us=float(latencies.std()) / 1000 if count else 0.0,
        percentiles_us={p: percentile_ns(latencies, p) / 1000 for p in wanted},
        avg_send_us=sum(w.client.send_ns for w in last) / count / 1000 if count else 0.0,
        avg_recv_us=sum(w.client.recv_ns for w in last) / count / 1000 if count else 0.0,
        delayed=sum(w.client.delayed for w in last),
        sent=sum(w.client.sent for w in last),
        server=server,
        stability_percentile=percentile,
        responses=sum(w.client.responses for w in last),
        decoupled=decoupled,
        sequences=sum(w.client.sequences for w in last) if sequence else None,
        gpu_metrics=merge([read for reads in gpu for read in reads]) if gpu else None,
    )
