"""Large copies split over threads (dlserve.memory.copying) put every byte where it belongs."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dlserve.memory import copying
from dlserve.memory.copying import PARALLEL_MIN, copy_bytes


@pytest.mark.parametrize(
    "nbytes", [0, 1, 4099, PARALLEL_MIN - 1, PARALLEL_MIN, 3 * PARALLEL_MIN + 7]
)
def test_every_byte_lands_in_place(nbytes):
    source = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    destination = np.zeros(nbytes + 64, dtype=np.uint8)
    copy_bytes(destination[32 : 32 + nbytes], source)
    assert np.array_equal(destination[32 : 32 + nbytes], source)
    assert not destination[:32].any() and not destination[32 + nbytes :].any()


def test_a_big_copy_uses_helper_threads_that_are_gone_afterwards(monkeypatch):
    monkeypatch.setattr(copying, "usable_cpus", lambda: 4)
    seen: list[str] = []
    copyto = np.copyto

    def watched(destination, source):
        seen.append(threading.current_thread().name)
        copyto(destination, source)

    monkeypatch.setattr(copying.np, "copyto", watched)
    before = threading.active_count()
    source = np.full(2 * PARALLEL_MIN, 7, dtype=np.uint8)
    destination = np.zeros_like(source)
    copy_bytes(destination, source)
    assert (destination == 7).all()
    assert len(seen) == 4 and seen.count("dlserve-copy") == 3  # four parts, three helpers
    assert threading.active_count() == before


def test_one_cpu_copies_in_the_calling_thread(monkeypatch):
    monkeypatch.setattr(copying, "usable_cpus", lambda: 1)
    monkeypatch.setattr(copying.threading, "Thread", None)  # any helper would fail
    source = np.arange(PARALLEL_MIN, dtype=np.uint64).view(np.uint8)[:PARALLEL_MIN]
    destination = np.empty_like(source)
    copy_bytes(destination, source)
    assert np.array_equal(destination, source)


def test_sizes_must_match():
    with pytest.raises(ValueError, match="cannot copy 8 bytes into 4"):
        copy_bytes(np.zeros(4, np.uint8), np.zeros(8, np.uint8))


def test_overlapping_arrays_are_copied_in_one_piece(monkeypatch):
    monkeypatch.setattr(copying, "usable_cpus", lambda: 4)
    monkeypatch.setattr(copying.threading, "Thread", None)  # any helper would fail
    buffer = np.arange(3 * PARALLEL_MIN, dtype=np.uint64).view(np.uint8)[: 3 * PARALLEL_MIN]
    source = buffer[: 2 * PARALLEL_MIN]
    destination = buffer[PARALLEL_MIN // 2 : PARALLEL_MIN // 2 + 2 * PARALLEL_MIN]
    expected = source.copy()
    copy_bytes(destination, source)
    assert np.array_equal(destination, expected)


def test_without_threads_the_caller_copies_every_part(monkeypatch):
    monkeypatch.setattr(copying, "usable_cpus", lambda: 4)

    class NoThread(threading.Thread):
        def start(self) -> None:
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(copying.threading, "Thread", NoThread)
    source = np.full(2 * PARALLEL_MIN, 3, dtype=np.uint8)
    destination = np.zeros_like(source)
    copy_bytes(destination, source)
    assert (destination == 3).all()


def test_an_error_in_a_helper_thread_is_raised_to_the_caller(monkeypatch):
    monkeypatch.setattr(copying, "usable_cpus", lambda: 2)
    copyto = np.copyto

    def failing_in_helpers(destination, source):
        if threading.current_thread().name == "dlserve-copy":
            raise MemoryError("helper failed")
        copyto(destination, source)

    monkeypatch.setattr(copying.np, "copyto", failing_in_helpers)
    with pytest.raises(MemoryError, match="helper failed"):
        copy_bytes(np.zeros(2 * PARALLEL_MIN, np.uint8), np.ones(2 * PARALLEL_MIN, np.uint8))
