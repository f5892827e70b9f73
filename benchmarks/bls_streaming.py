"""BLS call overhead, BLS with a 4 MiB tensor, and decoupled streaming: dlserve vs real Triton.

    .venv/bin/python benchmarks/bls_streaming.py [--quick] [--out FILE.md]

Both servers serve the SAME model repository, built at run time in a temporary folder from
unmodified Triton Python models: add_sub, bls_sync and repeat (examples/models),
identity_fp32 (tools/reference-servers/models) and bls_identity (benchmarks/models: hands its
FP32[-1] INPUT0 to identity_fp32 with a blocking BLS ``exec()`` and returns the answer). The
servers run one after the other on the same machine, started exactly as benchmarks/frontends.py
starts them (dlserve on ports 18100-18102, Triton 2.51 via start_triton.sh on 18000-18002), and
the same clients measure both:

1. BLS overhead per call: perf_analyzer, gRPC, concurrency 1, on add_sub and on bls_sync (one
   BLS call to add_sub per request). Overhead = p50(bls_sync) - p50(add_sub); the same
   difference of perf_analyzer's "Server Compute Infer" (server-side time, no transport) too.
2. BLS with a 4 MiB payload: perf_analyzer, gRPC with system shared memory for the client's
   tensors (so the client transfer costs little), concurrency 1, on identity_fp32 and
   bls_identity with a 4 B and a 4 MiB FP32 tensor. Passing references instead of copies, the
   4 MiB BLS call should cost about what the 4 B one does.
3. Decoupled streaming: the tritonclient gRPC streaming client sends requests to ``repeat``
   with IN = 1000 INT32 values, one at a time on one stream, each answered by 1000 responses
   and a flag-only final (``enable_empty_final_response``); responses/s = responses received /
   wall time from the first send to the last final.

Before measuring, every model's answers are checked (bls_sync == add_sub; bls_identity returns
its 4 MiB input; repeat returns IN in order) and a wrong answer is reported in the table.

``--quick`` (a few minutes): gRPC only, 3 s of streaming. Without it: HTTP as well, plain gRPC
for the 4 MiB case as well, 10 s of streaming.

Needs the reference tools set up once: ``bash ../shared/tools/reference-servers/setup.sh``.
Exits 2 when they are missing.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import frontends  # noqa: E402  (benchmarks/frontends.py: servers, perf_analyzer, ports)
from frontends import ANCHORS, REFERENCE, ROOT, perf_analyzer  # noqa: E402

BENCH_MODELS = Path(__file__).resolve().parent / "models"
SITE = ANCHORS / "venv-triton/lib/python3.11/site-packages"
TRITON_BIN = SITE / "pytriton/tritonserver/bin/tritonserver"
TINY, BIG = 1, (4 << 20) // 4  # FP32 elements: 4 B and 4 MiB
STREAM_LEN = 1000


def build_repository() -> Path:
    """The benchmark's model repository, in a fresh temporary folder (removed by the caller)."""
    repo = Path(tempfile.mkdtemp(prefix="bench-bls-"))
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for source in (ROOT / "examples/models" / m for m in ("add_sub", "bls_sync", "repeat")):
        shutil.copytree(source, repo / source.name, ignore=skip)
    shutil.copytree(REFERENCE / "models/identity_fp32", repo / "identity_fp32", ignore=skip)
    shutil.copytree(BENCH_MODELS / "bls_identity", repo / "bls_identity", ignore=skip)
    return repo


def perf_cases(quick: bool) -> list[tuple[str, list[str]]]:
    """(label, perf_analyzer arguments without the URL); the label names the protocol."""
    out = []
    for protocol in ("grpc",) if quick else ("grpc", "http"):
        for model in ("add_sub", "bls_sync"):
            args = ["-m", model, "-i", protocol, "--concurrency-range", "1"]
            out.append((f"{model} {protocol}", args))
    for n in (TINY, BIG):
        for model in ("identity_fp32", "bls_identity"):
            base = ["-m", model, "--shape", f"INPUT0:{n}", "--concurrency-range", "1", "-i", "grpc"]
            out.append((f"{model} {size(n)} grpc+sysshm",
                        [*base, "--shared-memory", "system", "--output-shared-memory-size", str(4 * n)]))
            if not quick and n == BIG:
                out.append((f"{model} {size(n)} grpc", base))
    return out


