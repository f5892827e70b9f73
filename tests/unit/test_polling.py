"""dlserve.ipc.polling: how long waiters poll, polling reads, keeping a loop awake."""

from __future__ import annotations

import asyncio
import os
import socket
import threading

import pytest

from dlserve.ipc import polling
from dlserve.ipc.polling import PollWindow, loop_poller, recv_polling


@pytest.fixture
def spare_cpu(monkeypatch):
    """Polling as on an idle machine (whatever else this one runs meanwhile)."""
    monkeypatch.setattr(polling, "cpu_to_spare", lambda: True)


@pytest.fixture
def busy_machine(monkeypatch):
    monkeypatch.setattr(polling, "cpu_to_spare", lambda: False)

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
    assert polling.usable_cpus(tmp_path) == everything  # no cgroup files: no limit
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert polling.usable_cpus(tmp_path) == everything
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs (cgroup v2)
    assert polling.usable_cpus(tmp_path) == 1
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")  # half a CPU (cgroup v1)
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert polling.usable_cpus(tmp_path) == 1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")  # v1: no limit
    assert polling.usable_cpus(tmp_path) == everything
