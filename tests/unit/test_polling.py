"""dlserve.ipc.polling: how long waiters poll, polling reads, keeping a loop awake."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from dlserve.ipc.polling import PollWindow, loop_poller, recv_polling

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


def test_recv_polling_catches_a_message_that_lands_while_it_polls(pair):
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


def test_the_poller_keeps_the_loop_awake_until_the_deadline_or_done():
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
