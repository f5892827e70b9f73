"""How many CPUs this process may use: what polling (dlserve.ipc.polling) and
parallel copies (dlserve.memory.copying) count on."""

from __future__ import annotations

import os
from pathlib import Path


def usable_cpus(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """The CPUs this process may run on, fewer under a cgroup CPU quota (a container's
    CPU limit, v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``): a throttled container pays
    for every CPU-second it spends, so a fractional CPU rounds down."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    quota = _cpu_quota(cgroup)
    return cpus if quota is None else max(1, min(cpus, int(quota)))


def _cpu_quota(cgroup: Path) -> float | None:
    try:
        limit, period = (cgroup / "cpu.max").read_text().split()
        if limit != "max":
            return int(limit) / int(period)
    except (OSError, ValueError):
        pass
    try:
        limit = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
        if limit > 0 and period > 0:
            return limit / period
    except (OSError, ValueError):
        pass
    return None
