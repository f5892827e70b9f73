"""Triton's dynamic batcher: ``dynamic_batching`` in config.pbtxt.

Requests wait in one queue per priority level (1 is the highest; priority 0, or one
above ``priority_levels``, means ``default_priority_level``, as in Triton). When an
instance is free the batcher takes requests in priority and arrival order while they
fit ``max_batch_size`` and have the same shapes (inputs with ``allow_ragged_batch``
excepted), and runs them as one ``execute`` call — the model receives the list of
requests, as in Triton. It
sends a batch at once when it reaches a ``preferred_batch_size`` (the largest it can)
or can grow no more; otherwise it waits for more requests until the oldest has waited
``max_queue_delay_microseconds``, and then sends all that fits ``max_batch_size``.

Queue policies: ``max_queue_size`` rejects new requests (UNAVAILABLE, counted as
REJECTED); a request that waits longer than its timeout is rejected, or with
``timeout_action: DELAY`` moved behind the other requests of its level (still ahead of
lower levels'; it still takes room in its level's queue). A request's own ``timeout``
may only shorten a level's nonzero ``default_timeout_microseconds`` (with
``allow_timeout_override``), as in Triton. ``preserve_ordering`` delivers responses in
arrival order even when several instances finish out of order.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import time
from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING, Any

from dlserve.engine.proto import model_config_pb2 as mc
from dlserve.engine.request import Request, Response
from dlserve.engine.scheduler import Scheduler, delay_count
from dlserve.errors import UnavailableError

if TYPE_CHECKING:
    from dlserve.engine.instance import ModelInstance
    from dlserve.engine.model import ModelVersion

log = logging.getLogger("dlserve.engine")

_DELAY = mc.ModelQueuePolicy.DELAY


class DynamicBatcher(Scheduler):
    pipeline_depth = 1  # let requests gather into a batch while an instance works
    dispatch_on_reply = True

    def __init__(self, model: ModelVersion) -> None:
        super().__init__(model)
        config = model.config
        batching = config.dynamic_batching
        # (preferred sizes 1..max_batch_size: config.validate; config.normalize sets
        # max_batch_size if none)
        self.rule = BatchRule(
            batching.preferred_batch_size,
            max(config.max_batch_size, 1),
            batching.max_queue_delay_microseconds,
        )
        self.preserve_ordering = batching.preserve_ordering
        levels = max(batching.priority_levels, 1)
        self.default_level = batching.default_priority_level if batching.priority_levels else 1
        self.queues: list[collections.deque[Request]] = [collections.deque() for _ in range(levels)]
        self.policies = [
            batching.priority_queue_policy[level]
            if level in batching.priority_queue_policy
            else batching.default_queue_policy
            for level in range(1, levels + 1)
        ]
        # Per level, its requests that timed out with timeout_action DELAY.
        self.delayed: list[collections.deque[Request]] = [collections.deque() for _ in range(levels)]
        self._ragged = {t.name for t in config.input if t.allow_ragged_batch}
        self._order = itertools.count()
        # Queued requests with a queue-policy timeout: a heap of (deadline_ns, order, id)
        # and, by id, (order, request) until the request leaves its queue, so that one
        # answered long before its deadline is not held (with its tensors) until then.
        self._deadlines: list[tuple[int, int, int]] = []
        self._timed: dict[int, tuple[int, Request, int]] = {}  # id -> (order, request, deadline)
        # preserve_ordering: per arrival order, responses waiting for the requests before
        # (None: a cancelled request's place, answered already)
        self._held: dict[int, list[tuple[Request, Response, str | None] | None]] = {}
        self._next_to_deliver = 0
        self._order_of: dict[int, int] = {}  # id(request) -> arrival order, for preserve_ordering
        # Triton's test hook: no batch until this many requests are queued, once.
        self._held_until = delay_count("TRITONSERVER_DELAY_SCHEDULER")
        if self._held_until:
            log.info(
                "Delaying batcher for %s until %d queued requests", model.name, self._held_until
            )

    # -- queueing -----------------------------------------------------------------------
    def _level(self, priority: int) -> int:
        """Queue index for a request priority (0 or out of range: the default level)."""
        level = priority if 0 < priority <= len(self.queues) else self.default_level
        return level - 1

    def _enqueue(self, request: Request) -> None:
        level = self._level(request.priority)
        policy = self.policies[level]
        waiting = len(self.queues[level]) + len(self.delayed[level])  # (delayed ones count, as in Triton)
        if policy.max_queue_size and waiting >= policy.max_queue_size:
            raise UnavailableError(f"{request.label}Exceeds maximum queue size")  # (Triton's words)
        timeout_us = policy.default_timeout_microseconds
        if timeout_us and policy.allow_timeout_override and request.timeout_us > 0:
            # A request may shorten the level's timeout, never lengthen it (nor set one).
            timeout_us = min(timeout_us, request.timeout_us)
        order = next(self._order)
        if self.preserve_ordering:
            self._order_of[id(request)] = order
        self.queues[level].append(request)
        if timeout_us:
            deadline = request.arrival_ns + timeout_us * 1000
            heapq.heappush(self._deadlines, (deadline, order, id(request)))
            self._timed[id(request)] = (order, request, deadline)
            self._arm(deadline)

    @property
    def pending(self) -> int:
        return sum(len(q) for q in self._queues())

    def _queues(self) -> list[collections.deque[Request]]:
        """Every queue in the order they are served: each level, then its delayed ones."""
        return [queue for pair in zip(self.queues, self.delayed) for queue in pair]

    def _remove(self, request: Request) -> bool:
        for queue in self._queues():
            try:
                queue.remove(request)
            except ValueError:
                continue
            self._untime(request)
            return True
        return False

    def _take_all(self) -> list[Request]:
        taken = [r for queue in self._queues() for r in queue]
        for queue in self._queues():
            queue.clear()
        self._timed.clear()
        self._deadlines.clear()
        return taken

    def _untime(self, request: Request) -> None:
        """``request`` left its queue: its deadline no longer applies (nor holds it)."""
        if self._timed:
            self._timed.pop(id(request), None)
            if len(self._deadlines) > 2 * len(self._timed) + 1024:  # mostly gone: compact
                self._deadlines = [(d, o, k) for k, (o, _, d) in self._timed.items()]
                heapq.heapify(self._deadlines)

    # -- timers -------------------------------------------------------------------------
    def _expire(self, now: int) -> None:
        """Apply the queue policies' timeouts to requests that waited too long."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, order, key = heapq.heappop(self._deadlines)
            timed = self._timed.get(key)
            if timed is None or timed[0] != order:
                continue  # it left its queue already (an id may be another request's now)
            request = timed[1]
            del self._timed[key]
            level = self._level(request.priority)
            self.queues[level].remove(request)
            if self.policies[level].timeout_action == _DELAY:
                self.delayed[level].append(request)
            else:
                self._fail(request, UnavailableError("Request timeout expired"), "REJECTED")
        if self._deadlines:
            self._arm(self._deadlines[0][0])

    def dispatch(self) -> None:
        # Timeouts first, and whether or not an instance has room: a request whose time
        # in the queue ran out is answered then, not once an instance is free, as in Triton.
        if self._deadlines:
            self._expire(time.monotonic_ns())
        super().dispatch()

    # -- batch formation ----------------------------------------------------------------
    def _has_queued(self) -> bool:
        return any(self.queues) or any(self.delayed)

    def _next_batch(self, instance: ModelInstance) -> list[Request] | None:
        if self._held_until:
            if self.pending < self._held_until:
                return None  # (each request queued dispatches again)
            self._held_until = 0
        queued = itertools.chain.from_iterable(self._queues())
        count, wait_until = self.rule.take(
            (self.model.batch_size_of(r), batch_shapes(r, self._ragged), r.arrival_ns)
            for r in queued
        )
        if not count:
            if wait_until:
                self._arm(wait_until)  # wait for more requests, at most until then
            return None
        chosen = []
        for queue in self._queues():
            while queue and len(chosen) < count:
                request = queue.popleft()
                self._untime(request)
                chosen.append(request)
        return chosen

    # -- responses ----------------------------------------------------------------------
    def _answer_from_cache(self, request: Request, response: Response) -> None:
        if self.preserve_ordering:  # a hit waits its turn behind the requests before it
            self._order_of[id(request)] = next(self._order)
        super()._answer_from_cache(request, response)

    def _deliver(self, request: Request, response: Response, failure: str | None) -> None:
        """With ``preserve_ordering``, every response of a request (a decoupled model's
        many) waits until each request that came before it has had its final one."""
        order = self._order_of.get(id(request)) if self.preserve_ordering else None
        if order is None:
            super()._deliver(request, response, failure)
            return
        if response.final:
            del self._order_of[id(request)]
        held = self._held.setdefault(order, [])
        if request.cancelled:
            # A cancelled request is answered now, like every cancel; its place in
            # the order is kept, empty, for the requests after it.
            super()._deliver(request, response, failure)
            if response.final:
                held.append(None)
        else:
            held.append((request, response, failure))
        while (held := self._held.get(self._next_to_deliver)) is not None:
            ended = False
            for entry in held:
                if entry is None:
                    ended = True
                else:
                    super()._deliver(*entry)
                    ended = entry[1].final
            held.clear()
            if not ended:
                return  # (its next responses go out as they come: it is first in line)
            del self._held[self._next_to_deliver]
            self._next_to_deliver += 1


