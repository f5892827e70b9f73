"""A load whose config changes only ``instance_group`` updates the serving versions'
instances in place, as Triton's does, instead of reloading them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from dlserve.engine.load_errors import version_failure
from dlserve.engine.model import ModelVersion
from dlserve.engine.model_table import ModelEntry
from dlserve.engine.proto import model_config_pb2 as mc
from dlserve.engine.repository import ModelSource
from dlserve.errors import InvalidArgumentError, TritonError
from dlserve.ipc.supervisor import WorkerProcess


async def update_instances(
    entry: ModelEntry,
    source: ModelSource,
    config: mc.ModelConfig,
    versions: list[int],
    *,
    config_name: str,
    exit_timeout: float,
    starting: set[ModelVersion | WorkerProcess],
) -> bool:
    """Load ``config`` by updating the serving versions' instances in place, as Triton
    does when the model's files (but its config.pbtxt) are unchanged, the same versions
    serve, and the config differs from theirs at most in ``instance_group``
    (ModelVersion.update_instances); False where a full reload is needed. If an
    instance fails to start, the versions serve on as they were and the load fails,
    in Triton's words ("version N is at READY state: ..."). ``config_name``: the
    repository's --model-config-name; ``starting``: what the loads are starting."""
    if not in_place(entry, source, config, versions, config_name=config_name):
        return False
    serving = entry.versions
    starting.update(serving.values())  # (a stop meanwhile ends their workers)
    try:
        results = await asyncio.gather(
            *(v.update_instances(config, exit_timeout) for v in serving.values()), return_exceptions=True
        )
    finally:
        starting.difference_update(serving.values())
    failed = {version: r for version, r in zip(serving, results) if isinstance(r, BaseException)}
    for error in failed.values():
        if not isinstance(error, TritonError):  # (a bug, or a cancellation)
            raise error
    for model in serving.values():
        model.reason = ""
    if failed:
        raise refused(entry, source.name, failed)  # type: ignore[arg-type]
    return True


def in_place(
    entry: ModelEntry, source: ModelSource, config: mc.ModelConfig, versions: list[int], *, config_name: str
) -> bool:
    """Whether loading ``config`` updates the serving versions' instances (see
    update_instances) rather than reloading them."""
    serving = entry.versions
    if not serving or sorted(serving) != sorted(versions):
        return False
    if any(v.state != "READY" or v.is_ensemble for v in serving.values()):
        return False
    if entry.fingerprint is None:
        return False
    config_file = source.config_path(config_name)
    if not _same_files(entry.fingerprint, source.fingerprint, source.path, config_file):
        return False
    return all(_alike_but_instances(v.config, config) for v in serving.values())


def refused(entry: ModelEntry, name: str, failed: dict[int, TritonError]) -> InvalidArgumentError:
    """An instance update that failed (a new instance did not start, or the new groups are
    invalid): the versions serve on as they were, READY, with the reason, as in Triton."""
    entry.tried = []  # (the versions serve on: no version failed to load)
    for version, error in failed.items():
        entry.versions[version].reason = version_failure(error)
    states = "".join(
        f"version {v} is at READY state: {entry.versions[v].reason};\n" for v in sorted(failed)
    )
    return InvalidArgumentError(f"load failed for model '{name}': {states}")


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
