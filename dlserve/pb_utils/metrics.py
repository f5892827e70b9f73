"""``pb_utils.MetricFamily`` and its metrics: custom Prometheus metrics from models.

Declaring a family and reading a value wait for the server (so a conflict or a
missing metric raises here); updates are sent without waiting. Outside a worker
the metrics live in this process, so model code can be unit-tested unchanged.
Misuse raises what Triton 2.51 raises, in its words (compared side by side).
"""

from __future__ import annotations

import enum
import re
import weakref
from typing import Any

from dlserve.engine.custom_metrics import check_buckets, label_key
from dlserve.errors import TritonError
from dlserve.ipc.protocol import Kind
from dlserve.pb_utils import _runtime
from dlserve.pb_utils.errors import TritonModelException, incompatible_arguments

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_CREATE_FAMILY = "Error when creating MetricFamily"
_CREATE_METRIC = "Error when creating Metric"


class MetricKind(enum.IntEnum):
    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2


class MetricFamily:
    COUNTER = MetricKind.COUNTER
    GAUGE = MetricKind.GAUGE
    HISTOGRAM = MetricKind.HISTOGRAM

    def __init__(self, name: str, description: str, kind: int) -> None:  # (kind required, as in Triton)
        if not isinstance(name, str) or kind not in list(MetricKind):
            signature = "name: str, description: str, kind: c_python_backend_utils.MetricKind"
            raise incompatible_arguments(
                "__init__", signature, name, description, kind,
                constructor="c_python_backend_utils.MetricFamily",
            )
        if not _NAME.match(name):
            raise _runtime.failure(_CREATE_FAMILY, "Invalid metric name")
        self.kind = MetricKind(kind)
        self.name = name
        self.description = str(description)
        runtime = _runtime.current()
        if runtime is not None:
            try:
                runtime.request(Kind.METRIC_FAMILY, (name, self.description, int(self.kind)))
            except TritonModelException as exc:
                raise _runtime.failure(_CREATE_FAMILY, str(exc)) from None
            # Once the model lets go of the family, its metrics leave the server's metrics, as
            # in Triton (the worker's own exit is no letting go: see CustomMetrics.release).
            weakref.finalize(self, runtime.release_metric_family, name).atexit = False

    def Metric(self, labels: dict[str, str] | None = None, buckets: list[float] | None = None) -> Metric:  # noqa: N802 - Triton's name
        return Metric(self, labels or {}, buckets)


class Metric:
    def __init__(self, family: MetricFamily, labels: dict[str, str], buckets: list[float] | None) -> None:
        # (Triton's stub checks the buckets are there; its server, the rest)
        if family.kind is MetricKind.HISTOGRAM and buckets is None:
            raise TritonModelException("Failed to create metric. Missing required buckets.")
        if family.kind is not MetricKind.HISTOGRAM and buckets is not None:
            raise TritonModelException("Failed to create metric. Unexpected buckets found.")
        if not isinstance(labels, dict) or not all(isinstance(k, str) for k in labels):
            raise _runtime.failure(_CREATE_METRIC, "metric labels must be a dict of str to str")
        if not all(isinstance(v, str) for v in labels.values()):
            raise _runtime.failure(_CREATE_METRIC, "attempt to access JSON non-string as string")
        # Refused here, as Triton refuses them, not later by the server.
        try:
            label_key(labels)
        except TritonError:
            raise _runtime.failure(_CREATE_METRIC, "Invalid label name") from None
        if buckets is not None:
            try:
                check_buckets(buckets)
            except TritonError:
                reason = "Bucket Boundaries must be strictly sorted"
                raise _runtime.failure(_CREATE_METRIC, reason) from None
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

    def _kind(self, operation: str, method: str, *supporting: MetricKind) -> MetricKind:
        """The metric's kind, where it supports the operation (refused as Triton's server does)."""
        kind = self._family(operation).kind
        if kind not in supporting:
            reason = f"TRITONSERVER_METRIC_KIND_{kind.name} does not support {method}"
            raise _failed(operation, reason)
        return kind

    def _number(self, function: str, value: Any) -> float:
        """The value as Triton's bindings take a float: a number, not a string, say."""
        if not (hasattr(value, "__float__") or hasattr(value, "__index__")):
            signature = "self: c_python_backend_utils.Metric, arg0: float"
            raise incompatible_arguments(function, signature, self, value)
        return float(value)

    def _send(self, op: str, value: float) -> None:
        if self._runtime is not None:
            self._runtime.notify(Kind.METRIC, (op, self._name, self._labels, value))

    def increment(self, value: float) -> None:
        value = self._number("increment", value)
        kind = self._kind("increment", "Increment", MetricKind.COUNTER, MetricKind.GAUGE)
        if kind is MetricKind.COUNTER and value < 0:
            raise _failed(
                "increment",
                "TRITONSERVER_METRIC_KIND_COUNTER can only be incremented monotonically by "
                "non-negative values.",
            )
        self._local_value += value
        self._send("increment", value)

    def set(self, value: float) -> None:
        value = self._number("set", value)
        self._kind("set", "Set", MetricKind.GAUGE)
        self._local_value = value
        self._send("set", value)

    def observe(self, value: float) -> None:
        value = self._number("observe", value)
        self._kind("observe", "Observe", MetricKind.HISTOGRAM)
        self._send("observe", value)

    def value(self) -> float:
        self._kind("get", "Value", MetricKind.COUNTER, MetricKind.GAUGE)
        if self._runtime is None:
            return self._local_value
        try:
            return float(self._runtime.request(Kind.METRIC_VALUE, (self._name, self._labels)))
        except TritonModelException as exc:
            raise _failed("get", str(exc)) from None


def _failed(operation: str, reason: str) -> TritonModelException:
    return _runtime.failure(f"Failed to {operation} metric value", reason)

