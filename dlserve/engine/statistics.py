"""Per model-version statistics, as Triton's statistics extension defines them.

* ``success``/``fail``: one per request, duration = request end-to-end time.
* ``queue``: time from arrival at the scheduler to the start of its execution.
* ``compute_input``/``compute_infer``/``compute_output``: one per request, the
  execution's time split in three (inputs handed to the worker / the worker's
  round trip / outputs turned into responses).
* ``inference_count`` counts batch elements; ``execution_count`` counts ``execute``
  calls; ``batch_stats`` has one row per batch size seen (counts per execution).

With latency summaries on (``keep_samples``), the durations that have a summary also
keep their recent observations (:mod:`dlserve.engine.summaries`).

A reload of a model version starts its statistics again at 0, as Triton's; Prometheus
counters go on from the replaced version's (:meth:`ModelStatistics.continues`), as
Triton's do (it keeps a version's metric reporter across reloads, not across unloads),
counting what each replaced version still answers until it has ended.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from dlserve.engine.summaries import LatencyWindow


@dataclasses.dataclass
class Duration:
    count: int = 0
    ns: int = 0
    # the recent observations, in microseconds, where a summary shows them
    window: LatencyWindow | None = dataclasses.field(default=None, repr=False, compare=False)

    def add(self, ns: int, count: int = 1) -> None:
        """``count`` requests that took ``ns`` together (each ``ns / count``)."""
        self.count += count
        self.ns += ns
        if self.window is not None and count:
            self.window.observe(ns // count // 1000, count)

    def as_dict(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclasses.dataclass
class BatchStats:
    compute_input: Duration = dataclasses.field(default_factory=Duration)
    compute_infer: Duration = dataclasses.field(default_factory=Duration)
    compute_output: Duration = dataclasses.field(default_factory=Duration)


FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")
# the durations that Triton's summaries show (successes only, as its request summary)
SUMMARY_FIELDS = ("success", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit", "cache_miss")
_INFERENCE_FIELDS = (
    "success",
    "fail",
    "queue",
    "compute_input",
    "compute_infer",
    "compute_output",
    "cache_hit",
    "cache_miss",
)


class ModelStatistics:
    """Counters for one model version; mutated on the engine's event loop only."""

    def __init__(self, name: str, version: int, keep_samples: bool = False) -> None:
        self.name = name
        self.version = version
        self.last_inference_ms = 0
        self.inference_count = 0
        self.execution_count = 0
        self.durations: dict[str, Duration] = {field: Duration() for field in _INFERENCE_FIELDS}
        if keep_samples:
            for field in SUMMARY_FIELDS:
                self.durations[field].window = LatencyWindow()
        self.batches: dict[int, BatchStats] = {}
        self.failures = dict.fromkeys(FAILURE_REASONS, 0)
        self.replaced: list[ModelStatistics] = []  # those of the versions reloads replaced
        self.ended = False  # its version has unloaded: nothing counts here any more

    def continues(self, previous: ModelStatistics) -> None:
        """A reload replaced the version ``previous`` counts for with this one: its counts,
        and those it went on from, go on in :meth:`lifetime`. A replaced version may still
        be finishing requests, so it stays live until it has ended (a reload may come
        before that); the ended ones are folded into one, so reloads do not lengthen the list.
        (An instance_group update keeps the version, and these: nothing to carry.)"""
        if previous is self:
            return
        for duration in previous.durations.values():
            duration.window = None  # (summaries' quantiles go on with this version's samples)
        carried = [previous, *previous.replaced]
        self.replaced = [stats for stats in carried if not stats.ended]
        ended = [stats for stats in carried if stats.ended]
        if ended:
            folded = self._summed(ended)
            folded.ended = True
            self.replaced.append(folded)

    def lifetime(self) -> ModelStatistics:
        """What Prometheus counts: these counts plus those of the versions reloads
        replaced (a copy, without batch rows or samples, when there are any)."""
        if not self.replaced:
            return self
        return self._summed([self, *self.replaced])

    def _summed(self, parts: list[ModelStatistics]) -> ModelStatistics:
        total = ModelStatistics(self.name, self.version)
        for stats in parts:
            total.inference_count += stats.inference_count
            total.execution_count += stats.execution_count
            for reason, count in stats.failures.items():
                total.failures[reason] += count
            for field, duration in stats.durations.items():
                total.durations[field].add(duration.ns, duration.count)
        return total

    def record_execution(
        self,
        batch_size: int,
        request_count: int,
        queue_ns: list[int],
        input_ns: int,
        infer_ns: int,
        output_ns: int,
        filler_rows: int = 0,
    ) -> None:
        """One ``execute`` call over ``request_count`` requests holding ``batch_size``
        elements, ``filler_rows`` of them the sequence batcher's fillers for empty slots:
        in the batch's size, as in Triton's batch statistics, but not inferred."""
        d = self.durations
        self.execution_count += 1
        self.inference_count += batch_size - filler_rows
        for ns in queue_ns:
            d["queue"].add(ns)
        d["compute_input"].add(input_ns * request_count, request_count)
        d["compute_infer"].add(infer_ns * request_count, request_count)
        d["compute_output"].add(output_ns * request_count, request_count)
        self._batch_row(batch_size, input_ns, infer_ns, output_ns)

    def record_failed_execution(self, batch_size: int, elapsed_ns: int) -> None:
        """An ``execute`` that failed as a whole (it raised, or its worker died): as in
        Triton it ran, so it counts as an execution with its batch row, but it inferred
        nothing."""
        self.execution_count += 1
        self._batch_row(batch_size, 0, elapsed_ns, 0)

    def _batch_row(self, batch_size: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        row = self.batches.get(batch_size)
        if row is None:
            row = self.batches[batch_size] = BatchStats()
        row.compute_input.add(input_ns)
        row.compute_infer.add(infer_ns)
        row.compute_output.add(output_ns)

    def record_request(self, duration_ns: int, failure: str | None = None) -> None:
        """One finished request; ``failure`` is its reason label when it failed
        (REJECTED, CANCELED, BACKEND or OTHER, as Triton's failure metric)."""
        if failure is None:
            self.durations["success"].add(duration_ns)
        else:
            self.durations["fail"].add(duration_ns)
            self.failures[failure] += 1
        self.last_inference_ms = int(time.time() * 1000)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": str(self.version),
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {k: v.as_dict() for k, v in self.durations.items()},
            "response_stats": {},
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": row.compute_input.as_dict(),
                    "compute_infer": row.compute_infer.as_dict(),
                    "compute_output": row.compute_output.as_dict(),
                }
                for size, row in sorted(self.batches.items())
            ],
            "memory_usage": [],
        }