class BatchRule:
    """Triton's batch formation (its dynamic batcher's GetDynamicBatch, which its
    ``oldest`` sequence batcher uses too): take requests in order while they fit
    ``max_batch_size`` and share shapes; the longest run that hits a preferred size goes
    at once, as does a run that cannot grow (the next request is too big or of other
    shapes, or it would pass the largest preferred size); otherwise wait for more until
    the oldest has waited the delay, then send all that fits."""

    def __init__(self, preferred: Iterable[int], max_batch: int, delay_us: int) -> None:
        self.preferred = set(preferred)
        self.max_batch = max_batch
        self.max_preferred = max(self.preferred, default=max_batch)
        self.delay_ns = delay_us * 1000

    def take(self, candidates: Iterable[tuple[int, Hashable, int]]) -> tuple[int, int]:
        """How many of the queued ``(batch size, shapes, waiting since ns)`` candidates,
        in queue order, to send now, and if none, until when the batch waits for more
        (0 when nothing is queued)."""
        count = total = best = 0  # best: how many make the batch to send before the delay
        shapes: Hashable = None
        oldest = 0
        closed = False  # the next candidate cannot join: the batch can grow no more
        for size, its_shapes, since in candidates:
            if count:
                if total + size > self.max_preferred and not best:
                    best = count
                if total + size > self.max_batch or its_shapes != shapes:
                    closed = True
                    break
                oldest = min(oldest, since)
            else:
                shapes, oldest = its_shapes, since
            count += 1
            total += size
            if total in self.preferred:
                best = count
        if not count:
            return 0, 0
        ready_at = oldest + self.delay_ns
        delay_over = self.delay_ns and time.monotonic_ns() >= ready_at
        if best and not delay_over:
            return best, 0
        if closed or total >= self.max_preferred or delay_over or not self.delay_ns:
            return count, 0
        return 0, ready_at


def batch_shapes(request: Request, ragged: set[str]) -> tuple[Any, ...]:
    """What requests in one batch must share: each input's shape after the batch
    dimension (but a ragged one's) and data type."""
    return tuple(
        sorted(
            (name, None if name in ragged else tensor.shape[1:], tensor.data_type)
            for name, tensor in request.inputs.items()
        )
    )
