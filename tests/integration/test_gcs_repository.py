"""gs:// model repositories, against a Google Cloud Storage emulator on a local port
(the same mirror as s3://, test_s3_repository.py, behind Google's own client)."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dlserve
from tests.conftest import MODELS

emulator = pytest.importorskip("gcp_storage_emulator.server")
storage = pytest.importorskip("google.cloud.storage")

BUCKET = "models"


@pytest.fixture(scope="module")
def bucket() -> Iterator[str]:
    """The emulator's address (STORAGE_EMULATOR_HOST, which Google's client follows)."""
    logging.getLogger("gcp_storage_emulator").setLevel(logging.ERROR)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
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


def put(prefix: str, model: str, source: Path, only: str = "") -> None:
    def upload(client: Any) -> None:
        for root, _dirs, files in os.walk(source):
            for name in files:
                relative = os.path.relpath(os.path.join(root, name), source)
                if relative.startswith(only) and "__pycache__" not in relative:
                    blob = client.bucket(BUCKET).blob(f"{prefix}/{model}/{relative}")
                    blob.upload_from_filename(os.path.join(root, name))

    with_client(upload)


@pytest.fixture
def mount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "mount"
    folder.mkdir()
    monkeypatch.setenv("TRITON_GCS_MOUNT_DIRECTORY", str(folder))
    return folder


def test_a_repository_in_gcs_is_served_followed_and_its_copy_removed(bucket, mount, servers):
    put("served", "add_sub", MODELS / "add_sub")
    put("served", "versioned", MODELS / "versioned", only="config.pbtxt")
    put("served", "versioned", MODELS / "versioned", only="1")
    server = servers.start(
        f"gs://{bucket}/served",
        model_control_mode=dlserve.ModelControlMode.POLL,
        repository_poll_secs=3600,
    )
    a = np.arange(16, dtype=np.float32)
    (response,) = server.model("add_sub").infer(inputs={"INPUT0": a, "INPUT1": a})
    assert np.from_dlpack(response.outputs["OUTPUT0"]).tolist() == (a * 2).tolist()

    def version() -> int:
        (answer,) = server.model("versioned").infer(inputs={"INPUT0": np.zeros(1, np.float32)})
        return int(np.from_dlpack(answer.outputs["VERSION"])[0])

    assert version() == 1
    put("served", "versioned", MODELS / "versioned", only="2")
    server.poll_model_repository()
    assert version() == 2
    (copy,) = mount.iterdir()
    assert copy.name.startswith("dlserve-gs-") and (copy / "versioned" / "2" / "model.py").is_file()
    servers.stop(server)
    assert list(mount.iterdir()) == []


def test_a_missing_bucket_fails_the_start_by_name(bucket, mount, servers):
    url = "gs://no-such-bucket/models"
    with pytest.raises(dlserve.TritonError) as caught:
        servers.start(url)
    assert url in caught.value.message and "cannot list it" in caught.value.message
    assert list(mount.iterdir()) == []
