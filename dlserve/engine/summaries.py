"""Sliding-window samples behind the latency summaries (``--metrics-config
summary_latencies=true``).

Triton's summaries are prometheus-cpp ``Summary`` objects: ``_count`` and ``_sum``
over the server's life, quantiles over the observations of a sliding window
(``max_age`` 60 s in 5 age buckets, so the window holds the last 48 to 60 s).
``_count`` and ``_sum`` are the statistics' own counters; this module keeps only
the window. Recording is one append (quantiles are computed when scraped), and
memory is bounded: the window is 5 slots of 12 s, each holding at most
``SLOT_CAPACITY`` observations exactly and, past that, a uniform random sample of
them (reservoir sampling), weighted by how many it stands for when quantiles are
computed.
"""

from __future__ import annotations

import array
import math
import random
import time
from collections import deque

MAX_AGE_S = 60.0
AGE_BUCKETS = 5
SLOT_S = MAX_AGE_S / AGE_BUCKETS
SLOT_CAPACITY = 1024


class _Slot:
    """The observations of one 12 s slot: every one up to SLOT_CAPACITY, then a
    uniform sample of ``seen`` of them."""

    __slots__ = ("index", "samples", "seen")

    def __init__(self, index: int) -> None:
        self.index = index
        self.samples = array.array("q")
        self.seen = 0

    def add(self, value: int) -> None:
        self.seen += 1
        if len(self.samples) < SLOT_CAPACITY:
            self.samples.append(value)
        else:
            j = random.randrange(self.seen)
            if j < SLOT_CAPACITY:
                self.samples[j] = value


class LatencyWindow:
    """The last minute's observations (microseconds) of one latency."""

    __slots__ = ("_slots",)

    def __init__(self) -> None:
        self._slots: deque[_Slot] = deque(maxlen=AGE_BUCKETS)

    def observe(self, value: int, count: int = 1) -> None:
        """``count`` observations of ``value`` (the requests of one batch)."""
        index = int(time.monotonic() // SLOT_S)
        if not self._slots or self._slots[-1].index != index:
            self._slots.append(_Slot(index))
        slot = self._slots[-1]
        for _ in range(count):
            slot.add(value)

    def quantiles(self, qs: tuple[float, ...]) -> list[float]:
        """The value at each quantile of the window, NaN when it is empty.

        As prometheus-cpp's estimate over exact data: the ``floor(q * n)``-th smallest
        observation (the smallest for a rank below 1).
        """
        oldest = int(time.monotonic() // SLOT_S) - AGE_BUCKETS + 1
        weighted: list[tuple[int, float]] = []
        for slot in self._slots:
            if slot.index >= oldest and slot.samples:
                weight = slot.seen / len(slot.samples)
                weighted.extend((value, weight) for value in slot.samples)
        if not weighted:
            return [math.nan] * len(qs)
        weighted.sort()
        total = sum(weight for _, weight in weighted)
        out: list[float] = []
        for q in qs:
            rank = max(math.floor(q * total), 1)
            seen = 0.0
            for value, weight in weighted:
                seen += weight
                if seen >= rank - 1e-9:
                    break
            out.append(value)
        return out
