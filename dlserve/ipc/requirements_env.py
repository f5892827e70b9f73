"""Execution environments built from a model's requirements file, once per content.

Triton asks for a conda-pack archive of a whole environment, built on a matching OS and
Python (reference/user-pain.md §12). A model may instead name a pip requirements file in
its own folder::

    parameters: {
      key: "EXECUTION_ENV_REQUIREMENTS",
      value: {string_value: "$$TRITON_MODEL_DIRECTORY/requirements.txt"}
    }

and dlserve builds a virtual environment of the server's own Python for it: the server's
packages stay visible (a ``.pth`` file), so pip installs only what they lack or what the
file pins to another version (installed into the environment, never touching the
server's), and the model's packages come first in its workers. Relative paths in the file
(a wheel or a folder beside it, another requirements file) are read from the file's folder.

Environments are cached under ``DLSERVE_ENV_CACHE`` (default
``~/.cache/dlserve/environments``), a folder only the server's user may write, and kept
across restarts: the second load of the same requirements, by any model or server, costs
nothing. The cache key covers the file's text and the content of every local file it
names, so a changed wheel, or another model's wheel of the same name, gets an environment
of its own. A build holds a lock file, so servers sharing the cache never build the same
one at once; a build that failed or was interrupted leaves no environment that looks
ready, and is redone at the next load. Builds still running when the server stops are
killed.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from dlserve.errors import InvalidArgumentError

CACHE_VARIABLE = "DLSERVE_ENV_CACHE"
READY = "dlserve-ready"  # written last: the environment is complete
PIP_TIMEOUT_S = 3600.0
_PATH_OPTIONS = ("-r", "--requirement", "-c", "--constraint", "-e", "--editable")


def cache_root() -> Path:
    explicit = os.environ.get(CACHE_VARIABLE)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "dlserve" / "environments"


def local_files(text: str, folder: Path) -> Iterator[Path]:
    """The files on this machine a requirements text names (wheels, archives, project
    folders' files, included requirements), resolved from ``folder``."""
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        try:
            tokens = shlex.split(line)
        except ValueError:
            continue
        for index, token in enumerate(tokens):
            value = token.split("=", 1)[1] if token.startswith("--") and "=" in token else token
            named = index > 0 and tokens[index - 1] in _PATH_OPTIONS
            if not (named or value.startswith((".", "/", "file:"))):
                continue
            path = folder / value.removeprefix("file://").removeprefix("file:")
            if path.is_file():
                yield path
            elif path.is_dir():
                found = (p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
                yield from sorted(found)


class Builder:
    """Builds (and, at stop, cancels) the environments of one server."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen[str]] = set()
        self._cancelled = False

    def build(self, requirements: Path, server_paths: list[str], where: str) -> Path:
        """The environment for ``requirements`` (built now if the cache lacks it); blocking."""
        try:
            text = requirements.read_bytes()
        except OSError as exc:
            raise InvalidArgumentError(
                f"{where}: cannot read '{requirements}': {exc.strerror}"
            ) from None
        fallback = "\n".join(server_paths)
        key = self._key(text, requirements.parent, fallback)
        try:
            cache = _private_folder(cache_root())
            root = cache / key
            if (root / READY).is_file():
                return root
            # Not followed if planted as a link, never truncated: only ever locked.
            lock = os.open(cache / f"{key}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise InvalidArgumentError(
                f"{where}: the environment cache {cache_root()} cannot be used ({exc}); "
                f"set {CACHE_VARIABLE} to a folder the server may write"
            ) from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another server may be building it
            if (root / READY).is_file():
                return root
            shutil.rmtree(root, ignore_errors=True)  # what a failed build left
            try:
                venv = [sys.executable, "-m", "venv", str(root)]
                self._run(venv, requirements.parent, where, "venv")
                (site_packages,) = root.glob("lib/python3*/site-packages")
                (site_packages / "dlserve-server.pth").write_text(fallback + "\n")
                self._run(
                    [str(root / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-input",
                     "--disable-pip-version-check", "-r", str(requirements)],
                    requirements.parent, where, "pip install",
                )
                (root / READY).write_bytes(text)
            except BaseException:
                shutil.rmtree(root, ignore_errors=True)
                raise
        finally:
            os.close(lock)
        return root

    @staticmethod
    def _key(text: bytes, folder: Path, fallback: str) -> str:
        digest = hashlib.sha256()
        python = os.path.realpath(sys.executable)
        for part in (text, sys.version.encode(), python.encode(), fallback.encode()):
            digest.update(part + b"\0")
        for path in local_files(text.decode(errors="replace"), folder):
            name = path.relative_to(folder) if path.is_relative_to(folder) else path
            digest.update(str(name).encode() + b"\0")
            with path.open("rb") as file:
                while chunk := file.read(1 << 20):
                    digest.update(chunk)
        return digest.hexdigest()[:20]

    def _run(self, command: list[str], cwd: Path, where: str, what: str) -> None:
        with self._lock:
            if self._cancelled:
                raise InvalidArgumentError(f"{where}: the server is stopping")
            process = subprocess.Popen(
                command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True,  # killed with its children by cancel()
            )
            self._running.add(process)
        try:
            output, _ = process.communicate(timeout=PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _kill(process)
            raise InvalidArgumentError(f"{where}: {what} took over {PIP_TIMEOUT_S:.0f} s") from None
        finally:
            with self._lock:
                self._running.discard(process)
        if process.returncode:
            # pip's own error lines, not everything it printed (it may quote the file).
            errors = [line[:300] for line in output.splitlines() if line.startswith("ERROR")]
            tail = "\n".join(errors[-10:] or output.strip().splitlines()[-5:])
            raise InvalidArgumentError(
                f"{where}: {what} failed (exit code {process.returncode}):\n{tail}"
            )

    def cancel(self) -> None:
        """Kill the builds running now, and refuse new ones (the server is stopping)."""
        with self._lock:
            self._cancelled = True
            running = list(self._running)
        for process in running:
            _kill(process)


def _kill(process: subprocess.Popen[str]) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _private_folder(path: Path) -> Path:
    """``path``, made if need be; refused unless it is a folder of this user that no one
    else may write (an environment found there is run as the server)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise PermissionError(f"{path} must be a folder of this user that others cannot write")
    return path


__all__ = ["CACHE_VARIABLE", "Builder", "cache_root", "local_files"]
