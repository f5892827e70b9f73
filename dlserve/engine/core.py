"""The engine: every server operation, as async methods on one event loop.

Frontends (HTTP, gRPC) and the in-process :class:`dlserve.Server` all drive this
one class; it knows nothing about transports. Everything except :meth:`prepare`
and :meth:`share` must be called on the engine's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import glob
import logging
import os
import re
import time
import uuid
from typing import Any

import numpy as np

import dlserve
from dlserve.engine.backends import DEFAULT_BACKEND_DIRECTORY
from dlserve.engine.custom_metrics import APPLICATION, CustomMetrics
from dlserve.engine.logs import LogSettings
from dlserve.engine.manager import ModelControlMode, ModelManager
from dlserve.engine.metrics_settings import MetricsSettings
from dlserve.engine.model import EngineResources, ModelVersion
from dlserve.engine.rate_limiter import RateLimiter, RateLimiterResource
from dlserve.engine.repository import Repository
from dlserve.engine.request import Request, validate_request
from dlserve.engine.response_cache import ResponseCache
from dlserve.engine.shutdown_log import ShutdownLog
from dlserve.engine.tracing import Tracer, TraceSettings
from dlserve.errors import (
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    TritonError,
    UnavailableError,
)
from dlserve.ipc.environments import Environments
from dlserve.ipc.polling import close_loop_poller, loop_poller
from dlserve.ipc.supervisor import unlink_segments
from dlserve.ipc.tensors import INLINE_MAX
from dlserve.memory import cuda
from dlserve.memory.arena import Arena, MemorySpace
from dlserve.memory.cuda_regions import CudaRegions
from dlserve.memory.dtypes import DataType
from dlserve.memory.regions import SystemRegions
from dlserve.memory.shm import SHM_DIR, abandoned, hold_prefix
from dlserve.memory.tensor import MemoryType, Tensor, allocation_size

log = logging.getLogger("dlserve.engine")

SEGMENT_NAMESPACE = "dlserve_"  # reserved: clients may never register a region here
EXTENSIONS = [  # Triton's order; cuda_shared_memory only where a GPU is (see metadata)
    "classification",
    "sequence",
    "model_repository",
    "model_repository(unload_dependents)",
    "schedule_policy",
    "model_configuration",
    "system_shared_memory",
    "cuda_shared_memory",
    "binary_tensor_data",
    "parameters",
    "statistics",
    "trace",
    "logging",
]
_MIB = 1 << 20
# (Triton 2.51's words)
_STOPPING = "Server is stopping, scheduler for model has stopped accepting new inference requests"


@dataclasses.dataclass
class EngineSettings:
    model_repositories: list[str]
    server_id: str = "dlserve"
    control_mode: ModelControlMode = ModelControlMode.NONE
    startup_models: list[str] = dataclasses.field(default_factory=list)
    auto_complete: bool = True
    strict_readiness: bool = True
    exit_on_error: bool = True
    exit_timeout: float = 30.0
    poll_interval: float = 15.0
    arena_bytes: int = 64 * _MIB
    worker_arena_bytes: int = 16 * _MIB
    worker_arena_growth_bytes: int = 16 * _MIB
    busy_poll_us: int = 1000
    model_config_name: str = ""
    backend_directory: str = DEFAULT_BACKEND_DIRECTORY  # where Python-based backends are
    model_load_retry_count: int = 0
    model_load_timeout: float = 0.0  # seconds an instance may take to start; 0: no limit
    model_load_thread_count: int = 4  # models loaded at once at startup and by repository polling
    model_namespacing: bool = False  # each repository a namespace: a name may be in several
    response_cache_bytes: int | None = None  # --cache-config local,size=<bytes>; None: no cache
    # --rate-limit=execution_count: the rate limiter's pool sizes (None: no rate limiter)
    rate_limit_resources: list[RateLimiterResource] | None = None
    without_effect: list[str] = dataclasses.field(default_factory=list)  # settings given, not acted on
    log: LogSettings = dataclasses.field(default_factory=LogSettings)
    trace: TraceSettings = dataclasses.field(default_factory=TraceSettings)
    metrics: MetricsSettings = dataclasses.field(default_factory=MetricsSettings)


def remove_stale_segments() -> None:
    """Unlink segments left by dlserve servers that died without cleaning up (SIGKILL,
    OOM, a container restarted with its pod's /dev/shm kept): those whose lock nobody
    holds any more (:func:`dlserve.memory.shm.hold_prefix`). Not by the pid in their
    name: a server sharing /dev/shm from another PID namespace (another container, with
    ``--ipc=host`` or in the same pod) has a pid this process cannot see, or its own."""
    pattern = re.compile(re.escape(SEGMENT_NAMESPACE) + r"\d+_[0-9a-f]{8}")
    prefixes = {
        match.group(0)
        for path in glob.glob(os.path.join(SHM_DIR, SEGMENT_NAMESPACE + "*"))
        if (match := pattern.match(os.path.basename(path)))
    }
    for prefix in prefixes:
        if abandoned(prefix):
            unlink_segments(prefix)


class Engine:
    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.space = MemorySpace()
        self.segment_prefix = f"{SEGMENT_NAMESPACE}{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self._prefix_lock: int | None = None  # held while its segments may exist
        self.arena: Arena | None = None
        self.environments = Environments()  # EXECUTION_ENV_PATH environments, shared by models
        self.manager: ModelManager | None = None
        self.gpu_count = 0  # (counted at start)
        self.custom_metrics = CustomMetrics(shared=APPLICATION)
        self.regions = SystemRegions(
            self.space, SEGMENT_NAMESPACE, on_forget=lambda name: self.segments_gone([name])
        )
        self.cuda_regions = CudaRegions(on_forget=self.segments_gone)
        self.tracer = Tracer(settings.trace, self._knows)
        size = settings.response_cache_bytes
        self.response_cache = ResponseCache(size) if size else None
        pools = settings.rate_limit_resources
        self.rate_limiter = RateLimiter(pools) if pools is not None else None
        self.live = False
        # Whether the network's new requests are taken: no longer once a shutdown began,
        # while those in flight (and the BLS calls they make) still finish.
        self.accepting = True
        self._shutdown_log: ShutdownLog | None = None
        self._stack_dump: asyncio.Future[None] | None = None  # (dump_worker_stacks)

    def _knows(self, name: str) -> bool:
        """Whether a model of this name is loaded (whose trace settings can be had)."""
        return self.manager is not None and any(
            entry.latest_loaded() is not None for entry in self.manager.models.named(name)
        )

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> list[str]:
        """Load models per the control mode; returns the load errors (see exit_on_error)."""
        s = self.settings
        if not s.model_repositories:
            raise InvalidArgumentError("Model repository must be specified.")
        s.log.start()
        for setting in s.without_effect:
            log.warning("%s has no effect in dlserve", setting)
        remove_stale_segments()
        self._prefix_lock = hold_prefix(self.segment_prefix)
        loop = asyncio.get_running_loop()

        def retired(name: str) -> None:  # (its last block may die on any thread)
            with contextlib.suppress(RuntimeError):  # (the loop is closed: so is every worker)
                loop.call_soon_threadsafe(self.segments_gone, [name])

        self.arena = Arena(
            self.space, f"{self.segment_prefix}_s", s.arena_bytes, s.arena_bytes, on_retire=retired
        )
        self.gpu_count = cuda.device_count()
        resources = EngineResources(
            space=self.space,
            arena=self.arena,
            segment_prefix=self.segment_prefix,
            worker_arena_bytes=s.worker_arena_bytes,
            worker_arena_growth_bytes=s.worker_arena_growth_bytes,
            busy_poll_us=s.busy_poll_us,
            load_timeout=s.model_load_timeout,
            custom_metrics=self.custom_metrics,
            host=self,
            environments=self.environments,
            gpu_count=self.gpu_count,
            cuda_regions=self.cuda_regions,
            backend_directory=s.backend_directory,
            response_cache=self.response_cache,
            rate_limiter=self.rate_limiter,
            latency_summaries=s.metrics.summary_latencies,
        )
        try:
            repository = Repository(s.model_repositories, s.model_config_name, s.model_namespacing)
            healthy = True
        except TritonError as exc:
            if s.exit_on_error:
                raise
            # As tritonserver with --exit-on-error=false: it answers on, neither live nor
            # ready, so that its health says what is wrong.
            log.error("%s", exc.message)
            repository = Repository([], s.model_config_name, s.model_namespacing)
            healthy = False
        self.manager = ModelManager(
            repository,
            resources,
            control_mode=s.control_mode,
            auto_complete=s.auto_complete,
            exit_timeout=s.exit_timeout,
            load_retries=s.model_load_retry_count,
            concurrent_loads=s.model_load_thread_count,
        )
        self._poller = loop_poller(asyncio.get_running_loop())
        self.live = healthy
        return await self.manager.start(s.startup_models, s.poll_interval)

    async def begin_stop(self, deadline: float) -> None:
        """A shutdown begins (a server's stop, before its services drain): the network's
        new requests are refused from now on, and what the stop waits for is logged."""
        self.accepting = False
        log.info("Waiting for in-flight requests to complete.")
        if self.manager is not None and self._shutdown_log is None:
            manager = self.manager
            self._shutdown_log = ShutdownLog(
                deadline, manager.versions_in_flight, manager.live_models
            )

    async def stop(self, deadline: float | None = None) -> bool:
        """Finish in-flight requests, finalize models and end workers by ``deadline``
        (``time.monotonic()``; default: ``exit_timeout`` from now); whether every
        request in flight finished and every worker ended in time."""
        self.live = False
        self.environments.cancel_builds()  # a pip run would hold the stop up for minutes
        if deadline is None:
            deadline = time.monotonic() + self.settings.exit_timeout
        drained = True
        try:
            if self.manager is not None:
                if self._shutdown_log is not None:
                    self._shutdown_log.unloading()
                try:
                    drained = await self.manager.stop(deadline)
                finally:
                    if self._shutdown_log is not None:
                        await self._shutdown_log.finish()
            await asyncio.sleep(0)  # traces let go in the last turn are written first
            self.tracer.close()
            self._release_memory()
        finally:
            close_loop_poller(asyncio.get_running_loop())
        return drained

    async def sequences_ended(self, deadline: float) -> None:
        """Wait, by ``deadline``, until no sequence is open; meanwhile (``accepting`` off)
        the requests that continue one are still taken, until it ends or idles out."""
        while time.monotonic() < deadline:
            open_now = [
                (version, count)
                for entry in (self.manager.models.values() if self.manager else [])
                for version in entry.versions.values()
                if (count := version.scheduler.open_sequences())
            ]
            if not open_now:
                return
            for version, count in open_now:  # (once a second, as Triton logs what it waits for)
                log.info(
                    "Model '%s' (version %d) has %d open sequences", version.name, version.version, count
                )
            await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def kill(self) -> None:
        """Stop without asking models to finalize (the loop is gone)."""
        self.live = False
        if self.manager is not None:
            self.manager.kill()
        self.tracer.close()
        self._release_memory()

    def instances(self) -> list[Any]:
        """Every model instance of every loaded version."""
        if self.manager is None:
            return []
        return [
            instance
            for entry in self.manager.models.values()
            for version in entry.versions.values()
            for instance in version.all_instances
        ]

    def dump_worker_stacks(self) -> None:
        """Every worker's Python stacks on the server's stderr, one worker after the
        other, each under a line that names it: what the models are doing (``kill -USR1``
        of ``dlserve serve``), loads still starting included. Called on the loop; a dump
        asked for while one is being written is that one."""
        if self._stack_dump is None or self._stack_dump.done():
            self._stack_dump = asyncio.ensure_future(self._dump_worker_stacks())

    async def _dump_worker_stacks(self) -> None:
        workers = [instance.worker for instance in self.instances()]
        for starting in list(self.manager.loader.starting) if self.manager is not None else []:
            if isinstance(starting, ModelVersion):
                workers += [instance.worker for instance in starting.all_instances]
            else:  # (an auto_complete_config's worker)
                workers.append(starting)
        for worker in workers:
            if worker is not None and worker.alive:
                title = f"Python stacks of '{worker.instance_name}' (pid {worker.pid}):\n"
                with contextlib.suppress(OSError):  # (the server's stderr may be gone)
                    os.write(2, title.encode())
                await worker.dump_stacks()

    def segments_gone(self, names: list[str]) -> None:
        """Segments that were unlinked (a client's unregistered region, one the server's
        arena or a worker retired, a gone worker's): every worker drops its mapping, or
        the memory would never be freed (called on the loop)."""
        for instance in self.instances():
            instance.forget_segments(names)

    def _release_memory(self) -> None:
        self.regions.unregister(force=True)
        self.cuda_regions.unregister(force=True)
        if self.arena is not None:
            self.arena.close()
        unlink_segments(self.segment_prefix)
        if self._prefix_lock is not None:
            os.close(self._prefix_lock)
            self._prefix_lock = None
        self.environments.close()

    # -- health and metadata -------------------------------------------------------------
    def ready(self) -> bool:
        if not (self.live and self.accepting) or self.manager is None:  # (stopping: not ready)
            return False
        return self.manager.models.all_ready() if self.settings.strict_readiness else True

    def metadata(self) -> dict[str, Any]:
        return {
            "name": self.settings.server_id,
            "version": dlserve.__version__,
            "extensions": [name for name in EXTENSIONS if name != "cuda_shared_memory" or self.gpu_count],
        }

    def model(self, name: str, version: int = -1, namespace: str | None = None) -> ModelVersion:
        """The version serving ``name``; ``namespace`` where an ensemble's step was
        resolved (model namespacing)."""
        if self.manager is None:
            raise NotFoundError(f"Request for unknown model: '{name}' is not found")
        return self.manager.models.version(name, version, namespace)

    async def model_ready(self, name: str, version: int = -1, namespace: str | None = None) -> bool:
        """Whether the version serves requests; asks the model's ``is_ready()`` if it has one."""
        try:
            model = self.model(name, version, namespace)
        except (NotFoundError, UnavailableError, InvalidArgumentError):  # unknown, failed, ambiguous
            return False
        return await model.check_ready()

    def model_metadata(self, name: str, version: int = -1) -> dict[str, Any]:
        """Triton's metadata: ``versions`` lists every ready version, or only the one asked for."""
        model = self.model(name, version)
        meta = model.metadata()
        assert self.manager is not None
        if version < 0:
            meta["versions"] = [str(v) for v in self.manager.models.ready_versions(name)] or meta["versions"]
        return meta

    def model_config(self, name: str, version: int = -1) -> dict[str, Any]:
        return self.model(name, version).config_json

    def statistics(self, name: str = "", version: int = -1, instances: bool = False) -> dict[str, Any]:
        """Triton's statistics extension; with ``instances`` (beyond Triton, so the network
        frontends leave it out) each version also lists its instances' state, so a worker
        restarting after a crash shows."""
        assert self.manager is not None
        if name:
            try:
                if version is not None and version >= 0:
                    models = [self.manager.models.version(name, version)]
                else:
                    entry = self.manager.models.find(name)
                    models = list(entry.versions.values()) if entry else []
            except (NotFoundError, UnavailableError, InvalidArgumentError):
                models = []  # (unknown, a version that failed, or ambiguous: model namespacing)
            if not models:
                entry = None
                with contextlib.suppress(InvalidArgumentError):
                    entry = self.manager.models.find(name)
                if version >= 0 and entry is not None and entry.versions:  # (it serves others)
                    raise InvalidArgumentError(f"requested model version is not available for model '{name}'")
                raise InvalidArgumentError(f"requested model '{name}' is not available")
        else:
            models = [
                m for e in self.manager.models.values() for m in e.versions.values() if m.ready
            ]
        models.sort(key=lambda m: (m.name, m.version))  # (Triton's order)
        return {"model_stats": [self._model_statistics(m, instances) for m in models]}

    @staticmethod
    def _model_statistics(model: ModelVersion, instances: bool) -> dict[str, Any]:
        stats = model.stats.as_dict()
        if instances:
            stats["instances"] = [instance.status() for instance in model.instances]
        return stats

    async def repository_index(self, ready: bool = False) -> list[dict[str, Any]]:
        assert self.manager is not None
        if not ready:  # the ready ones are loaded already: no need to ask the store
            await self.manager.refresh_repository(strict=False)
        return self.manager.index(ready)

    # -- model control -------------------------------------------------------------------
    async def register_repository(self, path: str, name_mapping: dict[str, str] | None = None) -> None:
        """Add a model repository (EXPLICIT mode); ``name_mapping`` serves some of its
        folders under other names: ``{folder: model name}``."""
        assert self.manager is not None
        await self.manager.register_repository(path, name_mapping)

    def unregister_repository(self, path: str) -> None:
        """Remove a model repository (on the loop); its loaded models keep serving."""
        assert self.manager is not None
        self.manager.unregister_repository(path)

    async def load(self, name: str, parameters: dict[str, Any] | None = None) -> None:
        """Load ``name``; ``parameters`` may carry ``config`` (JSON) and ``file:<path>`` bytes."""
        assert self.manager is not None
        parameters = dict(parameters or {})
        config = parameters.pop("config", None)
        files: dict[str, bytes] = {}
        for key, value in parameters.items():
            if not key.startswith("file:"):
                raise InvalidArgumentError(f"unrecognized load parameter '{key}'.")  # (Triton's words)
            if not isinstance(value, (bytes, bytearray)):
                raise InvalidArgumentError(f"load of model '{name}': '{key}' must be bytes")
            files[key[len("file:") :]] = bytes(value)
        if config is not None and not isinstance(config, str):
            raise InvalidArgumentError(f"load of model '{name}': 'config' must be a JSON string")
        try:
            await self.manager.load(name, config, files or None)
        except InternalError as exc:  # the model itself failed (initialize, worker): a bad load
            raise InvalidArgumentError(f"load failed for model '{name}': {exc.message}") from None

    async def unload(self, name: str, unload_dependents: bool = False, wait: bool = True) -> None:
        """See :meth:`ModelManager.unload`: without ``wait``, return once it began."""
        assert self.manager is not None
        await self.manager.unload(name, unload_dependents, wait)

    # -- inference -----------------------------------------------------------------------
    def prepare(self, request: Request, model: ModelVersion | None = None) -> ModelVersion:
        """Resolve (unless the caller did: ``model``) and validate a request. Safe from
        any thread; raises on bad input, and while the server stops (UNAVAILABLE, as
        Triton's: a request that continues an open sequence excepted, until it ends)."""
        if not self.live:
            raise UnavailableError(_STOPPING)
        if model is None:
            try:
                model = self.model(request.model_name, request.model_version)
            except (NotFoundError, UnavailableError):
                if self.live:
                    raise
                # The stop began since the check above (on a caller's thread): its unload,
                # not the request, is why the model is gone.
                raise UnavailableError(_STOPPING) from None
        validate_request(request, model.signature)
        if not self.accepting and not model.scheduler.continues(request):
            raise UnavailableError(_STOPPING)
        return model

    def submit(self, request: Request, sample: bool = True, model: ModelVersion | None = None) -> None:
        """Validate and queue a request (on the loop); responses go to ``on_response``.
        With ``sample`` False it is never picked for tracing: a request made for
        another (an ensemble's step) is traced only as a child of a traced one.
        ``model``: the version it is for, where the caller resolved it (an ensemble's
        step, in the ensemble's namespace)."""
        try:
            model = self.prepare(request, model)
        except TritonError:
            if request.trace is not None:
                request.trace.discard()
            raise
        self.enqueue(model, request, sample)

    def enqueue(self, model: ModelVersion, request: Request, sample: bool = True) -> None:
        """Queue a request :meth:`prepare` accepted (on the loop)."""
        trace = request.trace
        if trace is None and sample and self.tracer.enabled:
            trace = request.trace = self.tracer.start(
                model.name, request.request_id, request.trace_context
            )
        if trace is not None:
            trace.model_version = model.version
            trace.record("REQUEST_START", request.arrival_ns)
            trace.record("QUEUE_START")
            trace.record_tensors("TENSOR_QUEUE_INPUT", request.inputs)
        if sample:  # a client's: while more than one is answered, nobody polls
            request.from_client = True
            self._poller.request_started()
        model.scheduler.submit(request)

    def request_finished(self) -> None:
        """A client's request (one :meth:`enqueue` sampled) got its final response."""
        self._poller.request_finished()

    @staticmethod
    def cancel(request: Request) -> None:
        """Cancel a submitted request (on the loop): it is answered CANCELLED at once;
        a queued one never runs, an executing one's model sees ``is_cancelled()``."""
        if request.owner is not None:
            request.owner.cancel(request)

    def share(self, tensor: Tensor) -> Tensor:
        """The tensor in shared memory: itself if already there (or on a GPU: workers are
        sent GPU tensors through device memory), else a copy in the arena."""
        if tensor.memory_type is MemoryType.GPU:
            return tensor
        data = tensor.storage()
        if data.nbytes <= INLINE_MAX or self.arena is None or self.space.locate(data) is not None:
            return tensor  # tiny tensors travel inline to workers anyway
        view = np.frombuffer(self.arena.copy(data), dtype=np.uint8)
        if tensor.data_type is DataType.BYTES:
            return Tensor(tensor.data_type, tensor.shape, data=view)
        return Tensor(tensor.data_type, tensor.shape, data=view.view(data.dtype).reshape(tensor.shape))

    def allocate(self, shape: list[int], data_type: DataType) -> Tensor:
        """A new tensor in shared memory, for callers that fill it in place."""
        if self.arena is None:
            raise InvalidArgumentError("Server not started")
        if data_type is DataType.BYTES:
            raise InvalidArgumentError("BYTES tensors cannot be pre-allocated")
        anchor = self.arena.allocate(allocation_size(data_type, shape))
        data = np.frombuffer(anchor, dtype=data_type.storage_dtype).reshape(shape)
        return Tensor(data_type, shape, data=data)