def size(elements: int) -> str:
    nbytes = 4 * elements
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes} B"


# ---------------------------------------------------------------- correctness


def check_answers(grpc_port: int) -> list[str]:
    """Problems found in the models' answers (empty when all is right)."""
    import tritonclient.grpc as grpcclient

    problems = []
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        a, b = np.arange(4, dtype=np.float32), np.full(4, 0.5, np.float32)
        for model in ("add_sub", "bls_sync"):
            inputs = [grpcclient.InferInput(name, [4], "FP32") for name in ("INPUT0", "INPUT1")]
            inputs[0].set_data_from_numpy(a)
            inputs[1].set_data_from_numpy(b)
            result = client.infer(model, inputs)
            added, subtracted = result.as_numpy("OUTPUT0"), result.as_numpy("OUTPUT1")
            if not (np.array_equal(added, a + b) and np.array_equal(subtracted, a - b)):
                problems.append(f"{model}: wrong answer {added}, {subtracted}")
        for n in (TINY, BIG):
            x = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
            tensor = grpcclient.InferInput("INPUT0", [n], "FP32")
            tensor.set_data_from_numpy(x)
            got = client.infer("bls_identity", [tensor]).as_numpy("OUTPUT0")
            if got is None or not np.array_equal(got, x):
                problems.append(f"bls_identity {size(n)}: output differs from input")
    except Exception as error:  # noqa: BLE001 -- reported in the table
        problems.append(f"{type(error).__name__}: {error}")
    finally:
        client.close()
    return problems


# ---------------------------------------------------------------- streaming


class Stream:
    """One gRPC stream to ``repeat``; ``request()`` sends IN and waits for the flag-only final."""

    def __init__(self, grpc_port: int, length: int) -> None:
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        self.values = np.arange(length, dtype=np.int32) * 3 + 1
        self.inputs = [grpcclient.InferInput("IN", [length], "INT32")]
        self.inputs[0].set_data_from_numpy(self.values)
        self.done = threading.Event()
        self.keep: list | None = None  # responses kept for checking (only when asked)
        self.count = 0
        self.first = 0.0
        self.error: str | None = None
        self.client.start_stream(self._on_response)

    def _on_response(self, result, error) -> None:
        if error is not None:
            self.error = str(error)
            self.done.set()
            return
        response = result.get_response()
        if response.parameters["triton_final_response"].bool_param and not response.outputs:
            self.done.set()
            return
        if self.count == 0:
            self.first = time.perf_counter()
        self.count += 1
        if self.keep is not None:
            self.keep.append(result)
        if response.parameters["triton_final_response"].bool_param:
            self.done.set()

    def request(self, check: bool = False) -> tuple[float, float]:
        """(seconds to the final, seconds to the first response) for one request."""
        self.done.clear()
        self.count, self.error = 0, None
        self.keep = [] if check else None
        start = time.perf_counter()
        self.client.async_stream_infer("repeat", self.inputs, enable_empty_final_response=True)
        if not self.done.wait(120):
            raise RuntimeError(f"repeat: no final response after 120 s ({self.count} responses so far)")
        elapsed = time.perf_counter() - start
        if self.error:
            raise RuntimeError(f"repeat: {self.error}")
        if self.count != len(self.values):
            raise RuntimeError(f"repeat: {self.count} responses, expected {len(self.values)}")
        if check:
            out = np.concatenate([r.as_numpy("OUT") for r in self.keep])
            idx = np.concatenate([r.as_numpy("IDX") for r in self.keep])
            in_order = np.array_equal(idx, np.arange(len(self.values)))
            if not (in_order and np.array_equal(out, self.values)):
                raise RuntimeError("repeat: responses out of order or wrong values")
        return elapsed, self.first - start

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def streaming(grpc_port: int, seconds: float) -> dict[str, float] | str:
    """Responses/s over ``seconds`` of back-to-back requests on one stream, or an error."""
    stream = Stream(grpc_port, STREAM_LEN)
    try:
        stream.request(check=True)  # warm-up and correctness
        times, firsts = [], []
        begin = time.perf_counter()
        while time.perf_counter() - begin < seconds or len(times) < 3:
            elapsed, first = stream.request()
            times.append(elapsed)
            firsts.append(first)
        wall = time.perf_counter() - begin
    except Exception as error:  # noqa: BLE001 -- reported in the table
        return f"{type(error).__name__}: {error}"
    finally:
        stream.close()
    return {
        "responses_per_s": len(times) * STREAM_LEN / wall,
        "requests": len(times),
        "request_ms": 1e3 * float(np.median(times)),
        "first_ms": 1e3 * float(np.median(firsts)),
    }


