"""s3:// model repositories, against a real S3 API (moto's server on a local port):
served as Triton serves them, in every model control mode, with the store's changes
followed and the local copy removed at stop."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dlserve
from tests.conftest import MODELS

from .object_store_checks import add_sub, free_port, mount_directory, put, version_of

moto_server = pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

BUCKET = "models"


class Store:
    """The S3 server and what the tests do to it (each with a client of its own, closed
    after, so the leak checks see no pooled connection of ours)."""

    def __init__(self, port: int) -> None:
        self.endpoint = f"127.0.0.1:{port}"

    def _run(self, action: Callable[[Any], Any]) -> Any:
        client = boto3.client("s3", endpoint_url=f"http://{self.endpoint}")
        try:
            return action(client)
        finally:
            client.close()

    def url(self, prefix: str) -> str:
        return f"s3://{self.endpoint}/{BUCKET}/{prefix}"

    def put(self, prefix: str, model: str, source: Path, only: str = "") -> None:
        self._run(
            lambda client: put(
                lambda key, path: client.upload_file(path, BUCKET, key), prefix, model, source, only
            )
        )

    def put_object(self, key: str, body: bytes, **extra: Any) -> None:
        self._run(lambda client: client.put_object(Bucket=BUCKET, Key=key, Body=body, **extra))

    def delete(self, prefix: str, model: str, only: str = "") -> None:
        def remove(client: Any) -> None:
            listed = client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/{model}/{only}")
            for entry in listed.get("Contents", []):
                client.delete_object(Bucket=BUCKET, Key=entry["Key"])

        self._run(remove)


def moto() -> tuple[Any, Store]:
    """A started moto S3 server on a free port, with the bucket made."""
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    s3 = Store(port)
    s3._run(lambda client: client.create_bucket(Bucket=BUCKET))
    return server, s3


@pytest.fixture(scope="module")
def store() -> Iterator[Store]:
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    with pytest.MonkeyPatch.context() as env:
        for name, value in {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            env.setenv(name, value)
        env.delenv("TRITON_CLOUD_CREDENTIAL_PATH", raising=False)
        server, s3 = moto()
        try:
            yield s3
        finally:
            server.stop()


@pytest.fixture
def mount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return mount_directory(tmp_path, monkeypatch, "TRITON_AWS_MOUNT_DIRECTORY")


def test_a_repository_in_s3_is_served_and_its_copy_removed_at_stop(store, mount, servers) -> None:
    store.put("served", "add_sub", MODELS / "add_sub")
    server = servers.start(store.url("served"))
    assert server.model("add_sub").ready()
    assert add_sub(server) == (np.arange(16) * 2).tolist()
    (copy,) = mount.iterdir()
    original = MODELS / "add_sub" / "1" / "model.py"
    assert (copy / "add_sub" / "1" / "model.py").read_bytes() == original.read_bytes()
    servers.stop(server)
    assert list(mount.iterdir()) == []


def test_explicit_mode_loads_what_the_store_holds_at_the_time(store, mount, servers) -> None:
    store.put("explicit", "versioned", MODELS / "versioned", only="config.pbtxt")
    store.put("explicit", "versioned", MODELS / "versioned", only="1")
    server = servers.start(
        store.url("explicit"), model_control_mode=dlserve.ModelControlMode.EXPLICIT
    )
    assert [key[0] for key in server.models()] == ["versioned"]  # listed, not loaded

    # A model uploaded after the start is listed and loads.
    store.put("explicit", "add_sub", MODELS / "add_sub")
    assert sorted(key[0] for key in server.models()) == ["add_sub", "versioned"]
    server.load("add_sub")
    assert add_sub(server) == (np.arange(16) * 2).tolist()

    server.load("versioned")
    assert version_of(server) == 1
    # A new version folder is fetched by the next load (latest version policy).
    store.put("explicit", "versioned", MODELS / "versioned", only="2")
    server.load("versioned")
    assert version_of(server) == 2
    (copy,) = mount.iterdir()
    assert (copy / "versioned" / "1" / "model.py").is_file()
    # ...and a version deleted from the store is gone from the copy at the next load.
    store.delete("explicit", "versioned", only="2/")
    server.load("versioned")
    assert version_of(server) == 1
    assert not (copy / "versioned" / "2").exists()

    # A model deleted from the store can no longer be loaded; the version that was
    # loaded keeps serving (its files stay for a worker restart) until it is unloaded,
    # and then leaves the index, as in Triton (whose index lists what repositories hold).
    store.delete("explicit", "add_sub")
    with pytest.raises(dlserve.NotFoundError, match="add_sub"):
        server.load("add_sub")
    assert add_sub(server) == (np.arange(16) * 2).tolist()
    assert (copy / "add_sub" / "1" / "model.py").is_file()
    server.unload("add_sub")
    assert "add_sub" not in [row["name"] for row in server.engine.manager.index()]


def test_poll_mode_follows_the_store(store, mount, servers) -> None:
    store.put("polled", "versioned", MODELS / "versioned", only="config.pbtxt")
    store.put("polled", "versioned", MODELS / "versioned", only="1")
    server = servers.start(
        store.url("polled"),
        model_control_mode=dlserve.ModelControlMode.POLL,
        repository_poll_secs=3600,
    )
    assert version_of(server) == 1
    worker = server.engine.manager.models.find("versioned").versions[1].instances[0].pid

    store.put("polled", "add_sub", MODELS / "add_sub")
    server.poll_model_repository()
    assert add_sub(server) == (np.arange(16) * 2).tolist()
    # Unchanged in the store: not reloaded.
    assert server.engine.manager.models.find("versioned").versions[1].instances[0].pid == worker

    store.put("polled", "versioned", MODELS / "versioned", only="2")
    server.poll_model_repository()
    assert version_of(server) == 2

    store.delete("polled", "add_sub")
    server.poll_model_repository()
    assert not server.model("add_sub").ready()


def test_a_bucket_that_cannot_be_listed_fails_the_start_by_name(store, mount, servers) -> None:
    url = f"s3://{store.endpoint}/no-such-bucket/models"
    with pytest.raises(dlserve.TritonError) as caught:
        servers.start(url)
    assert url in caught.value.message and "NoSuchBucket" in caught.value.message
    assert list(mount.iterdir()) == []


@pytest.mark.parametrize("url", ["hdfs://namenode/models", "ftp://host/models"])
def test_other_cloud_stores_are_refused_by_name(url: str) -> None:
    with pytest.raises(dlserve.InvalidArgumentError, match="only local folders") as caught:
        dlserve.Server(dlserve.Options(model_repository=url)).start()
    assert url in caught.value.message


def renamed_add_sub(name: str) -> tuple[bytes, bytes]:
    """add_sub's config (named ``name``) and model file."""
    config = (MODELS / "add_sub" / "config.pbtxt").read_bytes()
    config = config.replace(b'"add_sub"', f'"{name}"'.encode())
    return config, (MODELS / "add_sub" / "1" / "model.py").read_bytes()


