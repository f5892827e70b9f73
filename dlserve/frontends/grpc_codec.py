"""The gRPC API's messages on the wire: protobuf to python values and back, as Triton's
gRPC frontend translates them (its error texts included), with no servicer in it.

* Requests: parameters checked as Triton checks them, model versions parsed as it
  parses them, typed ``contents`` decoded to an input's bytes; a large ModelInferRequest
  (:func:`parse_infer_request`) has its ``raw_input_contents`` cut out as views of the
  request's bytes, not parsed into copies.
* Responses always carry outputs as ``raw_output_contents``, one entry per output in
  order; an output written into the client's shared memory gets the region in its
  parameters and an empty entry. Parameters a model sets on its response come back in
  ``ModelInferResponse.parameters``. An inference response is serialized by hand, as
  pieces (:func:`encode_response`), so a large output reaches the socket uncopied.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from google.protobuf.message import DecodeError, Message

from dlserve.engine.request import Response, version_from_string
from dlserve.errors import InvalidArgumentError
from dlserve.frontends.dataplane import InputSpec, OutputSpec
from dlserve.frontends.proto import grpc_service_pb2 as pb
from dlserve.memory.dtypes import DataType

# Triton's reserved "triton_" request parameters (all others with the prefix are refused).
EMPTY_FINAL = "triton_enable_empty_final_response"
TRITON_PARAMETERS = (EMPTY_FINAL,)
FINAL_RESPONSE = "triton_final_response"
_INT64_MAX = (1 << 63) - 1


# -- parameters ------------------------------------------------------------------------------------
def parameter_value(parameter: Any) -> Any:
    """The python value of an InferParameter / ModelRepositoryParameter (None if unset)."""
    kind = parameter.WhichOneof("parameter_choice")
    return None if kind is None else getattr(parameter, kind)


def plain_parameters(parameters: Any) -> dict[str, Any]:
    return {key: parameter_value(value) for key, value in parameters.items()}


def request_parameters(parameters: Any) -> dict[str, Any]:
    """Request parameters checked the way Triton's gRPC frontend checks them."""
    result: dict[str, Any] = {}
    for key, parameter in parameters.items():
        kind = parameter.WhichOneof("parameter_choice")
        if key == "sequence_id":
            if kind not in ("int64_param", "string_param"):
                raise InvalidArgumentError(
                    "invalid value type for 'sequence_id' parameter, expected "
                    "int64_param or string_param."
                )
            if kind == "int64_param":  # a uint64 carried in an int64, as Triton reads it
                result[key] = parameter.int64_param % 2**64
                continue
        elif key in ("sequence_start", "sequence_end"):
            if kind != "bool_param":
                raise InvalidArgumentError(
                    f"invalid value type for '{key}' parameter, expected bool_param."
                )
        elif key == "priority":
            if kind == "int64_param":
                if parameter.int64_param < 0:
                    raise InvalidArgumentError("invalid value for 'priority', expected value >= 0.")
            elif kind != "uint64_param":
                raise InvalidArgumentError(
                    "invalid value type for 'priority' parameter, expected "
                    "int64_param or uint64_param."
                )
        elif key == "timeout":
            if kind != "int64_param":
                raise InvalidArgumentError(
                    "invalid value type for 'timeout' parameter, expected int64_param."
                )
        elif key.startswith("triton_"):
            if key not in TRITON_PARAMETERS:
                raise InvalidArgumentError(
                    "parameter keys starting with 'triton_' are reserved for Triton usage. Only "
                    "the following keys starting with 'triton_' are allowed: "
                    + " ".join(TRITON_PARAMETERS)
                )
            if kind != "bool_param":
                raise InvalidArgumentError(
                    f"invalid value type for '{key}' parameter, expected bool_param."
                )
            continue  # consumed by the frontend, never seen by the model
        elif kind not in ("int64_param", "bool_param", "string_param", "double_param"):
            raise InvalidArgumentError(
                f"invalid value type for '{key}' parameter, expected "
                "int64_param, bool_param, or string_param."
            )
        result[key] = getattr(parameter, kind)
    return result


