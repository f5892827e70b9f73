"""Tensor values as JSON, both ways, as Triton's HTTP frontend reads and writes them.

Reading is strict: a value of the wrong JSON type for the tensor's data type (a
float for an integer, a number for a bool, an out-of-range integer) is refused
rather than converted, so a client bug shows up as an error instead of as
silently different data. FP16 and BF16 only travel as binary data.

NaN and infinities, which JSON proper cannot spell, are spelled ``NaN``, ``Infinity``
and ``-Infinity`` both ways, as Triton and Python's json module (which tritonclient
uses) spell them.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import orjson

from dlserve.errors import InvalidArgumentError
from dlserve.memory.dtypes import DataType, numpy_dtype
from dlserve.memory.tensor import Tensor

_INTEGER_KINDS = {
    DataType.UINT8, DataType.UINT16, DataType.UINT32, DataType.UINT64,
    DataType.INT8, DataType.INT16, DataType.INT32, DataType.INT64,
}
MAX_NESTING = 64


def parse_object(data: Any) -> dict[str, Any]:
    """A request body (any contiguous buffer: read in place, never copied) that must hold
    one JSON object."""
    try:
        value = orjson.loads(memoryview(data))
    except orjson.JSONDecodeError as exc:
        # NaN, Infinity, -Infinity: only Python's json reads them. It also reads what
        # orjson rightly refuses (lone surrogates), which orjson finds when it writes
        # the value back out (NaN aside, which it writes as null).
        try:
            value = json.loads(bytes(data))
            orjson.dumps(value)
        except (ValueError, TypeError, RecursionError):
            raise InvalidArgumentError(f"failed to parse the request JSON buffer: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgumentError("request body must be a JSON object")
    return value


def repeated_keys(data: Any, candidates: Any) -> list[str]:
    """Which of ``candidates`` (names) the body's top-level object holds more than once,
    which a parsed dict cannot tell. Read again only where a name's text occurs twice."""
    raw = data if isinstance(data, bytes) else bytes(data)
    suspects = [name for name in candidates if raw.count(json.dumps(name).encode()) > 1]
    if not suspects:
        return []
    objects: list[list[str]] = []

    def keep_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        objects.append([key for key, _ in pairs])  # (the top-level object closes last)
        return dict(pairs)

    try:
        json.loads(raw, object_pairs_hook=keep_keys)
    except (ValueError, RecursionError):
        return []
    keys = objects[-1] if objects else []
    return [name for name in suspects if keys.count(name) > 1]


_JSON_KINDS = {list: "array", str: "string"}


def member(document: dict[str, Any], key: str, kind: type[list] | type[str]) -> Any:
    """A required member of a JSON object, of one kind, or Triton's words for why not."""
    if key not in document:
        raise InvalidArgumentError(
            f"Unable to parse '{key}': attempt to access non-existing object member '{key}'"
        )
    value = document[key]
    if not isinstance(value, kind):
        what = _JSON_KINDS[kind]
        raise InvalidArgumentError(
            f"Unable to parse '{key}': attempt to access JSON non-{what} as {what}"
        )
    return value


def object_field(value: Any, what: str) -> dict[str, Any]:
    """An optional member that must be a JSON object (absent: empty)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"'{what}' must be a JSON object")
    return value


def id_and_parameters(document: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """An inference request's ``id`` and ``parameters`` members, checked."""
    request_id = document.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidArgumentError("'id' must be a string")
    return request_id, object_field(document.get("parameters"), "parameters")


def check_infer_parameters(parameters: dict[str, Any]) -> None:
    """What Triton's infer endpoint refuses (its generate endpoint takes them all): keys
    it keeps for itself, and the ones it reads without their types."""
    for key, value in parameters.items():
        if key.startswith("triton_"):
            raise InvalidArgumentError(
                "parameter keys starting with 'triton_' are reserved for Triton usage and should "
                "not be specified."
            )
        if key in ("sequence_start", "sequence_end", "binary_data_output") and not isinstance(value, bool):
            raise InvalidArgumentError(f"parameter '{key}' must be a boolean")
        if key == "sequence_id" and (
            isinstance(value, bool) or not isinstance(value, (int, str)) or (isinstance(value, int) and value < 0)
        ):
            raise InvalidArgumentError("parameter 'sequence_id' must be a non-negative integer or a string")


