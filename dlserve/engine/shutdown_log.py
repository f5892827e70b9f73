"""What a stopping server waits for, logged once a second in tritonserver's words.

Deployment scripts and people reading a pod's log grep these lines to tell a shutdown
that drains from one that hangs (side by side with Triton 2.51): first the model
versions that still have requests in flight, until none has; then "All models are
stopped, unloading models" and the models still loaded, until none is. Each line
starts with the seconds left of the exit timeout, as Triton's do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from dlserve.engine.model import ModelVersion

log = logging.getLogger("dlserve.engine")

VersionsInFlight = Callable[[], list[tuple[ModelVersion, int]]]


class ShutdownLog:
    """Runs on the engine's loop from the start of a stop until :meth:`finish`."""

    def __init__(
        self, deadline: float, in_flight: VersionsInFlight, live_models: Callable[[], int]
    ) -> None:
        self._deadline = deadline
        self._in_flight = in_flight
        self._live_models = live_models
        self._draining = True  # (then unloading)
        self._done = False
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    def unloading(self) -> None:
        """The services drained and the models unload now: say so at once, before the
        first of them says it unloaded."""
        if self._draining:
            self._log()

    async def finish(self) -> None:
        """Every model is unloaded (or the timeout ran out): the last line, then done."""
        self._done = True
        self._wake.set()
        await self._task

    async def _run(self) -> None:
        while True:
            self._log()
            if self._done:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)

    def _log(self) -> None:
        left = max(0, round(self._deadline - time.monotonic()))
        if self._draining:
            busy = self._in_flight()
            log.info(
                "Timeout %d: Found %d model versions that have in-flight inferences",
                left, len(busy),
            )
            for version, count in busy:
                log.info(
                    "Model '%s' (version %d) has %d in-flight inferences",
                    version.name, version.version, count,
                )
            if busy:
                return  # (at the end, the timeout ran out with them: the caller says so)
            self._draining = False
            log.info("All models are stopped, unloading models")
        live = 0 if self._done else self._live_models()
        log.info(
            "Timeout %d: Found %d live models and 0 in-flight non-inference requests", left, live
        )
