"""as:// model repositories, against Azurite (Microsoft's Azure Storage emulator, installed
by scripts/setup_azurite.sh) on a local port: the same mirror as s3:// and gs://, behind
Azure's own client, its endpoint and key from AZURE_STORAGE_CONNECTION_STRING."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dlserve
from tests.conftest import MODELS

blob = pytest.importorskip("azure.storage.blob")

AZURITE = Path(sys.executable).parent.parent / "azurite" / "node_modules" / ".bin" / "azurite-blob"
ACCOUNT = "devstoreaccount1"
# Azurite's documented development key (public, for the emulator only).
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
CONTAINER = "models"


@pytest.fixture(scope="module")
def connection(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not AZURITE.is_file():
        pytest.skip("Azurite is not installed (scripts/setup_azurite.sh)")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = tmp_path_factory.mktemp("azurite") / "azurite.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [str(AZURITE), "--blobHost", "127.0.0.1", "--blobPort", str(port),
             "--inMemoryPersistence", "--skipApiVersionCheck", "--disableTelemetry", "--silent"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 30
        while "successfully listens" not in log.read_text():
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        text = (
            f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
            f"BlobEndpoint=http://127.0.0.1:{port}/{ACCOUNT};"
        )
        with pytest.MonkeyPatch.context() as env:
            env.setenv("AZURE_STORAGE_CONNECTION_STRING", text)
            env.delenv("TRITON_CLOUD_CREDENTIAL_PATH", raising=False)
            with_container(lambda container: container.create_container())
            yield text
    finally:
        process.terminate()
        process.wait(10)


def with_container(action: Callable[[Any], Any]) -> Any:
    service = blob.BlobServiceClient.from_connection_string(
        os.environ["AZURE_STORAGE_CONNECTION_STRING"]
    )
    try:
        with service.get_container_client(CONTAINER) as container:
            return action(container)
    finally:
        service.close()


def put(prefix: str, model: str, source: Path, only: str = "") -> None:
    def upload(container: Any) -> None:
        for root, _dirs, files in os.walk(source):
            for name in files:
                relative = os.path.relpath(os.path.join(root, name), source)
                if relative.startswith(only) and "__pycache__" not in relative:
                    with open(os.path.join(root, name), "rb") as data:
                        container.upload_blob(f"{prefix}/{model}/{relative}", data, overwrite=True)

    with_container(upload)


@pytest.fixture
def mount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "mount"
    folder.mkdir()
    monkeypatch.setenv("TRITON_AZURE_MOUNT_DIRECTORY", str(folder))
    return folder


def test_a_repository_in_azure_is_served_followed_and_its_copy_removed(connection, mount, servers):
    put("served", "add_sub", MODELS / "add_sub")
    put("served", "versioned", MODELS / "versioned", only="config.pbtxt")
    put("served", "versioned", MODELS / "versioned", only="1")
    server = servers.start(
        f"as://{ACCOUNT}/{CONTAINER}/served",
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
    assert copy.name.startswith("dlserve-as-")
    servers.stop(server)
    assert list(mount.iterdir()) == []


def test_a_missing_container_fails_the_start_by_name(connection, mount, servers):
    url = f"as://{ACCOUNT}/no-such-container/models"
    with pytest.raises(dlserve.TritonError) as caught:
        servers.start(url)
    message = caught.value.message
    assert url in message and "cannot list it" in message and "container does not exist" in message
    assert list(mount.iterdir()) == []


def test_an_url_without_a_container_is_refused(connection):
    with pytest.raises(dlserve.InvalidArgumentError, match="name the account and the container"):
        dlserve.Server(dlserve.Options(model_repository=f"as://{ACCOUNT}")).start()
