"""WorkerOutput: a worker's stderr, copied to the server's with its last lines kept."""

from __future__ import annotations

import os
import resource
import threading

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
