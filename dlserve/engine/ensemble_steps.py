"""An ensemble's steps at its load: ensembles load after the models they run, each step
is resolved to the model it means (see :mod:`dlserve.engine.manager`), and the ensemble
is checked against its steps' loaded models."""

from __future__ import annotations

import contextlib

from dlserve.engine import config as cfg
from dlserve.engine import ensemble
from dlserve.engine.model_table import ModelTable
from dlserve.engine.proto import model_config_pb2 as mc
from dlserve.engine.repository import ModelKey, ModelSource, Repository
from dlserve.errors import InvalidArgumentError, TritonError


def ensembles_last(
    repository: Repository, wanted: list[str | ModelSource]
) -> tuple[list[str | ModelSource], list[str | ModelSource]]:
    """``wanted`` split in two: what is not an ensemble (or cannot be told: a remote
    model not fetched yet, a config that does not parse), then the ensembles."""

    def is_ensemble(source: ModelSource) -> bool:
        try:
            config = repository.read_config(source)
        except (TritonError, OSError):
            return False
        return config is not None and config.platform == cfg.ENSEMBLE_PLATFORM

    first: list[str | ModelSource] = []
    last: list[str | ModelSource] = []
    for what in wanted:
        try:
            sources = [what] if isinstance(what, ModelSource) else repository.find(what)
        except TritonError:  # unknown or ambiguous: its load says so
            sources = []
        (last if any(is_ensemble(s) for s in sources) else first).append(what)
    return first, last


def resolve_steps(
    models: ModelTable, source: ModelSource, config: mc.ModelConfig, listed: dict[ModelKey, ModelSource | str]
) -> list[ModelKey]:
    """Resolve the ensemble's steps to models (written into each step's
    ``model_namespace``); the models they run, sorted."""
    keys: dict[str, ModelKey] = {}
    for step in config.ensemble_scheduling.step:
        key = keys.get(step.model_name) or _step_key(models, source, step.model_name, listed)
        keys[step.model_name] = key
        step.model_namespace = key[0]
    return sorted(set(keys.values()))


def _step_key(
    models: ModelTable, ensemble_source: ModelSource, step: str, listed: dict[ModelKey, ModelSource | str]
) -> ModelKey:
    """The model an ensemble's step names: with namespacing, the one in the
    ensemble's repository, else the only one listed or loaded."""
    if not models.namespacing:
        found = listed.get(("", step))
        if isinstance(found, str):  # loaded from one of them or not, it is ambiguous
            raise InvalidArgumentError(
                f"failed to load ensemble '{ensemble_source.name}': {found}; with model "
                "namespacing on (--model-namespacing), the one in the ensemble's repository is taken"
            )
        return ("", step)
    own = (ensemble_source.namespace, step)
    if own in listed or (own in models and models[own].versions):
        return own
    candidates = {k for k in listed if k[1] == step} | {e.key for e in models.named(step) if e.versions}
    if len(candidates) > 1:
        raise InvalidArgumentError(
            f"failed to load ensemble '{ensemble_source.name}': its step model '{step}' is in "
            f"{len(candidates)} model repositories, none of them the ensemble's"
        )
    return candidates.pop() if candidates else own


def check_steps(models: ModelTable, repository: Repository, name: str, config: mc.ModelConfig) -> None:
    """Check an ensemble against its steps' loaded models, as Triton does at load
    (ensemble.check_step), and make it decoupled if one of them is: a streaming step
    makes a streaming ensemble, whatever its config said (Triton's rule). A step not
    loaded yet (a remote or nested ensemble's, loading beside it) is judged by its
    config.pbtxt, for decoupling only."""
    decoupled: set[int] = set()  # the steps that are
    for index, step in enumerate(ensemble.steps_of(config)):
        key = (step.namespace, step.model)
        entry = models.get(key)
        model = entry.latest_loaded() if entry is not None else None
        if entry is None or model is None:
            source = repository.scan().get(key)
            if not isinstance(source, ModelSource) or (entry is not None and entry.error):
                # None such, or it failed to load: the ensemble cannot run (Triton's words)
                raise InvalidArgumentError(unavailable_steps(name, step.model))
            with contextlib.suppress(TritonError):
                listed = repository.read_config(source)
                if listed and listed.model_transaction_policy.decoupled:
                    decoupled.add(index)
            continue
        if step.version >= 0:
            model = entry.versions.get(step.version)
            if model is None or model.state != "READY":
                raise InvalidArgumentError(
                    f"ensemble '{name}' depends on '{step.model}' whose required version "
                    f"{step.version} is not loaded."
                )
        ensemble.check_step(config, name, step, model.config)
        if model.decoupled:
            decoupled.add(index)
    ensemble.check_origins(config, name, decoupled)
    if decoupled:
        config.model_transaction_policy.decoupled = True
        cfg.check_response_cache(config, name)


def unavailable_steps(ensemble_name: str, step: str) -> str:
    return f"ensemble {ensemble_name} contains models that are not available or ambiguous: {step}"