def test_only_changed_objects_are_fetched_again(store, mount, servers) -> None:
    store.put("incremental", "versioned", MODELS / "versioned", only="config.pbtxt")
    store.put("incremental", "versioned", MODELS / "versioned", only="1")
    server = servers.start(
        store.url("incremental"), model_control_mode=dlserve.ModelControlMode.EXPLICIT
    )
    server.load("versioned")
    (copy,) = mount.iterdir()
    unchanged = (copy / "versioned" / "1" / "model.py").stat()
    store.put("incremental", "versioned", MODELS / "versioned", only="2")
    server.load("versioned")
    assert version_of(server) == 2
    again = (copy / "versioned" / "1" / "model.py").stat()
    assert (again.st_ino, again.st_mtime_ns) == (unchanged.st_ino, unchanged.st_mtime_ns)


def test_keys_that_would_leave_the_mirror_are_ignored(store, mount, servers, tmp_path) -> None:
    store.put("keys", "add_sub", MODELS / "add_sub")
    for key in (
        "keys/add_sub/1/../../../../escaped.py",
        "keys/../escaped.py",
        "keys/add_sub//odd.py",
        "keys/.hidden/config.pbtxt",
    ):
        store.put_object(key, b"raise SystemExit('must never run')\n")
    server = servers.start(store.url("keys"))
    assert add_sub(server) == (np.arange(16) * 2).tolist()
    assert [key[0] for key in server.models()] == ["add_sub"]
    written = sorted(str(p.relative_to(mount)) for p in mount.rglob("*") if p.is_file())
    assert not [p for p in written if "escaped" in p or "odd" in p or ".hidden" in p], written
    assert not list(tmp_path.rglob("escaped.py"))


