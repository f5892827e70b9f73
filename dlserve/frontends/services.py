"""Frontend services modelled on ``tritonfrontend``: ``KServeHttp``, ``KServeGrpc``, ``Metrics``.

Each is built from a started :class:`dlserve.Server` and an ``Options`` dataclass
with tritonfrontend's fields and defaults (plus dlserve's own, documented on each
field), validated on construction. ``start()``/``stop()`` or a ``with`` block run the
service on the server's event loop. Closing tritonfrontend's documented gaps:
shared memory works, restricted APIs work, and stopping the server first is safe —
it stops its services, so a late request is refused cleanly instead of crashing.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import logging
import os
import re
import time
from collections.abc import Coroutine
from typing import Any

import numpy as np

from dlserve.engine.server import Server
from dlserve.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    UnavailableError,
    UnsupportedError,
)
from dlserve.frontends.dataplane import DataPlane, forward_pattern
from dlserve.frontends.hosted import (
    PING_MODE_VARIABLE,
    SageMakerApi,
    VertexAiApi,
    sagemaker_model,
    vertex_model,
)
from dlserve.frontends.http_api import KServeHttpApi
from dlserve.frontends.http_server import REQUEST_TIMEOUT, HttpServer
from dlserve.frontends.restrictions import Restriction

_MIB = 1 << 20


def _check_field_types(options: Any) -> None:
    """Each field of an ``Options`` holds what it declares, as tritonfrontend's validated
    Options do (``server_key=10`` is refused); an integer given as a numeric string (a
    port from an environment variable) is taken as that integer, as there."""
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        declared = str(field.type)  # (a string: annotations are postponed here)
        if isinstance(value, str) and "int" in declared.split(" | ") and value.strip().lstrip("-").isdigit():
            value = int(value)
            setattr(options, field.name, value)
        if not any(_holds(kind, value) for kind in declared.split(" | ")):
            raise InvalidArgumentError(f"{field.name} must be {declared}, got {value!r}")


def _holds(kind: str, value: Any) -> bool:
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "list[str]":
        return isinstance(value, list) and all(isinstance(item, str) for item in value)
    if kind == "str":
        return isinstance(value, str)
    if kind == "bool":
        return isinstance(value, bool)
    return kind == "None" and value is None


def _check_port(port: Any) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidArgumentError(f"port must be an integer in [0, 65535], got {port!r}")


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}")


def _check_non_negative(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(f"{name} must be a non-negative integer, got {value!r}")


def _check_pattern(name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{name} must be a string")
    if value:
        try:
            forward_pattern(value)
        except re.error as exc:
            raise InvalidArgumentError(f"{name} is not a valid regular expression: {exc}") from None


class Service:
    """Shared lifecycle: a coroutine pair run on the server's loop."""

    Options: type[Any]
    # The service as tritonserver's messages name it, and as its "Started ... at" line does.
    triton_name: str
    started_as: str

    def __init__(self, server: Server, options: Any = None) -> None:
        options = self.Options() if options is None else options
        if not isinstance(options, self.Options):
            raise InvalidArgumentError(
                f"Incorrect type for options. options argument must be of type "
                f"{type(self).__name__}.Options"
            )
        self.server = server
        self.options = options
        self.port: int | None = None
        self._running = False

    def start(self) -> None:
        if self._running:
            raise AlreadyExistsError("server is already running.")
        try:
            self.port = self.server._run(self._start_with_the_server())
        except OSError as exc:
            where = f"{self.options.address}:{self.options.port}"
            if exc.errno == errno.EADDRINUSE:  # (tritonserver's words, which scripts grep)
                message = (
                    f"failed to start {self.triton_name} service: Unavailable - Socket '{where}' "
                    "already in use"
                )
            else:
                message = f"{type(self).__name__} cannot listen on {where}: {exc.strerror or exc}"
            raise UnavailableError(message) from None

    async def _start_with_the_server(self) -> int:
        """Start, attached to the server (on its loop) so that its stop stops this too. Once
        the stop began (its services already taken), the service is closed again and
        refused: it was left out, its port bound until the loop closed."""
        port = await self._start()
        if not self.server.engine.accepting:
            await self._stop(0.0)
            raise UnavailableError(f"{type(self).__name__} not started: the server is stopping")
        self._running = True
        self.server._attach(self)
        return port

    def stop(self, deadline: float | None = None) -> None:
        """Stop accepting; let requests in flight finish until ``deadline``
        (``time.monotonic()``; default: the server's exit timeout from now)."""
        stopping = self._stopping(deadline)
        if stopping is not None:
            self.server._run(stopping)

    def _stopping(self, deadline: float | None) -> Coroutine[Any, Any, None] | None:
        """Mark the service stopped and return what closes it, to run on the server's
        loop (None: nothing to close). The server runs all its services' at once, so
        that none takes new requests while another drains."""
        if not self._running:
            return None
        self._running = False
        self.server._detach(self)
        if deadline is None:
            deadline = time.monotonic() + float(self.server.options.exit_timeout)
        if self.server._loop is None:
            return None
        return self._stop(max(0.0, deadline - time.monotonic()))

    async def _start(self) -> int:
        raise NotImplementedError

    async def _stop(self, grace: float) -> None:
        raise NotImplementedError

    def __enter__(self) -> Service:
        self.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()


