"""Loading models from their repositories' sources: each under its model's lock, its
config read, completed and checked, an ensemble's steps loaded first (explicit mode),
then its versions started and swapped in for those they replace."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path

from dlserve.engine import config as cfg
from dlserve.engine import config_forms, ensemble, ensemble_steps, load_errors
from dlserve.engine.auto_complete import run_auto_complete
from dlserve.engine.backends import PYTHON_BACKEND, backend_model_file
from dlserve.engine.instance_update import in_place, refused, update_instances
from dlserve.engine.model import EngineResources, ModelVersion
from dlserve.engine.model_table import ModelEntry, ModelTable
from dlserve.engine.proto import model_config_pb2 as mc
from dlserve.engine.repository import (
    ModelKey,
    ModelSource,
    Repository,
    UploadFolder,
    check_model_name,
    log_missing_versions,
    may_define_auto_complete,
    select_versions,
)
from dlserve.engine.unloading import Unloader
from dlserve.errors import (
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    TritonError,
    UnavailableError,
)
from dlserve.ipc.supervisor import WorkerProcess

log = logging.getLogger("dlserve.engine")


class Loader:
    """Loads into the manager's ``models``; ``explicit``: the model control mode is
    EXPLICIT (an ensemble's load loads its steps too)."""

    def __init__(
        self,
        repository: Repository,
        resources: EngineResources,
        models: ModelTable,
        unloader: Unloader,
        *,
        explicit: bool,
        auto_complete: bool,
        exit_timeout: float,
        load_retries: int,
        concurrent_loads: int,
    ) -> None:
        self.repository = repository
        self.resources = resources
        self.models = models
        self.unloader = unloader
        self.explicit = explicit
        self.auto_complete = auto_complete
        self.exit_timeout = exit_timeout
        self.load_retries = load_retries  # tries after a model's first failed start
        # Loads of the whole repository (startup, polling) run this many at a time, as
        # tritonserver's --model-load-thread-count: not one worker per model all at once.
        self._load_slots = asyncio.Semaphore(concurrent_loads)
        # What a load is starting (versions, auto-complete workers): ended at the stop deadline.
        self.starting: set[ModelVersion | WorkerProcess] = set()
        self.stopping = False  # the server stops: no load starts a worker (retries included)

    async def _fetch(self, name: str) -> list[ModelSource]:
        """The model's sources (with namespacing, one per repository that has it), its
        files brought from a remote repository first."""
        if self.repository.remote:
            return await asyncio.to_thread(self.repository.fetch, name)
        return self.repository.find(name)

    async def _fetch_source(self, source: ModelSource) -> ModelSource:
        """A listed source, its files brought from its remote repository first."""
        if source.stamps is not None:
            return await asyncio.to_thread(self.repository.fetch_source, source)
        return source

    async def load_in_turn(self, what: str | ModelSource) -> TritonError | None:
        """:meth:`load_guarded` in its turn among the repository's models. (Only for loads
        of the whole repository: a load this one starts, such as an ensemble's that
        waited for it, does not wait for a turn, so none waits for another's.)"""
        async with self._load_slots:
            return await self.load_guarded(what)

    async def load_guarded(self, what: str | ModelSource) -> TritonError | None:
        """Load a model by name, or from a source; its error, logged, rather than raised."""
        try:
            if isinstance(what, ModelSource):
                await self._load_source(await self._fetch_source(what))
            else:
                await self.load_named(what)
            return None
        except TritonError as exc:
            source = what if isinstance(what, ModelSource) else None
            name = what if source is None else source.name
            load_errors.log_load_failure(name, exc, source.namespace if source is not None else "")
            if not isinstance(exc, NotFoundError):  # listed as failed, with the reason
                listed = [key for key in self.repository.scan() if key[1] == name] or [("", name)]
                for key in [source.key] if source is not None else listed:
                    entry = self.models.entry(key)
                    if not entry.versions and not entry.tried:  # (a version's failure is listed already)
                        entry.error = load_errors.listed(exc)
            return exc

    async def load_named(
        self, name: str, config: str | None = None, files: dict[str, bytes] | None = None
    ) -> None:
        """Load ``name`` in any control mode. As in Triton, loading a model that serves,
        unchanged, leaves it as it is (its workers, its sequences); a changed file, a
        config override or files given reload it. A config override therefore lasts until
        the model's files change or it is unloaded, as in Triton 2.51."""
        check_model_name(name)
        if files and config is None:
            raise InvalidArgumentError(
                f"load of model '{name}': file: parameters need a 'config' parameter too"
            )
        upload: UploadFolder | None = None
        if files:  # it replaces the model of that name, in its namespace
            loaded = self.models.find(name)
            written = self.repository.write_upload(name, files)
            upload = written.upload
            sources = [dataclasses.replace(written, namespace=loaded.namespace if loaded else "")]
        else:
            sources = await self._fetch(name)
            if config is None:
                sources = [s for s in sources if not self._unchanged(s)]
        try:
            results = await asyncio.gather(
                *(self._load_source(source, config) for source in sources), return_exceptions=True
            )
        finally:
            if upload is not None:  # (the versions loaded from it hold it on)
                upload.release()
        for result in results:
            if isinstance(result, BaseException):
                raise result
        await self.ensembles_follow([source.key for source in sources])

    def _unchanged(self, source: ModelSource) -> bool:
        entry = self.models.get(source.key)
        if entry is None or not entry.unchanged(source.fingerprint):
            return False
        return not self.steps_moved(source)

    def steps_moved(self, source: ModelSource) -> bool:
        """With model namespacing, whether a loaded ensemble's steps now mean other models
        (a step model came into its own repository, or went from another): its load then
        loads it again, resolved anew, as Triton re-resolves it."""
        entry = self.models.get(source.key)
        loaded = entry.latest_loaded() if entry is not None and self.models.namespacing else None
        if loaded is None or not loaded.is_ensemble:
            return False
        config = mc.ModelConfig()
        config.CopyFrom(loaded.config)
        try:
            ensemble_steps.resolve_steps(self.models, source, config, self.repository.scan())
        except TritonError:  # (now ambiguous: its load says so)
            return True
        return config != loaded.config

    async def ensembles_follow(self, loaded: list[ModelKey]) -> None:
        """After models ``loaded`` (load or reload), ensembles follow their steps, as
        Triton's do: a loaded ensemble that a step's new version no longer fits (an input
        or output renamed, say) is unloaded (it stayed READY, failing every request),
        and ensembles waiting for their steps load again once every one serves."""
        for user in list(self.models.values()):
            version = user.latest_loaded()
            if version is None or not version.is_ensemble or user.unloading is not None:
                continue
            steps = {(step.namespace, step.model) for step in ensemble.steps_of(version.config)}
            if steps.isdisjoint(loaded):
                continue
            config = mc.ModelConfig()
            config.CopyFrom(version.config)
            try:
                ensemble_steps.check_steps(self.models, self.repository, user.name, config)
            except TritonError as exc:
                log.warning("unloading ensemble '%s': %s", user.name, exc.message)
                await self.unloader.unload_with_users(user)
        await self._reload_waiting()

    async def _reload_waiting(self) -> None:
        """Ensembles unloaded with their step models (or, outside explicit mode, that
        failed to load for want of them) load again, as Triton's do, once every step
        they lost is loaded again: by name, by a poll, or as another ensemble's step."""
        for user in list(self.models.values()):
            # (not while it drains: its steps may still serve until they unload after it)
            if user.waits_for and not user.versions and user.unloading is None:
                user.waits_for = {key for key in user.waits_for if not self._serving(key)}
                if not user.waits_for:
                    log.info("loading ensemble '%s' again: its step models are back", user.name)
                    await self.load_guarded(user.name)

    def _serving(self, key: ModelKey) -> bool:
        entry = self.models.get(key)
        return entry is not None and entry.unloading is None and entry.latest_loaded() is not None

    async def _load_source(self, source: ModelSource, config: str | None = None, as_step: bool = False) -> None:
        entry = self.models.entry(source.key)
        if entry.unloading is not None:  # (it may still drain the ensembles that use it first)
            await asyncio.wait({entry.unloading})
        async with entry.lock:
            entry.loading = True
            try:
                loaded = await self._load_versions(source, config, entry)
            except TritonError as exc:
                if not entry.tried:  # (before its versions were known: the model's own error)
                    if not entry.versions:
                        entry.error = load_errors.listed(exc)
                    raise
                # Its versions failed: said as Triton says it, in the index and to the loader
                # (a failure before they started is each one's; those that started are
                # stopped again).
                entry.failed = entry.failed or dict.fromkeys(entry.tried, load_errors.version_failure(exc))
                stopped = set(entry.tried) - entry.failed.keys() - entry.versions.keys()
                entry.unloaded = sorted(stopped.union(entry.unloaded))
                if not entry.versions:
                    entry.error = next(iter(entry.failed.values()))
                states = "".join(
                    f"version {v} is at UNAVAILABLE state: {why};\n" for v, why in entry.failed.items()
                )
                bad_load = InvalidArgumentError if isinstance(exc, InternalError) else type(exc)
                failure = bad_load(f"load failed for model '{source.name}': {states}")
                failure.failed_versions = entry.failed  # type: ignore[attr-defined]
                raise failure from None
            finally:
                entry.loading = False
            old = entry.versions
            for version, model in loaded.items():
                if version in old:  # a reload: Prometheus counts on, as Triton's
                    model.stats.continues(old[version].stats)
            log.info("successfully loaded '%s'", source.name)
            entry.unloaded = sorted((old.keys() | set(entry.unloaded)) - loaded.keys())
            entry.versions, entry.error, entry.tried, entry.failed = loaded, "", [], {}
            entry.waits_for.clear()
            entry.as_step = as_step
            entry.fingerprint = source.fingerprint
            for replaced in old.values():
                self.unloader.retire(entry, replaced)

    def _refuse_if_stopping(self, name: str) -> None:
        if self.stopping:
            raise UnavailableError(f"model '{name}' not started: the server is stopping")

    async def _load_versions(
        self, source: ModelSource, override: str | None, entry: ModelEntry
    ) -> dict[int, ModelVersion]:
        name = source.name
        # (a load that outlives its client may get here after the stop unloaded the model:
        # no worker starts then, auto-complete's neither)
        self._refuse_if_stopping(name)
        entry.tried, entry.failed = [], {}
        if override is not None:
            config = config_forms.parse_json(override, name)
        else:
            found = self.repository.read_config(source)
            if found is None and not self.auto_complete:
                raise InvalidArgumentError(
                    f"failed to load model '{name}': it has no config.pbtxt and "
                    "auto-complete is disabled"
                )
            config = found or mc.ModelConfig()
        if not config.name or source.renamed:  # a renamed folder: the name it is served under
            config.name = name
        if not config.backend and not config.platform:
            config.backend = PYTHON_BACKEND
        if not config.HasField("version_policy"):
            config.version_policy.latest.num_versions = 1
        is_ensemble = config.platform == cfg.ENSEMBLE_PLATFORM
        filename = config.default_model_filename or cfg.DEFAULT_MODEL_FILENAME
        on_disk = source.versions_on_disk()
        log_missing_versions(name, config.version_policy, on_disk)
        own_file = not is_ensemble and config.backend == PYTHON_BACKEND  # (a version needs its model.py)
        available = [v for v in on_disk if not own_file or (source.path / str(v) / filename).is_file()]
        versions = select_versions(config.version_policy, available)
        if not versions and available:  # (Triton's words)
            raise InvalidArgumentError(
                f"failed to load model '{name}': at least one version must be available under "
                f"the version policy of model '{name}' (version folders: {available})"
            )
        if not versions:
            holding = f"holds '{filename}'" if own_file else "exists"
            raise InvalidArgumentError(
                f"failed to load model '{name}': no version folder {holding} "
                f"(version folders with it: {available or 'none'})"
            )
        if not is_ensemble:  # from here on a failure is these versions' (as Triton lists it;
            entry.tried = versions  # an ensemble that fails over its steps, by name only)
        backend_file = None if is_ensemble else backend_model_file(config, name, self.resources.backend_directory)
        model_path = source.path / str(max(versions)) / filename
        code_file = backend_file or model_path
        if not is_ensemble and self.auto_complete and may_define_auto_complete(code_file):
            cfg.complete_instances(config, name, self.resources.gpu_count)  # what Triton shows it
            config = await run_auto_complete(self.resources, self.starting, name, config, model_path, code_file)
        cfg.complete(config, name, self.resources.gpu_count)
        try:
            cfg.validate(config, name, self.resources.gpu_count)
        except TritonError as exc:  # (an instance update's groups: the versions serve on, READY)
            config_name = self.repository.config_name
            if not is_ensemble and in_place(entry, source, config, versions, config_name=config_name):
                raise refused(entry, name, dict.fromkeys(entry.versions, exc)) from None
            raise
        for output in config.output:
            labels = source.path / output.label_filename
            if output.label_filename and not labels.is_file():  # (Triton's words)
                raise InternalError(  # (Triton's code and words)
                    f"failed to open text file for read {labels}: No such file or directory"
                )
        if not is_ensemble and await update_instances(
            entry,
            source,
            config,
            versions,
            config_name=self.repository.config_name,
            exit_timeout=self.exit_timeout,
            starting=self.starting,
        ):
            return dict(entry.versions)
        steps: list[ModelKey] = []
        if is_ensemble:
            ensemble.validate(config, name)
            steps = await self._load_steps(source, config)
            try:
                ensemble_steps.check_steps(self.models, self.repository, name, config)
            except TritonError as exc:  # (Triton's prefix for what it finds at this stage)
                await self.unloader.unload_unused(steps)
                if not self.explicit:  # it loads again once its steps serve, as Triton's does
                    entry.waits_for = {
                        key
                        for step in ensemble.steps_of(config)
                        if not self._serving(key := (step.namespace, step.model))
                    }
                raise load_errors.load_failed(name, exc) from None
            except BaseException:
                await self.unloader.unload_unused(steps)
                raise
        try:
            for attempt in range(self.load_retries + 1):
                loaded, failures = await self._start_versions(
                    name, versions, config, source, backend_file
                )
                if not failures:
                    return loaded
                first = next(iter(failures.values()))
                if attempt == self.load_retries or self.stopping:
                    entry.failed = {version: load_errors.version_failure(exc) for version, exc in failures.items()}
                    raise first
                log.warning(
                    "model '%s' failed to start (try %d of %d): %s",
                    name, attempt + 1, self.load_retries + 1, first.message,
                )
            raise AssertionError("unreachable")
        except BaseException:
            await self.unloader.unload_unused(steps)  # what this load brought in for nothing
            raise

    async def _start_versions(
        self,
        name: str,
        versions: list[int],
        config: mc.ModelConfig,
        source: ModelSource,
        backend_file: Path | None,
    ) -> tuple[dict[int, ModelVersion], dict[int, TritonError]]:
        """Start every version's instances, side by side as Triton does; all or none of
        them: if any fails, those that started stop again, and the failures (by version)
        are returned."""
        self._refuse_if_stopping(name)
        models = {
            version: ModelVersion(
                name, version, config, source.path, self.resources, source.namespace, backend_file,
                source.upload,
            )
            for version in versions
        }
        try:
            results = await asyncio.gather(
                *(self._start_version(model) for model in models.values()), return_exceptions=True
            )
            errors = {
                version: result for version, result in zip(models, results) if result is not None
            }
            if errors:  # all or none: those that started stop again
                await asyncio.gather(*(m.unload(time.monotonic() + 1.0) for m in models.values()))
        except BaseException:  # cancelled (starting them, or stopping them): the started ones end
            for model in models.values():
                model.abandon()
            raise
        if not errors:
            return models, {}
        for error in errors.values():
            if not isinstance(error, TritonError):  # (a bug, or a cancellation)
                raise error
        return {}, {version: error for version, error in errors.items() if isinstance(error, TritonError)}

    async def _start_version(self, model: ModelVersion) -> None:
        log.info("loading: %s:%d", model.name, model.version)
        self.starting.add(model)
        try:
            await model.load()
        finally:
            self.starting.discard(model)

    async def _load_steps(self, source: ModelSource, config: mc.ModelConfig) -> list[ModelKey]:
        """Resolve the ensemble's steps to models (see :mod:`dlserve.engine.manager`), then, in
        explicit mode, load those not loaded (or being unloaded), as Triton does (in the
        other modes they load with the rest); returns those it loaded. If one fails,
        those it loaded go again."""
        name = source.name
        listed = self.repository.scan()
        keys = ensemble_steps.resolve_steps(self.models, source, config, listed)
        if not self.explicit:
            return []
        loaded: list[ModelKey] = []
        for key in keys:
            entry = self.models.get(key)
            if entry is not None and entry.latest_loaded() is not None:
                continue
            found = listed.get(key)
            if not isinstance(found, ModelSource):  # none in the repository (an upload unloaded since)
                await self.unloader.unload_unused(loaded)
                unavailable = ensemble_steps.unavailable_steps(name, key[1])
                raise load_errors.load_failed(name, InvalidArgumentError(unavailable))
            try:
                await self._load_source(await self._fetch_source(found), as_step=True)
            except TritonError as exc:
                await self.unloader.unload_unused(loaded)
                raise InvalidArgumentError(
                    f"failed to load ensemble '{name}': its step model '{key[1]}' did not "
                    f"load: {exc.message}"
                ) from None
            loaded.append(key)
        return loaded
