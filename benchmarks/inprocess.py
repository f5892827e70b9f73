"""In-process benchmark: the engine and its worker processes, no network.

    python benchmarks/inprocess.py [--requests N] [--triton] [--busy-poll-us N]

(a) add_sub through a worker: latency of the sync in-process API (caller thread ->
    engine loop -> worker -> back), of a request submitted on the engine's own loop
    (what a frontend pays: no thread hops), and the server's own ``compute_infer``
    (the execute round trip to the worker, as Triton's statistics define it).
    The model's own ``execute()`` is also timed, called directly in this process,
    so the server<->worker overhead is the on-loop round trip less that.
    With ``--triton``, real Triton (benchmarks/peers.py) serves the same model in
    the same run and its ``compute_infer`` is read from its statistics endpoint.
(b) identity on 1 MiB and 64 MiB FP32: a tensor already in shared memory
    (``server.allocate_tensor``), a numpy input (copied once into shared memory),
    and a memcpy of the same size for scale.
(c) BLS overhead with no client in the way: examples/models bls_sync (one blocking
    BLS call to add_sub per request) against add_sub itself, both submitted on the
    engine's loop, alternating, three rounds; then again with add_sub marked
    ``INLINE_BLS: "yes"``, so bls_sync's worker runs it itself (README, Inline BLS).

Prints a markdown report. Timings are wall-clock on whatever machine runs it; the
ratios are what carry over.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

import dlserve
from dlserve.engine.request import Request

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "tests" / "models"
EXAMPLES = ROOT / "examples" / "models"


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def summary_us(samples_ns: list[int]) -> tuple[float, float]:
    us = [s / 1000 for s in samples_ns]
    return pct(us, 50), pct(us, 99)


def bench_sync(model: dlserve.Model, inputs: dict[str, Any], n: int) -> list[int]:
    for _ in range(min(200, n)):
        list(model.infer(inputs=inputs))
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        for _response in model.infer(inputs=inputs):
            pass
        samples.append(time.perf_counter_ns() - t0)
    return samples


def bench_on_loop(server: dlserve.Server, name: str, inputs: dict[str, Any], n: int) -> list[int]:
    """Submit on the engine's loop, as the HTTP/gRPC frontends do: each request from the
    previous one's ``on_response``, its latency taken there (where a frontend writes its
    answer; no task wakes up for it, so the figure holds no cost of this harness's)."""
    engine = server.engine
    tensors = {k: engine.share(dlserve.Tensor.from_object(v)) for k, v in inputs.items()}
    finished: concurrent.futures.Future[list[int]] = concurrent.futures.Future()
    samples: list[int] = []
    warmup = 200
    sent = 0
    t0 = 0

    def submit() -> None:
        nonlocal sent, t0
        request = Request(model_name=name, inputs=dict(tensors), on_response=answered)
        sent += 1
        t0 = time.perf_counter_ns()
        engine.submit(request)

    def answered(response: Any) -> None:
        elapsed = time.perf_counter_ns() - t0
        if response.error is not None:
            finished.set_exception(response.error)
        elif sent > warmup:
            samples.append(elapsed)
        if finished.done():
            return
        if sent < warmup + n:
            submit()
        else:
            finished.set_result(samples)

    server.loop.call_soon_threadsafe(submit)
    return finished.result()


def compute_infer(stats: dict[str, Any]) -> tuple[int, int]:
    """(ns, count) of a model's compute_infer statistic, from Triton's statistics JSON."""
    entry = stats["model_stats"][0]["inference_stats"]["compute_infer"]
    return int(entry["ns"]), int(entry["count"])


def average_us(before: tuple[int, int], after: tuple[int, int]) -> float:
    """Average µs per request of a cumulative statistic between two readings."""
    return (after[0] - before[0]) / max(after[1] - before[1], 1) / 1000


def bench_execute_here(
    model_dir: Path, config: dict[str, Any], inputs: dict[str, Any], n: int
) -> list[int]:
    """The model's own ``execute()`` on one request, called directly in this process
    with no server or worker: the part of a round trip that is the model's, not ours."""
    import triton_python_backend_utils as pb_utils
    from dlserve.ipc.model_code import load_module

    model_file = str(model_dir / "1" / "model.py")
    model = load_module(model_file, model_file).TritonPythonModel()
    model.initialize({"model_config": json.dumps(config)})
    request = pb_utils.InferenceRequest(
        model_name=config["name"],
        inputs=[pb_utils.Tensor(name, value) for name, value in inputs.items()],
        requested_output_names=[],
    )
    samples = []
    for i in range(n + 200):
        t0 = time.perf_counter_ns()
        model.execute([request])
        if i >= 200:
            samples.append(time.perf_counter_ns() - t0)
    return samples


