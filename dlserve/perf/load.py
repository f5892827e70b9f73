"""Load modes on one asyncio loop: closed-loop concurrency and open-loop request rate.

* Concurrency N: N tasks, each with its own slot, each sending its next request as soon
  as the previous one is answered. Changing N adds tasks or lets extra ones finish their
  request and stop.
* Request rate R: a scheduler sends requests at times spaced 1/R apart (constant) or
  exponentially (poisson), each on a free slot from a pool of ``--max-threads``; a
  request whose time comes while every slot is busy waits for one and counts as delayed.
* Periodic concurrency (:mod:`dlserve.perf.periodic`): single requests, each sent with
  :meth:`LoadGenerator.send_once`, which hears each answer arrive.

Every answered request appends its latency (ns, from send to response) to the current
:class:`Recorder`; :meth:`LoadGenerator.collect` swaps the recorder, so a window holds
exactly the requests that ended in it. Per request the hot path costs two clock reads,
the slot's send/receive, and a list append. With ``--profile-export-file`` each request
is also logged (sent and answer times, sequence, data, the answers undecoded) for
:mod:`dlserve.perf.export`. With ``validation_data`` each request's answer is checked as it
ends (:class:`dlserve.perf.answers.Validator`); a mismatch ends the run.

What each request carries comes from a source: the distinct requests in turn
(:class:`_Cycle`), or for a sequence model the steps of one sequence after another
(:class:`_SequenceSteps`, encoded per request since each names its sequence). A load
that stops mid-sequence ends it with one more request flagged END, so the server does
not hold the sequence's slot until it idles out.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dlserve.perf.answers import Validator
from dlserve.perf.clients import DataPlane, Slot
from dlserve.perf.export import Logged, RequestLog, clock_offset
from dlserve.perf.measure import ClientWindow
from dlserve.perf.sequences import SequenceMaker, Step

_now = time.perf_counter_ns


class Recorder:
    __slots__ = ("latencies", "send", "recv", "responses", "delayed", "sent", "sequences", "start_ns", "log")

    def __init__(self, log: bool = False) -> None:
        self.latencies: list[int] = []
        self.log: list[Logged] | None = [] if log else None  # --profile-export-file's
        self.send = 0
        self.recv = 0
        self.responses = 0
        self.delayed = 0
        self.sent = 0
        self.sequences = 0  # sequences whose last request ended in the window
        self.start_ns = _now()


def _logged(start: int, end: int, slot: Slot, where: tuple[int, int]) -> Logged:
    """A request for the export, from what its slot kept: the last answer's time is the
    request's end, which put it in its window (and makes its latency end - start)."""
    answers = slot.captured or [(end, None)]
    times = [t for t, _ in answers]
    times[-1] = end
    return start, times, where[1], where[0], [answer for _, answer in answers]


class _Cycle:
    """The distinct requests in turn, from ``start``."""

    __slots__ = ("payloads", "index")

    def __init__(self, payloads: list[Any], start: int) -> None:
        self.payloads = payloads
        self.index = start % len(payloads)

    def next(self) -> tuple[Any, bool]:
        """The next request, and whether it ends a sequence."""
        payload = self.payloads[self.index]
        self.index += 1
        if self.index == len(self.payloads):
            self.index = 0
        return payload, False

    def unfinished(self) -> Any:
        """A request that ends what was left midway (nothing here)."""
        return None

    def where(self) -> tuple[int, int]:
        """The last request's data index, and its sequence ID (0: none)."""
        return (self.index or len(self.payloads)) - 1, 0


class _SequenceSteps:
    """One sequence after another, each step encoded as it is sent."""

    __slots__ = ("plane", "maker", "steps", "position", "in_flight")

    def __init__(self, plane: DataPlane, maker: SequenceMaker) -> None:
        self.plane = plane
        self.maker = maker
        self.steps: list[Step] = []
        self.position = 0
        self.in_flight: set[asyncio.Task[None]] = set()  # request-rate mode: its requests on the way

    def next(self) -> tuple[Any, bool]:
        if self.position == len(self.steps):
            self.steps = self.maker.new(self.steps[0].sequence_id if self.steps else None)
            self.position = 0
        step = self.steps[self.position]
        self.position += 1
        return self.plane.encode(step.data, step.parameters()), step.end

    def where(self) -> tuple[int, int]:
        step = self.steps[self.position - 1]
        return step.data, step.sequence_id

    def unfinished(self) -> Any:
        if not 0 < self.position < len(self.steps):
            return None
        step = self.steps[self.position]
        self.position = len(self.steps)
        return self.plane.encode(step.data, Step(step.data, step.sequence_id, False, True).parameters())


