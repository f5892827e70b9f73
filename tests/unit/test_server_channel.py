"""The server's end of a worker channel (dlserve.ipc.channel.ServerChannel) over a
real socket pair: each reply reaches the request it answers, whatever the order,
and a worker that goes away answers every open request."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from dlserve.errors import ErrorCode, InvalidArgumentError, UnavailableError
from dlserve.ipc.channel import ServerChannel, WorkerGoneError
from dlserve.ipc.protocol import FrameBuffer, Kind, encode


async def open_channel() -> tuple[ServerChannel, socket.socket]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    _, channel = await asyncio.get_running_loop().create_unix_connection(
        lambda: ServerChannel(lambda message: None, lambda: None), sock=ours
    )
    theirs.setblocking(False)
    return channel, theirs


async def read_requests(worker: socket.socket, count: int) -> list[tuple[int, int, Any]]:
    """What the server sent, as the worker reads it."""
    loop, frames, messages = asyncio.get_running_loop(), FrameBuffer(), []
    while len(messages) < count:
        messages += frames.feed(await loop.sock_recv(worker, 1 << 16))
    return messages


def test_replies_and_errors_reach_their_requests_in_any_order():
    async def scenario() -> None:
        channel, worker = await open_channel()
        ready = channel.request(Kind.IS_READY, None)
        first = channel.request(Kind.EXECUTE, ["batch"])
        second = channel.request(Kind.EXECUTE, ["other"])
        third = channel.request(Kind.EXECUTE, ["third"])
        sent = await read_requests(worker, 4)
        assert [(kind, body) for kind, _, body in sent] == [
            (Kind.IS_READY, None), (Kind.EXECUTE, ["batch"]), (Kind.EXECUTE, ["other"]),
            (Kind.EXECUTE, ["third"]),
        ]
        (_, ready_corr, _), (_, first_corr, _), (_, second_corr, _), (_, third_corr, _) = sent
        await asyncio.get_running_loop().sock_sendall(
            worker,
            encode(Kind.REPLY, second_corr, "second's reply")
            + encode(Kind.ERROR, first_corr, (int(ErrorCode.INVALID_ARG), "bad input"))
            + encode(Kind.REPLY, ready_corr, True)
            + encode(Kind.ERROR, third_corr, (int(ErrorCode.UNAVAILABLE), "no shared memory")),
        )
        assert await asyncio.wait_for(second, 5) == "second's reply"
        with pytest.raises(InvalidArgumentError, match="bad input"):
            await asyncio.wait_for(first, 5)
        assert await asyncio.wait_for(ready, 5) is True
        # An UNAVAILABLE answer from a live worker is that call's error, not its death.
        with pytest.raises(UnavailableError, match="no shared memory") as info:
            await asyncio.wait_for(third, 5)
        assert not isinstance(info.value, WorkerGoneError)
        assert channel.connected
        channel.close()
        worker.close()

    asyncio.run(scenario())


def test_a_worker_that_goes_away_answers_every_open_request():
    async def scenario() -> None:
        channel, worker = await open_channel()
        pending = [channel.request(Kind.IS_READY, None), channel.request(Kind.EXECUTE, [])]
        await read_requests(worker, 2)
        worker.close()
        for future in pending:
            with pytest.raises(WorkerGoneError, match="worker process connection closed"):
                await asyncio.wait_for(future, 5)
        assert not channel.connected

    asyncio.run(scenario())