class _HttpService(Service):
    """A service over dlserve's HTTP server, on the engine's loop, whose large request
    bodies land in shared memory. Its Options have address, port, max_input_size and
    allow_client_shm."""

    def __init__(self, server: Server, options: Any = None) -> None:
        super().__init__(server, options)
        self._http: HttpServer | None = None

    def _kserve_api(self, **extra: Any) -> KServeHttpApi:
        return KServeHttpApi(DataPlane(self.server.engine, allow_client_shm=self.options.allow_client_shm), **extra)

    async def _listen(
        self,
        handler: Any,
        reuse_port: bool = False,
        max_connections: int = 0,
        request_timeout: float = REQUEST_TIMEOUT,
    ) -> int:
        engine = self.server.engine

        def allocate_body(nbytes: int) -> np.ndarray:
            assert engine.arena is not None
            return np.frombuffer(engine.arena.allocate(nbytes), dtype=np.uint8)

        options = self.options
        self._http = HttpServer(
            handler,
            allocate_body,
            max_body=options.max_input_size,
            poll_limit=engine.settings.busy_poll_us / 1e6,
            max_connections=max_connections,
            request_timeout=request_timeout,
        )
        return await self._http.start(options.address, options.port, reuse_port)

    async def _stop(self, grace: float) -> None:
        if self._http is not None:
            await self._http.stop(grace)
            self._http = None


class KServeHttp(_HttpService):
    triton_name, started_as = "HTTP", "HTTPService"

    @dataclasses.dataclass
    class Options:
        address: str = "0.0.0.0"
        port: int = 8000
        reuse_port: bool = False
        thread_count: int = 8  # accepted for compatibility; dlserve serves HTTP on one event loop
        header_forward_pattern: str = ""
        # dlserve: --http-max-input-size, --allow-client-shm, --http-restricted-api,
        # --http-max-connections (0: a quarter of the descriptor limit, at most 16384),
        # --http-request-timeout
        # (seconds a request's headers may take, and its body may stall; 0: no limit)
        max_input_size: int = 64 * _MIB
        allow_client_shm: bool = False
        restricted_apis: list[str] = dataclasses.field(default_factory=list)
        max_connections: int = 0
        request_timeout: int = int(REQUEST_TIMEOUT)

        def __post_init__(self) -> None:
            _check_field_types(self)
            _check_port(self.port)
            _check_positive("thread_count", self.thread_count)
            _check_positive("max_input_size", self.max_input_size)
            _check_non_negative("max_connections", self.max_connections)
            _check_non_negative("request_timeout", self.request_timeout)
            _check_pattern("header_forward_pattern", self.header_forward_pattern)
            self._restrictions = Restriction.parse_all(self.restricted_apis)

    async def _start(self) -> int:
        options = self.options
        api = self._kserve_api(
            restrictions=options._restrictions, header_forward_pattern=options.header_forward_pattern
        )
        return await self._listen(
            api, options.reuse_port, options.max_connections, options.request_timeout
        )


