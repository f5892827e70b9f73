"""WorkerOutput: a worker's stderr, copied to the server's with its last lines kept."""

from __future__ import annotations

import os
import resource
import threading
import time

import pytest

from dlserve.ipc.supervisor import WorkerOutput


def copiers() -> int:
    return len([t for t in threading.enumerate() if t.name == "worker-stderr"])


def test_the_output_is_copied_and_its_last_lines_kept(capfd):
    read, write = os.pipe()
    output = WorkerOutput(read)
    os.write(write, b"".join(b"line %d\n" % i for i in range(100)))
    os.close(write)  # the worker is gone
    output.close(wait=5)
    assert copiers() == 0
    assert output.last_lines().splitlines() == [f"line {i}" for i in range(70, 100)]
    assert "line 0\n" in capfd.readouterr().err  # all of it reached the server's stderr


def test_close_ends_the_copy_while_another_process_still_holds_the_pipe():
    """A helper the model started keeps the write end: what was written is still copied,
    and then the thread and the read end go."""
    read, write = os.pipe()
    output = WorkerOutput(read)
    os.write(write, b"last words\n")
    output.close(wait=5)
    try:
        assert copiers() == 0
        assert output.last_lines() == "last words"
        with pytest.raises(BrokenPipeError):  # nobody reads any more
            os.write(write, b"more\n")
    finally:
        os.close(write)


def test_descriptors_beyond_select_s_limit_work():
    """A busy server's descriptors pass 1024, where select() gives up."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip("the descriptor limit here is below 2048")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    fillers = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        read, write = os.pipe()
        assert read > 1024
        output = WorkerOutput(read)
        os.write(write, b"from far away\n")
        os.close(write)
        output.close(wait=5)
        assert output.last_lines() == "from far away"
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_since_gives_what_came_after_a_mark_as_far_as_it_is_kept():
    read, write = os.pipe()
    output = WorkerOutput(read)
    try:
        os.write(write, b"before\n")
        wait_for_bytes(output, 7)
        mark = output.received
        os.write(write, b"after 1\nafter 2\n")
        wait_for_bytes(output, 7 + 16)
        assert output.since(mark) == "after 1\nafter 2\n"
        assert output.since(output.received) == ""
        flood = b"x" * (WorkerOutput.KEEP_BYTES + 100)
        os.write(write, flood)
        wait_for_bytes(output, 7 + 16 + len(flood))
        assert output.since(mark) == "x" * WorkerOutput.KEEP_BYTES  # the tail kept, not more
    finally:
        os.close(write)
        output.close(wait=5)


def wait_for_bytes(output: WorkerOutput, count: int) -> None:
    deadline = time.monotonic() + 10
    while output.received < count:
        assert time.monotonic() < deadline, f"{output.received} of {count} bytes copied"
        time.sleep(0.01)
