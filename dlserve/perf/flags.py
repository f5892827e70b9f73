"""Value parsers for ``dlserve perf``'s flags (argparse ``type=`` functions, whose
errors argparse reports as "argument X: message") and :class:`UsageError`, the error
for flag values that cannot work together; what the benchmark's modules raise for a
bad setting, without depending on the command line."""

from __future__ import annotations

import argparse
import math
from typing import Any

PROTOCOLS = ("http", "grpc", "inprocess")
UNSTABLE = 2  # perf_analyzer's exit status when no measurement became stable
FAILED = 99  # and for any error, bad flags included


class UsageError(Exception):
    """A flag value that cannot work; reported like argparse's errors (exit 99)."""


def int_at_least(minimum: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _finite(text: str, positive: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got '{text}'") from None
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        what = "a positive" if positive else "a non-negative"
        raise argparse.ArgumentTypeError(f"must be {what} number, got '{text}'")
    return value


def positive_float(text: str) -> float:
    return _finite(text, positive=True)


def non_negative_float(text: str) -> float:
    return _finite(text, positive=False)


def _range_numbers(text: str, kind: type, form: str) -> list[Any]:
    """The one to three numbers of ``text``, a range written as ``form``."""
    parts = text.split(":")
    if not 1 <= len(parts) <= 3 or any(p.strip() == "" for p in parts):
        raise argparse.ArgumentTypeError(f"expected {form}, got '{text}'")
    values = []
    for part in parts:
        try:
            value = kind(part)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"'{part}' in '{text}' is not {what}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"'{part}' in '{text}' is not a finite number")
        values.append(value)
    return values


def parse_range(text: str, kind: type) -> tuple[Any, Any, Any]:
    """perf_analyzer's ``start[:end[:step]]``; a missing end is start, a missing step 1.

    ``kind`` is int (concurrency: end 0 means "no limit") or float (request rate).
    """
    values = _range_numbers(text, kind, "start[:end[:step]]")
    start = values[0]
    end = values[1] if len(values) > 1 else start
    step = values[2] if len(values) > 2 else 1
    if start <= 0:
        raise argparse.ArgumentTypeError(f"start must be positive, got '{text}'")
    if step <= 0:
        raise argparse.ArgumentTypeError(f"step must be positive, got '{text}'")
    if end != 0 and end < start:
        raise argparse.ArgumentTypeError(f"end must not be below start, got '{text}'")
    if kind is float and end == 0:
        raise argparse.ArgumentTypeError(f"end must not be below start, got '{text}'")
    return start, end, step


def parse_concurrency_range(text: str) -> tuple[int, int, int]:
    return parse_range(text, int)


def parse_rate_range(text: str) -> tuple[float, float, float]:
    return parse_range(text, float)


def parse_periodic_range(text: str) -> tuple[int, int, int]:
    """``--periodic-concurrency-range start:end[:step]``, checked as perf_analyzer checks
    it (in its words); a start of 0, which perf_analyzer takes and then waits on forever,
    is refused."""
    values = _range_numbers(text, int, "start:end[:step]")
    if len(values) < 2:
        raise argparse.ArgumentTypeError(f"both <start> and <end> values must be provided, got '{text}'")
    start, end, step = values[0], values[1], values[2] if len(values) == 3 else 1
    if step <= 0:
        raise argparse.ArgumentTypeError(f"the <step> value must be > 0, got '{text}'")
    if start <= 0:
        raise argparse.ArgumentTypeError(f"the <start> value must be > 0, got '{text}'")
    if start > end:
        raise argparse.ArgumentTypeError(f"the <start> must be <= <end>, got '{text}'")
    if (end - start) % step:
        raise argparse.ArgumentTypeError(
            f"the <step> value must be a factor of the range size (<end> - <start>), got '{text}'"
        )
    return start, end, step


def parse_shape(text: str) -> tuple[str, list[int]]:
    """``NAME:d1,d2,...`` (dims without the batch dimension); the name may hold colons."""
    name, sep, dims = text.rpartition(":")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME:d1,d2,..., got '{text}'")
    shape = []
    for dim in dims.split(","):
        try:
            value = int(dim)
        except ValueError:
            raise argparse.ArgumentTypeError(f"dimension '{dim}' in '{text}' is not an integer") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"dimension {value} in '{text}' is negative")
        shape.append(value)
    return name, shape


def parse_id_range(text: str) -> tuple[int, int]:
    """``--sequence-id-range start[:end]`` (end excluded; none: no end)."""
    parts = text.split(":")
    try:
        values = [int(part) for part in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected start[:end] integers, got '{text}'") from None
    if len(values) > 2:
        raise argparse.ArgumentTypeError(f"expected start[:end], got '{text}'")
    start, end = values[0], values[1] if len(values) == 2 else 0
    if start < 1:
        raise argparse.ArgumentTypeError(f"sequence IDs start at 1 or more, got '{text}'")
    if len(values) == 2 and end <= start:
        raise argparse.ArgumentTypeError(f"end must be above start, got '{text}'")
    if max(start, end) >= 2**64:
        raise argparse.ArgumentTypeError(f"sequence IDs are 64-bit, got '{text}'")
    return start, end


def parse_request_parameter(text: str) -> tuple[str, bool | int | str]:
    """perf_analyzer's ``name:value:type`` (type bool, int or string)."""
    name, sep, rest = text.partition(":")
    value, sep2, kind = rest.rpartition(":")
    if not (sep and sep2 and name):
        raise argparse.ArgumentTypeError(f"expected name:value:type, got '{text}'")
    if kind == "string":
        return name, value
    if kind == "int":
        try:
            return name, int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{value}' in '{text}' is not an integer") from None
    if kind == "bool":
        if value.lower() not in ("true", "false"):
            raise argparse.ArgumentTypeError(f"'{value}' in '{text}' is not true or false")
        return name, value.lower() == "true"
    raise argparse.ArgumentTypeError(f"type '{kind}' in '{text}' is not bool, int or string")


def parse_header(text: str) -> tuple[str, str]:
    """``-H Name:Value``."""
    name, sep, value = text.partition(":")
    name = name.strip()
    if not sep or not name or any(c in name for c in " \t\r\n") or any(c in value for c in "\r\n"):
        raise argparse.ArgumentTypeError(f"expected Header:Value, got '{text}'")
    return name, value.strip()


def read_intervals(path: str) -> list[float]:
    """``--request-intervals``: one gap between requests per line, in microseconds."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f]
    except OSError as exc:
        raise UsageError(f"--request-intervals: cannot read '{path}': {exc.strerror or exc}") from None
    intervals = []
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            value = float(line)
        except ValueError:
            value = -1.0
        if not math.isfinite(value) or value < 0:
            raise UsageError(f"--request-intervals: line {number} of '{path}' is not a number of microseconds: '{line}'")
        intervals.append(value)
    if not intervals or sum(intervals) <= 0:
        raise UsageError(f"--request-intervals: '{path}' holds no interval above 0")
    return intervals


def parse_composing_models(text: str) -> list[tuple[str, str]]:
    """``--bls-composing-models a:3,b``: (name, version), version '' for the server's choice."""
    models = []
    for item in text.split(","):
        name, _, version = item.strip().partition(":")
        if not name or (version and not version.isdigit()):
            raise argparse.ArgumentTypeError(f"expected NAME[:VERSION],..., got '{text}'")
        models.append((name, version))
    return models


def parse_percentile(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'") from None
    if value != -1 and not 1 <= value <= 99:
        raise argparse.ArgumentTypeError(f"must be in [1, 99] (or -1 for the average), got {value}")
    return value


def parse_protocol(text: str) -> str:
    value = text.strip().lower()
    if value not in PROTOCOLS:
        raise argparse.ArgumentTypeError(f"invalid choice '{text}' (choose from {', '.join(PROTOCOLS)})")
    return value
