"""Custom execution environments (Triton's ``EXECUTION_ENV_PATH``): the Python a model's
workers run in, when the model needs packages the server's own Python lacks. (Or one
built from a requirements file: ``EXECUTION_ENV_REQUIREMENTS``, ipc.requirements_env.)

A model's config names either a packed environment (a ``.tar.gz`` / ``.tgz`` / ``.tar`` made
by conda-pack, or any tarball of an environment with ``bin/python``) or an unpacked
environment directory; ``$$TRITON_MODEL_DIRECTORY`` stands for the model's directory::

    parameters: {
      key: "EXECUTION_ENV_PATH",
      value: {string_value: "$$TRITON_MODEL_DIRECTORY/python3.11.tar.gz"}
    }

As in Triton, an archive is unpacked once per path and modification time (a changed archive
is unpacked again) into a fresh ``dlserve_env_*`` folder under the temporary directory,
shared by every model naming it and removed when the server stops; its entries may not
reach outside that folder (no absolute paths, no ``..``, no writing through a link).

Workers start with the environment's ``bin/python``, its ``bin`` first on ``PATH`` and its
``lib`` first on ``LD_LIBRARY_PATH`` (what ``bin/activate`` would do). The environment's own
packages come first; dlserve itself, and any package the environment lacks, come from the
server's Python after them (so an environment need only hold what the model adds).

Triton's stub is built for one Python, so a model needing another needs a stub compiled
for it. dlserve's worker is plain Python and its channel carries only ``marshal`` data of
basic types in format version 4, read back the same by Pythons 3.10-3.13 (ipc.protocol),
so an environment may run any Python from 3.10 on. One of another minor version than the
server's cannot use the server's compiled packages: it must bring its own numpy (2.x),
and only dlserve itself comes from the server. The environment's interpreter is run once at load, with the
worker's variables, to learn this, so one that cannot run here (built for another OS)
fails the load with its reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import lzma
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import threading
import zlib
from pathlib import Path

from dlserve.errors import InvalidArgumentError
from dlserve.ipc import requirements_env

log = logging.getLogger("dlserve.worker")

# The folder holding the dlserve package (and Triton's module names for it beside it).
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
PARAMETER = "EXECUTION_ENV_PATH"
REQUIREMENTS_PARAMETER = "EXECUTION_ENV_REQUIREMENTS"
MODEL_DIRECTORY = "$$TRITON_MODEL_DIRECTORY"
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")
# Python 3.11+: the working directory does not go first on the worker's sys.path, so a file
# there named like a module the worker imports (ssl.py, json.py) cannot stand in for it; the
# worker puts the directory last once it has started (dlserve.ipc.stub.main).
SAFE_PATH = "PYTHONSAFEPATH"
# Run by the environment's Python: put the server's paths after its own, then start the stub.
_BOOTSTRAP = (
    "import os, runpy, sys; "
    "sys.path.extend(os.environ.pop('DLSERVE_FALLBACK_PATH').split(os.pathsep)); "
    "runpy.run_module('dlserve.ipc.stub', run_name='__main__', alter_sys=True)"
)


@dataclasses.dataclass(frozen=True)
class ExecutionEnvironment:
    """A ready environment: where it is and how a worker starts in it."""

    root: Path
    # Where its workers look after its own packages: the server's (for an environment
    # of the server's Python), or dlserve alone (for another Python, which cannot load
    # the server's compiled packages).
    fallback: tuple[str, ...] = ()

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    def launch(self, base: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """The command that starts the stub (its own arguments follow) and the process
        environment, from the server's environment ``base``."""
        env = dict(base)
        env.pop("PYTHONHOME", None)
        env.pop("PYTHONPATH", None)
        env["PATH"] = os.pathsep.join(p for p in (str(self.root / "bin"), base.get("PATH", "")) if p)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(self.root / "lib"), base.get("LD_LIBRARY_PATH", "")) if p
        )
        marker = "CONDA_PREFIX" if (self.root / "conda-meta").is_dir() else "VIRTUAL_ENV"
        env[marker] = str(self.root)
        env["DLSERVE_FALLBACK_PATH"] = os.pathsep.join(self.fallback)
        env[SAFE_PATH] = "1"
        return [str(self.python), "-c", _BOOTSTRAP], env


class ServerPython:
    """The server's own Python, for models that name no environment: the stub as a module,
    dlserve first on ``PYTHONPATH``."""

    def launch(self, base: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """As :meth:`ExecutionEnvironment.launch`."""
        env = dict(base)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, base.get("PYTHONPATH", "")) if p)
        env[SAFE_PATH] = "1"
        return [sys.executable, "-m", "dlserve.ipc.stub"], env


SERVER_PYTHON = ServerPython()


