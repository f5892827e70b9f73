"""What a request's reference into a client's shared-memory region costs the server:
``SystemRegions.view`` (its checks, and each view an anchor of its own that counts itself
out when it dies, so that a region in use cannot be unregistered) against the same checks
and a slice of the region's mapping (the view before the count, as of e2bf2a3).

    .venv/bin/python benchmarks/shm_view_cost.py
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from collections.abc import Callable

import numpy as np

from dlserve.memory.arena import MemorySpace
from dlserve.memory.regions import SystemRegions

VIEWS = 20_000


def per_view_us(take: Callable[[], np.ndarray]) -> float:
    """Median over five runs of taking a view and dropping it, in µs."""
    runs = []
    for _ in range(5):
        start = time.perf_counter_ns()
        for _ in range(VIEWS):
            view = take()
            del view
        runs.append((time.perf_counter_ns() - start) / VIEWS / 1000)
    return statistics.median(runs)


def main() -> None:
    key = f"shm_view_cost_{uuid.uuid4().hex[:6]}"
    with open(f"/dev/shm/{key}", "wb") as f:
        f.write(bytes(1 << 20))
    regions = SystemRegions(MemorySpace(), "dlserve_")
    try:
        regions.register("r", f"/{key}", 0, 1 << 20)
        def checked_slice() -> np.ndarray:
            with regions._lock:
                region = regions._regions["r"]
            if region.segment.current_size() < region.offset + 64 + 4096:
                raise AssertionError("shrunk")
            return np.frombuffer(region.anchor, dtype=np.uint8)[64 : 64 + 4096]

        def counted_view() -> np.ndarray:
            return regions.view("r", 64, 4096)

        for _ in range(2):  # alternated, twice
            print(f"checks and a slice (before): {per_view_us(checked_slice):.2f} µs per view")
            print(f"SystemRegions.view (now):    {per_view_us(counted_view):.2f} µs per view")
    finally:
        regions.unregister(force=True)
        os.unlink(f"/dev/shm/{key}")


if __name__ == "__main__":
    main()