# ---------------------------------------------------------------- one server


def measure_all(name: str, ports: tuple[int, int, int], cases, seconds: float) -> dict:
    """Everything measured on one running server (called in place of frontends.measure)."""
    note_own_segments(name)
    results: dict = {"problems": check_answers(ports[1]), "relaxed": []}
    for problem in results["problems"]:
        print(f"  {name:7s} WRONG: {problem}", file=sys.stderr)
    for label, args in cases:
        port = ports[0] if " http" in label else ports[1]
        cell = results[label] = perf_analyzer(args, f"127.0.0.1:{port}", big="MiB" in label)
        if cell is None and "MiB" not in label:  # unstable (noisy machine): measure without the check
            cell = results[label] = perf_analyzer(args, f"127.0.0.1:{port}", big=True)
            results["relaxed"].append(label)
        shown = f"{cell['throughput']:.1f}/s p50 {cell['p50_us']:.0f}µs" if cell else "failed"
        print(f"  {name:7s} {label:32s} {shown}", file=sys.stderr)
    results["stream"] = streaming(ports[1], seconds)
    stream = results["stream"]
    shown = f"{stream['responses_per_s']:.0f} responses/s" if isinstance(stream, dict) else stream
    print(f"  {name:7s} {'repeat streaming':32s} {shown}", file=sys.stderr)
    note_own_segments(name)
    return results


def on_server(run, repo: Path, cases, seconds: float) -> dict:
    """frontends.run_dlserve / run_triton start a server, call frontends.measure(name, ports,
    matrix) and stop the server whatever happens; this runs measure_all there instead."""
    def measure(name: str, ports: tuple[int, int, int], _matrix) -> dict:
        return measure_all(name, ports, cases, seconds)

    with mock.patch.object(frontends, "measure", measure):
        return run(repo, [])


def on_triton(repo: Path, cases, seconds: float) -> dict:
    started = time.time()
    try:
        return on_server(frontends.run_triton, repo, cases, seconds)
    except subprocess.CalledProcessError as error:  # start_triton.sh failed; it may leave Triton running
        pid_file = ANCHORS / "triton.pid"
        if pid_file.exists() and pid_file.stat().st_mtime >= started - 1:
            stop_if_tritonserver(int(pid_file.read_text()))
        output = (error.stdout or b"").decode(errors="replace").strip()[-2000:]
        raise RuntimeError(f"Triton did not start:\n{output}") from error


def stop_if_tritonserver(pid: int) -> None:
    try:
        if b"tritonserver" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return
        os.kill(pid, signal.SIGTERM)
    except (FileNotFoundError, ProcessLookupError):
        return
    for _ in range(300):
        if not Path(f"/proc/{pid}").exists():
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------- /dev/shm

OWN_SEGMENTS: set[str] = set()  # /dev/shm segments of the servers this script started


def note_own_segments(name: str) -> None:
    """Remember the running server's segments, to remove any it leaves behind once stopped.

    dlserve names them dlserve_<server pid>_..., and its server is our child; Triton's Python
    backend gives each stub (a child of tritonserver) its region's name on its command line.
    """
    if name == "triton":
        server = int((ANCHORS / "triton.pid").read_text())
        for proc in glob.glob("/proc/[0-9]*"):
            try:
                parent = int(Path(proc, "stat").read_text().rsplit(")", 1)[1].split()[1])
                argv = Path(proc, "cmdline").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            if parent == server and len(argv) > 2 and argv[0].endswith(b"triton_python_backend_stub"):
                OWN_SEGMENTS.add(f"/dev/shm/{argv[2].decode()}")
        return
    for path in glob.glob("/dev/shm/dlserve_*"):
        pid = os.path.basename(path).split("_")[1]
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent == os.getpid():
            OWN_SEGMENTS.add(path)


