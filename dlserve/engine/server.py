"""The in-process API, modelled on Triton's ``tritonserver`` package.

``Server`` runs the :class:`Engine` on its own event loop in a background thread
(uvloop when installed), the way ``tritonserver`` runs Triton's C++ core. Calls
from user threads validate and copy inputs on the caller's thread and hand the
request to the loop; responses come back through a queue. Frontends run on the
same loop and call the engine directly, with no thread hop.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import enum
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

from dlserve.engine import prometheus
from dlserve.engine.core import Engine, EngineSettings
from dlserve.engine.logs import LogSettings
from dlserve.engine.manager import ModelControlMode
from dlserve.engine.metrics_settings import MetricsSettings
from dlserve.engine.rate_limiter import RateLimiterResource, parse_resource
from dlserve.engine.request import Request, Response
from dlserve.engine.response_cache import cache_size
from dlserve.engine.tracing import TraceSettings
from dlserve.errors import (
    InternalError,
    InvalidArgumentError,
    TritonError,
    UnavailableError,
    UnsupportedError,
)
from dlserve.memory.dtypes import DataType
from dlserve.memory.tensor import Tensor, is_host_memory

T = TypeVar("T")
_MIB = 1 << 20

# tritonserver.Options fields dlserve does not act on: refused when set where they would
# change what the server does, a warning where they only tune Triton's C++ core.
_REFUSED = ("host_policies", "model_load_device_limits", "repo_agent_directory")
_IGNORED = (
    "pinned_memory_pool_size", "cuda_memory_pool_sizes", "min_supported_compute_capability",
    "buffer_manager_thread_count", "model_load_thread_count", "enable_peer_access",
    "backend_directory", "cache_directory",
)


class RateLimitMode(enum.IntEnum):
    OFF = 0
    EXEC_COUNT = 1


class LogFormat(enum.IntEnum):
    DEFAULT = 0
    ISO8601 = 1


class MetricFormat(enum.IntEnum):
    PROMETHEUS = 0


class InstanceGroupKind(enum.IntEnum):
    AUTO = 0
    CPU = 1
    GPU = 2
    MODEL = 3


class ModelBatchFlag(enum.IntEnum):
    UNKNOWN = 1
    FIRST_DIM = 2


class ModelTxnPropertyFlag(enum.IntEnum):
    ONE_TO_ONE = 1
    DECOUPLED = 2


@dataclasses.dataclass
class Options:
    """Server options; names and defaults follow ``tritonserver.Options``.

    dlserve reads these Triton fields: model_repository, server_id,
    model_control_mode, startup_models, strict_model_config, exit_on_error,
    strict_readiness, exit_timeout, model_load_retry_count, model_namespacing
    (:mod:`dlserve.engine.manager`), rate_limiter_mode and
    rate_limiter_resources (``RateLimiterResource(name, count, device=None)`` or
    ``"NAME:COUNT[:DEVICE]"``), cache_config
    (``{"local": {"size": <bytes>}}``: the response cache), log_file,
    log_info/warn/error, log_verbose, metrics, cpu_metrics, gpu_metrics,
    metrics_interval (ms between refreshes of nv_cpu_*), metrics_configuration
    (``{"": {KEY: VALUE}}``, ``--metrics-config`` keys: :mod:`dlserve.engine.metrics_settings`), and
    ``backend_configuration["python"]`` keys ``shm-default-byte-size`` and
    ``shm-growth-byte-size`` (each worker's shared-memory arena). Of the rest,
    those that would change what the server does (``host_policies``,
    ``model_load_device_limits``, ``repo_agent_directory``) are
    refused when set, and the tuning knobs of Triton's C++ core are accepted with a
    warning that they do nothing here. ``model_config_name`` is tritonserver's
    ``--model-config-name`` (``<model>/configs/<name>.pbtxt`` where a model has
    one, else its config.pbtxt). dlserve's own: ``shm_arena_size`` sizes the
    server's arena for request inputs; ``repository_poll_secs`` sets the POLL period;
    ``busy_poll_us`` is the most the server and the models' workers poll for an
    expected message before they sleep (:mod:`dlserve.ipc.polling`; 0 = never);
    ``trace`` holds tritonserver's ``--trace-config`` settings (:mod:`dlserve.engine.tracing`).
    """

    model_repository: str | list[str] = dataclasses.field(default_factory=list)
    server_id: str = "dlserve"
    model_control_mode: ModelControlMode = ModelControlMode.NONE
    startup_models: list[str] = dataclasses.field(default_factory=list)
    strict_model_config: bool = False
    rate_limiter_mode: RateLimitMode = RateLimitMode.OFF
    rate_limiter_resources: list[Any] = dataclasses.field(default_factory=list)
    pinned_memory_pool_size: int = 1 << 28
    cuda_memory_pool_sizes: dict[int, int] = dataclasses.field(default_factory=dict)
    cache_config: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    cache_directory: str = ""
    min_supported_compute_capability: float = 6.0
    exit_on_error: bool = True
    strict_readiness: bool = True
    exit_timeout: int = 30
    buffer_manager_thread_count: int = 0
    model_load_thread_count: int = 4
    model_load_retry_count: int = 0
    model_namespacing: bool = False
    model_config_name: str = ""
    enable_peer_access: bool = True
    log_file: str | None = None
    log_info: bool = False
    log_warn: bool = False
    log_error: bool = False
    log_format: LogFormat = LogFormat.DEFAULT
    log_verbose: int = 0
    metrics: bool = True
    gpu_metrics: bool = True
    cpu_metrics: bool = True
    metrics_interval: int = 2000
    backend_directory: str = ""
    repo_agent_directory: str = ""
    model_load_device_limits: list[Any] = dataclasses.field(default_factory=list)
    backend_configuration: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    host_policies: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    metrics_configuration: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    shm_arena_size: int = 64 * _MIB
    repository_poll_secs: float = 15.0
    busy_poll_us: int = 1000
    trace: TraceSettings = dataclasses.field(default_factory=TraceSettings)

    def _without_effect(self) -> list[str]:
        """The fields set that dlserve ignores; raises for those it refuses."""
        defaults = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                    for f in dataclasses.fields(self)}
        for name in _REFUSED:
            if getattr(self, name) != defaults[name]:
                raise UnsupportedError(f"Options.{name} is not supported by dlserve")
        return [f"Options.{name}" for name in _IGNORED if getattr(self, name) != defaults[name]]

    def engine_settings(self) -> EngineSettings:
        without_effect = self._without_effect()
        repos = self.model_repository
        if repos is None:
            raise InvalidArgumentError("Model repository must be specified.")
        repositories = [repos] if isinstance(repos, str) else [str(r) for r in repos]
        python = self.backend_configuration.get("python", {})
        try:
            worker_bytes = int(python.get("shm-default-byte-size", 16 * _MIB))
        except ValueError:
            raise InvalidArgumentError("shm-default-byte-size must be an integer") from None
        if worker_bytes < _MIB:
            raise InvalidArgumentError("shm-default-byte-size must be at least 1 MiB")
        if self.exit_timeout < 0:
            raise InvalidArgumentError("exit_timeout must be >= 0")
        if self.model_load_retry_count < 0:
            raise InvalidArgumentError("model_load_retry_count must be >= 0")
        if not 0 <= self.busy_poll_us <= 10_000:
            raise InvalidArgumentError("busy_poll_us must be between 0 and 10000")
        self.trace.values()  # raises on a bad setting
        return EngineSettings(
            model_repositories=repositories,
            server_id=self.server_id,
            control_mode=ModelControlMode(self.model_control_mode),
            startup_models=list(self.startup_models),
            auto_complete=not self.strict_model_config,
            strict_readiness=self.strict_readiness,
            exit_on_error=self.exit_on_error,
            exit_timeout=float(self.exit_timeout),
            poll_interval=float(self.repository_poll_secs),
            arena_bytes=int(self.shm_arena_size),
            worker_arena_bytes=worker_bytes,
            busy_poll_us=int(self.busy_poll_us),
            model_config_name=self.model_config_name,
            model_load_retry_count=int(self.model_load_retry_count),
            model_namespacing=bool(self.model_namespacing),
            response_cache_bytes=cache_size(self.cache_config),
            rate_limit_resources=self._rate_limit_resources(),
            without_effect=without_effect,
            log=self.log_settings(),
            trace=self.trace,
            metrics=MetricsSettings.from_options(self.metrics_interval, self.metrics_configuration),
        )

    def _rate_limit_resources(self) -> list[RateLimiterResource] | None:
        """The rate limiter's explicit pool sizes; None when rate limiting is off."""
        if RateLimitMode(self.rate_limiter_mode) is RateLimitMode.OFF:
            return None
        pools = []
        for entry in self.rate_limiter_resources:
            if isinstance(entry, str):
                entry = parse_resource(entry)
            elif not isinstance(entry, RateLimiterResource):  # tritonserver's, or alike
                entry = RateLimiterResource(entry.name, int(entry.count), getattr(entry, "device", None))
            pools.append(entry)
        return pools

    def log_settings(self) -> LogSettings:
        """Triton's cascade: verbose implies info, info implies warnings; errors always log."""
        info = self.log_info or self.log_verbose > 0
        return LogSettings(
            log_file=self.log_file or "",
            log_info=info,
            log_warning=info or self.log_warn,
            log_error=True,
            log_verbose_level=int(self.log_verbose),
            log_format="ISO8601" if self.log_format == LogFormat.ISO8601 else "default",
        )


@dataclasses.dataclass
class InferenceRequest:
    """A request for :meth:`Model.infer`; fields follow ``tritonserver.InferenceRequest``.

    ``requested_output_names`` (dlserve's) limits the outputs returned.
    """

    model: Model
    request_id: str | None = None
    flags: int = 0
    correlation_id: int | str | None = None
    priority: int = 0
    timeout: int = 0
    inputs: dict[str, Any] = dataclasses.field(default_factory=dict)
    parameters: dict[str, str | int | bool | float] = dataclasses.field(default_factory=dict)
    output_memory_type: Any = None
    response_queue: Any = None
    requested_output_names: list[str] | None = None


@dataclasses.dataclass
class InferenceResponse:
    """One response; ``outputs`` are :class:`dlserve.Tensor` views of shared memory."""

    model: Model
    request_id: str = ""
    parameters: dict[str, Any] = dataclasses.field(default_factory=dict)
    outputs: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    error: TritonError | None = None
    classification_label: str | None = None
    final: bool = False


_PARAMETER_TYPES = (str, int, bool, float)


def _engine_request(request: InferenceRequest, deliver: Any) -> Request:
    inputs: dict[str, Tensor] = {}
    for name, value in request.inputs.items():
        try:
            inputs[name] = Tensor.from_object(value)
        except (TypeError, ValueError, BufferError) as exc:  # (tritonserver: InvalidArgumentError)
            raise InvalidArgumentError(f"input '{name}': {exc}") from None
    for key, value in request.parameters.items():
        if type(value) not in _PARAMETER_TYPES:
            raise InvalidArgumentError(
                f"Unsupported Value. Can't convert {type(value)} to Request Parameter ('{key}')"
            )
    if not is_host_memory(request.output_memory_type):
        raise InvalidArgumentError(
            f"output memory type {request.output_memory_type!r} is not supported without CUDA"
        )
    return Request(
        model_name=request.model.name,
        model_version=request.model.version,
        inputs=inputs,
        on_response=deliver,
        request_id=request.request_id or "",
        correlation_id=0 if request.correlation_id is None else request.correlation_id,
        flags=int(request.flags),
        priority=int(request.priority),
        timeout_us=int(request.timeout),
        parameters=dict(request.parameters),
        requested_outputs=(
            None if request.requested_output_names is None else list(request.requested_output_names)
        ),
    )


def _public(server: Server, response: Response) -> InferenceResponse:
    """The engine's response as the API gives it (to the iterator and a response_queue)."""
    return InferenceResponse(
        model=Model(server, response.model_name, response.model_version),
        request_id=response.request_id,  # ('' without one, as tritonserver's)
        parameters=response.parameters,
        outputs=response.outputs,
        error=response.error,
        final=response.final,
    )


class _Iterator:
    """Shared state of the sync and async response iterators."""

    def __init__(self, server: Server, model: Model, request: Request, raise_on_error: bool) -> None:
        self._server = server
        self._model = model
        self._request = request
        self._raise_on_error = raise_on_error
        self._done = False

    def _hand_out(self, response: InferenceResponse) -> InferenceResponse:
        self._done = response.final
        if response.error is not None and self._raise_on_error:
            raise response.error
        return response

    def cancel(self) -> None:
        """Cancel the request: the iterator ends with a CANCELLED response at once; a
        queued request never runs, an executing one's ``is_cancelled()`` turns True."""
        self._server._on_loop(Engine.cancel, self._request)


class ResponseIterator(_Iterator):
    def __init__(self, server: Server, model: Model, request: Request, raise_on_error: bool,
                 responses: queue.SimpleQueue[InferenceResponse]) -> None:
        super().__init__(server, model, request, raise_on_error)
        self._responses = responses

    def __iter__(self) -> Iterator[InferenceResponse]:
        return self

    def __next__(self) -> InferenceResponse:
        if self._done:
            raise StopIteration
        return self._hand_out(self._responses.get())


class AsyncResponseIterator(_Iterator):
    def __init__(self, server: Server, model: Model, request: Request, raise_on_error: bool,
                 responses: asyncio.Queue[InferenceResponse]) -> None:
        super().__init__(server, model, request, raise_on_error)
        self._responses = responses

    def __aiter__(self) -> AsyncIterator[InferenceResponse]:
        return self

    async def __anext__(self) -> InferenceResponse:
        if self._done:
            raise StopAsyncIteration
        return self._hand_out(await self._responses.get())


class Model:
    """A handle on a model (and version) of a started :class:`Server`."""

    def __init__(
        self,
        server: Server,
        name: str,
        version: int = -1,
        state: str | None = None,
        reason: str | None = None,
    ) -> None:
        server._engine_or_raise()
        self._server = server
        self.name = name
        self.version = version
        self.state = state
        self.reason = reason

    def create_request(self, **kwargs: Any) -> InferenceRequest:
        kwargs.pop("model", None)
        return InferenceRequest(model=self, **kwargs)

    def _start(self, request: InferenceRequest | None, kwargs: dict[str, Any], deliver: Any) -> Request:
        if request is None:
            request = self.create_request(**kwargs)
        engine = self._server._engine_or_raise()
        engine_request = _engine_request(request, deliver)
        for name, tensor in engine_request.inputs.items():
            engine_request.inputs[name] = engine.share(tensor)
        model = engine.prepare(engine_request)
        self._server._on_loop(engine.enqueue, model, engine_request)
        return engine_request

    def infer(
        self,
        inference_request: InferenceRequest | None = None,
        raise_on_error: bool = True,
        **kwargs: Any,
    ) -> ResponseIterator:
        """Run a request; iterate the returned object for its response(s).

        Bad requests (unknown model, wrong dtype or shape, ...) raise here; with
        ``raise_on_error`` an error response raises while iterating.
        """
        # A response_queue (tritonserver's) is where the responses go: the iterator reads it too.
        responses = self._response_queue(inference_request, kwargs, queue.SimpleQueue, "queue.SimpleQueue")
        server = self._server

        def deliver(response: Response) -> None:
            responses.put(_public(server, response))

        request = self._start(inference_request, kwargs, deliver)
        return ResponseIterator(self._server, self, request, raise_on_error, responses)

    @staticmethod
    def _response_queue(request: InferenceRequest | None, kwargs: dict[str, Any], kind: type, what: str) -> Any:
        given = request.response_queue if request is not None else kwargs.get("response_queue")
        if given is None:
            return kind()
        if not isinstance(given, kind):  # (tritonserver's words)
            iterator = "async response iterator" if kind is asyncio.Queue else "response iterator"
            raise InvalidArgumentError(f"{what} must be used for {iterator}")
        return given

    def async_infer(
        self,
        inference_request: InferenceRequest | None = None,
        raise_on_error: bool = True,
        **kwargs: Any,
    ) -> AsyncResponseIterator:
        """Like :meth:`infer`, for ``async for`` on the caller's running event loop."""
        loop = asyncio.get_running_loop()
        responses = self._response_queue(inference_request, kwargs, asyncio.Queue, "asyncio.Queue")
        server = self._server

        def deliver(response: Response) -> None:
            loop.call_soon_threadsafe(responses.put_nowait, _public(server, response))

        request = self._start(inference_request, kwargs, deliver)
        return AsyncResponseIterator(self._server, self, request, raise_on_error, responses)

    def metadata(self) -> dict[str, Any]:
        return self._server._call_sync(lambda e: e.model_metadata(self.name, self.version))

    def config(self, config_version: int = 1) -> dict[str, Any]:
        return self._server._call_sync(lambda e: e.model_config(self.name, self.version))

    def ready(self) -> bool:
        return self._server._run(self._server.engine.model_ready(self.name, self.version))

    def statistics(self) -> dict[str, Any]:
        """Triton's statistics for this model, plus an ``instances`` list per version
        (name, kind, device, state, pid, restarts, last error)."""
        return self._server._call_sync(lambda e: e.statistics(self.name, self.version, instances=True))

    def batch_properties(self) -> ModelBatchFlag:
        config = self.config()
        return ModelBatchFlag.FIRST_DIM if config.get("max_batch_size", 0) > 0 else ModelBatchFlag.UNKNOWN

    def transaction_properties(self) -> ModelTxnPropertyFlag:
        policy = self.config().get("model_transaction_policy") or {}
        return ModelTxnPropertyFlag.DECOUPLED if policy.get("decoupled") else ModelTxnPropertyFlag.ONE_TO_ONE

    def __repr__(self) -> str:
        return str({"name": self.name, "version": self.version, "state": self.state})

    __str__ = __repr__


class ModelDictionary(dict):  # type: ignore[type-arg]
    """``{(name, version): Model}``; indexing by a bare name returns a fresh Model."""

    def __init__(self, server: Server, models: dict[tuple[str, int], Model]) -> None:
        super().__init__(models)
        self._server = server

    def __getitem__(self, key: Any) -> Model:
        if isinstance(key, str):
            if any(name == key for name, _ in self.keys()):
                return Model(self._server, key)
            raise KeyError(f"Unknown Model: {key}")
        if key not in self.keys():
            raise KeyError(f"Unknown Model: {key}")
        return super().__getitem__(key)


class Server:
    """An in-process dlserve server: ``Server(Options(model_repository=...)).start()``."""

    def __init__(self, options: Options | None = None, **kwargs: Any) -> None:
        self.options = options if options is not None else Options(**kwargs)
        self._engine: Engine | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._services: list[Any] = []  # frontends running on our loop, stopped with us
        self._cpu = prometheus.CpuSampler()  # CPU use between calls of metrics()
        self._loading = False  # start() is loading the models

    # -- plumbing -----------------------------------------------------------------------
    def _engine_or_raise(self) -> Engine:
        if self._engine is None:
            raise InvalidArgumentError("Server not started")
        return self._engine

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The engine's event loop (frontends run their servers on it)."""
        if self._loop is None:
            raise InvalidArgumentError("Server not started")
        return self._loop

    @property
    def engine(self) -> Engine:
        return self._engine_or_raise()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def _call_sync(self, fn: Any) -> Any:
        """Run ``fn(engine)`` on the loop and return its result (or raise its error)."""
        engine = self._engine_or_raise()

        async def call() -> Any:
            return fn(engine)

        return self._run(call())

    def _on_loop(self, fn: Any, *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    # -- lifecycle ----------------------------------------------------------------------
    def start(
        self,
        wait_until_ready: bool = False,
        polling_interval: float = 0.1,
        timeout: float | None = None,
    ) -> Server:
        if self._engine is not None:
            raise InvalidArgumentError("Server already started")
        settings = self.options.engine_settings()
        loop = _new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="dlserve-engine", daemon=True)
        thread.start()
        engine = Engine(settings)
        self._engine, self._loop, self._thread = engine, loop, thread
        _LIVE_SERVERS.add(self)
        try:
            self._loading = True
            try:
                errors = self._run(engine.start())
            finally:
                self._loading = False
        except BaseException:
            self._shutdown()
            raise
        if errors and settings.exit_on_error:
            self._shutdown()
            raise InternalError("failed to load all models: " + "; ".join(errors))
        if wait_until_ready:
            deadline = None if timeout is None else time.monotonic() + timeout
            while not self.ready():
                if deadline is not None and time.monotonic() > deadline:
                    raise UnavailableError("Timeout before ready")
                time.sleep(polling_interval)
        return self

    @property
    def loading(self) -> bool:
        """Whether :meth:`start` is loading the models. An exception raised in its
        thread meanwhile (a signal handler's) makes it shut down what it started
        and raise it; at any other time, stop() is the way."""
        return self._loading

    def stop(self) -> bool:
        """Drain in-flight requests (up to ``exit_timeout``), finalize models, end workers.
        Returns whether every request in flight finished (False: the exit timeout
        expired and the rest were dropped; Triton's stop raises then)."""
        self._engine_or_raise()
        return self._shutdown()

    def _shutdown(self) -> bool:
        engine, loop, thread = self._engine, self._loop, self._thread
        if engine is None or loop is None:
            return True
        # One budget for the whole shutdown: the services drain, then the engine.
        deadline = time.monotonic() + engine.settings.exit_timeout
        for service in list(self._services):  # no new requests from the network first
            service.stop(deadline)
        try:
            return asyncio.run_coroutine_threadsafe(engine.stop(deadline), loop).result()
        finally:
            loop.call_soon_threadsafe(loop.stop)
            if thread is not None:
                thread.join()
            loop.close()
            self._engine = self._loop = self._thread = None
            _LIVE_SERVERS.discard(self)

    def _attach(self, service: Any) -> None:
        self._services.append(service)

    def _detach(self, service: Any) -> None:
        if service in self._services:
            self._services.remove(service)

    def _kill(self) -> None:
        """Interpreter exit without stop(): end workers, unlink segments."""
        if self._engine is not None:
            self._engine.kill()

    # -- queries ------------------------------------------------------------------------
    def live(self) -> bool:
        return self._call_sync(lambda e: e.live)

    def ready(self) -> bool:
        return self._call_sync(lambda e: e.ready())

    def metadata(self) -> dict[str, Any]:
        return self._call_sync(lambda e: e.metadata())

    def model(self, model_name: str, model_version: int = -1) -> Model:
        return Model(self, model_name, model_version)

    def models(self, exclude_not_ready: bool = False) -> ModelDictionary:
        rows = self._run(self._engine_or_raise().repository_index(exclude_not_ready))
        models = {}
        for row in rows:
            version = int(row["version"]) if "version" in row else -1
            models[(row["name"], version)] = Model(
                self, row["name"], version, row.get("state"), row.get("reason")
            )
        return ModelDictionary(self, models)

    def load(self, model_name: str, parameters: dict[str, Any] | None = None) -> Model:
        self._run(self._engine_or_raise().load(model_name, parameters))
        return self.model(model_name)

    def unload(
        self,
        model: str | Model,
        unload_dependents: bool = False,
        wait_until_unloaded: bool = False,
        polling_interval: float = 0.1,
        timeout: float | None = None,
    ) -> None:
        """Unload every version; unloading finishes before this returns in dlserve."""
        name = model.name if isinstance(model, Model) else model
        self._run(self._engine_or_raise().unload(name, unload_dependents))

    def register_model_repository(
        self, repository_path: str, name_mapping: dict[str, str] | None = None
    ) -> None:
        """Add a model repository (EXPLICIT mode); ``name_mapping`` serves some of its
        model folders under other names: ``{folder: model name}``. Its models load on
        request, like the others'."""
        self._run(self._engine_or_raise().register_repository(str(repository_path), name_mapping))

    def unregister_model_repository(self, repository_path: str) -> None:
        """Remove a model repository (EXPLICIT mode); its loaded models keep serving
        until they are unloaded."""
        self._call_sync(lambda engine: engine.unregister_repository(str(repository_path)))

    def metrics(self, metric_format: MetricFormat = MetricFormat.PROMETHEUS) -> str:
        """The metrics the metrics port serves, as Prometheus text."""
        if not self.options.metrics:
            raise UnsupportedError("metrics are disabled (Options.metrics is False)")
        if metric_format not in (MetricFormat.PROMETHEUS,):
            raise UnsupportedError(f"unsupported metric format {metric_format!r}")
        cpu = self._cpu if self.options.cpu_metrics else None
        gpu = self.options.gpu_metrics
        return self._call_sync(lambda engine: prometheus.render(engine, cpu, gpu))

    def poll_model_repository(self) -> None:
        engine = self._engine_or_raise()
        if engine.settings.control_mode is not ModelControlMode.POLL:
            raise UnavailableError("poll_model_repository needs model control mode POLL")
        assert engine.manager is not None
        self._run(engine.manager.poll())

    def allocate_tensor(self, shape: list[int] | tuple[int, ...], data_type: Any) -> Tensor:
        """A tensor in the server's shared memory, to fill in place (e.g. ``np.from_dlpack``).

        Passing it as an input costs no copy at all: the model reads it where it is.
        """
        dt = data_type if isinstance(data_type, DataType) else DataType.from_numpy(data_type)
        return self._engine_or_raise().allocate([int(d) for d in shape], dt)


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; stay usable without it
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


_LIVE_SERVERS: weakref.WeakSet[Server] = weakref.WeakSet()


@atexit.register
def _kill_live_servers() -> None:
    for server in list(_LIVE_SERVERS):
        server._kill()