def _set_parameters(target: Any, values: dict[str, Any]) -> None:
    """Fill an ``InferParameter`` map from python values."""
    for key, value in values.items():
        parameter = target[key]
        if isinstance(value, bool):
            parameter.bool_param = value
        elif isinstance(value, int):
            if value > _INT64_MAX:
                parameter.uint64_param = value
            else:
                parameter.int64_param = value
        elif isinstance(value, float):
            parameter.double_param = value
        else:
            parameter.string_param = str(value)


def parse_version(text: str) -> int:
    """Triton's GetModelVersionFromString: "" is -1 (policy), else a non-negative integer."""
    return version_from_string(
        text, "invalid model version specified '{text}' , version should be an integral value > 0"
    )


# -- typed contents --------------------------------------------------------------------------------
# contents field -> (the TRITONSERVER type its values have, data types it may carry)
_CONTENTS = (
    ("bool_contents", "BOOL", {DataType.BOOL: np.bool_}),
    (
        "int_contents",
        "INT32",
        {DataType.INT8: np.int8, DataType.INT16: np.int16, DataType.INT32: np.int32},
    ),
    ("int64_contents", "INT64", {DataType.INT64: np.int64}),
    (
        "uint_contents",
        "UINT32",
        {DataType.UINT8: np.uint8, DataType.UINT16: np.uint16, DataType.UINT32: np.uint32},
    ),
    ("uint64_contents", "UINT64", {DataType.UINT64: np.uint64}),
    ("fp32_contents", "FP32", {DataType.FP32: np.float32}),
    ("fp64_contents", "FP64", {DataType.FP64: np.float64}),
    ("bytes_contents", "BYTES", {DataType.BYTES: np.object_}),
)
_WIDE = {np.int8: np.int32, np.int16: np.int32, np.uint8: np.uint32, np.uint16: np.uint32}
# Wire data type -> the contents field that carries its values.
CONTENTS_FIELD = {data_type.wire_name: field for field, _, allowed in _CONTENTS for data_type in allowed}


def decode_contents(tensor: Any, data_type: DataType | None, model_name: str) -> InputSpec:
    """An input given as typed ``contents``; FP16/BF16 have no typed field (raw only)."""
    contents = tensor.contents
    spec = InputSpec(tensor.name, tensor.datatype, list(tensor.shape))
    found = False
    for field, field_type, allowed in _CONTENTS:
        values = getattr(contents, field)
        if not values:
            continue
        if found:
            raise InvalidArgumentError(
                f"unexpected explicit tensor data for input tensor '{tensor.name}' for model "
                f"'{model_name}', binary data was already supplied."
            )
        found = True
        dtype = allowed.get(data_type) if data_type is not None else None
        if dtype is None:
            expected = data_type.wire_name if data_type is not None else "<invalid>"
            raise InvalidArgumentError(
                f"unexpected explicit tensor data for input tensor '{tensor.name}' for model "
                f"'{model_name}' of type '{field_type}', expected datatype '{expected}'"
            )
        if dtype is np.object_:
            array = np.empty(len(values), dtype=np.object_)
            array[:] = list(values)
            spec.array = array
        else:
            wide = _WIDE.get(dtype, dtype)
            array = np.fromiter(values, dtype=wide, count=len(values))
            if wide is not dtype:  # Triton keeps the low bytes of each 32-bit value
                array = array.astype(dtype)
            spec.raw = array.view(np.uint8)
    if not found:  # contents present but empty: zero bytes of data
        spec.raw = np.empty(0, dtype=np.uint8)
    return spec


