"""Metrics that models define with ``pb_utils.MetricFamily``: the server-side registry.

Workers send family declarations (answered, so a conflict raises in the model),
fire-and-forget updates, and value queries (answered in order after the updates
before them, since one channel carries both). The registry renders itself in the
Prometheus text format next to the server's own ``nv_*`` metrics.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import math
import re
from typing import Any

from dlserve.errors import InvalidArgumentError, NotFoundError

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
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


def _labels(labels: Any) -> Labels:
    pairs = tuple(sorted((str(k), str(v)) for k, v in dict(labels or {}).items()))
    for key, _ in pairs:
        if not _LABEL.match(key) or key.startswith("__"):
            raise InvalidArgumentError(f"invalid metric label name '{key}'")
    return pairs


class CustomMetrics:
    def __init__(self) -> None:
        self.families: dict[str, Family] = {}

    def declare(self, name: str, description: str, kind: int) -> None:
        if not _NAME.match(name) or name.startswith("nv_"):
            raise InvalidArgumentError(
                f"invalid metric family name '{name}' (Prometheus names; 'nv_' is reserved)"
            )
        kind = MetricKind(kind)
        family = self.families.get(name)
        if family is None:
            self.families[name] = Family(name, description, kind)
        elif family.kind is not kind:  # (another description: the first one stays, as in Triton)
            raise InvalidArgumentError(
                f"metric family '{name}' already exists as a {family.kind.name}, not a {kind.name}"
            )

    def _family(self, name: str) -> Family:
        family = self.families.get(name)
        if family is None:
            raise NotFoundError(f"metric family '{name}' is not declared")
        return family

    def create(self, name: str, labels: Any, buckets: list[float] | None) -> None:
        family = self._family(name)
        key = _labels(labels)
        if family.kind is MetricKind.HISTOGRAM:
            if not buckets:
                raise InvalidArgumentError(f"histogram '{name}' needs buckets")
            edges = sorted(float(b) for b in buckets)
            family.values.setdefault(key, Histogram(edges, [0] * len(edges)))
        else:
            if buckets:
                raise InvalidArgumentError(f"only histograms take buckets ('{name}')")
            family.values.setdefault(key, 0.0)

    def update(self, op: str, name: str, labels: Any, value: float) -> None:
        """Apply ``increment``/``set``/``observe`` (worker updates; errors were checked there)."""
        family = self.families.get(name)
        if family is None:
            return
        key = _labels(labels)
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
        current = family.values.get(_labels(labels))
        if current is None:
            raise NotFoundError(f"metric '{name}' with labels {dict(labels or {})} does not exist")
        if isinstance(current, Histogram):
            raise InvalidArgumentError(f"histogram '{name}' has no single value")
        return float(current)

    def render(self) -> list[str]:
        lines: list[str] = []
        for family in self.families.values():
            kind = family.kind.name.lower()
            lines.append(f"# HELP {family.name} {family.description}")
            lines.append(f"# TYPE {family.name} {kind}")
            for key, value in family.values.items():
                if isinstance(value, Histogram):
                    cumulative = 0
                    for edge, count in zip(value.buckets, value.counts):
                        cumulative += count
                        lines.append(sample(f"{family.name}_bucket", key + (("le", _number(edge)),), cumulative))
                    lines.append(sample(f"{family.name}_bucket", key + (("le", "+Inf"),), value.count))
                    lines.append(sample(f"{family.name}_sum", key, value.total))
                    lines.append(sample(f"{family.name}_count", key, value.count))
                else:
                    lines.append(sample(family.name, key, value))
        return lines


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def sample(name: str, labels: Labels, value: float) -> str:
    """One Prometheus text-format sample line."""
    if labels:
        inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
        return f"{name}{{{inner}}} {_number(value)}"
    return f"{name} {_number(value)}"
