"""The sliding window behind the latency summaries (dlserve.engine.summaries), on a
fake clock: prometheus-cpp's quantile ranks over exact data, the last 48-60 s only,
bounded memory past SLOT_CAPACITY observations per 12 s slot."""

from __future__ import annotations

import math

import pytest

from dlserve.engine import summaries
from dlserve.engine.summaries import SLOT_CAPACITY, LatencyWindow

QS = (0.5, 0.9, 0.95, 0.99, 0.999)


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(summaries.time, "monotonic", lambda: now[0])
    return now


def test_empty_window_is_nan(clock):
    assert all(math.isnan(v) for v in LatencyWindow().quantiles(QS))


@pytest.mark.parametrize(
    "values,expected",
    [
        ([7], [7, 7, 7, 7, 7]),
        ([631, 774, 32324], [631, 774, 774, 774, 774]),  # Triton 2.51 showed these for these
        (list(range(1, 101)), [50, 90, 95, 99, 99]),  # floor(q * n)-th smallest
        (list(range(1000, 0, -1)), [500, 900, 950, 990, 999]),
    ],
)
def test_quantiles_are_prometheus_cpp_ranks(clock, values, expected):
    window = LatencyWindow()
    for v in values:
        window.observe(v)
    assert window.quantiles(QS) == expected


def test_a_batch_is_count_observations(clock):
    window = LatencyWindow()
    window.observe(10, count=9)
    window.observe(1000)
    assert window.quantiles((0.5, 0.9, 0.999)) == [10, 10, 10]  # 10 observations: ranks 5, 9, 9


def test_the_window_holds_the_last_minute(clock):
    window = LatencyWindow()
    window.observe(1)
    clock[0] += 30
    window.observe(2)
    assert window.quantiles((0.5, 0.999)) == [1, 1]
    clock[0] += 36  # the first observation is over 60 s old, the second 36 s
    assert window.quantiles((0.5, 0.999)) == [2, 2]
    clock[0] += 60
    assert math.isnan(window.quantiles((0.5,))[0])
    window.observe(3)
    assert window.quantiles((0.5,)) == [3]


def test_memory_is_bounded_and_quantiles_stay_representative(clock):
    window = LatencyWindow()
    for i in range(20 * SLOT_CAPACITY):
        window.observe(i % 100)  # uniform over 0..99
    assert sum(len(slot.samples) for slot in window._slots) <= SLOT_CAPACITY
    median, p90 = window.quantiles((0.5, 0.9))
    assert 40 <= median <= 60 and 80 <= p90 <= 99