def triton_add_sub(n: int) -> dict[str, float] | None:
    """Serve add_sub from real Triton (benchmarks/peers.py) and read its per-request compute_infer."""
    if peers.missing_peers(mlserver=False):
        print(f"(Triton skipped: run {peers.REFERENCE}/setup.sh first)", file=sys.stderr)
        return None
    import tritonclient.http as http

    with peers.repository([MODELS / "add_sub"]) as repo, peers.triton(repo, ["add_sub"]) as server:
        client = http.InferenceServerClient(server.url("http"))
        a = np.arange(16, dtype=np.float32)
        inputs = []
        for name in ("INPUT0", "INPUT1"):
            tensor = http.InferInput(name, [16], "FP32")
            tensor.set_data_from_numpy(a)
            inputs.append(tensor)
        for _ in range(200):
            client.infer("add_sub", inputs)
        before = client.get_inference_statistics("add_sub")
        for _ in range(n):
            client.infer("add_sub", inputs)
        after = client.get_inference_statistics("add_sub")
        client.close()

    return {"compute_infer_us": average_us(compute_infer(before), compute_infer(after))}


def bench_identity(server: dlserve.Server, nbytes: int, n: int) -> dict[str, float]:
    count = nbytes // 4
    model = server.model("identity")
    shared = server.allocate_tensor([count], np.float32)
    np.from_dlpack(shared)[:] = np.random.default_rng(0).random(count, dtype=np.float32)
    out = list(model.infer(inputs={"INPUT0": shared}))[0].outputs["OUTPUT0"]
    assert out.data_ptr == shared.data_ptr, "shared-memory input should come back by reference"
    del out
    plain = np.random.default_rng(1).random(count, dtype=np.float32)
    src, dst = np.ones(count, np.float32), np.zeros(count, np.float32)
    memcpy = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        np.copyto(dst, src)
        memcpy.append(time.perf_counter_ns() - t0)
    return {
        "shared_p50": summary_us(bench_sync(model, {"INPUT0": shared}, n))[0],
        "numpy_p50": summary_us(bench_sync(model, {"INPUT0": plain}, n))[0],
        "memcpy_p50": summary_us(memcpy)[0],
    }


@contextlib.contextmanager
def serving(
    models: Path, names: tuple[str, ...], inline: tuple[str, ...] = (), **options: Any
) -> Iterator[dlserve.Server]:
    """A server over a temporary repository holding ``models/<name>`` for each name;
    those in ``inline`` with ``INLINE_BLS: "yes"`` (run by their BLS callers)."""
    repo = Path(tempfile.mkdtemp(prefix="dlserve-bench-"))
    try:
        for name in names:
            shutil.copytree(models / name, repo / name)
            if name in inline:
                with open(repo / name / "config.pbtxt", "a") as config:
                    config.write('\nparameters { key: "INLINE_BLS" value: { string_value: "yes" } }\n')
        server = dlserve.Server(dlserve.Options(model_repository=str(repo), **options))
        server.start(wait_until_ready=True)
        try:
            yield server
        finally:
            server.stop()
    finally:
        shutil.rmtree(repo, ignore_errors=True)


