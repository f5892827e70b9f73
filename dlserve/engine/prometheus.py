"""The engine's metrics as Prometheus text: Triton's ``nv_*`` names and labels, plus
dlserve's and the models' own.

Values are read from the engine's statistics when rendered, so serving requests
costs nothing extra for metrics (but an append per latency with
``summary_latencies``). Counters keep Triton's names exactly (no ``_total`` suffix),
which is why the text is rendered here rather than through prometheus-client's
collectors. What is shown follows ``--metrics-config``
(:mod:`dlserve.engine.metrics_settings`). CPU metrics come from /proc, refreshed
once per metrics interval; GPU metrics from nvidia-ml-py when a GPU and its driver
are present. The metrics port (:mod:`dlserve.frontends.metrics`) and
``Server.metrics()`` both serve this text.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from dlserve.engine.core import Engine
from dlserve.engine.custom_metrics import APPLICATION, Labels, sample
from dlserve.engine.model import ModelVersion
from dlserve.engine.statistics import FAILURE_REASONS, Duration

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _family(name: str, kind: str, help_text: str, samples: list[str]) -> list[str]:
    """One metric family: its HELP and TYPE lines, then its samples."""
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]


def _gauges(rows: tuple[tuple[str, str, float], ...]) -> list[str]:
    """Unlabelled gauges, one family each: (name, help, value) rows."""
    return [line for name, help_text, value in rows for line in _family(name, "gauge", help_text, [sample(name, (), value)])]

_MODEL_METRICS = (
    ("nv_inference_request_success", "counter", "Number of successful inference requests, all batch sizes"),
    ("nv_inference_request_failure", "counter", "Number of failed inference requests, all batch sizes"),
    ("nv_inference_count", "counter", "Number of inferences performed (does not include cached requests)"),
    ("nv_inference_exec_count", "counter", "Number of model executions performed (does not include cached requests)"),
    ("nv_inference_request_duration_us", "counter", "Cumulative inference request duration in microseconds (includes cached requests)"),
    ("nv_inference_queue_duration_us", "counter", "Cumulative inference queuing duration in microseconds (includes cached requests)"),
    ("nv_inference_compute_input_duration_us", "counter", "Cumulative compute input duration in microseconds (does not include cached requests)"),
    ("nv_inference_compute_infer_duration_us", "counter", "Cumulative compute inference duration in microseconds (does not include cached requests)"),
    ("nv_inference_compute_output_duration_us", "counter", "Cumulative inference compute output duration in microseconds (does not include cached requests)"),
    ("nv_inference_pending_request_count", "gauge", "Instantaneous number of pending requests awaiting execution per-model."),
    # dlserve's own, per instance (its worker process): alert on crashes and instances down.
    ("dlserve_instance_restarts_total", "counter", "Number of times the instance's worker process was restarted after it died (attempts, failed ones included)"),
    ("dlserve_instance_ready", "gauge", "Whether the instance's worker process is up and serving (1) or not (0)"),
)
# (counter, statistics field): what --metrics-config counter_latencies=false leaves out,
# with the per-model cache counters.
_LATENCY_COUNTERS = (
    ("nv_inference_request_duration_us", "success"),  # successes only, as Triton
    ("nv_inference_queue_duration_us", "queue"),
    ("nv_inference_compute_input_duration_us", "compute_input"),
    ("nv_inference_compute_infer_duration_us", "compute_infer"),
    ("nv_inference_compute_output_duration_us", "compute_output"),
)
_LATENCY_COUNTER_NAMES = frozenset(name for name, _ in _LATENCY_COUNTERS)


# Per model whose config enables the response cache (Triton lists them for those only).
_CACHE_MODEL_METRICS = (
    ("nv_cache_num_hits_per_model", "counter", "Number of cache hits per model", "cache_hit", False),
    ("nv_cache_hit_duration_per_model", "counter", "Total cache hit duration per model, in microseconds", "cache_hit", True),
    ("nv_cache_num_misses_per_model", "counter", "Number of cache misses per model", "cache_miss", False),
    ("nv_cache_miss_duration_per_model", "counter", "Total cache miss (insert+lookup) duration per model, in microseconds", "cache_miss", True),
)

# --metrics-config summary_latencies=true: (family, statistics field, help, shown for
# models using the response cache (True), for the others (False), or for all (None)).
# As Triton 2.51 shows them, help texts included: a model using the cache has no
# request summary, and the compute ones say "Cumulative".
_SUMMARIES = (
    ("nv_inference_request_summary_us", "success", "Summary of inference request duration in microseconds (includes cached requests)", False),
    ("nv_inference_queue_summary_us", "queue", "Summary of inference queuing duration in microseconds (includes cached requests)", None),
    ("nv_inference_compute_input_summary_us", "compute_input", "Cumulative compute input duration in microseconds (does not include cached requests)", None),
    ("nv_inference_compute_infer_summary_us", "compute_infer", "Cumulative compute inference duration in microseconds (does not include cached requests)", None),
    ("nv_inference_compute_output_summary_us", "compute_output", "Cumulative inference compute output duration in microseconds (does not include cached requests)", None),
    ("nv_cache_hit_summary_per_model", "cache_hit", "Summary of cache hit counts/durations per model, in microseconds.", True),
    ("nv_cache_miss_summary_per_model", "cache_miss", "Summary of cache miss counts/durations per model, in microseconds.", True),
)


def _model_labels(engine: Engine, model: ModelVersion, *more: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    """A model version's labels, in name order: with model namespacing, as in Triton,
    its namespace too (the same name may be served from several repositories)."""
    labels = [("model", model.name), ("version", str(model.version)), *more]
    if engine.settings.model_namespacing:
        labels.append(("namespace", model.namespace))
    return tuple(sorted(labels))


def _versions(engine: Engine) -> list[ModelVersion]:
    """Every model version the engine holds."""
    if engine.manager is None:
        return []
    return [model for entry in engine.manager.models.values() for model in entry.versions.values()]


def _cache_lines(engine: Engine) -> list[str]:
    """The response cache's metrics: per model that uses it (with counter_latencies),
    and the cache's own gauges when the server has one (Triton's order and words)."""
    lines: list[str] = []
    if engine.settings.metrics.counter_latencies:
        rows: dict[str, list[str]] = {name: [] for name, *_ in _CACHE_MODEL_METRICS}
        for model in _versions(engine):
            if not model.config.response_cache.enable:
                continue
            labels = _model_labels(engine, model)
            totals = model.stats.lifetime().durations
            for name, _, _, field, is_duration in _CACHE_MODEL_METRICS:
                duration = totals[field]
                rows[name].append(sample(name, labels, duration.ns // 1000 if is_duration else duration.count))
        for name, kind, help_text, _, _ in _CACHE_MODEL_METRICS:
            if rows[name]:
                lines += _family(name, kind, help_text, rows[name])
    cache = engine.response_cache
    if cache is not None:
        lines += _gauges((
            ("nv_cache_util", "Cache utilization [0.0 - 1.0]", cache.utilization),
            ("nv_cache_num_entries", "Number of responses stored in response cache", len(cache)),
            ("nv_cache_num_hits", "Number of cache hits in response cache", cache.hits),
            ("nv_cache_num_misses", "Number of cache misses in response cache", cache.misses),
            ("nv_cache_num_lookups", "Number of cache lookups in response cache", cache.lookups),
            ("nv_cache_num_evictions", "Number of cache evictions in response cache", cache.evictions),
            ("nv_cache_lookup_duration", "Total cache lookup duration (hit and miss), in microseconds",
             cache.lookup_ns // 1000),
            ("nv_cache_insertion_duration", "Total cache insertion duration, in microseconds",
             cache.insertion_ns // 1000),
        ))
    return lines


def _quantile_label(quantile: float) -> str:
    """As prometheus-cpp writes it: "0.5", "1"."""
    return str(int(quantile)) if quantile.is_integer() else repr(quantile)


def _summary_samples(
    name: str, labels: Labels, total: Duration, recent: Duration, quantiles: tuple[float, ...]
) -> list[str]:
    """One summary's series: count and sum over the model's life (``total``, as its
    counters), quantiles over the last minute of ``recent``'s samples (NaN with no
    observation in it)."""
    assert recent.window is not None  # (kept by every model's statistics when summaries are on)
    lines = [
        sample(f"{name}_count", labels, total.count),
        sample(f"{name}_sum", labels, total.ns // 1000),
    ]
    for quantile, value in zip(quantiles, recent.window.quantiles(quantiles)):
        lines.append(sample(name, (*labels, ("quantile", _quantile_label(quantile))), value))
    return lines


def _summary_lines(engine: Engine) -> list[str]:
    """The latency summaries of every model version (summary_latencies=true)."""
    quantiles = tuple(quantile for quantile, _ in engine.settings.metrics.summary_quantiles)
    rows: dict[str, list[str]] = {name: [] for name, *_ in _SUMMARIES}
    for model in _versions(engine):
        cached = bool(model.config.response_cache.enable)
        labels = _model_labels(engine, model)
        totals = model.stats.lifetime().durations
        for name, field, _, for_cached in _SUMMARIES:
            if for_cached is None or for_cached == cached:
                rows[name] += _summary_samples(
                    name, labels, totals[field], model.stats.durations[field], quantiles
                )
    lines: list[str] = []
    for name, _, help_text, _ in _SUMMARIES:
        if rows[name]:
            lines += _family(name, "summary", help_text, rows[name])
    return lines


def _model_samples(engine: Engine) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {name: [] for name, _, _ in _MODEL_METRICS}
    for model in _versions(engine):
        stats = model.stats.lifetime()
        labels = _model_labels(engine, model)
        d = stats.durations
        out["nv_inference_request_success"].append(
            sample("nv_inference_request_success", labels, d["success"].count)
        )
        for reason in FAILURE_REASONS:
            out["nv_inference_request_failure"].append(
                sample(
                    "nv_inference_request_failure",
                    _model_labels(engine, model, ("reason", reason)),
                    stats.failures[reason],
                )
            )
        out["nv_inference_count"].append(sample("nv_inference_count", labels, stats.inference_count))
        out["nv_inference_exec_count"].append(sample("nv_inference_exec_count", labels, stats.execution_count))
        for metric, field in _LATENCY_COUNTERS:
            out[metric].append(sample(metric, labels, d[field].ns // 1000))
        out["nv_inference_pending_request_count"].append(
            sample("nv_inference_pending_request_count", labels, model.pending)
        )
        for instance in model.instances:
            # Not "instance": Prometheus gives that label to the scraped target.
            where = (*labels, ("model_instance", instance.name))
            out["dlserve_instance_restarts_total"].append(
                sample("dlserve_instance_restarts_total", where, instance.restarts)
            )
            out["dlserve_instance_ready"].append(
                sample("dlserve_instance_ready", where, int(instance.ready))
            )
    return out


class CpuSampler:
    """nv_cpu_* as Triton's poller shows them: CPU utilization (/proc/stat) over the
    last metrics interval and memory (/proc/meminfo) at its end, refreshed at most
    once per interval, so that scrapes in between (by any number of scrapers) see the
    same values. Refreshed when read rather than by a timer: the first read after a
    quiet spell covers the whole time since the previous refresh."""

    def __init__(self) -> None:
        self._times = self._cpu_times()
        self._refreshed = time.monotonic()
        self._values: tuple[float, int, int] | None = None

    def values(self, interval_s: float) -> tuple[float, int, int]:
        """(utilization, total memory, used memory) as of the last refresh."""
        now = time.monotonic()
        if self._values is None or now - self._refreshed >= interval_s:
            (total, idle), (last_total, last_idle) = self._cpu_times(), self._times
            elapsed = total - last_total
            utilization = 0.0 if elapsed <= 0 else 1.0 - (idle - last_idle) / elapsed
            self._times, self._refreshed = (total, idle), now
            self._values = (utilization, *self._memory())
        return self._values

    @staticmethod
    def _cpu_times() -> tuple[int, int]:
        """(all, idle) jiffies since boot."""
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        idle = values[3] + (values[4] if len(values) > 4 else 0)
        return sum(values), idle

    @staticmethod
    def _memory() -> tuple[int, int]:
        """(total, used) bytes of RAM."""
        info: dict[str, int] = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0]) * 1024
        total = info.get("MemTotal", 0)
        return total, total - info.get("MemAvailable", info.get("MemFree", 0))


@functools.cache
def _nvml() -> Any:
    """pynvml, initialised once for the process; None without it, a driver or a GPU."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver / library: no GPU metrics
        return None
    return pynvml


