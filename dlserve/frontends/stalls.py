"""Stalled clients: requests still being received, answers nobody reads.

A client that sends a request a byte now and then, or starts a message and stops, holds
its connection and what it sent for as long as it likes unless something looks. A timer
per request would cost every request; instead each listener sweeps its connections every
quarter of its timeout (within [50 ms, 5 s], so a stall is cut at most a quarter late,
and never more than 5 s), and a request pays only for a counter of what it received.

The other way round, a client that reads nothing of what it is sent holds its answers in
the server's memory: :class:`SendProgress` tells it from one that reads slowly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class Sweeper:
    """Runs ``check(now)`` (``time.monotonic()``) every quarter of ``timeout`` seconds
    between :meth:`start` and :meth:`stop`; a ``timeout`` of 0 runs nothing."""

    def __init__(self, timeout: float, check: Callable[[float], None]) -> None:
        self.timeout = timeout
        self._check = check
        self._timer: asyncio.TimerHandle | None = None

    @property
    def every(self) -> float:
        return min(5.0, max(0.05, self.timeout / 4))

    def start(self) -> None:
        if self.timeout > 0 and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.every, self._run)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _run(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(self.every, self._run)
        self._check(time.monotonic())


class SendProgress:
    """Whether a client reads what it is sent: the bytes waiting to go (a transport's
    write buffer) and since when they have not shrunk. One that reads slowly makes
    progress; one that reads nothing does not."""

    __slots__ = ("_unsent", "_since")

    def __init__(self) -> None:
        self._unsent = 0
        self._since = 0.0

    def stalled_for(self, unsent: int, now: float) -> float:
        """Seconds for which ``unsent`` bytes, as many or more, have waited, as far as
        the looks so far tell (0 at the first look, or when they shrank since the last);
        0 when nothing waits."""
        if not unsent:
            self._since = 0.0
        elif not self._since or unsent < self._unsent:
            self._since = now  # (began to wait, or moved since the last look)
        self._unsent = unsent
        return now - self._since if unsent else 0.0


__all__ = ["SendProgress", "Sweeper"]