def remove_leftover_segments() -> None:
    left = [path for path in sorted(OWN_SEGMENTS) if os.path.exists(path)]
    print(f"/dev/shm: {len(OWN_SEGMENTS)} segments of our servers seen, {len(left)} left behind",
          file=sys.stderr)
    for path in left:
        print(f"  removing {path}", file=sys.stderr)
        os.unlink(path)


# ---------------------------------------------------------------- report

Metric = Callable[[dict], "float | None"]  # one server's results -> one number (None: no data)


def p50(label: str) -> Metric:
    return lambda results: (results.get(label) or {}).get("p50_us")


def rate(label: str) -> Metric:
    return lambda results: (results.get(label) or {}).get("throughput")


def minus(x: str, y: str, key: str = "p50_us") -> Metric:
    def metric(results: dict) -> float | None:
        a, b = (results.get(x) or {}).get(key), (results.get(y) or {}).get(key)
        return None if a is None or b is None else a - b
    return metric


def over(x: str, y: str) -> Metric:
    def metric(results: dict) -> float | None:
        a, b = p50(x)(results), p50(y)(results)
        return None if a is None or not b else a / b
    return metric


def streamed(key: str) -> Metric:
    return lambda results: r.get(key) if isinstance(r := results.get("stream"), dict) else None


def table(rows: list[tuple[str, Metric, int]], mine: dict, theirs: dict) -> list[str]:
    lines = ["| | dlserve | Triton | dlserve/Triton |", "|---|---:|---:|---:|"]
    for label, metric, digits in rows:
        a, b = metric(mine), metric(theirs)
        shown = ["—" if v is None else f"{v:,.{digits}f}" for v in (a, b)]
        quotient = "—" if a is None or not b else f"**{a / b:.2f}×**"
        lines.append(f"| {label} | {shown[0]} | {shown[1]} | {quotient} |")
    return lines


