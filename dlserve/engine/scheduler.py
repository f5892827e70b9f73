"""The default scheduler: a FIFO queue drained by idle, ready instances.

Each ``execute`` gets one request (Triton's default scheduler does not batch). An
idle instance is picked round-robin, so with one request per instance at a time
load spreads evenly. When no instance is ready (all crashed and restarting), new
and queued requests fail at once with UNAVAILABLE and the reason, rather than
waiting on a restart that may never succeed.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import TYPE_CHECKING

from dlserve.engine.request import Request, Response
from dlserve.errors import CancelledError, InternalError, TritonError, UnavailableError

log = logging.getLogger("dlserve.engine")

PIPELINE_DEPTH = 2

if TYPE_CHECKING:
    from dlserve.engine.instance import ModelInstance, Timings
    from dlserve.engine.model import ModelVersion


class Scheduler:
    def __init__(self, model: ModelVersion) -> None:
        self.model = model
        self.queue: collections.deque[Request] = collections.deque()
        self.in_flight = 0
        self._next = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def instances(self) -> list[ModelInstance]:
        return self.model.instances

    def submit(self, request: Request) -> None:
        if self.model.state != "READY":
            self._fail(
                request,
                UnavailableError(f"model '{self.model.name}' version {self.model.version} is not ready"),
            )
            return
        if not any(instance.ready for instance in self.instances):
            self._fail(request, self._unavailable())
            return
        self.queue.append(request)
        self._idle.clear()
        self.dispatch()

    def _unavailable(self) -> UnavailableError:
        model = self.model
        return UnavailableError(
            f"model '{model.name}' version {model.version} has {model.unready_reason()}"
        )

    def dispatch(self) -> None:
        while self.queue:
            instance = self._pick()
            if instance is None:
                return
            batch = [self.queue.popleft()]
            instance.in_flight += 1
            self.in_flight += 1
            self._execute(instance, batch)

    def _pick(self) -> ModelInstance | None:
        """An idle ready instance (round-robin), else one with room in its pipeline.

        Up to PIPELINE_DEPTH executions are sent to a worker at once: it still runs
        them one after another, but the next one is waiting in its socket when the
        previous finishes, so the worker never sleeps between requests under load
        (each sleep/wake-up costs ~50 µs on a small VM).
        """
        instances = self.instances
        count = len(instances)
        fallback = None
        for step in range(count):
            index = (self._next + step) % count
            instance = instances[index]
            if not instance.ready or instance.in_flight >= PIPELINE_DEPTH:
                continue
            if instance.in_flight == 0:
                self._next = (index + 1) % count
                return instance
            if fallback is None:
                fallback = instance
        return fallback

    def _execute(self, instance: ModelInstance, batch: list[Request]) -> None:
        start = time.monotonic_ns()
        queue_ns = [start - r.arrival_ns for r in batch]

        def done(result: list[Response] | TritonError, timings: Timings | None) -> None:
            self._finished(instance, batch, queue_ns, result, timings)

        try:
            instance.execute(batch, done)
        except TritonError as exc:
            done(exc, None)

    def _finished(
        self,
        instance: ModelInstance,
        batch: list[Request],
        queue_ns: list[int],
        result: list[Response] | TritonError,
        timings: Timings | None,
    ) -> None:
        instance.in_flight -= 1
        self.in_flight -= 1
        if isinstance(result, TritonError) or timings is None:
            error = result if isinstance(result, TritonError) else InternalError("execute failed")
            self.model.stats.execution_count += 1  # as Triton: a failed execute still ran
            for request in batch:
                self._fail(request, error, "BACKEND")
        else:
            self.model.stats.record_execution(
                batch_size=sum(self.model.batch_size_of(r) for r in batch),
                request_count=len(batch),
                queue_ns=queue_ns,
                input_ns=timings.input_ns,
                infer_ns=timings.infer_ns,
                output_ns=timings.output_ns,
            )
            # An error the model returns in a response still counts as a success, as
            # in Triton's statistics: the request was executed and answered.
            for request, response in zip(batch, result):
                self._deliver(request, response, None)
        self.dispatch()
        if not self.queue and not self.in_flight:
            self._idle.set()

    def _deliver(self, request: Request, response: Response, failure: str | None) -> None:
        self.model.stats.record_request(time.monotonic_ns() - request.arrival_ns, failure)
        try:
            request.on_response(response)
        except Exception:  # noqa: BLE001 - one caller's broken callback must not hurt others
            log.exception("response callback for request '%s' failed", request.request_id)

    def cancel(self, request: Request) -> bool:
        """Drop a request that is still queued, answering it CANCELLED."""
        try:
            self.queue.remove(request)
        except ValueError:
            return False
        self._fail(request, CancelledError("request was cancelled"), "CANCELED")
        return True

    def _fail(self, request: Request, error: TritonError, failure: str = "OTHER") -> None:
        response = Response(self.model.name, self.model.version, request.request_id, error=error)
        self._deliver(request, response, failure)

    def instance_state_changed(self) -> None:
        """No ready instance left: fail what is queued instead of letting it wait."""
        if self.queue and not any(instance.ready for instance in self.instances):
            error = self._unavailable()
            while self.queue:
                self._fail(self.queue.popleft(), error)
            if not self.in_flight:
                self._idle.set()
        else:
            self.dispatch()

    async def drain(self, timeout: float) -> bool:
        """Wait until nothing is queued or executing; False if ``timeout`` ran out."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False
