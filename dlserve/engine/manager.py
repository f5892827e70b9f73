"""Which models are loaded: the model control modes, the index, start and stop, and the
load / unload / poll API, whose work the manager's collaborators do (:mod:`.loading`,
:mod:`.unloading`, :mod:`.repository_polling`).

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
import enum
import logging
import time
from typing import Any

from dlserve.engine import repository_polling
from dlserve.engine.ensemble_steps import ensembles_last
from dlserve.engine.load_errors import log_load_failure
from dlserve.engine.loading import Loader
from dlserve.engine.model import EngineResources, ModelVersion
from dlserve.engine.model_table import ModelTable
from dlserve.engine.object_store import ObjectStoreError, is_remote
from dlserve.engine.repository import ModelKey, ModelSource, Repository
from dlserve.engine.unloading import Unloader
from dlserve.errors import InvalidArgumentError, TritonError, UnavailableError, UnsupportedError

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
        concurrent_loads: int = 4,
    ) -> None:
        self.repository = repository
        self.control_mode = control_mode
        self.models = ModelTable(repository.namespacing)
        self.unloader = Unloader(self.models, exit_timeout)
        self.loader = Loader(
            repository,
            resources,
            self.models,
            self.unloader,
            explicit=control_mode is ModelControlMode.EXPLICIT,
            auto_complete=auto_complete,
            exit_timeout=exit_timeout,
            load_retries=load_retries,
            concurrent_loads=concurrent_loads,
        )
        self._poll_task: asyncio.Task[None] | None = None
        # One poll at a time (the startup load is the first), as Triton's poll mutex: a poll
        # that forgot a model whose folder went, while another's load of it still ran,
        # left that load's worker running outside the table, past the server's stop.
        self._polling = asyncio.Lock()

    # -- the repository index ------------------------------------------------------
    def index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        keys = set(self.models)
        in_repository: set[ModelKey] = set()
        if not ready_only:
            in_repository = {k for k, s in self.repository.scan().items() if isinstance(s, ModelSource)}
            keys |= in_repository
        # (namespace, name): by repository, then by name, as Triton lists them
        for key in sorted(keys):
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
        async with self._polling:
            for group in ensembles_last(self.repository, wanted):
                loads = (self.loader.load_in_turn(what) for what in group)
                results += await asyncio.gather(*loads)
        errors = [failure.message for failure in results if failure is not None]
        if self.control_mode is ModelControlMode.POLL and poll_interval > 0:  # (0: never, as Triton)
            polling = repository_polling.poll_forever(self, poll_interval)
            self._poll_task = asyncio.get_running_loop().create_task(polling)
        return errors

    async def stop(self, deadline: float) -> bool:
        """Unload everything by ``deadline`` (``time.monotonic()``); whether every
        request in flight finished, and every worker ended, by then."""
        if self._poll_task is not None:
            self._poll_task.cancel()
        unloads = asyncio.gather(
            *(self.unloader.unload_entry(entry, deadline) for entry in list(self.models.values())),
            return_exceptions=True,
        )
        self.loader.stopping = True  # no load starts a worker from now on (retries included)
        try:
            await asyncio.wait_for(asyncio.shield(unloads), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            # A load still starting (an initialize, auto-complete or warmup that does not
            # return) holds its model's lock: end its workers, so that it fails and the
            # unload runs.
            while not unloads.done():
                for starting in list(self.loader.starting):
                    what = starting.name if isinstance(starting, ModelVersion) else starting.instance_name
                    log.warning("stopping: '%s' is still starting; ending its workers", what)
                    starting.kill()
                await asyncio.wait({unloads}, timeout=1.0)
        if self.unloader.background:  # (each ends by its own deadline, set when it began: before ours)
            await asyncio.gather(*self.unloader.background, return_exceptions=True)
        self.repository.close()
        return all(drained is True for drained in unloads.result())

    def versions_in_flight(self) -> list[tuple[ModelVersion, int]]:
        """The loaded versions (and those a reload replaced) with requests queued or
        executing, and how many each has."""
        loaded = (v for entry in self.models.values() for v in entry.versions.values())
        versions = [*loaded, *self.unloader.retiring]
        counted = ((version, version.requests_in_flight) for version in versions)
        return [(version, count) for version, count in counted if count]

    def live_models(self) -> int:
        """Models with a version not unloaded yet (replaced ones still draining count apart)."""
        loaded = sum(1 for entry in self.models.values() if entry.versions)
        return loaded + len(self.unloader.retiring)

    def kill(self) -> None:
        for entry in self.models.values():
            for model in entry.versions.values():
                model.kill()
        for model in self.unloader.retiring:
            model.kill()
        self.repository.close()

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
            await self.loader.load_named(name, config, files)
        except TritonError as exc:
            log_load_failure(name, exc)
            raise

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
        await self.unloader.unload(name, unload_dependents, wait)

    # -- poll mode --------------------------------------------------------------------
    async def poll(self) -> None:
        """Load new models, reload changed ones, unload removed ones (after any poll
        still running)."""
        async with self._polling:
            await repository_polling.poll(self)
