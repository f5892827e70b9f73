"""Which models are loaded: model control modes, load/unload/reload, polling, the index.

Every model has a lock, so loads and unloads of one model never interleave while
different models load in parallel. A reload loads the new versions first and
swaps them in only when they are ready, so a broken edit never takes down a
serving model; as in Triton, it returns then, while the versions it replaced finish
their requests in the background (a client's load never waits on a long request).

With model namespacing, as in Triton: a model is known by its repository and name
(:data:`ModelKey`); a name alone means the one model of that name that is loaded, and
is an error when several are; an ensemble's step means the model of that name in the
ensemble's repository, else the only one there is (resolved at load, and written into
the step's ``model_namespace``); loading or unloading a name takes every model of
that name.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import json
import logging
import time
from collections.abc import Coroutine, Iterable
from pathlib import Path
from typing import Any

from dlserve.engine import config as cfg
from dlserve.engine import config_forms, ensemble
from dlserve.engine.backends import PYTHON_BACKEND, backend_model_file, code_paths
from dlserve.engine.model import EngineResources, ModelVersion
from dlserve.engine.model_table import ModelEntry, ModelTable
from dlserve.engine.object_store import ObjectStoreError, is_remote
from dlserve.engine.proto import model_config_pb2 as mc
from dlserve.engine.repository import (
    ModelKey,
    ModelSource,
    Repository,
    check_model_name,
    defines_auto_complete,
    log_missing_versions,
    select_versions,
)
from dlserve.errors import (
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    TritonError,
    UnavailableError,
    UnsupportedError,
)
from dlserve.ipc.protocol import Kind
from dlserve.ipc.supervisor import WorkerProcess

log = logging.getLogger("dlserve.engine")


class ModelControlMode(enum.IntEnum):
    NONE = 0
    POLL = 1
    EXPLICIT = 2


class ModelManager:
    def __init__(
        self,
        repository: Repository,
        resources: EngineResources,
        *,
        control_mode: ModelControlMode,
        auto_complete: bool,
        exit_timeout: float,
        load_retries: int = 0,
    ) -> None:
        self.repository = repository
        self.resources = resources
        self.control_mode = control_mode
        self.auto_complete = auto_complete
        self.exit_timeout = exit_timeout
        self.load_retries = load_retries  # tries after a model's first failed start
        self.models = ModelTable(repository.namespacing)
        # What a load is starting (versions, auto-complete workers): ended at the stop deadline.
        self._starting: set[ModelVersion | WorkerProcess] = set()
        self._stopping = False
        self._poll_task: asyncio.Task[None] | None = None
        self._unloading: set[asyncio.Task[Any]] = set()  # unloads returned from before they ended
        self._retiring: set[ModelVersion] = set()  # versions a reload replaced, still draining

    # -- the repository index ------------------------------------------------------
    def index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        keys = set(self.models)
        in_repository: set[ModelKey] = set()
        if not ready_only:
            in_repository = {k for k, s in self.repository.scan().items() if isinstance(s, ModelSource)}
            keys |= in_repository
        for key in sorted(keys, key=lambda k: (k[1], k[0])):
            name, entry = key[1], self.models.get(key)
            if entry is not None and not entry.versions and not entry.tried and (entry.loading or entry.error):
                if not ready_only:  # (its versions not known yet, or it failed before they were)
                    failed = {"state": "UNAVAILABLE", "reason": entry.error}
                    rows.append({"name": name, **({"state": "LOADING"} if entry.loading else failed)})
                continue
            if entry is not None and not (entry.versions or entry.error or entry.loading):
                if key not in in_repository:  # unloaded, and no repository holds it (uploads included)
                    continue
            states = entry.states() if entry is not None else {}
            if not states and not ready_only:
                rows.append({"name": name})
            for version, (state, reason) in states.items():
                if ready_only and state != "READY":
                    continue
                row = {"name": name, "version": str(version), "state": state}
                if reason:
                    row["reason"] = reason
                rows.append(row)
        return rows

    async def refresh_repository(self, strict: bool = True) -> None:
        """List remote repositories again (on a thread: it is network I/O). Not
        ``strict``: a store that cannot be listed leaves its last listing in place."""
        if not self.repository.remote:
            return
        try:
            await asyncio.to_thread(self.repository.refresh)
        except ObjectStoreError as exc:
            if strict:
                raise
            log.warning("%s; using its last listing", exc.message)

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

    # -- start / stop -----------------------------------------------------------------
    async def start(self, startup_models: list[str], poll_interval: float) -> list[str]:
        """Load the models the control mode calls for; returns the load errors."""
        await self.refresh_repository()
        if self.control_mode is ModelControlMode.EXPLICIT and startup_models != ["*"]:
            if "*" in startup_models:
                raise InvalidArgumentError("'*' must be the only startup model when it is used")
            wanted: list[str | ModelSource] = list(dict.fromkeys(startup_models))
        else:  # every model; a name in two repositories (no namespacing) fails as a name
            wanted = [s if isinstance(s, ModelSource) else k[1] for k, s in sorted(self.repository.scan().items())]
        # Ensembles after the models they run: loading one checks what its steps are.
        results = []
        for group in self._ensembles_last(wanted):
            results += await asyncio.gather(*(self._load_guarded(what) for what in group))
        errors = [failure.message for failure in results if failure is not None]
        if self.control_mode is ModelControlMode.POLL and poll_interval > 0:  # (0: never, as Triton)
            self._poll_task = asyncio.get_running_loop().create_task(self._poll_forever(poll_interval))
        return errors

    def _ensembles_last(self, wanted: list[str | ModelSource]) -> tuple[list[str | ModelSource], list[str | ModelSource]]:
        """``wanted`` split in two: what is not an ensemble (or cannot be told: a remote
        model not fetched yet, a config that does not parse), then the ensembles."""

        def is_ensemble(source: ModelSource) -> bool:
            try:
                config = self.repository.read_config(source)
            except (TritonError, OSError):
                return False
            return config is not None and config.platform == cfg.ENSEMBLE_PLATFORM

        first: list[str | ModelSource] = []
        last: list[str | ModelSource] = []
        for what in wanted:
            try:
                sources = [what] if isinstance(what, ModelSource) else self.repository.find(what)
            except TritonError:  # unknown or ambiguous: its load says so
                sources = []
            (last if any(is_ensemble(s) for s in sources) else first).append(what)
        return first, last

    async def _load_guarded(self, what: str | ModelSource) -> TritonError | None:
        """Load a model by name, or from a source; its error, logged, rather than raised."""
        try:
            if isinstance(what, ModelSource):
                await self._load_source(await self._fetch_source(what))
            else:
                await self._load_named(what)
            return None
        except TritonError as exc:
            source = what if isinstance(what, ModelSource) else None
            name = what if source is None else source.name
            _log_load_failure(name, exc, source.namespace if source is not None else "")
            if not isinstance(exc, NotFoundError):  # listed as failed, with the reason
                listed = [key for key in self.repository.scan() if key[1] == name] or [("", name)]
                for key in [source.key] if source is not None else listed:
                    entry = self.models.entry(key)
                    if not entry.versions and not entry.tried:  # (a version's failure is listed already)
                        entry.error = _listed(exc)
            return exc

    async def stop(self, deadline: float) -> bool:
        """Unload everything by ``deadline`` (``time.monotonic()``); whether every
        request in flight finished by then."""
        if self._poll_task is not None:
            self._poll_task.cancel()
        unloads = asyncio.gather(
            *(self._unload_entry(entry, deadline) for entry in list(self.models.values())),
            return_exceptions=True,
        )
        self._stopping = True  # no load starts a worker from now on (retries included)
        try:
            await asyncio.wait_for(asyncio.shield(unloads), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            # A load still starting (an initialize, auto-complete or warmup that does not
            # return) holds its model's lock: end its workers, so that it fails and the
            # unload runs.
            while not unloads.done():
                for starting in list(self._starting):
                    what = starting.name if isinstance(starting, ModelVersion) else starting.instance_name
                    log.warning("stopping: '%s' is still starting; ending its workers", what)
                    starting.kill()
                await asyncio.wait({unloads}, timeout=1.0)
        if self._unloading:  # (each ends by its own deadline, set when it began: before ours)
            await asyncio.gather(*self._unloading, return_exceptions=True)
        self.repository.close()
        return all(drained is True for drained in unloads.result())

    def kill(self) -> None:
        for entry in self.models.values():
            for model in entry.versions.values():
                model.kill()
        for model in self._retiring:
            model.kill()

    # -- repositories -----------------------------------------------------------------
    async def register_repository(self, path: str, name_mapping: dict[str, str] | None) -> None:
        """Add a repository (explicit mode only, as in Triton); its models load on request."""
        self._check_registration_allowed("registration")
        # Opening a remote one lists the store (network I/O, on a thread); the
        # repositories themselves change here, on the loop.
        mirror = await asyncio.to_thread(Repository.open_remote, path) if is_remote(path) else None
        try:
            self.repository.register(path, name_mapping, mirror)
        except BaseException:
            if mirror is not None:
                mirror.close()
            raise

    def unregister_repository(self, path: str) -> None:
        self._check_registration_allowed("unregistration")
        self.repository.unregister(path)

    def _check_registration_allowed(self, what: str) -> None:
        if self.control_mode is not ModelControlMode.EXPLICIT:
            raise UnsupportedError(
                f"repository {what} is not allowed if model control mode is not EXPLICIT"
            )

    # -- load / unload ----------------------------------------------------------------
    def _check_api_allowed(self) -> None:
        if self.control_mode is not ModelControlMode.EXPLICIT:
            raise UnavailableError(
                "explicit model load / unload is not allowed if polling is enabled "
                f"(model control mode is {self.control_mode.name}; use EXPLICIT)"
            )

    async def load(self, name: str, config: str | None = None, files: dict[str, bytes] | None = None) -> None:
        """Load (or reload) ``name`` (explicit mode only); ``config`` overrides
        config.pbtxt (JSON). A failure is logged, as one at startup is, and raised."""
        self._check_api_allowed()
        try:
            await self._load_named(name, config, files)
        except TritonError as exc:
            _log_load_failure(name, exc)
            raise

    async def _load_named(
        self, name: str, config: str | None = None, files: dict[str, bytes] | None = None
    ) -> None:
        """Load ``name`` in any control mode. As in Triton, loading a model that serves,
        unchanged, leaves it as it is (its workers, its sequences); a changed file, a
        config override or files given reload it."""
        check_model_name(name)
        if files and config is None:
            raise InvalidArgumentError(
                f"load of model '{name}': file: parameters need a 'config' parameter too"
            )
        if files:  # it replaces the model of that name, in its namespace
            loaded = self.models.find(name)
            upload = self.repository.write_upload(name, files)
            sources = [dataclasses.replace(upload, namespace=loaded.namespace if loaded else "")]
        else:
            sources = await self._fetch(name)
            if config is None:
                sources = [s for s in sources if not self._unchanged(s)]
        results = await asyncio.gather(
            *(self._load_source(source, config) for source in sources), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result
        await self._reload_waiting([source.key for source in sources])

    def _unchanged(self, source: ModelSource) -> bool:
        entry = self.models.get(source.key)
        return entry is not None and entry.unchanged(source.fingerprint)

    async def _reload_waiting(self, loaded: list[ModelKey]) -> None:
        """Ensembles unloaded with these step models load again, as Triton's do, once
        every step they lost is back."""
        for user in list(self.models.values()):
            if user.waits_for & set(loaded):
                user.waits_for -= set(loaded)
                if not user.waits_for and not user.versions:
                    log.info("loading ensemble '%s' again: its step models are back", user.name)
                    await self._load_guarded(user.name)

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
                        entry.error = _listed(exc)
                    raise
                # Its versions failed: said as Triton says it, in the index and to the loader
                # (a failure before they started is each one's; those that started are
                # stopped again).
                entry.failed = entry.failed or dict.fromkeys(entry.tried, _version_failure(exc))
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
            entry.overridden = config is not None
            for replaced in old.values():
                self._retire(entry, replaced)

    def _retire(self, entry: ModelEntry, version: ModelVersion) -> None:
        """Unload a version a reload replaced, in the background: its requests finish
        (by the exit timeout) while the new version serves, and the index shows it
        UNLOADING meanwhile."""
        if entry.versions.get(version.version) is version:
            return  # (updated in place: it serves on)
        self._retiring.add(version)
        entry.draining[version.version] = version
        task = self._in_background(version.unload(self._deadline()))

        def ended(_: object) -> None:
            self._retiring.discard(version)
            if entry.draining.get(version.version) is version:
                del entry.draining[version.version]

        task.add_done_callback(ended)

    async def _load_versions(
        self, source: ModelSource, override: str | None, entry: ModelEntry
    ) -> dict[int, ModelVersion]:
        name = source.name
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
        if not is_ensemble and self.auto_complete and defines_auto_complete(code_file):
            cfg.complete_instances(config, name, self.resources.gpu_count)  # what Triton shows it
            config = await self._auto_complete(name, config, model_path, code_file)
        cfg.complete(config, name, self.resources.gpu_count)
        cfg.validate(config, name, self.resources.gpu_count)
        for output in config.output:
            labels = source.path / output.label_filename
            if output.label_filename and not labels.is_file():  # (Triton's words)
                raise InvalidArgumentError(
                    f"failed to open text file for read {labels}: No such file or directory"
                )
        if not is_ensemble and await self._update_instances(entry, source, config, versions):
            return dict(entry.versions)
        steps: list[ModelKey] = []
        if is_ensemble:
            ensemble.validate(config, name)
            steps = await self._load_steps(source, config)
            try:
                self._check_steps(name, config)
            except TritonError as exc:  # (Triton's prefix for what it finds at this stage)
                await self._unload_unused(steps)
                raise _load_failed(name, exc) from None
            except BaseException:
                await self._unload_unused(steps)
                raise
        try:
            for attempt in range(self.load_retries + 1):
                loaded, failures = await self._start_versions(
                    name, versions, config, source, backend_file
                )
                if not failures:
                    return loaded
                first = next(iter(failures.values()))
                if attempt == self.load_retries or self._stopping:
                    entry.failed = {version: _version_failure(exc) for version, exc in failures.items()}
                    raise first
                log.warning(
                    "model '%s' failed to start (try %d of %d): %s",
                    name, attempt + 1, self.load_retries + 1, first.message,
                )
            raise AssertionError("unreachable")
        except BaseException:
            await self._unload_unused(steps)  # what this load brought in for nothing
            raise

    async def _update_instances(
        self, entry: ModelEntry, source: ModelSource, config: mc.ModelConfig, versions: list[int]
    ) -> bool:
        """Load ``config`` by updating the serving versions' instances in place, as Triton
        does when the model's files (but its config.pbtxt) are unchanged, the same versions
        serve, and the config differs from theirs at most in ``instance_group``
        (ModelVersion.update_instances); False where a full reload is needed. If an
        instance fails to start, the versions serve on as they were and the load fails,
        in Triton's words ("version N is at READY state: ...")."""
        serving = entry.versions
        if not serving or sorted(serving) != sorted(versions):
            return False
        if any(v.state != "READY" or v.is_ensemble for v in serving.values()):
            return False
        if entry.fingerprint is None:
            return False
        config_file = source.config_path(self.repository.config_name)
        if not _same_files(entry.fingerprint, source.fingerprint, source.path, config_file):
            return False
        if not all(_alike_but_instances(v.config, config) for v in serving.values()):
            return False
        self._starting.update(serving.values())  # (a stop meanwhile ends their workers)
        try:
            results = await asyncio.gather(
                *(v.update_instances(config, self.exit_timeout) for v in serving.values()), return_exceptions=True
            )
        finally:
            self._starting.difference_update(serving.values())
        failed = {version: r for version, r in zip(serving, results) if isinstance(r, BaseException)}
        for error in failed.values():
            if not isinstance(error, TritonError):  # (a bug, or a cancellation)
                raise error
        for version, model in serving.items():
            model.reason = _version_failure(failed[version]) if version in failed else ""  # type: ignore[arg-type]
        if failed:
            entry.tried = []  # (the versions serve on: no version failed to load)
            states = "".join(
                f"version {v} is at READY state: {serving[v].reason};\n" for v in sorted(failed)
            )
            raise InvalidArgumentError(f"load failed for model '{source.name}': {states}")
        return True

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
        if self._stopping:
            raise UnavailableError(f"model '{name}' not started: the server is stopping")
        models = {
            version: ModelVersion(
                name, version, config, source.path, self.resources, source.namespace, backend_file
            )
            for version in versions
        }
        results = await asyncio.gather(
            *(self._start_version(model) for model in models.values()), return_exceptions=True
        )
        errors = {version: result for version, result in zip(models, results) if result is not None}
        if not errors:
            return models, {}
        await asyncio.gather(*(m.unload(time.monotonic() + 1.0) for m in models.values()))
        for error in errors.values():
            if not isinstance(error, TritonError):  # (a bug, or a cancellation)
                raise error
        return {}, {version: error for version, error in errors.items() if isinstance(error, TritonError)}

    async def _start_version(self, model: ModelVersion) -> None:
        log.info("loading: %s:%d", model.name, model.version)
        self._starting.add(model)
        try:
            await model.load()
        finally:
            self._starting.discard(model)

    async def _load_steps(self, source: ModelSource, config: mc.ModelConfig) -> list[ModelKey]:
        """Resolve the ensemble's steps to models (see the module's docstring), then, in
        explicit mode, load those not loaded (or being unloaded), as Triton does (in the
        other modes they load with the rest); returns those it loaded. If one fails,
        those it loaded go again."""
        name = source.name
        listed = self.repository.scan()
        keys: dict[str, ModelKey] = {}
        for step in config.ensemble_scheduling.step:
            key = keys.get(step.model_name) or self._step_key(source, step.model_name, listed)
            keys[step.model_name] = key
            step.model_namespace = key[0]
        if self.control_mode is not ModelControlMode.EXPLICIT:
            return []
        loaded: list[ModelKey] = []
        for key in sorted(set(keys.values())):
            entry = self.models.get(key)
            if entry is not None and entry.latest_loaded() is not None:
                continue
            found = listed.get(key)
            if not isinstance(found, ModelSource):  # none in the repository (an upload unloaded since)
                await self._unload_unused(loaded)
                raise _load_failed(name, InvalidArgumentError(_unavailable_steps(name, key[1])))
            try:
                await self._load_source(await self._fetch_source(found), as_step=True)
            except TritonError as exc:
                await self._unload_unused(loaded)
                raise InvalidArgumentError(
                    f"failed to load ensemble '{name}': its step model '{key[1]}' did not "
                    f"load: {exc.message}"
                ) from None
            loaded.append(key)
        return loaded

    def _check_steps(self, name: str, config: mc.ModelConfig) -> None:
        """Check an ensemble against its steps' loaded models, as Triton does at load
        (ensemble.check_step), and make it decoupled if one of them is: a streaming step
        makes a streaming ensemble, whatever its config said (Triton's rule). A step not
        loaded yet (a remote or nested ensemble's, loading beside it) is judged by its
        config.pbtxt, for decoupling only."""
        decoupled = False
        for step in ensemble.steps_of(config):
            key = (step.namespace, step.model)
            entry = self.models.get(key)
            model = entry.latest_loaded() if entry is not None else None
            if entry is None or model is None:
                source = self.repository.scan().get(key)
                if not isinstance(source, ModelSource) or (entry is not None and entry.error):
                    # None such, or it failed to load: the ensemble cannot run (Triton's words)
                    raise InvalidArgumentError(_unavailable_steps(name, step.model))
                with contextlib.suppress(TritonError):
                    listed = self.repository.read_config(source)
                    decoupled |= bool(listed and listed.model_transaction_policy.decoupled)
                continue
            if step.version >= 0:
                model = entry.versions.get(step.version)
                if model is None or model.state != "READY":
                    raise InvalidArgumentError(
                        f"ensemble '{name}' depends on '{step.model}' whose required version "
                        f"{step.version} is not loaded."
                    )
            ensemble.check_step(config, name, step, model.config)
            decoupled |= model.decoupled
        if decoupled:
            config.model_transaction_policy.decoupled = True

    def _step_key(self, ensemble_source: ModelSource, step: str, listed: dict[ModelKey, ModelSource | str]) -> ModelKey:
        """The model an ensemble's step names: with namespacing, the one in the
        ensemble's repository, else the only one listed or loaded."""
        if not self.models.namespacing:
            found = listed.get(("", step))
            if isinstance(found, str):  # loaded from one of them or not, it is ambiguous
                raise InvalidArgumentError(
                    f"failed to load ensemble '{ensemble_source.name}': {found}; with model "
                    "namespacing on (--model-namespacing), the one in the ensemble's repository is taken"
                )
            return ("", step)
        own = (ensemble_source.namespace, step)
        if own in listed or (own in self.models and self.models[own].versions):
            return own
        candidates = {k for k in listed if k[1] == step} | {e.key for e in self.models.named(step) if e.versions}
        if len(candidates) > 1:
            raise InvalidArgumentError(
                f"failed to load ensemble '{ensemble_source.name}': its step model '{step}' is in "
                f"{len(candidates)} model repositories, none of them the ensemble's"
            )
        return candidates.pop() if candidates else own

    async def _auto_complete(
        self, name: str, config: mc.ModelConfig, model_path: Path, code_file: Path
    ) -> mc.ModelConfig:
        """Run ``auto_complete_config`` of ``code_file`` (the model's own ``model_path``,
        or its Python-based backend's file) in a throwaway worker, as Triton does."""
        resources = self.resources
        environment = await resources.environments.for_model(
            *cfg.environment_parameters(config), model_path.parent.parent, name
        )
        worker = WorkerProcess(
            instance_name=f"{name}_auto_complete",
            segment_prefix=f"{resources.segment_prefix}_a{resources.next_serial()}",
            arena_bytes=1 << 16,
            space=resources.space,
            arena=resources.arena,
            on_message=lambda message: None,
            on_exit=lambda description: None,
            environment=environment,
        )
        await worker.start()
        self._starting.add(worker)
        try:
            result = await worker.request(
                Kind.AUTO_COMPLETE,
                {
                    **code_paths(code_file, model_path),
                    "config": json.dumps(config_forms.to_json(config)),
                },
            )
        except TritonError as exc:
            raise type(exc)(f"auto_complete_config of model '{name}' failed: {exc.message}") from None
        finally:
            self._starting.discard(worker)
            await worker.stop(time.monotonic() + 5.0, finalize=False)
        return config_forms.parse_json(result, name, source="config from auto_complete_config")

    async def unload(self, name: str, unload_dependents: bool = False, wait: bool = True) -> None:
        """Unload every version of ``name``, and the loaded ensembles that use it (they
        could not run without it); with ``unload_dependents``, an ensemble's step
        models that were loaded only for it, and that no other loaded ensemble uses,
        go too. A name that is not loaded (or not known at all) is nothing to do, as in
        Triton.

        Without ``wait`` (the HTTP and gRPC endpoints, as Triton's) this returns once the
        unload began: the versions (and those of the ensembles that use them) are
        UNLOADING, taking no new requests, while those in flight finish; a load of the
        model meanwhile waits for the unload to end."""
        self._check_api_allowed()
        entries = self.models.named(name)
        if wait:
            await self._unload_entries(entries, unload_dependents)
            return
        task = self._in_background(self._unload_entries(entries, unload_dependents))
        marked: set[ModelKey] = set()
        going = [entry.key for entry in entries]
        while going:  # the models named and, in turn, the ensembles that use them
            key = going.pop()
            if key not in marked and key in self.models:
                marked.add(key)
                entry = self.models[key]
                entry.unloading = task
                for version in entry.versions.values():
                    version.begin_unload()
                going.extend(self._users_of(key))

    async def _unload_entries(self, entries: list[ModelEntry], unload_dependents: bool) -> None:
        deadline = self._deadline()  # (one for the whole unload, its ensembles and steps too)
        for entry in entries:
            steps = self._steps_of(entry) if unload_dependents else set()
            await self._unload_with_users(entry, deadline)
            entry.waits_for.clear()  # unloaded by name: it stays unloaded
            await self._unload_unused(steps, deadline)

    def _in_background(self, unloading: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run an unload the caller does not wait for; stop() waits for it."""
        task = asyncio.ensure_future(unloading)
        self._unloading.add(task)
        task.add_done_callback(self._unload_ended)
        return task

    def _unload_ended(self, task: asyncio.Task[Any]) -> None:
        self._unloading.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("unloading failed", exc_info=task.exception())

    async def _unload_unused(self, keys: Iterable[ModelKey], deadline: float | None = None) -> None:
        """Of these step models, unload those loaded only for ensembles that no loaded
        ensemble uses any more, and in turn theirs (a step may be an ensemble)."""
        for key in sorted(keys):
            entry = self.models.get(key)
            if entry is None or not entry.versions or not entry.as_step or self._users_of(key):
                continue
            steps = self._steps_of(entry)
            await self._unload_with_users(entry, deadline)
            await self._unload_unused(steps, deadline)

    @staticmethod
    def _steps_of(entry: ModelEntry) -> set[ModelKey]:
        return {
            (step.namespace, step.model)
            for version in entry.versions.values()
            if version.is_ensemble
            for step in ensemble.steps_of(version.config)
        }

    def _users_of(self, key: ModelKey) -> list[ModelKey]:
        """The loaded ensembles with a step that runs the model ``key``."""
        return sorted(user for user, entry in self.models.items() if key in self._steps_of(entry))

    async def _unload_with_users(self, entry: ModelEntry, deadline: float | None = None) -> None:
        for user in self._users_of(entry.key):
            log.info("unloading ensemble '%s': it uses '%s', which is being unloaded", user[1], entry.name)
            self.models[user].waits_for.add(entry.key)
            await self._unload_with_users(self.models[user], deadline)
        await self._unload_entry(entry, deadline)

    def _deadline(self) -> float:
        return time.monotonic() + self.exit_timeout

    async def _unload_entry(self, entry: ModelEntry, deadline: float | None = None) -> bool:
        """Unload every version of ``entry``; whether their requests all finished."""
        async with entry.lock:
            entry.error = ""
            # The versions stay listed (as UNLOADING) until their requests have drained.
            drained = await asyncio.gather(*(v.unload(deadline or self._deadline()) for v in entry.versions.values()))
            entry.unloaded = sorted(entry.versions.keys() | set(entry.unloaded))
            entry.versions = {}
        return all(drained)

    # -- poll mode --------------------------------------------------------------------
    async def poll(self) -> None:
        """Load new models, reload changed ones, unload removed ones."""
        await self.refresh_repository()
        found = {k: s for k, s in self.repository.scan().items() if isinstance(s, ModelSource)}
        for key in list(self.models):
            if key in found or key not in self.models:
                continue
            if self.models[key].versions:
                log.info("model '%s' was removed from the repository; unloading", key[1])
                await self._unload_with_users(self.models[key])
            self.models.forget(key)  # gone from the index too, as in Triton
        for group in self._ensembles_last(list(found.values())):  # (side by side, as Triton)
            await asyncio.gather(*(self._poll_load(source) for source in group if self._changed(source)))

    def _changed(self, source: str | ModelSource) -> bool:
        assert isinstance(source, ModelSource)
        entry = self.models.get(source.key)
        return entry is None or entry.fingerprint != source.fingerprint

    async def _poll_load(self, source: str | ModelSource) -> None:
        """Load a model a poll found new or changed."""
        assert isinstance(source, ModelSource)
        log.info("model '%s' is new or changed; loading", source.name)
        failure = await self._load_guarded(source)
        if failure is None:
            await self._reload_waiting([source.key])
        elif source.key in self.models:
            # A model that failed to load is tried again once it changes; one the
            # store failed to hand over, at the next poll.
            failed_store = isinstance(failure, ObjectStoreError)
            self.models[source.key].fingerprint = None if failed_store else source.fingerprint

    async def _poll_forever(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.poll()
            except ObjectStoreError as exc:  # the store is down: nothing is unloaded for it
                log.warning("repository poll skipped: %s", exc.message)
            except Exception:  # noqa: BLE001 - a poll must never kill the loop
                log.exception("repository poll failed")


def _log_load_failure(name: str, exc: TritonError, namespace: str = "") -> None:
    """Log a failed load once, in Triton's words (each version that failed, then the
    model), with Triton's ``ns::name`` and without the name twice."""
    where = f"{namespace}::{name}" if namespace else name
    failed_versions: dict[int, str] = getattr(exc, "failed_versions", {})
    for version, reason in failed_versions.items():
        log.error("failed to load '%s' version %d: %s", where, version, reason)
    if failed_versions:
        log.info("failed to load '%s'", where)
        return
    reason = exc.message.strip()
    for said in (f"failed to load model '{name}': ", f"load failed for model '{name}': "):
        reason = reason.removeprefix(said)  # (most load errors start so already)
    log.error("failed to load '%s': %s", where, reason)


