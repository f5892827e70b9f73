"""Triton's tensor data types and their numpy, wire, config and DLPack spellings.

One table drives every conversion so the names cannot drift apart:
``DataType.FP32`` is ``"FP32"`` on the wire, ``"TYPE_FP32"`` in ``config.pbtxt``,
``numpy.float32`` in memory and ``(kDLFloat, 32)`` in a DLPack capsule.
BF16 has no numpy type of its own: it is carried as ``uint16`` bits and viewed
as ``ml_dtypes.bfloat16`` when that package is present.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np


class DataType(enum.IntEnum):
    """``TRITONSERVER_DataType`` (same numbers as ``inference.DataType`` minus ``TYPE_``)."""

    INVALID = 0
    BOOL = 1
    UINT8 = 2
    UINT16 = 3
    UINT32 = 4
    UINT64 = 5
    INT8 = 6
    INT16 = 7
    INT32 = 8
    INT64 = 9
    FP16 = 10
    FP32 = 11
    FP64 = 12
    BYTES = 13
    BF16 = 14

    @property
    def wire_name(self) -> str:
        """Name used by the KServe v2 protocol (``"FP32"``, ``"BYTES"``)."""
        return self.name

    @property
    def config_name(self) -> str:
        """Name used in ``config.pbtxt`` (``"TYPE_FP32"``, ``"TYPE_STRING"``)."""
        return "TYPE_STRING" if self is DataType.BYTES else "TYPE_" + self.name

    @property
    def itemsize(self) -> int:
        """Bytes per element; 0 for BYTES, whose elements vary in size."""
        return _ITEMSIZE[self]

    @property
    def storage_dtype(self) -> np.dtype[Any]:
        """The numpy dtype whose bits hold this type in memory (BF16 → uint16)."""
        try:
            return _STORAGE[self]
        except KeyError:
            raise TypeError(f"data type {self.name} has no fixed-size storage") from None

    @staticmethod
    def from_wire(name: str) -> DataType:
        try:
            return _FROM_WIRE[name]
        except KeyError:
            raise ValueError(f"unknown datatype '{name}'") from None

    @staticmethod
    def from_config(name: str) -> DataType:
        try:
            return _FROM_CONFIG[name]
        except KeyError:
            raise ValueError(f"unknown data_type '{name}'") from None

    @staticmethod
    def from_numpy(dtype: Any) -> DataType:
        """Map a numpy dtype (or anything ``np.dtype`` accepts) to a DataType."""
        dt = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
        found = _FROM_NUMPY.get(dt)
        if found is not None:
            return found
        if dt.kind in ("O", "S", "U"):
            return DataType.BYTES
        if dt.name == "bfloat16":
            return DataType.BF16
        raise TypeError(f"numpy dtype {dt} has no Triton data type")


_STORAGE: dict[DataType, np.dtype[Any]] = {
    DataType.BOOL: np.dtype(np.bool_),
    DataType.UINT8: np.dtype(np.uint8),
    DataType.UINT16: np.dtype(np.uint16),
    DataType.UINT32: np.dtype(np.uint32),
    DataType.UINT64: np.dtype(np.uint64),
    DataType.INT8: np.dtype(np.int8),
    DataType.INT16: np.dtype(np.int16),
    DataType.INT32: np.dtype(np.int32),
    DataType.INT64: np.dtype(np.int64),
    DataType.FP16: np.dtype(np.float16),
    DataType.FP32: np.dtype(np.float32),
    DataType.FP64: np.dtype(np.float64),
    DataType.BF16: np.dtype(np.uint16),
}
_ITEMSIZE: dict[DataType, int] = {dt: nd.itemsize for dt, nd in _STORAGE.items()}
_ITEMSIZE[DataType.BYTES] = 0
_ITEMSIZE[DataType.INVALID] = 0
_FROM_WIRE: dict[str, DataType] = {dt.name: dt for dt in DataType if dt is not DataType.INVALID}
_FROM_CONFIG: dict[str, DataType] = {dt.config_name: dt for dt in DataType}
_FROM_NUMPY: dict[np.dtype[Any], DataType] = {
    nd: dt for dt, nd in _STORAGE.items() if dt is not DataType.BF16
}


def bfloat16_dtype() -> np.dtype[Any]:
    """``ml_dtypes.bfloat16``; imported lazily so workers that never see BF16 skip it."""
    try:
        import ml_dtypes
    except ImportError as exc:  # pragma: no cover - ml_dtypes is a runtime dependency
        raise TypeError("BF16 tensors need the 'ml_dtypes' package for numpy access") from exc
    return np.dtype(ml_dtypes.bfloat16)


def numpy_dtype(data_type: DataType) -> np.dtype[Any]:
    """The dtype a user sees for ``data_type``: object for BYTES, bfloat16 for BF16."""
    if data_type is DataType.BYTES:
        return np.dtype(np.object_)
    if data_type is DataType.BF16:
        return bfloat16_dtype()
    return data_type.storage_dtype


# DLPack (type code, bits) for each fixed-size type; BYTES has none.
KDL_INT, KDL_UINT, KDL_FLOAT, KDL_BFLOAT, KDL_BOOL = 0, 1, 2, 4, 6
DLPACK_TYPES: dict[DataType, tuple[int, int]] = {
    DataType.BOOL: (KDL_BOOL, 8),
    DataType.UINT8: (KDL_UINT, 8),
    DataType.UINT16: (KDL_UINT, 16),
    DataType.UINT32: (KDL_UINT, 32),
    DataType.UINT64: (KDL_UINT, 64),
    DataType.INT8: (KDL_INT, 8),
    DataType.INT16: (KDL_INT, 16),
    DataType.INT32: (KDL_INT, 32),
    DataType.INT64: (KDL_INT, 64),
    DataType.FP16: (KDL_FLOAT, 16),
    DataType.FP32: (KDL_FLOAT, 32),
    DataType.FP64: (KDL_FLOAT, 64),
    DataType.BF16: (KDL_BFLOAT, 16),
}
FROM_DLPACK_TYPE: dict[tuple[int, int], DataType] = {v: k for k, v in DLPACK_TYPES.items()}
