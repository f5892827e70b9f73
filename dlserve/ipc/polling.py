"""Bounded, adaptive polling before sleeping: how dlserve avoids paying for wake-ups.

Putting a process to sleep and waking it from another CPU is the dominant cost of a
message between two processes on a virtual machine: the waker sends an
inter-processor interrupt, the halted vCPU has to be resumed, and it runs with cold
caches. On the 2-vCPU development VM an add_sub request through a worker took
~210-250 µs when both sides slept and 60-170 µs when they polled (depending on how
busy the host was), and both processes used *less* CPU per request while polling
(benchmarks/RESULTS.md, "In-process").

So whoever expects a message soon polls for it for a while before sleeping: a worker
waiting for its next command or a reply, the server's loop waiting for a worker's
reply or a keep-alive client's next request. How long is learnt per waiter, the way
Linux's haltpoll cpuidle governor does it (:class:`PollWindow`): the window follows
the waits that ended soon after it, and halves on every wait longer than the limit,
so a trickle of traffic polls for nothing and an idle server uses no CPU. The limit
is the server's ``busy_poll_us`` (0 turns all of it off).

Polling only pays with a CPU to spare: on a saturated machine every microsecond spent
polling is taken from a process with work to do, and a polling process makes its CPU
look busy to the scheduler, which then queues work on the others. Measured with a
CPU-hungry client (tritonclient, 16 threads) on 2 vCPUs: HTTP throughput at
concurrency 16 fell by 28% when polling ignored the load. So nobody polls while more
tasks are runnable than there are CPUs (:func:`cpu_to_spare`); with that check the
same run is 5-10% faster than without polling, and concurrency 1 ~1.4x faster. Under
a container's CPU limit the CPUs counted are the quota's (dlserve.cpus), so a
throttled container does not spend its quota polling.

A poller yields its CPU to anything runnable (a worker at every check, the server's
loop once it has polled idle for 50 µs), so a CPU that only a fellow poller holds is
nearly as good as free for the work a message brings. Counting runnable tasks alone made a
BLS call look like an overloaded machine: the caller's worker waits for its reply, the
server's loop for the callee's, the callee for its next command, so three processes
were runnable on two CPUs while at most one of them had work, and all three slept. So
a server's processes say when they poll (:class:`PollerBoard`: one byte each in a page
of shared memory the workers inherit) and the fellow pollers are not counted. Measured
in-process (a BLS call to add_sub against calling add_sub), the overhead of the call
went from 280-400 µs to 200-265 µs, and under perf_analyzer the BLS p99 from 1.3-2.2
to 0.9-1.4 ms.

The run queue misses a light client: perf_analyzer's threads sleep most of the time, so
at concurrency 4 and 16 a CPU often looked spare while the server's loop had requests
to serve, and the server and its worker polled for messages that its own work delayed.
So while the server answers more than one client request at once (BLS calls and
ensemble steps are part of one), nobody polls: a byte on the board says so
(:meth:`LoopPoller.request_started`). Measured with perf_analyzer on add_sub over HTTP,
alternating this with the code before it (benchmarks/ab_cpu_per_request.sh, six
rounds): the server's and its worker's CPU time per request fell by ~10% at
concurrency 4 and ~12% at 16, throughput rose ~5%, and concurrency 1 is as before.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import socket
import time
import weakref
from collections.abc import Callable, Hashable

from dlserve.cpus import usable_cpus

_MIN_WINDOW = 10e-6  # below this a window is not worth a poll: it becomes 0
_MARGIN = 1.5  # a window covers the last wait that fit the limit with this much to spare
_IDLE_TURN = 20e-6  # a loop turn this short did nothing but poll (an empty one: 1-3 µs)
# A loop idle this long lets others run between its turns. Not from the first idle
# turn: a relay's replies come sooner and the loop would give its CPU away just
# before. Never yielding, a worker woken onto the loop's CPU could wait out the loop's
# whole window (the p99 of a BLS call went from ~0.6 to ~1.5 ms).
_YIELD_AFTER = 50e-6


class PollerBoard:
    """Which of a server's processes poll right now: one byte per poller in a page of
    shared memory. Each server loop has one (a memfd: nothing in /dev/shm to clean up
    after a crash), keeps a slot of it for itself and hands one to each worker, with
    the descriptor."""

    SLOTS = 1024  # the page's bytes: one per poller (a seat), but for the last
    SEATS = SLOTS - 1
    _BUSY = SEATS  # the last byte: whether the server answers more than one client request

    def __init__(self, fd: int, owner: bool = False) -> None:
        self._map = mmap.mmap(fd, self.SLOTS)
        # The owner's descriptor (for the workers), closed by close() or, for a board
        # nobody closed (its loop was never stopped), when the board is dropped.
        self._fd = fd if owner else -1
        self._closer = weakref.finalize(self, os.close, fd) if owner else None
        # Slots not handed out; only the server's board hands them out.
        self._free = list(range(self.SEATS - 1, -1, -1)) if owner else []

    @classmethod
    def create(cls) -> PollerBoard:
        fd = os.memfd_create("dlserve-pollers", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, cls.SLOTS)
            return cls(fd, owner=True)
        except OSError:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int) -> PollerBoard:
        """A worker's view of its server's board, from the descriptor it inherited."""
        try:
            return cls(fd)
        finally:
            os.close(fd)  # the mapping keeps a descriptor of its own

    def fileno(self) -> int:
        return self._fd

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def claim(self) -> int | None:
        """A slot for a new poller; None when all are taken or the board is closed (the
        poller then counts as work)."""
        return self._free.pop() if self._free and not self._map.closed else None

    def free(self, slot: int | None) -> None:
        if slot is not None and not self._map.closed:
            self._map[slot] = 0
            self._free.append(slot)

    def mark(self, slot: int | None, polling: bool) -> None:
        if slot is not None and not self._map.closed:
            self._map[slot] = polling

    def set_busy(self, busy: bool) -> None:
        if not self._map.closed:
            self._map[self._BUSY] = 2 if busy else 0  # (not 1: fellows() counts those)

    def busy(self) -> bool:
        """Whether the server answers more than one client request now: then nobody
        polls (see the module's docstring)."""
        return not self._map.closed and self._map[self._BUSY] == 2

    def snapshot(self) -> bytes:
        return b"" if self._map.closed else self._map[:]

    def fellows(self, slot: int | None) -> int:
        """How many poll now, ``slot`` (the caller's) aside."""
        marks = self.snapshot()
        return marks.count(1) - (marks[slot] if slot is not None and marks else 0)

    def close(self) -> None:
        self._map.close()
        self._free.clear()
        if self._closer is not None:
            self._closer()  # the descriptor's only closer: a finalizer runs once
        self._fd = -1


# In a worker: the server's board and the worker's slot on it (join_board).
_worker_seat: tuple[PollerBoard, int] | None = None


def join_board(fd: int, slot: int) -> None:
    """In a worker: poll on the server's board (inherited as ``fd``), in ``slot``."""
    global _worker_seat
    _worker_seat = (PollerBoard.attach(fd), slot)


class _RunQueue:
    """How many tasks are runnable on the machine right now: the fourth field of
    /proc/loadavg ("running/total"), read (open, read, close: ~7 µs) at most once per
    ``fresh`` seconds, and only once somebody asks: nothing is opened at import and
    no descriptor is held. Without /proc, there is always a CPU to spare."""

    def __init__(
        self, path: str = "/proc/loadavg", cpus: int | None = None, fresh: float = 0.001
    ) -> None:
        self._path = path
        self._cpus = cpus  # usable_cpus() at the first reading unless given
        self._fresh = fresh
        self._read_at = 0.0
        self._running = 0

    def cpu_to_spare(self, board: PollerBoard | None = None, slot: int | None = None) -> bool:
        """``board``, ``slot``: where the caller and its fellow pollers are marked."""
        now = time.perf_counter()
        if now - self._read_at >= self._fresh:
            self._read_at = now
            if self._cpus is None:
                self._cpus = usable_cpus()
            try:
                fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    text = os.read(fd, 128)
                finally:
                    os.close(fd)
                self._running = int(text.split()[3].split(b"/")[0])
            except (OSError, ValueError, IndexError):
                self._running = 0
        # The caller counts itself: nobody but fellow pollers may wait for a CPU.
        cpus = self._cpus or 1
        if self._running <= cpus:
            return True
        return board is not None and self._running - board.fellows(slot) <= cpus


_run_queue = _RunQueue()


def cpu_to_spare(board: PollerBoard | None = None, slot: int | None = None) -> bool:
    """Whether no runnable task but fellow pollers (marked on ``board``, the caller in
    ``slot``) waits for a CPU now: then polling costs nobody anything."""
    return _run_queue.cpu_to_spare(board, slot)


class PollWindow:
    """How long one waiter polls before sleeping; adapted after every wait."""

    __slots__ = ("limit", "seconds")

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.seconds = limit

    def record(self, waited: float) -> None:
        """A wait ended after ``waited`` seconds (polling or asleep)."""
        if waited <= self.seconds:
            return  # caught while polling: the window is right
        if waited <= self.limit:
            self.seconds = min(self.limit, waited * _MARGIN)
        else:
            half = self.seconds / 2
            self.seconds = half if half >= _MIN_WINDOW else 0.0


def _worker_may_poll(board: PollerBoard | None, slot: int | None) -> bool:
    return not (board is not None and board.busy()) and cpu_to_spare(board, slot)


def recv_polling(sock: socket.socket, window: PollWindow, size: int = 1 << 16) -> bytes:
    """``sock.recv(size)`` for a blocking socket, polling for up to the window first."""
    start = time.perf_counter()
    data: bytes | None = None
    board, slot = _worker_seat or (None, None)
    if window.seconds and _worker_may_poll(board, slot):
        deadline = start + window.seconds
        if board is not None:
            board.mark(slot, True)
        try:
            while True:
                try:
                    data = sock.recv(size, socket.MSG_DONTWAIT)
                    break
                except (BlockingIOError, InterruptedError):
                    if time.perf_counter() >= deadline or not _worker_may_poll(board, slot):
                        break
                    os.sched_yield()  # whatever else is runnable on this CPU goes first
        finally:
            if board is not None:
                board.mark(slot, False)
    if data is None:
        data = sock.recv(size)
    window.record(time.perf_counter() - start)
    return data


class LoopPoller:
    """Keeps an asyncio loop from sleeping while somebody expects a message soon.

    A pending callback makes the loop check its sockets without blocking, so what
    arrives is read at once, and everything else on the loop is served as usual.
    Each waiter (a channel, a connection) says until when it polls and when it no
    longer needs to; the loop polls while any does. It shows on the server's board
    as a poller only from its second turn in a row with nothing else to do until a
    message it waited for comes: a loop that keeps itself awake but serves requests
    is work, not a poller.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # weak: the loop is the key this poller is filed under
        self._until: dict[Hashable, float] = {}
        self._ticking = False
        self.board = PollerBoard.create()  # for the workers this loop talks to, too
        self._slot = self.board.claim()
        self._last_tick = 0.0
        self._idle_since = 0.0
        self._requests = 0  # client requests being answered (request_started / _finished)

    def poll(self, waiter: Hashable, seconds: float) -> None:
        if seconds <= 0 or self.board.busy() or not cpu_to_spare(self.board, self._slot):
            self._until.pop(waiter, None)
            return
        self._until[waiter] = time.perf_counter() + seconds
        if not self._ticking:
            self._ticking = True
            self._last_tick = 0.0
            self._call_soon(self._tick)

    def done(self, waiter: Hashable) -> None:
        self._until.pop(waiter, None)
        self.board.mark(self._slot, False)  # what came is work until the next idle turn

    def _call_soon(self, callback: Callable[[], None]) -> None:
        loop = self._loop()
        if loop is not None and not loop.is_closed():
            loop.call_soon(callback)

    def request_started(self) -> None:
        """A client's request came in (BLS calls and ensemble steps are not counted:
        they are part of one)."""
        self._requests += 1
        if self._requests == 2:
            self.board.set_busy(True)

    def request_finished(self) -> None:
        """A client's request got its final response."""
        self._requests -= 1
        if self._requests == 1:
            self.board.set_busy(False)

    @property
    def requests(self) -> int:
        return self._requests

    @property
    def polling(self) -> bool:
        """Whether somebody still keeps the loop awake."""
        return bool(self._until)

    def _tick(self) -> None:
        now = time.perf_counter()
        idle = now - self._last_tick < _IDLE_TURN
        self.board.mark(self._slot, idle)
        if not idle:
            self._idle_since = now
        elif now - self._idle_since > _YIELD_AFTER:
            os.sched_yield()  # whatever else is runnable on this CPU goes first
        self._last_tick = now
        until = self._until
        for waiter in [w for w, deadline in until.items() if deadline <= now]:
            del until[waiter]
        if until and (self.board.busy() or not cpu_to_spare(self.board, self._slot)):
            until.clear()  # the machine is busy now: sleep; the next message will do
        if until:
            self._call_soon(self._tick)
        else:
            self._ticking = False
            self.board.mark(self._slot, False)


_pollers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopPoller]
_pollers = weakref.WeakKeyDictionary()


def loop_poller(loop: asyncio.AbstractEventLoop) -> LoopPoller:
    """The loop's one poller."""
    poller = _pollers.get(loop)
    if poller is None:
        poller = _pollers[loop] = LoopPoller(loop)
    return poller


def close_loop_poller(loop: asyncio.AbstractEventLoop) -> None:
    """The loop's server has stopped: its board goes. The poller stays filed, so a late
    user (a worker still starting) finds a closed board, not a new one: it counts as
    work, polls on its own and hands out no slot."""
    poller = _pollers.get(loop)
    if poller is not None:
        poller.board.close()
