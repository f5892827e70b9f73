"""dlserve vs real Triton over the network, measured by perf_analyzer, in one run.

    python benchmarks/frontends.py [--matrix quick|full] [--out FILE.md]

Both servers serve the SAME model repository (tools/reference-servers/models:
add_sub and identity_fp32, one CPU instance each, Triton's own model code), one
after the other on the same machine, and the same perf_analyzer binary measures
both with the same flags. The report gives each cell and the ratio dlserve/Triton
(throughput: higher is better; latency: lower is better).

Needs the reference tools set up once: ``bash ../shared/tools/reference-servers/setup.sh``
(Triton 2.51 from the nvidia-pytriton wheel, perf_analyzer from tritonclient 2.50).
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = Path(os.environ.get("REFERENCE_SERVERS", ROOT.parent / "shared" / "tools" / "reference-servers"))
ANCHORS = Path(os.environ.get("ANCHORS", "/tmp/anchors"))
DLSERVE_PORTS = (18100, 18101, 18102)
TRITON_PORTS = (18000, 18001, 18002)  # fixed by start_triton.sh


def cases(matrix: str) -> list[tuple[str, list[str]]]:
    """(label, perf_analyzer arguments without the URL)."""
    out: list[tuple[str, list[str]]] = []
    for c in (1, 4) if matrix == "quick" else (1, 4, 16):
        out.append((f"add_sub http c{c}", ["-m", "add_sub", "-i", "http", "--concurrency-range", str(c)]))
        out.append((f"add_sub grpc c{c}", ["-m", "add_sub", "-i", "grpc", "--concurrency-range", str(c)]))
    sizes = (1 << 24,) if matrix == "quick" else (1 << 12, 1 << 20, 1 << 24, 1 << 26)
    for nbytes in sizes:
        n = nbytes // 4
        label = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
        base = ["-m", "identity_fp32", "--shape", f"INPUT0:{n}", "--concurrency-range", "1"]
        out.append((f"identity {label} http", [*base, "-i", "http"]))
        out.append((f"identity {label} grpc", [*base, "-i", "grpc"]))
        out.append((f"identity {label} grpc+sysshm", [*base, "-i", "grpc", "--shared-memory", "system",
                                                       "--output-shared-memory-size", str(nbytes)]))
    if matrix == "quick":
        n = (1 << 26) // 4
        base = ["-m", "identity_fp32", "--shape", f"INPUT0:{n}", "--concurrency-range", "1"]
        out.append(("identity 64 MiB http", [*base, "-i", "http"]))
        out.append(("identity 64 MiB grpc+sysshm", [*base, "-i", "grpc", "--shared-memory", "system",
                                                      "--output-shared-memory-size", str(1 << 26)]))
    return out


def wait_ready(port: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"server on port {port} not ready after {timeout:.0f}s")


def perf_analyzer(args: list[str], url: str, big: bool) -> dict[str, float] | None:
    with tempfile.NamedTemporaryFile(suffix=".csv") as out:
        stability = "1000" if big else "30"
        command = [
            "bash", str(REFERENCE / "pa.sh"), *args, "-u", url,
            "--measurement-interval", "3000", "--stability-percentage", stability,
            "--max-trials", "4", "-f", out.name,
        ]
        run = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, PA_TIMEOUT="200"))
        rows = list(csv.DictReader(open(out.name))) if os.path.getsize(out.name) else []
    if not rows:
        tail = (run.stdout + run.stderr).strip().splitlines()[-3:]
        print(f"    perf_analyzer failed: {' | '.join(tail)}", file=sys.stderr)
        return None
    row = rows[0]
    return {
        "throughput": float(row["Inferences/Second"]),
        "p50_us": float(row["p50 latency"]),
        "p99_us": float(row["p99 latency"]),
        "compute_infer_us": float(row["Server Compute Infer"]),
    }


def measure(name: str, ports: tuple[int, int, int], matrix: list[tuple[str, list[str]]]) -> dict[str, dict[str, float] | None]:
    results = {}
    for label, args in matrix:
        port = ports[1] if "grpc" in label else ports[0]
        big = "MiB" in label
        results[label] = perf_analyzer(args, f"127.0.0.1:{port}", big)
        cell = results[label]
        shown = f"{cell['throughput']:.1f}/s p50 {cell['p50_us']:.0f}µs" if cell else "failed"
        print(f"  {name:7s} {label:28s} {shown}", file=sys.stderr)
    return results


def run_dlserve(models: Path, matrix: list[tuple[str, list[str]]]) -> dict[str, dict[str, float] | None]:
    http, grpc, metrics = DLSERVE_PORTS
    command = [
        str(Path(sys.executable).parent / "dlserve"), "serve", "--model-repository", str(models),
        "--http-address", "127.0.0.1", "--http-port", str(http),
        "--grpc-address", "127.0.0.1", "--grpc-port", str(grpc),
        "--metrics-address", "127.0.0.1", "--metrics-port", str(metrics),
        "--allow-client-shm", "true", "--http-max-input-size", str(1 << 28),
        "--grpc-max-message-size", str(1 << 28),
    ]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(http)
        return measure("dlserve", DLSERVE_PORTS, matrix)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)


def run_triton(models: Path, matrix: list[tuple[str, list[str]]]) -> dict[str, dict[str, float] | None]:
    # cwd outside the checkout: its triton_python_backend_utils.py shim must not shadow Triton's.
    subprocess.run(
        ["bash", str(REFERENCE / "start_triton.sh"), str(ANCHORS)],
        check=True, capture_output=True, env=dict(os.environ, MODELS=str(models)), cwd=models,
    )
    pid = int((ANCHORS / "triton.pid").read_text())
    try:
        return measure("triton", TRITON_PORTS, matrix)
    finally:
        os.kill(pid, signal.SIGTERM)
        for _ in range(300):
            if not Path(f"/proc/{pid}").exists():
                break
            time.sleep(0.1)


def report(matrix, mine, theirs, command: str) -> str:
    lines = [
        f"Command: `{command}`",
        "",
        "| case | dlserve infer/s | Triton infer/s | throughput ratio | dlserve p50 µs | Triton p50 µs | p50 ratio (lower is better) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, _ in matrix:
        a, b = mine.get(label), theirs.get(label)
        if a is None or b is None:
            lines.append(f"| {label} | {a['throughput'] if a else 'failed'} | {b['throughput'] if b else 'failed'} | — | — | — | — |")
            continue
        lines.append(
            f"| {label} | {a['throughput']:.1f} | {b['throughput']:.1f} | **{a['throughput'] / b['throughput']:.2f}×** "
            f"| {a['p50_us']:.0f} | {b['p50_us']:.0f} | {a['p50_us'] / b['p50_us']:.2f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--matrix", choices=["quick", "full"], default="quick")
    parser.add_argument("--out", type=Path, help="also write the markdown report here")
    args = parser.parse_args()
    if not (ANCHORS / "pa" / "perf_analyzer").exists():
        print(f"perf_analyzer missing: run bash {REFERENCE}/setup.sh first", file=sys.stderr)
        return 2
    models = Path(tempfile.mkdtemp(prefix="bench-models-"))
    shutil.copytree(REFERENCE / "models", models, dirs_exist_ok=True)
    matrix = cases(args.matrix)
    try:
        mine = run_dlserve(models, matrix)
        theirs = run_triton(models, matrix)
    finally:
        shutil.rmtree(models, ignore_errors=True)
    text = report(matrix, mine, theirs, "python benchmarks/frontends.py " + " ".join(sys.argv[1:]))
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
