"""The servers the benchmarks compare: dlserve, real Triton and MLServer as context managers on
free loopback ports, each on a model repository assembled in a temporary folder from model
folders::

    with peers.repository([EXAMPLES / "add_sub"]) as repo:
        with peers.dlserve(repo, ["add_sub"]) as server:  # dlserve serve --model-repository repo
            ...                                           # server.url("grpc") -> "127.0.0.1:PORT"
        with peers.triton(repo, ["add_sub"]) as server:   # tritonserver 2.51 (nvidia-pytriton wheel)
            ...
    # peers.mlserver(repo, models): MLServer 1.7.1 on a folder of MLServer model folders

Each runs in its own session, so that stopping it also stops what it spawned (Triton's
Python-backend stubs, MLServer's worker pool, dlserve's workers), and waits until the server
and the named models are ready. Leaving the block stops the server (SIGTERM, then SIGKILL to
its whole process group) and removes any /dev/shm segment it left behind (dlserve's
``dlserve_<pid>_*``, the regions named on the command lines of Triton's stubs); it is left on
Ctrl-C as well (and on SIGTERM inside :func:`stop_on_sigterm`).

The peers come from ../shared/tools/reference-servers (``setup.sh`` installs them into
``$ANCHORS``, default ``${TMPDIR:-/tmp}/anchors``); :func:`ensure_peers` runs it when they are
missing. The clients that measure them are in measure.py.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH_MODELS = ROOT / "benchmarks" / "models"
EXAMPLES = ROOT / "examples" / "models"
REFERENCE = Path(
    os.environ.get("REFERENCE_SERVERS", ROOT.parent / "shared" / "tools" / "reference-servers")
)
ANCHORS = Path(os.environ.get("ANCHORS", Path(os.environ.get("TMPDIR", "/tmp")) / "anchors"))
TRITON_VENV = ANCHORS / "venv-triton"
TRITON_SITE = TRITON_VENV / "lib" / "python3.11" / "site-packages"
TRITON_HOME = TRITON_SITE / "pytriton" / "tritonserver"
MLSERVER_BIN = ANCHORS / "venv-mlserver" / "bin" / "mlserver"
PERF_ANALYZER = ANCHORS / "pa" / "perf_analyzer"
PA_SH = REFERENCE / "pa.sh"
LOADGEN = REFERENCE / "loadgen.py"
# (beside this Python, as a virtual environment installs it; else the one on PATH)
DLSERVE_BIN = Path(sys.executable).parent / "dlserve"
if not DLSERVE_BIN.exists() and shutil.which("dlserve"):
    DLSERVE_BIN = Path(shutil.which("dlserve") or "dlserve")
SHM = "/dev/shm"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- setup


def missing_peers(mlserver: bool = True) -> list[Path]:
    needed = [
        PERF_ANALYZER,
        ANCHORS / "palib" / "libcudart.so.12",
        TRITON_HOME / "bin" / "tritonserver",
        PA_SH,
    ]
    if mlserver:
        needed.append(MLSERVER_BIN)
    return [path for path in needed if not path.exists()]


def ensure_peers(mlserver: bool = True) -> None:
    """Run the reference setup.sh when Triton, perf_analyzer (or MLServer) are not in $ANCHORS."""
    missing = missing_peers(mlserver)
    if not missing:
        return
    setup = REFERENCE / "setup.sh"
    if not setup.exists():
        raise SystemExit(
            f"peers missing ({', '.join(map(str, missing))}) and no {setup} to install them"
        )
    log(f"peers missing in {ANCHORS}: {', '.join(p.name for p in missing)}")
    log(
        f"running bash {setup} (about a minute: pip installs Triton 2.51 via nvidia-pytriton, "
        "perf_analyzer from the tritonclient 2.50 wheel, MLServer 1.7.1; apt installs libb64-0d)"
    )
    subprocess.run(["bash", str(setup)], check=True, env=dict(os.environ, ANCHORS=str(ANCHORS)))
    still = missing_peers(mlserver)
    if still:
        raise SystemExit(f"setup.sh ran but these are still missing: {', '.join(map(str, still))}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_json(port: int, path: str, timeout: float = 5.0) -> Any:
    """GET 127.0.0.1:port/path as JSON (None on any failure)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as response:
            return json.loads(response.read() or b"null") if response.status == 200 else None
    except (OSError, ValueError, urllib.error.HTTPError):
        return None


