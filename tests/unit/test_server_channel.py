"""The server's end of a worker channel (dlserve.ipc.channel.ServerChannel) over a
real socket pair: replies reach futures and reply callbacks, a reply callback runs
inside the read that brings its reply, and a worker that goes away answers every
open request."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import pytest

from dlserve.errors import ErrorCode, InvalidArgumentError, UnavailableError
from dlserve.ipc.channel import ServerChannel
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


def test_replies_and_errors_reach_futures_and_callbacks():
    async def scenario() -> None:
        channel, worker = await open_channel()
        answers: list[tuple[Any, BaseException | None]] = []

        def answered(body: Any, error: BaseException | None) -> None:
            answers.append((body, error))

        future = channel.request(Kind.IS_READY, None)
        channel.request_then(Kind.EXECUTE, ["batch"], answered)
        channel.request_then(Kind.EXECUTE, ["other"], answered)
        sent = await read_requests(worker, 3)
        assert [(kind, body) for kind, _, body in sent] == [
            (Kind.IS_READY, None), (Kind.EXECUTE, ["batch"]), (Kind.EXECUTE, ["other"])
        ]
        (_, ready, _), (_, first, _), (_, second, _) = sent
        await asyncio.get_running_loop().sock_sendall(
            worker,
            encode(Kind.REPLY, second, "second's reply")
            + encode(Kind.ERROR, first, (int(ErrorCode.INVALID_ARG), "bad input"))
            + encode(Kind.REPLY, ready, True),
        )
        assert await asyncio.wait_for(future, 5) is True
        assert answers[0] == ("second's reply", None)
        body, error = answers[1]
        assert body is None and isinstance(error, InvalidArgumentError)
        assert error.message == "bad input"
        channel.close()
        worker.close()

    asyncio.run(scenario())


def test_a_reply_callback_runs_inside_the_read_that_brings_its_reply():
    """No turn of the event loop between the reply and its callback: the scheduler
    dispatches the worker's next execute from there."""

    async def scenario() -> None:
        channel, worker = await open_channel()
        answers: list[Any] = []
        channel.request_then(Kind.EXECUTE, [], lambda body, error: answers.append(body))
        ((_, corr, _),) = await read_requests(worker, 1)
        channel.data_received(encode(Kind.REPLY, corr, "done"))
        assert answers == ["done"]  # before data_received returned
        channel.close()
        worker.close()

    asyncio.run(scenario())


def test_a_failing_callback_is_logged_and_the_channel_goes_on(caplog):
    async def scenario() -> None:
        channel, worker = await open_channel()
        answers: list[Any] = []

        def broken(body: Any, error: BaseException | None) -> None:
            raise RuntimeError("bug in a reply handler")

        channel.request_then(Kind.EXECUTE, [], broken)
        channel.request_then(Kind.EXECUTE, [], lambda body, error: answers.append(body))
        (_, first, _), (_, second, _) = await read_requests(worker, 2)
        with caplog.at_level(logging.ERROR, logger="dlserve.worker"):
            channel.data_received(encode(Kind.REPLY, first, 1) + encode(Kind.REPLY, second, 2))
        assert answers == [2]
        assert "handling a worker's reply failed" in caplog.text
        assert channel.connected
        channel.close()
        worker.close()

    asyncio.run(scenario())


def test_a_worker_that_goes_away_answers_every_open_request():
    async def scenario() -> None:
        channel, worker = await open_channel()
        answers: list[BaseException | None] = []
        future = channel.request(Kind.IS_READY, None)
        channel.request_then(Kind.EXECUTE, [], lambda body, error: answers.append(error))
        await read_requests(worker, 2)
        worker.close()
        with pytest.raises(UnavailableError, match="worker process connection closed"):
            await asyncio.wait_for(future, 5)
        assert len(answers) == 1 and isinstance(answers[0], UnavailableError)
        assert not channel.connected

    asyncio.run(scenario())
