"""Two dlserve code trees side by side: the in-process add_sub round trip, alternated.

    git worktree add /tmp/old_tree <rev>
    python benchmarks/ab_inprocess.py /tmp/old_tree [--rounds 24] [--requests 1500]

On this shared 2-vCPU machine the round trip of the same code moves by 30% and more from
one minute to the next, far more than a change to the request path moves it. So both
trees serve add_sub (tests/models) at once, each in a process of its own (the old one with
PYTHONPATH=OLD_TREE, the new one this checkout; the harness is this checkout's for both),
and they take turns: a burst of requests submitted on the engine's loop (inprocess.py's
``bench_on_loop``) from one, then the other, in alternating order. Whatever the machine
does meanwhile, each pair of bursts is timed seconds apart; the paired differences of
their p50s say what the change did.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(requests: int) -> None:
    """Serve add_sub and time a burst for every ``go`` line on stdin (its p50 in µs)."""
    import inprocess
    import numpy as np

    import dlserve

    with inprocess.serving(inprocess.MODELS, ("add_sub",)) as server:
        a = np.arange(16, dtype=np.float32)
        inputs = {"INPUT0": a, "INPUT1": a}
        inprocess.bench_on_loop(server, "add_sub", inputs, 2000)  # (warm: polling windows learnt)
        print("ready", Path(dlserve.__file__).resolve().parent.parent, flush=True)
        for line in sys.stdin:
            if line.strip() != "go":
                break
            latencies = inprocess.bench_on_loop(server, "add_sub", inputs, requests)
            print(f"{inprocess.summary_us(latencies)[0]:.3f}", flush=True)


def start(tree: Path, requests: int) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    process = subprocess.Popen(
        [sys.executable, __file__, "--child", "--requests", str(requests)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd="/tmp",
    )
    assert process.stdin is not None and process.stdout is not None
    ready, _, serving = process.stdout.readline().strip().partition(" ")
    if ready != "ready" or Path(serving) != tree:
        process.communicate("stop\n")  # (a server that started stops as it should)
        raise RuntimeError(
            f"{tree}: the server did not start" if ready != "ready"
            else f"{tree} has no dlserve of its own: the one imported is {serving}'s"
        )
    return process


def burst(process: subprocess.Popen[str]) -> float:
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write("go\n")
    process.stdin.flush()
    return float(process.stdout.readline())


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("old_tree", nargs="?", type=Path, help="a checkout to compare with")
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--requests", type=int, default=1500, help="requests per burst")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.requests)
        return 0
    if args.old_tree is None:
        parser.error("the old tree is required")
    trees = {"old": args.old_tree.resolve(), "new": ROOT}
    processes: dict[str, subprocess.Popen[str]] = {}
    try:
        for name, tree in trees.items():
            processes[name] = start(tree, args.requests)
    except RuntimeError as exc:
        for process in processes.values():
            process.communicate("stop\n")
        print(f"ab_inprocess: {exc}", file=sys.stderr)
        return 2
    p50s: dict[str, list[float]] = {"old": [], "new": []}
    try:
        for round_ in range(args.rounds):
            for name in ("old", "new") if round_ % 2 == 0 else ("new", "old"):
                p50s[name].append(burst(processes[name]))
    finally:
        for process in processes.values():
            process.communicate("stop\n")
    differences = [new - old for old, new in zip(p50s["old"], p50s["new"])]
    print(
        f"add_sub on the engine loop, p50 µs, {args.rounds} rounds of {args.requests} requests: "
        f"old {statistics.median(p50s['old']):.1f}, new {statistics.median(p50s['new']):.1f}; "
        f"paired difference new - old: median {statistics.median(differences):+.1f}, "
        f"new faster in {sum(d < 0 for d in differences)} of {len(differences)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
