"""dlserve side by side with real Triton and MLServer: one entry point, one run, one report.

    .venv/bin/python benchmarks/run.py [--quick] [--only SECTION ...] [--out benchmarks/RESULTS.md]

Sets up the peers when they are missing (../shared/tools/reference-servers/setup.sh into
$ANCHORS: Triton 2.51 from the nvidia-pytriton wheel, perf_analyzer from the tritonclient 2.50
wheel, MLServer 1.7.1), then, section by section, serves the same models from dlserve and from
each peer one after the other (each on free loopback ports, started fresh for the section and
stopped after it) and measures them with the same client and the same flags. Writes the
report (machine, versions, tables with dlserve/peer ratios, the exact commands) to --out and
its plots to plots/ next to it.

The pieces: sections.py (what each section measures), peers.py (the servers), measure.py (the
clients), clients.py (answer checks and the streaming client), report.py, tables.py and plots.py
(RESULTS.md).

Sections (--only takes any of them; default all):

  add_sub    add_sub over HTTP and gRPC, concurrency sweep 1..16: perf_analyzer (dlserve,
             Triton), dlserve perf (dlserve, Triton, MLServer), tritonclient loadgen at 1 and 16
             (dlserve, Triton, MLServer, HTTP with JSON tensors); latency/throughput plots; and
             the load-generator check (dlserve perf vs perf_analyzer on the same server)
  identity   identity FP32 at 4 KiB, 1 MiB, 16 MiB, 64 MiB over HTTP, gRPC and gRPC + system
             shared memory (perf_analyzer; dlserve vs Triton)
  bytes      string_upper (BYTES) over HTTP and gRPC (perf_analyzer; dlserve vs Triton)
  bls        BLS overhead per call, BLS with a 4 MiB tensor, decoupled streaming responses/s
             (perf_analyzer and a tritonclient stream; dlserve vs Triton)
  batching   a dynamically batched model at concurrency 16: throughput and the server-side
             average batch size (perf_analyzer and the statistics extension; dlserve vs Triton)
  cache      add_sub with and without the response cache, all hits but the first
             (perf_analyzer and the statistics extension; dlserve vs Triton)

A full run takes about 20 minutes on 2 cores, --quick about 6 (fewer levels, sizes and cases,
shorter windows). Every server it starts is stopped when it ends, also on Ctrl-C or SIGTERM,
and no /dev/shm segment of its servers or clients is left behind.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure
import peers
from peers import ROOT, log
from report import render
from sections import SECTIONS, Plan, Served, run_section, sections


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smaller run (about 6 minutes on 2 cores)"
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=SECTIONS,
        metavar="SECTION",
        help=f"run only these sections ({', '.join(SECTIONS)})",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "benchmarks" / "RESULTS.md",
        help="the report (default: benchmarks/RESULTS.md); plots go to plots/ next to it",
    )
    args = parser.parse_args()
    plan = Plan.make(args.quick)
    chosen = [s for s in SECTIONS if not args.only or s in args.only]
    started = datetime.datetime.now(datetime.timezone.utc)
    command = " ".join([".venv/bin/python benchmarks/run.py", *sys.argv[1:]])
    peers.ensure_peers(mlserver="add_sub" in chosen)
    info = measure.machine()
    served_all: dict[str, dict[str, Served]] = {}
    took: dict[str, float] = {}
    interrupted = False
    with peers.stop_on_sigterm():
        for key in chosen:
            log(f"== {key}")
            begin = time.monotonic()
            served_all[key] = {}
            try:
                run_section(sections()[key], plan, served_all[key])
            except KeyboardInterrupt:
                interrupted = True
                log("interrupted: every server started is stopped; writing what was measured")
            took[key] = time.monotonic() - begin
            log(f"== {key}: {took[key] / 60:.1f} min")
            if interrupted:
                break
    log(peers.SHM_LEDGER.summary())
    if interrupted:
        command += "  (interrupted: incomplete)"
    text = render(plan, chosen, served_all, info, args.out, took, command, started)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    log(f"wrote {args.out} (plots in {args.out.parent / 'plots'})")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
