"""The clients that measure the servers, each returning a :class:`Measurement` (per-concurrency
:class:`Level` rows, the exact command, the client's CPU use), and the facts of the machine.

perf_analyzer and dlserve perf take the same arguments and the same :class:`Window`
(measurement interval, stability percentage, trials) and, when no window becomes stable, are
run once more with the check off (``relaxed``)::

    measure.perf_analyzer(args, url, window)  # NVIDIA's C++ perf_analyzer (tritonclient 2.50 wheel)
    measure.dlserve_perf(args, url, window)   # dlserve's perf_analyzer-compatible load generator
    measure.loadgen(url, protocol, model, concurrency, duration, warmup)  # tritonclient, Python

Each client runs in its own session (a timeout or Ctrl-C stops all of it), and the /dev/shm
regions a killed or failed client left are removed once nothing maps them.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peers import (
    ANCHORS,
    DLSERVE_BIN,
    LOADGEN,
    PA_SH,
    SHM_LEDGER,
    TRITON_VENV,
    kill_group,
    shm_names,
)


@dataclass
class Level:
    concurrency: int
    throughput: float  # inferences/s
    p50_us: float
    p99_us: float
    compute_infer_us: float | None = None  # server side (perf_analyzer's "Server Compute Infer")


@dataclass
class Measurement:
    tool: str  # "perf_analyzer", "dlserve perf", "loadgen"
    command: list[str]
    levels: list[Level] = field(default_factory=list)
    cpu_cores: float = 0.0  # client CPU: cores busy on average over the run
    wall_s: float = 0.0
    relaxed: bool = False  # measured again without the stability check
    error: str | None = None
    attempts: list[list[str]] = field(default_factory=list)  # every command run, in order
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.levels)

    def at(self, concurrency: int | None = None) -> Level | None:
        if not self.ok:
            return None
        if concurrency is None:
            return self.levels[0]
        return next((lv for lv in self.levels if lv.concurrency == concurrency), None)


def _run(
    command: list[str], timeout: float, env: dict[str, str] | None = None
) -> tuple[int, str, float, float]:
    """Run a client in its own session (so that a timeout or Ctrl-C stops all of it):
    (exit status, output, wall seconds, CPU cores used)."""
    before = os.times()
    start = time.monotonic()
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
        cwd=tempfile.gettempdir(),
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        output += f"\n(killed after {timeout:.0f} s)"
    except BaseException:
        kill_group(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    finally:
        kill_group(proc.pid, signal.SIGKILL)  # anything it left running
    wall = time.monotonic() - start
    after = os.times()
    cpu = (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )
    return proc.returncode, output, wall, cpu / wall if wall > 0 else 0.0


def _levels_from_csv(path: Path) -> list[Level]:
    if not path.exists() or not path.stat().st_size:
        return []
    with path.open() as f:
        rows = list(csv.DictReader(f))
    levels = []
    for row in rows:
        infer = row.get("Server Compute Infer")
        levels.append(
            Level(
                concurrency=int(float(row["Concurrency"])),
                throughput=float(row["Inferences/Second"]),
                p50_us=float(row["p50 latency"]),
                p99_us=float(row["p99 latency"]),
                compute_infer_us=float(infer) if infer not in (None, "") else None,
            )
        )
    return sorted(levels, key=lambda lv: lv.concurrency)


@dataclass
class Window:
    """perf_analyzer's measurement flags, used identically by dlserve perf."""

    interval_ms: int = 3000
    stability: float = 30.0
    trials: int = 4

    def flags(self, stability: float | None = None) -> list[str]:
        s = self.stability if stability is None else stability
        return [
            "--measurement-interval",
            str(self.interval_ms),
            "--stability-percentage",
            f"{s:g}",
            "--max-trials",
            str(self.trials),
        ]


RELAXED = 1000.0  # -s 1000: the stability check as good as off


def _levels_in(args: list[str]) -> int:
    if "--concurrency-range" not in args:
        return 1
    start, _, rest = args[args.index("--concurrency-range") + 1].partition(":")
    end, _, step = rest.partition(":")
    if not end:
        return 1
    return len(range(int(start), int(end) + 1, int(step or 1)))


def _sweep_client_segments(before: set[str], tool: str, tensors: bool) -> None:
    """Remove the /dev/shm regions a client created and left (it was killed, or failed):
    perf_analyzer's (``INPUT0_0_0``, ``OUTPUT0``...) and dlserve perf's (``perf_client_<pid>_*``)
    that appeared during its run. One a server still maps (registered) is removed once no
    process maps it any more (after the server stops)."""
    new = shm_names() - before
    found = {n for n in new if n.startswith("perf_client_")}
    if tensors:
        found |= {n for n in new if re.fullmatch(r"[A-Za-z][A-Za-z0-9]*(_\d+_\d+)?", n)}
    if found:
        SHM_LEDGER.candidates(found, tool)


