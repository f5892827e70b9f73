"""Inline BLS, the server's side: which callers may run a model in their own process.

A BLS call normally crosses four process boundaries (caller -> server -> callee ->
server -> caller); on a small machine that is hundreds of microseconds however little
the callee does (benchmarks/bls_cost.py). A model whose config says
``parameters { key: "INLINE_BLS" value: { string_value: "yes" } }`` lets its
BLS callers run a private instance of it in their own worker process instead, on the
calling thread (:mod:`dlserve.ipc.inline`): the call becomes a function call.

The server says yes to a caller only where that changes nothing a caller could see but
timing and isolation: the model is a plain Python model (not decoupled, no sequence
batching, no response cache), runs on the CPU, in the caller's execution environment,
and the server has no rate limiter to honour. It records who was told yes, tells them
to let their copies go (``Kind.INLINE_DROP``) when any version of the model loads or
unloads, and counts their calls in the model's statistics (``Kind.INLINE_DONE``).
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any

from dlserve.engine.backends import init_message
from dlserve.engine.proto import model_config_pb2 as mc
from dlserve.ipc.protocol import Kind

if TYPE_CHECKING:
    from dlserve.engine.instance import ModelInstance
    from dlserve.engine.model import ModelVersion

log = logging.getLogger("dlserve.engine")

INLINE_PARAMETER = "INLINE_BLS"  # (named as dlserve's ASYNC_EXECUTE_CONCURRENCY is)


def inline_allowed(config: mc.ModelConfig) -> bool:
    """The model's ``INLINE_BLS``: "yes" or "no" (the default); any other value
    fails the load, as Triton's Python backend treats its own yes/no parameters."""
    entry = config.parameters.get(INLINE_PARAMETER)
    value = "no" if entry is None else entry.string_value
    if value not in ("yes", "no"):
        raise ValueError(f"Incorrect value for {INLINE_PARAMETER}: '{value}' (it takes 'yes' or 'no')")
    return value == "yes"


def refusal(target: ModelVersion, caller: ModelVersion) -> str | None:
    """Why ``caller``'s worker may not run ``target`` (a model that allows it) itself;
    None when it may."""
    config = target.config
    if target.is_ensemble or target.decoupled:
        return "an ensemble or a decoupled model"
    if config.HasField("sequence_batching") or target.cache is not None:
        return "sequence batching or a response cache"
    if any(group.kind != mc.ModelInstanceGroup.KIND_CPU for group in config.instance_group):
        return "instances that are not KIND_CPU"
    if target.environment != caller.environment:
        return "another execution environment"
    if target.resources.rate_limiter is not None:
        return "the server's rate limiter"
    if not target.ready:
        return "not ready"
    return None


def offer(name: str, target: ModelVersion | None, caller: ModelInstance) -> dict[str, Any] | None:
    """What ``caller``'s worker needs to run model ``name`` (``target``, the version
    asked for, if loaded) itself: the INIT message of a private instance, with the
    version; None where it may not. Either way ``caller`` is told when a version of the
    model loads or unloads, so that it asks again then."""
    resources = caller.model.resources
    resources.inline_callers.setdefault(name, weakref.WeakSet()).add(caller)
    if target is None or not inline_allowed(target.config):
        return None
    reason = refusal(target, caller.model)
    if reason is not None:
        log.info("BLS calls of '%s' into '%s' go through the server: %s", caller.name, name, reason)
        return None
    message = init_message(target, "CPU", f"{target.name}_inline_{caller.name}", 0)
    return {**message, "name": target.name, "version": target.version}


def drop(target: ModelVersion) -> None:
    """A version of ``target``'s model loads or unloads: the copies callers hold go,
    and their next call asks again (and may be told no, or get the new version)."""
    callers = target.resources.inline_callers.pop(target.name, None)
    for instance in list(callers or ()):
        channel = instance.channel
        if channel is not None:
            channel.notify(Kind.INLINE_DROP, [target.name])


def record(target: ModelVersion, body: Any) -> None:
    """A caller's inline call, in ``target``'s statistics as its own executions count:
    one execute of one request that spent no time queued."""
    batch_size, ok, input_ns, infer_ns, output_ns, duration_ns = body
    stats = target.stats
    if ok:
        stats.record_execution(batch_size, 1, [0], input_ns, infer_ns, output_ns)
        stats.record_request(duration_ns)
    else:
        stats.record_failed_execution(batch_size, infer_ns)
        stats.record_request(duration_ns, "BACKEND")
