"""Scheduling: what every scheduler shares, and Triton's default scheduler.

A scheduler owns the requests of one model version from arrival to their last
response: it queues them, hands batches to ready instances, records statistics
and delivers responses. Subclasses decide only *what* runs next
(:meth:`Scheduler._enqueue` / :meth:`Scheduler._next_batch`): the default one sends
requests one at a time, the dynamic batcher (:mod:`batcher`) groups them, the
sequence batcher (:mod:`sequence`) keeps each sequence on one instance.

When no instance is ready (all crashed and restarting), new and queued requests
fail at once with UNAVAILABLE and the reason, rather than waiting on a restart
that may never succeed.

A request is *finished* once its final response is delivered; nothing is delivered
for it after that, whatever arrives late (a cancelled request's real answer, a
worker's error after the model already answered). Cancelling a request finishes it
at once with CANCELLED, so no caller ever waits on a model that ignores cancellation.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import re
import time
from typing import TYPE_CHECKING

from dlserve.engine import response_cache
from dlserve.engine.request import NOT_RUN, STREAMING, Request, Response, reschedule_refused
from dlserve.errors import (
    CancelledError,
    InternalError,
    InvalidArgumentError,
    TritonError,
    UnavailableError,
)

if TYPE_CHECKING:
    from dlserve.engine.instance import ModelInstance, Timings
    from dlserve.engine.model import ModelVersion

log = logging.getLogger("dlserve.engine")


def delay_count(variable: str) -> int:
    """A test hook of Triton's that its upstream tests set (TRITONSERVER_DELAY_SCHEDULER,
    TRITONSERVER_BACKLOG_DELAY_SCHEDULER): how many requests a batcher holds back until
    they are queued, read as C's ``atoi`` reads the variable (0 when unset or not a number)."""
    match = re.match(r"\s*([+-]?\d+)", os.environ.get(variable, ""))
    return max(int(match.group(1)), 0) if match else 0