def flatten(data: Any) -> list[Any]:
    """A JSON value or (nested) list of them as one flat list, in row-major order."""
    out: list[Any] = []
    stack = [iter(data if isinstance(data, list) else [data])]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                if len(stack) > MAX_NESTING:
                    raise ValueError("'data' is nested too deeply")
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()
    return out


def from_json(data_type: DataType, data: Any) -> np.ndarray:
    """JSON values as a flat array of ``data_type``; raises TypeError, ValueError or
    OverflowError saying what does not fit."""
    flat = flatten(data)
    kinds = set(map(type, flat))
    if data_type is DataType.BYTES:
        if kinds - {str}:
            raise TypeError("BYTES data must be JSON strings")
        array = np.empty(len(flat), dtype=np.object_)
        array[:] = [s.encode("utf-8") for s in flat]
        return array
    if data_type is DataType.BOOL:
        if kinds - {bool}:
            raise TypeError("BOOL data must be JSON true/false")
        return np.array(flat, dtype=np.bool_)
    if data_type in _INTEGER_KINDS:
        if kinds - {int}:
            raise TypeError(f"{data_type.name} data must be JSON integers")
        return np.array(flat, dtype=numpy_dtype(data_type))  # out of range: OverflowError
    if kinds - {int, float}:
        raise TypeError(f"{data_type.name} data must be JSON numbers")
    return np.array(flat, dtype=numpy_dtype(data_type))


class NonFinite:
    """Floats among which NaN or an infinity appears (orjson would write them as null),
    a flat list or, with ``scalar``, its one element."""

    __slots__ = ("scalar", "values")

    def __init__(self, values: np.ndarray, scalar: bool = False) -> None:
        self.values = values
        self.scalar = scalar

    def plain(self) -> Any:
        return self.values[0].item() if self.scalar else self.values.tolist()

    def fragment(self) -> orjson.Fragment:
        """The JSON text: orjson's for the finite values, Triton's words for the rest."""
        values = self.values[:1] if self.scalar else self.values
        pieces = orjson.dumps(values, option=orjson.OPT_SERIALIZE_NUMPY).split(b"null")
        words = [
            b"NaN" if np.isnan(v) else b"Infinity" if v > 0 else b"-Infinity"
            for v in values[~np.isfinite(values)]
        ]
        text = b"".join(piece + word for piece, word in zip(pieces, [*words, b""]))
        return orjson.Fragment(text[1:-1] if self.scalar else text)


def to_json(tensor: Tensor) -> Any:
    """A tensor's values, flat: strings for BYTES (bytes that are not UTF-8 kept as
    they are, see :func:`dumps`), numbers otherwise (a numpy array, which orjson writes,
    or :class:`NonFinite`)."""
    if tensor.data_type is DataType.BYTES:
        values = tensor.to_bytes_array().reshape(-1)
        return [v.decode("utf-8", "surrogateescape") for v in values.tolist()]
    array = tensor.as_numpy().reshape(-1)
    if tensor.data_type in (DataType.FP16, DataType.BF16):
        array = array.astype(np.float32)
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        return NonFinite(array)
    return array


def dumps(document: dict[str, Any], sort_keys: bool = False) -> bytes:
    """The JSON bytes of a response document holding :func:`to_json` values."""
    option = orjson.OPT_SERIALIZE_NUMPY | (orjson.OPT_SORT_KEYS if sort_keys else 0)
    try:
        return orjson.dumps(document, default=_fragment, option=option)
    except TypeError:  # BYTES that are not UTF-8: written raw, as Triton does
        return json.dumps(document, ensure_ascii=False, sort_keys=sort_keys, default=_plain).encode(
            "utf-8", "surrogateescape"
        )


def _fragment(value: Any) -> Any:
    if isinstance(value, NonFinite):
        return value.fragment()
    raise TypeError(f"cannot encode {type(value).__name__}")


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, NonFinite):
        return value.plain()
    raise TypeError(f"cannot encode {type(value).__name__}")
