"""Model repositories in an object store (S3, Google Cloud Storage, Azure), served from a
local mirror.

The store is listed, not downloaded, to learn which models exist and whether they
changed (each object's ETag and size); a model's files are downloaded when it is loaded,
into a private folder (under the store's ``TRITON_AWS_MOUNT_DIRECTORY``,
``TRITON_GCS_MOUNT_DIRECTORY`` or ``TRITON_AZURE_MOUNT_DIRECTORY`` when set) that is removed at stop. Only new and changed objects are fetched again, each
to a temporary name and then renamed, so a process reading the folder never sees half a
file; files whose object is gone are removed. The rest of the engine reads that folder
as an ordinary local model folder. The stores themselves: :mod:`cloud_stores`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path, PurePosixPath

from dlserve.engine.cloud_stores import error_reason, is_remote, open_store
from dlserve.errors import InvalidArgumentError, UnavailableError

log = logging.getLogger("dlserve.engine")

# One model's objects: (path inside the model folder, ETag, size), sorted.
Stamps = tuple[tuple[str, str, int], ...]


def model_file(model: str, inside: str) -> PurePosixPath | None:
    """The path of an object inside its model folder, or None for one that would not
    stay there (``..``, empty or dot segments): such objects are never downloaded."""
    parts = inside.split("/")
    if not model or model.startswith(".") or any(p in ("", ".", "..") for p in parts):
        return None
    return PurePosixPath(model, *parts)


class ObjectStoreError(UnavailableError):
    """The store could not be listed or read, or its objects not written here: worth
    trying again later, unlike a model that failed to load."""


class StoreMirror:
    """One object-store repository and its local folder.

    ``refresh`` and ``fetch`` may run on several threads at once (one download per
    model at a time, never holding up a listing), ``listing`` is read from any: it is
    replaced whole, never changed in place, and an entry is only ever replaced by one
    listed later.
    """

    def __init__(self, url: str) -> None:
        self._store = open_store(url)  # makes no request yet
        variable = self._store.mount_variable
        mount = os.environ.get(variable) or None
        if mount is not None and not os.path.isdir(mount):
            self._store.close()
            raise InvalidArgumentError(f"{variable} '{mount}' is not a directory")
        self.root = Path(tempfile.mkdtemp(prefix=f"dlserve-{url[:2]}-", dir=mount))
        self.listing: dict[str, Stamps] = {}  # model -> its objects, as last listed
        self._listed_at: dict[str, int] = {}  # model -> the generation of its entry
        self._generations = itertools.count(1)  # a listing's, taken when it starts
        self._fetched: dict[str, tuple[str, int]] = {}  # local relative path -> (ETag, size)
        self._lock = threading.Lock()  # the listing
        self._downloads: dict[str, threading.Lock] = {}  # per model
        self._closed = False

    @property
    def url(self) -> str:
        return self._store.url

    def _list(self, model: str | None) -> tuple[int, dict[str, Stamps]]:
        """Every model's objects (only ``model``'s, if given), and the listing's generation."""
        generation = next(self._generations)
        prefix = self._store.prefix
        found: dict[str, list[tuple[str, str, int]]] = {}
        try:
            for key, etag, size in self._store.list(prefix + (f"{model}/" if model else "")):
                name, _, inside = key[len(prefix) :].partition("/")
                if not inside or inside.endswith("/"):
                    continue  # a file beside the models, or a folder marker
                if model_file(name, inside) is None:
                    log.warning("model repository '%s': ignoring object '%s'", self.url, key)
                    continue
                found.setdefault(name, []).append((inside, etag, size))
        except Exception as exc:  # noqa: BLE001 - the clients' errors have no common base
            raise ObjectStoreError(
                f"model repository '{self.url}': cannot list it: {error_reason(exc)}"
            ) from None
        return generation, {name: tuple(sorted(objects)) for name, objects in found.items()}

    def _publish(self, generation: int, found: dict[str, Stamps], model: str | None) -> None:
        """Take what a listing found into ``listing``, except where a later one was taken."""
        with self._lock:
            listing, listed_at = dict(self.listing), dict(self._listed_at)
            names = {model} if model is not None else set(listing) | set(found)
            for name in names:
                if listed_at.get(name, 0) > generation:
                    continue
                listed_at[name] = generation
                if name in found:
                    listing[name] = found[name]
                else:
                    listing.pop(name, None)
            self.listing, self._listed_at = listing, listed_at

    def refresh(self) -> None:
        """List the whole repository (no download)."""
        self._publish(*self._list(None), None)

    def fetch(self, model: str) -> None:
        """List ``model`` again and bring its local folder up to date with it. A model
        gone from the store is no longer listed, but its folder stays (until the stop)
        for the versions still loaded: a worker restarted after a crash needs it."""
        generation, found = self._list(model)
        objects = found.get(model, ())
        with self._lock:
            download = self._downloads.setdefault(model, threading.Lock())
        with download:
            try:
                self._bring(model, objects)
            except OSError as exc:  # a key that is also a folder, a name too long here...
                raise ObjectStoreError(
                    f"model repository '{self.url}': cannot write the files of model "
                    f"'{model}' here: {exc}"
                ) from None
            finally:
                if self._closed:  # stopped meanwhile: what was written goes too
                    shutil.rmtree(self.root, ignore_errors=True)
        self._publish(generation, found, model)

    def _bring(self, model: str, objects: Stamps) -> None:
        wanted = set()
        for inside, etag, size in objects:
            relative = str(model_file(model, inside))
            wanted.add(relative)
            target = self.root / relative
            if self._fetched.get(relative) != (etag, size) or not target.is_file():
                if self._closed:
                    return
                self._download(self._store.prefix + f"{model}/{inside}", target)
                self._fetched[relative] = (etag, size)
        if objects:
            self._remove_stale(model, wanted)

    def _download(self, key: str, target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=".dlserve-")
        os.close(handle)
        try:
            self._store.download(key, temporary)
            os.replace(temporary, target)
        except Exception as exc:  # noqa: BLE001 - the clients' errors have no common base
            with contextlib.suppress(FileNotFoundError):  # Google's client removes it itself
                os.unlink(temporary)
            if isinstance(exc, OSError):
                raise
            raise ObjectStoreError(
                f"model repository '{self.url}': cannot download '{key}': {error_reason(exc)}"
            ) from None

    def _remove_stale(self, model: str, wanted: set[str]) -> None:
        folder = self.root / model
        for root, _dirs, files in os.walk(folder, topdown=False):
            if "__pycache__" in Path(root).relative_to(self.root).parts:
                continue  # written by the model's own imports
            for name in files:
                path = Path(root, name)
                relative = str(path.relative_to(self.root))
                if relative not in wanted:
                    path.unlink()
                    self._fetched.pop(relative, None)
            if not any(Path(root).iterdir()):
                Path(root).rmdir()

    def close(self) -> None:
        """Remove the folder; a fetch still running removes what it writes after."""
        self._closed = True
        self._store.close()
        shutil.rmtree(self.root, ignore_errors=True)


__all__ = ["ObjectStoreError", "Stamps", "StoreMirror", "is_remote", "model_file"]
