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
from dlserve.errors import CancelledError, TritonError, UnavailableError

log = logging.getLogger("dlserve.engine")

if TYPE_CHECKING:
    from dlserve.engine.instance import ModelInstance
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
        instances = self.instances
        count = len(instances)
        while self.queue:
            for step in range(count):
                instance = instances[(self._next + step) % count]
                if instance.ready and not instance.busy:
                    self._next = (self._next + step + 1) % count
                    break
            else:
                return
            batch = [self.queue.popleft()]
            instance.busy = True
            self.in_flight += 1
            asyncio.get_running_loop().create_task(self._run(instance, batch))

    async def _run(self, instance: ModelInstance, batch: list[Request]) -> None:
        start = time.monotonic_ns()
        queue_ns = [start - r.arrival_ns for r in batch]
        try:
            responses, timings = await instance.execute(batch)
        except TritonError as exc:
            for request in batch:
                self._fail(request, exc)
        else:
            self.model.stats.record_execution(
                batch_size=sum(self.model.batch_size_of(r) for r in batch),
                request_count=len(batch),
                queue_ns=queue_ns,
                input_ns=timings.input_ns,
                infer_ns=timings.infer_ns,
                output_ns=timings.output_ns,
            )
            for request, response in zip(batch, responses):
                self._deliver(request, response)
        finally:
            instance.busy = False
            self.in_flight -= 1
            self.dispatch()
            if not self.queue and not self.in_flight:
                self._idle.set()

    def _deliver(self, request: Request, response: Response) -> None:
        self.model.stats.record_request(
            response.error is None, time.monotonic_ns() - request.arrival_ns
        )
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
        self._fail(request, CancelledError("request was cancelled"))
        return True

    def _fail(self, request: Request, error: TritonError) -> None:
        response = Response(self.model.name, self.model.version, request.request_id, error=error)
        self._deliver(request, response)

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
