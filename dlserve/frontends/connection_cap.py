"""A bound on the connections one listening frontend holds, and who goes when it is reached.

Each connection costs a file descriptor and its buffers. Without a bound, enough clients
(or one that opens connections and sends nothing) use up the process's descriptors, and
then the server can open nothing else: no shared-memory region, no model file, no
worker's channel, while accept() fails in a loop. So each listener holds at most
``limit`` connections: by default a quarter of the process's descriptor limit
(:func:`default_limit`), so that HTTP and gRPC together leave half for the server's own
use. A connection beyond the limit takes the place of the one idle longest (nothing in
flight, nothing partly received), as nginx sheds idle keep-alive connections under
pressure; with none idle, it is refused (HTTP answers 503, gRPC sends a GOAWAY).
"""

from __future__ import annotations

import logging
import resource
from collections.abc import Collection
from typing import Protocol

log = logging.getLogger("dlserve.frontends")

# With no descriptor limit at all, this many per listener.
_UNLIMITED_DEFAULT = 16384
_FLOOR = 16


class Sheddable(Protocol):
    @property
    def idle_since(self) -> float | None:
        """When the connection went idle (loop time); None while it is busy or closing."""

    def shed(self) -> None:
        """Close the connection, idle, to make room (``idle_since`` is None from then on)."""


def default_limit() -> int:
    """A quarter of the process's descriptor limit (at least 16)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return _UNLIMITED_DEFAULT
    return max(_FLOOR, soft // 4)


class ConnectionCap:
    """The bound of one listener: ``limit`` connections (None or 0: :func:`default_limit`).
    Refusals are logged once per spell of them, not once each."""

    def __init__(self, limit: int | None, service: str) -> None:
        self.limit = limit or default_limit()
        self._service = service
        self._refusing = False

    def admit(self, connections: Collection[Sheddable]) -> bool:
        """Whether a new connection may join ``connections`` (which do not hold it yet):
        yes below the limit, or in place of the connection idle longest, which is shed."""
        if len(connections) < self.limit:
            self._refusing = False
            return True
        oldest: Sheddable | None = None
        since = 0.0
        for connection in connections:
            idle = connection.idle_since
            if idle is not None and (oldest is None or idle < since):
                oldest, since = connection, idle
        if oldest is not None:
            oldest.shed()
            self._refusing = False
            return True
        if not self._refusing:
            self._refusing = True
            log.warning(
                "%s connection refused: the server holds its maximum of %d connections, "
                "none of them idle", self._service, self.limit,
            )
        return False

    def refusal(self) -> str:
        """What a refused client is told."""
        return f"the server holds its maximum of {self.limit} connections; try again later"


__all__ = ["ConnectionCap", "Sheddable", "default_limit"]
