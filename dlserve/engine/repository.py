"""Model repositories: Triton's layout, version folders and version policy.

``<repository>/<model>/config.pbtxt`` and ``<repository>/<model>/<version>/model.py``.
Only names found by listing the repositories can be loaded, so a model name from a
request can never reach outside them; files uploaded with a load request are
written under a private folder after the same check on every path. A repository
may be an ``s3://``, ``gs://`` or ``as://`` URL: its models are read from a local
mirror (object_store).
"""

from __future__ import annotations

import ast
import dataclasses
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from dlserve.engine import config as cfg
from dlserve.engine.object_store import Stamps, StoreMirror, is_remote
from dlserve.engine.proto import model_config_pb2 as mc
from dlserve.errors import InvalidArgumentError, NotFoundError

log = logging.getLogger("dlserve.engine")

CONFIG_FILE = "config.pbtxt"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a model's files are."""

    name: str
    path: Path
    # For a model in an s3:// repository: its objects as last listed (its fingerprint);
    # ``path`` holds its files once fetched.
    stamps: Stamps | None = None

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_FILE

    def versions_on_disk(self) -> list[int]:
        """Numeric version folders, ascending; other folders are ignored with a warning."""
        versions = []
        for entry in sorted(os.scandir(self.path), key=lambda e: e.name):
            if not entry.is_dir():
                continue
            if entry.name.isascii() and entry.name.isdigit():
                versions.append(int(entry.name))
            else:
                log.warning(
                    "model '%s': ignoring folder '%s', version folders must be numbers",
                    self.name,
                    entry.name,
                )
        return sorted(versions)

    def fingerprint(self) -> tuple[tuple[str, Any, int], ...]:
        """Changes when any file of the model changes (used by poll mode)."""
        if self.stamps is not None:
            return self.stamps
        stamps = []
        for root, _dirs, files in os.walk(self.path):
            if "__pycache__" in root:
                continue
            for name in files:
                st = os.stat(os.path.join(root, name))
                stamps.append((os.path.join(root, name), st.st_mtime_ns, st.st_size))
        return tuple(sorted(stamps))


def select_versions(policy: mc.ModelVersionPolicy, available: list[int]) -> list[int]:
    choice = policy.WhichOneof("policy_choice")
    if choice == "all":
        return list(available)
    if choice == "specific":
        return [v for v in policy.specific.versions if v in available]
    count = policy.latest.num_versions if choice == "latest" else 1
    return sorted(available)[-max(count, 1) :]


def defines_auto_complete(model_file: Path) -> bool:
    """Whether ``TritonPythonModel`` defines ``auto_complete_config``, read without importing.

    Saves a throwaway worker process for the (common) models that do not. A file
    that does not parse, or has no such class, is left for the instance's worker
    to report, after the config has been checked.
    """
    try:
        tree = ast.parse(model_file.read_text())
    except (OSError, SyntaxError, ValueError):
        return False
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "TritonPythonModel":
            return any(
                isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                and item.name == "auto_complete_config"
                for item in node.body
            )
    return False


def check_model_name(name: str) -> None:
    """Reject names that are not a single, plain folder name (Triton's rules)."""
    if not name or name != name.strip():
        raise InvalidArgumentError(f"model name '{name}' is empty or has surrounding spaces")
    if "/" in name or "\\" in name or name in (".", "..") or "\0" in name:
        raise InvalidArgumentError(f"model name '{name}' must not contain path traversal characters")


class Repository:
    """One or more repositories, searched in order; model names must be unique.

    An object-store repository is listed by :meth:`refresh` and a model's files are
    downloaded by :meth:`fetch`; both block on the network, so the engine runs them
    on a thread. :meth:`scan` and :meth:`find` never touch the network.
    """

    def __init__(self, paths: list[str | Path]) -> None:
        self.paths: list[Path] = []
        self._mirrors: dict[Path, StoreMirror] = {}  # local root -> its s3:// repository
        try:
            for path in paths:
                if is_remote(path):
                    mirror = StoreMirror(str(path))
                    self._mirrors[mirror.root] = mirror
                    self.paths.append(mirror.root)
                    continue
                if "://" in str(path):
                    raise InvalidArgumentError(
                        f"model repository '{path}': only local folders and s3://, gs:// "
                        "and as:// URLs are supported"
                    )
                resolved = Path(path).expanduser().resolve()
                if not resolved.is_dir():
                    raise InvalidArgumentError(f"model repository '{path}' is not a directory")
                self.paths.append(resolved)
        except BaseException:
            for mirror in self._mirrors.values():
                mirror.close()
            raise
        self._uploads = Path(tempfile.mkdtemp(prefix="dlserve-uploads-"))

    @property
    def remote(self) -> bool:
        """Whether any repository is remote (refresh and fetch do network I/O)."""
        return bool(self._mirrors)

    def scan(self) -> dict[str, ModelSource | str]:
        """Every model folder by name; a name found in two repositories maps to an error."""
        found: dict[str, ModelSource | str] = {}
        for repo in self.paths:
            mirror = self._mirrors.get(repo)
            if mirror is not None:
                listing = sorted(mirror.listing.items())
                sources = [ModelSource(name, repo / name, stamps) for name, stamps in listing]
            else:
                sources = [
                    ModelSource(entry.name, Path(entry.path))
                    for entry in sorted(os.scandir(repo), key=lambda e: e.name)
                    if entry.is_dir() and not entry.name.startswith(".")
                ]
            for source in sources:
                if source.name in found:
                    found[source.name] = (
                        f"model '{source.name}' appears in more than one model repository"
                    )
                else:
                    found[source.name] = source
        return found

    def refresh(self) -> None:
        """List the remote repositories again (blocking)."""
        for mirror in self._mirrors.values():
            mirror.refresh()

    def fetch(self, name: str) -> ModelSource:
        """:meth:`find`, after bringing the model's files from remote repositories up
        to date (blocking)."""
        check_model_name(name)
        for mirror in self._mirrors.values():
            mirror.fetch(name)
        return self.find(name)

    def find(self, name: str) -> ModelSource:
        entry = self.scan().get(name)
        if entry is None:
            raise NotFoundError(
                f"failed to load '{name}', failed to poll from model repository"
            )
        if isinstance(entry, str):
            raise InvalidArgumentError(entry)
        return entry

    def read_config(self, source: ModelSource) -> mc.ModelConfig | None:
        """The model's config.pbtxt, or None when it has none."""
        try:
            text = source.config_path.read_text()
        except FileNotFoundError:
            return None
        return cfg.parse_text(text, source.name)

    def write_upload(self, name: str, files: dict[str, bytes]) -> ModelSource:
        """Materialise ``file:<path>`` load parameters as a private model folder."""
        check_model_name(name)
        root = self._uploads / name
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
        for relative, content in files.items():
            target = (root / relative).resolve()
            if not target.is_relative_to(root.resolve()) or target == root.resolve():
                raise InvalidArgumentError(
                    f"load of model '{name}': file path 'file:{relative}' escapes the model folder"
                )
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
        return ModelSource(name, root)

    def close(self) -> None:
        for mirror in self._mirrors.values():
            mirror.close()
        shutil.rmtree(self._uploads, ignore_errors=True)