# -- responses -------------------------------------------------------------------------------------
# What a handler answers: a message, or an inference response serialized as pieces to send.
Answer = Message | list[bytes | memoryview]
_RAW_OUTPUT = b"\x32"  # ModelInferResponse.raw_output_contents: field 6, length-delimited
_INFER_RESPONSE = b"\x12"  # ModelStreamInferResponse.infer_response: field 2, length-delimited
_INLINE = 1 << 16  # raw outputs up to this size are copied into the message; larger ones are not


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_response(
    response: Response, specs: dict[str, OutputSpec] | None, final: bool | None = None
) -> list[bytes | memoryview]:
    """A successful engine response as a serialized ModelInferResponse, in pieces to be
    sent in order (``specs``: the requested outputs that need more than raw contents, by
    name; ``final``: the ``triton_final_response`` parameter of a streamed response).

    Outputs go in ``raw_output_contents``, written after the rest of the message (a
    repeated field's entries may follow the other fields on the wire): a large output
    is a view of the tensor's memory, so it reaches the socket without being copied.
    """
    message = pb.ModelInferResponse(
        model_name=response.model_name,
        model_version=str(response.model_version),
        id=response.request_id,
    )
    outputs = message.outputs
    raws: list[memoryview] = []
    for name, tensor in response.outputs.items():
        outputs.add(name=name, datatype=tensor.data_type.wire_name, shape=tensor.shape)
        spec = specs.get(name) if specs else None
        if spec is not None and spec.shm is not None:
            # Written into the client's region: no parameters (as Triton 2.51, and as over
            # HTTP), and an empty raw entry keeps raw_output_contents[i] aligned with outputs[i].
            raws.append(memoryview(b""))
        else:
            raws.append(memoryview(tensor.storage().reshape(-1).view(np.uint8)))
    if response.parameters:
        _set_parameters(message.parameters, response.parameters)
    if final is not None:
        message.parameters[FINAL_RESPONSE].bool_param = final
    pieces: list[bytes | memoryview] = []
    head = bytearray(message.SerializeToString())
    for raw in raws:
        head += _RAW_OUTPUT + _varint(raw.nbytes)
        if raw.nbytes <= _INLINE:
            head += raw
        else:
            pieces += (bytes(head), raw)
            head = bytearray()
    if head or not pieces:
        pieces.append(bytes(head))
    return pieces


def encode_stream_response(pieces: list[bytes | memoryview]) -> list[bytes | memoryview]:
    """A ModelStreamInferResponse carrying the ModelInferResponse in ``pieces``."""
    size = sum(memoryview(piece).nbytes for piece in pieces)
    return [_INFER_RESPONSE + _varint(size), *pieces]


# -- requests --------------------------------------------------------------------------------------
class InferCall(NamedTuple):
    """A ModelInferRequest as received: the message, and its raw input contents."""

    message: pb.ModelInferRequest
    raws: Sequence[bytes | memoryview]


_RAW_INPUT = 7  # ModelInferRequest.raw_input_contents
_SCAN_FROM = 1 << 16  # messages from this size have their raw inputs cut out, not parsed


def _varint_at(data: bytes | memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while shift < 64:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise DecodeError("varint longer than 10 bytes")


def parse_infer_request(body: bytes | memoryview) -> InferCall:
    """Parse a ModelInferRequest. From 64 KiB up, the raw input contents become views of
    ``body`` instead of parsed copies: the top-level fields are walked (a dozen or so),
    the other fields parsed from their own bytes, the tensors left where they arrived."""
    if len(body) < _SCAN_FROM:
        message = pb.ModelInferRequest.FromString(body)
        return InferCall(message, message.raw_input_contents)
    view = memoryview(body)
    kept: list[memoryview] = []
    raws: list[memoryview] = []
    pos, size = 0, len(body)
    try:
        while pos < size:
            tag, at = _varint_at(body, pos)
            kind = tag & 7
            if kind == 2:
                length, start = _varint_at(body, at)
                end = start + length
                if end > size:
                    raise DecodeError("truncated message")
                if tag >> 3 == _RAW_INPUT:
                    raws.append(view[start:end])
                    pos = end
                    continue
            elif kind == 0:
                end = _varint_at(body, at)[1]
            elif kind in (1, 5):
                end = at + (8 if kind == 1 else 4)
            else:
                raise DecodeError(f"wire type {kind}")
            if end > size:
                raise DecodeError("truncated message")
            kept.append(view[pos:end])
            pos = end
    except IndexError:
        raise DecodeError("truncated message") from None
    return InferCall(pb.ModelInferRequest.FromString(b"".join(kept)), raws)


__all__ = [
    "EMPTY_FINAL",
    "FINAL_RESPONSE",
    "Answer",
    "InferCall",
    "decode_contents",
    "encode_response",
    "encode_stream_response",
    "parameter_value",
    "parse_infer_request",
    "parse_version",
    "plain_parameters",
    "request_parameters",
]