class _Worker:
    __slots__ = ("slot", "stop", "task")

    def __init__(self, slot: Slot) -> None:
        self.slot = slot
        self.stop = False
        self.task: asyncio.Task[None] | None = None


class LoadGenerator:
    """Drives one data plane; used directly (one process) or inside a worker process."""

    def __init__(self, plane: DataPlane, max_threads: int = 16, sequences: SequenceMaker | None = None,
                 num_sequences: int = 4, serial_sequences: bool = False,
                 intervals_us: list[float] | None = None, log: bool = False,
                 validator: Validator | None = None) -> None:
        self.plane = plane
        self.log = log  # --profile-export-file: log every request
        self.validator = validator  # validation_data's: check every answer
        # slots keep their answers, requests say their data
        self.track = log or validator is not None
        self.clock_ns = clock_offset()
        self.max_threads = max_threads
        self.intervals_us = intervals_us  # --request-intervals: the gaps at the whole run's rate
        self.sequences = sequences
        self.num_sequences = num_sequences
        self.serial_sequences = serial_sequences
        self._live: list[_SequenceSteps] = []  # request-rate mode's sequences
        self._busy: set[int] = set()  # those of them with a request in flight
        self.recorder = Recorder(log)
        self.error: str | None = None
        self._workers: list[_Worker] = []
        self._idle: list[Slot] = []
        self._slots: list[Slot] = []
        self._rate_task: asyncio.Task[None] | None = None
        self._in_flight: set[asyncio.Task[None]] = set()  # request-rate mode's requests
        self._slot_freed = asyncio.Event()
        self._next = 0  # payload index, shared so slots spread over the payloads
        self.budget: int | None = None  # --request-count's: requests left to send (None: no end)
        self._rng = random.Random(0)  # which live sequence a request-rate request goes to

    # -- set-up ---------------------------------------------------------------------------
    async def start(self) -> None:
        await self.plane.setup()

    def _source(self) -> _Cycle | _SequenceSteps:
        if self.sequences is not None:
            return _SequenceSteps(self.plane, self.sequences)
        self._next += 1
        return _Cycle(self.plane.payloads, self._next - 1)

    async def _slot(self) -> Slot:
        if self._idle:
            return self._idle.pop()
        return await self._open_slot()

    async def _open_slot(self) -> Slot:
        slot = await self.plane.open_slot()
        if self.track:
            slot.captured = []  # (it keeps each request's answers from now on)
        self._slots.append(slot)
        return slot

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = str(exc) or type(exc).__name__
        for worker in self._workers:
            worker.stop = True
        if self._rate_task is not None:
            self._rate_task.cancel()

    # -- closed loop ----------------------------------------------------------------------
    async def set_concurrency(self, concurrency: int) -> None:
        await self._stop_rate()
        active = [w for w in self._workers if not w.stop]
        for worker in active[concurrency:]:
            worker.stop = True
        for _ in range(concurrency - len(active)):
            worker = _Worker(await self._slot())
            worker.task = asyncio.get_running_loop().create_task(self._closed_loop(worker))
            self._workers.append(worker)

    async def _closed_loop(self, worker: _Worker) -> None:
        source = self._source()
        slot = worker.slot
        infer = slot.infer
        now = _now
        try:
            while not worker.stop and self._spend():
                payload, ends = source.next()
                start = now()
                timings = await infer(payload)
                where = source.where() if self.track else None
                self.record(start, now(), timings, slot, ends, where)
            if self.error is None:
                await self._finish(slot, source)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any client failure ends the run with its reason
            self._fail(exc)
        finally:
            if worker in self._workers:
                self._workers.remove(worker)
            self._idle.append(slot)

    # -- open loop --------------------------------------------------------------------------
    async def set_rate(self, rate: float, distribution: str = "constant", seed: int | None = None) -> None:
        for worker in self._workers:
            worker.stop = True
        await self._stop_rate()
        if rate <= 0:
            return
        while len(self._slots) < self.max_threads:
            self._idle.append(await self._open_slot())
        self._rate_task = asyncio.get_running_loop().create_task(self._open_loop(rate, distribution, seed))

    async def _stop_rate(self) -> None:
        task, self._rate_task = self._rate_task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def _open_loop(self, rate: float, distribution: str, seed: int | None) -> None:
        loop = asyncio.get_running_loop()
        cycle = _Cycle(self.plane.payloads, 0)
        if self.sequences is not None and not self._live:
            self._live = [_SequenceSteps(self.plane, self.sequences) for _ in range(self.num_sequences)]
        interval = 1e9 / rate
        rng = random.Random(seed)
        gap = (lambda: rng.expovariate(1.0) * interval) if distribution == "poisson" else (lambda: interval)
        if self.intervals_us:  # (stretched to this process's share of the rate)
            given = itertools.cycle(self.intervals_us)
            scale = interval / (1e3 * sum(self.intervals_us) / len(self.intervals_us))
            gap = lambda: next(given) * 1e3 * scale  # noqa: E731
        due = float(_now())
        idle = self._idle
        while True:
            now = _now()
            while due <= now:
                if not self._spend():
                    return
                late = await self._freed(lambda: bool(idle))
                sequence = -1
                if self._live:
                    sequence, waited = await self._pick_sequence()
                    late = late or waited
                # Counted with its sending, in the window that sends it (the wait may
                # outlast a window: a delayed count above the sent one).
                self.recorder.delayed += late
                slot = idle.pop()
                source = self._live[sequence] if sequence >= 0 else cycle
                payload, ends = source.next()
                where = source.where() if self.track else None
                task = loop.create_task(self._one(slot, payload, ends, sequence, where))
                if sequence >= 0:
                    self._live[sequence].in_flight.add(task)
                    task.add_done_callback(self._live[sequence].in_flight.discard)
                self._in_flight.add(task)
                task.add_done_callback(self._in_flight.discard)
                self.recorder.sent += 1
                due += gap()
                now = _now()
            await asyncio.sleep((due - now) / 1e9)

    def _spend(self) -> bool:
        """Whether one more request may go out (counted off the budget, if any)."""
        if self.budget is None:
            return True
        if self.budget == 0:
            return False
        self.budget -= 1
        return True

    async def _pick_sequence(self) -> tuple[int, bool]:
        """The live sequence the next request goes to (at random; with
        --serial-sequences, one without a request in flight, waited for if need be)."""
        if not self.serial_sequences:
            return self._rng.randrange(len(self._live)), False
        waited = await self._freed(lambda: len(self._busy) < len(self._live))
        free = [i for i in range(len(self._live)) if i not in self._busy]
        chosen = free[self._rng.randrange(len(free))]
        self._busy.add(chosen)
        return chosen, waited

    async def _one(self, slot: Slot, payload: Any, ends: bool, sequence: int,
                   where: tuple[int, int] | None) -> None:
        start = _now()
        try:
            timings = await slot.infer(payload)
            self.record(start, _now(), timings, slot, ends, where)
        except Exception as exc:  # noqa: BLE001 - any client failure ends the run with its reason
            self._fail(exc)
            return
        self._busy.discard(sequence)
        self._idle.append(slot)
        self._slot_freed.set()

    def record(self, start: int, end: int, timings: tuple[int, int], slot: Slot, ends: bool,
               where: tuple[int, int] | None) -> None:
        """A request answered, into the current window: its latency, its send and receive
        times, its responses, whether it ended a sequence, and (with a log) itself; with
        validation data, its answer checked first (a mismatch raises RequestError)."""
        if where is not None and self.validator is not None:
            self.validator.check(slot.captured or [], where[0])
        recorder = self.recorder
        recorder.latencies.append(end - start)
        recorder.send += timings[0]
        recorder.recv += timings[1]
        recorder.responses += slot.responses
        recorder.sequences += ends
        if where is not None and recorder.log is not None:
            recorder.log.append(_logged(start, end, slot, where))

    async def send_once(self, on_answer: Callable[[], None]) -> None:
        """One request, recorded (--periodic-concurrency-range's); ``on_answer`` is called
        as each of its answers arrives."""
        slot = await self._slot()
        source = self._source()
        payload, ends = source.next()
        slot.on_answer = on_answer
        start = _now()
        timings = await slot.infer(payload)
        self.record(start, _now(), timings, slot, ends, source.where() if self.track else None)
        slot.on_answer = None
        self._idle.append(slot)

    async def _freed(self, ready: Callable[[], bool]) -> bool:
        """Wait until ``ready()`` (a request ended: a slot or a sequence may be free);
        whether it had to wait."""
        waited = False
        while not ready():
            waited = True
            self._slot_freed.clear()
            await self._slot_freed.wait()
        return waited

    async def _end_live(self) -> None:
        """End request-rate mode's sequences left midway, each once its requests on the
        way are answered (before that, it may hold the server's slot that another's
        waits for, and its END would overtake them)."""

        async def end(steps: _SequenceSteps) -> None:
            if steps.in_flight:
                await asyncio.wait(set(steps.in_flight))
            await self._freed(lambda: bool(self._idle))
            slot = self._idle.pop()
            try:
                await self._finish(slot, steps)
            finally:
                self._idle.append(slot)
                self._slot_freed.set()

        if self.error is None:  # (a failed run's server may refuse them too; they idle out)
            await asyncio.gather(*(end(steps) for steps in self._live), return_exceptions=True)

    async def _finish(self, slot: Slot, source: _Cycle | _SequenceSteps) -> None:
        """End the sequence ``source`` left midway, if any (not measured)."""
        payload = source.unfinished()
        if payload is not None:
            await slot.infer(payload)

    # -- warm-up, windows, the end --------------------------------------------------------
    async def warmup(self, requests: int, concurrency: int) -> None:
        """Send ``requests`` requests on up to ``concurrency`` slots; record nothing."""
        if requests <= 0:
            return
        left = [requests]

        async def run(slot: Slot) -> None:
            source = self._source()
            try:
                while left[0] > 0 and self.error is None:
                    left[0] -= 1
                    await slot.infer(source.next()[0])
                    if self.validator is not None:
                        self.validator.check(slot.captured or [], source.where()[0])
                if self.error is None:
                    await self._finish(slot, source)
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)
            finally:
                self._idle.append(slot)

        slots = [await self._slot() for _ in range(max(1, min(concurrency, requests)))]
        await asyncio.gather(*(run(slot) for slot in slots))

    @property
    def ended(self) -> int:
        """Requests that ended in the current window."""
        return len(self.recorder.latencies)

    def collect(self) -> ClientWindow:
        """The requests that ended since the last call; starts the next window."""
        recorder, self.recorder = self.recorder, Recorder(self.log)
        end = self.recorder.start_ns
        logs = [] if recorder.log is None else [RequestLog(self.clock_ns, recorder.start_ns, end, recorder.log)]
        return ClientWindow(
            duration_ns=end - recorder.start_ns,
            latencies_ns=np.array(recorder.latencies, dtype=np.int64),
            send_ns=recorder.send,
            recv_ns=recorder.recv,
            responses=recorder.responses,
            delayed=recorder.delayed,
            sent=recorder.sent,
            sequences=recorder.sequences,
            logs=logs,
        )

    async def stop(self) -> None:
        await self._stop_rate()
        tasks = [w.task for w in self._workers if w.task is not None]
        for worker in self._workers:
            worker.stop = True
        tasks += list(self._in_flight)
        if self._live:
            tasks.append(asyncio.get_running_loop().create_task(self._end_live()))
        if tasks:  # let the requests in flight finish (and the sequences end)
            _, pending = await asyncio.wait(tasks, timeout=5)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1)
        for slot in self._slots:
            try:
                await slot.close()
            except Exception:  # noqa: BLE001
                pass
        await self.plane.close()
