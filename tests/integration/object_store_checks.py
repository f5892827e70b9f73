"""What every object-store repository must do, for test_{s3,gcs,azure}_repository.py:
each gives a way to upload a model folder (``PutModel``, built on :func:`put`) and a
repository URL."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import dlserve
from tests.conftest import MODELS, ServerHarness

# upload(key, local file): put one object in the store.
Upload = Callable[[str, str], None]
# put_model(prefix, model, local folder, only=""): upload a model folder (see put).
PutModel = Callable[..., None]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def mount_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str) -> Path:
    """An empty folder, named by the store's mount-directory variable: where servers put
    their local copies."""
    folder = tmp_path / "mount"
    folder.mkdir()
    monkeypatch.setenv(variable, str(folder))
    return folder


def put(upload: Upload, prefix: str, model: str, source: Path, only: str = "") -> None:
    """Upload the files of ``source`` (those under ``only``) as ``prefix/model/...``."""
    for root, _dirs, files in os.walk(source):
        for name in files:
            relative = os.path.relpath(os.path.join(root, name), source)
            if relative.startswith(only) and "__pycache__" not in relative:
                upload(f"{prefix}/{model}/{relative}", os.path.join(root, name))


def add_sub(server: dlserve.Server) -> list[float]:
    a = np.arange(16, dtype=np.float32)
    (response,) = server.model("add_sub").infer(inputs={"INPUT0": a, "INPUT1": a})
    return np.from_dlpack(response.outputs["OUTPUT0"]).tolist()


def version_of(server: dlserve.Server) -> int:
    (response,) = server.model("versioned").infer(inputs={"INPUT0": np.zeros(1, np.float32)})
    return int(np.from_dlpack(response.outputs["VERSION"])[0])


def served_followed_and_removed(
    servers: ServerHarness, put_model: PutModel, url: str, mount: Path
) -> None:
    """A repository at ``url`` (whose models ``put_model`` uploads under "served/") is
    served, a version uploaded later is served at the next poll, and the local copy
    (under ``mount``, the store's mount directory) goes at stop."""
    put_model("served", "add_sub", MODELS / "add_sub")
    put_model("served", "versioned", MODELS / "versioned", only="config.pbtxt")
    put_model("served", "versioned", MODELS / "versioned", only="1")
    server = servers.start(
        url, model_control_mode=dlserve.ModelControlMode.POLL, repository_poll_secs=3600
    )
    assert add_sub(server) == (np.arange(16) * 2).tolist()
    assert version_of(server) == 1
    put_model("served", "versioned", MODELS / "versioned", only="2")
    server.poll_model_repository()
    assert version_of(server) == 2
    (copy,) = mount.iterdir()
    assert copy.name.startswith(f"dlserve-{url[:2]}-")
    assert (copy / "versioned" / "2" / "model.py").is_file()
    servers.stop(server)
    assert list(mount.iterdir()) == []


def start_fails_by_name(servers: ServerHarness, url: str, mount: Path, *words: str) -> None:
    """Starting on ``url`` fails with an error naming it (and ``words``), leaving no copy."""
    with pytest.raises(dlserve.TritonError) as caught:
        servers.start(url)
    message = caught.value.message
    assert url in message and all(word in message for word in words), message
    assert list(mount.iterdir()) == []
