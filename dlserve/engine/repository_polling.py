"""Poll mode: each poll lists the repositories again, loads the models that are new or
changed and unloads those that are gone."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from dlserve.engine.ensemble_steps import ensembles_last
from dlserve.engine.object_store import ObjectStoreError
from dlserve.engine.repository import ModelSource

if TYPE_CHECKING:
    from dlserve.engine.manager import ModelManager

log = logging.getLogger("dlserve.engine")


async def poll(manager: ModelManager) -> None:
    """Load new models, reload changed ones, unload removed ones."""
    await manager.refresh_repository()
    found = {k: s for k, s in manager.repository.scan().items() if isinstance(s, ModelSource)}
    models = manager.models
    for key in list(models):
        if key in found or key not in models:
            continue
        if models[key].versions:
            log.info("model '%s' was removed from the repository; unloading", key[1])
            await manager.unloader.unload_with_users(models[key])
        models.forget(key)  # gone from the index too, as in Triton
    for group in ensembles_last(manager.repository, list(found.values())):  # (side by side, as Triton)
        changed = [source for source in group if _changed(manager, source)]
        await asyncio.gather(*(_poll_load(manager, source) for source in changed))


def _changed(manager: ModelManager, source: str | ModelSource) -> bool:
    """New or changed files; with model namespacing, also an ensemble whose steps now mean
    other models, or one unloaded with a step model that is gone when another repository
    has a model of that name (Triton re-resolves both)."""
    assert isinstance(source, ModelSource)
    entry = manager.models.get(source.key)
    if entry is None or entry.fingerprint != source.fingerprint:
        return True
    if not manager.models.namespacing:
        return False
    if entry.versions:
        return manager.loader.steps_moved(source)
    gone = {name for namespace, name in entry.waits_for if (namespace, name) not in manager.models}
    return any(e.versions for name in gone for e in manager.models.named(name))


async def _poll_load(manager: ModelManager, source: str | ModelSource) -> None:
    """Load a model a poll found new or changed."""
    assert isinstance(source, ModelSource)
    log.info("model '%s' is new or changed; loading", source.name)
    failure = await manager.loader.load_in_turn(source)
    if failure is None:
        await manager.loader.ensembles_follow([source.key])
    elif source.key in manager.models:
        # A model that failed to load is tried again once it changes; one the
        # store failed to hand over, at the next poll.
        failed_store = isinstance(failure, ObjectStoreError)
        manager.models[source.key].fingerprint = None if failed_store else source.fingerprint


async def poll_forever(manager: ModelManager, interval: float) -> None:
    """Poll every ``interval`` seconds until cancelled (by the manager's stop())."""
    while True:
        await asyncio.sleep(interval)
        try:
            await manager.poll()
        except ObjectStoreError as exc:  # the store is down: nothing is unloaded for it
            log.warning("repository poll skipped: %s", exc.message)
        except Exception:  # noqa: BLE001 - a poll must never kill the loop
            log.exception("repository poll failed")
