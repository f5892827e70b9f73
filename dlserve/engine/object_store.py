"""Model repositories in Amazon S3 or an S3-compatible store, served from a local mirror.

Triton's URL forms are accepted: ``s3://bucket/path``, and for a private endpoint
(MinIO, Ceph, R2, ...) ``s3://host:port/bucket/path`` (HTTP) or
``s3://https://host:port/bucket/path``. Credentials come from boto3's usual chain
(``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``,
``AWS_PROFILE``, ``~/.aws``, instance roles; region ``AWS_DEFAULT_REGION``), or from
the file ``TRITON_CLOUD_CREDENTIAL_PATH`` names, as in Triton: its ``"s3"`` entry whose
key is the longest start of the URL.

The store is listed, not downloaded, to learn which models exist and whether they
changed (each object's ETag and size); a model's files are downloaded when it is loaded,
into a private folder (under ``TRITON_AWS_MOUNT_DIRECTORY`` when set) that is removed
at stop. Only new and changed objects are fetched again, each to a temporary name and
then renamed, so a process reading the folder never sees half a file; files whose
object is gone are removed. The rest of the engine reads that folder as an ordinary
local model folder.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path, PurePosixPath
from typing import Any

from dlserve.errors import InvalidArgumentError, TritonError, UnavailableError

log = logging.getLogger("dlserve.engine")

SCHEME = "s3://"
MOUNT_DIRECTORY_VARIABLE = "TRITON_AWS_MOUNT_DIRECTORY"
CREDENTIAL_FILE_VARIABLE = "TRITON_CLOUD_CREDENTIAL_PATH"
_ENDPOINT = re.compile(r"^[0-9A-Za-z.\-]+:[0-9]+$")

# One model's objects: (path inside the model folder, ETag, size), sorted.
Stamps = tuple[tuple[str, str, int], ...]


def is_remote(path: str | os.PathLike[str]) -> bool:
    return str(path).startswith(SCHEME)


@dataclasses.dataclass(frozen=True)
class S3Location:
    """Where a repository is: ``endpoint`` (None for AWS itself), bucket and key prefix
    (empty, or ending in ``/``)."""

    url: str
    bucket: str
    prefix: str
    endpoint: str | None = None

    @classmethod
    def parse(cls, url: str) -> S3Location:
        rest = url.removeprefix(SCHEME)
        scheme = ""
        for candidate in ("https://", "http://"):
            if rest.startswith(candidate):
                scheme, rest = candidate, rest[len(candidate) :]
        parts = [part for part in rest.split("/") if part]
        endpoint = None
        if parts and _ENDPOINT.match(parts[0]):
            endpoint = (scheme or "http://") + parts.pop(0)
        elif scheme:
            raise InvalidArgumentError(
                f"model repository '{url}': an endpoint needs a port, as in "
                "s3://https://host:port/bucket/path"
            )
        if not parts:
            raise InvalidArgumentError(f"model repository '{url}': no bucket name in the path")
        prefix = "/".join(parts[1:])
        return cls(url, parts[0], prefix + "/" if prefix else "", endpoint)


def credentials_for(url: str, environ: Any = os.environ) -> dict[str, str]:
    """boto3 session arguments for ``url`` from Triton's credential file, if one is named;
    empty (boto3's own chain) otherwise."""
    path = environ.get(CREDENTIAL_FILE_VARIABLE)
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as file:
            entries = json.load(file).get("s3", {})
        matches = [key for key in entries if url.startswith(key)]
        entry = entries[max(matches, key=len)] if matches else {}
        if not isinstance(entry, dict):
            raise TypeError(f"its entry for '{max(matches, key=len)}' is not an object")
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        raise InvalidArgumentError(
            f"cannot read the cloud credential file '{path}': {exc}"
        ) from None
    arguments = {}
    if entry.get("key_id") and entry.get("secret_key"):
        arguments["aws_access_key_id"] = entry["key_id"]
        arguments["aws_secret_access_key"] = entry["secret_key"]
        if entry.get("session_token"):
            arguments["aws_session_token"] = entry["session_token"]
    elif entry.get("profile"):
        arguments["profile_name"] = entry["profile"]
    if entry.get("region"):
        arguments["region_name"] = entry["region"]
    return arguments


def _client(location: S3Location) -> Any:
    try:
        import boto3
        from botocore import UNSIGNED
        from botocore.config import Config
    except ImportError:
        raise UnavailableError(
            f"model repository '{location.url}': s3:// repositories need boto3 "
            "(pip install 'dlserve[s3]')"
        ) from None
    try:
        session = boto3.session.Session(**credentials_for(location.url))
        credentials = session.get_credentials()
    except TritonError:
        raise
    except Exception as exc:  # noqa: BLE001 - botocore's errors (an unknown profile...)
        raise InvalidArgumentError(f"model repository '{location.url}': {exc}") from None
    # With no credentials anywhere, requests go unsigned: a public bucket still serves.
    unsigned = {} if credentials is not None else {"signature_version": UNSIGNED}
    return session.client(
        "s3",
        endpoint_url=location.endpoint,
        # Without a region, signing for a private endpoint would fail.
        region_name=session.region_name or "us-east-1",
        config=Config(
            s3={"addressing_style": "path"}, connect_timeout=10, read_timeout=60, **unsigned
        ),
    )


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


class S3Mirror:
    """One s3:// repository and its local folder.

    ``refresh`` and ``fetch`` may run on several threads at once (one download per
    model at a time, never holding up a listing), ``listing`` is read from any: it is
    replaced whole, never changed in place, and an entry is only ever replaced by one
    listed later.
    """

    def __init__(self, url: str) -> None:
        self.location = S3Location.parse(url)
        mount = os.environ.get(MOUNT_DIRECTORY_VARIABLE) or None
        if mount is not None and not os.path.isdir(mount):
            raise InvalidArgumentError(f"{MOUNT_DIRECTORY_VARIABLE} '{mount}' is not a directory")
        self._client = _client(self.location)  # makes no request yet
        self.root = Path(tempfile.mkdtemp(prefix="dlserve-s3-", dir=mount))
        self.listing: dict[str, Stamps] = {}  # model -> its objects, as last listed
        self._listed_at: dict[str, int] = {}  # model -> the generation of its entry
        self._generations = itertools.count(1)  # a listing's, taken when it starts
        self._fetched: dict[str, tuple[str, int]] = {}  # local relative path -> (ETag, size)
        self._lock = threading.Lock()  # the listing
        self._downloads: dict[str, threading.Lock] = {}  # per model
        self._closed = False

    @property
    def url(self) -> str:
        return self.location.url

    def _list(self, model: str | None) -> tuple[int, dict[str, Stamps]]:
        """Every model's objects (only ``model``'s, if given), and the listing's generation."""
        generation = next(self._generations)
        location = self.location
        scope = location.prefix + (f"{model}/" if model else "")
        found: dict[str, list[tuple[str, str, int]]] = {}
        try:
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=location.bucket, Prefix=scope):
                for entry in page.get("Contents", ()):
                    relative = entry["Key"][len(location.prefix) :]
                    name, _, inside = relative.partition("/")
                    if not inside or inside.endswith("/"):
                        continue  # a file beside the models, or a folder marker
                    if model_file(name, inside) is None:
                        log.warning(
                            "model repository '%s': ignoring object '%s'", self.url, entry["Key"]
                        )
                        continue
                    found.setdefault(name, []).append((inside, entry["ETag"], entry["Size"]))
        except Exception as exc:  # noqa: BLE001 - botocore's errors have no common base
            raise ObjectStoreError(
                f"model repository '{self.url}': cannot list it: {_reason(exc)}"
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
                self._download(self.location.prefix + f"{model}/{inside}", target)
                self._fetched[relative] = (etag, size)
        if objects:
            self._remove_stale(model, wanted)

    def _download(self, key: str, target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=".dlserve-")
        os.close(handle)
        try:
            self._client.download_file(self.location.bucket, key, temporary)
            os.replace(temporary, target)
        except Exception as exc:  # noqa: BLE001 - botocore's errors have no common base
            os.unlink(temporary)
            if isinstance(exc, OSError):
                raise
            raise ObjectStoreError(
                f"model repository '{self.url}': cannot download '{key}': {_reason(exc)}"
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
        self._client.close()  # its pooled connections
        shutil.rmtree(self.root, ignore_errors=True)


def _reason(exc: Exception) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and "Error" in response:
        error = response["Error"]
        return f"{error.get('Code', '')}: {error.get('Message', '')}".strip(": ")
    return str(exc) or type(exc).__name__


__all__ = ["ObjectStoreError", "S3Location", "S3Mirror", "credentials_for", "is_remote", "model_file"]
