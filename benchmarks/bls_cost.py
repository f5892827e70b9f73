"""Where a BLS call's time goes: the CPU each process spends on it, and what a hop costs.

    python benchmarks/bls_cost.py [--requests N]

(a) CPU per request, by process: examples/models add_sub, and bls_sync (one blocking
    BLS call to add_sub per request), submitted on the engine's loop one at a time,
    with polling off (``busy_poll_us`` 0: every message wakes a sleeping process, so
    the CPU counted is the work and its wake-ups, not time spent polling) and with
    the default. The columns are the server's process (its loop), add_sub's worker
    and bls_sync's worker; "BLS adds" is what bls_sync costs beyond add_sub.
(b) One handoff between two threads of one process, the way an in-process (thread)
    instance would be reached: a thread's round trip through a queue to another and
    back, and the engine loop's round trip to a thread (``call_soon_threadsafe``).

A BLS call crosses four process boundaries (caller -> server -> callee -> server ->
caller); (a) says what they cost in CPU, (b) whether threads in one process would
cross them more cheaply. Prints a markdown report; read the ratios, not the absolute
figures, on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from inprocess import EXAMPLES, bench_on_loop, serving

import dlserve


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def worker_pid(server: dlserve.Server, name: str) -> int:
    stats = server.model(name).statistics()["model_stats"][0]
    return int(stats["instances"][0]["pid"])


def cpu_per_request(n: int, busy_poll_us: int) -> dict[str, list[float]]:
    """Per model: [p50 µs, then CPU µs per request of the server, add_sub's worker and
    bls_sync's worker]."""
    a = np.arange(4, dtype=np.float32)
    inputs = {"INPUT0": a, "INPUT1": a}
    result: dict[str, list[float]] = {}
    with serving(EXAMPLES, ("add_sub", "bls_sync"), busy_poll_us=busy_poll_us) as server:
        processes = [os.getpid(), worker_pid(server, "add_sub"), worker_pid(server, "bls_sync")]
        for name in ("add_sub", "bls_sync"):
            before = [cpu_seconds(p) for p in processes]
            samples = bench_on_loop(server, name, inputs, n)
            after = [cpu_seconds(p) for p in processes]
            ran = n + 200  # (bench_on_loop runs 200 before its samples)
            p50 = sorted(samples)[len(samples) // 2] / 1e3
            result[name] = [p50, *((b - a) / ran * 1e6 for a, b in zip(before, after))]
    return result


def thread_round_trip(n: int) -> float:
    """p50 µs of a round trip from one thread to another and back through queues."""
    there: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    back: queue.SimpleQueue[int] = queue.SimpleQueue()

    def echo() -> None:
        while (item := there.get()) is not None:
            back.put(item)

    thread = threading.Thread(target=echo)
    thread.start()
    samples = []
    for i in range(n):
        t0 = time.perf_counter_ns()
        there.put(i)
        back.get()
        samples.append(time.perf_counter_ns() - t0)
    there.put(None)
    thread.join()
    return sorted(samples)[n // 2] / 1e3


def loop_round_trip(n: int) -> float:
    """p50 µs of an asyncio loop handing work to a thread and being told it is done."""

    async def run() -> float:
        loop = asyncio.get_running_loop()
        work: queue.SimpleQueue[asyncio.Future[None] | None] = queue.SimpleQueue()

        def serve() -> None:
            while (future := work.get()) is not None:
                loop.call_soon_threadsafe(future.set_result, None)

        thread = threading.Thread(target=serve)
        thread.start()
        samples = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            future = loop.create_future()
            work.put(future)
            await future
            samples.append(time.perf_counter_ns() - t0)
        work.put(None)
        thread.join()
        return sorted(samples)[n // 2] / 1e3

    return asyncio.run(run())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    n = args.requests

    print("### (a) CPU per request, by process (µs; submitted on the engine loop, one at a time)\n")
    print("| busy_poll_us | model | p50 µs | server | add_sub worker | bls_sync worker | all |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for busy_poll_us in (0, dlserve.Options.busy_poll_us):
        rows = cpu_per_request(n, busy_poll_us)
        for name, (p50, *cpu) in rows.items():
            cells = " | ".join(f"{c:.0f}" for c in cpu)
            print(f"| {busy_poll_us} | {name} | {p50:.0f} | {cells} | {sum(cpu):.0f} |")
        extra = [b - a for a, b in zip(rows["add_sub"], rows["bls_sync"])]
        cells = " | ".join(f"{c:.0f}" for c in extra[1:])
        print(f"| {busy_poll_us} | BLS adds | {extra[0]:.0f} | {cells} | {sum(extra[1:]):.0f} |")

    print("\n### (b) One handoff between threads of one process (p50 µs)\n")
    print("| round trip | p50 µs |")
    print("|---|---:|")
    print(f"| thread -> thread -> back (queue) | {thread_round_trip(n):.0f} |")
    print(f"| engine-style asyncio loop -> thread -> loop (call_soon_threadsafe) | {loop_round_trip(n):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