def _server_paths() -> list[str]:
    """Where the server's Python finds dlserve, triton_python_backend_utils and their
    dependencies."""
    paths = [PACKAGE_ROOT, *site.getsitepackages(), sysconfig.get_paths()["purelib"]]
    return list(dict.fromkeys(p for p in paths if os.path.isdir(p)))


class Environments:
    """The execution environments of one server: archives unpacked once, removed at stop."""

    def __init__(self) -> None:
        self._unpacked: dict[tuple[str, int], Path] = {}
        self._lock = threading.Lock()
        self._dlserve_only: Path | None = None  # see _package_alone
        self._builder = requirements_env.Builder()

    def resolve(self, value: str, model_dir: Path, model_name: str) -> ExecutionEnvironment:
        """The environment a model's ``EXECUTION_ENV_PATH`` names, unpacked if needed.
        Blocking (an archive may take seconds): call it off the event loop."""
        where = f"model '{model_name}': parameter {PARAMETER}"
        path = _model_path(value, model_dir)
        if path.is_dir():
            root = path
        elif path.is_file() and path.name.endswith(ARCHIVE_SUFFIXES):
            root = self._unpack(path, where)
        elif path.exists():
            raise InvalidArgumentError(
                f"{where}: '{path}' is neither an environment directory nor an archive "
                f"({', '.join(ARCHIVE_SUFFIXES)})"
            )
        else:
            raise InvalidArgumentError(f"{where}: '{path}' does not exist")
        if _check_python(root, where):
            return ExecutionEnvironment(root, tuple(_server_paths()))
        return ExecutionEnvironment(root, (self._package_alone(),))

    def _package_alone(self) -> str:
        """A folder holding dlserve and Triton's module names for it (links) and nothing
        else: installed normally, they sit among all the server's packages."""
        with self._lock:
            if self._dlserve_only is None:
                folder = Path(tempfile.mkdtemp(prefix="dlserve_pkg_"))
                (folder / "dlserve").symlink_to(Path(PACKAGE_ROOT, "dlserve"))
                for module in ("triton_python_backend_utils.py", "c_python_backend_utils.py"):
                    (folder / module).symlink_to(Path(PACKAGE_ROOT, module))
                self._dlserve_only = folder
            return str(self._dlserve_only)

    def resolve_requirements(
        self, value: str, model_dir: Path, model_name: str
    ) -> ExecutionEnvironment:
        """The environment built for the requirements file a model's
        ``EXECUTION_ENV_REQUIREMENTS`` names (ipc.requirements_env); blocking."""
        where = f"model '{model_name}': parameter {REQUIREMENTS_PARAMETER}"
        path = _model_path(value, model_dir)
        # Only a file of the model's own: pip quotes what it reads in its errors.
        if not (path.is_file() and _inside(os.path.realpath(model_dir), os.path.realpath(path))):
            raise InvalidArgumentError(f"{where}: '{value}' is not a file in the model's folder")
        server_paths = _server_paths()
        root = self._builder.build(path, server_paths, where)
        return ExecutionEnvironment(root, tuple(server_paths))

    async def for_model(
        self, path: str, requirements: str, model_dir: Path, model_name: str
    ) -> ExecutionEnvironment | None:
        """The environment a model names (an ``EXECUTION_ENV_PATH`` or an
        ``EXECUTION_ENV_REQUIREMENTS``), readied off the event loop; None when it names
        none."""
        if path and requirements:
            raise InvalidArgumentError(
                f"model '{model_name}': set one of {PARAMETER} and "
                f"{REQUIREMENTS_PARAMETER}, not both"
            )
        if requirements:
            return await asyncio.to_thread(
                self.resolve_requirements, requirements, model_dir, model_name
            )
        if path:
            return await asyncio.to_thread(self.resolve, path, model_dir, model_name)
        return None

    def _unpack(self, archive: Path, where: str) -> Path:
        real = os.path.realpath(archive)
        key = (real, archive.stat().st_mtime_ns)
        with self._lock:
            root = self._unpacked.get(key)
            if root is not None and root.is_dir():
                return root
            stale = [k for k in self._unpacked if k[0] == real]
            for old in stale:  # the archive changed: its old contents go
                shutil.rmtree(self._unpacked.pop(old), ignore_errors=True)
            root = Path(tempfile.mkdtemp(prefix="dlserve_env_"))
            try:
                _extract(archive, root, where)
            except BaseException:
                shutil.rmtree(root, ignore_errors=True)
                raise
            log.info("unpacked execution environment %s into %s", archive, root)
            self._unpacked[key] = root
            return root

    def cancel_builds(self) -> None:
        """Kill the requirement builds running now and refuse new ones (stopping)."""
        self._builder.cancel()

    def close(self) -> None:
        """Remove every unpacked environment (the server is stopping)."""
        self.cancel_builds()
        with self._lock:
            roots, self._unpacked = list(self._unpacked.values()), {}
            if self._dlserve_only is not None:
                roots.append(self._dlserve_only)
                self._dlserve_only = None
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)


