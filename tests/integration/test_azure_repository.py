"""as:// model repositories, against Azurite (Microsoft's Azure Storage emulator, installed
by scripts/setup_azurite.sh) on a local port: the same mirror as s3:// and gs://, behind
Azure's own client, its endpoint and key from AZURE_STORAGE_CONNECTION_STRING."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import dlserve

from .object_store_checks import (
    free_port,
    mount_directory,
    put,
    served_followed_and_removed,
    start_fails_by_name,
)

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
    port = free_port()
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


def put_model(prefix: str, model: str, source: Path, only: str = "") -> None:
    def upload(container: Any) -> None:
        def one(key: str, path: str) -> None:
            with open(path, "rb") as data:
                container.upload_blob(key, data, overwrite=True)

        put(one, prefix, model, source, only)

    with_container(upload)


@pytest.fixture
def mount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return mount_directory(tmp_path, monkeypatch, "TRITON_AZURE_MOUNT_DIRECTORY")


def test_a_repository_in_azure_is_served_followed_and_its_copy_removed(connection, mount, servers):
    served_followed_and_removed(servers, put_model, f"as://{ACCOUNT}/{CONTAINER}/served", mount)


def test_a_missing_container_fails_the_start_by_name(connection, mount, servers):
    url = f"as://{ACCOUNT}/no-such-container/models"
    start_fails_by_name(servers, url, mount, "cannot list it", "container does not exist")


def test_an_url_without_a_container_is_refused(connection):
    with pytest.raises(dlserve.InvalidArgumentError, match="name the account and the container"):
        dlserve.Server(dlserve.Options(model_repository=f"as://{ACCOUNT}")).start()


def test_a_connection_string_for_another_account_is_refused(connection, servers):
    """AZURE_STORAGE_CONNECTION_STRING (often set for other tools) never stands in for
    another account than the repository's."""
    with pytest.raises(dlserve.InvalidArgumentError, match="is for account 'devstoreaccount1', not 'other'"):
        dlserve.Server(dlserve.Options(model_repository="as://other/models/repo")).start()
