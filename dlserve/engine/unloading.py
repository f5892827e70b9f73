"""Unloading: a model and the loaded ensembles that use it (and, asked to, the step
models loaded only for them), and the versions a reload replaced; in the background
where the caller does not wait, as Triton's endpoints do not."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Iterable
from typing import Any

from dlserve.engine import ensemble
from dlserve.engine.model import ModelVersion
from dlserve.engine.model_table import ModelEntry, ModelTable
from dlserve.engine.repository import ModelKey

log = logging.getLogger("dlserve.engine")


class Unloader:
    """Unloads the manager's ``models``; each version's requests get ``exit_timeout``
    to finish (one deadline for an unload and all it takes with it)."""

    def __init__(self, models: ModelTable, exit_timeout: float) -> None:
        self.models = models
        self.exit_timeout = exit_timeout
        self.background: set[asyncio.Task[Any]] = set()  # unloads returned from before they ended
        self.retiring: set[ModelVersion] = set()  # versions a reload replaced, still draining

    async def unload(self, name: str, unload_dependents: bool = False, wait: bool = True) -> None:
        """:meth:`ModelManager.unload <dlserve.engine.manager.ModelManager.unload>`, once
        the control mode allows it."""
        entries = self.models.named(name)
        if wait:
            await self._unload_entries(entries, unload_dependents)
            return
        task = self._in_background(self._unload_entries(entries, unload_dependents))
        marked: dict[ModelKey, ModelEntry] = {}
        going = [entry.key for entry in entries]
        while going:  # the models named and, in turn, the ensembles that use them
            key = going.pop()
            if key not in marked and key in self.models:
                entry = marked[key] = self.models[key]
                entry.unloading = task
                for version in entry.versions.values():
                    version.begin_unload()
                going.extend(self._users_of(key))

        def ended(_: object) -> None:  # (before a load that waits for it goes on)
            for entry in marked.values():
                if entry.unloading is task:
                    entry.unloading = None

        task.add_done_callback(ended)

    async def _unload_entries(self, entries: list[ModelEntry], unload_dependents: bool) -> None:
        deadline = self._deadline()  # (one for the whole unload, its ensembles and steps too)
        for entry in entries:
            steps = self._steps_of(entry) if unload_dependents else set()
            await self.unload_with_users(entry, deadline)
            entry.waits_for.clear()  # unloaded by name: it stays unloaded
            await self.unload_unused(steps, deadline)

    def retire(self, entry: ModelEntry, version: ModelVersion) -> None:
        """Unload a version a reload replaced, in the background: its requests finish
        (by the exit timeout) while the new version serves, and the index shows it
        UNLOADING meanwhile."""
        if entry.versions.get(version.version) is version:
            return  # (updated in place: it serves on)
        self.retiring.add(version)
        entry.draining[version.version] = version
        task = self._in_background(version.unload(self._deadline()))

        def ended(_: object) -> None:
            self.retiring.discard(version)
            if entry.draining.get(version.version) is version:
                del entry.draining[version.version]

        task.add_done_callback(ended)

    def _in_background(self, unloading: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run an unload the caller does not wait for; the manager's stop() waits for it."""
        task = asyncio.ensure_future(unloading)
        self.background.add(task)
        task.add_done_callback(self._unload_ended)
        return task

    def _unload_ended(self, task: asyncio.Task[Any]) -> None:
        self.background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("unloading failed", exc_info=task.exception())

    async def unload_unused(self, keys: Iterable[ModelKey], deadline: float | None = None) -> None:
        """Of these step models, unload those loaded only for ensembles that no loaded
        ensemble uses any more, and in turn theirs (a step may be an ensemble)."""
        for key in sorted(keys):
            entry = self.models.get(key)
            if entry is None or not entry.versions or not entry.as_step or self._users_of(key):
                continue
            steps = self._steps_of(entry)
            await self.unload_with_users(entry, deadline)
            await self.unload_unused(steps, deadline)

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

    async def unload_with_users(self, entry: ModelEntry, deadline: float | None = None) -> None:
        for user in self._users_of(entry.key):
            log.info("unloading ensemble '%s': it uses '%s', which is being unloaded", user[1], entry.name)
            self.models[user].waits_for.add(entry.key)
            await self.unload_with_users(self.models[user], deadline)
        await self.unload_entry(entry, deadline)

    def _deadline(self) -> float:
        return time.monotonic() + self.exit_timeout

    async def unload_entry(self, entry: ModelEntry, deadline: float | None = None) -> bool:
        """Unload every version of ``entry``; whether their requests all finished and their
        workers ended in time."""
        async with entry.lock:
            entry.error = ""
            # The versions stay listed (as UNLOADING) until their requests have drained.
            drained = await asyncio.gather(*(v.unload(deadline or self._deadline()) for v in entry.versions.values()))
            entry.unloaded = sorted(entry.versions.keys() | set(entry.unloaded))
            # (a version that served on through a failed reload is listed as unloaded now)
            entry.failed = {v: why for v, why in entry.failed.items() if v not in entry.versions}
            entry.versions = {}
        return all(drained)