class Scheduler:
    """The shared mechanics; see the module docstring."""

    # Executions sent to one worker at once. Above 1, the next execute waits in the
    # worker's socket while the previous runs, so the worker never sleeps between
    # requests under load (each sleep/wake-up costs ~50 µs on a small VM). Batching
    # schedulers use 1 so requests accumulate into batches while an instance works (and
    # the default scheduler with more than one instance: see there).
    pipeline_depth = 2
    # Send an instance its next execute as soon as its worker replies, before the
    # finished one's responses are read and delivered: where nothing is pipelined the
    # worker would sit idle meanwhile (batched add_sub at concurrency 16: +4-5%). Not
    # with a pipeline: the worker has its next execute already, and the responses go
    # first (dispatching first there measured ~5% lower gRPC add_sub at concurrency 4).
    dispatch_on_reply = False

    def __init__(self, model: ModelVersion) -> None:
        self.model = model
        self.unfinished = 0  # accepted requests whose final response has not gone out
        self.ensemble_holds = 0  # ensemble requests that will send it a step (keep_for_ensemble)
        self._next = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._timer: asyncio.TimerHandle | None = None  # a dispatch due later (batching delays)
        self._timer_at = 0

    @property
    def instances(self) -> list[ModelInstance]:
        return self.model.instances

    # -- what subclasses decide -----------------------------------------------------------
    def _enqueue(self, request: Request) -> None:
        raise NotImplementedError

    def _next_batch(self, instance: ModelInstance) -> list[Request] | None:
        """The requests to run on ``instance`` now, or None to wait."""
        raise NotImplementedError

    def _take_all(self) -> list[Request]:
        """Empty the queue (nothing can run any more) and return what was in it."""
        raise NotImplementedError

    def _remove(self, request: Request) -> bool:
        raise NotImplementedError

    @property
    def pending(self) -> int:
        """Requests waiting to execute (Triton's pending request count)."""
        raise NotImplementedError

    def open_sequences(self) -> int:
        """Sequences started and not ended (only a sequence batcher has any)."""
        return 0

    def continues(self, request: Request) -> bool:
        """Whether ``request`` continues a sequence this scheduler has open."""
        return False

    # -- submission ---------------------------------------------------------------------
    def keep_for_ensemble(self) -> None:
        """An ensemble request that will send this version a step later keeps it, as
        Triton's ensembles keep their steps' models from the request's start: an unload
        drains until it lets go, and meanwhile the version takes its step calls (those
        marked ``to_kept_version``; others' are refused as the version unloads)."""
        self.ensemble_holds += 1
        self._idle.clear()

    def release_for_ensemble(self) -> None:
        self.ensemble_holds -= 1
        self._set_idle_if_done()

    def _set_idle_if_done(self) -> None:
        if not self.unfinished and not self.ensemble_holds:
            self._idle.set()

    def submit(self, request: Request) -> None:
        if not self._accept(request) or self._started_at_once(request):
            return
        if not any(instance.serves for instance in self.instances):
            self._fail(request, self._unavailable())
            return
        try:
            self._enqueue(request)
        except InvalidArgumentError as exc:
            # A client's mistake the scheduler finds (a sequence without its START, say):
            # counted nowhere, as Triton counts its other validation errors.
            request.counted = True
            self._fail(request, exc)
            return
        except TritonError as exc:
            self._fail(request, exc, "REJECTED")
            return
        self.dispatch()

    def _accept(self, request: Request) -> bool:
        """Take ``request`` on (it is ours until its final response); False when it was
        answered at once because the model version is not ready."""
        request.owner = self
        self.unfinished += 1
        self._idle.clear()
        kept = request.to_kept_version and self.model.state == "UNLOADING"
        if self.model.state != "READY" and not kept:
            self._fail(
                request,
                UnavailableError(f"model '{self.model.name}' version {self.model.version} is not ready"),
            )
            return False
        cache = self.model.cache
        if cache is not None:
            hit = response_cache.answer(cache, self.model, request)
            if hit is not None:
                self._answer_from_cache(request, hit)
                return False
        return True

    def _answer_from_cache(self, request: Request, response: Response) -> None:
        # A hit that could not be written into the client's memory is a failed request.
        self._deliver(request, response, None if response.error is None else "OTHER")

    def _unavailable(self) -> UnavailableError:
        model = self.model
        return UnavailableError(
            f"model '{model.name}' version {model.version} has {model.unready_reason()}"
        )

    def _has_queued(self) -> bool:
        """Whether anything may be waiting to run (True where that is not cheap to tell:
        _next_batch then says)."""
        return True

    def _started_at_once(self, request: Request) -> bool:
        """Whether ``request`` went straight to an instance, as a dispatch would send it
        (True only where the scheduler can tell that cheaply: see DefaultScheduler)."""
        return False

    def dispatch(self) -> None:
        while self._has_queued():
            picked = self._pick()
            if picked is None:
                return
            instance, index = picked
            batch = self._next_batch(instance)
            if not batch:
                return
            self._run(instance, index, batch)

    def _run(self, instance: ModelInstance, index: int, batch: list[Request]) -> None:
        self._next = (index + 1) % len(self.instances)  # (the turn passes only with work)
        self._execute(instance, batch)

    def has_room(self, instance: ModelInstance) -> bool:
        """Ready, with room for another execute (async models take many at once), and the
        rate limiter's resources for it, if there is a rate limiter (which, when they are
        taken, notes this scheduler to dispatch again when they come back)."""
        if not instance.serves or instance.in_flight >= (instance.concurrency or self.pipeline_depth):
            return False
        limiter = self.model.resources.rate_limiter
        return limiter is None or limiter.admits(instance, self)

    def _pick(self) -> tuple[ModelInstance, int] | None:
        """The least-loaded ready instance with room in its pipeline (ties round-robin),
        and its index."""
        instances = self.instances
        count = len(instances)
        best: ModelInstance | None = None
        best_index = 0
        for step in range(count):
            index = (self._next + step) % count
            instance = instances[index]
            if not self.has_room(instance):
                continue
            if best is None or instance.in_flight < best.in_flight:
                best, best_index = instance, index
                if instance.in_flight == 0:
                    break
        return None if best is None else (best, best_index)

    # -- execution ----------------------------------------------------------------------
    def _execute(self, instance: ModelInstance, batch: list[Request]) -> None:
        limiter = self.model.resources.rate_limiter
        taken = limiter.acquire(instance) if limiter is not None else None
        instance.in_flight += 1
        start = time.monotonic_ns()
        busy, waited = True, 0

        def release(dispatch: bool) -> None:
            """The worker is done with this execute: the instance may take its next,
            dispatched at once if ``dispatch``, before this one's responses are read
            and delivered."""
            nonlocal busy, waited
            if busy:
                busy = False
                instance.in_flight -= 1
                if taken:
                    assert limiter is not None
                    limiter.release(taken)
                # A pipelined execute waited in the worker behind the previous one: that
                # wait is queue time, not compute time, as Triton would count it. (An
                # async model's executes overlap instead: none waits for another.)
                if instance.concurrency is None:
                    waited = max(0, instance.last_done_ns - start)
                instance.last_done_ns = time.monotonic_ns()
                if dispatch:
                    self.dispatch()

        def done(result: list[Response] | TritonError, timings: Timings | None) -> None:
            release(False)
            self._finished(batch, start, waited, result, timings)

        released = functools.partial(release, True) if self.dispatch_on_reply else None
        try:
            instance.execute(batch, done, released)
        except Exception as exc:  # noqa: BLE001 - answered (and the instance freed) either way
            if not isinstance(exc, TritonError):
                log.exception("sending an execute to '%s' failed", instance.name)
            done(exc if isinstance(exc, TritonError) else InternalError(str(exc)), None)

    def _finished(
        self,
        batch: list[Request],
        start: int,
        waited: int,
        result: list[Response] | TritonError,
        timings: Timings | None,
    ) -> None:
        """``start``: when the execute was sent (monotonic ns); ``waited``: how long it
        then waited in the worker behind the one before (queue time, as Triton counts)."""
        began = start + waited
        if waited and timings is not None:
            timings.infer_ns = max(0, timings.infer_ns - waited)
        # (the worker drops a whole execute or none of it: its first result says which)
        if not isinstance(result, TritonError) and result and result[0] is NOT_RUN:
            # Cancelled while they waited in the worker: as cancelled queued requests,
            # answered CANCELLED (where not already) and in no execution's statistics.
            for request in batch:
                self._fail(request, CancelledError("request was cancelled"), "CANCELED")
            self._completed(batch)
            self.dispatch()
            return
        if isinstance(result, TritonError) or timings is None:
            error = result if isinstance(result, TritonError) else InternalError("execute failed")
            batch_size = sum(self.model.batch_size_of(r) for r in batch)
            self.model.stats.record_failed_execution(batch_size, time.monotonic_ns() - began)
            for request in batch:
                self._fail(request, error, "BACKEND")
        else:
            # An error the model returns in a response still counts as a success, as
            # in Triton's statistics: the request was executed and answered. A request
            # answered by its model's response sender counts when the execute ends, as
            # in Triton (whose success time is then the request's time up to here),
            # however long its stream goes on after.
            now = time.monotonic_ns()
            batch_size_of = self.model.batch_size_of
            batch_size = fillers = 0  # (fillers: a sequence batcher's, answered to nobody)
            for request, response in zip(batch, result):
                batch_size += batch_size_of(request)
                if request.filler:
                    fillers += 1
                    continue
                request.compute_input_ns += timings.input_ns
                request.compute_infer_ns += timings.infer_ns
                request.compute_output_ns += timings.output_ns
                if response is None:
                    self._reschedule(request)
                elif response is not STREAMING:
                    self._deliver(request, response, None)
                elif not request.finished:  # its answers come through stream_response
                    request.counted = True
                    self.model.stats.record_request(now - request.arrival_ns)
            # The execution's statistics once its answers are on their way, as each
            # request's own (_deliver): a client's next request does not wait for them. In
            # this same loop turn, so that nothing can read the statistics in between.
            # (a filler was never queued)
            queue_ns = [began - r.arrival_ns for r in batch if not r.filler]
            self.model.stats.record_execution(
                batch_size=batch_size,
                request_count=len(batch) - fillers,
                queue_ns=queue_ns,
                input_ns=timings.input_ns,
                infer_ns=timings.infer_ns,
                output_ns=timings.output_ns,
                filler_rows=fillers,
            )
        self._completed(batch)
        self.dispatch()

    def _completed(self, batch: list[Request]) -> None:
        """A batch finished (its responses are delivered); before the next dispatch."""

    def holds(self, instance: ModelInstance) -> bool:
        """Whether work bound to ``instance`` is still to come (an instance_group update
        removed it: it stops once this is False and what it runs is done)."""
        return False

    def forget(self, instance: ModelInstance) -> None:
        """An instance an instance_group update removed has stopped."""

    def _reschedule(self, request: Request) -> None:
        """The model asked to run ``request`` again (TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)."""
        self._fail(request, reschedule_refused(self.model.name), "BACKEND")

    # -- responses ----------------------------------------------------------------------
    def stream_response(self, request: Request, response: Response) -> None:
        """A response the model sent through its response sender."""
        self._deliver(request, response, None)

    def _deliver(self, request: Request, response: Response, failure: str | None) -> None:
        if request.finished:
            return  # cancelled (or failed) already: the caller has its final answer
        took = None  # the request's time, where this final answer counts it
        if response.final:
            request.finished = True
            request.cancel_hook = None
            if request.resumes is not None:  # rescheduled: its instance lets go of it (if still open)
                instance, handle = request.resumes
                request.resumes = None
                instance.let_go(handle)
            self.unfinished -= 1
            if request.from_client:
                self.model.resources.host.request_finished()
            if not request.counted:
                took = time.monotonic_ns() - request.arrival_ns  # (counted once it is sent)
        trace = request.trace
        if trace is not None:
            if response.outputs:
                trace.record_tensors("TENSOR_BACKEND_OUTPUT", response.outputs)
            if trace.parent_id is None:  # as Triton: a step's answer goes to its ensemble
                trace.record("INFER_RESPONSE_COMPLETE")
            if response.final:
                trace.record("REQUEST_END")
        try:
            request.on_response(response)
        except Exception:  # noqa: BLE001 - one caller's broken callback must not hurt others
            log.exception("response callback for request '%s' failed", request.request_id)
        if took is not None:
            self.model.stats.record_request(took, failure)
        if trace is not None and response.final:
            trace.release_soon()
        self._set_idle_if_done()

    def fail(self, request: Request, error: TritonError) -> None:
        """Answer a request with a final error from its model's side (e.g. it died)."""
        self._fail(request, error, "BACKEND")

    def _fail(self, request: Request, error: TritonError, failure: str = "OTHER") -> None:
        response = Response(self.model.name, self.model.version, request.request_id, error=error)
        self._deliver(request, response, failure)

    def cancel(self, request: Request, answer: bool = True) -> None:
        """Cancel a request: a queued one is dropped and answered CANCELLED; an executing
        one's model sees ``is_cancelled()`` turn True, and with ``answer`` (its client
        is gone) it is answered CANCELLED now. Without, its responses go on until the
        model's final one, as a cancellation is in Triton (a BLS caller's
        ``ResponseIterator.cancel()``: a callee may ignore it, or answer it its own way)."""
        if request.finished:
            return
        request.cancelled = True
        queued = self._remove(request)
        if request.cancel_hook is not None:  # (an executing one's, or a rescheduled one's)
            request.cancel_hook(answer or queued)
        if answer or queued:
            self._fail(request, CancelledError("request was cancelled"), "CANCELED")

    def instance_state_changed(self) -> None:
        """No ready instance left: fail what is queued instead of letting it wait."""
        if self.pending and not any(instance.serves for instance in self.instances):
            error = self._unavailable()
            for request in self._take_all():
                self._fail(request, error)
        else:
            self.dispatch()

    async def drain(self, timeout: float) -> bool:
        """Wait until nothing is queued or executing; False if ``timeout`` ran out."""
        if self._idle.is_set() and not any(instance.in_flight for instance in self.instances):
            return True  # (wait_for with no time left would time out regardless)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def _arm(self, at_ns: int) -> None:
        """Make sure a dispatch runs no later than ``at_ns`` (monotonic ns, the loop's clock)."""
        if self._timer is not None and self._timer_at <= at_ns:
            return
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        self._timer_at = at_ns
        self._timer = loop.call_at(at_ns / 1e9, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.dispatch()

    def close(self) -> None:
        """The model is unloading: stop any timers (subclasses stop theirs too)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class DefaultScheduler(Scheduler):
    """Triton's default scheduler: requests in arrival order, one per ``execute``."""

    def __init__(self, model: ModelVersion) -> None:
        super().__init__(model)
        self.queue: collections.deque[Request] = collections.deque()

    def _enqueue(self, request: Request) -> None:
        self.queue.append(request)

    def _started_at_once(self, request: Request) -> bool:
        """With nothing queued ahead of it and an instance with room, a request runs now:
        where queuing and dispatching it would send it, in fewer steps (most requests
        of a model that keeps up come this way)."""
        if self.queue:
            return False
        picked = self._pick()
        if picked is None:
            return False
        self._run(picked[0], picked[1], [request])
        return True

    @property
    def pipeline_depth(self) -> int:  # type: ignore[override]
        """2 for a model with one instance, where the next request has nowhere else to
        go; 1 with more, so that a request never waits in one worker behind a slow
        execute while another instance is free (as in Triton, it waits in the queue)."""
        return 2 if len(self.instances) == 1 else 1

    @property
    def dispatch_on_reply(self) -> bool:  # type: ignore[override]
        """Where nothing is pipelined (more than one instance), an instance's next
        execute goes as soon as its worker replies (see Scheduler.dispatch_on_reply)."""
        return len(self.instances) > 1

    def _has_queued(self) -> bool:
        return bool(self.queue)

    def _next_batch(self, instance: ModelInstance) -> list[Request] | None:
        return [self.queue.popleft()] if self.queue else None

    def _take_all(self) -> list[Request]:
        taken = list(self.queue)
        self.queue.clear()
        return taken

    def _remove(self, request: Request) -> bool:
        try:
            self.queue.remove(request)
        except ValueError:
            return False
        return True

    @property
    def pending(self) -> int:
        return len(self.queue)
