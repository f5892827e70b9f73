"""A loaded model version: its config, instances, scheduler and statistics."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import weakref
from pathlib import Path
from typing import Any

from dlserve.engine import config as cfg
from dlserve.engine import config_forms, ensemble, inline_offers, warmup
from dlserve.engine.backends import DEFAULT_BACKEND_DIRECTORY
from dlserve.engine.batcher import DynamicBatcher
from dlserve.engine.calls import Host
from dlserve.engine.custom_metrics import CustomMetrics
from dlserve.engine.instance import ModelInstance
from dlserve.engine.proto import model_config_pb2 as mc
from dlserve.engine.rate_limiter import RateLimiter
from dlserve.engine.repository import UploadFolder
from dlserve.engine.request import Request, Signature
from dlserve.engine.response_cache import ResponseCache
from dlserve.engine.scheduler import DefaultScheduler, Scheduler
from dlserve.engine.sequence import SequenceBatcher
from dlserve.engine.statistics import ModelStatistics
from dlserve.errors import TritonError
from dlserve.ipc.environments import Environments, ExecutionEnvironment
from dlserve.memory.arena import Arena, MemorySpace
from dlserve.memory.cuda_regions import IpcTable
from dlserve.memory.dtypes import DataType

log = logging.getLogger("dlserve.engine")
_LOADS = itertools.count(1)

_KIND_NAMES = {
    mc.ModelInstanceGroup.KIND_CPU: "CPU",
    mc.ModelInstanceGroup.KIND_GPU: "GPU",
    mc.ModelInstanceGroup.KIND_MODEL: "MODEL",
}


@dataclasses.dataclass
class EngineResources:
    """What every model instance shares: the server's memory and naming."""

    space: MemorySpace
    arena: Arena
    segment_prefix: str
    worker_arena_bytes: int  # a worker's first shared-memory segment
    worker_arena_growth_bytes: int  # each segment it adds when that is full
    busy_poll_us: int  # see dlserve.ipc.polling
    load_timeout: float  # seconds a worker may take to start an instance; 0: no limit
    custom_metrics: CustomMetrics
    host: Host  # the engine, for the calls models make (BLS, model control)
    environments: Environments  # EXECUTION_ENV_PATH environments, unpacked once
    gpu_count: int = 0
    cuda_regions: IpcTable | None = None  # clients' CUDA regions, which workers are referred into
    backend_directory: str = DEFAULT_BACKEND_DIRECTORY  # where Python-based backends are
    serial: int = 0
    response_cache: ResponseCache | None = None  # the server's, if it has one
    rate_limiter: RateLimiter | None = None  # with --rate-limit=execution_count
    latency_summaries: bool = False  # statistics keep the samples of --metrics-config summary_latencies
    # Per model name, the instances whose workers were told they may run it themselves
    # (dlserve.engine.inline_offers), until a version of it loads or unloads.
    inline_callers: dict[str, weakref.WeakSet[ModelInstance]] = dataclasses.field(default_factory=dict)

    def next_serial(self) -> int:
        self.serial += 1
        return self.serial


