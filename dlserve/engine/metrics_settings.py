"""What the Prometheus metrics include: tritonserver's ``--metrics-interval-ms`` and
``--metrics-config KEY=VALUE`` (``Options.metrics_interval`` and
``Options.metrics_configuration = {"": {KEY: VALUE}}``).

Keys, as Triton 2.51's: ``counter_latencies`` (default true: the ``*_duration_us``
counters and the per-model cache counters), ``summary_latencies`` (default false:
the ``*_summary_us`` summaries, and ``nv_cache_*_summary_per_model`` for models
using the response cache), ``summary_quantiles`` (``QUANTILE:ERROR,...``; the
error is accepted and checked, but dlserve's quantiles are exact over the samples
it keeps, see :mod:`dlserve.engine.summaries`) and ``histogram_latencies``
(accepted without effect: Triton 2.51 shows no latency histogram for Python
models). Unlike Triton, which ignores them, an unknown key or group and a bad
value are errors.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping
from typing import Any

from dlserve.errors import InvalidArgumentError

log = logging.getLogger(__name__)

DEFAULT_QUANTILES = ((0.5, 0.05), (0.9, 0.01), (0.95, 0.001), (0.99, 0.001), (0.999, 0.001))
_BOOLEANS = {"true": True, "false": False}


@dataclasses.dataclass(frozen=True)
class MetricsSettings:
    interval_ms: float = 2000.0  # how often the polled gauges (nv_cpu_*) are refreshed
    counter_latencies: bool = True
    summary_latencies: bool = False
    histogram_latencies: bool = False  # accepted, no effect (see the module's docstring)
    summary_quantiles: tuple[tuple[float, float], ...] = DEFAULT_QUANTILES

    @classmethod
    def from_options(cls, interval_ms: float, configuration: Mapping[str, Mapping[str, str]]) -> MetricsSettings:
        """The settings of ``Options.metrics_interval`` and ``metrics_configuration``;
        raises InvalidArgumentError naming what is wrong."""
        if not interval_ms > 0:
            raise InvalidArgumentError(f"metrics interval must be a positive number of milliseconds, got {interval_ms}")
        values: dict[str, Any] = {"interval_ms": float(interval_ms)}
        for group, settings in configuration.items():
            if group:
                raise InvalidArgumentError(
                    f"metrics configuration group '{group}' is not supported (settings are KEY=VALUE)"
                )
            for key, value in settings.items():
                values[key] = _parse(key, str(value))
        return cls(**values)


def _parse(key: str, value: str) -> Any:
    if key in ("counter_latencies", "summary_latencies", "histogram_latencies"):
        parsed = _BOOLEANS.get(value.strip().lower())
        if parsed is None:
            raise InvalidArgumentError(f"metrics config {key} must be true or false, got '{value}'")
        return parsed
    if key == "summary_quantiles":
        return _quantiles(value)
    raise InvalidArgumentError(
        f"unknown metrics config key '{key}' (known: counter_latencies, summary_latencies, "
        "summary_quantiles, histogram_latencies)"
    )


# The number std::stod reads at the start of a text (it stops at the first character
# that cannot continue one), as Triton reads each quantile and error.
_LEADING_NUMBER = re.compile(r"\s*[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def _leading_number(text: str) -> float | None:
    match = _LEADING_NUMBER.match(text)
    if match is None:
        return None
    if match.end() != len(text):
        log.warning("metrics config summary_quantiles: '%s' read as %s, as Triton reads it",
                    text, match.group().strip())
    return float(match.group())


def _quantiles(text: str) -> tuple[tuple[float, float], ...]:
    """``0.5:0.05,0.9:0.01`` as ((0.5, 0.05), (0.9, 0.01))."""
    quantiles = []
    for entry in text.split(","):
        quantile, sep, error = entry.partition(":")
        q, e = _leading_number(quantile), _leading_number(error)
        if not sep or q is None or e is None or not (0.0 <= q <= 1.0 and 0.0 <= e <= 1.0):
            raise InvalidArgumentError(
                f"metrics config summary_quantiles '{text}' must look like QUANTILE:ERROR[,...] "
                "with both in [0, 1]"
            )
        quantiles.append((q, e))
    return tuple(quantiles)
