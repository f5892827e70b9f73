"""Polling before sleeping (dlserve.ipc.polling) in a running server: it stops once
traffic stops, and it can be turned off."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import psutil
import pytest

import dlserve
from dlserve.ipc.polling import loop_poller

from ..conftest import fd_targets, wait_until


def cpu_seconds(processes: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in processes)


def test_a_polling_server_uses_no_cpu_once_traffic_stops(servers, make_repo):
    server = servers.start(make_repo("add_sub"), busy_poll_us=10_000)  # polls up to 10 ms
    model = server.model("add_sub")
    a = np.arange(16, dtype=np.float32)
    for _ in range(300):  # dense traffic: both sides learn to poll
        (response,) = model.infer(inputs={"INPUT0": a, "INPUT1": a})
        assert response.error is None
    time.sleep(0.2)
    me = psutil.Process()
    processes = [me, *me.children(recursive=True)]
    before = cpu_seconds(processes)
    time.sleep(1.0)
    used = cpu_seconds(processes) - before
    # polling one CPU for the second would use ~1 s; sleeping uses next to nothing
    assert used < 0.25, f"{used:.3f} CPU seconds used in an idle second"


def test_polling_can_be_turned_off(servers, make_repo):
    server = servers.start(make_repo("add_sub"), busy_poll_us=0)
    a = np.arange(16, dtype=np.float32)
    (response,) = server.model("add_sub").infer(inputs={"INPUT0": a, "INPUT1": a})
    assert np.from_dlpack(response.outputs["OUTPUT0"]).tolist() == (a + a).tolist()


@pytest.mark.parametrize("value", [-1, 10_001])
def test_a_poll_limit_out_of_range_is_refused(value):
    options = dlserve.Options(model_repository="/nowhere", busy_poll_us=value)
    with pytest.raises(dlserve.InvalidArgumentError, match="busy_poll_us must be between 0 and"):
        options.engine_settings()


def board_descriptors(pid: int) -> list[str]:
    """The worker's descriptors of the server's poller board (a memfd)."""
    return [t for t in fd_targets(pid) if t.startswith("/memfd:dlserve-pollers")]


def test_workers_poll_on_the_servers_board_and_give_their_slots_back(servers, make_repo):
    """Each worker of a polling server is told its slot on the server's board (what
    lets a BLS relay's waiting processes keep polling), and the slot comes back when
    the worker goes: a restarted worker takes one, and the board goes with the server."""
    server = servers.start(make_repo("add_sub"), busy_poll_us=1000)
    a = np.arange(16, dtype=np.float32)
    (response,) = server.model("add_sub").infer(inputs={"INPUT0": a, "INPUT1": a})
    assert response.error is None
    instance = server.engine.model("add_sub").instances[0]
    assert len(board_descriptors(instance.pid)) == 1
    board = loop_poller(server.loop).board
    assert board.free_slots == board.SEATS - 2  # the loop's and the worker's

    old_pid = instance.pid
    os.kill(old_pid, signal.SIGKILL)
    wait_until(lambda: instance.ready and instance.pid != old_pid)  # restarted
    assert board.free_slots == board.SEATS - 2  # the dead worker's slot went to its successor
    assert len(board_descriptors(instance.pid)) == 1
    servers.stop(server)  # the harness checks that no descriptor is left, the board's included


def test_a_server_that_does_not_poll_gives_its_workers_no_board(servers, make_repo):
    server = servers.start(make_repo("add_sub"), busy_poll_us=0)
    a = np.arange(16, dtype=np.float32)
    (response,) = server.model("add_sub").infer(inputs={"INPUT0": a, "INPUT1": a})
    assert response.error is None
    assert board_descriptors(server.engine.model("add_sub").instances[0].pid) == []


def test_requests_in_flight_are_counted_until_each_is_answered(servers, make_repo):
    """More than one client request at once makes the server's processes stop polling
    (dlserve.ipc.polling); a BLS call is part of its caller's request; every request is
    counted off once answered, failed or cancelled, so polling comes back."""
    server = servers.start(make_repo("faulty", "bls"), busy_poll_us=1000)
    poller = loop_poller(server.loop)
    faulty = server.model("faulty")
    x = np.arange(4, dtype=np.float32)

    slow = [faulty.infer(inputs={"INPUT0": x}, parameters={"mode": "sleep:0.3"}) for _ in range(2)]
    wait_until(lambda: poller.requests == 2)
    assert poller.board.busy()
    assert all(list(responses)[-1].error is None for responses in slow)
    wait_until(lambda: poller.requests == 0)
    assert not poller.board.busy()

    call = server.model("bls").infer(inputs={"INPUT0": x}, parameters={"route": "faulty", "inner_mode": "sleep:0.3"})
    time.sleep(0.15)  # the BLS call to faulty is running
    assert poller.requests == 1 and not poller.board.busy()
    assert list(call)[-1].error is None

    for mode in ("raise", "error:INVALID_ARG"):
        assert list(faulty.infer(inputs={"INPUT0": x}, parameters={"mode": mode}, raise_on_error=False))[-1].error
    with pytest.raises(dlserve.InvalidArgumentError):  # refused before it is queued: never counted
        faulty.infer(inputs={"INPUT0": np.zeros((2, 2), np.int8)})
    cancelled = faulty.infer(inputs={"INPUT0": x}, parameters={"mode": "sleep:0.3"})
    wait_until(lambda: poller.requests == 1)
    cancelled.cancel()
    wait_until(lambda: poller.requests == 0)
    assert not poller.board.busy()
