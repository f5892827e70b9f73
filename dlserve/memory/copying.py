"""Copying a large tensor's bytes on every CPU the process may use.

Where a copy cannot be avoided (a model's output written into the region a client
named for it, a numpy array placed in shared memory), it is memory-bound, and one
thread does not saturate the memory system: on the 2-vCPU development VM one thread
copies 64 MiB in ~5.9 ms and two threads in ~4.2 ms; perf_analyzer's identity
64 MiB over gRPC with system shared memory went from 6.5-7.1 to 4.7-5.8 ms per request
(alternating runs).
numpy releases the GIL while it copies, so the threads run side by side. Below
:data:`PARALLEL_MIN` the data mostly sits in cache and a thread costs more than it
saves (8 MiB: 231 µs in one thread, 236 µs in two).

The helper threads live only for the copy: a worker process polls for messages only
while no thread of its own but the usual ones runs (dlserve.ipc.channel), so a pool
of idle threads would turn its polling off.
"""

from __future__ import annotations

import threading

import numpy as np

from dlserve.cpus import usable_cpus

PARALLEL_MIN = 16 << 20  # bytes: a copy at least this big is split over the CPUs
_PART_MIN = PARALLEL_MIN // 2  # no thread copies less than this
_MAX_PARTS = 8  # memory bandwidth, not CPUs, bounds a copy long before this


def copy_bytes(destination: np.ndarray, source: np.ndarray) -> None:
    """``destination[:] = source`` for two 1-D uint8 arrays of one size, split over
    threads when it is big. Overlapping arrays, or no thread to be had, are copied in
    the calling thread; an error in any part is raised here."""
    nbytes = source.nbytes
    if destination.nbytes != nbytes:
        raise ValueError(f"cannot copy {nbytes} bytes into {destination.nbytes}")
    parts = 1
    if nbytes >= PARALLEL_MIN and not np.may_share_memory(destination, source):
        parts = min(usable_cpus(), nbytes // _PART_MIN, _MAX_PARTS)
    if parts < 2:
        np.copyto(destination, source)
        return
    bounds = [nbytes * i // parts for i in range(parts + 1)]
    spans = list(zip(bounds[:-1], bounds[1:]))
    errors: list[BaseException] = []

    def copy_part(start: int, end: int) -> None:
        try:
            np.copyto(destination[start:end], source[start:end])
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread below
            errors.append(exc)

    helpers: list[threading.Thread] = []
    for span in spans[1:]:
        helper = threading.Thread(target=copy_part, args=span, name="dlserve-copy", daemon=True)
        try:
            helper.start()
        except RuntimeError:  # no thread to be had: this thread copies the rest
            break
        helpers.append(helper)
    for span in (spans[0], *spans[1 + len(helpers) :]):
        copy_part(*span)
    for helper in helpers:
        helper.join()
    if errors:
        raise errors[0]