class ModelVersion:
    """One version of one model, from load to unload."""

    def __init__(
        self,
        name: str,
        version: int,
        config: mc.ModelConfig,
        model_dir: Path,
        resources: EngineResources,
        namespace: str = "",
        backend_file: Path | None = None,
        upload: UploadFolder | None = None,
    ) -> None:
        self.name = name
        self.namespace = namespace  # its repository as given, with model namespacing
        self.version = version
        self.config = config
        self.config_json = config_forms.to_json(config)
        self.model_dir = model_dir
        self.model_file = model_dir / str(version) / (config.default_model_filename or cfg.DEFAULT_MODEL_FILENAME)
        # what its workers import: that file, or its Python-based backend's (dlserve.engine.backends)
        self.code_file = backend_file or self.model_file
        self.resources = resources
        self.stats = ModelStatistics(name, version, resources.latency_summaries)
        self.signature = Signature(config)
        self.decoupled = bool(config.model_transaction_policy.decoupled)
        self.output_names = self.signature.output_names
        self.instances: list[ModelInstance] = []  # those the schedulers give work to
        # Instances an instance_group update removed, until they are stopped (see
        # update_instances): each with the task that retires it.
        self.retiring: dict[ModelInstance, asyncio.Task[None]] = {}
        self._finalizing: set[ModelInstance] = set()  # retiring ones being stopped now
        self._adding: list[ModelInstance] = []  # an update's instances, while they start
        self.generation = next(_LOADS)  # tells this load from earlier ones of the same version
        # Where its responses are cached, if the server has a cache and its config asks.
        self.cache = resources.response_cache if config.response_cache.enable else None
        self.is_ensemble = config.platform == cfg.ENSEMBLE_PLATFORM
        self.scheduler: Scheduler
        if self.is_ensemble:
            self.scheduler = ensemble.EnsembleScheduler(self)
        elif config.HasField("sequence_batching"):
            self.scheduler = SequenceBatcher(self)
        elif config.HasField("dynamic_batching"):
            self.scheduler = DynamicBatcher(self)
        else:
            self.scheduler = DefaultScheduler(self)
        self.state = "LOADING"
        self.reason = ""
        self.environment: ExecutionEnvironment | None = None  # the Python its workers run in
        self.warmup_samples: list[warmup.Sample] = []  # run by each instance before it serves
        self._upload = upload  # the uploaded files it is loaded from, held until it unloads
        if upload is not None:
            upload.hold()

    @property
    def ready(self) -> bool:
        if self.is_ensemble:  # no instances of its own
            return self.state == "READY"
        return self.state == "READY" and any(instance.ready for instance in self.instances)

    async def check_ready(self) -> bool:
        """Readiness including the models' own ``is_ready()`` hooks."""
        if not self.ready:
            return False
        if self.is_ensemble:  # ready when every step's model is
            steps = {(s.model, s.version, s.namespace) for s in ensemble.steps_of(self.config)}
            host = self.resources.host
            return all(await asyncio.gather(*(host.model_ready(*step) for step in steps)))
        checks = await asyncio.gather(*(i.check_ready() for i in self.instances if i.ready))
        return any(checks)

    @property
    def all_instances(self) -> list[ModelInstance]:
        """Its instances, and those an instance_group update removed that still run."""
        return [*self.instances, *self.retiring]

    @property
    def pending(self) -> int:
        """Requests not executing yet: queued, or sent to a worker behind another execute."""
        waiting_in_workers = sum(max(0, i.in_flight - 1) for i in self.all_instances)
        return self.scheduler.pending + waiting_in_workers

    @property
    def requests_in_flight(self) -> int:
        """Requests queued or open in a worker (executing, or streaming responses)."""
        return self.scheduler.pending + sum(len(i.open_requests(None)) for i in self.all_instances)

    def unready_reason(self) -> str:
        """Why a loaded version has no ready instance (workers died, restarting)."""
        reasons = "; ".join(i.last_error for i in self.instances if i.last_error)
        return "no ready instance" + (f": {reasons}" if reasons else "")

    def batch_size_of(self, request: Request) -> int:
        if self.config.max_batch_size <= 0 or not request.inputs:
            return 1
        return next(iter(request.inputs.values())).shape[0]

    def _instance_plan(self, config: mc.ModelConfig | None = None) -> list[tuple[str, str, int, mc.ModelInstanceGroup]]:
        """(instance name, kind, device id, its group) for every instance the config (its
        own, unless given) asks for."""
        plan = []
        for group in (config or self.config).instance_group:
            devices = list(group.gpus) if group.kind == mc.ModelInstanceGroup.KIND_GPU else [0]
            kind = _KIND_NAMES.get(group.kind, "CPU")
            for device in devices:
                for index in range(group.count):
                    suffix = f"_{index}_{device}" if len(devices) > 1 else f"_{index}"
                    plan.append((f"{group.name}{suffix}", kind, device, group))
        return plan

    async def load(self) -> None:
        """Start and warm up every instance; if any fails, stop the others and raise its error."""
        resources = self.resources
        if self.is_ensemble:
            self.state, self.reason = "READY", ""
            return
        try:
            self.warmup_samples = warmup.samples(self)  # checked before any worker starts
            self.environment = await resources.environments.for_model(
                *cfg.environment_parameters(self.config), self.model_dir, self.name
            )
        except TritonError as exc:
            self.state, self.reason = "UNAVAILABLE", str(exc)
            raise
        plan = self._instance_plan()
        self.instances = [self._new_instance(name, kind, device, group) for name, kind, device, group in plan]
        limiter = resources.rate_limiter
        if limiter is not None:
            try:
                for instance, (_, _, device, group) in zip(self.instances, plan):
                    limiter.register(instance, group.rate_limiter, device)
            except TritonError as exc:
                self._leave_limiter()
                self.state, self.reason = "UNAVAILABLE", str(exc)
                raise
        results = await asyncio.gather(
            *(instance.start() for instance in self.instances), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(i.stop(time.monotonic() + 5.0) for i in self.instances))
            self._leave_limiter()
            self.state, self.reason = "UNAVAILABLE", str(errors[0])
            raise errors[0]
        self.state, self.reason = "READY", ""
        inline_offers.drop(self)  # (callers running an older version go to the server again)

    def _new_instance(self, name: str, kind: str, device: int, group: mc.ModelInstanceGroup) -> ModelInstance:
        instance = ModelInstance(
            self, name, kind, device, self.resources.next_serial(), self._instance_changed, group.passive
        )
        instance.signature = instance_signature(group, device)
        return instance

    async def update_instances(self, config: mc.ModelConfig, drain_timeout: float) -> None:
        """Apply a config that differs from this version's only in ``instance_group``,
        as Triton does, without reloading the version: it stays READY throughout, the
        instances the new config still asks for go on as they are (their workers, their
        state), only the added ones start (``initialize``, warmup) and the removed ones
        stop (``finalize``).

        An instance is kept for a new one with the same settings (kind, device, passive,
        rate limiter, ...: the group but its name and count, Triton's rule), so a renamed
        group keeps its instances and their names; of several alike the first ones stay
        (Triton keeps the last made, and names a new one after its place in the group even
        where a kept one has that name; here a new one takes the first free name). The
        removed instances get no more work at once; each finishes what it runs (decoupled
        responses included, by ``drain_timeout`` seconds) and is then finalized, and this
        returns when they are, as Triton's load does. One that holds sequences (sequence
        batcher) runs them to their end (END, or idle) first, as in Triton, and this does
        not wait for that. If an added instance fails to start, nothing changes: the
        others stop again and its error is raised."""
        plan = self._instance_plan(config)
        alike: dict[bytes, list[ModelInstance]] = {}
        for instance in self.instances:
            alike.setdefault(instance.signature, []).append(instance)
        chosen: list[ModelInstance | None] = []
        for _name, _kind, device, group in plan:
            pool = alike.get(instance_signature(group, device))
            chosen.append(pool.pop(0) if pool else None)
        removed = [instance for pool in alike.values() for instance in pool]
        # (one removed that outlives this update, to end its sequences, keeps its name)
        outliving = [*self.retiring, *(i for i in removed if self.scheduler.holds(i))]
        names = {instance.name for instance in [*chosen, *outliving] if instance is not None}
        added: list[ModelInstance] = []
        for index, (name, kind, device, group) in enumerate(plan):
            if chosen[index] is None:
                name = name if name not in names else _free_name(group, device, names)
                instance = self._new_instance(name, kind, device, group)
                names.add(instance.name)
                chosen[index] = instance
                added.append(instance)
        limiter = self.resources.rate_limiter
        registered: list[ModelInstance] = []
        try:
            if limiter is not None:
                for instance in added:
                    limiter.register(instance, _group_of(plan, chosen, instance).rate_limiter, instance.device_id)
                    registered.append(instance)
            self._adding = added
            try:
                results = await asyncio.gather(*(instance.start() for instance in added), return_exceptions=True)
                errors = [r for r in results if isinstance(r, BaseException)]
                if errors:
                    await asyncio.gather(*(i.stop(time.monotonic() + 5.0) for i in added))
            except BaseException:  # cancelled (starting them, or stopping them): those started end
                for instance in added:
                    instance.kill()
                raise
            finally:
                self._adding = []
            if errors:
                raise errors[0]
        except BaseException:
            if limiter is not None:
                for instance in registered:
                    limiter.unregister(instance)
            raise
        self.config = config
        self.config_json = config_forms.to_json(config)
        self.instances = [instance for instance in chosen if instance is not None]
        held = set()
        for instance in removed:
            if self.scheduler.holds(instance):
                held.add(instance)
            self.retiring[instance] = asyncio.get_running_loop().create_task(
                self._retire_instance(instance, drain_timeout)
            )
        if added or removed:
            log.info(
                "model '%s' version %d: instance_group updated in place (started: %s; stopping: %s)",
                self.name, self.version,
                ", ".join(i.name for i in added) or "none", ", ".join(i.name for i in removed) or "none",
            )
        self.scheduler.instance_state_changed()  # the added ones take queued work (sequences too)
        waited = [self.retiring[i] for i in removed if i not in held]
        if waited:
            await asyncio.wait(waited)

    async def _retire_instance(self, instance: ModelInstance, drain_timeout: float) -> None:
        """Stop an instance an instance_group update removed, once the sequences it holds
        have ended and what it executes (or streams) is done, or ``drain_timeout`` after."""
        try:
            while self.scheduler.holds(instance) and self.state == "READY":
                await asyncio.sleep(0.05)
            deadline = time.monotonic() + drain_timeout
            while (instance.in_flight or instance.open_requests(None)) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            self._finalizing.add(instance)
            # (finalize gets time of its own: a drain that used up the timeout must not
            # turn the finalize the load promises into a kill)
            await instance.stop(max(deadline, time.monotonic() + drain_timeout))
        finally:
            self._finalizing.discard(instance)
            self.retiring.pop(instance, None)
            self.scheduler.forget(instance)
            limiter = self.resources.rate_limiter
            if limiter is not None:
                limiter.unregister(instance)

    def _leave_limiter(self) -> None:
        limiter = self.resources.rate_limiter
        if limiter is not None:
            for instance in self.instances:
                limiter.unregister(instance)

    def _instance_changed(self, _instance: ModelInstance) -> None:
        self.scheduler.instance_state_changed()

    def begin_unload(self) -> None:
        """Take no more requests (the rest is :meth:`unload`'s)."""
        self.state = "UNLOADING"
        inline_offers.drop(self)

    async def unload(self, deadline: float) -> bool:
        """Stop taking requests, let in-flight ones finish and stop the workers, all by
        ``deadline`` (``time.monotonic()``); whether every request finished and every
        worker ended (a finalize that never returns counts as Triton's live model)."""
        served = self.state != "UNAVAILABLE"  # (not one that failed to load, or went already)
        self.begin_unload()
        drained = await self.scheduler.drain(max(0.0, deadline - time.monotonic()))
        if not drained:
            log.warning(
                "model '%s' version %d still had requests in flight at its unload deadline",
                self.name,
                self.version,
            )
        # Instances an instance_group update removed: those still waiting to stop stop
        # here, with the rest, by the same deadline; those stopping already, on their own.
        retiring = [(i, task, i in self._finalizing) for i, task in self.retiring.items()]
        for _, task, finalizing in retiring:
            if not finalizing:
                task.cancel()
        await asyncio.gather(*(task for _, task, _ in retiring), return_exceptions=True)
        instances = [*self.instances, *(i for i, _, finalizing in retiring if not finalizing)]
        ended = await asyncio.gather(*(instance.stop(deadline) for instance in instances))
        self._leave_limiter()
        if self.cache is not None:
            self.cache.forget(self.generation)
        self.scheduler.close()
        self.stats.ended = True
        self.state, self.reason = "UNAVAILABLE", "unloaded"
        self._release_upload()
        if served:
            log.info("successfully unloaded '%s' version %d", self.name, self.version)
        return drained and all(ended)

    def abandon(self) -> None:
        """Its load was cancelled (a poll the server's stop cancelled, say): the workers
        that started end at once, and what it holds goes, as an unload's would."""
        self.kill()
        self._leave_limiter()
        self.scheduler.close()
        self.state, self.reason = "UNAVAILABLE", "load cancelled"
        self._release_upload()

    def _release_upload(self) -> None:
        upload, self._upload = self._upload, None
        if upload is not None:
            upload.release()

    def kill(self) -> None:
        for instance in [*self.all_instances, *self._adding]:
            instance.kill()

    def metadata(self) -> dict[str, Any]:
        batching = self.config.max_batch_size > 0

        def tensor(t: Any) -> dict[str, Any]:
            shape = [int(d) for d in t.dims]
            return {
                "name": t.name,
                "datatype": DataType(t.data_type).wire_name,
                "shape": ([-1] + shape) if batching else shape,
            }

        return {
            "name": self.name,
            "versions": [str(self.version)],
            "platform": self.config.platform or self.config.backend,
            "inputs": [tensor(t) for t in self.config.input],
            "outputs": [tensor(t) for t in self.config.output],
        }


def instance_signature(group: mc.ModelInstanceGroup, device: int) -> bytes:
    """What makes instances alike for an instance_group update (Triton's rule): their
    device and their group's settings but its name and count."""
    settings = mc.ModelInstanceGroup()
    settings.CopyFrom(group)
    settings.ClearField("name")
    settings.ClearField("count")
    return device.to_bytes(4, "little", signed=True) + settings.SerializeToString(deterministic=True)


def _free_name(group: mc.ModelInstanceGroup, device: int, taken: set[str]) -> str:
    """The first of the group's instance names (``<group>_<index>``, with ``_<device>``
    for a group on several GPUs) that no instance has."""
    several = group.kind == mc.ModelInstanceGroup.KIND_GPU and len(group.gpus) > 1
    index = 0
    while True:
        name = f"{group.name}_{index}_{device}" if several else f"{group.name}_{index}"
        if name not in taken:
            return name
        index += 1


def _group_of(plan: list[Any], chosen: list[Any], instance: ModelInstance) -> mc.ModelInstanceGroup:
    return next(group for (_, _, _, group), one in zip(plan, chosen) if one is instance)
