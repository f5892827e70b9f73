"""Triton's BYTES tensor encoding: each element is a 4-byte little-endian length, then its bytes.

Both directions avoid a Python-level loop over bytes where numpy can do the work:
encoding joins the elements once and inserts every length prefix in one
``np.insert``; decoding walks the prefixes (the only sequential part) and, when all
elements have the same length, slices them with one strided view instead.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

_LEN = struct.Struct("<I")


class TruncatedElement(ValueError):
    """Encoded BYTES data that ends inside an element: inside its 4-byte length prefix
    (``in_prefix``) or inside its bytes; ``expected`` bytes were due, ``available`` left."""

    def __init__(self, in_prefix: bool, expected: int, available: int) -> None:
        where = "an element's length prefix" if in_prefix else f"an element of {expected} bytes"
        super().__init__(f"BYTES data ends inside {where} ({available} bytes left)")
        self.in_prefix, self.expected, self.available = in_prefix, expected, available


def _truncated(buf: memoryview, pos: int, end: int) -> TruncatedElement:
    """The error for an element that starts at ``pos`` and does not fit before ``end``."""
    if pos + 4 > end:
        return TruncatedElement(True, 4, end - pos)
    return TruncatedElement(False, _LEN.unpack_from(buf, pos)[0], end - pos - 4)


def _element_bytes(flat: np.ndarray) -> list[bytes]:
    kind = flat.dtype.kind
    if kind == "S":
        return flat.tolist()  # numpy drops trailing NULs of fixed-width bytes, as Triton's does
    if kind == "U":
        return [s.encode("utf-8") for s in flat.tolist()]
    if kind == "O":
        out = flat.tolist()
        for i, item in enumerate(out):
            if type(item) is bytes:
                continue
            if isinstance(item, str):
                out[i] = item.encode("utf-8")
            elif isinstance(item, (bytes, bytearray, memoryview)):
                out[i] = bytes(item)
            else:
                out[i] = str(item).encode("utf-8")
        return out
    raise TypeError(f"cannot serialize a {flat.dtype} array as BYTES")


def serialize_bytes(array: np.ndarray) -> np.ndarray:
    """Encode an object/bytes/str array (C order) into a flat ``uint8`` array."""
    flat = np.asarray(array).ravel(order="C")
    if flat.size == 0:
        return np.empty(0, dtype=np.uint8)
    items = _element_bytes(flat)
    lengths = np.fromiter(map(len, items), dtype=np.uint32, count=len(items))
    data = np.frombuffer(b"".join(items), dtype=np.uint8)
    starts = np.zeros(len(items), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    prefixes = lengths.astype("<u4", copy=False).view(np.uint8)
    return np.insert(data, np.repeat(starts, 4), prefixes)


def serialized_size(array: np.ndarray) -> int:
    """Size in bytes of ``serialize_bytes(array)`` without building it."""
    flat = np.asarray(array).ravel(order="C")
    return 4 * flat.size + sum(map(len, _element_bytes(flat)))


def _uniform_elements(buf: memoryview, count: int) -> list[bytes] | None:
    """Fast path: every element has the same length and no element ends in NUL."""
    if count == 0 or len(buf) < 4:
        return None
    width = _LEN.unpack_from(buf, 0)[0]
    stride = 4 + width
    if width == 0 or stride * count != len(buf):
        return None
    raw = np.frombuffer(buf, dtype=np.uint8)
    prefixes = np.ndarray((count,), dtype="<u4", buffer=raw, strides=(stride,))
    if not (prefixes == width).all():
        return None
    last = np.ndarray((count,), dtype=np.uint8, buffer=raw, offset=stride - 1, strides=(stride,))
    if not last.all():
        return None  # "S" views would strip the trailing NULs
    return np.ndarray(
        (count,), dtype=f"S{width}", buffer=raw, offset=4, strides=(stride,)
    ).tolist()


def deserialize_bytes(buffer: Any, count: int | None = None) -> np.ndarray:
    """Decode Triton's BYTES encoding into a 1-D object array of ``bytes``.

    With ``count`` given, the buffer must hold exactly that many elements, else
    ``ValueError``; without it, elements are read until the buffer ends.
    """
    buf = memoryview(buffer).cast("B")
    items = _uniform_elements(buf, count) if count is not None else None
    if items is None:
        items = []
        pos, end = 0, len(buf)
        unpack = _LEN.unpack_from
        while pos < end:
            if pos + 4 > end:
                raise _truncated(buf, pos, end)
            (length,) = unpack(buf, pos)
            if pos + 4 + length > end:
                raise _truncated(buf, pos, end)
            pos += 4
            items.append(bytes(buf[pos : pos + length]))
            pos += length
    if count is not None and len(items) != count:
        raise ValueError(f"BYTES data holds {len(items)} elements, expected {count}")
    out = np.empty(len(items), dtype=np.object_)
    out[:] = items
    return out


def count_elements(buffer: Any) -> int:
    """Number of elements in an encoded buffer, validating every prefix."""
    buf = memoryview(buffer).cast("B")
    pos, end, n = 0, len(buf), 0
    while pos < end:
        start = pos
        if pos + 4 > end:
            raise _truncated(buf, start, end)
        pos += 4 + _LEN.unpack_from(buf, pos)[0]
        if pos > end:
            raise _truncated(buf, start, end)
        n += 1
    return n