class SageMaker(_HttpService):
    """Amazon SageMaker's ``/ping`` and ``/invocations`` (:mod:`dlserve.frontends.hosted`),
    as tritonserver's ``--allow-sagemaker`` serves them."""

    triton_name, started_as = "SageMaker", "SageMaker"

    @dataclasses.dataclass
    class Options:
        address: str = "0.0.0.0"
        port: int = dataclasses.field(default_factory=lambda: _env_port("SAGEMAKER_BIND_TO_PORT", 8080))
        # The endpoint's model; None: SAGEMAKER_TRITON_DEFAULT_MODEL_NAME, else the only model.
        default_model: str | None = None
        # "ready" or "live": what /ping answers for (None: SAGEMAKER_TRITON_PING_MODE, else ready)
        ping_mode: str | None = None
        max_input_size: int = 64 * _MIB
        allow_client_shm: bool = False

        def __post_init__(self) -> None:
            _check_field_types(self)
            _check_port(self.port)
            _check_positive("max_input_size", self.max_input_size)
            if self.ping_mode is None:
                self.ping_mode = os.environ.get(PING_MODE_VARIABLE, "ready")
                if self.ping_mode not in ("ready", "live"):  # (tritonserver's reading)
                    logging.getLogger("dlserve").warning(
                        "%s=%r is neither 'ready' nor 'live': /ping answers for readiness",
                        PING_MODE_VARIABLE,
                        self.ping_mode,
                    )
                    self.ping_mode = "ready"
            if self.ping_mode not in ("ready", "live"):
                raise InvalidArgumentError(f"ping_mode must be 'ready' or 'live', got {self.ping_mode!r}")

    async def _start(self) -> int:
        options = self.options
        names = sorted({row["name"] for row in await self.server.engine.repository_index()})
        model = sagemaker_model(options.default_model, names)
        return await self._listen(SageMakerApi(self._kserve_api(), model, options.ping_mode))


class VertexAi(_HttpService):
    """Google Vertex AI's health and predict routes (:mod:`dlserve.frontends.hosted`), as
    tritonserver's ``--allow-vertex-ai`` serves them; the defaults come from the AIP_*
    variables Vertex AI sets in a custom container."""

    triton_name, started_as = "Vertex AI", "VertexAi"

    @dataclasses.dataclass
    class Options:
        address: str = "0.0.0.0"
        port: int = dataclasses.field(default_factory=lambda: _env_port("AIP_HTTP_PORT", 8080))
        health_route: str = dataclasses.field(default_factory=lambda: os.environ.get("AIP_HEALTH_ROUTE", ""))
        predict_route: str = dataclasses.field(default_factory=lambda: os.environ.get("AIP_PREDICT_ROUTE", ""))
        # The predict route's model; None: the one loaded model (there must be one only).
        default_model: str | None = None
        max_input_size: int = 64 * _MIB
        allow_client_shm: bool = False

        def __post_init__(self) -> None:
            _check_field_types(self)
            _check_port(self.port)
            _check_positive("max_input_size", self.max_input_size)
            if not self.predict_route:
                raise InvalidArgumentError("predict_route (AIP_PREDICT_ROUTE) is not set for the Vertex AI endpoint")
            if not self.health_route:
                raise InvalidArgumentError("health_route (AIP_HEALTH_ROUTE) is not set for the Vertex AI endpoint")

    async def _start(self) -> int:
        options = self.options
        loaded = sorted({row["name"] for row in await self.server.engine.repository_index(ready=True)})
        model = vertex_model(options.default_model, loaded)
        return await self._listen(VertexAiApi(self._kserve_api(), model, options.health_route, options.predict_route))


def _env_port(variable: str, default: int) -> int:
    text = os.environ.get(variable, "")
    try:
        return int(text) if text else default
    except ValueError:
        raise InvalidArgumentError(f"{variable} '{text}' is not a port number") from None


class GrpcCompressionLevel(enum.IntEnum):
    NONE = 0
    LOW = 1
    MED = 2
    HIGH = 3
    COUNT = 4


