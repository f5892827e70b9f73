"""The object stores a model repository may live in, behind one small interface.

Amazon S3 and S3-compatible stores (boto3) and Google Cloud Storage
(google-cloud-storage), with Triton's URL forms and credentials:

- ``s3://bucket/path``; a private endpoint (MinIO, Ceph, R2, ...) as
  ``s3://host:port/bucket/path`` (HTTP) or ``s3://https://host:port/bucket/path``.
  Credentials from boto3's usual chain (``AWS_ACCESS_KEY_ID`` /
  ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, ``~/.aws``,
  instance roles; region ``AWS_DEFAULT_REGION``).
- ``gs://bucket/path``. Credentials from Google's application default credentials
  (``GOOGLE_APPLICATION_CREDENTIALS``, the metadata server, gcloud's login).
- ``as://account/container/path`` (Azure Blob Storage). The account key from
  ``AZURE_STORAGE_KEY``; beyond Triton, ``AZURE_STORAGE_CONNECTION_STRING`` when set (its
  endpoint and key: sovereign clouds, Azurite).

Or, for each, from the file ``TRITON_CLOUD_CREDENTIAL_PATH`` names, as in Triton: its
``"s3"``, ``"gs"`` or ``"as"`` entry whose key is the longest start of the URL (for ``gs``
the path of a service-account key file, for ``as`` ``account_str`` and ``account_key``).
With no credentials at all, requests go unsigned, so a public bucket still serves.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from dlserve.errors import InvalidArgumentError, TritonError, UnavailableError

log = logging.getLogger("dlserve.engine")

CREDENTIAL_FILE_VARIABLE = "TRITON_CLOUD_CREDENTIAL_PATH"
_ENDPOINT = re.compile(r"^[0-9A-Za-z.\-]+:[0-9]+$")


class Store(Protocol):
    """One repository's store: its objects' keys start with ``prefix``."""

    url: str
    prefix: str  # empty, or ending in "/"
    mount_variable: str  # where Triton lets the local copy go

    def list(self, prefix: str) -> Iterator[tuple[str, str, int]]:
        """Every object under ``prefix``: (key, ETag, size). Raises the client's errors."""
        ...

    def download(self, key: str, path: str) -> None: ...

    def close(self) -> None: ...


def is_remote(path: str | os.PathLike[str]) -> bool:
    return str(path).startswith(("s3://", "gs://", "as://"))


def open_store(url: str) -> Store:
    """The store of an ``s3://``, ``gs://`` or ``as://`` repository URL (no request made)."""
    if url.startswith("gs://"):
        return GcsStore(url)
    if url.startswith("as://"):
        return AzureStore(url)
    return S3Store(S3Location.parse(url))


@dataclasses.dataclass(frozen=True)
class S3Location:
    """Where an s3:// repository is: ``endpoint`` (None for AWS itself), bucket and key
    prefix (empty, or ending in ``/``)."""

    url: str
    bucket: str
    prefix: str
    endpoint: str | None = None

    @classmethod
    def parse(cls, url: str) -> S3Location:
        rest = url.removeprefix("s3://")
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
        bucket, prefix = _bucket_and_prefix(url, parts)
        return cls(url, bucket, prefix, endpoint)


def _bucket_and_prefix(url: str, parts: list[str]) -> tuple[str, str]:
    if not parts:
        raise InvalidArgumentError(f"model repository '{url}': no bucket name in the path")
    prefix = "/".join(parts[1:])
    return parts[0], prefix + "/" if prefix else ""


def credential_entry(url: str, section: str, environ: Mapping[str, str] = os.environ) -> Any:
    """The entry of Triton's credential file for ``url`` (the longest key it starts
    with) in ``section`` ("s3", "gs"); None when no file is named or no key matches."""
    path = environ.get(CREDENTIAL_FILE_VARIABLE)
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as file:
            entries = json.load(file).get(section, {})
        matches = [key for key in entries if url.startswith(key)]
        return entries[max(matches, key=len)] if matches else None
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        raise InvalidArgumentError(
            f"cannot read the cloud credential file '{path}': {exc}"
        ) from None


def credentials_for(url: str, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """boto3 session arguments for an s3:// ``url`` from Triton's credential file; empty
    (boto3's own chain) when it names none."""
    entry = credential_entry(url, "s3", environ)
    if entry is None:
        return {}
    if not isinstance(entry, dict):
        path = environ.get(CREDENTIAL_FILE_VARIABLE)
        raise InvalidArgumentError(
            f"cannot read the cloud credential file '{path}': its s3 entry for '{url}' is "
            "not an object"
        )
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


class S3Store:
    mount_variable = "TRITON_AWS_MOUNT_DIRECTORY"

    def __init__(self, location: S3Location) -> None:
        self.url, self.prefix, self._bucket = location.url, location.prefix, location.bucket
        try:
            import boto3
            from botocore import UNSIGNED
            from botocore.config import Config
        except ImportError:
            raise UnavailableError(
                f"model repository '{self.url}': s3:// repositories need boto3 "
                "(pip install 'dlserve[s3]')"
            ) from None
        try:
            session = boto3.session.Session(**credentials_for(self.url))
            credentials = session.get_credentials()
        except TritonError:
            raise
        except Exception as exc:  # noqa: BLE001 - botocore's errors (an unknown profile...)
            raise InvalidArgumentError(f"model repository '{self.url}': {exc}") from None
        unsigned = {} if credentials is not None else {"signature_version": UNSIGNED}
        self._client = session.client(
            "s3",
            endpoint_url=location.endpoint,
            # Without a region, signing for a private endpoint would fail.
            region_name=session.region_name or "us-east-1",
            config=Config(
                s3={"addressing_style": "path"}, connect_timeout=10, read_timeout=60, **unsigned
            ),
        )

    def list(self, prefix: str) -> Iterator[tuple[str, str, int]]:
        paginator = self._client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self._bucket, Prefix=prefix):
            for entry in page.get("Contents", ()):
                yield entry["Key"], entry["ETag"], entry["Size"]

    def download(self, key: str, path: str) -> None:
        self._client.download_file(self._bucket, key, path)

    def close(self) -> None:
        self._client.close()  # its pooled connections


