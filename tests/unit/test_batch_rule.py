"""BatchRule: Triton's batch formation (GetDynamicBatch), which the dynamic batcher and
the sequence batcher's oldest strategy share, on queued (batch size, shapes, since)."""

from __future__ import annotations

import time

from dlserve.engine.batcher import BatchRule

A, B = ("a",), ("b",)


def queued(*sizes: int, shapes=A, since: int = 0) -> list[tuple[int, tuple[str], int]]:
    return [(size, shapes, since) for size in sizes]


def test_nothing_queued_sends_nothing_and_waits_for_nothing():
    assert BatchRule([], 8, 1000).take([]) == (0, 0)


def test_without_a_delay_all_that_fits_goes_at_once():
    assert BatchRule([], 4, 0).take(queued(1, 1, 1, 1, 1)) == (4, 0)
    assert BatchRule([], 4, 0).take(queued(1, 2, 2)) == (2, 0)  # 3 rows; 5 would not fit


def test_the_largest_preferred_size_goes_even_when_more_would_fit():
    assert BatchRule([2, 4], 16, 0).take(queued(*[1] * 8)) == (4, 0)
    assert BatchRule([2], 4, 0).take(queued(1, 1, 1)) == (2, 0)


def test_a_batch_that_misses_every_preferred_size_waits_out_the_delay():
    now = time.monotonic_ns()
    assert BatchRule([4], 8, 10_000).take(queued(1, 1, since=now)) == (0, now + 10_000_000)
    # once the oldest has waited the delay, all that fits goes
    assert BatchRule([4], 8, 10_000).take(queued(1, 1, since=now - 20_000_000)) == (2, 0)


def test_a_batch_that_cannot_grow_goes_without_waiting():
    now = time.monotonic_ns()
    # the next request would pass the largest preferred size (3 + 2 > 4)
    assert BatchRule([4], 8, 10_000).take(queued(1, 2, 2, since=now)) == (2, 0)
    # the next request has other shapes
    other_shapes = queued(1, since=now) + queued(1, shapes=B, since=now)
    assert BatchRule([4], 8, 10_000).take(other_shapes) == (1, 0)
    # the next request does not fit max_batch_size
    assert BatchRule([], 4, 10_000).take(queued(3, 2, since=now)) == (1, 0)


def test_a_preferred_size_reached_before_the_batch_closes_is_what_goes():
    now = time.monotonic_ns()
    # 2 is preferred; the third request would pass the largest preferred size (4)
    assert BatchRule([2, 4], 8, 10_000).take(queued(1, 1, 3, since=now)) == (2, 0)
