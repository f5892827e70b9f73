"""Model repositories: Triton's layout, version folders and version policy.

``<repository>/<model>/config.pbtxt`` and ``<repository>/<model>/<version>/model.py``;
with a model config name ``<n>`` (``--model-config-name``), ``<model>/configs/<n>.pbtxt``
where a model has it. Repositories may be added and removed while the server runs
(``Server.register_model_repository``), a folder optionally served under another
name. Only names found by listing the repositories can be loaded, so a model name from a
request can never reach outside them; files uploaded with a load request are
written under a private folder after the same check on every path. A repository
may be an ``s3://``, ``gs://`` or ``as://`` URL: its models are read from a local
mirror (object_store).

With model namespacing (``--model-namespacing``) each repository is a namespace,
named by the repository as given, and the same model name may appear in several:
a model is then told apart by its :data:`ModelKey`.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from dlserve.engine import config_forms
from dlserve.engine.object_store import ObjectStoreError, Stamps, StoreMirror, is_remote
from dlserve.engine.proto import model_config_pb2 as mc
from dlserve.errors import AlreadyExistsError, InternalError, InvalidArgumentError, NotFoundError

log = logging.getLogger("dlserve.engine")

CONFIG_FILE = "config.pbtxt"
CUSTOM_CONFIGS = "configs"  # <model>/configs/<name>.pbtxt: the config --model-config-name picks
WARMUP_FOLDER = "warmup"  # <model>/warmup/<file>: model_warmup's input_data_file
_MODEL_FOLDERS = (CUSTOM_CONFIGS, WARMUP_FOLDER)  # a model's folders that are not versions

# (namespace, model name); the namespace is "" unless model namespacing is on.
ModelKey = tuple[str, str]


class UploadFolder:
    """The folder one load's uploaded files were written to, removed when nothing uses
    it any more: that load, then each version loaded from it (until it unloads), hold it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._users = 1  # (the load that wrote it)

    def hold(self) -> None:
        self._users += 1

    def release(self) -> None:
        self._users -= 1
        if not self._users:
            shutil.rmtree(self.path, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a model's files are."""

    name: str
    path: Path
    # For a model in an s3:// repository: its objects as last listed (its fingerprint);
    # ``path`` holds its files once fetched.
    stamps: Stamps | None = None
    # Served under a name its repository's registration gave it (not its folder's):
    # its config's ``name`` becomes that name, as in Triton.
    renamed: bool = False
    # Its repository as given, with model namespacing on ("" otherwise).
    namespace: str = ""
    # For a model from files uploaded with its load: their folder.
    upload: UploadFolder | None = None

    @property
    def key(self) -> ModelKey:
        return (self.namespace, self.name)

    def config_path(self, config_name: str = "") -> Path:
        """Its ``configs/<config_name>.pbtxt`` if it has one, else its config.pbtxt."""
        if config_name:
            custom = self.path / CUSTOM_CONFIGS / f"{config_name}.pbtxt"
            if custom.is_file():
                return custom
        return self.path / CONFIG_FILE

    def versions_on_disk(self) -> list[int]:
        """Numeric version folders, ascending; other folders (and numbers with leading
        zeros, as Triton's) are ignored with a warning."""
        versions = []
        for entry in sorted(os.scandir(self.path), key=lambda e: e.name):
            if not entry.is_dir() or entry.name in _MODEL_FOLDERS:
                continue
            why = _why_not_a_version(entry.name)
            if why:
                log.warning("model '%s': ignoring folder '%s', %s", self.name, entry.name, why)
            else:
                versions.append(int(entry.name))
        return sorted(versions)

    @functools.cached_property
    def fingerprint(self) -> tuple[tuple[str, Any, int], ...]:
        """Changes when any file of the model changes (used by poll mode): a file's time
        and size, but a config's content, so that a config rewritten unchanged (a sync
        tool, ``touch``) reloads nothing, as in Triton. Read once per source (a scan's
        finding): a load keeps what was read before it, so that a file changed while the
        model loaded still counts as a change at the next poll."""
        if self.stamps is not None:
            return self.stamps
        stamps = []
        for root, _dirs, files in os.walk(self.path):
            if "__pycache__" in root:
                continue
            for name in files:
                path = os.path.join(root, name)
                st = os.stat(path)
                if name.endswith(".pbtxt"):
                    with open(path, "rb") as config:
                        stamps.append((path, hashlib.sha256(config.read()).hexdigest(), st.st_size))
                else:
                    stamps.append((path, st.st_mtime_ns, st.st_size))
        return tuple(sorted(stamps))


def _why_not_a_version(folder: str) -> str:
    """Why a model's folder is not a version folder ("" when it is one)."""
    if not (folder.isascii() and folder.isdigit()):
        return "version folders must be numbers"
    if folder != str(int(folder)):
        return "version folders have no leading zeros"
    return ""


def log_missing_versions(name: str, policy: mc.ModelVersionPolicy, on_disk: list[int]) -> None:
    """Log (at error level, as Triton) each version a ``specific`` policy names that has
    no folder; the others load."""
    for version in policy.specific.versions:
        if version not in on_disk:
            log.error(
                "model '%s': its version policy names version %d, which has no version folder",
                name,
                version,
            )


def select_versions(policy: mc.ModelVersionPolicy, available: list[int]) -> list[int]:
    choice = policy.WhichOneof("policy_choice")
    if choice == "all":
        return list(available)
    if choice == "specific":
        return [v for v in policy.specific.versions if v in available]
    count = policy.latest.num_versions if choice == "latest" else 1
    return sorted(available)[-count:] if count > 0 else []  # (0: none, as Triton has it)


_MODEL_CLASS = "TritonPythonModel"


def may_define_auto_complete(model_file: Path) -> bool:
    """Whether ``TritonPythonModel`` may have ``auto_complete_config``, read without importing.

    Triton runs the hook of every model; reading the file saves a throwaway worker for
    the (common) models that plainly have none: a class of that name with no base but
    ``object``, no decorator or metaclass, nothing of that name in its body, and not
    changed or bound otherwise in the file. Anything else (a base class, an import of
    the class, a star import) may bring the hook, so the worker asks the class. A file
    that does not parse, or has no such class, is left for the instance's worker to
    report, after the config has been checked.
    """
    try:
        tree = ast.parse(model_file.read_text())
    except (OSError, SyntaxError, ValueError):
        return False
    classes = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == _MODEL_CLASS:
            classes.append(node)
        elif _binds_model_class(node):
            return True
    return any(_class_may_define_auto_complete(node) for node in classes)


def _binds_model_class(node: ast.AST) -> bool:
    """Whether ``node`` binds or changes the model class other than by a plain class
    statement: an import of it, a star import, an assignment to it or to its attributes,
    or a ``setattr`` on it."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        names = [alias.asname or alias.name for alias in node.names]
        return "*" in names or _MODEL_CLASS in names
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        return node.id == _MODEL_CLASS
    if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
        return isinstance(node.value, ast.Name) and node.value.id == _MODEL_CLASS
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
        target = node.args[0] if node.args else None
        return isinstance(target, ast.Name) and target.id == _MODEL_CLASS
    return False


def _class_may_define_auto_complete(node: ast.ClassDef) -> bool:
    plain_bases = all(isinstance(base, ast.Name) and base.id == "object" for base in node.bases)
    if node.decorator_list or node.keywords or not plain_bases:
        return True
    for item in ast.walk(node):
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if item.name == "auto_complete_config":
                return True
        elif isinstance(item, ast.Name) and item.id == "auto_complete_config":
            return True  # assigned in the body, or any other mention: let the worker ask
    return False


def check_model_name(name: str) -> None:
    """Reject names that are not a single, plain folder name (Triton's rules)."""
    if not name or name != name.strip():
        raise InvalidArgumentError(f"model name '{name}' is empty or has surrounding spaces")
    if "/" in name or "\\" in name or name in (".", "..") or "\0" in name:
        raise InvalidArgumentError(f"model name '{name}' must not contain path traversal characters")


class Repository:
    """One or more repositories, searched in order; model names must be unique, or,
    with ``namespacing``, unique within each repository.

    An object-store repository is listed by :meth:`refresh` and a model's files are
    downloaded by :meth:`fetch`; both block on the network, so the engine runs them
    on a thread. :meth:`scan` and :meth:`find` never touch the network. The set of
    repositories changes on the engine's loop only (the network part of registering
    a remote one, :meth:`open_remote`, runs first, changing nothing); the threads read
    snapshots of it.
    """

    def __init__(self, paths: list[str | Path], config_name: str = "", namespacing: bool = False) -> None:
        if config_name and ("/" in config_name or "\\" in config_name or config_name in (".", "..")):
            raise InvalidArgumentError(
                f"model config name '{config_name}' must be a file name (it names configs/<name>.pbtxt)"
            )
        self.config_name = config_name
        self.namespacing = namespacing
        self.paths: list[Path] = []
        self._mirrors: dict[Path, StoreMirror] = {}  # local root -> its s3:// repository
        self._keys: dict[str, Path] = {}  # a repository as named (normalised) -> its root
        self._renames: dict[Path, dict[str, str]] = {}  # root -> {folder: model name}
        self._namespaces: dict[Path, str] = {}  # root -> the repository as given (Triton's namespace)
        self._retired: list[StoreMirror] = []  # unregistered remote repositories
        try:
            for path in paths:
                self._add(path)
        except BaseException:
            for mirror in self._mirrors.values():
                mirror.close()
            raise
        # made on the first load with files, so that a server that never takes one
        # (or dies before its stop) leaves nothing in the temp folder
        self._uploads: Path | None = None

    @staticmethod
    def _key(path: str | Path) -> str:
        """How a repository is told apart: its URL (trailing slashes aside), or its
        folder's real path."""
        return str(path).rstrip("/") if is_remote(path) else str(Path(path).expanduser().resolve())

    @staticmethod
    def open_remote(path: str) -> StoreMirror:
        """A remote repository, listed (blocking), for :meth:`register`."""
        mirror = StoreMirror(path)
        try:
            mirror.refresh()
        except ObjectStoreError as exc:
            mirror.close()
            raise InvalidArgumentError(f"failed to register '{path}': {exc.message}") from None
        return mirror

    def _add(self, path: str | Path, mirror: StoreMirror | None = None) -> Path:
        """Add a repository last (a remote one as ``mirror``, if opened already)."""
        if is_remote(path):
            mirror = mirror or StoreMirror(str(path))
            self._mirrors[mirror.root] = mirror
            root = mirror.root
        else:
            if "://" in str(path):
                raise InvalidArgumentError(
                    f"model repository '{path}': only local folders and s3://, gs:// "
                    "and as:// URLs are supported"
                )
            root = Path(path).expanduser().resolve()
            if not root.exists():  # (Triton's words and code)
                raise InternalError(f"failed to stat file {path}")
            if not root.is_dir():
                raise InvalidArgumentError(f"model repository '{path}' is not a directory")
        self.paths.append(root)
        self._keys[self._key(path)] = root
        self._namespaces[root] = str(path)
        return root

    def register(
        self, path: str, name_mapping: dict[str, str] | None = None, mirror: StoreMirror | None = None
    ) -> None:
        """Add a repository while serving (a remote one opened by :meth:`open_remote`);
        ``name_mapping`` serves some of its folders under other names ({folder: model
        name}). Triton's checks and messages."""
        key = self._key(path)
        if key in self._keys:
            raise AlreadyExistsError(f"model repository '{path}' has already been registered")
        mapping = dict(name_mapping or {})
        taken = {name for renames in self._renames.values() for name in renames.values()}
        for folder, name in mapping.items():
            check_model_name(folder)
            check_model_name(name)
            if name in taken or list(mapping.values()).count(name) > 1:
                raise AlreadyExistsError(
                    f"failed to register '{name}', there is a conflicting mapping for '{name}'"
                )
        if is_remote(path) and mirror is None:
            raise InvalidArgumentError(f"failed to register '{path}': open it with open_remote first")
        try:
            root = self._add(path, mirror)
        except (InvalidArgumentError, InternalError):
            raise InvalidArgumentError(f"failed to register '{path}', repository not found") from None
        if mapping:
            self._renames[root] = mapping
        log.info("Model repository registered: %s", path)

    def unregister(self, path: str) -> None:
        """Remove a repository (its loaded models keep serving until unloaded)."""
        root = self._keys.get(self._key(path))
        if root is None:
            raise InvalidArgumentError(f"failed to unregister '{path}', repository not found")
        mirror = self._drop(root)
        if mirror is not None:  # its models' files stay until the stop: loaded ones may restart
            self._retired.append(mirror)
        log.info("Model repository unregistered: %s", path)

    def _drop(self, root: Path) -> StoreMirror | None:
        """Forget a repository; its mirror, if remote, is the caller's to close."""
        self.paths.remove(root)
        self._keys = {key: r for key, r in self._keys.items() if r != root}
        self._renames.pop(root, None)
        self._namespaces.pop(root, None)
        return self._mirrors.pop(root, None)

    @property
    def remote(self) -> bool:
        """Whether any repository is remote (refresh and fetch do network I/O)."""
        return bool(self._mirrors)

    def scan(self) -> dict[ModelKey, ModelSource | str]:
        """Every model folder by key; a key found twice (a name in two repositories,
        without namespacing) maps to an error."""
        found: dict[ModelKey, ModelSource | str] = {}
        for repo in tuple(self.paths):
            # (.get: a thread's snapshot may hold a repository unregistered meanwhile)
            namespace = self._namespaces.get(repo, str(repo)) if self.namespacing else ""
            mirror = self._mirrors.get(repo)
            if mirror is not None:
                listing = sorted(mirror.listing.items())
                sources = [ModelSource(name, repo / name, stamps, namespace=namespace) for name, stamps in listing]
            else:
                sources = [
                    ModelSource(entry.name, Path(entry.path), namespace=namespace)
                    for entry in sorted(os.scandir(repo), key=lambda e: e.name)
                    if entry.is_dir() and not entry.name.startswith(".")
                ]
            renames = self._renames.get(repo)
            if renames:
                sources = [
                    dataclasses.replace(s, name=renames[s.name], renamed=True) if s.name in renames else s
                    for s in sources
                ]
            for source in sources:
                if source.key in found:
                    found[source.key] = (
                        f"model '{source.name}' appears in more than one model repository"
                    )
                else:
                    found[source.key] = source
        return found

    def refresh(self) -> None:
        """List the remote repositories again (blocking)."""
        for mirror in tuple(self._mirrors.values()):
            mirror.refresh()

    def fetch(self, name: str) -> list[ModelSource]:
        """:meth:`find`, after bringing the model's files from remote repositories up
        to date (blocking)."""
        check_model_name(name)
        for root, mirror in tuple(self._mirrors.items()):  # (the loop may change it meanwhile)
            renames = self._renames.get(root, {})
            mirror.fetch(next((folder for folder, n in renames.items() if n == name), name))
        return self.find(name)

    def fetch_source(self, source: ModelSource) -> ModelSource:
        """``source`` as it is now, its files brought up to date if it is in a remote
        repository (blocking)."""
        mirror = self._mirrors.get(source.path.parent)
        if mirror is None:
            return source
        mirror.fetch(source.path.name)
        found = self.scan().get(source.key)
        if not isinstance(found, ModelSource):
            raise NotFoundError(f"failed to load '{source.name}', failed to poll from model repository")
        return found

    def find(self, name: str) -> list[ModelSource]:
        """The models of this name: one, or with namespacing one per repository that has it."""
        entries = [entry for (_, found), entry in self.scan().items() if found == name]
        if not entries:
            raise NotFoundError(
                f"failed to load '{name}', failed to poll from model repository"
            )
        for entry in entries:
            if isinstance(entry, str):
                raise InvalidArgumentError(entry)
        return [entry for entry in entries if isinstance(entry, ModelSource)]

    def read_config(self, source: ModelSource) -> mc.ModelConfig | None:
        """The model's config (see :meth:`ModelSource.config_path`), or None when it has none."""
        path = source.config_path(self.config_name)
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        return config_forms.parse_text(text, source.name, path.relative_to(source.path).as_posix())

    def write_upload(self, name: str, files: dict[str, bytes]) -> ModelSource:
        """Materialise ``file:<path>`` load parameters as a private model folder: a new
        one for each load, as Triton's, so that a version loaded from earlier ones keeps
        its files. The caller holds its ``upload`` (see :class:`UploadFolder`)."""
        check_model_name(name)
        if self._uploads is None:
            self._uploads = Path(tempfile.mkdtemp(prefix="dlserve-uploads-"))
        folder = Path(tempfile.mkdtemp(dir=self._uploads))
        root = folder / name
        try:
            root.mkdir()
            for relative, content in files.items():
                target = (root / relative).resolve()
                if not target.is_relative_to(root.resolve()) or target == root.resolve():
                    raise InvalidArgumentError(
                        f"load of model '{name}': file path 'file:{relative}' escapes the "
                        "model folder"
                    )
                try:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(content)
                except OSError as exc:  # (a name too long, ...: said without the server's paths)
                    raise InvalidArgumentError(
                        f"load of model '{name}': invalid file path 'file:{relative}': "
                        f"{exc.strerror}"
                    ) from None
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return ModelSource(name, root, upload=UploadFolder(folder))

    def close(self) -> None:
        for mirror in [*self._mirrors.values(), *self._retired]:
            mirror.close()
        if self._uploads is not None:
            shutil.rmtree(self._uploads, ignore_errors=True)
            self._uploads = None
