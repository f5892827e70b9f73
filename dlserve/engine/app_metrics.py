"""Custom metrics of the application embedding dlserve: Triton's ``tritonserver.MetricFamily``
and ``tritonserver.Metric``.

As in Triton, families belong to the process, not to a server: they can be made
before any server starts, and every server in the process serves them on its metrics
port and in ``Server.metrics()``, next to its models' ``pb_utils`` metrics. A family
lives as long as a ``MetricFamily`` object of its name does, a metric as long as a
``Metric`` object with its labels (Triton deletes them with their objects too).

    requests = dlserve.MetricFamily(dlserve.MetricKind.COUNTER, "app_requests_total", "Requests seen")
    ok = dlserve.Metric(requests, labels={"outcome": "ok"})
    ok.increment(1)
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from typing import Any

from dlserve.engine.custom_metrics import APPLICATION, Histogram, Labels, MetricKind, label_key
from dlserve.errors import InvalidArgumentError, UnsupportedError

__all__ = ["Metric", "MetricFamily", "MetricKind"]

# How many live objects stand for each family and each metric: the last one to go
# takes its family or metric off the registry.
_holders: Counter[tuple[str, Labels | None]] = Counter()
_holders_lock = threading.Lock()


def _hold(key: tuple[str, Labels | None]) -> None:
    with _holders_lock:
        _holders[key] += 1


def _let_go(name: str, labels: Labels | None) -> None:
    with _holders_lock:
        _holders[(name, labels)] -= 1
        if _holders[(name, labels)] > 0:
            return
        del _holders[(name, labels)]
    APPLICATION.remove(name, None if labels is None else dict(labels))


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"a metric value must be a number, got {value!r}") from None


class MetricFamily:
    """A family of metrics of one kind (COUNTER, GAUGE or HISTOGRAM) under one name.

    A second family of an existing name shares it if the kinds agree (its
    description is ignored, as Triton's registry does) and raises otherwise.
    """

    def __init__(self, kind: MetricKind, name: str, description: str) -> None:
        try:
            self.kind = MetricKind(kind)
        except ValueError:
            raise InvalidArgumentError(f"unknown metric kind {kind!r}") from None
        if not isinstance(name, str) or not isinstance(description, str):
            raise InvalidArgumentError("a metric family's name and description must be strings")
        APPLICATION.declare(name, description, int(self.kind))
        self.name = name
        self.description = description
        _hold((name, None))
        weakref.finalize(self, _let_go, name, None)

    def __repr__(self) -> str:
        return f"MetricFamily({self.kind.name}, {self.name!r})"


class Metric:
    """One metric of a family: the family's name with these labels.

    ``buckets`` (upper bounds) are for histograms only, which ``observe()``; counters
    ``increment()`` by non-negative amounts; gauges ``increment()`` either way and
    ``set_value()``.
    """

    def __init__(
        self,
        family: MetricFamily,
        labels: dict[str, str] | None = None,
        buckets: list[float] | None = None,
    ) -> None:
        if not isinstance(family, MetricFamily):
            raise InvalidArgumentError(f"a Metric needs a MetricFamily, got {type(family).__name__}")
        if labels is not None and not (
            isinstance(labels, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items())
        ):
            raise InvalidArgumentError("metric labels must be a dict of str to str")
        self.family = family  # keeps the family alive as long as its metrics
        self._key = label_key(labels)
        APPLICATION.create(family.name, labels, buckets)
        _hold((family.name, self._key))
        weakref.finalize(self, _let_go, family.name, self._key)

    @property
    def kind(self) -> MetricKind:
        return self.family.kind

    @property
    def value(self) -> float:
        """The current value (a histogram's: the sum of what it observed)."""
        current = self._current()
        return current.total if isinstance(current, Histogram) else float(current)

    def increment(self, value: float) -> None:
        kind = self.kind
        if kind is MetricKind.HISTOGRAM:
            raise UnsupportedError("a histogram metric is updated with observe()")
        number = _number(value)
        if kind is MetricKind.COUNTER and number < 0:
            raise InvalidArgumentError("a counter metric cannot be incremented by a negative value")
        self._update("increment", number)

    def set_value(self, value: float) -> None:
        if self.kind is not MetricKind.GAUGE:
            raise UnsupportedError(f"only gauge metrics can be set; this one is a {self.kind.name}")
        self._update("set", _number(value))

    def observe(self, value: float) -> None:
        if self.kind is not MetricKind.HISTOGRAM:
            raise UnsupportedError(f"only histogram metrics observe(); this one is a {self.kind.name}")
        self._update("observe", _number(value))

    def _update(self, op: str, value: float) -> None:
        APPLICATION.update(op, self.family.name, dict(self._key), value)

    def _current(self) -> Any:
        family = APPLICATION.families.get(self.family.name)
        current = None if family is None else family.values.get(self._key)
        if current is None:  # (not while this object holds it)
            raise InvalidArgumentError(f"metric '{self.family.name}' no longer exists")
        return current

    def __repr__(self) -> str:
        return f"Metric({self.family.name!r}, {dict(self._key)})"
