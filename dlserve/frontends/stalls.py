"""A periodic look at requests that are still being received, for their timeouts.

A client that sends a request a byte now and then, or starts a message and stops, holds
its connection and what it sent for as long as it likes unless something looks. A timer
per request would cost every request; instead each listener sweeps its connections every
quarter of its timeout (within [50 ms, 5 s], so a stall is cut at most a quarter late,
and never more than 5 s), and a request pays only for a counter of what it received.
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


__all__ = ["Sweeper"]
