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
