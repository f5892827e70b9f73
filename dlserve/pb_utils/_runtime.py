"""The link between ``pb_utils`` and the worker process hosting the model.

The worker installs its runtime here at start-up; pb_utils objects that need the
server (logging, metrics, responses, BLS, model control) reach it through
:func:`current`. Outside a worker — a model imported by a unit test — there is no
runtime and those objects fall back to local behaviour or say they need a worker.
"""

from __future__ import annotations

import contextvars
import sys
from typing import TYPE_CHECKING, Any, Protocol

from dlserve.pb_utils.errors import TritonModelException

if TYPE_CHECKING:
    from dlserve.memory.arena import Arena
    from dlserve.pb_utils.inference import InferenceRequest, InferenceResponse
    from dlserve.pb_utils.sender import Exchange


class Runtime(Protocol):
    arena: Arena
    instance_name: str  # the model instance the worker hosts, as Triton names it ("m_0_0")

    def log(self, level: int, message: str, filename: str, line: int) -> None:
        """Queue a log line to the server; ``filename`` and ``line``: the model's code that logged it."""
        ...

    def request(self, kind: int, body: Any) -> Any:
        """Send to the server and wait for its reply (raises its error)."""
        ...

    def notify(self, kind: int, body: Any) -> None:
        """Send to the server without waiting."""
        ...

    def release_metric_family(self, name: str) -> None:
        """The model let go of a ``MetricFamily`` of this name."""
        ...

    def send_response(self, exchange: Exchange, response: InferenceResponse | None, final: bool) -> None:
        """Send one response (or, with None, just the final flag) for a received request."""
        ...

    def abandon(self, exchange: Exchange) -> None:
        """The model dropped a request without sending its final response."""
        ...

    def is_cancelled(self, exchange: Exchange) -> bool: ...

    def infer(self, request: InferenceRequest, decoupled: bool) -> Any:
        """Run a BLS request and wait: a response, or an iterator of responses."""
        ...

    async def async_infer(self, request: InferenceRequest, decoupled: bool) -> Any: ...


_current: Runtime | None = None
model_dir: str | None = None  # get_model_dir's answer in a worker: the model's version folder
# While a model another runs inline (dlserve.ipc.inline) initializes, executes or
# finalizes, on that thread: its own version folder.
inline_model_dir: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "dlserve_inline_model_dir", default=None
)


def current() -> Runtime | None:
    return _current


def install(runtime: Runtime | None) -> None:
    global _current
    _current = runtime


def failure(operation: str, reason: str) -> TritonModelException:
    """Triton's error for a pb_utils call its backend refused: the call's words, then the
    reason under the name of the model instance that asked (outside a worker, no name)."""
    runtime = current()
    if runtime is not None:
        model = runtime.instance_name
        reason = f"Failed to process the request for model '{model}', message: {reason}"
    return TritonModelException(f"{operation}: {reason}")


class ForkedChild:
    """The runtime of a process the model forked (``multiprocessing``): the worker's
    channel to the server is not its to use (its writes would mix with the worker's, and
    the replies go to the worker), so whatever needs the server fails at once instead
    of waiting forever, and its log lines go to its stderr (which reaches the server's)."""

    def __init__(self, instance_name: str) -> None:
        self.instance_name = instance_name  # (for the errors of calls that need no server)

    def log(self, level: int, message: str, filename: str, line: int) -> None:
        print(f"{filename}:{line}] {message}", file=sys.stderr, flush=True)

    def __getattr__(self, name: str) -> Any:
        raise TritonModelException(
            "a process the model forked (multiprocessing) cannot reach the server: make BLS "
            "calls, responses and the other calls that need it from the model's own process "
            "(threads can)"
        )


def forked() -> None:
    """In a child the worker forked (``os.register_at_fork``)."""
    parent = current()
    install(ForkedChild(parent.instance_name if parent is not None else ""))