def _gpu_lines() -> list[str]:
    """nv_gpu_* gauges per GPU through NVML; nothing when there is no GPU or driver."""
    pynvml = _nvml()
    if pynvml is None:
        return []
    lines: list[str] = []
    try:
        rows: dict[str, list[str]] = {
            "nv_gpu_utilization": [],
            "nv_gpu_memory_total_bytes": [],
            "nv_gpu_memory_used_bytes": [],
            "nv_gpu_power_usage": [],
            "nv_gpu_power_limit": [],
        }
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            labels = (("gpu_uuid", uuid if isinstance(uuid, str) else uuid.decode()),)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            rows["nv_gpu_utilization"].append(
                sample("nv_gpu_utilization", labels, pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100)
            )
            rows["nv_gpu_memory_total_bytes"].append(sample("nv_gpu_memory_total_bytes", labels, memory.total))
            rows["nv_gpu_memory_used_bytes"].append(sample("nv_gpu_memory_used_bytes", labels, memory.used))
            rows["nv_gpu_power_usage"].append(
                sample("nv_gpu_power_usage", labels, pynvml.nvmlDeviceGetPowerUsage(handle) / 1000)
            )
            rows["nv_gpu_power_limit"].append(
                sample("nv_gpu_power_limit", labels, pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000)
            )
        helps = {
            "nv_gpu_utilization": "GPU utilization rate [0.0 - 1.0)",
            "nv_gpu_memory_total_bytes": "GPU total memory, in bytes",
            "nv_gpu_memory_used_bytes": "GPU used memory, in bytes",
            "nv_gpu_power_usage": "GPU power usage in watts",
            "nv_gpu_power_limit": "GPU power management limit in watts",
        }
        for name, samples in rows.items():
            lines += _family(name, "gauge", helps[name], samples)
    except Exception:  # noqa: BLE001 - a flaky driver must not break the scrape
        return lines
    return lines