def _load_failed(name: str, exc: TritonError) -> TritonError:
    """``exc`` as Triton words an ensemble's failure at load for the loader; the index
    lists it without the prefix (:func:`_listed`)."""
    failure = type(exc)(f"load failed for model '{name}': {exc.message}\n")
    failure.listed = exc.message  # type: ignore[attr-defined]
    return failure


def _alike_but_instances(running: mc.ModelConfig, new: mc.ModelConfig) -> bool:
    """Whether two configs differ at most in ``instance_group`` (Triton's
    ConfigChangeRequiresReload, less its version_policy: here a reload)."""
    a, b = mc.ModelConfig(), mc.ModelConfig()
    a.CopyFrom(running)
    b.CopyFrom(new)
    a.ClearField("instance_group")
    b.ClearField("instance_group")
    return a == b


def _same_files(old: Any, new: Any, model_dir: Path, config_file: Path) -> bool:
    """Whether two fingerprints of a model's files agree but for the config it loads
    (its config.pbtxt, or the ``configs/<name>.pbtxt`` that --model-config-name picks),
    named by its path (a local repository's stamps) or by its path inside the model
    folder (an object store's)."""
    config = {str(config_file), str(config_file.relative_to(model_dir))}

    def files(stamps: Any) -> list[Any]:
        return [stamp for stamp in stamps if stamp[0] not in config]

    return files(old) == files(new)


def _version_failure(exc: TritonError) -> str:
    """Why a version failed to load, as Triton's index and load error say it."""
    return f"{exc.code.words}: {exc.message}"


def _listed(exc: TritonError) -> str:
    """What the index says of a failed load (see :func:`_load_failed`)."""
    return getattr(exc, "listed", exc.message)


def _unavailable_steps(ensemble_name: str, step: str) -> str:
    return f"ensemble {ensemble_name} contains models that are not available or ambiguous: {step}"

