"""``dlserve perf`` side by side with NVIDIA's perf_analyzer, on the same server.

Serves add_sub (tests/models) from a ``dlserve serve`` process on free ports, then runs
perf_analyzer and ``dlserve perf`` with the same settings at concurrency 1 and 16 over
HTTP and gRPC -- alternating the two tools, ``--repeat`` times each -- and prints a
markdown table: throughput of both, their p50/p99, and the throughput ratio (medians
over the repeats). It also shows how much CPU each client burned (cores busy on
average over its run): on a small machine client and server share the cores, so a
hungrier client leaves less for the server.

    .venv/bin/python benchmarks/perf_vs_perf_analyzer.py [--repeat 3] [--interval 3000]

perf_analyzer: ``--perf-analyzer PATH``, else ../shared/tools/reference-servers/pa.sh,
else .venv/perf_analyzer/perf_analyzer (scripts/setup_perf_analyzer.sh installs it).
"""

from __future__ import annotations

import argparse
import csv
import http.client
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DLSERVE = str(Path(sys.executable).parent / "dlserve")
CANDIDATES = [
    ROOT.parent / "shared" / "tools" / "reference-servers" / "pa.sh",
    ROOT / ".venv" / "perf_analyzer" / "perf_analyzer",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ready(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/v2/health/ready")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def run_client(command: list[str], csv_path: Path, timeout: float) -> dict[str, float]:
    """Run one client; its CSV row plus the CPU it used (cores busy over its run)."""
    start = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
    wall = time.monotonic() - start
    if proc.returncode != 0 or not csv_path.exists():
        raise RuntimeError(f"{command[0]} exited {proc.returncode}:\n{output[-3000:]}")
    with csv_path.open() as f:
        row = next(csv.DictReader(f))
    csv_path.unlink()
    return {
        "throughput": float(row["Inferences/Second"]),
        "p50": float(row["p50 latency"]),
        "p99": float(row["p99 latency"]),
        "wall": wall,
    }


def cpu_of(command: list[str], csv_path: Path, timeout: float) -> dict[str, float]:
    """``run_client`` with the children's CPU time measured around it."""
    before = os.times()
    result = run_client(command, csv_path, timeout)
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    result["cores"] = cpu / result["wall"] if result["wall"] > 0 else 0.0
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--perf-analyzer", default=None, help="perf_analyzer binary or wrapper")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each tool per cell (default: 3)")
    parser.add_argument("--interval", type=int, default=3000, help="measurement window, ms (default: 3000)")
    parser.add_argument("--stability", type=float, default=20.0,
                        help="-s for both tools (default: 20; on a busy 2-core machine 10 often never settles)")
    parser.add_argument("--concurrency", default="1,16", help="comma-separated (default: 1,16)")
    parser.add_argument("--protocols", default="http,grpc", help="comma-separated (default: http,grpc)")
    args = parser.parse_args()

    pa = Path(args.perf_analyzer) if args.perf_analyzer else next((c for c in CANDIDATES if c.exists()), None)
    if pa is None or not pa.exists():
        print("perf_analyzer not found: give --perf-analyzer or run scripts/setup_perf_analyzer.sh", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="perf_vs_pa_"))
    repo = work / "repo"
    shutil.copytree(ROOT / "tests" / "models" / "add_sub", repo / "add_sub")
    ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
    log = (work / "serve.log").open("w")
    server = subprocess.Popen(
        [DLSERVE, "serve", "--model-repository", str(repo),
         "--http-address", "127.0.0.1", "--http-port", str(ports["http"]),
         "--grpc-address", "127.0.0.1", "--grpc-port", str(ports["grpc"]),
         "--metrics-address", "127.0.0.1", "--metrics-port", str(ports["metrics"])],
        stdout=log, stderr=subprocess.STDOUT, cwd=work,
    )
    rows = []
    try:
        deadline = time.monotonic() + 60
        while not ready(ports["http"]):
            if server.poll() is not None or time.monotonic() > deadline:
                print((work / "serve.log").read_text(), file=sys.stderr)
                return 1
            time.sleep(0.1)
        common = ["-m", "add_sub", "-p", str(args.interval), "-s", f"{args.stability:g}", "-r", "10"]
        timeout = 30 + 12 * args.interval / 1000
        for protocol in args.protocols.split(","):
            for concurrency in [int(c) for c in args.concurrency.split(",")]:
                flags = [*common, "-i", protocol, "-u", f"127.0.0.1:{ports[protocol]}",
                         "--concurrency-range", str(concurrency)]
                runs: dict[str, list[dict[str, float]]] = {"pa": [], "dl": []}
                for _ in range(args.repeat):
                    out = work / "out.csv"
                    env_pa = [str(pa), *flags, "-f", str(out)]
                    env_dl = [DLSERVE, "perf", *flags, "-f", str(out), "--no-progress"]
                    for key, command in (("pa", env_pa), ("dl", env_dl)):
                        try:
                            runs[key].append(cpu_of(command, out, timeout))
                        except RuntimeError as exc:  # e.g. never stable: that run does not count
                            last = str(exc).strip().splitlines()
                            print(f"  {protocol} c={concurrency} {key}: {last[0]} ... {last[-1]}", file=sys.stderr)
                    print(f"  {protocol} c={concurrency}: "
                          f"pa {[round(r['throughput']) for r in runs['pa']]} "
                          f"dl {[round(r['throughput']) for r in runs['dl']]}", file=sys.stderr, flush=True)
                if runs["pa"] and runs["dl"]:
                    rows.append((protocol, concurrency, runs))
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()

    def med(runs: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    def listed(runs: list[dict[str, float]]) -> str:
        return ", ".join(f"{r['throughput']:.0f}" for r in runs)

    print(f"add_sub on `dlserve serve`, {os.cpu_count()} CPU cores shared by client and server; "
          f"-p {args.interval} ms, -s {args.stability:g}, -r 10; medians of up to {args.repeat} alternating "
          "runs per tool (runs that never became stable left out)\n")
    print("| protocol | concurrency | perf_analyzer infer/s | dlserve perf infer/s | ratio | "
          "PA p50 / p99 (µs) | dlserve perf p50 / p99 (µs) | client CPU, cores (PA / dlserve perf) | "
          "runs, infer/s (PA; dlserve perf) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for protocol, concurrency, runs in rows:
        pa_t, dl_t = med(runs["pa"], "throughput"), med(runs["dl"], "throughput")
        print(
            f"| {protocol} | {concurrency} | {pa_t:.0f} | {dl_t:.0f} | {dl_t / pa_t:.2f} | "
            f"{med(runs['pa'], 'p50'):.0f} / {med(runs['pa'], 'p99'):.0f} | "
            f"{med(runs['dl'], 'p50'):.0f} / {med(runs['dl'], 'p99'):.0f} | "
            f"{med(runs['pa'], 'cores'):.2f} / {med(runs['dl'], 'cores'):.2f} | "
            f"{listed(runs['pa'])}; {listed(runs['dl'])} |"
        )
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
