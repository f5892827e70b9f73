"""Load modes on one asyncio loop: closed-loop concurrency and open-loop request rate.

* Concurrency N: N tasks, each with its own slot, each sending its next request as soon
  as the previous one is answered. Changing N adds tasks or lets extra ones finish their
  request and stop.
* Request rate R: a scheduler sends requests at times spaced 1/R apart (constant) or
  exponentially (poisson), each on a free slot from a pool of ``--max-threads``; a
  request whose time comes while every slot is busy waits for one and counts as delayed.

Every answered request appends its latency (ns, from send to response) to the current
:class:`Recorder`; :meth:`LoadGenerator.collect` swaps the recorder, so a window holds
exactly the requests that ended in it. Per request the hot path costs two clock reads,
the slot's send/receive, and a list append.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import numpy as np

from dlserve.perf.clients import DataPlane, Slot
from dlserve.perf.measure import ClientWindow

_now = time.perf_counter_ns


class Recorder:
    __slots__ = ("latencies", "send", "recv", "responses", "delayed", "sent", "start_ns")

    def __init__(self) -> None:
        self.latencies: list[int] = []
        self.send = 0
        self.recv = 0
        self.responses = 0
        self.delayed = 0
        self.sent = 0
        self.start_ns = _now()


class _Worker:
    __slots__ = ("slot", "stop", "task")

    def __init__(self, slot: Slot) -> None:
        self.slot = slot
        self.stop = False
        self.task: asyncio.Task[None] | None = None


class LoadGenerator:
    """Drives one data plane; used directly (one process) or inside a worker process."""

    def __init__(self, plane: DataPlane, max_threads: int = 16) -> None:
        self.plane = plane
        self.max_threads = max_threads
        self.recorder = Recorder()
        self.error: str | None = None
        self._workers: list[_Worker] = []
        self._idle: list[Slot] = []
        self._slots: list[Slot] = []
        self._rate_task: asyncio.Task[None] | None = None
        self._in_flight: set[asyncio.Task[None]] = set()  # request-rate mode's requests
        self._slot_freed = asyncio.Event()
        self._next = 0  # payload index, shared so slots spread over the payloads

    # -- set-up ---------------------------------------------------------------------------
    async def start(self) -> None:
        await self.plane.setup()

    async def _slot(self) -> Slot:
        if self._idle:
            return self._idle.pop()
        slot = await self.plane.open_slot()
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
        payloads = self.plane.payloads
        count = len(payloads)
        index = self._next % count
        self._next += 1
        slot = worker.slot
        infer = slot.infer
        now = _now
        try:
            while not worker.stop:
                start = now()
                send, recv = await infer(payloads[index])
                end = now()
                recorder = self.recorder
                recorder.latencies.append(end - start)
                recorder.send += send
                recorder.recv += recv
                recorder.responses += slot.responses
                index += 1
                if index == count:
                    index = 0
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
            slot = await self.plane.open_slot()
            self._slots.append(slot)
            self._idle.append(slot)
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
        payloads = self.plane.payloads
        count = len(payloads)
        index = 0
        interval = 1e9 / rate
        rng = random.Random(seed)
        gap = (lambda: rng.expovariate(1.0) * interval) if distribution == "poisson" else (lambda: interval)
        due = float(_now())
        idle = self._idle
        while True:
            now = _now()
            while due <= now:
                late = not idle
                while not idle:
                    self._slot_freed.clear()
                    await self._slot_freed.wait()
                # Counted with its sending, in the window that sends it (the wait may
                # outlast a window: a delayed count above the sent one).
                self.recorder.delayed += late
                slot = idle.pop()
                task = loop.create_task(self._one(slot, payloads[index]))
                self._in_flight.add(task)
                task.add_done_callback(self._in_flight.discard)
                self.recorder.sent += 1
                index += 1
                if index == count:
                    index = 0
                due += gap()
                now = _now()
            await asyncio.sleep((due - now) / 1e9)

    async def _one(self, slot: Slot, payload: Any) -> None:
        start = _now()
        try:
            send, recv = await slot.infer(payload)
        except Exception as exc:  # noqa: BLE001 - any client failure ends the run with its reason
            self._fail(exc)
            return
        end = _now()
        recorder = self.recorder
        recorder.latencies.append(end - start)
        recorder.send += send
        recorder.recv += recv
        recorder.responses += slot.responses
        self._idle.append(slot)
        self._slot_freed.set()

    # -- warm-up, windows, the end --------------------------------------------------------
    async def warmup(self, requests: int, concurrency: int) -> None:
        """Send ``requests`` requests on up to ``concurrency`` slots; record nothing."""
        if requests <= 0:
            return
        payloads = self.plane.payloads
        left = [requests]

        async def run(slot: Slot) -> None:
            index = 0
            try:
                while left[0] > 0:
                    left[0] -= 1
                    await slot.infer(payloads[index % len(payloads)])
                    index += 1
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
        recorder, self.recorder = self.recorder, Recorder()
        end = self.recorder.start_ns
        return ClientWindow(
            duration_ns=end - recorder.start_ns,
            latencies_ns=np.array(recorder.latencies, dtype=np.int64),
            send_ns=recorder.send,
            recv_ns=recorder.recv,
            responses=recorder.responses,
            delayed=recorder.delayed,
            sent=recorder.sent,
        )

    async def stop(self) -> None:
        await self._stop_rate()
        tasks = [w.task for w in self._workers if w.task is not None]
        for worker in self._workers:
            worker.stop = True
        tasks += list(self._in_flight)
        if tasks:  # let the requests in flight finish
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
