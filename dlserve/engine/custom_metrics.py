"""Custom metrics: the registries behind ``pb_utils.MetricFamily`` and ``dlserve.MetricFamily``.

Each engine keeps one for its models. Workers send family declarations (answered,
so a conflict raises in the model), fire-and-forget updates, and value queries
(answered in order after the updates before them, since one channel carries both).
The application embedding dlserve has one more, :data:`APPLICATION`, shared by every
server in the process as Triton's metrics registry is (``dlserve.MetricFamily``,
:mod:`dlserve.engine.app_metrics`). A family name belongs to one of them: a model
cannot declare a family the application has, nor the application one a model of a
running server has. Each renders itself in the Prometheus text format next to the
server's own ``nv_*`` metrics.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import enum
import math
import re
import threading
import weakref
from collections.abc import Hashable
from typing import Any

from dlserve.errors import InvalidArgumentError, NotFoundError

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
# The server's own families begin so; other names are free, ``nv_`` ones too, as in Triton.
RESERVED_PREFIXES = (
    "nv_inference_", "nv_cache_", "nv_cpu_", "nv_gpu_", "nv_pinned_memory_", "dlserve_instance_", "dlserve_shm_",
)
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
Labels = tuple[tuple[str, str], ...]


class MetricKind(enum.IntEnum):
    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2


@dataclasses.dataclass
class Histogram:
    buckets: list[float]
    counts: list[int]
    total: float = 0.0
    count: int = 0


@dataclasses.dataclass
class Family:
    name: str
    description: str
    kind: MetricKind
    values: dict[Labels, Any] = dataclasses.field(default_factory=dict)
    # the models' MetricFamily objects of this name still alive, per worker process
    holders: collections.Counter[Hashable] = dataclasses.field(default_factory=collections.Counter)


def check_buckets(buckets: Any) -> list[float]:
    """A histogram's upper bounds, which must rise strictly (as Triton requires; none at
    all leaves only ``+Inf``)."""
    edges = [float(b) for b in buckets]
    if any(low >= high for low, high in zip(edges, edges[1:])):
        raise InvalidArgumentError(f"histogram buckets must be strictly increasing, got {edges}")
    return edges


def label_key(labels: Any) -> Labels:
    pairs = tuple(sorted((str(k), str(v)) for k, v in dict(labels or {}).items()))
    for key, _ in pairs:
        if not _LABEL.match(key) or key.startswith("__"):
            raise InvalidArgumentError(f"invalid metric label name '{key}'")
    return pairs


class CustomMetrics:
    """One registry of families. Safe to use from any thread: the application's is
    updated from its threads while a server's loop renders it."""

    def __init__(self, shared: CustomMetrics | None = None) -> None:
        self.families: dict[str, Family] = {}
        self._lock = threading.Lock()
        self._shared = shared  # the application's registry, whose names a model may not take
        if shared is not None:
            _model_registries.add(self)

    def declare(self, name: str, description: str, kind: int, holder: Hashable = None) -> None:
        """A MetricFamily object made (by ``holder``: a model's worker process)."""
        if not _NAME.match(name):
            raise InvalidArgumentError(f"invalid metric family name '{name}' (Prometheus names)")
        if name.startswith(RESERVED_PREFIXES):
            raise InvalidArgumentError(
                f"metric family name '{name}' is reserved: names beginning with "
                f"{', '.join(repr(p) for p in RESERVED_PREFIXES)} are the server's own"
            )
        kind = MetricKind(kind)
        if self._shared is not None and name in self._shared.families:
            raise InvalidArgumentError(
                f"metric family '{name}' is the application's (dlserve.MetricFamily): a model "
                "cannot declare it"
            )
        if self is APPLICATION and any(name in r.families for r in list(_model_registries)):
            raise InvalidArgumentError(f"metric family '{name}' is declared by a model of a running server")
        with self._lock:
            family = self.families.get(name)
            if family is None:
                family = self.families[name] = Family(name, description, kind)
            elif family.kind is not kind:  # (another description: the first one stays, as in Triton)
                raise InvalidArgumentError("Family name already exists with different type")
            family.holders[holder] += 1

    def release(self, name: str, holder: Hashable = None) -> None:
        """A model let one of its MetricFamily objects go. With the last one, the family's
        metrics go too, as in Triton (its name and description stay; a family declared
        again starts its metrics at zero)."""
        with self._lock:
            family = self.families.get(name)
            if family is not None and family.holders[holder] > 0:
                family.holders[holder] -= 1
                if not +family.holders:  # (+: the counts above zero)
                    family.values.clear()

    def forget(self, holder: Hashable) -> None:
        """A worker ended: its objects no longer hold their families, but their metrics
        stay, as Triton's outlive a model's unload and reload (a worker's teardown is not
        the model letting go); the next model to let go of the family clears them."""
        with self._lock:
            for family in self.families.values():
                del family.holders[holder]

    def _family(self, name: str) -> Family:
        family = self.families.get(name)
        if family is None:
            raise NotFoundError(f"metric family '{name}' is not declared")
        return family

    def create(self, name: str, labels: Any, buckets: list[float] | None) -> None:
        family = self._family(name)
        key = label_key(labels)
        if family.kind is MetricKind.HISTOGRAM:
            if buckets is None:
                raise InvalidArgumentError(f"histogram '{name}' needs buckets")
            edges = check_buckets(buckets)
            initial: Any = Histogram(edges, [0] * len(edges))
        else:
            if buckets:
                raise InvalidArgumentError(f"only histograms take buckets ('{name}')")
            initial = 0.0
        with self._lock:
            family.values.setdefault(key, initial)

    def remove(self, name: str, labels: Any = None) -> None:
        """Drop one metric of a family, or (``labels`` None) the whole family."""
        with self._lock:
            if labels is None:
                self.families.pop(name, None)
                return
            family = self.families.get(name)
            if family is not None:
                family.values.pop(label_key(labels), None)

    def update(self, op: str, name: str, labels: Any, value: float) -> None:
        """Apply ``increment``/``set``/``observe`` (worker updates; errors were checked there)."""
        family = self.families.get(name)
        if family is None:
            return
        key = label_key(labels)
        with self._lock:
            self._apply(family, key, op, value)

    @staticmethod
    def _apply(family: Family, key: Labels, op: str, value: float) -> None:
        current = family.values.get(key)
        if current is None:
            return
        if op == "observe" and isinstance(current, Histogram):
            index = bisect.bisect_left(current.buckets, value)
            if index < len(current.counts):  # above the last edge: only in +Inf
                current.counts[index] += 1
            current.total += value
            current.count += 1
        elif op == "increment" and not isinstance(current, Histogram):
            family.values[key] = current + value
        elif op == "set" and family.kind is MetricKind.GAUGE:
            family.values[key] = float(value)

    def value(self, name: str, labels: Any) -> float:
        family = self._family(name)
        current = family.values.get(label_key(labels))
        if current is None:
            raise NotFoundError(f"metric '{name}' with labels {dict(labels or {})} does not exist")
        if isinstance(current, Histogram):
            raise InvalidArgumentError(f"histogram '{name}' has no single value")
        return float(current)

    def render(self) -> list[str]:
        with self._lock:
            return self._render()

    def _render(self) -> list[str]:
        lines: list[str] = []
        for family in self.families.values():
            if not family.values:  # (Triton shows no family without metrics)
                continue
            kind = family.kind.name.lower()
            if family.description:  # (as Triton's prometheus-cpp: no HELP line without one)
                lines.append(f"# HELP {family.name} {family.description}")
            lines.append(f"# TYPE {family.name} {kind}")
            for key, value in family.values.items():
                if isinstance(value, Histogram):  # (in Triton's order: count, sum, buckets)
                    lines.append(sample(f"{family.name}_count", key, value.count))
                    lines.append(sample(f"{family.name}_sum", key, value.total))
                    cumulative = 0
                    for edge, count in zip(value.buckets, value.counts):
                        cumulative += count
                        lines.append(sample(f"{family.name}_bucket", key + (("le", _number(edge)),), cumulative))
                    lines.append(sample(f"{family.name}_bucket", key + (("le", "+Inf"),), value.count))
                else:
                    lines.append(sample(family.name, key, value))
        return lines


APPLICATION = CustomMetrics()
# The engines' registries, so the application cannot take a name a model has.
_model_registries: weakref.WeakSet[CustomMetrics] = weakref.WeakSet()


def _number(value: float) -> str:
    """A sample's value as Triton's metrics library writes it: 16 significant digits,
    ``Nan`` (a summary's quantile with no observation to rank), ``+Inf``/``-Inf``."""
    if math.isnan(value):
        return "Nan"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return format(value, ".16g")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def sample(name: str, labels: Labels, value: float) -> str:
    """One Prometheus text-format sample line."""
    if labels:
        inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
        return f"{name}{{{inner}}} {_number(value)}"
    return f"{name} {_number(value)}"
