"""The worker's end of a channel (dlserve.ipc.channel.WorkerChannel) over a real socket
pair whose server end is gone."""

from __future__ import annotations

import gc
import socket
import weakref
from collections.abc import Iterator

import pytest

from dlserve.ipc.channel import Stream, WorkerChannel
from dlserve.ipc.protocol import Kind


@pytest.fixture
def orphaned() -> Iterator[WorkerChannel]:
    """A worker's channel whose server closed its end."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.close()
    channel = WorkerChannel(ours)
    yield channel
    channel.close()


class Answer:
    """Stands for the error response the runtime puts in such a call's stream."""


def test_a_call_that_cannot_be_sent_says_the_server_closed_and_keeps_nothing(orphaned):
    """The call's stream was registered before the send and stayed registered when the
    send failed (a BrokenPipeError): held by the channel for good, with what it held."""
    stream = Stream()
    with pytest.raises(EOFError, match="server closed the channel"):
        orphaned.call(Kind.BLS, ("model", -1), stream)
    answer = Answer()
    stream.items.append(answer)
    kept = weakref.ref(answer)
    del stream, answer
    gc.collect()
    assert kept() is None


def test_a_request_that_cannot_be_sent_says_the_server_closed(orphaned):
    with pytest.raises(EOFError, match="server closed the channel"):
        orphaned.request(Kind.METRIC_VALUE, ("family", {}))
    with pytest.raises(EOFError):  # and the channel knows it is gone
        orphaned.next_command()


def test_a_read_that_fails_hands_the_reading_on_to_a_waiting_thread():
    """A frame that cannot be decoded fails the thread that read it; a thread waiting for
    its own reply meanwhile takes over the reading and sees the server go, rather than
    sleeping for good with nobody reading."""
    import struct
    import threading
    import time

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    channel = WorkerChannel(ours)
    outcomes: dict[str, str] = {}

    def ask(name: str) -> None:
        try:
            channel.request(Kind.METRIC_VALUE, (name, {}))
            outcomes[name] = "answered"
        except BaseException as exc:  # noqa: BLE001 - what each thread ended with is the point
            outcomes[name] = type(exc).__name__

    threads = [threading.Thread(target=ask, args=(name,), daemon=True) for name in "AB"]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while channel._waiters != 1:  # one thread reads, the other waits for it
        assert time.monotonic() < deadline, "the second thread never waited"
        time.sleep(0.01)
    try:
        theirs.sendall(struct.pack("<I", 3) + b"\xff\xff\xff")  # not marshal data
        time.sleep(0.2)
        theirs.close()
        for thread in threads:
            thread.join(10)
        assert sorted(outcomes.values()) == ["EOFError", "ValueError"]
    finally:
        channel.close()
