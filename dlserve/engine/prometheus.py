"""The engine's metrics as Prometheus text: Triton's ``nv_*`` names and labels, plus
dlserve's and the models' own.

Values are read from the engine's statistics when rendered, so serving requests
costs nothing extra for metrics. Counters keep Triton's names exactly (no
``_total`` suffix), which is why the text is rendered here rather than through
prometheus-client's collectors. CPU metrics come from /proc; GPU metrics from
nvidia-ml-py when a GPU and its driver are present. The metrics port
(:mod:`dlserve.frontends.metrics`) and ``Server.metrics()`` both serve this text.
"""

from __future__ import annotations

from dlserve.engine.core import Engine
from dlserve.engine.custom_metrics import APPLICATION, sample
from dlserve.engine.model import ModelVersion
from dlserve.engine.statistics import FAILURE_REASONS

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


# Per model whose config enables the response cache (Triton lists them for those only).
_CACHE_MODEL_METRICS = (
    ("nv_cache_num_hits_per_model", "counter", "Number of cache hits per model", "cache_hit", False),
    ("nv_cache_hit_duration_per_model", "counter", "Total cache hit duration per model, in microseconds", "cache_hit", True),
    ("nv_cache_num_misses_per_model", "counter", "Number of cache misses per model", "cache_miss", False),
    ("nv_cache_miss_duration_per_model", "counter", "Total cache miss (lookup and insertion) duration per model, in microseconds", "cache_miss", True),
)


def _model_labels(engine: Engine, model: ModelVersion, *more: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    """A model version's labels, in name order: with model namespacing, as in Triton,
    its namespace too (the same name may be served from several repositories)."""
    labels = [("model", model.name), ("version", str(model.version)), *more]
    if engine.settings.model_namespacing:
        labels.append(("namespace", model.namespace))
    return tuple(sorted(labels))


def _cache_lines(engine: Engine) -> list[str]:
    """The response cache's metrics: per model that uses it, and the cache's own
    gauges when the server has one."""
    rows: dict[str, list[str]] = {name: [] for name, *_ in _CACHE_MODEL_METRICS}
    for entry in engine.manager.models.values() if engine.manager is not None else ():
        for model in entry.versions.values():
            if not model.config.response_cache.enable:
                continue
            labels = _model_labels(engine, model)
            for name, _, _, field, is_duration in _CACHE_MODEL_METRICS:
                duration = model.stats.durations[field]
                rows[name].append(sample(name, labels, duration.ns // 1000 if is_duration else duration.count))
    lines: list[str] = []
    for name, kind, help_text, _, _ in _CACHE_MODEL_METRICS:
        if rows[name]:
            lines += _family(name, kind, help_text, rows[name])
    cache = engine.response_cache
    if cache is not None:
        lines += _gauges((
            ("nv_cache_num_entries", "Number of responses stored in the response cache", len(cache)),
            ("nv_cache_num_lookups", "Number of response cache lookups", cache.lookups),
            ("nv_cache_num_hits", "Number of response cache hits", cache.hits),
            ("nv_cache_num_misses", "Number of response cache misses", cache.misses),
            ("nv_cache_num_evictions", "Number of response cache evictions", cache.evictions),
            ("nv_cache_lookup_duration", "Total response cache lookup duration, in microseconds", cache.lookup_ns // 1000),
            ("nv_cache_insertion_duration", "Total response cache insertion duration, in microseconds", cache.insertion_ns // 1000),
            ("nv_cache_util", "Response cache utilization [0.0 - 1.0]", cache.utilization),
        ))
    return lines


def _model_samples(engine: Engine) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {name: [] for name, _, _ in _MODEL_METRICS}
    if engine.manager is None:
        return out
    for entry in engine.manager.models.values():
        for model in entry.versions.values():
            stats = model.stats
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
            for metric, ns in (
                ("nv_inference_request_duration_us", d["success"].ns),  # successes only, as Triton
                ("nv_inference_queue_duration_us", d["queue"].ns),
                ("nv_inference_compute_input_duration_us", d["compute_input"].ns),
                ("nv_inference_compute_infer_duration_us", d["compute_infer"].ns),
                ("nv_inference_compute_output_duration_us", d["compute_output"].ns),
            ):
                out[metric].append(sample(metric, labels, ns // 1000))
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
    """CPU utilisation between scrapes, from /proc/stat; memory from /proc/meminfo."""

    def __init__(self) -> None:
        self._last = self._times()

    @staticmethod
    def _times() -> tuple[int, int]:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        idle = values[3] + (values[4] if len(values) > 4 else 0)
        return sum(values), idle

    def utilization(self) -> float:
        total, idle = self._times()
        last_total, last_idle = self._last
        self._last = (total, idle)
        elapsed = total - last_total
        return 0.0 if elapsed <= 0 else 1.0 - (idle - last_idle) / elapsed

    @staticmethod
    def memory() -> tuple[int, int]:
        info: dict[str, int] = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0]) * 1024
        total = info.get("MemTotal", 0)
        return total, total - info.get("MemAvailable", info.get("MemFree", 0))


def _gpu_lines() -> list[str]:
    """nv_gpu_* gauges per GPU through NVML; nothing when there is no GPU or driver."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver / library: no GPU metrics
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
    finally:
        pynvml.nvmlShutdown()
    return lines


def render(engine: Engine, cpu: CpuSampler | None = None, gpu: bool = True) -> str:
    lines: list[str] = []
    samples = _model_samples(engine)
    for name, kind, help_text in _MODEL_METRICS:
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
        total, used = cpu.memory()
        lines += _gauges((
            ("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]", cpu.utilization()),
            ("nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes", total),
            ("nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes", used),
        ))
    if gpu:
        lines += _gpu_lines()
    lines += _cache_lines(engine)
    lines += engine.custom_metrics.render()
    lines += APPLICATION.render()  # dlserve.MetricFamily: the embedding application's
    return "\n".join(lines) + "\n"