class GcsStore:
    mount_variable = "TRITON_GCS_MOUNT_DIRECTORY"

    def __init__(self, url: str) -> None:
        self.url = url
        parts = [part for part in url.removeprefix("gs://").split("/") if part]
        self._bucket, self.prefix = _bucket_and_prefix(url, parts)
        try:
            from google.auth.exceptions import DefaultCredentialsError
            from google.cloud import storage
        except ImportError:
            raise UnavailableError(
                f"model repository '{url}': gs:// repositories need google-cloud-storage "
                "(pip install 'dlserve[gcs]')"
            ) from None
        key_file = credential_entry(url, "gs")
        try:
            if key_file:
                self._client = storage.Client.from_service_account_json(key_file)
            else:
                try:
                    self._client = storage.Client()
                except DefaultCredentialsError as exc:  # none: a public bucket still serves
                    log.warning("model repository '%s': no Google credentials (%s); "
                                "reading it anonymously", url, exc)
                    self._client = storage.Client.create_anonymous_client()
        except Exception as exc:  # noqa: BLE001 - google-auth's errors (a bad key file...)
            raise InvalidArgumentError(f"model repository '{url}': {exc}") from None

    def list(self, prefix: str) -> Iterator[tuple[str, str, int]]:
        for blob in self._client.list_blobs(self._bucket, prefix=prefix):
            yield blob.name, blob.etag, blob.size

    def download(self, key: str, path: str) -> None:
        self._client.bucket(self._bucket).blob(key).download_to_filename(path)

    def close(self) -> None:
        self._client.close()


def azure_account(
    url: str, environ: Mapping[str, str] = os.environ
) -> tuple[str, str | None, str, str]:
    """An as:// URL's account, key (None: anonymous), container and key prefix, as
    Triton finds them: the credential file's ``account_str`` / ``account_key`` or
    ``AZURE_STORAGE_ACCOUNT`` / ``AZURE_STORAGE_KEY``, else the URL's account."""
    parts = [part for part in url.removeprefix("as://").split("/") if part]
    if len(parts) < 2:
        raise InvalidArgumentError(
            f"model repository '{url}': name the account and the container, as in "
            "as://account/container/path"
        )
    entry = credential_entry(url, "as", environ)
    entry = entry if isinstance(entry, dict) else {}
    account = (
        entry.get("account_str")
        or environ.get("AZURE_STORAGE_ACCOUNT")
        or parts[0].removesuffix(".blob.core.windows.net")
    )
    key = entry.get("account_key") or environ.get("AZURE_STORAGE_KEY") or None
    container, prefix = _bucket_and_prefix(url, parts[1:])
    return account, key, container, prefix


class AzureStore:
    mount_variable = "TRITON_AZURE_MOUNT_DIRECTORY"

    def __init__(self, url: str) -> None:
        self.url = url
        account, key, container, self.prefix = azure_account(url)
        try:
            from azure.storage.blob import BlobServiceClient
        except ImportError:
            raise UnavailableError(
                f"model repository '{url}': as:// repositories need azure-storage-blob "
                "(pip install 'dlserve[azure]')"
            ) from None
        connection = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
        try:
            if connection:  # another endpoint (a sovereign cloud, Azurite): for this account only
                named = dict(
                    field.split("=", 1) for field in connection.split(";") if "=" in field
                ).get("AccountName")
                if named != account:
                    raise InvalidArgumentError(
                        f"model repository '{url}': AZURE_STORAGE_CONNECTION_STRING is for "
                        f"account '{named}', not '{account}'"
                    )
                service = BlobServiceClient.from_connection_string(connection)
            else:
                credential = {"account_name": account, "account_key": key} if key else None
                service = BlobServiceClient(
                    f"https://{account}.blob.core.windows.net", credential=credential
                )
        except TritonError:
            raise
        except Exception as exc:  # noqa: BLE001 - azure's errors (a malformed string...)
            raise InvalidArgumentError(f"model repository '{url}': {exc}") from None
        self._service = service
        self._container = service.get_container_client(container)

    def list(self, prefix: str) -> Iterator[tuple[str, str, int]]:
        for blob in self._container.list_blobs(name_starts_with=prefix):
            yield blob.name, blob.etag, blob.size

    def download(self, key: str, path: str) -> None:
        with open(path, "wb") as file:
            self._container.download_blob(key).readinto(file)

    def close(self) -> None:
        self._container.close()
        self._service.close()


def error_reason(exc: Exception) -> str:
    """A store client's error in a few words (botocore's code and message, or the text)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and "Error" in response:
        error = response["Error"]
        return f"{error.get('Code', '')}: {error.get('Message', '')}".strip(": ")
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


__all__ = [
    "S3Location",
    "Store",
    "azure_account",
    "credential_entry",
    "credentials_for",
    "error_reason",
    "is_remote",
    "open_store",
]
