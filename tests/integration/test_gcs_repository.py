"""gs:// model repositories, against a Google Cloud Storage emulator on a local port
(the same mirror as s3://, test_s3_repository.py, behind Google's own client)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .object_store_checks import (
    free_port,
    mount_directory,
    put,
    served_followed_and_removed,
    start_fails_by_name,
)

emulator = pytest.importorskip("gcp_storage_emulator.server")
storage = pytest.importorskip("google.cloud.storage")

BUCKET = "models"


@pytest.fixture(scope="module")
def bucket() -> Iterator[str]:
    """The emulator's address (STORAGE_EMULATOR_HOST, which Google's client follows)."""
    logging.getLogger("gcp_storage_emulator").setLevel(logging.ERROR)
    port = free_port()
    server = emulator.create_server("127.0.0.1", port, in_memory=True)
    server.start()
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
            env.delenv("TRITON_CLOUD_CREDENTIAL_PATH", raising=False)
            with_client(lambda client: client.create_bucket(BUCKET))
            yield BUCKET
    finally:
        server.stop()


def with_client(action: Callable[[Any], Any]) -> Any:
    client = storage.Client(project="test")
    try:
        return action(client)
    finally:
        client.close()


def put_model(prefix: str, model: str, source: Path, only: str = "") -> None:
    def upload(client: Any) -> None:
        bucket = client.bucket(BUCKET)
        put(lambda key, path: bucket.blob(key).upload_from_filename(path), prefix, model, source, only)

    with_client(upload)


@pytest.fixture
def mount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return mount_directory(tmp_path, monkeypatch, "TRITON_GCS_MOUNT_DIRECTORY")


def test_a_repository_in_gcs_is_served_followed_and_its_copy_removed(bucket, mount, servers):
    served_followed_and_removed(servers, put_model, f"gs://{bucket}/served", mount)


def test_a_missing_bucket_fails_the_start_by_name(bucket, mount, servers):
    start_fails_by_name(servers, "gs://no-such-bucket/models", mount, "cannot list it")
