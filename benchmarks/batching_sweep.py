"""How dynamic batching's gain over Triton depends on what one execute() costs.

    python benchmarks/batching_sweep.py [--delays-ms 0.25,0.5,1,2] [--protocols grpc,http]

benchmarks/models/add_sub_batched waits a fixed EXECUTE_DELAY_MS in every execute(),
whatever the batch: what a framework call or a kernel launch costs, and what batching
saves. Section 6 of RESULTS.md measures it at 2 ms. This serves one copy of it per delay
from dlserve and from real Triton (one server at a time, same repository, same client:
perf_analyzer at concurrency 16, batch size 1 per request) and reports throughput, the
server-side average batch (statistics extension) and dlserve/Triton per delay, so the
ratio can be read across cheap and dear models rather than at one point.

Prints a markdown table; timings are wall-clock on this machine, the ratios are what
carry over.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure
import peers

MODEL = Path(__file__).resolve().parent / "models" / "add_sub_batched"


def variant_name(delay_ms: float) -> str:
    return f"add_sub_batched_{delay_ms:g}ms".replace(".", "_")


@contextmanager
def sweep_repository(delays_ms: list[float]) -> Iterator[Path]:
    """A repository with one add_sub_batched per delay (its name and parameter changed)."""
    work = Path(tempfile.mkdtemp(prefix="dlserve-sweep-"))
    repo = work / "models"
    try:
        for delay in delays_ms:
            target = repo / variant_name(delay)
            shutil.copytree(MODEL, target)
            config = (target / "config.pbtxt").read_text()
            config = config.replace('name: "add_sub_batched"', f'name: "{target.name}"')
            config = config.replace('string_value: "2"', f'string_value: "{delay:g}"')
            (target / "config.pbtxt").write_text(config)
        yield repo
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure_server(
    server: peers.Server, names: list[str], protocols: list[str], window: measure.Window
) -> dict[tuple[str, str], tuple[float, float]]:
    """(model, protocol) -> (infer/s, average batch) at concurrency 16."""
    out = {}
    for name in names:
        for protocol in protocols:
            before = server.stats(name)
            args = ["-m", name, "-i", protocol, "--concurrency-range", "16"]
            result = measure.perf_analyzer(args, server.url(protocol), window)
            after = server.stats(name)
            level = result.at(16)
            executions = after["execution_count"] - before["execution_count"]
            batch = (after["inference_count"] - before["inference_count"]) / max(executions, 1)
            out[(name, protocol)] = (level.throughput if level else float("nan"), batch)
            peers.log(f"    {server.name:8s} {name} {protocol}: {out[(name, protocol)]}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delays-ms", default="0.25,0.5,1,2")
    parser.add_argument("--protocols", default="grpc,http")
    parser.add_argument("--interval-ms", type=int, default=3000)
    args = parser.parse_args()
    delays = [float(d) for d in args.delays_ms.split(",")]
    protocols = args.protocols.split(",")
    peers.ensure_peers(mlserver=False)
    window = measure.Window(interval_ms=args.interval_ms)
    names = [variant_name(d) for d in delays]
    results = {}
    with sweep_repository(delays) as repo, peers.stop_on_sigterm():
        for make in (peers.dlserve, peers.triton):
            with make(repo, names) as server:
                results[server.name] = measure_server(server, names, protocols, window)
    print("| EXECUTE_DELAY_MS | protocol | dlserve infer/s | Triton infer/s | dlserve/Triton "
          "| average batch dlserve / Triton |")
    print("|---:|---|---:|---:|---:|---|")
    for delay, name in zip(delays, names):
        for protocol in protocols:
            ours, our_batch = results["dlserve"][(name, protocol)]
            theirs, their_batch = results["Triton"][(name, protocol)]
            print(
                f"| {delay:g} | {protocol} | {ours:,.1f} | {theirs:,.1f} "
                f"| **{ours / theirs:.2f}×** | {our_batch:.2f} / {their_batch:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
