"""The link between ``pb_utils`` and the worker process hosting the model.

The worker installs its runtime here at start-up; pb_utils objects that need the
server (logging, shared-memory allocation, later BLS and metrics) reach it through
:func:`current`. Outside a worker — a model imported by a unit test — there is no
runtime and those objects fall back to local behaviour.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from dlserve.memory.arena import Arena


class Runtime(Protocol):
    arena: Arena

    def log(self, level: int, message: str) -> None: ...

    def request(self, kind: int, body: Any) -> Any:
        """Send to the server and wait for its reply (raises its error)."""
        ...

    def notify(self, kind: int, body: Any) -> None:
        """Send to the server without waiting."""
        ...


_current: Runtime | None = None


def current() -> Runtime | None:
    return _current


def install(runtime: Runtime | None) -> None:
    global _current
    _current = runtime
