"""dlserve.ipc.polling: how long waiters poll, polling reads, keeping a loop awake."""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import threading
import time

import pytest

from dlserve.cpus import usable_cpus
from dlserve.ipc import polling
from dlserve.ipc.polling import PollWindow, close_loop_poller, loop_poller, recv_polling

from ..conftest import fd_targets


@pytest.fixture
def spare_cpu(monkeypatch):
    """Polling as on an idle machine (whatever else this one runs meanwhile)."""
    monkeypatch.setattr(polling, "cpu_to_spare", lambda board=None, slot=None: True)


@pytest.fixture
def busy_machine(monkeypatch):
    monkeypatch.setattr(polling, "cpu_to_spare", lambda board=None, slot=None: False)

# -- PollWindow --------------------------------------------------------------------------------


def test_a_window_starts_at_its_limit():
    assert PollWindow(0.001).seconds == 0.001
    assert PollWindow(0.0).seconds == 0.0


def test_a_wait_caught_while_polling_keeps_the_window():
    window = PollWindow(0.001)
    window.record(0.0002)
    assert window.seconds == 0.001


def test_a_wait_just_past_the_window_widens_it_with_a_margin():
    window = PollWindow(0.001)
    window.seconds = 0.0001
    window.record(0.0004)
    assert window.seconds == pytest.approx(0.0006)
    window.record(0.0009)  # 1.5 x would pass the limit: the limit it is
    assert window.seconds == 0.001


def test_waits_longer_than_the_limit_halve_the_window_down_to_nothing():
    window = PollWindow(0.001)
    seen = []
    for _ in range(8):
        window.record(0.5)  # a trickle of traffic: polling would only burn CPU
        seen.append(window.seconds)
    assert seen[:3] == [pytest.approx(0.0005), pytest.approx(0.00025), pytest.approx(0.000125)]
    assert seen[-1] == 0.0
    window.record(0.0003)  # traffic is dense again: polling pays again
    assert window.seconds == pytest.approx(0.00045)


def test_a_window_with_no_limit_never_polls():
    window = PollWindow(0.0)
    window.record(0.00001)
    assert window.seconds == 0.0


# -- recv_polling ----------------------------------------------------------------------------


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_recv_polling_returns_what_is_already_there(pair):
    a, b = pair
    b.sendall(b"ready")
    window = PollWindow(0.001)
    assert recv_polling(a, window) == b"ready"
    assert window.seconds == 0.001


def test_recv_polling_catches_a_message_that_lands_while_it_polls(pair, spare_cpu):
    a, b = pair
    window = PollWindow(0.5)  # polls for up to half a second: the message comes first
    sender = threading.Timer(0.01, b.sendall, args=(b"soon",))
    sender.start()
    assert recv_polling(a, window) == b"soon"
    sender.join()
    assert window.seconds == 0.5


def test_recv_polling_sleeps_after_its_window_and_still_gets_the_message(pair):
    a, b = pair
    window = PollWindow(0.001)
    sender = threading.Timer(0.05, b.sendall, args=(b"late",))
    sender.start()
    assert recv_polling(a, window) == b"late"
    sender.join()
    assert window.seconds == pytest.approx(0.0005)  # the wait passed the limit: halved


def test_recv_polling_reports_end_of_file(pair):
    a, b = pair
    b.close()
    assert recv_polling(a, PollWindow(0.001)) == b""


# -- LoopPoller ------------------------------------------------------------------------------


def test_the_poller_keeps_the_loop_awake_until_the_deadline_or_done(spare_cpu):
    async def run() -> list[bool]:
        loop = asyncio.get_running_loop()
        poller = loop_poller(loop)
        assert loop_poller(loop) is poller  # one per loop
        seen = [poller.polling]
        poller.poll("reply", 0.02)
        seen.append(poller.polling)
        await asyncio.sleep(0.1)  # the deadline passes: the poller lets the loop sleep
        seen.append(poller.polling)
        poller.poll("reply", 10.0)
        poller.poll("request", 10.0)
        poller.done("reply")
        await asyncio.sleep(0.01)
        seen.append(poller.polling)  # one waiter is left
        poller.done("request")
        await asyncio.sleep(0.01)
        seen.append(poller.polling)
        poller.poll("nothing", 0.0)  # a zero window asks for nothing
        seen.append(poller.polling)
        return seen

    assert asyncio.run(run()) == [False, True, False, True, False, False]


