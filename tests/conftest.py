"""Shared fixtures: model repositories built from tests/models, and servers that
are checked for leaks (worker processes, /dev/shm segments, file descriptors)
when they stop."""

from __future__ import annotations

import gc
import glob
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import gevent
import grpc
import psutil
import pytest
import uvloop

import dlserve

MODELS = Path(__file__).parent / "models"

# libuv opens one process-wide signal pipe the first time any uvloop loop is made
# and keeps it until exit; make it now so the file-descriptor leak checks below
# only see what servers themselves leave behind.
uvloop.new_event_loop().close()
# gRPC's poller (an epoll and an eventfd) lives while any channel does and is torn
# down lazily; one channel kept open for the whole session keeps it out of the counts.
_GRPC_POLLER = grpc.insecure_channel("127.0.0.1:1")
# tritonclient.http runs on gevent, whose hub keeps an epoll and an eventfd for good.
gevent.sleep(0)
EXAMPLES = Path(__file__).parent.parent / "examples" / "models"


def open_fds() -> set[int]:
    """This process's open descriptors, less the one the listing itself used (closed by
    now: counted, it could take the number of a descriptor opened since and hide it)."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            os.fstat(int(name))
        except OSError:
            continue
        found.add(int(name))
    return found


def fd_targets(pid: int | str = "self") -> list[str]:
    """What a process's open descriptors refer to (``/proc/PID/fd`` links)."""
    targets = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed meanwhile
            pass
    return targets


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    """Poll ``predicate`` until it holds; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes, but it means nobody reaped it
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # (reaped between the two looks)
        return False


def worker_processes(segment_prefix: str) -> list[int]:
    """Live worker processes of the server whose segments start with ``segment_prefix``
    (each worker gets it on its command line), known to the server or not."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        for flag, value in zip(cmdline, cmdline[1:]):
            if flag == "--segment-prefix" and value.startswith(f"{segment_prefix}_"):
                found.append(process.pid)
    return [pid for pid in found if pid_alive(pid)]


def describe_fds(fds: set[int]) -> list[str]:
    described = []
    for fd in sorted(fds):
        try:
            described.append(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except FileNotFoundError:
            described.append(f"{fd} -> (closed meanwhile)")
    return described


@pytest.fixture
def make_repo(tmp_path: Path) -> Callable[..., Path]:
    """Copy models from tests/models (by name) and write extra ones into a new repository.

    ``extra`` maps a model name to {relative path: file text}.
    """

    def make(*names: str, extra: dict[str, dict[str, str]] | None = None) -> Path:
        repo = tmp_path / f"repo{len(list(tmp_path.glob('repo*')))}"
        repo.mkdir()
        for name in names:
            shutil.copytree(MODELS / name, repo / name)
        for name, files in (extra or {}).items():
            for relative, text in files.items():
                path = repo / name / relative
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
        return repo

    return make


class ServerHarness:
    """Starts servers and, at teardown, stops them and checks nothing leaked."""

    def __init__(self) -> None:
        self.servers: list[dlserve.Server] = []
        self.fds_before = open_fds()

    def start(self, repo: Path | list[Path], **options: object) -> dlserve.Server:
        options.setdefault("exit_timeout", 5)
        server = dlserve.Server(dlserve.Options(model_repository=repo if isinstance(repo, list) else str(repo), **options))
        server.start(wait_until_ready=False)
        self.servers.append(server)
        return server

    def stop(self, server: dlserve.Server) -> None:
        engine = server.engine
        prefix = engine.segment_prefix
        pids = [
            instance.pid
            for entry in (engine.manager.models.values() if engine.manager else [])
            for version in entry.versions.values()
            for instance in version.instances
            if instance.pid
        ]
        try:
            server.stop()
        finally:  # (a stop that raised must have cleaned up too)
            self.servers.remove(server)
            leaked = glob.glob(f"/dev/shm/{prefix}*")
            assert not leaked, f"shared memory segments left behind: {leaked}"
            alive = [pid for pid in pids if pid_alive(pid)] + worker_processes(prefix)
            assert not alive, f"worker processes left behind: {sorted(set(alive))}"

    def close(self) -> None:
        for server in list(self.servers):
            self.stop(server)
        gc.collect()  # tensors caught in exception reference cycles hold mappings until then
        # gRPC shuts its pollers down on a background thread a moment after the last
        # channel and server are gone: give such asynchronous clean-up a few seconds
        # (on a loaded two-CPU machine one was seen closing just after five).
        deadline = time.monotonic() + 10
        while (extra := open_fds() - self.fds_before) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not extra, f"file descriptors left open: {describe_fds(extra)}"


@pytest.fixture
def servers() -> Iterator[ServerHarness]:
    harness = ServerHarness()
    yield harness
    harness.close()


def serve(
    tmp_path_factory: pytest.TempPathFactory, names: list[str], **options: object
) -> Iterator[dlserve.Server]:
    """For module-scoped fixtures (``yield from serve(...)``): a server over a new
    repository holding these tests/models, checked for leaks when it stops."""
    repo = tmp_path_factory.mktemp("repo")
    for name in names:
        shutil.copytree(MODELS / name, repo / name)
    harness = ServerHarness()
    try:
        yield harness.start(repo, **options)
    finally:
        harness.close()


def frontend(service_class: type, server: dlserve.Server) -> Iterator[int]:
    """A KServeHttp or KServeGrpc service on a free 127.0.0.1 port, for the fixture's
    lifetime; yields the port."""
    service = service_class(server, service_class.Options(address="127.0.0.1", port=0))
    service.start()
    try:
        yield service.port
    finally:
        service.stop()
