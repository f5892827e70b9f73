"""Execution environments built from a model's requirements file, once per content.

Triton asks for a conda-pack archive of a whole environment, built on a matching OS and
Python (reference/user-pain.md §12). A model may instead name a pip requirements file::

    parameters: {
      key: "EXECUTION_ENV_REQUIREMENTS",
      value: {string_value: "$$TRITON_MODEL_DIRECTORY/requirements.txt"}
    }

and dlserve builds a virtual environment of the server's own Python for it: the server's
packages stay visible (a ``.pth`` file), so pip installs only what they lack or what the
file pins to another version (installed into the environment, never touching the
server's), and the model's packages come first in its workers. Relative paths in the file
(a wheel or a folder beside it) are read from the file's folder.

Environments are cached by the file's content, the server's Python and its packages'
paths, under ``DLSERVE_ENV_CACHE`` (default ``~/.cache/dlserve/environments``), and kept
across restarts: the second load of the same requirements, by any model or server, costs
nothing. A build holds a lock file, so servers sharing the cache never build the same one
at once; a build that failed or was interrupted leaves no environment that looks ready,
and is redone at the next load.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from dlserve.errors import InvalidArgumentError

CACHE_VARIABLE = "DLSERVE_ENV_CACHE"
READY = "dlserve-ready"  # written last: the environment is complete
PIP_TIMEOUT_S = 3600.0


def cache_root() -> Path:
    explicit = os.environ.get(CACHE_VARIABLE)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "dlserve" / "environments"


def build(requirements: Path, server_paths: list[str], where: str) -> Path:
    """The environment for ``requirements`` (built now if the cache lacks it); blocking."""
    try:
        text = requirements.read_bytes()
    except OSError as exc:
        raise InvalidArgumentError(
            f"{where}: cannot read '{requirements}': {exc.strerror}"
        ) from None
    fallback = "\n".join(server_paths)
    python = os.path.realpath(sys.executable)
    key = hashlib.sha256(
        b"\0".join((text, sys.version.encode(), python.encode(), fallback.encode()))
    ).hexdigest()[:20]
    root = cache_root() / key
    if (root / READY).is_file():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another server may be building it
        if (root / READY).is_file():
            return root
        shutil.rmtree(root, ignore_errors=True)  # what a failed build left
        try:
            _run([sys.executable, "-m", "venv", str(root)], requirements.parent, where, "venv")
            (site_packages,) = root.glob("lib/python3*/site-packages")
            (site_packages / "dlserve-server.pth").write_text(fallback + "\n")
            _run(
                [str(root / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-input",
                 "--disable-pip-version-check", "-r", str(requirements)],
                requirements.parent, where, "pip install",
            )
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        (root / READY).write_bytes(text)
    return root


def _run(command: list[str], cwd: Path, where: str, what: str) -> None:
    try:
        done = subprocess.run(
            command, cwd=cwd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InvalidArgumentError(f"{where}: {what} failed: {exc}") from None
    if done.returncode:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise InvalidArgumentError(f"{where}: {what} failed (exit code {done.returncode}):\n{tail}")


__all__ = ["CACHE_VARIABLE", "build", "cache_root"]