def render(engine: Engine, cpu: CpuSampler | None = None, gpu: bool = True) -> str:
    """The metrics text; CPU metrics from ``cpu`` (none without), GPU ones if ``gpu``."""
    settings = engine.settings.metrics
    lines: list[str] = []
    samples = _model_samples(engine)
    for name, kind, help_text in _MODEL_METRICS:
        # (no family at all without a model, as in Triton)
        if samples[name] and (settings.counter_latencies or name not in _LATENCY_COUNTER_NAMES):
            lines += _family(name, kind, help_text, samples[name])
    arena = engine.arena
    lines += _gauges((
        # dlserve uses no pinned memory; the gauges exist because dashboards expect them
        ("nv_pinned_memory_pool_total_bytes", "Pinned memory pool total memory size, in bytes", 0),
        ("nv_pinned_memory_pool_used_bytes", "Pinned memory pool used memory size, in bytes", 0),
        ("dlserve_shm_arena_reserved_bytes", "Shared memory the server holds for tensors, in bytes",
         arena.bytes_reserved if arena else 0),
        ("dlserve_shm_arena_used_bytes", "Shared memory in use by tensors in the server's arena, in bytes",
         arena.bytes_in_use if arena else 0),
    ))
    if cpu is not None:
        utilization, total, used = cpu.values(settings.interval_ms / 1000)
        lines += _gauges((
            ("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]", utilization),
            ("nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes", total),
            ("nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes", used),
        ))
    if gpu:
        lines += _gpu_lines()
    lines += _cache_lines(engine)
    if settings.summary_latencies:
        lines += _summary_lines(engine)
    lines += engine.custom_metrics.render()
    lines += APPLICATION.render()  # dlserve.MetricFamily: the embedding application's
    return "\n".join(lines) + "\n"
