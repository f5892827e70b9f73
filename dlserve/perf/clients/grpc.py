"""gRPC: a blocking stub for the control plane; for inference, the request bytes encoded
up front go out as they are and responses are not decoded (with ``--profile-export-file``
they are kept, for :mod:`dlserve.perf.answers` to decode after the run):

* ``--grpc-transport h2`` (the default): unary calls on one hand-driven HTTP/2
  connection per process (:mod:`.h2`), about a tenth of grpcio's CPU per call;
* ``--grpc-transport grpcio``: generic calls on one ``grpc.aio`` channel per process
  whose serializers are the identity.

Unary slots share the connection (HTTP/2 multiplexes them). With ``--streaming`` each slot
owns a ``ModelStreamInfer`` stream and waits for its request's response; a response whose
first field is ``error_message`` (tag 0x0a) is the request's failure.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from typing import Any

import grpc

from dlserve.perf.clients.base import (
    ControlClient,
    DataPlane,
    MissingEndpoint,
    RequestError,
    ServerError,
    Slot,
)
from dlserve.perf.clients.h2 import H2Channel, H2Slot, grpc_message, unframe
from dlserve.perf.inputs import ModelInfo
from dlserve.perf.payloads import grpc_request
from dlserve.perf.shm import CudaRegion, SystemRegion

INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 2**31 - 1),
    ("grpc.max_receive_message_length", 2**31 - 1),
]
_now = time.perf_counter_ns


def _read(path: str) -> bytes | None:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ServerError(f"cannot read '{path}': {exc.strerror or exc}") from None


def channel_credentials(settings: Any) -> grpc.ChannelCredentials | None:
    """With --ssl-grpc-use-ssl: TLS with the given root certificates (else the system's)
    and, for mutual TLS, the client's key and certificate chain."""
    if not settings.ssl_grpc:
        return None
    return grpc.ssl_channel_credentials(
        _read(settings.ssl_grpc_root_certs), _read(settings.ssl_grpc_private_key), _read(settings.ssl_grpc_cert_chain)
    )


def open_channel(api: Any, settings: Any, **options: Any) -> Any:
    """A channel of ``api`` (grpc, or grpc.aio) to the server, over TLS with --ssl-grpc-use-ssl."""
    credentials = channel_credentials(settings)
    if credentials is None:
        return api.insecure_channel(settings.url, options=CHANNEL_OPTIONS, **options)
    return api.secure_channel(settings.url, credentials, options=CHANNEL_OPTIONS, **options)


def ssl_context(settings: Any) -> ssl.SSLContext | None:
    """The same TLS for dlserve perf's own HTTP/2 client (ALPN h2, as gRPC requires)."""
    if not settings.ssl_grpc:
        return None
    context = ssl.create_default_context(cafile=settings.ssl_grpc_root_certs or None)
    if settings.ssl_grpc_cert_chain:
        context.load_cert_chain(settings.ssl_grpc_cert_chain, settings.ssl_grpc_private_key or None)
    context.set_alpn_protocols(["h2"])
    return context


class GrpcControl(ControlClient):
    def __init__(self, settings: Any, timeout: float = 30.0) -> None:
        from dlserve.frontends.proto import grpc_service_pb2 as pb
        from dlserve.frontends.proto import grpc_service_pb2_grpc as pb_grpc

        self.pb = pb
        self.url = settings.url
        self.timeout = timeout
        self.channel = open_channel(grpc, settings)
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)

    def _call(self, method: str, request: Any) -> Any:
        try:
            return getattr(self.stub, method)(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = exc.details() if hasattr(exc, "details") else str(exc)
            if code == grpc.StatusCode.UNAVAILABLE:
                raise ServerError(f"cannot reach the server at {self.url}: {details}") from None
            if code == grpc.StatusCode.UNIMPLEMENTED:
                raise MissingEndpoint(f"{method}: {details}") from None
            raise ServerError(f"{method}: {details}") from None

    def model_info(self, model: str, version: str) -> ModelInfo:
        from google.protobuf import json_format

        pb = self.pb
        metadata = self._call("ModelMetadata", pb.ModelMetadataRequest(name=model, version=version))
        try:  # Triton's model configuration extension: batching, decoupled
            response = self._call("ModelConfig", pb.ModelConfigRequest(name=model, version=version))
            config = json_format.MessageToDict(response.config, preserving_proto_field_name=True)
        except MissingEndpoint:
            config = {}  # a plain KServe v2 server: the metadata alone
        return ModelInfo.from_json(
            json_format.MessageToDict(metadata, preserving_proto_field_name=True), config
        )

    def statistics(self, model: str, version: str) -> dict[str, Any]:
        from google.protobuf import json_format

        response = self._call("ModelStatistics", self.pb.ModelStatisticsRequest(name=model, version=version))
        return json_format.MessageToDict(response, preserving_proto_field_name=True)

    def register(self, region: SystemRegion | CudaRegion) -> None:
        pb = self.pb
        if isinstance(region, SystemRegion):
            self._call("SystemSharedMemoryRegister", pb.SystemSharedMemoryRegisterRequest(
                name=region.name, key=region.key, offset=0, byte_size=region.byte_size))
        else:
            self._call("CudaSharedMemoryRegister", pb.CudaSharedMemoryRegisterRequest(
                name=region.name, raw_handle=region.raw_handle, device_id=region.device_id,
                byte_size=region.byte_size))

    def unregister(self, region: SystemRegion | CudaRegion) -> None:
        pb = self.pb
        if isinstance(region, SystemRegion):
            self._call("SystemSharedMemoryUnregister", pb.SystemSharedMemoryUnregisterRequest(name=region.name))
        else:
            self._call("CudaSharedMemoryUnregister", pb.CudaSharedMemoryUnregisterRequest(name=region.name))

    def close(self) -> None:
        self.channel.close()


class UnarySlot(Slot):
    def __init__(self, call: Any) -> None:
        self.call = call

    async def infer(self, payload: bytes) -> tuple[int, int]:
        try:
            response = await self.call(payload)
        except grpc.aio.AioRpcError as exc:
            raise RequestError(f"gRPC {exc.code().name}: {exc.details()}") from None
        if self.captured is not None:
            self.captured = [(_now(), response)]
        return 0, 0


class StreamSlot(Slot):
    """One ModelStreamInfer stream; one request on it at a time."""

    def __init__(self, method: Any, decoupled: bool) -> None:
        self.method = method
        self.decoupled = decoupled
        self.call: Any = None

    async def infer(self, payload: bytes) -> tuple[int, int]:
        if self.call is None:
            self.call = self.method()
        call = self.call
        self.responses = 0
        answers = None if self.captured is None else []
        self.captured = answers
        try:
            await call.write(payload)
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    self.call = None
                    raise RequestError("the server ended the stream")
                if response[:1] == b"\x0a":
                    raise RequestError(_stream_error(response))
                if answers is not None:  # (a flag-only final too: perf_analyzer keeps its time)
                    answers.append((_now(), response))
                if self.on_answer is not None:
                    self.on_answer()
                if not self.decoupled:
                    self.responses = 1
                    return 0, 0
                if not _final(response):
                    self.responses += 1
                    continue
                self.responses += _has_outputs(response)  # (a flag-only final is no response)
                return 0, 0
        except grpc.aio.AioRpcError as exc:
            self.call = None
            raise RequestError(f"gRPC {exc.code().name}: {exc.details()}") from None

    async def close(self) -> None:
        call, self.call = self.call, None
        if call is not None:
            try:
                await call.done_writing()
            except Exception:  # noqa: BLE001 - the stream may be gone already
                pass
            call.cancel()


def _has_outputs(response: bytes) -> bool:
    from dlserve.frontends.proto import grpc_service_pb2 as pb

    return bool(pb.ModelStreamInferResponse.FromString(response).infer_response.outputs)


def _stream_error(response: bytes) -> str:
    from dlserve.frontends.proto import grpc_service_pb2 as pb

    return "stream error: " + pb.ModelStreamInferResponse.FromString(response).error_message


def _final(response: bytes) -> bool:
    from dlserve.frontends.proto import grpc_service_pb2 as pb

    parsed = pb.ModelStreamInferResponse.FromString(response)
    parameter = parsed.infer_response.parameters.get("triton_final_response")
    return bool(parameter is not None and parameter.bool_param)


class GrpcDataPlane(DataPlane):
    async def setup(self) -> None:
        self.shared_memory()
        streaming = self.settings.streaming
        # (a decoupled model's stream says where its request's responses end)
        self._flags = {"triton_enable_empty_final_response": True} if streaming and self.info.decoupled else {}
        self.h2: H2Channel | None = None
        self.encoding = None if self.settings.grpc_compression == "none" else self.settings.grpc_compression
        if self.settings.grpc_transport == "h2" and not streaming:
            self.h2 = H2Channel(self.settings.url, INFER, self.encoding, ssl_context(self.settings))
            await self.h2.connect()
        else:
            await self._grpcio()
        self.payloads = self.encode_all()

    def encode(self, index: int, extra: dict[str, object] | None = None) -> bytes:
        request = grpc_request(
            self.info, self.settings.version, self.requests[index],
            None if self.shm_inputs is None else self.shm_inputs[index], self.output_refs(index),
            {**self._flags, **self.parameters(extra)},
        )
        return request if self.h2 is None else grpc_message(request, self.encoding)

    async def _grpcio(self) -> None:
        compression = {"gzip": grpc.Compression.Gzip, "deflate": grpc.Compression.Deflate}.get(
            self.settings.grpc_compression, grpc.Compression.NoCompression
        )
        self.channel = open_channel(grpc.aio, self.settings, compression=compression)
        # No serializers: the bytes given are sent as they are, the reply bytes returned.
        self._unary = self.channel.unary_unary(INFER)
        self._stream = self.channel.stream_stream(STREAM)
        try:
            await asyncio.wait_for(self.channel.channel_ready(), timeout=30)
        except asyncio.TimeoutError:
            raise RequestError(f"cannot connect to {self.settings.url}") from None

    async def describe(self, framed: bytes) -> str:
        """Why the server refused a request sent over h2: ask again through grpcio."""
        if getattr(self, "channel", None) is None:
            await self._grpcio()
        try:
            await self._unary(unframe(framed), timeout=30)
        except grpc.aio.AioRpcError as exc:
            return f"gRPC {exc.code().name}: {exc.details()}"
        return "the server answered without a response message"

    async def open_slot(self) -> Slot:
        if self.h2 is not None:
            return H2Slot(self.h2, self.describe)
        if self.settings.streaming:
            return StreamSlot(self._stream, self.info.decoupled)
        return UnarySlot(self._unary)

    async def close(self) -> None:
        channel = getattr(self, "channel", None)
        h2 = getattr(self, "h2", None)
        try:
            if h2 is not None:
                h2.close()
            if channel is not None:
                await channel.close()
        finally:
            await super().close()
