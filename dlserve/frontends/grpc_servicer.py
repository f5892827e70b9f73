"""``inference.GRPCInferenceService``: every RPC, as a plain coroutine on the engine's loop.

Wire semantics follow Triton's gRPC frontend, including its error texts where a
client could tell the difference (captured in ``tests/data/triton_reference``):

* ``ModelInfer`` takes inputs as ``raw_input_contents`` (one entry per input that has
  neither typed ``contents`` nor a shared-memory reference, in input order), as typed
  ``contents`` (never both in one request), or from a registered shared-memory region.
  Raw inputs are ``np.frombuffer`` views of the request's bytes; the one copy they get
  is into the server's arena (above the inline size), which the worker needs anyway.
* ``ModelStreamInfer`` answers each request on the stream as it completes
  (:class:`dlserve.frontends.grpc_stream.InferStream`).
* Errors map :class:`dlserve.errors.ErrorCode` to gRPC codes with Triton's table
  (:data:`GRPC_CODES`).
* A restricted protocol (``--grpc-restricted-protocol=<protocols>:<header>=<value>``)
  answers UNAVAILABLE unless the call carries the header, named either as configured or
  with Triton's ``triton-grpc-protocol-`` prefix.
* A call cancelled by its client (or past its deadline) stops waiting; a request still
  queued is taken off the queue.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from google.protobuf import json_format

from dlserve.engine.request import Request
from dlserve.engine.tracing import Trace
from dlserve.errors import InvalidArgumentError, TritonError, UnsupportedError
from dlserve.frontends.dataplane import (
    CLASSIFICATION,
    DataPlane,
    InputSpec,
    OutputSpec,
    ShmRef,
    forward_pattern,
    shm_ref,
)
from dlserve.frontends.grpc_calls import GRPC_CODES, Abort, status_of
from dlserve.frontends.grpc_codec import (
    Answer,
    InferCall,
    decode_contents,
    encode_response,
    parameter_value,
    parse_version,
    plain_parameters,
    request_parameters,
)
from dlserve.frontends.grpc_stream import InferStream
from dlserve.frontends.proto import grpc_service_pb2 as pb
from dlserve.frontends.restrictions import Restriction, rules_by_category
from dlserve.memory.dtypes import DataType

if TYPE_CHECKING:
    from dlserve.engine.model import ModelVersion

log = logging.getLogger("dlserve.frontends.grpc")

HEADER_PREFIX = "triton-grpc-protocol-"
# infer_compression_level -> the algorithm gRPC core picks for that level when the client
# accepts gzip and deflate (its ranking: low = gzip, medium and high = deflate).
_COMPRESSION = {1: "gzip", 2: "deflate", 3: "deflate"}
_EXPECTED_LOG_VALUE = {bool: "boolean", int: "int32", str: "string"}  # a log setting sent without one


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
                await context.abort(status_of(exc), exc.message)
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
        self.forward = forward_pattern(getattr(options, "forward_header_pattern", ""))
        self.compression = _COMPRESSION.get(int(getattr(options, "infer_compression_level", 0)))

    async def check_restricted(self, rules: list[Restriction], context: Any) -> None:
        metadata = context.invocation_metadata() or ()
        for rule in rules:
            # Only under Triton's prefix, named so in the error (as Triton 2.51: a bare
            # header of the rule's name is refused).
            key = HEADER_PREFIX + rule.header
            if not any(name == key and value == rule.value for name, value in metadata):
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE, f"This protocol is restricted, expecting header '{key}'"
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
            value = parameter_value(parameter)
            if key == "config" and not isinstance(value, str):  # (Triton's words, these three)
                raise InvalidArgumentError("invalid value type for load parameter 'config', expected string_param.")
            if key.startswith("file:") and not isinstance(value, bytes):
                raise InvalidArgumentError(f"invalid value type for load parameter '{key}', expected bytes_param.")
            parameters[key] = value
        # (shielded: a call past its deadline or cancelled leaves the load to complete, as
        # Triton's does; see KServeHttpApi.load)
        await asyncio.shield(self.engine.load(request.model_name, parameters))
        return pb.RepositoryModelLoadResponse()

    @_rpc("model-repository")
    async def RepositoryModelUnload(
        self, request: Any, context: Any
    ) -> pb.RepositoryModelUnloadResponse:
        self._check_repository(request.repository_name)
        dependents = False
        for key, parameter in request.parameters.items():
            value = parameter_value(parameter)
            if key != "unload_dependents":
                raise InvalidArgumentError(
                    f"unload of model '{request.model_name}': unknown parameter '{key}'"
                )
            if not isinstance(value, bool):
                raise InvalidArgumentError(
                    "invalid value type for 'unload_dependents' parameter, expected bool_param."
                )
            dependents = value
        await self.engine.unload(request.model_name, dependents, wait=False)  # (as Triton: at once)
        return pb.RepositoryModelUnloadResponse()

    # -- shared memory ------------------------------------------------------------------
    @_rpc("shared-memory")
    async def SystemSharedMemoryStatus(
        self, request: Any, context: Any
    ) -> pb.SystemSharedMemoryStatusResponse:
        statuses = self.dataplane.system_shm_status(request.name)
        return _region_statuses(pb.SystemSharedMemoryStatusResponse(), statuses, ("key", "offset", "byte_size"))

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
        statuses = self.dataplane.cuda_shm_status(request.name)
        return _region_statuses(pb.CudaSharedMemoryStatusResponse(), statuses, ("device_id", "byte_size"))

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
                else:  # (the tracer says which settings take more than one value)
                    changes[key] = values if key == "trace_level" or len(values) > 1 else values[0]
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
            decoded = parameter_value(value)
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
    ) -> tuple[Request, dict[str, OutputSpec] | None, ModelVersion]:
        """The engine request for a ModelInferRequest, the requested outputs that need
        care (written to shared memory, or classified) by name, and the model version
        that will serve it."""
        request, raws = inbound
        model_name = request.model_name
        version = parse_version(request.model_version)
        # The model first, as Triton does: an unknown model wins over a bad input.
        model = self.engine.model(model_name, version)
        if unary and model.decoupled:
            raise UnsupportedError(
                "ModelInfer RPC doesn't support models with decoupled transaction policy"
            )
        parameters = request_parameters(request.parameters) if request.parameters else {}
        metadata = context.invocation_metadata() or ()
        forwarded = []
        if self.forward is not None:
            for key, value in metadata:
                if self.forward.search(key):
                    # A binary (-bin) header goes as its text up to a NUL, as Triton's does.
                    text = value if isinstance(value, str) else value.split(b"\0", 1)[0].decode("utf-8", "replace")
                    forwarded.append((key, text))
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
                ref = shm_ref(plain_parameters(tensor.parameters), f"input '{name}'")
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
                spec = decode_contents(tensor, data_type, model_name)
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
                    plain_parameters(output.parameters) if output.parameters else {}
                )
                ref = shm_ref(output_parameters, f"output '{output.name}'")
                _check_classification(output_parameters, ref)
                spec_out = OutputSpec(output.name, output_parameters, ref)
                outputs.append(spec_out)
                if spec_out.shm is not None or spec_out.class_count:
                    if specs is None:
                        specs = {}
                    specs[spec_out.name] = spec_out
        engine_request = self.dataplane.build_request(
            model_name, version if version >= 0 else None, request.id, parameters, inputs, outputs, forwarded
        )
        engine_request.trace_context = self.dataplane.trace_context(metadata)
        return engine_request, specs, model

    @_rpc("inference")
    async def ModelInfer(self, request: InferCall, context: Any) -> list[bytes | memoryview]:
        received = time.monotonic_ns()
        engine_request, specs, _ = self.decode(request, context)
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
            response = self.dataplane.finished(response, specs.values())
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
        stream = InferStream(self, context)
        context.on_server_stop(stream.stop)
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


def _check_classification(parameters: dict[str, Any], shm: ShmRef | None) -> None:
    """An output's class count as Triton's gRPC frontend checks it (a 0 sent is refused
    too), in its words."""
    if CLASSIFICATION in parameters:
        count = parameters[CLASSIFICATION]
        if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
            raise InvalidArgumentError(
                f"invalid value for '{CLASSIFICATION}' parameter, expected >= 0"
            )
        if shm is not None:
            raise InvalidArgumentError(
                f"output can't set both 'shared_memory_region' and '{CLASSIFICATION}'"
            )


__all__ = ["GRPC_CODES", "InferenceServicer"]


def _region_statuses(response: Any, statuses: list[dict[str, Any]], fields: tuple[str, ...]) -> Any:
    """A shared-memory status response: a RegionStatus per region, named, with these
    fields of its status (0 where it has none)."""
    region = type(response).RegionStatus
    for status in statuses:
        response.regions[status["name"]].CopyFrom(
            region(name=status["name"], **{field: status.get(field, 0) for field in fields})
        )
    return response