def http_ok(port: int, path: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


# ---------------------------------------------------------------- model repositories

_SKIP = shutil.ignore_patterns("__pycache__", "*.pyc")


@contextlib.contextmanager
def repository(sources: Iterable[Path], extra: Iterable[Path] = ()) -> Iterator[Path]:
    """A fresh temporary model repository holding a copy of each model folder in ``sources``
    (and of the files in ``extra``, e.g. MLServer's runtimes.py); removed, with the server
    logs kept next to it, on exit."""
    work = Path(tempfile.mkdtemp(prefix="dlserve-bench-"))
    repo = work / "models"
    repo.mkdir()
    try:
        for source in sources:
            shutil.copytree(source, repo / source.name, ignore=_SKIP)
        for path in extra:
            shutil.copy2(path, repo / path.name)
        yield repo
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------- /dev/shm


def shm_names() -> set[str]:
    try:
        return set(os.listdir(SHM))
    except OSError:
        return set()


def mapped_shm_names() -> set[str]:
    """Names of /dev/shm segments some live process maps or holds open."""
    names: set[str] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps, encoding="utf-8", errors="replace") as f:
                for line in f:
                    at = line.find("/dev/shm/")
                    if at >= 0:
                        names.add(line[at + 9 :].split()[0])
        except OSError:
            continue
    for fd in glob.glob("/proc/[0-9]*/fd/*"):
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("/dev/shm/"):
                names.add(target[9:].split()[0])
    return names


