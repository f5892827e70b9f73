"""The KServe v2 gRPC API with Triton's extensions (``inference.GRPCInferenceService``).

Served by our own gRPC-over-HTTP/2 transport on the engine's event loop
(:mod:`dlserve.frontends.grpc_transport`): every handler is a plain coroutine that calls
the engine or the shared :class:`DataPlane` directly, with no thread hop.
Wire semantics follow Triton's gRPC frontend, including its error texts where a
client could tell the difference (captured in ``tests/data/triton_reference``):

* ``ModelInfer`` takes inputs as ``raw_input_contents`` (one entry per input that has
  neither typed ``contents`` nor a shared-memory reference, in input order), as typed
  ``contents`` (never both in one request), or from a registered shared-memory region.
  Raw inputs are ``np.frombuffer`` views of the request's bytes; the one copy they get
  is into the server's arena (above the inline size), which the worker needs anyway.
* Responses always carry outputs as ``raw_output_contents``, one entry per output in
  order; an output written into the client's shared memory gets the region in its
  parameters and an empty entry. Parameters a model sets on its response come back in
  ``ModelInferResponse.parameters``.
* ``ModelStreamInfer`` answers each request on the stream with a
  ``ModelStreamInferResponse`` (``triton_final_response`` set on the final one); a
  failed request puts its message in ``error_message`` and the stream stays open.
* Errors map :class:`dlserve.errors.ErrorCode` to gRPC codes with Triton's table
  (:data:`GRPC_CODES`).
* A restricted protocol (``--grpc-restricted-protocol=<protocols>:<header>=<value>``)
  answers UNAVAILABLE unless the call carries the header, named either as configured or
  with Triton's ``triton-grpc-protocol-`` prefix.
* A call cancelled by its client (or past its deadline) stops waiting; a request still
  queued is taken off the queue.

``KServeGrpc.Options`` set the transport (:func:`transport_settings`): message size
limits, keepalive and ping policy, connection age, ``SO_REUSEPORT``, TLS and mutual
TLS; ``infer_compression_level`` compresses inference responses. ``infer_thread_count``,
``infer_allocation_pool_size`` and ``max_response_pool_size`` are accepted for
compatibility: every call runs on the loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, NamedTuple

import grpc
import numpy as np
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message

from dlserve.engine.request import Request, Response
from dlserve.engine.tracing import Trace
from dlserve.errors import (
    ErrorCode,
    InvalidArgumentError,
    TritonError,
    UnavailableError,
    UnsupportedError,
)
from dlserve.frontends.dataplane import DataPlane, InputSpec, OutputSpec, shm_ref
from dlserve.frontends.grpc_calls import Abort, Buffer, Method
from dlserve.frontends.grpc_transport import GrpcTransport, Settings, tls_context
from dlserve.frontends.proto import grpc_service_pb2 as pb
from dlserve.frontends.proto import health_pb2
from dlserve.frontends.restrictions import Restriction, rules_by_category
from dlserve.memory.dtypes import DataType

log = logging.getLogger("dlserve.frontends.grpc")

GRPC_CODES = {
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.INVALID_ARG: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorCode.UNKNOWN: grpc.StatusCode.UNKNOWN,
}
HEADER_PREFIX = "triton-grpc-protocol-"
# Triton's reserved "triton_" request parameters (all others with the prefix are refused).
EMPTY_FINAL = "triton_enable_empty_final_response"
TRITON_PARAMETERS = (EMPTY_FINAL,)
FINAL_RESPONSE = "triton_final_response"
# Answers one ModelStreamInfer call may hold unsent (the client's window is shut)
# before it reads no more of the client's requests (see _Stream).
STREAM_BACKLOG = 128
# infer_compression_level -> the algorithm gRPC core picks for that level when the client
# accepts gzip and deflate (its ranking: low = gzip, medium and high = deflate).
_COMPRESSION = {1: "gzip", 2: "deflate", 3: "deflate"}
_EXPECTED_LOG_VALUE = {bool: "boolean", int: "int32", str: "string"}  # a log setting sent without one
_STOL = re.compile(r"\s*([+-]?\d+)")
_INT64_MAX = (1 << 63) - 1


# -- restricted protocols --------------------------------------------------------------------------
# -- parameters ------------------------------------------------------------------------------------
def _value(parameter: Any) -> Any:
    """The python value of an InferParameter / ModelRepositoryParameter (None if unset)."""
    kind = parameter.WhichOneof("parameter_choice")
    return None if kind is None else getattr(parameter, kind)


def _plain_parameters(parameters: Any) -> dict[str, Any]:
    return {key: _value(value) for key, value in parameters.items()}


def _request_parameters(parameters: Any) -> dict[str, Any]:
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
    if not text:
        return -1
    match = _STOL.match(text)
    value = int(match.group(1)) if match else None
    if value is None or not -(1 << 63) <= value <= _INT64_MAX:
        raise InvalidArgumentError(
            f"failed to get model version from specified version string '{text}' (details: stol), "
            "version should be an integral value > 0"
        )
    if value < 0:
        raise InvalidArgumentError(
            f"invalid model version specified '{text}' , version should be an integral value > 0"
        )
    return value


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


def _decode_contents(tensor: Any, data_type: DataType | None, model_name: str) -> InputSpec:
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


def _status(error: TritonError) -> grpc.StatusCode:
    return GRPC_CODES.get(error.code, grpc.StatusCode.UNKNOWN)


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


# -- the servicer ----------------------------------------------------------------------------------
Handler = Callable[..., Awaitable[Any]]


def _rpc(protocol: str) -> Callable[[Handler], Handler]:
    """Restriction check and error mapping around a unary handler."""

    def wrap(method: Handler) -> Handler:
        @functools.wraps(method)
        async def handler(self: InferenceServicer, request: Any, context: Any) -> Any:
            rules = self.rules[protocol]
            if rules:
                await self.check_restricted(rules, context)
            try:
                return await method(self, request, context)
            except TritonError as exc:
                await context.abort(_status(exc), exc.message)
            except (asyncio.CancelledError, Abort):
                raise
            except Exception as exc:  # noqa: BLE001 - a bug must still answer the call
                log.exception("gRPC %s failed", method.__name__)
                await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")

        return handler

    return wrap


class InferenceServicer:
    """``inference.GRPCInferenceService``: every RPC, as plain coroutines."""

    def __init__(self, dataplane: DataPlane, restrictions: list[Restriction], options: Any) -> None:
        self.dataplane = dataplane
        self.engine = dataplane.engine
        self.rules = rules_by_category(restrictions)
        pattern = getattr(options, "forward_header_pattern", "")
        # Triton forwards every header the pattern finds (RE2::PartialMatch) as a string parameter.
        self.forward = re.compile(pattern) if pattern else None
        self.compression = _COMPRESSION.get(int(getattr(options, "infer_compression_level", 0)))

    async def check_restricted(self, rules: list[Restriction], context: Any) -> None:
        metadata = context.invocation_metadata() or ()
        for rule in rules:
            keys = (rule.header, HEADER_PREFIX + rule.header)
            if not any(key in keys and value == rule.value for key, value in metadata):
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"This protocol is restricted, expecting header '{rule.header}'",
                )

    # -- health and metadata ------------------------------------------------------------
    @_rpc("health")
    async def ServerLive(self, request: Any, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self.engine.live)

    @_rpc("health")
    async def ServerReady(self, request: Any, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.engine.ready())

    @_rpc("health")
    async def ModelReady(self, request: Any, context: Any) -> pb.ModelReadyResponse:
        version = parse_version(request.version)
        return pb.ModelReadyResponse(ready=await self.engine.model_ready(request.name, version))

    @_rpc("metadata")
    async def ServerMetadata(self, request: Any, context: Any) -> pb.ServerMetadataResponse:
        meta = self.engine.metadata()
        return pb.ServerMetadataResponse(
            name=meta["name"], version=meta["version"], extensions=meta["extensions"]
        )

    @_rpc("metadata")
    async def ModelMetadata(self, request: Any, context: Any) -> pb.ModelMetadataResponse:
        meta = self.engine.model_metadata(request.name, parse_version(request.version))
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=meta["name"],
            versions=meta["versions"],
            platform=meta["platform"],
            inputs=[
                tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"])
                for t in meta["inputs"]
            ],
            outputs=[
                tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"])
                for t in meta["outputs"]
            ],
        )

    @_rpc("model-config")
    async def ModelConfig(self, request: Any, context: Any) -> pb.ModelConfigResponse:
        config = self.engine.model_config(request.name, parse_version(request.version))
        response = pb.ModelConfigResponse()
        json_format.ParseDict(config, response.config, ignore_unknown_fields=True)
        return response

    @_rpc("statistics")
    async def ModelStatistics(self, request: Any, context: Any) -> pb.ModelStatisticsResponse:
        stats = self.engine.statistics(request.name, parse_version(request.version))
        response = pb.ModelStatisticsResponse()
        json_format.ParseDict(stats, response, ignore_unknown_fields=True)
        return response

    # -- model repository ---------------------------------------------------------------
    @staticmethod
    def _check_repository(name: str) -> None:
        if name:
            raise UnsupportedError("'repository_name' specification is not supported")

    @_rpc("model-repository")
    async def RepositoryIndex(self, request: Any, context: Any) -> pb.RepositoryIndexResponse:
        self._check_repository(request.repository_name)
        index = pb.RepositoryIndexResponse.ModelIndex
        rows = await self.engine.repository_index(request.ready)
        return pb.RepositoryIndexResponse(
            models=[
                index(
                    name=row["name"],
                    version=str(row.get("version", "")),
                    state=row.get("state", "") or "",
                    reason=row.get("reason", "") or "",
                )
                for row in rows
            ]
        )

    @_rpc("model-repository")
    async def RepositoryModelLoad(
        self, request: Any, context: Any
    ) -> pb.RepositoryModelLoadResponse:
        self._check_repository(request.repository_name)
        parameters = {}
        for key, parameter in request.parameters.items():
            value = _value(parameter)
            if key == "config" and not isinstance(value, str):  # (Triton's words, these three)
                raise InvalidArgumentError("invalid value type for load parameter 'config', expected string_param.")
            if key.startswith("file:") and not isinstance(value, bytes):
                raise InvalidArgumentError(f"invalid value type for load parameter '{key}', expected bytes_param.")
            parameters[key] = value
        await self.engine.load(request.model_name, parameters)
        return pb.RepositoryModelLoadResponse()

    @_rpc("model-repository")
    async def RepositoryModelUnload(
        self, request: Any, context: Any
    ) -> pb.RepositoryModelUnloadResponse:
        self._check_repository(request.repository_name)
        dependents = False
        for key, parameter in request.parameters.items():
            value = _value(parameter)
            if key != "unload_dependents":
                raise InvalidArgumentError(
                    f"unload of model '{request.model_name}': unknown parameter '{key}'"
                )
            if not isinstance(value, bool):
                raise InvalidArgumentError(
                    "invalid value type for 'unload_dependents' parameter, expected bool_param."
                )
            dependents = value
        await self.engine.unload(request.model_name, dependents)
        return pb.RepositoryModelUnloadResponse()

    # -- shared memory ------------------------------------------------------------------
    @_rpc("shared-memory")
    async def SystemSharedMemoryStatus(
        self, request: Any, context: Any
    ) -> pb.SystemSharedMemoryStatusResponse:
        region = pb.SystemSharedMemoryStatusResponse.RegionStatus
        response = pb.SystemSharedMemoryStatusResponse()
        for status in self.dataplane.system_shm_status(request.name):
            response.regions[status["name"]].CopyFrom(
                region(
                    name=status["name"],
                    key=status["key"],
                    offset=status["offset"],
                    byte_size=status["byte_size"],
                )
            )
        return response

    @_rpc("shared-memory")
    async def SystemSharedMemoryRegister(
        self, request: Any, context: Any
    ) -> pb.SystemSharedMemoryRegisterResponse:
        self.dataplane.register_system_shm(
            request.name, request.key, request.offset, request.byte_size
        )
        return pb.SystemSharedMemoryRegisterResponse()

    @_rpc("shared-memory")
    async def SystemSharedMemoryUnregister(
        self, request: Any, context: Any
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        self.dataplane.unregister_system_shm(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    @_rpc("shared-memory")
    async def CudaSharedMemoryStatus(
        self, request: Any, context: Any
    ) -> pb.CudaSharedMemoryStatusResponse:
        region = pb.CudaSharedMemoryStatusResponse.RegionStatus
        response = pb.CudaSharedMemoryStatusResponse()
        for status in self.dataplane.cuda_shm_status(request.name):
            response.regions[status["name"]].CopyFrom(
                region(
                    name=status["name"],
                    device_id=status.get("device_id", 0),
                    byte_size=status.get("byte_size", 0),
                )
            )
        return response

    @_rpc("shared-memory")
    async def CudaSharedMemoryRegister(
        self, request: Any, context: Any
    ) -> pb.CudaSharedMemoryRegisterResponse:
        self.dataplane.register_cuda_shm(
            request.name, request.raw_handle, request.device_id, request.byte_size
        )
        return pb.CudaSharedMemoryRegisterResponse()

    @_rpc("shared-memory")
    async def CudaSharedMemoryUnregister(
        self, request: Any, context: Any
    ) -> pb.CudaSharedMemoryUnregisterResponse:
        self.dataplane.unregister_cuda_shm(request.name)
        return pb.CudaSharedMemoryUnregisterResponse()

    # -- trace and logging --------------------------------------------------------------
    @_rpc("trace")
    async def TraceSetting(self, request: Any, context: Any) -> pb.TraceSettingResponse:
        tracer, model = self.engine.tracer, request.model_name or None
        if request.settings:
            changes: dict[str, Any] = {}
            for key, entry in request.settings.items():
                values = list(entry.value)
                if not values:  # no value: back to the default
                    changes[key] = None
                elif key == "trace_level":
                    changes[key] = values
                elif len(values) == 1:
                    changes[key] = values[0]
                else:
                    raise InvalidArgumentError(
                        f"trace setting '{key}' takes one value, got {len(values)}"
                    )
            settings = tracer.update(model, changes)
        else:
            settings = tracer.settings(model)
        response = pb.TraceSettingResponse()
        for key, value in settings.items():
            response.settings[key].value.extend(value if isinstance(value, list) else [value])
        return response

    @_rpc("logging")
    async def LogSettings(self, request: Any, context: Any) -> pb.LogSettingsResponse:
        settings = self.engine.settings.log
        current = settings.as_dict()
        changes = {}
        for key, value in request.settings.items():
            decoded = _value(value)
            if decoded is not None:
                changes[key] = decoded
            elif key == "log_file":
                changes[key] = ""  # refused as with a value: it cannot be changed at all
            elif key in current:  # (Triton's words; an unknown key without a value is ignored)
                expected = _EXPECTED_LOG_VALUE[type(current[key])]
                raise InvalidArgumentError(f"expect {expected} for '{key}'")
        if changes:
            settings.update(changes)
        response = pb.LogSettingsResponse()
        for key, value in settings.as_dict().items():
            entry = response.settings[key]
            if isinstance(value, bool):
                entry.bool_param = value
            elif isinstance(value, int):
                entry.uint32_param = value
            else:
                entry.string_param = str(value)
        return response

    # -- inference ------------------------------------------------------------------------
    def decode(
        self, inbound: InferCall, context: Any, unary: bool = True
    ) -> tuple[Request, dict[str, OutputSpec] | None]:
        """The engine request for a ModelInferRequest, and the requested outputs that
        need care (written to shared memory, or classified), by name."""
        request, raws = inbound
        model_name = request.model_name
        version = parse_version(request.model_version)
        # The model first, as Triton does: an unknown model wins over a bad input.
        model = self.engine.model(model_name, version)
        if unary and model.decoupled:
            raise UnsupportedError(
                "ModelInfer RPC doesn't support models with decoupled transaction policy"
            )
        parameters = _request_parameters(request.parameters) if request.parameters else {}
        if self.forward is not None:
            for key, value in context.invocation_metadata() or ():
                if self.forward.search(key):
                    # A binary (-bin) header goes as its text up to a NUL, as Triton's does.
                    text = value if isinstance(value, str) else value.split(b"\0", 1)[0].decode("utf-8", "replace")
                    parameters[key] = text
        raw_count = len(raws)
        index = 0
        inputs = []
        for tensor in request.inputs:
            name = tensor.name
            try:
                data_type: DataType | None = DataType.from_wire(tensor.datatype)
            except ValueError:
                data_type = None
                declared = model.signature.inputs.get(name)
                if declared is not None:
                    label = f"[request id: {request.id or '<id_unknown>'}] "
                    raise InvalidArgumentError(
                        f"{label}inference input '{name}' data-type is '<invalid>', but model "
                        f"'{model_name}' expects '{declared.data_type.wire_name}'"
                    ) from None
            ref = None
            if tensor.parameters:
                ref = shm_ref(_plain_parameters(tensor.parameters), f"input '{name}'")
            if ref is not None:
                if tensor.HasField("contents"):
                    raise InvalidArgumentError(
                        f"unexpected 'content' provided when using shared memory for input tensor "
                        f"'{name}' for model '{model_name}'"
                    )
                spec = InputSpec(name, tensor.datatype, list(tensor.shape), shm=ref)
            elif tensor.HasField("contents"):
                if raw_count:
                    raise InvalidArgumentError(
                        f"contents field must not be specified when using raw_input_contents for "
                        f"'{name}' for model '{model_name}'"
                    )
                spec = _decode_contents(tensor, data_type, model_name)
            elif index < raw_count:
                # A view of the request's bytes: no copy on the way to the engine.
                spec = InputSpec(
                    name,
                    tensor.datatype,
                    list(tensor.shape),
                    raw=np.frombuffer(raws[index], dtype=np.uint8),
                )
                index += 1
            else:
                raise InvalidArgumentError(
                    f"unable to find data for input tensor '{name}' for model "
                    f"'{model_name}' in request."
                )
            inputs.append(spec)
        if index < raw_count:
            raise InvalidArgumentError(
                f"expected {index} raw_input_contents (one per input sent neither as contents nor "
                f"in shared memory) but got {raw_count} for model '{model_name}'"
            )
        outputs: list[OutputSpec] | None = None
        specs: dict[str, OutputSpec] | None = None  # outputs to shared memory or classified
        if request.outputs:
            outputs = []
            for output in request.outputs:
                output_parameters = (
                    _plain_parameters(output.parameters) if output.parameters else {}
                )
                spec_out = OutputSpec(
                    output.name,
                    output_parameters,
                    shm_ref(output_parameters, f"output '{output.name}'"),
                )
                outputs.append(spec_out)
                if spec_out.shm is not None or spec_out.class_count:
                    if specs is None:
                        specs = {}
                    specs[spec_out.name] = spec_out
        engine_request = self.dataplane.build_request(
            model_name, version if version >= 0 else None, request.id, parameters, inputs, outputs
        )
        return engine_request, specs

    @_rpc("inference")
    async def ModelInfer(self, request: InferCall, context: Any) -> list[bytes | memoryview]:
        received = time.monotonic_ns()
        engine_request, specs = self.decode(request, context)
        if not self.engine.tracer.enabled:
            return await self._answer(engine_request, specs, context)
        held: list[Trace] = []

        def traced(trace: Trace) -> None:
            trace.record("GRPC_WAITREAD_START", context.started_ns)
            trace.record("GRPC_WAITREAD_END", received)
            trace.hold()
            held.append(trace)

        def sent(done: bool) -> None:
            for trace in held:
                if done:
                    trace.record("GRPC_SEND_END")
                trace.release()

        context.after_send = sent
        return await self._answer(engine_request, specs, context, traced, held)

    async def _answer(
        self,
        engine_request: Request,
        specs: dict[str, OutputSpec] | None,
        context: Any,
        traced: Callable[[Trace], None] | None = None,
        held: list[Trace] | None = None,
    ) -> list[bytes | memoryview]:
        # A client that cancels or whose deadline passes cancels its request in there.
        response = await self.dataplane.infer(engine_request, traced)
        if response.error is not None:
            # A new exception: raising the one this frame's response holds would make a
            # cycle (error -> traceback -> frame -> response -> error) that keeps the
            # request's tensors, a client's shared memory among them, until the cyclic
            # garbage collector happens to run.
            raise TritonError.from_code(response.error.code, response.error.message)
        if specs:
            response = self.dataplane.classified(response, specs.values())
        if self.compression is not None:
            context.set_compression(self.compression)
        encoded = encode_response(response, specs)
        for trace in held or ():
            trace.record("GRPC_SEND_START")
        return encoded

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[InferCall], context: Any
    ) -> AsyncIterator[Answer]:
        rules = self.rules["inference"]
        if rules:
            await self.check_restricted(rules, context)
        if self.compression is not None:
            context.set_compression(self.compression)
        stream = _Stream(self, context)
        reader = asyncio.get_running_loop().create_task(stream.read(request_iterator))
        try:
            while True:
                entry = await stream.queue.get()
                stream.room.set()
                if entry is None:
                    if stream.failure is not None:
                        raise stream.failure  # a message that was no request ends the call
                    break
                item, trace = entry
                try:
                    yield item
                    if trace is not None:  # back here once it was handed to the transport
                        trace.record("GRPC_SEND_END")
                finally:
                    if trace is not None:
                        trace.release()
        finally:
            reader.cancel()
            stream.cancel_pending()
            stream.release_traces()
            try:
                await reader
            except asyncio.CancelledError:
                pass
            except Exception:  # noqa: BLE001 - the stream already failed; do not mask it
                log.exception("gRPC stream reader failed")


class _Stream:
    """One ModelStreamInfer call: requests in, responses out in completion order.

    A client that reads no answers is held back: while :data:`STREAM_BACKLOG` answers
    wait unsent (its window is shut), the call reads no more of its requests, which stay
    with the transport, which reopens the client's window only as they are read. Only
    answers count: requests in flight do not, since a model may hold some open until a
    later one arrives (a decoupled model answering a whole utterance at its end), and
    not reading that one would hang the stream. Two bounds are the models' to set: how
    many requests wait to execute (``max_queue_size`` of a dynamic batcher, as in
    Triton), and how many answers a decoupled model sends for one request."""

    def __init__(self, servicer: InferenceServicer, context: Any) -> None:
        self.servicer = servicer
        self.context = context
        # answers in completion order, each with the trace it holds open until it is sent
        self.queue: asyncio.Queue[tuple[Answer, Trace | None] | None] = asyncio.Queue()
        self.waiting_since: int = context.started_ns  # for the next request's GRPC_WAITREAD_START
        self.pending: set[Request] = set()
        self.room = asyncio.Event()  # set when an answer leaves the queue
        self.reading = True
        self.failure: Abort | None = None

    async def read(self, requests: AsyncIterator[InferCall]) -> None:
        try:
            async for message in requests:
                self.submit(message)
                while self.queue.qsize() >= STREAM_BACKLOG:
                    self.room.clear()
                    await self.room.wait()
        except Abort as abort:
            self.failure = abort
            self.queue.put_nowait(None)
        finally:
            self.reading = False
            if not self.pending:
                self.queue.put_nowait(None)

    def submit(self, inbound: InferCall) -> None:
        received = time.monotonic_ns()
        message = inbound.message
        try:
            request, specs = self.servicer.decode(inbound, self.context, unary=False)
            empty_final = message.parameters.get(EMPTY_FINAL)
            request.on_response = functools.partial(
                self.deliver, request, specs, empty_final is not None and empty_final.bool_param
            )
            self.pending.add(request)
            try:
                self.servicer.engine.submit(request)
            except BaseException:
                self.pending.discard(request)
                raise
            if request.trace is not None:
                request.trace.record("GRPC_WAITREAD_START", self.waiting_since)
                request.trace.record("GRPC_WAITREAD_END", received)
        except TritonError as exc:
            self.refuse(message, exc.message)
        except Exception as exc:  # noqa: BLE001 - a bug answers this request, not the stream
            log.exception("gRPC stream request failed")
            self.refuse(message, f"{type(exc).__name__}: {exc}")
        self.waiting_since = time.monotonic_ns()

    def refuse(self, message: pb.ModelInferRequest, error: str) -> None:
        # Refused before reaching a model: Triton answers with just the request id.
        self.queue.put_nowait(
            (
                pb.ModelStreamInferResponse(
                    error_message=error, infer_response=pb.ModelInferResponse(id=message.id)
                ),
                None,
            )
        )

    def deliver(
        self,
        request: Request,
        specs: dict[str, OutputSpec] | None,
        empty_final: bool,
        response: Response,
    ) -> None:
        if request not in self.pending:
            return  # cancelled meanwhile
        if response.final:
            self.pending.discard(request)
        if response.flags_only and not empty_final:
            # Only clients that asked for it get a final with nothing in it.
            if not self.reading and not self.pending:
                self.queue.put_nowait(None)
            return
        error = response.error.message if response.error is not None else ""
        item: Answer | None = None
        if not error and not response.flags_only:
            try:
                if specs:
                    response = self.servicer.dataplane.classified(response, specs.values())
                item = encode_stream_response(encode_response(response, specs, response.final))
            except Exception as exc:  # noqa: BLE001 - one bad response must not end the stream
                log.exception("encoding a stream response failed")
                error = f"{type(exc).__name__}: {exc}"
        if item is None:  # Triton: the model name and id, no version, no outputs
            infer = pb.ModelInferResponse(model_name=response.model_name, id=response.request_id)
            infer.parameters[FINAL_RESPONSE].bool_param = response.final
            item = pb.ModelStreamInferResponse(error_message=error, infer_response=infer)
        trace = request.trace
        if trace is not None:  # still open: this runs inside the engine's delivery
            trace.record("GRPC_SEND_START")
            trace.hold()  # until the answer is sent
        self.queue.put_nowait((item, trace))
        if not self.reading and not self.pending:
            self.queue.put_nowait(None)

    def release_traces(self) -> None:
        """The call is over: the traces of answers never sent are let go."""
        while not self.queue.empty():
            entry = self.queue.get_nowait()
            if entry is not None and entry[1] is not None:
                entry[1].release()

    def cancel_pending(self) -> None:
        pending, self.pending = self.pending, set()
        for request in pending:
            self.servicer.engine.cancel(request)


class HealthServicer:
    """``grpc.health.v1.Health``: SERVING while the engine is live and ready."""

    def __init__(self, servicer: InferenceServicer) -> None:
        self.servicer = servicer

    async def Check(self, request: Any, context: Any) -> health_pb2.HealthCheckResponse:
        rules = self.servicer.rules["health"]
        if rules:
            await self.servicer.check_restricted(rules, context)
        engine = self.servicer.engine
        serving = engine.live and engine.ready()
        status = health_pb2.HealthCheckResponse
        return status(status=status.SERVING if serving else status.NOT_SERVING)

    async def Watch(
        self, request: Any, context: Any
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Watch is not supported; use Check")
        yield health_pb2.HealthCheckResponse()  # pragma: no cover - makes this a generator


# -- the server ------------------------------------------------------------------------------------
def transport_settings(options: Any) -> Settings:
    """The transport's settings from KServeGrpc.Options (grpc's server options, same names)."""
    return Settings(**{field: getattr(options, field) for field in Settings.__dataclass_fields__})


def _read(path: str, what: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise InvalidArgumentError(f"unable to read the {what} '{path}': {exc.strerror}") from None


def server_tls(options: Any) -> ssl.SSLContext:
    _read(options.server_key, "server key")
    _read(options.server_cert, "server certificate")
    if options.root_cert:
        _read(options.root_cert, "root certificate")
    try:
        return tls_context(
            options.server_cert,
            options.server_key,
            options.root_cert or None,
            bool(options.use_mutual_auth),
        )
    except ssl.SSLError as exc:
        raise InvalidArgumentError(f"unable to use the TLS key and certificates: {exc}") from None


def _serialized(answer: Answer) -> bytes | list[bytes | memoryview]:
    """An answer on the wire: inference answers come serialized already (as pieces)."""
    return answer if isinstance(answer, list) else answer.SerializeToString()


def methods(servicer: InferenceServicer) -> dict[str, Method]:
    """The methods of ``inference.GRPCInferenceService`` and ``grpc.health.v1.Health``, by path."""
    table: dict[str, Method] = {}
    services = (
        (pb.DESCRIPTOR.services_by_name["GRPCInferenceService"], pb, servicer),
        (health_pb2.DESCRIPTOR.services_by_name["Health"], health_pb2, HealthServicer(servicer)),
    )
    for service, module, implementation in services:
        for method in service.methods:
            if method.input_type.name == "ModelInferRequest":
                decode: Callable[[Buffer], Any] = parse_infer_request
            else:
                decode = getattr(module, method.input_type.name).FromString
            table[f"/{service.full_name}/{method.name}"] = Method(
                behaviour=getattr(implementation, method.name),
                decode=decode,
                encode=_serialized,
                client_streaming=method.client_streaming,
                server_streaming=method.server_streaming,
            )
    return table


class GrpcServer:
    """The gRPC frontend: ``await start()`` on the engine's loop, ``await stop()`` there too."""

    def __init__(self, dataplane: DataPlane, options: Any) -> None:
        self.dataplane = dataplane
        self.options = options
        self.restrictions = options._restrictions
        self.servicer = InferenceServicer(dataplane, self.restrictions, options)
        self._transport: GrpcTransport | None = None

    @property
    def address(self) -> str:
        host = self.options.address
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # IPv6
        return f"{host}:{self.options.port}"

    async def start(self) -> int:
        if self._transport is not None:
            raise UnavailableError("the gRPC server is already running")
        options = self.options
        tls = server_tls(options) if options.use_ssl else None
        transport = GrpcTransport(methods(self.servicer), transport_settings(options))
        try:
            port = await transport.listen(options.address, options.port, tls, options.reuse_port)
        except OSError as exc:
            raise UnavailableError(
                f"failed to bind the gRPC service to {self.address}: {exc.strerror or exc}"
            ) from None
        self._transport = transport
        return port

    async def stop(self, grace: float | None = 5.0) -> None:
        """Stop accepting calls; in-flight calls get up to ``grace`` seconds, then are cancelled."""
        transport, self._transport = self._transport, None
        if transport is not None:
            await transport.stop(grace)


__all__ = ["GRPC_CODES", "GrpcServer", "encode_response"]
