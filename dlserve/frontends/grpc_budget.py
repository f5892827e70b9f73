"""The memory that partly received gRPC messages may hold, across a transport's connections.

A message's buffer is filled as its DATA frames come, and flow control alone does not
bound what that holds: each stream may send its whole window (8 MiB) unasked, a message
still being cut gets its window back at once (so that one bigger than the window
arrives), and a connection carries up to a thousand streams. So clients that announce
large messages on many streams and send them slowly could make the server hold
gigabytes. The budget bounds it in two steps:

* past ``soft`` bytes held, only the stream of the oldest partly received message gets
  its window back: the others wait (flow control) until the held bytes fall below
  ``soft`` again, so well-behaved large uploads slow down rather than fail;
* past ``hard``, a call that adds to any message but the oldest is refused
  RESOURCE_EXHAUSTED: what its stream's window still let it send is not taken.

The oldest message always proceeds, so every message of at most the maximum size can
complete; what is held stays under ``hard`` plus that one message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from dlserve.frontends.grpc_calls import Abort

if TYPE_CHECKING:
    from dlserve.frontends.grpc_calls import CallContext

SOFT = 256 << 20
HARD = 1 << 30


class MessageBudget:
    """Bytes held by partly received messages, the oldest first."""

    def __init__(self, soft: int | None = None, hard: int | None = None) -> None:
        self.soft = SOFT if soft is None else soft
        self.hard = HARD if hard is None else hard
        self.held = 0
        self._cutting: dict[CallContext, int] = {}  # (insertion order: oldest first)
        self._waiting: dict[CallContext, None] = {}  # streams whose window is withheld

    def started(self, call: CallContext) -> None:
        """``call`` began receiving a message that does not fit what has come."""
        self._cutting[call] = 0

    def add(self, call: CallContext, nbytes: int) -> None:
        """``nbytes`` more of ``call``'s message are to be kept (Abort past ``hard``)."""
        if self.held + nbytes > self.hard and not self._is_oldest(call):
            raise Abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the server holds {self.held} bytes of partly received messages, its limit "
                f"of {self.hard}; try again later",
            )
        self._cutting[call] += nbytes
        self.held += nbytes

    def ended(self, call: CallContext) -> None:
        """``call``'s message is complete, or dropped: its bytes no longer count here."""
        nbytes = self._cutting.pop(call, None)
        self._waiting.pop(call, None)
        if nbytes is None:
            return
        self.held -= nbytes
        if not self._waiting:
            return
        if self.held <= self.soft:
            waking = list(self._waiting)
        else:  # only the new oldest may go on
            oldest = next(iter(self._cutting), None)
            waking = [oldest] if oldest in self._waiting else []
        for waiting in waking:
            del self._waiting[waiting]
            waiting.connection.reopen(waiting)

    def withholds(self, call: CallContext) -> bool:
        """Whether ``call``'s stream must wait for its window (it is then given it once
        its turn comes, through its connection's ``reopen``)."""
        if self.held <= self.soft or call not in self._cutting or self._is_oldest(call):
            return False
        self._waiting[call] = None
        return True

    def _is_oldest(self, call: CallContext) -> bool:
        return next(iter(self._cutting), None) is call


__all__ = ["HARD", "SOFT", "MessageBudget"]