class ShmLedger:
    """Segments our servers and clients created: removed when they are left behind."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.removed: list[str] = []
        self.pending: dict[str, str] = {}  # client leftovers still mapped: name -> who

    def note(self, names: Iterable[str]) -> None:
        self.seen.update(names)

    def sweep(self, names: Iterable[str], who: str) -> None:
        for name in sorted(set(names)):
            path = os.path.join(SHM, name)
            if os.path.exists(path):
                log(f"  /dev/shm/{name} left behind by {who}: removing it")
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                self.removed.append(f"{name} ({who})")

    def candidates(self, names: set[str], who: str) -> None:
        """Left by a client: removed now unless some process maps them, else by ``settle``."""
        self.note(names)
        self.pending.update(dict.fromkeys(names, who))
        self.settle()

    def settle(self) -> None:
        """Remove the pending leftovers no live process maps (or has open) any more."""
        left = {n: who for n, who in self.pending.items() if os.path.exists(os.path.join(SHM, n))}
        if left:
            mapped = mapped_shm_names()
            for name, who in left.items():
                if name not in mapped:
                    self.sweep([name], who)
            left = {n: who for n, who in left.items() if n in mapped}
        self.pending = left

    def summary(self) -> str:
        self.settle()
        text = (
            f"/dev/shm: {len(self.seen)} segments of our servers and clients seen, "
            f"{len(self.removed)} left behind (removed)"
        )
        if self.pending:
            text += f"; {', '.join(self.pending)} still mapped by some process: left alone"
        return text


SHM_LEDGER = ShmLedger()


# ---------------------------------------------------------------- servers


def kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


@dataclass
class Server:
    """One server process on 127.0.0.1; a context manager (start on enter, stop on exit)."""

    name: str  # "dlserve", "Triton", "MLServer"
    command: list[str]
    repo: Path
    ports: dict[str, int]  # http, grpc, metrics
    env: dict[str, str] | None = None
    models: list[str] = field(default_factory=list)  # each must be ready
    shown_env: str = ""  # environment assignments to show before the command
    version: str = ""
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    segments: set[str] = field(default_factory=set)

    def url(self, protocol: str) -> str:
        return f"127.0.0.1:{self.ports['grpc' if protocol.startswith('grpc') else 'http']}"

    def shown_command(self) -> str:
        """The command line with the ports and the repository as placeholders."""
        text = " ".join(self.command)
        text = text.replace(str(self.repo), "REPO")
        for key, port in self.ports.items():
            text = re.sub(rf"\b{port}\b", f"${key.upper()}_PORT", text)
        return (self.shown_env + " " if self.shown_env else "") + text

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 180.0) -> None:
        self.log_path = self.repo.parent / f"{self.name}.log"
        log(f"starting {self.name}: {' '.join(self.command)}")
        with open(self.log_path, "wb") as out:
            # cwd = the repository, outside the checkout: the checkout's triton_python_backend_utils.py
            # shim must not shadow Triton's own module in Triton's stubs.
            self.proc = subprocess.Popen(
                self.command,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.repo,
                env=self.env,
                start_new_session=True,
            )
        started = time.monotonic()
        try:
            self._wait_ready(started + timeout)
        except BaseException:
            self.stop()
            raise
        info = http_json(self.ports["http"], "/v2") or {}
        self.version = str(info.get("version", ""))
        self.note_segments()
        log(
            f"  {self.name} {self.version} ready after {time.monotonic() - started:.1f} s "
            f"(HTTP {self.ports['http']}, gRPC {self.ports['grpc']})"
        )

    def _wait_ready(self, deadline: float) -> None:
        assert self.proc is not None
        port = self.ports["http"]
        paths = ["/v2/health/ready", *(f"/v2/models/{m}/ready" for m in self.models)]
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} while starting:\n{self.log_tail()}"
                )
            if all(http_ok(port, path) for path in paths):
                return
            time.sleep(0.3)
        raise RuntimeError(f"{self.name} not ready after {deadline:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def note_segments(self, pid: int | None = None) -> None:
        """Remember the server's /dev/shm segments, to remove any it leaves behind once stopped."""
        if pid is None:
            if self.proc is None:
                return
            pid = self.proc.pid
        found = {n for n in shm_names() if n.startswith(f"dlserve_{pid}_")}
        if self.name == "Triton":  # each stub gets its region's name as its second argument
            for proc in glob.glob("/proc/[0-9]*"):
                try:
                    argv = Path(proc, "cmdline").read_bytes().split(b"\0")
                    pgid = os.getpgid(int(os.path.basename(proc)))
                except (OSError, ValueError):
                    continue
                if (
                    pgid == pid
                    and len(argv) > 2
                    and argv[0].endswith(b"triton_python_backend_stub")
                ):
                    found.add(argv[2].decode().lstrip("/"))
        self.segments |= found
        SHM_LEDGER.note(found)

    def stats(self, model: str) -> dict[str, int]:
        """inference_count, execution_count and the cache_hit count of a model (statistics
        extension; {} without it)."""
        document = http_json(self.ports["http"], f"/v2/models/{model}/stats") or {}
        for entry in document.get("model_stats", []):
            counts = {
                key: int(entry.get(key, 0) or 0) for key in ("inference_count", "execution_count")
            }
            hits = entry.get("inference_stats", {}).get("cache_hit", {})
            counts["cache_hits"] = int(hits.get("count", 0) or 0)
            return counts
        return {}

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        self.note_segments(proc.pid)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                log(f"  {self.name} still running 30 s after SIGTERM: SIGKILL")
        kill_group(proc.pid, signal.SIGKILL)  # whatever it spawned and left (stubs, workers)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        for _ in range(100):
            if not _group_alive(proc.pid):
                break
            time.sleep(0.1)
        leftovers = {n for n in shm_names() if n.startswith(f"dlserve_{proc.pid}_")} | self.segments
        SHM_LEDGER.sweep(leftovers & shm_names(), self.name)
        SHM_LEDGER.settle()  # clients' regions the server held registered
        log(f"  {self.name} stopped")