class KServeGrpc(Service):
    triton_name, started_as = "GRPC", "GRPCInferenceService"

    Grpc_compression_level = GrpcCompressionLevel

    @dataclasses.dataclass
    class Options:
        address: str = "0.0.0.0"
        port: int = 8001
        reuse_port: bool = False
        use_ssl: bool = False
        server_cert: str = ""
        server_key: str = ""
        root_cert: str = ""
        use_mutual_auth: bool = False
        keepalive_time_ms: int = 7_200_000
        keepalive_timeout_ms: int = 20_000
        keepalive_permit_without_calls: bool = False
        http2_max_pings_without_data: int = 2
        http2_min_recv_ping_interval_without_data_ms: int = 300_000
        http2_max_ping_strikes: int = 2
        max_connection_age_ms: int = 0
        max_connection_age_grace_ms: int = 0
        infer_compression_level: int | GrpcCompressionLevel = GrpcCompressionLevel.NONE
        infer_thread_count: int = 2
        infer_allocation_pool_size: int = 8
        max_response_pool_size: int = 2_147_483_647
        forward_header_pattern: str = ""
        # dlserve: explicit message-size limit, --allow-client-shm, --grpc-restricted-protocol,
        # --grpc-max-connections (0: a quarter of the descriptor limit, at most 16384),
        # --grpc-message-timeout
        # (seconds a request message begun may go without a byte; 0: no limit)
        max_message_size: int = 2**31 - 1  # (tritonserver's: INT32_MAX)
        allow_client_shm: bool = False
        restricted_protocols: list[str] = dataclasses.field(default_factory=list)
        max_connections: int = 0
        message_timeout: int = int(REQUEST_TIMEOUT)

        def __post_init__(self) -> None:
            _check_field_types(self)
            _check_port(self.port)
            for name in (
                "keepalive_time_ms",
                "keepalive_timeout_ms",
                "http2_max_pings_without_data",
                "http2_min_recv_ping_interval_without_data_ms",
                "http2_max_ping_strikes",
                "max_connection_age_ms",
                "max_connection_age_grace_ms",
                "infer_allocation_pool_size",
                "max_response_pool_size",
                "max_connections",
                "message_timeout",
            ):
                _check_non_negative(name, getattr(self, name))
            _check_positive("infer_thread_count", self.infer_thread_count)
            _check_positive("max_message_size", self.max_message_size)
            _check_pattern("forward_header_pattern", self.forward_header_pattern)
            try:
                self.infer_compression_level = int(GrpcCompressionLevel(self.infer_compression_level))
            except ValueError:
                raise InvalidArgumentError(
                    f"infer_compression_level must be 0-4, got {self.infer_compression_level!r}"
                ) from None
            self._restrictions = Restriction.parse_all(self.restricted_protocols, "protocol")
            if self.use_ssl and not (self.server_cert and self.server_key):
                raise InvalidArgumentError("use_ssl needs server_cert and server_key")
            if self.use_mutual_auth and not self.root_cert:
                raise InvalidArgumentError("use_mutual_auth needs root_cert")

    def __init__(self, server: Server, options: KServeGrpc.Options | None = None) -> None:
        super().__init__(server, options)
        self._grpc: Any = None

    async def _start(self) -> int:
        # Imported here: grpc costs ~150 ms to import and HTTP-only servers never need it.
        from dlserve.frontends.grpc_server import GrpcServer

        options = self.options
        self._grpc = GrpcServer(DataPlane(self.server.engine, allow_client_shm=options.allow_client_shm), options)
        return await self._grpc.start()

    async def _stop(self, grace: float) -> None:
        if self._grpc is not None:
            await self._grpc.stop(grace)
            self._grpc = None


class Metrics(Service):
    triton_name, started_as = "Metrics", "Metrics Service"

    @dataclasses.dataclass
    class Options:
        address: str = "0.0.0.0"
        port: int = 8002
        thread_count: int = 1  # accepted for compatibility

        def __post_init__(self) -> None:
            _check_field_types(self)
            _check_port(self.port)
            _check_positive("thread_count", self.thread_count)

    def __init__(self, server: Server, options: Metrics.Options | None = None) -> None:
        super().__init__(server, options)
        self._http: Any = None

    async def _start(self) -> int:
        from dlserve.frontends.metrics import (
            MetricsEndpoint,  # loaded only where metrics are served
        )

        settings = self.server.options
        if not settings.metrics:
            raise UnsupportedError("metrics are disabled (Options.metrics is False)")
        self._http = MetricsEndpoint(self.server.engine, cpu=settings.cpu_metrics, gpu=settings.gpu_metrics)
        return await self._http.start(self.options.address, self.options.port)

    async def _stop(self, grace: float) -> None:
        if self._http is not None:
            await self._http.stop(grace)
            self._http = None


__all__ = ["KServeGrpc", "KServeHttp", "Metrics", "SageMaker", "VertexAi"]
