"""The KServe v2 gRPC API with Triton's extensions (``inference.GRPCInferenceService``).

Served by our own gRPC-over-HTTP/2 transport on the engine's event loop
(:mod:`dlserve.frontends.grpc_transport`): every handler is a plain coroutine that calls
the engine or the shared :class:`DataPlane` directly, with no thread hop. The RPCs are
:class:`dlserve.frontends.grpc_servicer.InferenceServicer`'s; this module adds
``grpc.health.v1.Health``, puts both services' methods in the transport's table
(:func:`methods`) and runs the transport (:class:`GrpcServer`).

``KServeGrpc.Options`` set the transport (:func:`transport_settings`): message size
limits, keepalive and ping policy, connection age, ``SO_REUSEPORT``, TLS and mutual
TLS; ``infer_compression_level`` compresses inference responses. ``infer_thread_count``,
``infer_allocation_pool_size`` and ``max_response_pool_size`` are accepted for
compatibility: every call runs on the loop.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from dlserve.errors import InvalidArgumentError, UnavailableError
from dlserve.frontends.dataplane import DataPlane
from dlserve.frontends.grpc_calls import Buffer, Method
from dlserve.frontends.grpc_codec import Answer, parse_infer_request
from dlserve.frontends.grpc_servicer import InferenceServicer
from dlserve.frontends.grpc_transport import GrpcTransport, Settings, tls_context
from dlserve.frontends.proto import grpc_service_pb2 as pb
from dlserve.frontends.proto import health_pb2


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
    """The server's TLS context. The root certificate checks clients' certificates, so
    only mutual TLS reads it (tritonserver, too, starts without one that is missing)."""
    _read(options.server_key, "server key")
    _read(options.server_cert, "server certificate")
    root = options.root_cert if options.use_mutual_auth else ""
    if root:
        _read(root, "root certificate")
    try:
        return tls_context(
            options.server_cert, options.server_key, root or None, bool(options.use_mutual_auth)
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
        port = await transport.listen(options.address, options.port, tls, options.reuse_port)
        self._transport = transport
        return port

    async def stop(self, grace: float | None = 5.0) -> None:
        """Stop accepting calls; in-flight calls get up to ``grace`` seconds, then are cancelled."""
        transport, self._transport = self._transport, None
        if transport is not None:
            await transport.stop(grace)


__all__ = ["GrpcServer"]