def _ports() -> dict[str, int]:
    ports: dict[str, int] = {}
    while len(set(ports.values())) < 3:
        ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
    return ports


def _listen_flags(ports: dict[str, int]) -> list[str]:
    """Loopback addresses and ports: flags both tritonserver and dlserve serve take."""
    flags = []
    for service in ("http", "grpc", "metrics"):
        flags += [f"--{service}-address", "127.0.0.1", f"--{service}-port", str(ports[service])]
    return flags


def dlserve(repo: Path, models: list[str] | None = None, flags: Sequence[str] = ()) -> Server:
    ports = _ports()
    command = [
        str(DLSERVE_BIN),
        "serve",
        "--model-repository",
        str(repo),
        *_listen_flags(ports),
        "--allow-client-shm",
        "true",
        "--http-max-input-size",
        str(1 << 28),
        "--grpc-max-message-size",
        str(1 << 28),
        *flags,
    ]
    return Server("dlserve", command, repo, ports, models=list(models or []))


def _triton_libdir() -> str:
    python = TRITON_VENV / "bin" / "python"
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def triton(repo: Path, models: list[str] | None = None, flags: Sequence[str] = ()) -> Server:
    """Triton 2.51 with its Python backend, started as reference-servers/start_triton.sh starts it
    (the stub for Python 3.11 next to libtriton_python.so; LD_LIBRARY_PATH led by the LIBDIR of
    the venv's Python, whose libpython the stub embeds; the venv's bin first on PATH so the stub
    finds the venv's numpy), on free ports instead of start_triton.sh's fixed ones."""
    stub = TRITON_HOME / "backends" / "python" / "triton_python_backend_stub"
    if not stub.exists():
        shutil.copy2(
            TRITON_HOME / "python_backend_stubs" / "3.11" / "triton_python_backend_stub", stub
        )
    ports = _ports()
    libs = f"{_triton_libdir()}:{TRITON_SITE / 'nvidia_pytriton.libs'}"
    env = dict(
        os.environ,
        LD_LIBRARY_PATH=libs
        + (":" + os.environ["LD_LIBRARY_PATH"] if os.environ.get("LD_LIBRARY_PATH") else ""),
        PATH=f"{TRITON_VENV / 'bin'}:{os.environ.get('PATH', '')}",
    )
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    command = [
        str(TRITON_HOME / "bin" / "tritonserver"),
        "--model-repository",
        str(repo),
        "--backend-directory",
        str(TRITON_HOME / "backends"),
        "--cache-directory",
        str(TRITON_HOME / "caches"),
        *_listen_flags(ports),
        "--allow-metrics",
        "true",
        "--allow-gpu-metrics",
        "false",
        "--allow-cpu-metrics",
        "true",
        "--log-verbose",
        "0",
        *flags,
    ]
    shown = f"LD_LIBRARY_PATH={libs} PATH={TRITON_VENV / 'bin'}:$PATH"
    return Server(
        "Triton", command, repo, ports, env=env, models=list(models or []), shown_env=shown
    )


def mlserver(repo: Path, models: list[str]) -> Server:
    """MLServer 1.7.1 serving the MLServer model folders in ``repo`` (with reference-servers'
    runtimes.py); its settings.json is written with free ports. Default parallel workers (1):
    the model runs in a worker process, as in Triton's Python backend and in dlserve."""
    ports = _ports()
    settings = json.loads((REFERENCE / "mlserver" / "settings.json").read_text())
    settings.update(
        http_port=ports["http"],
        grpc_port=ports["grpc"],
        metrics_port=ports["metrics"],
        host="127.0.0.1",
    )
    (repo / "settings.json").write_text(json.dumps(settings, indent=2) + "\n")
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    command = [str(MLSERVER_BIN), "start", str(repo)]
    return Server("MLServer", command, repo, ports, env=env, models=models)


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt, so that every ``finally`` (server stops) runs."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
