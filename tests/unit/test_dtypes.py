"""dlserve.memory.dtypes: one table for the wire, config, numpy and DLPack spellings."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from dlserve.memory.dtypes import (
    DLPACK_TYPES,
    FROM_DLPACK_TYPE,
    KDL_BFLOAT,
    KDL_BOOL,
    KDL_FLOAT,
    KDL_INT,
    KDL_UINT,
    DataType,
    bfloat16_dtype,
    numpy_dtype,
)

# (data type, value, wire name, config name, itemsize, storage dtype, DLPack (code, bits))
TABLE = [
    (DataType.BOOL, 1, "BOOL", "TYPE_BOOL", 1, np.bool_, (6, 8)),
    (DataType.UINT8, 2, "UINT8", "TYPE_UINT8", 1, np.uint8, (1, 8)),
    (DataType.UINT16, 3, "UINT16", "TYPE_UINT16", 2, np.uint16, (1, 16)),
    (DataType.UINT32, 4, "UINT32", "TYPE_UINT32", 4, np.uint32, (1, 32)),
    (DataType.UINT64, 5, "UINT64", "TYPE_UINT64", 8, np.uint64, (1, 64)),
    (DataType.INT8, 6, "INT8", "TYPE_INT8", 1, np.int8, (0, 8)),
    (DataType.INT16, 7, "INT16", "TYPE_INT16", 2, np.int16, (0, 16)),
    (DataType.INT32, 8, "INT32", "TYPE_INT32", 4, np.int32, (0, 32)),
    (DataType.INT64, 9, "INT64", "TYPE_INT64", 8, np.int64, (0, 64)),
    (DataType.FP16, 10, "FP16", "TYPE_FP16", 2, np.float16, (2, 16)),
    (DataType.FP32, 11, "FP32", "TYPE_FP32", 4, np.float32, (2, 32)),
    (DataType.FP64, 12, "FP64", "TYPE_FP64", 8, np.float64, (2, 64)),
    (DataType.BF16, 14, "BF16", "TYPE_BF16", 2, np.uint16, (4, 16)),
]
FIXED = [row[0] for row in TABLE]


def test_values_are_tritonserver_datatype_numbers():
    # TRITONSERVER_DataType; BYTES is 13 and INVALID 0 in Triton.
    assert {dt.name: int(dt) for dt in DataType} == {
        "INVALID": 0,
        "BOOL": 1,
        "UINT8": 2,
        "UINT16": 3,
        "UINT32": 4,
        "UINT64": 5,
        "INT8": 6,
        "INT16": 7,
        "INT32": 8,
        "INT64": 9,
        "FP16": 10,
        "FP32": 11,
        "FP64": 12,
        "BYTES": 13,
        "BF16": 14,
    }


@pytest.mark.parametrize("dt,value,wire,config,itemsize,storage,dlpack", TABLE, ids=lambda v: str(v))
def test_fixed_size_type_table(dt, value, wire, config, itemsize, storage, dlpack):
    assert int(dt) == value
    assert dt.wire_name == wire
    assert dt.config_name == config
    assert dt.itemsize == itemsize
    assert dt.storage_dtype == np.dtype(storage)
    assert dt.storage_dtype.itemsize == dt.itemsize
    assert DataType.from_wire(wire) is dt
    assert DataType.from_config(config) is dt
    assert DLPACK_TYPES[dt] == dlpack
    assert FROM_DLPACK_TYPE[dlpack] is dt


def test_dlpack_type_code_constants():
    # dlpack.h: kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4, kDLBool 6.
    assert (KDL_INT, KDL_UINT, KDL_FLOAT, KDL_BFLOAT, KDL_BOOL) == (0, 1, 2, 4, 6)
    assert DLPACK_TYPES[DataType.BOOL] == (KDL_BOOL, 8)
    assert DLPACK_TYPES[DataType.BF16] == (KDL_BFLOAT, 16)
    # UINT16 and BF16 share storage but never a DLPack type.
    assert DLPACK_TYPES[DataType.UINT16] != DLPACK_TYPES[DataType.BF16]


def test_dlpack_table_covers_every_fixed_type_and_nothing_else():
    assert set(DLPACK_TYPES) == set(FIXED)
    assert DataType.BYTES not in DLPACK_TYPES and DataType.INVALID not in DLPACK_TYPES
    assert len(FROM_DLPACK_TYPE) == len(DLPACK_TYPES)  # the mapping is one-to-one


def test_bytes_names_and_size():
    assert DataType.BYTES.wire_name == "BYTES"
    assert DataType.BYTES.config_name == "TYPE_STRING"
    assert DataType.BYTES.itemsize == 0
    assert DataType.from_wire("BYTES") is DataType.BYTES
    assert DataType.from_config("TYPE_STRING") is DataType.BYTES


def test_bytes_and_invalid_have_no_storage_dtype():
    with pytest.raises(TypeError, match="BYTES"):
        DataType.BYTES.storage_dtype
    with pytest.raises(TypeError, match="INVALID"):
        DataType.INVALID.storage_dtype
    assert DataType.INVALID.itemsize == 0


def test_bf16_is_stored_as_uint16():
    assert DataType.BF16.storage_dtype == np.dtype(np.uint16)
    assert DataType.BF16.config_name == "TYPE_BF16"


def test_config_spelling_of_bytes_is_only_type_string():
    with pytest.raises(ValueError, match="unknown data_type 'TYPE_BYTES'"):
        DataType.from_config("TYPE_BYTES")


@pytest.mark.parametrize("name", ["FP33", "fp32", "TYPE_FP32", "", "INVALID", "STRING"])
def test_from_wire_rejects_unknown_names(name):
    with pytest.raises(ValueError, match=f"unknown datatype '{name}'"):
        DataType.from_wire(name)


@pytest.mark.parametrize("name", ["FP32", "TYPE_FP33", "type_fp32", ""])
def test_from_config_rejects_unknown_names(name):
    with pytest.raises(ValueError, match=f"unknown data_type '{name}'"):
        DataType.from_config(name)


def test_from_config_knows_type_invalid():
    # config.pbtxt may leave data_type out; it then reads as TYPE_INVALID.
    assert DataType.from_config("TYPE_INVALID") is DataType.INVALID


@pytest.mark.parametrize("dt", [d for d in FIXED if d is not DataType.BF16], ids=str)
def test_from_numpy_round_trips_storage_dtypes(dt):
    storage = dt.storage_dtype
    assert DataType.from_numpy(storage) is dt
    assert DataType.from_numpy(storage.type) is dt  # a scalar type works too
    assert DataType.from_numpy(np.zeros(2, dtype=storage).dtype) is dt
    assert DataType.from_numpy(storage.str) is dt  # and a dtype string


def test_from_numpy_uint16_is_uint16_not_bf16():
    assert DataType.from_numpy(np.uint16) is DataType.UINT16


@pytest.mark.parametrize(
    "dtype",
    [np.object_, object, "O", np.bytes_, "S1", "S17", np.str_, "U1", "U9", np.dtype("<U3")],
    ids=str,
)
def test_from_numpy_string_dtypes_are_bytes(dtype):
    assert DataType.from_numpy(dtype) is DataType.BYTES


def test_from_numpy_of_arrays_holding_text():
    assert DataType.from_numpy(np.array([b"ab", b"c"]).dtype) is DataType.BYTES
    assert DataType.from_numpy(np.array(["ab", "é"]).dtype) is DataType.BYTES
    assert DataType.from_numpy(np.array([b"x", "y", 3], dtype=object).dtype) is DataType.BYTES


def test_from_numpy_bfloat16():
    assert DataType.from_numpy(ml_dtypes.bfloat16) is DataType.BF16
    assert DataType.from_numpy(np.dtype(ml_dtypes.bfloat16)) is DataType.BF16
    assert DataType.from_numpy(np.ones(3, dtype=ml_dtypes.bfloat16).dtype) is DataType.BF16


def test_from_numpy_python_types():
    assert DataType.from_numpy(bool) is DataType.BOOL
    assert DataType.from_numpy(float) is DataType.FP64
    assert DataType.from_numpy(int) is DataType.INT64


@pytest.mark.parametrize(
    "dtype",
    [np.complex64, np.complex128, "datetime64[s]", "timedelta64[ms]", ml_dtypes.float8_e4m3fn, "V4"],
    ids=str,
)
def test_from_numpy_rejects_types_triton_lacks(dtype):
    with pytest.raises(TypeError, match="has no Triton data type"):
        DataType.from_numpy(dtype)


def test_numpy_dtype_is_what_users_see():
    assert numpy_dtype(DataType.BYTES) == np.dtype(object)
    assert numpy_dtype(DataType.BF16) == np.dtype(ml_dtypes.bfloat16)
    assert bfloat16_dtype() == np.dtype(ml_dtypes.bfloat16)
    for dt in FIXED:
        if dt is not DataType.BF16:
            assert numpy_dtype(dt) == dt.storage_dtype
    # Every user-facing dtype maps back to its DataType.
    for dt in FIXED + [DataType.BYTES]:
        assert DataType.from_numpy(numpy_dtype(dt)) is dt


def test_wire_and_config_names_are_all_distinct():
    wires = [dt.wire_name for dt in DataType if dt is not DataType.INVALID]
    configs = [dt.config_name for dt in DataType]
    assert len(set(wires)) == len(wires)
    assert len(set(configs)) == len(configs)
    for dt in DataType:
        if dt is not DataType.INVALID:
            assert DataType.from_wire(dt.wire_name) is dt
        assert DataType.from_config(dt.config_name) is dt