def _client(
    tool: str,
    base: list[str],
    args: list[str],
    url: str,
    window: Window,
    env: dict[str, str] | None,
    relax: bool,
) -> Measurement:
    """Run perf_analyzer or dlserve perf once with ``window``'s flags; when it fails to become
    stable (or fails) and ``relax``, once more with the check as good as off (marked relaxed)."""
    stabilities = [window.stability] + ([RELAXED] if relax and window.stability < RELAXED else [])
    timeout = 60 + 2.5 * _levels_in(args) * window.trials * window.interval_ms / 1000
    result = Measurement(tool, [])
    attempts: list[list[str]] = []
    expected = _levels_in(args)
    for attempt, stability in enumerate(stabilities):
        with tempfile.TemporaryDirectory(prefix="dlserve-bench-") as tmp:
            out = Path(tmp) / "out.csv"
            command = [*base, *args, "-u", url, *window.flags(stability), "-f", str(out)]
            attempts.append(command)
            before = shm_names()
            try:
                rc, output, wall, cores = _run(command, timeout, env)
            finally:  # also when interrupted: the client was killed and may have left its regions
                _sweep_client_segments(before, tool, tensors="--shared-memory" in args)
            levels = _levels_from_csv(out) if rc == 0 else []
        result = Measurement(
            tool, command, levels, cores, wall, relaxed=attempt > 0, attempts=attempts
        )
        if result.ok and len(levels) == expected:
            return result
        # perf_analyzer may stop a sweep at a level that never became stable, exit 0 and write
        # only the levels before it: that is a failed measurement too
        lines = [line for line in output.strip().splitlines() if line.strip()]
        unstable = [line for line in lines if "stable" in line.lower()]
        if rc == 0 and levels:
            lines = unstable[-1:] + [
                f"only {len(levels)} of {expected} concurrency levels measured"
            ]
        result.error = " | ".join(lines[-2:])[-300:] or f"exit status {rc}"
        result.levels = []
    return result


def perf_analyzer(args: list[str], url: str, window: Window, relax: bool = True) -> Measurement:
    """NVIDIA perf_analyzer, through reference-servers/pa.sh (``args`` without -u and the window)."""
    env = dict(
        os.environ,
        ANCHORS=str(ANCHORS),
        PA_TIMEOUT=str(
            int(60 + 2.5 * _levels_in(args) * window.trials * window.interval_ms / 1000)
        ),
    )
    return _client("perf_analyzer", ["bash", str(PA_SH)], args, url, window, env, relax)


def dlserve_perf(args: list[str], url: str, window: Window, relax: bool = True) -> Measurement:
    """``dlserve perf`` with the same arguments perf_analyzer would get."""
    return _client(
        "dlserve perf", [str(DLSERVE_BIN), "perf", "--no-progress"], args, url, window, None, relax
    )


def loadgen(
    url: str,
    protocol: str,
    model: str,
    concurrency: int,
    duration: float,
    warmup: float,
    json_tensors: bool = False,
    elements: int = 1024,
) -> Measurement:
    """reference-servers/loadgen.py: tritonclient's sync clients, one thread per request in flight.
    The only client here that drives MLServer's REST API (JSON tensors: MLServer has no binary
    tensor extension)."""
    command = [
        sys.executable,
        str(LOADGEN),
        "--url",
        url,
        "--protocol",
        protocol,
        "--model",
        model,
        *(["--n", str(elements)] if model != "add_sub" else []),
        "--concurrency",
        str(concurrency),
        "--duration",
        f"{duration:g}",
        "--warmup",
        f"{warmup:g}",
        *(["--json"] if json_tensors else []),
    ]
    rc, output, wall, cores = _run(command, 60 + 3 * (duration + warmup))
    result = Measurement("loadgen", command, cpu_cores=cores, wall_s=wall)
    document: dict[str, Any] = {}
    for line in reversed(output.strip().splitlines()):
        with contextlib.suppress(ValueError):
            document = json.loads(line)
            break
    problems = (
        [f"{document['wrong_replies']} wrong replies"] if document.get("wrong_replies") else []
    )
    problems += document.get("errors", []) + ([document["error"]] if "error" in document else [])
    if rc != 0 or problems or not document.get("count"):
        tail = " | ".join(output.strip().splitlines()[-2:])[-300:]
        result.error = "; ".join(map(str, problems)) or tail or f"exit status {rc}"
        return result
    result.levels = [
        Level(
            concurrency,
            float(document["infer_per_s"]),
            float(document["p50_us"]),
            float(document["p99_us"]),
        )
    ]
    return result


# ---------------------------------------------------------------- the machine measured on


def machine() -> dict[str, str]:
    """CPU model, cores, memory, kernel, OS, Python and the versions of the pieces measured."""
    import platform

    def first(path: str, key: str) -> str:
        with contextlib.suppress(OSError):
            for line in Path(path).read_text().splitlines():
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
        return "?"

    def version(python: Path | str, package: str) -> str:
        code = f"import importlib.metadata as m; print(m.version({package!r}))"
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False)
        return out.stdout.strip() or "?"

    mem_kib = first("/proc/meminfo", "MemTotal").split()[0]
    os_name = "?"
    with contextlib.suppress(OSError):
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                os_name = line.split("=", 1)[1].strip('"')
    pa_wheel = sorted((ANCHORS / "dl").glob("tritonclient-*.whl"))
    return {
        "CPU": first("/proc/cpuinfo", "model name"),
        "cores": f"{os.cpu_count()} (client and server share them)",
        "memory": f"{int(mem_kib) / (1 << 20):.1f} GiB" if mem_kib.isdigit() else "?",
        "kernel": platform.release(),
        "OS": os_name,
        "Python": f"{platform.python_version()} ({sys.executable})",
        "dlserve": version(sys.executable, "dlserve"),
        "Triton": f"tritonserver (python backend) from nvidia-pytriton {version(TRITON_VENV / 'bin' / 'python', 'nvidia-pytriton')}",
        "MLServer": version(ANCHORS / "venv-mlserver" / "bin" / "python", "mlserver"),
        "perf_analyzer": f"from the {pa_wheel[0].name if pa_wheel else 'tritonclient 2.50.0'} wheel",
        "tritonclient (loadgen, checks)": version(sys.executable, "tritonclient"),
        "numpy (dlserve / Triton / MLServer)": " / ".join(
            version(p, "numpy")
            for p in (
                sys.executable,
                TRITON_VENV / "bin" / "python",
                ANCHORS / "venv-mlserver" / "bin" / "python",
            )
        ),
    }
