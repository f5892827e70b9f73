"""``pb_utils.MetricFamily`` and its metrics: custom Prometheus metrics from models.

Declaring a family and reading a value wait for the server (so a conflict or a
missing metric raises here); updates are sent without waiting. Outside a worker
the metrics live in this process, so model code can be unit-tested unchanged.
"""

from __future__ import annotations

import enum
import re
import weakref

from dlserve.engine.custom_metrics import check_buckets, label_key
from dlserve.errors import TritonError
from dlserve.ipc.protocol import Kind
from dlserve.pb_utils import _runtime
from dlserve.pb_utils.errors import TritonModelException

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


class MetricKind(enum.IntEnum):
    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2


class MetricFamily:
    COUNTER = MetricKind.COUNTER
    GAUGE = MetricKind.GAUGE
    HISTOGRAM = MetricKind.HISTOGRAM

    def __init__(self, name: str, description: str, kind: int) -> None:  # (kind required, as in Triton)
        if not isinstance(name, str) or not _NAME.match(name):
            raise TritonModelException(f"invalid metric family name {name!r}")
        try:
            self.kind = MetricKind(kind)
        except ValueError:
            raise TritonModelException(f"invalid metric kind {kind!r}") from None
        self.name = name
        self.description = str(description)
        runtime = _runtime.current()
        if runtime is not None:
            runtime.request(Kind.METRIC_FAMILY, (name, self.description, int(self.kind)))
            # Once the model lets go of the family, its metrics leave the server's metrics, as
            # in Triton (the worker's own exit is no letting go: see CustomMetrics.release).
            weakref.finalize(self, runtime.release_metric_family, name).atexit = False

    def Metric(self, labels: dict[str, str] | None = None, buckets: list[float] | None = None) -> Metric:  # noqa: N802 - Triton's name
        return Metric(self, labels or {}, buckets)


class Metric:
    def __init__(self, family: MetricFamily, labels: dict[str, str], buckets: list[float] | None) -> None:
        if not isinstance(labels, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
        ):
            raise TritonModelException("metric labels must be a dict of str to str")
        try:
            label_key(labels)  # (refused here, as Triton refuses it, not later by the server)
        except TritonError as exc:
            raise TritonModelException(exc.message) from None
        if family.kind is MetricKind.HISTOGRAM:
            if buckets is None:
                raise TritonModelException("a histogram metric needs buckets")
            try:
                check_buckets(buckets)
            except TritonError as exc:
                raise TritonModelException(exc.message) from None
        elif buckets is not None:
            raise TritonModelException("only histogram metrics take buckets")
        # Weakly, as Triton's metric holds its family: once the model lets the family go,
        # its metrics refuse every operation.
        self._family_ref = weakref.ref(family)
        self._name = family.name
        self._labels = dict(labels)
        self._local_value = 0.0
        runtime = _runtime.current()
        self._runtime = runtime
        if runtime is not None:
            runtime.notify(Kind.METRIC, ("create", family.name, self._labels, list(buckets or [])))

    def _family(self, operation: str) -> MetricFamily:
        family = self._family_ref()
        if family is None:  # (Triton's words)
            raise TritonModelException(
                f"Failed to {operation} metric value: Invalid metric operation as the "
                "corresponding 'MetricFamily' has been deleted. The 'MetricFamily' object should "
                "be deleted AFTER its corresponding 'Metric' objects have been deleted."
            )
        return family

    def _send(self, op: str, value: float) -> None:
        if self._runtime is not None:
            self._runtime.notify(Kind.METRIC, (op, self._name, self._labels, float(value)))

    def increment(self, value: float) -> None:
        kind = self._family("increment").kind
        if kind is MetricKind.HISTOGRAM:
            raise TritonModelException("histogram metrics are updated with observe()")
        if kind is MetricKind.COUNTER and value < 0:
            raise TritonModelException("a counter cannot be incremented by a negative value")
        self._local_value += value
        self._send("increment", value)

    def set(self, value: float) -> None:
        if self._family("set").kind is not MetricKind.GAUGE:
            raise TritonModelException("only gauge metrics can be set")
        self._local_value = float(value)
        self._send("set", value)

    def observe(self, value: float) -> None:
        if self._family("observe").kind is not MetricKind.HISTOGRAM:
            raise TritonModelException("only histogram metrics can observe()")
        self._send("observe", value)

    def value(self) -> float:
        if self._family("get").kind is MetricKind.HISTOGRAM:
            raise TritonModelException("a histogram metric has no single value")
        if self._runtime is None:
            return self._local_value
        return float(self._runtime.request(Kind.METRIC_VALUE, (self._name, self._labels)))

