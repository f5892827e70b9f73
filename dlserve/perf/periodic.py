"""perf_analyzer's periodic concurrency mode (``--periodic-concurrency-range START:END:STEP
--request-period N``), meant for decoupled models streamed (an LLM's tokens).

START requests go out at once; each time every request of the latest group has had N
answers (a stream's flag-only final counts, as in perf_analyzer), STEP more go out, until
END requests in all; the run ends when every one has had its final answer. Each request
is sent once, on a stream of its own or one a finished request left. There are no
windows and no stability check: the run is one window, which the profile export holds.

A request whose final answer comes before its N-th ends the run with perf_analyzer's
reason. Unlike perf_analyzer, which counts the groups it sent rather than the requests
(and so sends more than END when START is above STEP), the requests stop at END.
"""

from __future__ import annotations

import asyncio

from dlserve.perf.clients import RequestError
from dlserve.perf.load import LoadGenerator
from dlserve.perf.measure import ClientWindow

PERIOD_NOT_REACHED = (  # (perf_analyzer's words)
    "Request received final response before request period was reached. "
    "Request period must be at most the total number of responses received by any request."
)


class PeriodicLoad:
    """One periodic run on ``generator``; :meth:`run` returns its window."""

    def __init__(self, generator: LoadGenerator, periodic_range: tuple[int, int, int], period: int) -> None:
        self.generator = generator
        self.start, self.end, self.step = periodic_range
        self.period = period
        self._tasks: set[asyncio.Task[None]] = set()
        self._sent = 0
        self._finished = 0
        self._waiting = 0  # requests of the latest group yet to have `period` answers
        self._error: Exception | None = None
        self._wake = asyncio.Event()  # a request finished

    async def run(self) -> ClientWindow:
        self.generator.collect()  # (the window starts now)
        self._send(self.start)
        try:
            while self._error is None and self._finished < self.end:
                self._wake.clear()
                await self._wake.wait()
        finally:
            pending = [task for task in self._tasks if not task.done()]
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        if self._error is not None:
            raise RequestError(str(self._error) or type(self._error).__name__)
        return self.generator.collect()

    def _send(self, count: int) -> None:
        self._waiting = count
        self._sent += count
        loop = asyncio.get_running_loop()
        for _ in range(count):
            self._tasks.add(loop.create_task(self._request()))

    def _reached_period(self) -> None:
        self._waiting -= 1
        if self._waiting == 0 and self._sent < self.end:
            self._send(self.step)

    async def _request(self) -> None:
        answers = 0

        def answered() -> None:
            nonlocal answers
            answers += 1
            if answers == self.period:
                self._reached_period()

        try:
            await self.generator.send_once(answered)
            if answers < self.period:
                raise RequestError(PERIOD_NOT_REACHED)
        except Exception as exc:  # noqa: BLE001 - any failure ends the run with its reason
            self._error = self._error or exc
        finally:
            self._finished += 1
            self._wake.set()
