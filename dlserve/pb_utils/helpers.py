"""Triton's module-level helpers: lookups by name, type maps and the BYTES codec."""

from __future__ import annotations

import inspect
import os
from typing import Any

import numpy as np

from dlserve.memory import bytes_codec
from dlserve.memory.dtypes import DataType
from dlserve.pb_utils import _runtime
from dlserve.pb_utils.inference import InferenceRequest, InferenceResponse
from dlserve.pb_utils.tensor import Tensor

TRITON_STRING_TO_NUMPY: dict[str, Any] = {
    "TYPE_BOOL": bool,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    for tensor in inference_request.inputs():
        if tensor.name() == name:  # (a method call, as Triton's: a stand-in tensor may answer it)
            return tensor
    return None


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    for tensor in inference_response.output_tensors():
        if tensor.name() == name:
            return tensor
    return None


def _config_by_name(model_config: dict[str, Any], kind: str, name: str) -> dict[str, Any] | None:
    for entry in model_config.get(kind, ()):
        if entry.get("name") == name:
            return entry
    return None


def get_input_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return _config_by_name(model_config, "input", name)


def get_output_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return _config_by_name(model_config, "output", name)


def using_decoupled_model_transaction_policy(model_config: dict[str, Any]) -> bool:
    policy = model_config.get("model_transaction_policy") or {}
    return bool(policy.get("decoupled", False))


def get_model_dir() -> str:
    """The model's version folder, as Triton answers (where its ``model.py`` is, or, for
    a model of a Python-based backend, its data). A model imported outside a worker, by a
    unit test, gets its calling file's folder."""
    inline = _runtime.inline_model_dir.get()
    if inline is not None:
        return inline
    if _runtime.model_dir is not None:
        return _runtime.model_dir
    return os.path.dirname(os.path.abspath(inspect.stack()[1].filename))


def triton_string_to_numpy(triton_type_string: str) -> Any:
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def triton_to_numpy_type(data_type: int) -> Any:
    """numpy type for a ``TRITONSERVER_DataType`` int; None for BF16 and unknown ints."""
    try:
        dt = DataType(data_type)
    except ValueError:
        return None
    if dt is DataType.BYTES:
        return np.object_
    if dt in (DataType.BF16, DataType.INVALID):
        return None
    return dt.storage_dtype.type


def numpy_to_triton_type(data_type: Any) -> int | None:
    try:
        return int(DataType.from_numpy(data_type))
    except TypeError:
        return None


def serialize_byte_tensor(input_tensor: np.ndarray) -> bytes | tuple[()] | None:
    """Triton's BYTES encoding of ``input_tensor`` (4-byte length, then the bytes, per
    element in C order), returned as the Python backend's helper returns it: ``bytes``,
    ``()`` for an empty array, None for an array that is not of objects or bytes (a str
    array, which Triton's refuses, is taken as UTF-8 text). tritonclient's helper of the
    same name answers a 0-d object array instead; models get the backend's."""
    if input_tensor.size == 0:
        return ()
    if input_tensor.dtype.kind not in ("O", "S", "U"):
        return None
    return bytes_codec.serialize_bytes(input_tensor).tobytes()


def deserialize_bytes_tensor(encoded_tensor: Any) -> np.ndarray:
    """Decode Triton's BYTES encoding into a 1-D object array of ``bytes``."""
    if isinstance(encoded_tensor, np.ndarray) and encoded_tensor.dtype == np.object_:
        encoded_tensor = encoded_tensor.item()
    return bytes_codec.deserialize_bytes(encoded_tensor)