def report(cases, mine: dict, theirs: dict, quick: bool, command: str) -> str:
    servers = (("dlserve", mine), ("Triton", theirs))
    lines = [f"Command: `{command}`"]
    problems = [f"**{name} answered wrongly:** {problem}  "
                for name, results in servers for problem in results.get("problems", [])]
    lines += ["", *problems] if problems else []

    rows = []
    for protocol in ("grpc",) if quick else ("grpc", "http"):
        direct, bls = f"add_sub {protocol}", f"bls_sync {protocol}"
        rows += [
            (f"add_sub {protocol} p50 µs", p50(direct), 0),
            (f"bls_sync {protocol} p50 µs", p50(bls), 0),
            (f"**BLS overhead {protocol}: p50(bls_sync) − p50(add_sub) µs**", minus(bls, direct), 0),
            (f"BLS overhead {protocol}, server compute infer µs",
             minus(bls, direct, "compute_infer_us"), 0),
            (f"add_sub {protocol} infer/s", rate(direct), 1),
            (f"bls_sync {protocol} infer/s", rate(bls), 1),
        ]
    lines += ["", "### 1. BLS overhead per call (concurrency 1)", "", *table(rows, mine, theirs)]

    tiny, big = size(TINY), size(BIG)
    rows = [
        (f"identity_fp32 {tiny} grpc+sysshm p50 µs", p50(f"identity_fp32 {tiny} grpc+sysshm"), 0),
        (f"bls_identity {tiny} grpc+sysshm p50 µs", p50(f"bls_identity {tiny} grpc+sysshm"), 0),
        (f"BLS overhead {tiny} grpc+sysshm: p50(bls_identity) − p50(identity_fp32) µs",
         minus(f"bls_identity {tiny} grpc+sysshm", f"identity_fp32 {tiny} grpc+sysshm"), 0),
    ]
    for transport in ("grpc+sysshm",) if quick else ("grpc+sysshm", "grpc"):
        direct, bls = f"identity_fp32 {big} {transport}", f"bls_identity {big} {transport}"
        rows += [
            (f"identity_fp32 {big} {transport} p50 µs", p50(direct), 0),
            (f"bls_identity {big} {transport} p50 µs", p50(bls), 0),
            (f"**bls_identity p50: {big} {transport} / {tiny} grpc+sysshm**",
             over(bls, f"bls_identity {tiny} grpc+sysshm"), 2),
            (f"BLS overhead {big} {transport}: p50(bls_identity) − p50(identity_fp32) µs",
             minus(bls, direct), 0),
            (f"BLS overhead {big} {transport}, server compute infer µs",
             minus(bls, direct, "compute_infer_us"), 0),
        ]
    title = f"### 2. BLS with a {big} FP32 payload (bls_identity → identity_fp32, concurrency 1)"
    lines += ["", title, "", *table(rows, mine, theirs)]

    rows = [
        ("**responses/s**", streamed("responses_per_s"), 0),
        (f"ms per request ({STREAM_LEN} responses + final), median", streamed("request_ms"), 1),
        ("ms to the first response, median", streamed("first_ms"), 2),
    ]
    title = f"### 3. Decoupled streaming: repeat, {STREAM_LEN} responses per request, one gRPC stream"
    lines += ["", title, "", *table(rows, mine, theirs), ""]
    for name, results in servers:
        stream = results.get("stream")
        if isinstance(stream, dict):
            lines.append(f"{name}: {stream['requests']} requests timed.  ")
        else:
            lines.append(f"**{name} streaming failed:** {stream}  ")
        if results.get("relaxed"):
            lines.append(f"{name}: no perf_analyzer measurement stable within 30 % for "
                         f"{', '.join(results['relaxed'])}; measured again without the "
                         "stability check.  ")

    lines += [
        "",
        "Ratios: dlserve/Triton (latencies and overheads: lower is better; rates: higher is better).",
        "",
        "Commands (the same for both servers; dlserve on 127.0.0.1:18100/18101, Triton on 18000/18001):",
        "",
        "- servers: benchmarks/frontends.py `run_dlserve` (`dlserve serve --model-repository REPO ... "
        "--allow-client-shm true`) and `run_triton` (`start_triton.sh`, cwd REPO), REPO from "
        "`build_repository()`, one instance per model",
        "- perf_analyzer, through frontends.perf_analyzer, which adds `--measurement-interval 3000 "
        "--stability-percentage 30` (1000 for MiB tensors) `--max-trials 4 -f OUT.csv`:",
    ]
    for label, args in cases:
        port = "HTTP_PORT" if " http" in label else "GRPC_PORT"
        lines.append(f"  - `{REFERENCE / 'pa.sh'} {' '.join(args)} -u 127.0.0.1:{port}`")
    lines.append(
        f"- streaming: `tritonclient.grpc` `start_stream` + `async_stream_infer('repeat', "
        f"IN=INT32[{STREAM_LEN}], enable_empty_final_response=True)`, one request at a time, each "
        f"waited for until its flag-only final, for {3 if quick else 10} s after one checked "
        "warm-up request"
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="gRPC only, 3 s of streaming (a few minutes)")
    parser.add_argument("--out", type=Path, help="also write the markdown report here")
    args = parser.parse_args()
    needed = (ANCHORS / "pa" / "perf_analyzer", TRITON_BIN, REFERENCE / "start_triton.sh")
    missing = [path for path in needed if not path.exists()]
    if missing:
        print(f"Triton/perf_analyzer not set up ({', '.join(map(str, missing))} missing): "
              f"run bash {REFERENCE}/setup.sh first", file=sys.stderr)
        return 2
    cases = perf_cases(args.quick)
    seconds = 3.0 if args.quick else 10.0
    repo = build_repository()
    try:
        mine = on_server(frontends.run_dlserve, repo, cases, seconds)
        theirs = on_triton(repo, cases, seconds)
    finally:
        shutil.rmtree(repo, ignore_errors=True)
        remove_leftover_segments()
    command = " ".join(["python benchmarks/bls_streaming.py", *sys.argv[1:]])
    text = report(cases, mine, theirs, args.quick, command)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