def _model_path(value: str, model_dir: Path) -> Path:
    """A path from a model's parameter: ``$$TRITON_MODEL_DIRECTORY`` expanded, relative
    ones taken from the model's folder."""
    path = Path(value.replace(MODEL_DIRECTORY, str(model_dir))).expanduser()
    return path if path.is_absolute() else model_dir / path


def _inside(root: str, path: str) -> bool:
    return path == root or path.startswith(root + os.sep)


def _extract(archive: Path, root: Path, where: str) -> None:
    """Unpack ``archive`` into ``root``, refusing any entry that would land outside it."""
    base = os.path.realpath(root)
    try:
        with tarfile.open(archive) as tar:
            for member in tar:
                name = member.name
                if os.path.isabs(name) or ".." in Path(name).parts:
                    raise InvalidArgumentError(
                        f"{where}: archive entry '{name}' would be written outside the environment"
                    )
                # realpath resolves links unpacked before: no writing through one that leads out
                target = os.path.realpath(os.path.join(base, name))
                if not _inside(base, target):
                    raise InvalidArgumentError(
                        f"{where}: archive entry '{name}' would be written outside the "
                        "environment (through a link)"
                    )
                if member.islnk():
                    linked = os.path.realpath(os.path.join(base, member.linkname))
                    if not _inside(base, linked):
                        raise InvalidArgumentError(
                            f"{where}: archive entry '{name}' is a hard link to "
                            f"'{member.linkname}', outside the environment"
                        )
                if member.isdev():
                    raise InvalidArgumentError(f"{where}: archive entry '{name}' is a device file")
                tar.extract(member, base, **_NO_FILTER)
            # Read to the end, so the compression's checksum is checked: damage the tar
            # reader stopped before (or that landed in a file's bytes) is found too.
            while tar.fileobj is not None and tar.fileobj.read(1 << 20):
                pass
    except _DAMAGED as exc:
        raise InvalidArgumentError(f"{where}: cannot unpack '{archive}': {exc}") from None


# What a truncated or corrupt archive raises while it is read (its decompressor's errors too)
_DAMAGED = (tarfile.TarError, OSError, EOFError, zlib.error, lzma.LZMAError)


# Our checks above replace tarfile's extraction filters (which refuse the absolute symlinks
# a virtual environment's bin/python is); say so where Python has them, to keep it quiet.
_NO_FILTER = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}


# Run by the environment's Python at load, as a worker would run: its version, and its
# numpy's (or why numpy does not import), on one line after a marker.
_PROBE_MARK = "dlserve-probe:"
_PROBE = (
    "import json, sys\n"
    "try:\n    import numpy; n, e = numpy.__version__, ''\n"
    "except Exception as x: n, e = '', '%s: %s' % (type(x).__name__, x)\n"
    f"sys.stdout.write('\\n{_PROBE_MARK}' + json.dumps([sys.version_info[0], sys.version_info[1], n, e]))"
)
MINIMUM_PYTHON = (3, 10)


def _check_python(root: Path, where: str) -> bool:
    """Check that the environment's Python can run a worker; whether it is the server's
    minor version."""
    environment = ExecutionEnvironment(root)
    if not os.access(environment.python, os.X_OK):
        raise InvalidArgumentError(f"{where}: '{root}' has no bin/python")
    python = str(environment.python)
    try:
        probe = subprocess.run(
            [python, "-c", _PROBE], env=environment.launch(dict(os.environ))[1],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InvalidArgumentError(f"{where}: cannot run '{python}': {exc}") from None
    try:
        line = probe.stdout.rsplit(_PROBE_MARK, 1)[1]
        major, minor, numpy_version, numpy_error = json.loads(line)
        version = (int(major), int(minor))
    except (IndexError, ValueError, TypeError):
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise InvalidArgumentError(f"{where}: cannot run '{python}': {last}") from None
    name = f"Python {version[0]}.{version[1]}"
    if version < MINIMUM_PYTHON:
        raise InvalidArgumentError(
            f"{where}: the environment has {name}; dlserve's workers need Python 3.10 or newer"
        )
    if version == sys.version_info[:2]:
        return True
    numpy_major = numpy_version.partition(".")[0]
    if not (numpy_major.isdigit() and int(numpy_major) >= 2):
        found = f"numpy {numpy_version}" if numpy_version else f"no numpy ({numpy_error})"
        raise InvalidArgumentError(
            f"{where}: the environment has {name} and {found}; an environment of another "
            f"Python than the server's ({sys.version_info[0]}.{sys.version_info[1]}) must "
            "bring its own numpy 2.x"
        )
    return False
