"""SendProgress: telling a client that reads nothing from one that reads slowly."""

from __future__ import annotations

from dlserve.frontends.stalls import SendProgress


def test_nothing_waiting_is_no_stall():
    sending = SendProgress()
    assert sending.stalled_for(0, 100.0) == 0.0
    assert sending.stalled_for(0, 200.0) == 0.0


def test_bytes_that_do_not_shrink_stall_from_the_first_look_that_saw_them():
    sending = SendProgress()
    assert sending.stalled_for(500, 10.0) == 0.0
    assert sending.stalled_for(500, 12.5) == 2.5
    assert sending.stalled_for(800, 14.0) == 4.0  # (more queued behind: still nothing read)


def test_a_client_that_reads_a_little_between_looks_is_never_stalled():
    sending = SendProgress()
    for look, unsent in enumerate((900, 700, 650, 10)):
        assert sending.stalled_for(unsent, float(look)) == 0.0


def test_once_everything_went_a_new_wait_starts_afresh():
    sending = SendProgress()
    sending.stalled_for(500, 1.0)
    sending.stalled_for(500, 5.0)
    assert sending.stalled_for(0, 6.0) == 0.0
    assert sending.stalled_for(500, 7.0) == 0.0
    assert sending.stalled_for(500, 8.0) == 1.0