def test_a_model_the_store_fails_to_hand_over_fails_alone_and_is_tried_again(
    store, mount, servers
) -> None:
    """An object that cannot be read (archived, here) fails that model's load with the
    store's words; the other models load, and the next poll tries the model again."""
    config, model = renamed_add_sub("aaa")
    store.put_object("failing/aaa/config.pbtxt", config)
    store.put_object("failing/aaa/1/model.py", model, StorageClass="GLACIER")
    config, model = renamed_add_sub("zzz")
    store.put_object("failing/zzz/config.pbtxt", config)
    store.put_object("failing/zzz/1/model.py", model)
    # A key that is also a folder's name cannot be written here: that model fails alone.
    store.put("failing", "add_sub", MODELS / "add_sub")
    store.put_object("failing/add_sub/1", b"an object named like the version folder")
    server = servers.start(
        store.url("failing"),
        model_control_mode=dlserve.ModelControlMode.POLL,
        repository_poll_secs=3600,
        exit_on_error=False,
    )
    assert server.model("zzz").ready()
    rows = {row["name"]: row for row in server.engine.manager.index()}
    assert rows["aaa"]["state"] == "UNAVAILABLE" and "InvalidObjectState" in rows["aaa"]["reason"]
    assert "cannot write the files of model 'add_sub'" in rows["add_sub"]["reason"]

    store.put_object("failing/aaa/1/model.py", model)  # readable now, same name and size
    server.poll_model_repository()
    assert server.model("aaa").ready()


def test_the_index_outlives_the_store(mount, servers, monkeypatch) -> None:
    """A store that stops answering: the index lists what it last saw, the ready-only
    index does not ask it, and the loaded models keep serving."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    own, s3 = moto()
    try:
        s3.put("gone", "add_sub", MODELS / "add_sub")
        server = servers.start(s3.url("gone"))
    finally:
        own.stop()
    assert [key[0] for key in server.models()] == ["add_sub"]  # the last listing
    assert [key[0] for key in server.models(exclude_not_ready=True)] == ["add_sub"]
    assert add_sub(server) == (np.arange(16) * 2).tolist()


def test_a_repository_in_s3_registered_while_serving(store, mount, servers, make_repo) -> None:
    store.put("registered", "add_sub", MODELS / "add_sub")
    server = servers.start(make_repo("identity"), model_control_mode=dlserve.ModelControlMode.EXPLICIT)
    url = store.url("registered")
    server.register_model_repository(url, {"add_sub": "adder"})
    with pytest.raises(dlserve.AlreadyExistsError, match="has already been registered"):
        server.register_model_repository(url + "/")  # the same repository
    assert sorted(key[0] for key in server.models()) == ["adder", "identity"]
    server.load("adder")  # fetched under its folder's name, served under the mapped one
    assert server.model("adder").ready()
    server.unregister_model_repository(url + "/")
    assert sorted(key[0] for key in server.models()) == ["adder", "identity"]  # still loaded
    missing = url.replace(f"/{BUCKET}/", "/no-such-bucket/")
    with pytest.raises(dlserve.InvalidArgumentError, match=f"failed to register '{missing}': .*cannot list it"):
        server.register_model_repository(missing)
    servers.stop(server)
    assert list(mount.iterdir()) == []  # every mirror removed at stop, the unregistered one too


def test_with_namespacing_a_model_that_failed_at_start_is_one_row_once_it_loads(store, mount, servers) -> None:
    """A store that fails to hand a model over at start lists it as failed under its own
    namespace (the URL as given), so the load that works later replaces that row."""
    config, model = renamed_add_sub("aaa")
    store.put_object("spaced/aaa/config.pbtxt", config)
    store.put_object("spaced/aaa/1/model.py", model, StorageClass="GLACIER")
    server = servers.start(
        store.url("spaced"), model_control_mode=dlserve.ModelControlMode.EXPLICIT,
        startup_models=["aaa"], exit_on_error=False, model_namespacing=True,
    )
    assert [row.get("state") for row in server.engine.manager.index()] == ["UNAVAILABLE"]
    assert server.ready()  # (it failed before it had versions: no version to be unready, as in Triton)
    store.put_object("spaced/aaa/1/model.py", model)
    server.load("aaa")
    assert [row["state"] for row in server.engine.manager.index()] == ["READY"]
    assert server.ready()
    assert list(server.engine.manager.models) == [(store.url("spaced"), "aaa")]
