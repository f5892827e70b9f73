"""A bound on the connections one listening frontend holds, and who goes when it is reached.

Each connection costs a file descriptor and its buffers. Without a bound, enough clients
(or one that opens connections and sends nothing) use up the process's descriptors, and
then the server can open nothing else: no shared-memory region, no model file, no
worker's channel, while accept() fails in a loop. So each listener holds at most
``limit`` connections: by default a quarter of the process's descriptor limit, and at
most 16384 (:func:`default_limit`; ``dlserve serve`` first raises its soft limit to the
hard one, as most servers do), so that HTTP and gRPC together leave half for the server's
own use (the metrics listener has a small bound of its own).

A connection beyond the limit takes the place of the one idle longest, as nginx sheds
idle keep-alive connections under pressure; with none idle, it is refused (HTTP answers
503, gRPC sends a GOAWAY) and not counted. Idle means done with at least one request and
waiting for the next, or connected for :data:`FRESH_GRACE` seconds without a word: a
client that has just connected is never shed before it could send its first request.
The idle are kept in the order they went idle, so admission at the bound costs the same
whatever the number of connections.
"""

from __future__ import annotations

import logging
import resource
from typing import Protocol

log = logging.getLogger("dlserve.frontends")

FRESH_GRACE = 1.0  # seconds a new connection has to start its first request before it is idle
# The default never exceeds this (an idle HTTP connection costs ~7 KiB, so ~110 MiB at
# most), whatever the descriptor limit: explicit options go beyond.
_DEFAULT_MOST = 16384
_FLOOR = 16


class Sheddable(Protocol):
    def sheddable(self) -> bool:
        """Whether the connection is idle now (it may have turned busy since it said so)."""

    def shed(self) -> None:
        """Close the idle connection to make room for a new one."""


def default_limit() -> int:
    """A quarter of the process's descriptor limit, within [16, 16384]."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return _DEFAULT_MOST
    return max(_FLOOR, min(soft // 4, _DEFAULT_MOST))


class ConnectionCap:
    """The bound of one listener: ``limit`` connections (None or 0: :func:`default_limit`).

    A connection :meth:`admit` let in is counted until it calls :meth:`left`; between the
    two it says when it goes :meth:`idle` and :meth:`busy` again. Refusals are logged
    once per spell of them, not once each."""

    def __init__(self, limit: int | None, service: str) -> None:
        self.limit = limit or default_limit()
        self.held = 0  # admitted connections not yet lost
        self._service = service
        self._idle: dict[Sheddable, None] = {}  # (insertion order: idle longest first)
        self._refusing = False

    def admit(self) -> bool:
        """Whether a new connection is let in (and counted): below the limit, or in place
        of the connection idle longest, which is shed."""
        if self.held >= self.limit and not self._shed_one():
            if not self._refusing:
                self._refusing = True
                log.warning(
                    "%s connection refused: the server holds its maximum of %d connections, "
                    "none of them idle", self._service, self.limit,
                )
            return False
        self._refusing = False
        self.held += 1
        return True

    def _shed_one(self) -> bool:
        idle = self._idle
        while idle:
            oldest = next(iter(idle))
            del idle[oldest]
            if oldest.sheddable():
                oldest.shed()
                return True
        return False

    def idle(self, connection: Sheddable) -> None:
        """``connection`` (admitted) is idle from now: the last in line to be shed."""
        self._idle.pop(connection, None)
        self._idle[connection] = None

    def busy(self, connection: Sheddable) -> None:
        self._idle.pop(connection, None)

    def left(self, connection: Sheddable) -> None:
        """An admitted connection is gone (a shed one too, once closed)."""
        self.held -= 1
        self._idle.pop(connection, None)

    def refusal(self) -> str:
        """What a refused client is told."""
        return f"the server holds its maximum of {self.limit} connections; try again later"


__all__ = ["FRESH_GRACE", "ConnectionCap", "Sheddable", "default_limit"]