def bls_overhead(n: int, busy_poll_us: int, rounds: int = 3, inline: bool = False) -> dict[str, float]:
    """Median over ``rounds`` of p50/p99 µs for add_sub and bls_sync, and of their
    difference; with ``inline``, add_sub runs in bls_sync's worker (INLINE_BLS)."""
    a = np.arange(4, dtype=np.float32)
    inputs = {"INPUT0": a, "INPUT1": a}
    runs: list[tuple[float, float, float, float]] = []
    marked = ("add_sub",) if inline else ()
    with serving(EXAMPLES, ("add_sub", "bls_sync"), marked, busy_poll_us=busy_poll_us) as server:
        for _ in range(rounds):
            direct = summary_us(bench_on_loop(server, "add_sub", inputs, n))
            bls = summary_us(bench_on_loop(server, "bls_sync", inputs, n))
            runs.append((*direct, *bls))

    def median(column: int) -> float:
        return sorted(run[column] for run in runs)[len(runs) // 2]

    overheads = sorted(run[2] - run[0] for run in runs)
    return {
        "add_sub_p50": median(0),
        "add_sub_p99": median(1),
        "bls_p50": median(2),
        "bls_p99": median(3),
        "overhead_p50": overheads[len(overheads) // 2],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--triton", action="store_true", help="measure real Triton in the same run")
    parser.add_argument(
        "--busy-poll-us", type=int, default=dlserve.Options.busy_poll_us,
        help="the server's busy_poll_us (0: processes sleep at once; see dlserve/ipc/polling.py)",
    )
    args = parser.parse_args()

    with serving(
        MODELS, ("add_sub", "identity"), shm_arena_size=160 << 20, busy_poll_us=args.busy_poll_us
    ) as server:
        a = np.arange(16, dtype=np.float32)
        add_sub = {"INPUT0": a, "INPUT1": a}
        model = server.model("add_sub")
        sync = summary_us(bench_sync(model, add_sub, args.requests))
        before = compute_infer(model.statistics())
        on_loop = summary_us(bench_on_loop(server, "add_sub", add_sub, args.requests))
        infer_avg = average_us(before, compute_infer(model.statistics()))
        execute = summary_us(
            bench_execute_here(MODELS / "add_sub", model.config(), add_sub, args.requests)
        )
        identity = {
            size: bench_identity(server, size, n) for size, n in ((1 << 20, 500), (64 << 20, 30))
        }
    bls = bls_overhead(args.requests // 2, args.busy_poll_us)
    bls_inline = bls_overhead(args.requests // 2, args.busy_poll_us, inline=True)
    triton = triton_add_sub(args.requests) if args.triton else None

    print("### (a) add_sub through a worker process\n")
    print("| path | p50 µs | p99 µs |")
    print("|---|---:|---:|")
    print(
        f"| in-process sync API (caller thread → engine loop → worker → back) | {sync[0]:.0f} | {sync[1]:.0f} |"
    )
    print(
        f"| submitted on the engine loop (what a frontend pays) | {on_loop[0]:.0f} | {on_loop[1]:.0f} |"
    )
    print(f"| the model's execute() alone, called in this process | {execute[0]:.0f} | {execute[1]:.0f} |")
    print(
        f"| **server↔worker overhead: p50(on the loop) − p50(execute alone)** | {on_loop[0] - execute[0]:.0f} | |"
    )
    print()
    print("| server statistic | dlserve | Triton | dlserve / Triton |")
    print("|---|---:|---:|---:|")
    t = triton["compute_infer_us"] if triton else None
    ratio = f"{infer_avg / t:.2f}" if t else "—"
    print(
        f"| compute_infer, avg µs/request | {infer_avg:.0f} | {t:.0f} | {ratio} |"
        if t
        else f"| compute_infer, avg µs/request | {infer_avg:.0f} | — | — |"
    )
    print("\n### (b) identity, FP32\n")
    print("| size | in shared memory p50 ms | numpy input (1 copy) p50 ms | memcpy p50 ms |")
    print("|---|---:|---:|---:|")
    for size, r in identity.items():
        print(
            f"| {size >> 20} MiB | {r['shared_p50'] / 1000:.3f} | {r['numpy_p50'] / 1000:.3f} | {r['memcpy_p50'] / 1000:.3f} |"
        )
    print("\n### (c) BLS overhead, submitted on the engine loop\n")
    print("| model | p50 µs | p99 µs |")
    print("|---|---:|---:|")
    print(f"| add_sub | {bls['add_sub_p50']:.0f} | {bls['add_sub_p99']:.0f} |")
    print(f"| bls_sync (one BLS call to add_sub) | {bls['bls_p50']:.0f} | {bls['bls_p99']:.0f} |")
    print(f"| **BLS overhead: p50(bls_sync) − p50(add_sub)** | {bls['overhead_p50']:.0f} | |")
    print(f"| bls_sync, add_sub with INLINE_BLS (run in bls_sync's worker) | {bls_inline['bls_p50']:.0f} | {bls_inline['bls_p99']:.0f} |")
    print(f"| **inline BLS overhead: p50(bls_sync) − p50(add_sub)** | {bls_inline['overhead_p50']:.0f} | |")
    print(
        "\n"
        + json.dumps(
            {
                "add_sub": {
                    "sync": sync,
                    "on_loop": on_loop,
                    "execute_here": execute,
                    "compute_infer_avg_us": infer_avg,
                    "triton": triton,
                },
                "identity": identity,
                "bls": bls,
                "bls_inline": bls_inline,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