def test_nobody_polls_on_a_busy_machine(pair, busy_machine):
    a, b = pair
    window = PollWindow(0.5)
    sender = threading.Timer(0.01, b.sendall, args=(b"soon",))
    sender.start()
    assert recv_polling(a, window) == b"soon"  # slept in recv, and still got it
    sender.join()

    async def run() -> bool:
        poller = loop_poller(asyncio.get_running_loop())
        poller.poll("reply", 10.0)
        return poller.polling

    assert asyncio.run(run()) is False


def test_a_cpu_is_spare_while_no_runnable_task_waits_for_one(tmp_path):
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("0.50 0.40 0.30 2/150 4242\n")
    assert polling._RunQueue(str(loadavg), cpus=2).cpu_to_spare()  # one task per CPU
    loadavg.write_text("2.50 1.40 0.30 3/150 4242\n")
    assert not polling._RunQueue(str(loadavg), cpus=2).cpu_to_spare()  # one waits
    assert polling._RunQueue(str(tmp_path / "missing"), cpus=2).cpu_to_spare()  # no /proc


def test_a_reading_of_the_run_queue_holds_while_it_is_fresh(tmp_path):
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("0.50 0.40 0.30 1/150 4242\n")
    cached = polling._RunQueue(str(loadavg), cpus=1, fresh=3600.0)
    always = polling._RunQueue(str(loadavg), cpus=1, fresh=0.0)
    assert cached.cpu_to_spare() and always.cpu_to_spare()
    loadavg.write_text("0.50 0.40 0.30 9/150 4242\n")
    assert cached.cpu_to_spare()  # the reading of a moment ago still holds
    assert not always.cpu_to_spare()


def test_a_cgroup_cpu_quota_caps_the_cpus_polling_counts_on(tmp_path):
    everything = len(os.sched_getaffinity(0))
    assert usable_cpus(tmp_path) == everything  # no cgroup files: no limit
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(tmp_path) == everything
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs (cgroup v2)
    assert usable_cpus(tmp_path) == 1
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")  # half a CPU (cgroup v1)
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cpus(tmp_path) == 1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")  # v1: no limit
    assert usable_cpus(tmp_path) == everything


# -- PollerBoard -----------------------------------------------------------------------------


@pytest.fixture
def board():
    fresh = polling.PollerBoard.create()
    yield fresh
    fresh.close()


def test_a_board_hands_out_distinct_slots_and_takes_them_back(board):
    first, second = board.claim(), board.claim()
    assert first != second
    board.mark(first, True)
    board.mark(second, True)
    assert board.fellows(None) == 2
    board.free(first)  # a freed slot no longer counts as polling
    assert board.fellows(None) == 1
    assert board.claim() == first
    board.mark(None, True)  # a poller without a slot (the board was full) marks nothing
    assert board.fellows(None) == 1


def test_a_full_board_has_no_slot_to_give(board):
    slots = {board.claim() for _ in range(polling.PollerBoard.SEATS)}
    assert len(slots) == polling.PollerBoard.SEATS
    assert board.claim() is None


def test_a_worker_sees_the_marks_of_the_board_it_inherited(board):
    server_slot, worker_slot = board.claim(), board.claim()
    inherited = polling.PollerBoard.attach(os.dup(board.fileno()))  # what a worker maps
    try:
        inherited.mark(worker_slot, True)
        board.mark(server_slot, True)
        assert board.snapshot() == inherited.snapshot()
        assert board.fellows(server_slot) == 1 and inherited.fellows(worker_slot) == 1
    finally:
        inherited.close()


def test_fellow_pollers_do_not_count_as_work(tmp_path, board):
    """Three processes relaying one BLS call on two CPUs: the two that wait poll, and
    a CPU they hold is as good as free for the one with work."""
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("2.50 1.40 0.30 3/150 4242\n")  # three runnable on two CPUs
    queue = polling._RunQueue(str(loadavg), cpus=2, fresh=0.0)
    mine, fellow, other = board.claim(), board.claim(), board.claim()
    assert not queue.cpu_to_spare(board, mine)
    board.mark(mine, True)  # the caller itself is no fellow
    assert not queue.cpu_to_spare(board, mine)
    assert not queue.cpu_to_spare()  # nor is anybody without a board
    board.mark(fellow, True)
    assert queue.cpu_to_spare(board, mine)
    loadavg.write_text("2.50 1.40 0.30 5/150 4242\n")  # two more with real work: busy
    board.mark(other, True)
    assert not queue.cpu_to_spare(board, mine)


