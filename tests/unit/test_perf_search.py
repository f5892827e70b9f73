"""--binary-search's order of levels (perf_analyzer's): START, END, then halving."""

from __future__ import annotations

import pytest

from dlserve.perf.cli import settings_from_args
from dlserve.perf.profile import binary_levels

from .test_perf_options import parse


def searched(argv: list[str], limit: float) -> list[float]:
    """The levels measured when those up to ``limit`` make it."""
    search = binary_levels(settings_from_args(parse("-m", "m", "--binary-search", *argv)))
    levels = [next(search)]
    try:
        while True:
            levels.append(search.send(levels[-1] <= limit))
    except StopIteration:
        return levels


@pytest.mark.parametrize(
    ("argv", "limit", "expected"),
    [
        (["--concurrency-range", "1:16"], 5, [1, 16, 8, 4, 6, 5]),
        (["--concurrency-range", "1:16:4"], 5, [1, 16, 8, 4]),  # STEP: the precision
        (["--concurrency-range", "2:16"], 1, [2]),  # START misses: nothing above can make it
        (["--concurrency-range", "1:16"], 99, [1, 16]),  # END makes it: done
        (["--request-rate-range", "100:200:10"], 140, [100, 200, 150, 125, 137.5, 143.75]),
    ],
)
def test_binary_search_order(argv, limit, expected):
    assert searched(argv, limit) == expected
