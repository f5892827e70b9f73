"""``InferenceResponseSender``: how a model answers a request outside ``execute``'s return.

Every request handed to ``execute`` carries an :class:`Exchange`, its link back to
the server. The request and its sender both hold it; the sender never holds the
request, so once the model lets go of both, the exchange dies at once (reference
counting, no cycle to wait for) — and if it dies before the final response was sent,
it sends a final error for the request instead of leaving the client hanging.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol

from dlserve.errors import TritonError
from dlserve.pb_utils import _runtime
from dlserve.pb_utils.errors import TritonModelException

if TYPE_CHECKING:
    from dlserve.pb_utils.inference import InferenceResponse

RESPONSE_COMPLETE_FINAL = 1


class Answerer(Protocol):
    """Where a received request's answers go (the worker's runtime is one)."""

    def send_response(self, exchange: Exchange, response: InferenceResponse | None, final: bool) -> None: ...

    def abandon(self, exchange: Exchange) -> None: ...

    def is_cancelled(self, exchange: Exchange) -> bool: ...


class Exchange:
    """What the worker knows about one received request's answers."""

    __slots__ = (
        "handle",
        "requested",
        "destinations",
        "decoupled",
        "closed",
        "responses",
        "cancelled",
        "rescheduled",
        "lock",
        "runtime",
        "__weakref__",
    )

    def __init__(
        self,
        handle: int,
        requested: list[str],
        destinations: dict[str, Any] | None,
        decoupled: bool,
    ) -> None:
        self.handle = handle
        self.requested = requested
        # Output name -> shared memory (uint8 array) the server wants it written into.
        self.destinations = destinations
        self.decoupled = decoupled
        self.closed = False  # the final response went out (or the server was told otherwise)
        self.responses = 0
        self.cancelled = False
        # Rescheduled, its next execute to come: letting go of it now abandons nothing (the
        # next execute gets this exchange again while its sender lives, as in Triton).
        self.rescheduled = False
        # Held through a send: the checks, the counts and the sending are one step for the
        # model's threads. Re-entrant: a finalizer may send in the middle of a send.
        self.lock = threading.RLock()
        # Where its answers go: the worker's runtime (the server), unless the request is
        # an inline BLS call's (dlserve.ipc.inline), whose caller takes them itself.
        self.runtime: Answerer | None = None

    def answered_by(self) -> Answerer | None:
        return self.runtime if self.runtime is not None else _runtime.current()

    def __del__(self) -> None:
        if not self.closed and not self.rescheduled:
            runtime = self.answered_by()
            if runtime is not None:
                runtime.abandon(self)


def _closed_error() -> TritonModelException:
    return TritonModelException("Unable to send response. Response sender has been closed.")


class InferenceResponseSender:
    """``request.get_response_sender()``: send responses from any thread, at any time.

    ``send`` does not wait for the server: the response is on its way when it returns,
    and a full channel (a slow client) pushes back by blocking the call.
    """

    __slots__ = ("_exchange",)

    def __init__(self, exchange: Exchange) -> None:
        self._exchange = exchange

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        from dlserve.pb_utils.inference import InferenceResponse

        if flags not in (0, RESPONSE_COMPLETE_FINAL):
            raise TritonModelException(
                f"send flags must be 0 or TRITONSERVER_RESPONSE_COMPLETE_FINAL, got {flags!r}"
            )
        if response is not None and not isinstance(response, InferenceResponse):
            raise TritonModelException(
                f"send takes a pb_utils.InferenceResponse or None, got {type(response).__name__}"
            )
        final = flags == RESPONSE_COMPLETE_FINAL
        if response is None and not final:
            raise TritonModelException(
                "send needs a response, or flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL to close "
                "the request without one"
            )
        with self._exchange.lock:
            self._send(response, final)

    def _send(self, response: InferenceResponse | None, final: bool) -> None:
        exchange = self._exchange
        if exchange.closed:
            raise _closed_error()
        if not exchange.decoupled:
            if response is not None and exchange.responses:
                raise TritonModelException(
                    "Unable to send response. Non-decoupled model cannot send more than one response."
                )
            if response is None and not exchange.responses:
                raise TritonModelException(
                    "Unable to send response. Non-decoupled model cannot send complete final "
                    "before sending a response."
                )
        runtime = exchange.answered_by()
        if runtime is None:
            raise TritonModelException("responses can only be sent inside a dlserve worker")
        # Counted (and closed) before it goes, so that a send re-entering on this thread
        # sees it; a response that could not go (no shared memory for its outputs, say)
        # is taken back, so that the model can still answer the request, with an error
        # perhaps.
        if response is not None:
            exchange.responses += 1
        if final:
            exchange.closed = True
        try:
            runtime.send_response(exchange, response, final)
        except BaseException as exc:
            if response is not None:
                exchange.responses -= 1
            if final:
                exchange.closed = False
            if isinstance(exc, TritonError):  # (what pb_utils raises to a model, as Triton's)
                raise TritonModelException(exc.message) from None
            raise

    def is_cancelled(self) -> bool:
        """Whether the request was cancelled (its client went away, or a BLS caller
        cancelled it). Cheap, never a round trip: a flag the server sets, and while it
        is unset one non-blocking look at the channel when nothing else reads it."""
        runtime = self._exchange.answered_by()
        return runtime is not None and runtime.is_cancelled(self._exchange)

    def __repr__(self) -> str:
        state = "closed" if self._exchange.closed else "open"
        return f"pb_utils.InferenceResponseSender({state})"