@pytest.mark.parametrize("server_busy", [False, True])
def test_a_worker_is_marked_on_the_board_only_while_it_polls(pair, spare_cpu, board, monkeypatch, server_busy):
    """And it does not poll at all while its server answers more than one client request."""
    a, b = pair
    slot = board.claim()
    monkeypatch.setattr(polling, "_worker_seat", (board, slot))
    board.set_busy(server_busy)
    seen = []

    def look_then_send() -> None:
        seen.append(board.snapshot()[slot])
        b.sendall(b"soon")

    sender = threading.Timer(0.02, look_then_send)
    sender.start()
    started = time.thread_time()
    assert recv_polling(a, PollWindow(0.5)) == b"soon"
    spent = time.thread_time() - started
    sender.join()
    if server_busy:
        assert seen == [0] and spent < 0.01  # asleep in recv, not polling
    else:
        assert seen == [1]  # marked while polling
    assert board.snapshot()[slot] == 0  # and no longer once the message came
    assert board.fellows(None) == 0  # the busy mark is no poller's


def test_a_loop_is_marked_as_a_poller_only_while_its_turns_are_idle(spare_cpu):
    async def run() -> tuple[list[int], list[int], int]:
        loop = asyncio.get_running_loop()
        poller = loop_poller(loop)
        board, slot = poller.board, poller._slot
        try:
            poller.poll("reply", 10.0)
            idle = []
            for _ in range(50):  # nothing else to do: the loop only polls
                await asyncio.sleep(0.0002)
                idle.append(board.snapshot()[slot])
            busy = []
            for _ in range(5):
                time.sleep(0.001)  # a turn spent working (a request served)
                await asyncio.sleep(0)
                busy.append(board.snapshot()[slot])
            await asyncio.sleep(0.001)
            poller.done("reply")  # the reply came: handling it is work
            return idle, busy, board.snapshot()[slot]
        finally:
            close_loop_poller(loop)

    idle, busy, after = asyncio.run(run())
    assert sum(idle) > len(idle) / 2  # a turn the host's scheduler stretched may read as work
    assert busy == [0] * 5
    assert after == 0


def test_a_stopped_servers_board_is_closed_and_stays_closed(spare_cpu):
    """A late user of a stopped server's loop (a worker still starting) finds the
    closed board: no slot, no descriptor, no fellows, no error."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        poller = loop_poller(loop)
        board = poller.board
        fd = board.fileno()
        close_loop_poller(loop)
        link = f"/proc/self/fd/{fd}"
        assert not (os.path.exists(link) and "dlserve-pollers" in os.readlink(link))
        assert loop_poller(loop) is poller and poller.board is board  # no new board
        assert board.claim() is None and board.fileno() == -1 and board.fellows(None) == 0
        board.mark(0, True)
        board.free(0)
        poller.poll("late", 0.01)  # polls on, counting nobody as a fellow
        await asyncio.sleep(0.02)
        close_loop_poller(loop)  # twice is harmless

    asyncio.run(run())


def test_the_board_of_a_loop_nobody_stopped_closes_when_the_loop_goes():
    def board_fds() -> int:
        return sum("dlserve-pollers" in target for target in fd_targets())

    gc.collect()
    before = board_fds()
    loop = asyncio.new_event_loop()
    loop_poller(loop)
    assert board_fds() == before + 2  # the board's descriptor and its mapping's
    loop.close()
    del loop
    gc.collect()
    assert board_fds() == before


def test_while_the_server_answers_more_than_one_client_request_its_loop_does_not_poll(spare_cpu):
    async def run() -> list[tuple[bool, bool]]:
        loop = asyncio.get_running_loop()
        poller = loop_poller(loop)
        seen = []
        try:
            poller.request_started()
            poller.poll("reply", 10.0)
            seen.append((poller.board.busy(), poller.polling))  # one request: it polls
            poller.request_started()
            await asyncio.sleep(0.01)
            seen.append((poller.board.busy(), poller.polling))  # two: it stopped
            poller.poll("reply", 10.0)
            seen.append((poller.board.busy(), poller.polling))  # and starts no more
            poller.request_finished()
            poller.poll("reply", 10.0)
            seen.append((poller.board.busy(), poller.polling))  # one again: it polls
            poller.request_finished()
            poller.done("reply")
            assert poller.requests == 0
            return seen
        finally:
            close_loop_poller(loop)

    assert asyncio.run(run()) == [(False, True), (True, False), (True, False), (False, True)]

