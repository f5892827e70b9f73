"""How a failed load is said, in Triton's words: its log lines, the reason the index
lists and the error its loader gets."""

from __future__ import annotations

import logging

from dlserve.errors import TritonError

log = logging.getLogger("dlserve.engine")


def log_load_failure(name: str, exc: TritonError, namespace: str = "") -> None:
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


def load_failed(name: str, exc: TritonError) -> TritonError:
    """``exc`` as Triton words an ensemble's failure at load for the loader; the index
    lists it without the prefix (:func:`listed`)."""
    failure = type(exc)(f"load failed for model '{name}': {exc.message}\n")
    failure.listed = exc.message  # type: ignore[attr-defined]
    return failure


def version_failure(exc: TritonError) -> str:
    """Why a version failed to load, as Triton's index and load error say it."""
    return f"{exc.code.words}: {exc.message}"


def listed(exc: TritonError) -> str:
    """What the index says of a failed load (see :func:`load_failed`)."""
    return getattr(exc, "listed", exc.message)
