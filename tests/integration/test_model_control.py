"""Model control modes, load/unload (with config overrides and uploaded files),
version policies, auto-complete, bad repositories, logging and finalize."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import logging
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import uvloop

import dlserve
from dlserve import ModelControlMode
from dlserve.engine import server as inprocess
from dlserve.engine.model import ModelVersion
from dlserve.memory.tensor import HostMemoryAllocator

from ..conftest import MODELS, pid_alive, wait_until, worker_processes
from .test_metrics import families, value

X1 = np.ones(1, dtype=np.float32)
ADD_SUB_PY = (MODELS / "add_sub" / "1" / "model.py").read_text()


def rows(server: dlserve.Server) -> dict[str, dict]:
    return {f"{name}:{version}": {"state": m.state, "reason": m.reason} for (name, version), m in server.models().items()}


def version_of(server: dlserve.Server, version: int = -1) -> int:
    response = list(server.model("versioned", version).infer(inputs={"INPUT0": X1}))[0]
    return int(response.outputs["VERSION"].as_numpy()[0])


def worker_pids(server: dlserve.Server, name: str) -> list[int]:
    (stats,) = server.model(name).statistics()["model_stats"]
    return [instance["pid"] for instance in stats["instances"]]


def test_loading_a_model_that_serves_unchanged_leaves_it_as_it_is(servers, make_repo):
    """As in Triton: a load of a model that serves, from files that did not change, keeps
    its workers (and so their state, open sequences included); a changed file or a config
    override that changes more than instance_group reloads it (an override equal to the
    serving config changes nothing, as Triton's instance update rule has it), and a plain
    load after an override keeps it."""
    repo = make_repo("add_sub")
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    server.load("add_sub")
    first = worker_pids(server, "add_sub")
    server.load("add_sub")
    assert worker_pids(server, "add_sub") == first
    model_py = repo / "add_sub" / "1" / "model.py"
    os.utime(model_py, ns=(model_py.stat().st_atime_ns, model_py.stat().st_mtime_ns + 10**9))
    server.load("add_sub")
    second = worker_pids(server, "add_sub")
    assert second != first
    config = json.loads(json.dumps(server.model("add_sub").config()))
    server.load("add_sub", {"config": json.dumps(config)})
    assert worker_pids(server, "add_sub") == second
    config["parameters"] = {"X": {"string_value": "1"}}
    server.load("add_sub", {"config": json.dumps(config)})
    third = worker_pids(server, "add_sub")
    assert third != second
    server.load("add_sub")  # the override stays, as Triton 2.51's does: nothing changed
    assert worker_pids(server, "add_sub") == third


def test_explicit_mode_load_and_unload(servers, make_repo):
    server = servers.start(make_repo("add_sub", "identity"), model_control_mode=ModelControlMode.EXPLICIT)
    assert rows(server) == {
        "add_sub:-1": {"state": None, "reason": None},
        "identity:-1": {"state": None, "reason": None},
    }
    assert not server.model("add_sub").ready()
    server.load("add_sub")
    assert server.model("add_sub").ready()
    a = np.ones(16, dtype=np.float32)
    assert list(server.model("add_sub").infer(inputs={"INPUT0": a, "INPUT1": a}))[0].error is None
    server.unload("add_sub")
    assert not server.model("add_sub").ready()
    # As Triton (its issue 7588): an unloaded model was asked away, so the server, with
    # strict readiness too, is ready; only models that should serve count.
    assert server.ready()
    with pytest.raises(dlserve.NotFoundError):
        server.model("add_sub").infer(inputs={"INPUT0": a, "INPUT1": a})
    server.load("add_sub")  # a second load works
    assert server.model("add_sub").ready()
    with pytest.raises(dlserve.NotFoundError, match="failed to load 'nope'"):
        server.load("nope")
    # As in Triton: unloading twice, or a name that is not loaded or not known, is no error,
    # and an unloaded model stays listed as unloaded.
    server.unload("add_sub")
    server.unload("add_sub")
    server.unload("identity")
    server.unload("nope")
    assert rows(server) == {
        "add_sub:1": {"state": "UNAVAILABLE", "reason": "unloaded"},
        "identity:-1": {"state": None, "reason": None},
    }


def test_startup_models_and_star(servers, make_repo):
    repo = make_repo("add_sub", "identity")
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT, startup_models=["identity"])
    assert server.model("identity").ready() and not server.model("add_sub").ready()
    everything = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT, startup_models=["*"])
    assert everything.model("identity").ready() and everything.model("add_sub").ready()


def test_load_unload_refused_outside_explicit_mode(servers, make_repo):
    server = servers.start(make_repo("identity"))
    for call in (lambda: server.load("identity"), lambda: server.unload("identity")):
        with pytest.raises(dlserve.UnavailableError, match="explicit model load / unload is not allowed"):
            call()


def test_load_with_config_override(servers, make_repo):
    server = servers.start(make_repo("identity"), model_control_mode=ModelControlMode.EXPLICIT)
    config = json.dumps(
        {
            "backend": "python",
            "max_batch_size": 8,
            "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
            "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
            "instance_group": [{"count": 2, "kind": "KIND_CPU"}],
        }
    )
    server.load("identity", {"config": config})
    loaded = server.model("identity").config()
    assert loaded["max_batch_size"] == 8
    assert loaded["instance_group"][0]["count"] == 2
    assert len(server.engine.model("identity").instances) == 2
    batch = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = list(server.model("identity").infer(inputs={"INPUT0": batch}))[0].outputs["OUTPUT0"]
    np.testing.assert_array_equal(out.as_numpy(), batch)
    # A plain load of it, its files unchanged, leaves it as it is (as Triton 2.51 does,
    # side by side): the override lasts until an unload, or until its files change.
    workers = [instance.worker for instance in server.engine.model("identity").instances]
    server.load("identity")
    assert server.model("identity").config()["max_batch_size"] == 8
    assert [i.worker for i in server.engine.model("identity").instances] == workers
    server.unload("identity")
    server.load("identity")
    assert server.model("identity").config()["max_batch_size"] == 0


def test_load_from_uploaded_files(servers, make_repo):
    repo = make_repo("identity")
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    config = (MODELS / "add_sub" / "config.pbtxt").read_text()
    json_config = json.dumps(
        {
            "backend": "python",
            "input": [
                {"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [16]},
                {"name": "INPUT1", "data_type": "TYPE_FP32", "dims": [16]},
            ],
            "output": [
                {"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [16]},
                {"name": "OUTPUT1", "data_type": "TYPE_FP32", "dims": [16]},
            ],
        }
    )
    assert "INPUT0" in config
    server.load("uploaded", {"config": json_config, "file:1/model.py": ADD_SUB_PY.encode()})
    a = np.full(16, 3.0, dtype=np.float32)
    response = list(server.model("uploaded").infer(inputs={"INPUT0": a, "INPUT1": a}))[0]
    np.testing.assert_array_equal(response.outputs["OUTPUT0"].as_numpy(), a * 2)
    assert not (repo / "uploaded").exists(), "uploads must not be written into the repository"
    assert {"name": "uploaded", "version": "1", "state": "READY"} in server.engine.manager.index()
    server.load("identity")
    server.unload("uploaded")
    server.unload("identity")
    # As Triton's: a model from uploaded files leaves the index with its unload; one in
    # the repository stays, as unloaded.
    assert server.engine.manager.index() == [
        {"name": "identity", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}
    ]


LABEL_READER = """
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.folder = os.path.join(args["model_repository"], args["model_version"])

    def execute(self, requests):
        with open(os.path.join(self.folder, "labels.txt"), "rb") as f:
            label = np.array([f.read()], dtype=object)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", label)]) for _ in requests]
"""
BROKEN = """
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("this upload is broken")
"""


def test_a_refused_upload_reload_leaves_the_serving_version_its_files(servers, make_repo):
    """Each load's uploaded files get a folder of their own, as Triton's: a reload whose
    files fail to load leaves the version that serves on its own files, for its requests
    and its worker's restart (the refused upload's replaced them); a folder goes when its
    versions have unloaded, and the last at the stop."""
    server = servers.start(make_repo(), model_control_mode=ModelControlMode.EXPLICIT)
    config = json.dumps({
        "backend": "python",
        "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [1]}],
        "output": [{"name": "OUT", "data_type": "TYPE_STRING", "dims": [1]}],
    })

    def upload(code: str, labels: bytes) -> dict[str, object]:
        return {"config": config, "file:1/model.py": code.encode(), "file:1/labels.txt": labels}

    def label() -> bytes:
        (response,) = server.model("up").infer(inputs={"IN": X1})
        return response.outputs["OUT"].to_bytes_array()[0]

    server.load("up", upload(LABEL_READER, b"v1"))
    assert label() == b"v1"
    first = server.engine.model("up").model_dir
    uploads = first.parent.parent
    with pytest.raises(dlserve.InvalidArgumentError, match="this upload is broken"):
        server.load("up", upload(BROKEN, b"v2"))
    assert label() == b"v1"
    assert list(uploads.iterdir()) == [first.parent]  # (the refused one's is gone)
    instance = server.engine.model("up").instances[0]
    os.kill(instance.pid, signal.SIGKILL)
    wait_until(lambda: instance.restarts == 1 and server.model("up").ready())
    assert label() == b"v1"
    # A reload that loads: the replaced version's files go once it has unloaded.
    server.load("up", upload(LABEL_READER, b"v3"))
    assert label() == b"v3"
    second = server.engine.model("up").model_dir
    wait_until(lambda: not first.exists())
    server.unload("up")
    assert not second.exists()
    servers.stop(server)
    assert not uploads.exists()


@pytest.mark.parametrize("path", ["../escape.py", "1/../../escape.py", "/etc/evil.py", ""])
def test_uploaded_files_cannot_escape_the_model_folder(servers, make_repo, tmp_path, path):
    server = servers.start(make_repo("identity"), model_control_mode=ModelControlMode.EXPLICIT)
    config = json.dumps({"backend": "python"})
    with pytest.raises(dlserve.InvalidArgumentError, match="escapes the model folder"):
        server.load("evil", {"config": config, f"file:{path}": b"print('pwned')"})
    assert not Path("/etc/evil.py").exists()


def test_an_uploaded_file_the_filesystem_refuses_is_a_clear_error(servers, make_repo):
    """A name too long for the filesystem: INVALID_ARGUMENT naming it, not an INTERNAL
    OSError showing the server's upload folder (Triton 2.51 aborts; later ones refuse it)."""
    server = servers.start(make_repo("identity"), model_control_mode=ModelControlMode.EXPLICIT)
    config = json.dumps({"backend": "python"})
    long_name = "1/" + "a" * 300 + ".py"
    with pytest.raises(dlserve.InvalidArgumentError) as failure:
        server.load("long", {"config": config, f"file:{long_name}": b"x = 1"})
    assert str(failure.value) == f"load of model 'long': invalid file path 'file:{long_name}': File name too long"
    assert server.model("identity").ready() is False  # (explicit mode: not loaded; the server serves on)
    server.load("identity")
    assert server.model("identity").ready()


@pytest.mark.parametrize("name", ["../escape", "a/b", "..", " x", "x ", ""])
def test_model_names_with_path_characters_are_rejected(servers, make_repo, name):
    server = servers.start(make_repo("identity"), model_control_mode=ModelControlMode.EXPLICIT)
    config = json.dumps({"backend": "python"})
    with pytest.raises(dlserve.InvalidArgumentError, match="model name"):
        server.load(name, {"config": config, "file:1/model.py": b"x = 1"})
    with pytest.raises(dlserve.InvalidArgumentError, match="model name"):
        server.load(name)


def test_files_without_config_are_rejected(servers, make_repo):
    server = servers.start(make_repo("identity"), model_control_mode=ModelControlMode.EXPLICIT)
    with pytest.raises(dlserve.InvalidArgumentError, match="need a 'config' parameter"):
        server.load("x", {"file:1/model.py": b""})
    with pytest.raises(dlserve.InvalidArgumentError, match="unrecognized load parameter 'bogus'"):
        server.load("identity", {"bogus": "1"})


def test_failed_reload_keeps_the_old_version_serving(servers, make_repo):
    repo = make_repo("identity")
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT, startup_models=["identity"])
    broken = json.dumps({"backend": "python", "max_batch_size": -3})
    with pytest.raises(dlserve.InvalidArgumentError, match="max_batch_size must be >= 0"):
        server.load("identity", {"config": broken})
    assert server.model("identity").ready()
    out = list(server.model("identity").infer(inputs={"INPUT0": X1}))[0]
    assert out.error is None


def test_a_version_that_served_through_a_failed_reload_is_listed_as_unloaded(servers, make_repo):
    """Triton 2.51 side by side: once unloaded, the version that served on through a
    failed reload is 'unloaded' in the index (dlserve kept the reload's failure)."""
    server = servers.start(make_repo("identity"), model_control_mode=ModelControlMode.EXPLICIT, startup_models=["identity"])
    config = server.model("identity").config()
    with pytest.raises(dlserve.InvalidArgumentError, match="'name' is 'elsewhere'"):
        server.load("identity", {"config": json.dumps({**config, "name": "elsewhere"})})
    assert server.model("identity").ready() and server.ready()
    server.unload("identity", wait_until_unloaded=True)
    rows = [row for row in server.engine.manager.index() if row["name"] == "identity"]
    assert rows == [{"name": "identity", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}]


def test_version_policies(servers, make_repo):
    repo = make_repo("versioned")
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT, startup_models=["versioned"])
    assert version_of(server) == 3  # latest { num_versions: 1 } is the default
    with pytest.raises(dlserve.NotFoundError, match="version 1 is not found"):
        version_of(server, 1)
    base = (repo / "versioned" / "config.pbtxt").read_text()

    def reload(policy: str) -> None:
        (repo / "versioned" / "config.pbtxt").write_text(base + f"version_policy: {policy}\n")
        server.load("versioned")

    reload("{ all { } }")
    assert [version_of(server, v) for v in (1, 2, 3)] == [1, 2, 3]
    assert version_of(server) == 3
    reload("{ specific { versions: [ 1, 3 ] } }")
    assert version_of(server, 1) == 1 and version_of(server, 3) == 3
    with pytest.raises(dlserve.UnavailableError, match="version 2 is not at ready state"):
        version_of(server, 2)  # the reload retired it (Triton 2.51: 503, not 404)
    reload("{ latest { num_versions: 2 } }")
    assert server.model("versioned").metadata()["versions"] == ["2", "3"]
    # a version's own metadata names only that version, as Triton's does
    assert server.model("versioned", 2).metadata()["versions"] == ["2"]


UNLOADED = {"state": "UNAVAILABLE", "reason": "unloaded"}


def engine_log(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "dlserve.engine"]


def test_versions_it_served_stay_listed_and_unavailable(servers, make_repo, caplog):
    """Triton 2.51 (measured): a version the server served and serves no more (retired by
    a reload, or unloaded) stays in the index as unloaded and answers UNAVAILABLE ("not
    at ready state", HTTP 503); one it never had is NOT_FOUND. Loads and unloads are
    logged at info level."""
    repo = make_repo("versioned")
    config = repo / "versioned" / "config.pbtxt"
    latest = config.read_text()
    config.write_text(latest + "version_policy: { all { } }\n")
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    with caplog.at_level(logging.INFO, logger="dlserve.engine"):
        server.load("versioned")
        config.write_text(latest)  # version 3 only: the reload retires 1 and 2, and 3's old load
        server.load("versioned")
        retired = {(logging.INFO, f"successfully unloaded 'versioned' version {version}") for version in (1, 2, 3)}
        wait_until(lambda: retired <= set(engine_log(caplog)))  # (in the background)
    ready = {"state": "READY", "reason": None}
    assert rows(server) == {"versioned:1": UNLOADED, "versioned:2": UNLOADED, "versioned:3": ready}
    with pytest.raises(dlserve.UnavailableError, match="^Request for unknown model: 'versioned' version 1 is not at ready state$"):
        version_of(server, 1)
    with pytest.raises(dlserve.InvalidArgumentError, match="^requested model version is not available for model 'versioned'$"):
        server.model("versioned", 1).statistics()
    logged = engine_log(caplog)
    for version in (1, 2, 3):
        assert (logging.INFO, f"loading: versioned:{version}") in logged
    assert logged.count((logging.INFO, "successfully loaded 'versioned'")) == 2  # once a load

    server.unload("versioned")
    assert rows(server) == {f"versioned:{version}": UNLOADED for version in (1, 2, 3)}
    for version in (1, 2, 3):
        assert not server.model("versioned", version).ready()
        with pytest.raises(dlserve.UnavailableError, match=f"'versioned' version {version} is not at ready state$"):
            server.model("versioned", version).metadata()
    with pytest.raises(dlserve.NotFoundError, match="^Request for unknown model: 'versioned' version 7 is not found$"):
        server.model("versioned", 7).metadata()
    with pytest.raises(dlserve.InvalidArgumentError, match="^requested model 'versioned' is not available$"):
        server.model("versioned", 1).statistics()


VERSIONED_CONFIG = (MODELS / "versioned" / "config.pbtxt").read_text()
VERSION_1_PY = (MODELS / "versioned" / "1" / "model.py").read_text()
FAILS_TO_START_PY = (
    "class TritonPythonModel:\n"
    "    def initialize(self, args):\n"
    "        raise RuntimeError('version 2 cannot start')\n"
)


def test_a_version_that_fails_to_load_is_blamed_alone_and_logged_once(servers, make_repo, caplog):
    """Triton 2.51 (measured; versions 1 and 2, 2 raising in initialize): the load error
    and the index give version 2 its error; version 1, started and stopped again, is
    listed as unloaded. A load through the API that fails is logged once, as one at
    startup is."""
    two = {
        "config.pbtxt": VERSIONED_CONFIG + "version_policy: { all { } }\n",
        "1/model.py": VERSION_1_PY,
        "2/model.py": FAILS_TO_START_PY,
    }
    server = servers.start(make_repo(extra={"two": two}), model_control_mode=ModelControlMode.EXPLICIT)
    with caplog.at_level(logging.INFO, logger="dlserve.engine"):
        with pytest.raises(dlserve.InvalidArgumentError) as info:
            server.load("two")
        with pytest.raises(dlserve.NotFoundError):
            server.load("nope")
    said = str(info.value)
    assert said.startswith(  # (the model's own error, as Triton says it)
        "load failed for model 'two': version 2 is at UNAVAILABLE state: Internal: RuntimeError: version 2 cannot start"
    )
    assert "version 1" not in said
    assert said.count("is at UNAVAILABLE state") == 1
    assert rows(server)["two:1"] == UNLOADED
    failed = rows(server)["two:2"]
    assert failed["state"] == "UNAVAILABLE" and failed["reason"].startswith("Internal: ")
    assert "RuntimeError: version 2 cannot start" in failed["reason"]
    with pytest.raises(dlserve.UnavailableError, match="'two' version 1 is not at ready state$"):
        server.model("two", 1).metadata()
    logged = engine_log(caplog)
    errors = [message for level, message in logged if level == logging.ERROR]
    assert len(errors) == 2, errors  # each failed load once, in Triton's words
    assert errors[0].startswith("failed to load 'two' version 2: Internal: RuntimeError: version 2 cannot start")
    assert errors[1].startswith("failed to load 'nope': ")
    assert (logging.INFO, "failed to load 'two'") in logged
    assert (logging.INFO, "successfully unloaded 'two' version 1") in logged
    assert not [message for _, message in logged if message.startswith("successfully loaded 'two'")]


def test_a_model_file_that_does_not_parse_is_said_as_triton_says_it(servers, make_repo):
    broken = {"config.pbtxt": 'backend: "python"\n', "1/model.py": "class TritonPythonModel:\n    def (self):\n"}
    server = servers.start(make_repo(extra={"broken": broken}), model_control_mode=ModelControlMode.EXPLICIT)
    with pytest.raises(dlserve.InvalidArgumentError) as info:
        server.load("broken")
    assert str(info.value) == (  # (no import machinery frames after it, as Triton 2.51)
        "load failed for model 'broken': version 1 is at UNAVAILABLE state: Internal: "
        "SyntaxError: invalid syntax (model.py, line 2);\n"
    )


def test_version_folders_it_ignores_or_misses_are_logged(servers, make_repo, caplog):
    """As Triton 2.51 (measured): a version folder with leading zeros is ignored with a
    warning, and a version a specific policy names without a folder is logged as an
    error; the other versions load."""
    odd = {
        "config.pbtxt": VERSIONED_CONFIG + "version_policy: { specific { versions: [ 1, 5 ] } }\n",
        "1/model.py": VERSION_1_PY,
        "007/model.py": VERSION_1_PY,
    }
    server = servers.start(make_repo(extra={"odd": odd}), model_control_mode=ModelControlMode.EXPLICIT)
    with caplog.at_level(logging.WARNING, logger="dlserve.engine"):
        server.load("odd")
    assert rows(server) == {"odd:1": {"state": "READY", "reason": None}}
    logged = engine_log(caplog)
    assert (logging.WARNING, "model 'odd': ignoring folder '007', version folders have no leading zeros") in logged
    assert (logging.ERROR, "model 'odd': its version policy names version 5, which has no version folder") in logged


def test_auto_complete_fills_the_config(servers, make_repo):
    server = servers.start(make_repo("auto_complete"))
    config = server.model("auto_complete").config()
    assert config["max_batch_size"] == 4
    assert [i["name"] for i in config["input"]] == ["INPUT0", "INPUT1"]
    assert config["input"][1]["optional"] is True
    assert config["dynamic_batching"]["preferred_batch_size"] == [4]
    assert config["instance_group"][0]["name"] == "auto_complete"
    x = np.ones((2, 4), dtype=np.float32)
    out = list(server.model("auto_complete").infer(inputs={"INPUT0": x, "INPUT1": x}))[0]
    np.testing.assert_array_equal(out.outputs["OUTPUT0"].as_numpy(), x * 2)


NO_DIMS_CONFIG = 'backend: "python"\ninput [ { name: "X" data_type: TYPE_FP32 } ]\noutput [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'


def test_a_model_whose_versions_failed_is_reported_as_triton_reports_it(servers, make_repo):
    """Triton 2.51's answers on the same repository (measured): the load error names
    the failed version and the error's kind, the index says the same, and lookups
    tell a failed version (UNAVAILABLE) from a model with none and an unknown version."""
    repo = make_repo("add_sub", extra={"bad": {"config.pbtxt": NO_DIMS_CONFIG, "1/model.py": ""}})
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    with pytest.raises(dlserve.InvalidArgumentError) as info:
        server.load("bad")
    assert str(info.value) == (
        "load failed for model 'bad': version 1 is at UNAVAILABLE state: Invalid argument: "
        "model input 'X' must specify 'dims' for bad;\n"
    )
    (row,) = [r for r in server.engine.manager.index() if r["name"] == "bad"]
    assert row == {
        "name": "bad", "version": "1", "state": "UNAVAILABLE",
        "reason": "Invalid argument: model input 'X' must specify 'dims' for bad",
    }
    with pytest.raises(dlserve.NotFoundError, match="^Request for unknown model: 'bad' has no available versions$"):
        server.model("bad").metadata()
    with pytest.raises(dlserve.UnavailableError, match="^Request for unknown model: 'bad' version 1 is not at ready state$"):
        server.model("bad", 1).metadata()
    with pytest.raises(dlserve.NotFoundError, match="^Request for unknown model: 'bad' version 3 is not found$"):
        server.model("bad", 3).config()


SEES_MODEL = """
import json
import os


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        with open(os.path.join(os.path.dirname(__file__), "seen.json"), "w") as out:
            json.dump(config.as_dict(), out)
        return config

    def execute(self, requests):
        return []
"""


def test_index_lists_every_folder_and_then_why_a_folder_without_versions_failed(servers, make_repo):
    """Triton 2.51 (measured, explicit mode): before any load the index lists every folder
    by name, models or not (no version folder, only a non-numeric one, empty, only a
    file). After a failed load Triton drops the folders that have a config or a model
    file in a subfolder from the index and keeps the others by name; dlserve lists each
    failed one with its reason, and by name again once unloaded."""
    config = {"config.pbtxt": 'backend: "python"\n'}
    repo = make_repo(
        "identity",
        extra={
            "no_version": {**config, "model.py": ADD_SUB_PY},
            "not_numeric": {**config, "v1/model.py": ADD_SUB_PY},
            "only_a_file": {"README": "not a model\n"},
        },
    )
    (repo / "empty").mkdir()
    folders = ["empty", "no_version", "not_numeric", "only_a_file"]
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    assert server.engine.manager.index() == [{"name": name} for name in sorted([*folders, "identity"])]
    for name in folders:
        with pytest.raises(dlserve.InvalidArgumentError, match=f"model '{name}': no version folder holds 'model.py'"):
            server.load(name)
    failed = {row["name"]: row for row in server.engine.manager.index() if row["name"] != "identity"}
    assert sorted(failed) == folders
    assert all(row["state"] == "UNAVAILABLE" and "no version folder" in row["reason"] for row in failed.values())
    # Models that failed before they had versions leave the server ready, as in Triton
    # (side by side: dlserve stayed unready until each of them loaded)
    assert server.ready()
    for name in folders:
        server.unload(name)
    assert server.engine.manager.index() == [{"name": name} for name in sorted([*folders, "identity"])]


INHERITS_AUTO_COMPLETE = {
    "config.pbtxt": 'backend: "python"\n',
    "1/completing.py": (
        "class Completing:\n"
        "    @staticmethod\n"
        "    def auto_complete_config(config):\n"
        "        config.add_input({'name': 'IN', 'data_type': 'TYPE_FP32', 'dims': [2]})\n"
        "        config.add_output({'name': 'OUT', 'data_type': 'TYPE_FP32', 'dims': [2]})\n"
        "        return config\n"
    ),
    "1/model.py": (
        "from completing import Completing\n"
        "import triton_python_backend_utils as pb_utils\n\n\n"
        "class TritonPythonModel(Completing):\n"
        "    def execute(self, requests):\n"
        "        return [pb_utils.InferenceResponse([pb_utils.Tensor('OUT', pb_utils.get_input_tensor_by_name(r, 'IN')"
        ".as_numpy() * 2)]) for r in requests]\n"
    ),
}


def test_auto_complete_config_inherited_from_a_base_class_runs(servers, make_repo):
    """Triton asks the model class for the hook, so one a base class in a file beside
    model.py brings runs too (dlserve read only the class statement and skipped it)."""
    server = servers.start(make_repo("identity", extra={"inherits": INHERITS_AUTO_COMPLETE}))
    config = server.model("inherits").config()
    assert [(t["name"], t["dims"]) for t in config["input"]] == [("IN", [2])]
    (response,) = server.model("inherits").infer(inputs={"IN": np.array([1, 2], np.float32)})
    assert np.from_dlpack(response.outputs["OUT"]).tolist() == [2, 4]


def test_auto_complete_sees_the_defaults_triton_has_filled_in(servers, make_repo):
    """Triton 2.51 (measured) hands auto_complete_config a config with its model file,
    instance groups and optimization filled in; a model branching on them must see them."""
    config = 'backend: "python"\ninstance_group [ { count: 2 kind: KIND_CPU } ]\n'
    repo = make_repo(extra={"sees": {"config.pbtxt": config, "1/model.py": SEES_MODEL}})
    servers.start(repo, exit_on_error=False)
    seen = json.loads((repo / "sees" / "1" / "seen.json").read_text())
    assert seen["default_model_filename"] == "model.py"
    assert [(g["name"], g["count"], g["kind"]) for g in seen["instance_group"]] == [("sees_0", 2, "KIND_CPU")]
    assert seen["optimization"]["input_pinned_memory"] == {"enable": True}
    assert "dynamic_batching" not in seen


def test_auto_complete_disabled(servers, make_repo):
    server = servers.start(make_repo("auto_complete"), strict_model_config=True, exit_on_error=False)
    config = server.model("auto_complete").config()
    assert config["input"] == [] and config["max_batch_size"] == 0


def test_auto_complete_errors_are_reported(servers, make_repo):
    bad = (MODELS / "auto_complete" / "1" / "model.py").read_text().replace(
        "set_max_batch_size(4)", "set_max_batch_size(2)"
    )
    repo = make_repo(
        extra={
            "bad_auto": {
                "config.pbtxt": 'backend: "python"\nmax_batch_size: 8\n',
                "1/model.py": bad,
            }
        }
    )
    with pytest.raises(dlserve.InternalError, match="auto_complete_config of model 'bad_auto' failed.*max_batch_size"):
        servers.start(repo)


def test_an_auto_complete_config_returning_nothing_fails_in_tritons_words(servers, make_repo):
    returns_none = (
        "class TritonPythonModel:\n"
        "    @staticmethod\n"
        "    def auto_complete_config(config):\n"
        "        config.set_max_batch_size(4)\n"
    )
    forgetful = {"config.pbtxt": 'backend: "python"\n', "1/model.py": returns_none}
    repo = make_repo(extra={"forgetful": forgetful})
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    with pytest.raises(dlserve.TritonError) as info:
        server.load("forgetful")
    assert (
        "auto_complete_config function in model 'forgetful' must return a valid pb.ModelConfig "
        "object. (It returned a NoneType.)"
    ) in info.value.message


def test_a_worker_that_dies_before_auto_complete_answers_is_reported_with_its_last_output(servers, make_repo):
    """Its exit and what it wrote (an import that fails in an execution environment, say);
    dlserve said only "worker process connection closed" (UNAVAILABLE, a 503)."""
    dying = (
        "import os, sys\n"
        "sys.stderr.write('numpy.libs is missing\\n'); sys.stderr.flush()\n"
        "os._exit(3)\n\n"
        "class TritonPythonModel:\n"
        "    @staticmethod\n"
        "    def auto_complete_config(config):\n"
        "        return config\n"
    )
    repo = make_repo(extra={"dies": {"config.pbtxt": 'backend: "python"\n', "1/model.py": dying}})
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    with pytest.raises(dlserve.InvalidArgumentError) as info:  # (a failed load: 400, as Triton's)
        server.load("dies")
    message = info.value.message
    assert "auto_complete_config of model 'dies' failed" in message, message
    assert "exited with code 3" in message and "numpy.libs is missing" in message, message


def auto_complete_adding(input_fields: str) -> str:
    """A model whose auto_complete_config adds input IN with ``input_fields`` (Python
    text) and output OUT with dims ["-1", "4"]."""
    return (
        "class TritonPythonModel:\n"
        "    @staticmethod\n"
        "    def auto_complete_config(config):\n"
        f'        config.add_input({{"name": "IN", "data_type": "TYPE_FP32", {input_fields}}})\n'
        '        config.add_output({"name": "OUT", "data_type": "TYPE_FP32", "dims": ["-1", "4"]})\n'
        "        return config\n\n"
        "    def execute(self, requests):\n"
        "        return []\n"
    )


def test_auto_complete_numbers_and_bools_in_strings_are_read_as_triton_reads_them(servers, make_repo):
    """Triton 2.51 (measured, same models): the config it serves has the numbers and bools."""
    models = {
        "strings": '"dims": ["4"], "optional": "true"',
        "one_value": '"dims": "4", "optional": "no"',
        "bad": '"dims": ["abc"]',
    }
    files = {name: {"config.pbtxt": 'backend: "python"\n', "1/model.py": auto_complete_adding(fields)} for name, fields in models.items()}
    server = servers.start(make_repo(extra=files), model_control_mode=ModelControlMode.EXPLICIT)
    for name, optional in (("strings", True), ("one_value", False)):
        server.load(name)
        config = server.model(name).config()
        assert [(t["name"], t["dims"], t["optional"]) for t in config["input"]] == [("IN", [4], optional)]
        assert [(t["name"], t["dims"]) for t in config["output"]] == [("OUT", [-1, 4])]
    # Triton loads this one with its auto-complete result silently dropped (no inputs, no
    # outputs at all); dlserve refuses it and says why.
    with pytest.raises(
        dlserve.InvalidArgumentError,
        match=re.escape("invalid config from auto_complete_config: input[0].dims[0]: 'abc' is not an integer"),
    ):
        server.load("bad")


def test_exit_on_error(servers, make_repo):
    repo = make_repo("identity", "init_fail")
    with pytest.raises(dlserve.InternalError, match="cannot initialize: weights file is missing"):
        servers.start(repo)
    lenient = servers.start(repo, exit_on_error=False)
    assert lenient.model("identity").ready() and not lenient.model("init_fail").ready()
    assert not lenient.ready()  # strict readiness
    entry = lenient.models()[("init_fail", 1)]  # its version 1 failed, as Triton lists it
    assert entry.state == "UNAVAILABLE" and "cannot initialize" in entry.reason
    relaxed = servers.start(repo, exit_on_error=False, strict_readiness=False)
    assert relaxed.ready()


@pytest.mark.parametrize(
    "files,message",
    [
        ({"config.pbtxt": "backend: \"python\"\ninput [ { name: ", "1/model.py": ""}, "config.pbtxt"),
        ({"config.pbtxt": 'name: "other"\nbackend: "python"\n', "1/model.py": ""}, "must match the model's folder name"),
        ({"config.pbtxt": 'backend: "onnxruntime"\n', "1/model.py": ""}, "unable to find backend library for backend 'onnxruntime'"),
        ({"config.pbtxt": 'backend: "python"\n', "abc/model.py": ""}, "no version folder holds 'model.py'"),
        (
            {"config.pbtxt": 'backend: "python"\nversion_policy { specific { versions: [ 5 ] } }\n', "1/model.py": ""},
            "at least one version must be available under the version policy of model 'bad' (version folders: [1])",
        ),
        ({"config.pbtxt": 'backend: "python"\ninstance_group [ { kind: KIND_GPU } ]\n', "1/model.py": ""}, "has kind KIND_GPU but no GPUs are available"),
        ({"config.pbtxt": 'backend: "python"\n', "1/model.py": "class Nope: pass\n"}, "does not define class TritonPythonModel"),
        ({"config.pbtxt": 'backend: "python"\n', "1/model.py": "import not_a_module_anywhere\n"}, "ModuleNotFoundError"),
        (
            {
                "config.pbtxt": 'backend: "python"\n',
                "1/model.py": "import os\nclass TritonPythonModel:\n    def initialize(self, args):\n        os._exit(7)\n",
            },
            "Stub process 'bad_0' is not healthy: its worker process exited with code 7",
        ),
    ],
)
def test_bad_models_fail_to_load_with_a_clear_reason(servers, make_repo, files, message, caplog):
    repo = make_repo("identity", extra={"bad": files})
    with caplog.at_level(logging.ERROR, logger="dlserve.engine"):
        server = servers.start(repo, exit_on_error=False)
    assert server.model("identity").ready()
    (entry,) = [e for (name, _), e in server.models().items() if name == "bad"]
    assert entry.state == "UNAVAILABLE"
    assert message in entry.reason
    (logged,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("failed to load 'bad'")]
    assert message in logged and logged.count("failed to load") == 1  # said once


def test_kind_auto_falls_back_to_cpu(servers, make_repo):
    repo = make_repo(
        extra={
            "auto_kind": {
                "config.pbtxt": (MODELS / "identity" / "config.pbtxt").read_text()
                + "instance_group [ { kind: KIND_AUTO count: 1 } ]\n",
                "1/model.py": (MODELS / "identity" / "1" / "model.py").read_text(),
            }
        }
    )
    server = servers.start(repo)
    assert server.model("auto_kind").config()["instance_group"][0]["kind"] == "KIND_CPU"


def test_poll_mode_picks_up_new_changed_and_removed_models(servers, make_repo):
    repo = make_repo("identity")
    server = servers.start(repo, model_control_mode=ModelControlMode.POLL, repository_poll_secs=3600)
    assert server.model("identity").ready()
    (repo / "add_sub").mkdir()
    (repo / "add_sub" / "config.pbtxt").write_text((MODELS / "add_sub" / "config.pbtxt").read_text())
    (repo / "add_sub" / "1").mkdir()
    (repo / "add_sub" / "1" / "model.py").write_text(ADD_SUB_PY)
    server.poll_model_repository()
    assert server.model("add_sub").ready()
    # change: add_sub now multiplies
    time.sleep(0.01)
    (repo / "add_sub" / "1" / "model.py").write_text(ADD_SUB_PY.replace("(a + b)", "(a * b)"))
    server.poll_model_repository()
    a = np.full(16, 3.0, dtype=np.float32)
    out = list(server.model("add_sub").infer(inputs={"INPUT0": a, "INPUT1": a}))[0]
    assert out.outputs["OUTPUT0"].as_numpy()[0] == 9.0

    shutil.rmtree(repo / "identity")
    server.poll_model_repository()
    assert not server.model("identity").ready()
    with pytest.raises(dlserve.UnavailableError):
        server.load("identity")
    # gone from the index as well, as in Triton (it stayed listed as UNAVAILABLE "unloaded")
    assert [row["name"] for row in server.engine.manager.index()] == ["add_sub"]


def test_poll_mode_reloads_nothing_for_a_config_rewritten_unchanged(servers, make_repo):
    """As Triton 2.51 (measured): a config.pbtxt whose time changed but not its content
    leaves the model as it is; a changed one reloads it (but for an instance_group change
    alone, which updates the instances in place: test_instance_update)."""
    repo = make_repo("multi_instance")
    server = servers.start(repo, model_control_mode=ModelControlMode.POLL, repository_poll_secs=3600)

    def workers() -> set[int]:
        return {i.worker.process.pid for i in server.engine.instances() if i.worker is not None}

    before = workers()
    config = repo / "multi_instance" / "config.pbtxt"
    os.utime(config, ns=(time.time_ns() + 10**9,) * 2)
    server.poll_model_repository()
    assert workers() == before
    config.write_text(config.read_text().replace("count: 2", "count: 1"))
    server.poll_model_repository()
    kept = workers()
    assert len(kept) == 1 and kept < before
    config.write_text(config.read_text() + 'parameters { key: "X" value { string_value: "1" } }\n')
    server.poll_model_repository()
    assert len(workers()) == 1 and not workers() & kept


def test_poll_mode_loads_the_models_it_finds_side_by_side(servers, make_repo, tmp_path):
    """As Triton 2.51 (measured): two new models load at once, not one after the other."""
    repo = make_repo("identity")
    server = servers.start(repo, model_control_mode=ModelControlMode.POLL, repository_poll_secs=3600)
    go = tmp_path / "go"
    waits = f"import os, time\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.02)\n"
    for name in ("first", "second"):
        shutil.copytree(MODELS / "identity", repo / name)
        config = repo / name / "config.pbtxt"
        config.write_text(config.read_text().replace('name: "identity"', f'name: "{name}"'))
        model = repo / name / "1" / "model.py"
        model.write_text(waits + model.read_text())
    polling = threading.Thread(target=server.poll_model_repository)
    polling.start()

    def states() -> dict[str, str]:
        return {row["name"]: row.get("state", "") for row in server.engine.manager.index()}

    wait_until(lambda: states().get("first") == "LOADING" and states().get("second") == "LOADING")
    go.touch()
    polling.join(30)
    assert states() == {"first": "READY", "identity": "READY", "second": "READY"}


def test_a_model_removed_while_a_poll_loads_it_is_unloaded_by_the_next_poll(
    servers, make_repo, tmp_path
):
    """As in Triton (one poll at a time): a poll that finds the folder gone while an
    earlier poll still loads the model waits for that load, then unloads the model and
    drops it from the index. It forgot the model at once: the load went on to start a
    worker nobody knew of, left running past the server's stop."""
    repo = make_repo("identity")
    server = servers.start(repo, model_control_mode=ModelControlMode.POLL, repository_poll_secs=3600)
    started, go = tmp_path / "started", tmp_path / "go"
    waits = (
        "    def initialize(self, args):\n"
        "        import os, time\n"
        f"        open({str(started)!r}, 'w').write(str(os.getpid()))\n"
        f"        while not os.path.exists({str(go)!r}):\n"
        "            time.sleep(0.02)\n\n"
    )
    shutil.copytree(MODELS / "identity", repo / "slow")
    config = repo / "slow" / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "identity"', 'name: "slow"'))
    model = repo / "slow" / "1" / "model.py"
    model.write_text(model.read_text().replace("    def execute", waits + "    def execute"))
    loading = threading.Thread(target=server.poll_model_repository)
    loading.start()
    wait_until(lambda: started.exists() and started.read_text() != "")
    pid = int(started.read_text())
    shutil.rmtree(repo / "slow")
    removing = threading.Thread(target=server.poll_model_repository)
    removing.start()
    removing.join(0.5)
    assert removing.is_alive()  # (it waits for the load)
    go.touch()
    loading.join(30)
    removing.join(30)
    assert [row["name"] for row in server.engine.manager.index()] == ["identity"]
    wait_until(lambda: not pid_alive(pid), timeout=10)


def test_poll_mode_with_no_poll_period_polls_no_more(servers, make_repo):
    """--repository-poll-secs 0 scans once, at startup, as in Triton (it spun a CPU)."""
    repo = make_repo("identity")
    server = servers.start(repo, model_control_mode=ModelControlMode.POLL, repository_poll_secs=0)
    assert server.model("identity").ready()
    shutil.copytree(MODELS / "add_sub", repo / "add_sub")
    time.sleep(1.0)  # (it loaded a new model within a few ms when it scanned without pause)
    assert [row for row in server.engine.manager.index() if row["name"] == "add_sub"] == [{"name": "add_sub"}]


def test_multiple_instances_share_the_load(servers, make_repo):
    server = servers.start(make_repo("multi_instance"))
    seen: set[str] = set()
    pids: set[int] = set()
    lock = threading.Lock()

    def one() -> None:
        response = list(server.model("multi_instance").infer(inputs={"INPUT0": X1}))[0]
        with lock:
            seen.add(response.outputs["INSTANCE"].to_bytes_array()[0].decode())
            pids.add(int(response.outputs["PID"].as_numpy()[0]))

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"multi_instance_0_0", "multi_instance_0_1"}
    assert len(pids) == 2


def _instances_answering(server: dlserve.Server, model: str, requests: int, at_once: int) -> list[str]:
    """The instance that answered each of ``requests`` requests, ``at_once`` in flight."""
    def one(_: int) -> str:
        (response,) = server.model(model).infer(inputs={"INPUT0": X1})
        return response.outputs["INSTANCE"].to_bytes_array()[0].decode()

    with concurrent.futures.ThreadPoolExecutor(at_once) as pool:
        return list(pool.map(one, range(requests)))


def _multi_instance(groups: str) -> dict[str, str]:
    folder = MODELS / "multi_instance"
    config = (folder / "config.pbtxt").read_text().split("instance_group")[0] + f"instance_group [ {groups} ]\n"
    return {"config.pbtxt": config, "1/model.py": (folder / "1" / "model.py").read_text()}


def test_passive_instances_start_but_are_given_no_requests(servers, make_repo):
    """As Triton 2.51 (measured): a passive instance is initialized and never scheduled."""
    groups = '{ count: 1 kind: KIND_CPU }, { count: 1 kind: KIND_CPU passive: true name: "standby" }'
    server = servers.start(make_repo(extra={"standby_model": _multi_instance(groups)}))
    assert set(_instances_answering(server, "standby_model", 8, 4)) == {"standby_model_0_0"}
    (standby,) = [i for i in server.engine.instances() if i.name == "standby_0"]
    assert standby.ready and standby.passive


def test_requests_one_at_a_time_take_turns_over_the_instances(servers, make_repo):
    """As Triton 2.51 (measured): round robin, whatever else woke the scheduler between."""
    server = servers.start(make_repo(extra={"three": _multi_instance("{ count: 3 kind: KIND_CPU }")}))
    answered = _instances_answering(server, "three", 6, 1)
    assert collections.Counter(answered) == {"three_0_0": 2, "three_0_1": 2, "three_0_2": 2}, answered


def test_unload_waits_for_in_flight_requests(servers, make_repo):
    server = servers.start(make_repo("faulty"), model_control_mode=ModelControlMode.EXPLICIT, startup_models=["faulty"])
    results: list[object] = []

    def slow() -> None:
        results.extend(server.model("faulty").infer(inputs={"INPUT0": X1}, parameters={"mode": "sleep:0.5"}))

    thread = threading.Thread(target=slow)
    thread.start()
    time.sleep(0.2)
    server.unload("faulty")
    thread.join()
    assert results and results[0].error is None  # finished, not cut off


def test_unloading_a_decoupled_model_ends_a_stream_it_never_finished(servers, make_repo):
    """Triton's issue 7626 (a model stuck UNLOADING after streaming, finalize never
    called): a stream whose model keeps its sender and never sends the final is ended
    with an error at the unload's deadline, and the model is unloaded."""
    server = servers.start(
        make_repo("decoupled"), model_control_mode=ModelControlMode.EXPLICIT,
        startup_models=["decoupled"], exit_timeout=1,
    )
    stream = server.model("decoupled").infer(
        inputs={"IN": np.array([7], np.int32)}, parameters={"mode": "never_final"},
        raise_on_error=False,
    )
    first = next(stream)
    assert first.error is None and not first.final
    server.unload("decoupled")
    (last,) = list(stream)
    assert last.final and "unloaded before it sent the final response" in last.error.message
    assert rows(server)["decoupled:1"] == {"state": "UNAVAILABLE", "reason": "unloaded"}


class HeldRequest:
    """A request to the ``faulty`` test model that its execute holds until released."""

    def __init__(self, server: dlserve.Server, release: Path) -> None:
        self.release = release
        self.responses: list[dlserve.InferenceResponse] = []
        self.thread = threading.Thread(target=self._send, args=(server,))
        self.thread.start()
        wait_until(lambda: os.path.exists(f"{release}.held"))

    def _send(self, server: dlserve.Server) -> None:
        parameters = {"mode": f"hold:{self.release}"}
        self.responses.extend(server.model("faulty").infer(inputs={"INPUT0": X1}, parameters=parameters))

    def answer(self) -> dlserve.InferenceResponse:
        self.release.touch()
        self.thread.join(30)
        (response,) = self.responses
        return response


def reload_with(server: dlserve.Server, name: str, generation: int) -> None:
    """Reload ``name`` with a config override that differs from the one it serves."""
    config = server.model(name).config()
    config["parameters"] = {"generation": {"string_value": str(generation)}}
    server.load(name, {"config": json.dumps(config)})


def test_a_version_replaced_by_a_reload_is_unloading_while_it_drains(servers, make_repo, tmp_path):
    """As Triton 2.51 (measured): a new version 2 is LOADING while version 1 serves; then
    version 1, holding a request, is UNLOADING until it is answered, then unloaded."""
    repo = make_repo("faulty")
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT, startup_models=["faulty"])
    held = HeldRequest(server, tmp_path / "release")
    go = tmp_path / "go"
    code = (repo / "faulty" / "1" / "model.py").read_text()
    waits = f"while not os.path.exists({str(go)!r}):\n            time.sleep(0.02)\n        "
    (repo / "faulty" / "2").mkdir()
    (repo / "faulty" / "2" / "model.py").write_text(code.replace("folder = args", waits + "folder = args", 1))
    loading = threading.Thread(target=server.load, args=("faulty",))
    loading.start()
    wait_until(lambda: rows(server).get("faulty:2", {}).get("state") == "LOADING")
    assert rows(server)["faulty:1"] == {"state": "READY", "reason": None}
    go.touch()
    loading.join(30)
    assert rows(server) == {"faulty:1": {"state": "UNLOADING", "reason": None}, "faulty:2": {"state": "READY", "reason": None}}
    assert held.answer().error is None
    wait_until(lambda: rows(server)["faulty:1"] == UNLOADED)


def test_a_reload_returns_while_the_replaced_version_finishes_its_requests(servers, make_repo, tmp_path):
    """As in Triton: a reload returns once the new version serves, while a request the
    replaced version holds finishes there (and counts, over the reload); the replaced
    version's worker ends after it."""
    server = servers.start(make_repo("faulty"), model_control_mode=ModelControlMode.EXPLICIT, startup_models=["faulty"])
    (old_pid,) = worker_pids(server, "faulty")
    held = HeldRequest(server, tmp_path / "release")
    reload_with(server, "faulty", 1)
    assert held.thread.is_alive()  # the load did not wait for the held request
    (answer,) = server.model("faulty").infer(inputs={"INPUT0": X1})
    assert int(answer.outputs["PID"].as_numpy()[0]) != old_pid  # the new version serves
    assert held.answer().error is None
    wait_until(lambda: not pid_alive(old_pid))
    fams = families(server.metrics())
    assert value(fams, "nv_inference_request_success", model="faulty", version="1") == 2


def test_an_idle_model_stopped_with_no_time_left_is_not_said_to_have_requests(servers, make_repo, caplog):
    server = servers.start(make_repo("add_sub"), exit_timeout=0)
    with caplog.at_level(logging.WARNING, logger="dlserve"):
        # (no time for its finalize either: as tritonserver, that expires the exit timeout)
        with pytest.raises(dlserve.InternalError, match="^Exit timeout expired"):
            servers.stop(server)
    assert not [r for r in caplog.records if "still had requests in flight" in r.getMessage()]


def test_stop_raises_as_tritonserver_when_the_exit_timeout_drops_a_request(servers, make_repo):
    server = servers.start(make_repo("faulty"), exit_timeout=1)
    stuck = server.model("faulty").infer(inputs={"INPUT0": X1}, parameters={"mode": "sleep:30"}, raise_on_error=False)
    time.sleep(0.3)  # (queued or executing, it is in flight either way)
    with pytest.raises(dlserve.InternalError, match="^Exit timeout expired. Exiting immediately.$"):
        servers.stop(server)  # (which checks nothing was left behind all the same)
    assert next(stuck).error is not None


def test_an_in_process_request_while_stop_drains_is_unavailable(servers, make_repo, tmp_path):
    """As tritonserver's: a request made while stop() waits for those in flight is refused
    UNAVAILABLE, in Triton's words (it was NOT_FOUND: its model was being unloaded)."""
    server = servers.start(make_repo("faulty", "identity"))
    held = HeldRequest(server, tmp_path / "release")
    engine = server.engine
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stopping = pool.submit(servers.stop, server)
        wait_until(lambda: not engine.live)
        for name in ("faulty", "identity"):  # (the busy model, an idle one)
            with pytest.raises(dlserve.UnavailableError, match="^Server is stopping, scheduler"):
                server.model(name).infer(inputs={"INPUT0": X1})
        assert held.answer().error is None
        stopping.result(timeout=30)


def test_an_in_process_request_racing_the_start_of_stop_is_unavailable(servers, make_repo):
    """A request that found the server live just before stop() began, and looked its model
    up once the stop was unloading it, was refused NOT_FOUND ("has no available versions"):
    as every request the stop refuses, it is UNAVAILABLE, in Triton's words."""
    server = servers.start(make_repo("identity"))
    entry = server.engine.manager.models[("", "identity")]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stopping: list[concurrent.futures.Future[None]] = []

        class NameLookedUpAsTheStopBegins(str):
            def __hash__(self) -> int:  # (the engine's model lookup: the stop starts now)
                if not stopping:
                    stopping.append(pool.submit(servers.stop, server))
                    wait_until(lambda: entry.versions.get(1) is None or not entry.versions[1].ready)
                return str.__hash__(self)

        model = server.model(NameLookedUpAsTheStopBegins("identity"))
        with pytest.raises(dlserve.UnavailableError, match="^Server is stopping, scheduler"):
            model.infer(inputs={"INPUT0": X1})
        assert stopping
        stopping[0].result(timeout=30)


class Attempt:
    """``call()`` on a thread of its own (a daemon: one that hangs holds nothing up)."""

    def __init__(self, call: Any) -> None:
        self._outcome = "hung"
        self._thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self._thread.start()

    def _run(self, call: Any) -> None:
        try:
            call()
            self._outcome = "returned"
        except Exception as exc:  # noqa: BLE001 - the outcome
            self._outcome = f"{type(exc).__name__}: {exc}"

    def outcome(self, timeout: float = 10) -> str:
        """"returned", the error it raised ("Type: message"), or "hung"."""
        self._thread.join(timeout)
        return self._outcome


def test_calls_racing_the_end_of_a_stop_raise_as_on_a_stopped_server(
    servers, make_repo, monkeypatch
):
    """A call from another thread while stop() ends the engine's loop (made here as the
    stopped loop closes: before, then after) raises "Server not started": handed to the
    stopped loop, it waited forever; to the closed one, it raised the loop's RuntimeError.
    So does an infer validated before the stop and queued after it (it waited forever)."""
    outcomes: list[str] = []

    class ClosingLoop(uvloop.Loop):
        def close(self) -> None:
            closing.set()
            racing = (infer, Attempt(server.ready), Attempt(server.models))
            outcomes.extend(call.outcome() for call in racing)
            super().close()
            outcomes.append(Attempt(server.ready).outcome())

    monkeypatch.setattr(inprocess, "_new_event_loop", ClosingLoop)
    server = servers.start(make_repo("identity"))
    engine, validated, closing = server.engine, threading.Event(), threading.Event()
    prepare = engine.prepare

    def prepare_then_wait(request: Any, model: Any = None) -> Any:
        chosen = prepare(request, model)
        validated.set()
        closing.wait(30)
        return chosen

    monkeypatch.setattr(engine, "prepare", prepare_then_wait)
    infer = Attempt(lambda: list(server.model("identity").infer(inputs={"INPUT0": X1})))
    assert validated.wait(30)
    servers.stop(server)
    assert outcomes == ["InvalidArgumentError: Server not started"] * 4


def test_a_stop_racing_another_waits_for_it(servers, make_repo, tmp_path, monkeypatch, caplog):
    """Two threads stopping the server: the second returns once the first's stop is done,
    without stopping anything itself (it ran a stop of its own at the same time: the
    engine's twice, and at their ends the second could wait forever on the loop the first
    ended, or raise the closed loop's RuntimeError)."""
    server = servers.start(make_repo("faulty"))
    held = HeldRequest(server, tmp_path / "release")  # (the first stop waits for it)
    engine, checked = server.engine, threading.Event()
    engine_or_raise = server._engine_or_raise

    def check() -> Any:  # (what stop() does first)
        checked.set()
        return engine_or_raise()

    def stop_then_ask() -> None:
        server.stop()
        server.ready()  # (raises: the server was stopped)

    with caplog.at_level(logging.INFO, logger="dlserve.engine"):
        first = Attempt(lambda: servers.stop(server))
        wait_until(lambda: not engine.live)
        monkeypatch.setattr(server, "_engine_or_raise", check)
        second = Attempt(stop_then_ask)
        assert checked.wait(30)  # (the second stop found the server started)
        assert held.answer().error is None
        assert first.outcome(30) == "returned"
        assert second.outcome(30) == "InvalidArgumentError: Server not started"
    said = [r.getMessage() for r in caplog.records]
    assert said.count("Waiting for in-flight requests to complete.") == 1


def test_a_stop_made_inside_the_stop_on_its_own_thread_returns_at_once(servers, make_repo):
    """As a signal handler's stop() does when its signal lands on the thread already in
    stop() (a second SIGTERM): it returns at once, and the stop it interrupted ends the
    server. It waited for the lock its own thread held, forever."""
    server = servers.start(make_repo("faulty"))
    inner: list[str] = []

    class Reentering:  # a service whose stopping calls stop() again, on the stopping thread
        def _stopping(self, deadline: float) -> None:
            inner.append(_outcome(server.stop))

    server._attach(Reentering())
    outer = Attempt(lambda: servers.stop(server))
    assert outer.outcome(30) == "returned"
    assert inner == ["returned"]


def _outcome(call: Any) -> str:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the outcome
        return f"{type(exc).__name__}: {exc}"
    return "returned"


class StoppingAllocator(dlserve.MemoryAllocator):
    """Stops the server from the allocator's thread, then gives host memory."""

    def __init__(self, server: dlserve.Server, first: threading.Event | None = None) -> None:
        self.server, self.first, self.outcome = server, first, "not called"

    def allocate(self, size: int, memory_type: Any, memory_type_id: int, tensor_name: str) -> Any:
        if self.first is not None:
            wait_until(lambda: not self.server.engine.live)  # (the other stop has begun)
        self.outcome = _outcome(self.server.stop)
        return HostMemoryAllocator().allocate(size, memory_type, memory_type_id, tensor_name)


@pytest.mark.parametrize("other_stop", [True, False], ids=["beside-another-stop", "alone"])
def test_a_stop_from_an_output_allocator_returns_and_the_server_stops(
    servers, make_repo, other_stop
):
    """An allocator's stop() cannot wait for the stop, which waits for the allocator's
    thread: it returns at once, the stop going on (started on a thread of its own when
    none runs). Beside another thread's stop, both waited for each other forever."""
    server = servers.start(make_repo("faulty"))
    allocator = StoppingAllocator(server, threading.Event() if other_stop else None)
    call = server.model("faulty").infer(
        inputs={"INPUT0": X1}, parameters={"mode": "sleep:0.3"}, output_memory_allocator=allocator
    )
    outer = Attempt(lambda: servers.stop(server)) if other_stop else None
    responses = list(call)
    assert [r.error for r in responses] == [None]
    assert allocator.outcome == "returned"
    if outer is not None:
        assert outer.outcome(30) == "returned"
    else:
        wait_until(lambda: server._loop is None, 30)
        servers.servers.remove(server)
    with pytest.raises(dlserve.InvalidArgumentError, match="Server not started"):
        server.ready()


HANGING_FINALIZE = """
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([]) for _ in requests]

    def finalize(self):
        time.sleep(60)
"""


def test_stop_raises_as_tritonserver_when_a_finalize_outlasts_the_exit_timeout(servers, make_repo):
    """Triton 2.51 counts a model whose finalize has not returned as live at its exit
    timeout ("Found 1 live models"): the stop fails and tritonserver exits 1. The worker
    is killed at the deadline all the same."""
    config = 'backend: "python"\noutput [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
    repo = make_repo(extra={"hang_finalize": {"config.pbtxt": config, "1/model.py": HANGING_FINALIZE}})
    server = servers.start(repo, exit_timeout=1)
    wait_until(lambda: server.model("hang_finalize").ready(), 30)
    started = time.monotonic()
    with pytest.raises(dlserve.InternalError, match="^Exit timeout expired. Exiting immediately.$"):
        servers.stop(server)  # (which checks nothing was left behind all the same)
    assert time.monotonic() - started < 10


def test_model_logs_reach_the_server_log(servers, make_repo, caplog):
    server = servers.start(make_repo("logger"), log_verbose=1)
    with caplog.at_level(logging.DEBUG, logger="dlserve.model.logger"):
        list(server.model("logger").infer(inputs={"INPUT0": X1}))
        deadline = time.monotonic() + 5
        while len([r for r in caplog.records if r.name == "dlserve.model.logger"]) < 7:
            assert time.monotonic() < deadline, caplog.records
            time.sleep(0.02)
    by_message = {r.getMessage(): r.levelno for r in caplog.records if r.name == "dlserve.model.logger"}
    assert by_message["info message"] == logging.INFO
    assert by_message["warning message"] == logging.WARNING
    assert by_message["error message"] == logging.ERROR
    assert by_message["verbose message"] == logging.DEBUG
    assert by_message["explicit level message"] == logging.ERROR
    # Python logging in the model, with its logger's name and the traceback:
    assert by_message["logger_model: python warning message"] == logging.WARNING
    (error,) = [m for m in by_message if m.startswith("logger_model: python error message")]
    assert by_message[error] == logging.ERROR
    assert "Traceback" in error and "ZeroDivisionError: division by zero" in error


CONFIGURES_ITS_LOGGING = """
import logging
import logging.config

FORMAT = "%(levelname)s|%(name)s|%(message)s"
HOW = "{how}"
if HOW == "basicConfig":
    logging.basicConfig(level=logging.INFO, format=FORMAT)
elif HOW == "guarded":  # (configure only where nothing is configured)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format=FORMAT)
else:  # a handler of its own on its logger (records propagate to the root: none there)
    logging.config.dictConfig({
        "version": 1, "formatters": {"f": {"format": FORMAT}},
        "handlers": {"h": {"class": "logging.StreamHandler", "formatter": "f"}},
        "loggers": {"configured": {"handlers": ["h"], "level": "INFO"}},
    })
log = logging.getLogger("configured")


class TritonPythonModel:
    def initialize(self, args):
        log.info("info it asked for")
        log.debug("debug it did not")
        logging.getLogger("configured.child").warning("a warning, its way")

    def execute(self, requests):
        return []
"""


@pytest.mark.parametrize("how", ["basicConfig", "guarded", "dictConfig"])
def test_a_model_that_configures_its_logging_gets_what_it_configured(
    servers, make_repo, capfd, caplog, how
):
    """As in Triton (and plain Python): a model's own logging configuration shows its INFO
    records, on the worker's stderr (which the server passes on) in its own format, once
    each. A handler of dlserve's on the worker's root logger made basicConfig do nothing
    (they were dropped), or logged them twice."""
    code = CONFIGURES_ITS_LOGGING.replace("{how}", how)
    model = {"config.pbtxt": 'backend: "python"\n', "1/model.py": code}
    repo = make_repo(extra={"configured": model})
    servers.start(repo)
    deadline = time.monotonic() + 10
    err = ""
    while "a warning, its way" not in err:
        assert time.monotonic() < deadline, err
        time.sleep(0.05)
        err += capfd.readouterr().err
    assert err.count("INFO|configured|info it asked for") == 1
    assert err.count("WARNING|configured.child|a warning, its way") == 1
    assert "debug it did not" not in err
    assert not [r for r in caplog.records if r.name.startswith("dlserve.model")]  # (not twice)


LOGS_WITH_THE_MODULE_FUNCTIONS = """
import logging


class TritonPythonModel:
    def initialize(self, args):
        logging.warning("first, through the root logger")  # (calls basicConfig() if no handler)
        logging.getLogger("mine").error("then through its own")

    def execute(self, requests):
        return []
"""


def test_module_level_logging_calls_keep_the_model_s_records_in_the_server_log(
    servers, make_repo, caplog
):
    model = {"config.pbtxt": 'backend: "python"\n', "1/model.py": LOGS_WITH_THE_MODULE_FUNCTIONS}
    with caplog.at_level(logging.DEBUG, logger="dlserve.model.plain"):
        servers.start(make_repo(extra={"plain": model}))
        deadline = time.monotonic() + 5
        while len([r for r in caplog.records if r.name == "dlserve.model.plain"]) < 2:
            assert time.monotonic() < deadline, caplog.records
            time.sleep(0.02)
    lines = {r.getMessage(): r.levelno for r in caplog.records if r.name == "dlserve.model.plain"}
    assert lines == {"root: first, through the root logger": logging.WARNING,
                     "mine: then through its own": logging.ERROR}


LOGGER_MISUSE_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils
from dlserve.ipc.protocol import Kind
from dlserve.pb_utils import _runtime


class TritonPythonModel:
    def execute(self, requests):
        refused = []
        for call in (
            lambda: pb_utils.Logger.log("level 7", 7),
            lambda: pb_utils.Logger.log("a plain int", 1),
            lambda: pb_utils.Logger.log_info(12345),
            lambda: pb_utils.Logger.log_info(None),
        ):
            try:
                call()
            except TypeError as exc:
                refused.append(str(exc).splitlines()[0])
        pb_utils.Logger.log(b"bytes, as their text", pb_utils.Logger.LogLevel.WARNING)
        _runtime.current().notify(Kind.LOG, (7, "a malformed line"))  # as a bad worker would
        answer = np.array([len(refused)], dtype=np.float32)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", answer)]) for _ in requests]
"""


def test_a_logger_call_triton_refuses_raises_in_the_model_and_the_server_goes_on(servers, make_repo, caplog):
    """As Triton 2.51 (measured): ``Logger.log`` with a level that is not a
    ``Logger.LogLevel`` and ``log_info`` of a non-str raise TypeError in the model; bytes
    are logged as their text. A malformed log message from a worker is said and dropped:
    its instance serves on (it used to lose its channel and restart)."""
    config = (MODELS / "logger" / "config.pbtxt").read_text()
    repo = make_repo(extra={"misuse": {"config.pbtxt": config, "1/model.py": LOGGER_MISUSE_PY}})
    server = servers.start(repo)
    worker = server.engine.model("misuse").instances[0].pid
    with caplog.at_level(logging.INFO, logger="dlserve"):
        for _ in range(2):
            (response,) = server.model("misuse").infer(inputs={"INPUT0": X1})
            assert response.outputs["OUTPUT0"].as_numpy().tolist() == [4]  # each refused: TypeError
        wait_until(lambda: len([r for r in caplog.records if "malformed log line" in r.getMessage()]) == 2)
    assert server.engine.model("misuse").instances[0].pid == worker  # not restarted
    (bytes_line, _) = [r for r in caplog.records if r.name == "dlserve.model.misuse"]
    assert bytes_line.getMessage() == "bytes, as their text" and bytes_line.levelno == logging.WARNING
    assert bytes_line.source == "model.py:21"  # the model's line that logged it
    assert "level 7" not in caplog.text and "12345" not in caplog.text


def test_stop_runs_finalize(servers, make_repo, tmp_path):
    marker = tmp_path / "finalized.txt"
    model = f"""
class TritonPythonModel:
    def execute(self, requests):
        return []

    def finalize(self):
        open({str(marker)!r}, "w").write("done")
"""
    repo = make_repo(extra={"final": {"config.pbtxt": 'backend: "python"\n', "1/model.py": model}})
    server = servers.start(repo)
    servers.stop(server)
    assert marker.read_text() == "done"


def test_a_finalize_that_raises_is_logged_as_in_triton(servers, make_repo, caplog):
    model = """
class TritonPythonModel:
    def execute(self, requests):
        return []

    def finalize(self):
        raise RuntimeError("finalize went wrong")
"""
    repo = make_repo(extra={"final_fails": {"config.pbtxt": 'backend: "python"\n', "1/model.py": model}})
    server = servers.start(repo)
    with caplog.at_level(logging.ERROR, logger="dlserve"):
        servers.stop(server)
    (record,) = [r for r in caplog.records if "finalize() failed" in r.getMessage()]
    assert record.levelno == logging.ERROR
    assert record.getMessage().startswith(
        "model instance 'final_fails_0': finalize() failed: RuntimeError: finalize went wrong"
    ), record.getMessage()
    assert record.getMessage().endswith("final_fails/1/model.py(7): finalize\n")  # where, as Triton's "At:"


def test_server_start_twice_and_calls_before_start(make_repo):
    server = dlserve.Server(model_repository=str(make_repo("identity")))
    with pytest.raises(dlserve.InvalidArgumentError, match="Server not started"):
        server.ready()
    server.start()
    try:
        with pytest.raises(dlserve.InvalidArgumentError, match="Server already started"):
            server.start()
    finally:
        server.stop()
    with pytest.raises(dlserve.InternalError, match="^failed to stat file /definitely/not/here$"):  # (Triton's)
        dlserve.Server(model_repository="/definitely/not/here").start()


def test_model_is_ready_hook_drives_model_readiness(servers, make_repo, tmp_path):
    flag = tmp_path / "ready"
    flag.write_text("yes")
    model = f"""
import pathlib


class TritonPythonModel:
    def execute(self, requests):
        return []

    def is_ready(self):
        text = pathlib.Path({str(flag)!r}).read_text()
        return {{"yes": True, "no": False}}.get(text, text)
"""
    repo = make_repo(extra={"probe": {"config.pbtxt": 'backend: "python"\n', "1/model.py": model}})
    server = servers.start(repo)
    assert server.model("probe").ready()
    flag.write_text("no")
    assert not server.model("probe").ready()
    flag.write_text("yes")
    assert server.model("probe").ready()
    flag.write_text("ready")  # not a bool: not ready, as in Triton (its QA returns_non_boolean)
    assert not server.model("probe").ready()
    flag.write_text("yes")
    assert server.model("probe").ready()


def test_index_shows_loading_while_a_model_loads_and_the_server_is_not_ready(servers, make_repo):
    """As Triton (strict readiness): a model loading is a model not yet available, so the
    server says it is not ready until the load ends (readiness probes wait for it); so
    is a version a reload adds, while a reload of the versions that serve keeps it ready."""
    slow = """
import time


class TritonPythonModel:
    def initialize(self, args):
        time.sleep(1.0)

    def execute(self, requests):
        return []
"""
    repo = make_repo(extra={"slow": {"config.pbtxt": 'backend: "python"\n', "1/model.py": slow}})
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)

    def load_watching() -> tuple[set[tuple[tuple[str, int], str]], set[bool]]:
        """Load 'slow'; the (model, state) pairs and server readiness seen meanwhile.
        The server stays live throughout: liveness probes (Triton's issue 7014: a pod
        restarted for probing readiness) must not fail while a model loads."""
        thread = threading.Thread(target=server.load, args=("slow",))
        thread.start()
        states: set[tuple[tuple[str, int], str]] = set()
        server_ready: set[bool] = set()
        while thread.is_alive():
            states.update((key, m.state) for key, m in server.models().items() if key[0] == "slow")
            server_ready.add(server.ready())
            assert server.live()
            time.sleep(0.05)
        thread.join()
        return states, server_ready

    states, server_ready = load_watching()
    assert (("slow", 1), "LOADING") in states and False in server_ready  # (its version, as Triton)
    assert server.models()[("slow", 1)].state == "READY" and server.ready()
    # A reload (a file changed): the loaded version serves until the new one replaces it,
    # so still ready.
    model_py = repo / "slow" / "1" / "model.py"
    os.utime(model_py, ns=(model_py.stat().st_atime_ns, model_py.stat().st_mtime_ns + 10**9))
    assert load_watching()[1] == {True}
    # A reload that adds a version: not ready until the new version serves, as Triton.
    (repo / "slow" / "2").mkdir()
    (repo / "slow" / "2" / "model.py").write_text(slow)
    (repo / "slow" / "config.pbtxt").write_text('backend: "python"\nversion_policy { all { } }\n')
    assert False in load_watching()[1] and server.ready()
    assert {key for key in server.models() if key[0] == "slow"} == {("slow", 1), ("slow", 2)}


def test_a_load_cancelled_while_the_model_initializes_leaves_no_worker(servers, make_repo):
    """A load cancelled halfway (whoever awaited it went away) ends the worker it started
    at once: it used to stay, running, in no model's instances, and a later load started
    another."""
    initializing = """
import os
import time


class TritonPythonModel:
    def initialize(self, args):
        open(os.path.join(args["model_repository"], "INITIALIZING"), "w").close()
        time.sleep(2)

    def execute(self, requests):
        return []
"""
    slow = {"config.pbtxt": 'backend: "python"\n', "1/model.py": initializing}
    repo = make_repo(extra={"slow": slow})
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    prefix = server.engine.segment_prefix
    load = asyncio.run_coroutine_threadsafe(server.engine.load("slow"), server.loop)
    wait_until(lambda: (repo / "slow" / "INITIALIZING").exists())
    load.cancel()
    wait_until(lambda: not worker_processes(prefix), timeout=5)
    server.load("slow")
    assert server.model("slow").ready()
    assert len(worker_processes(prefix)) == 1


SECOND_INSTANCE_WAITS = """
import os
import time


class TritonPythonModel:
    def initialize(self, args):
        go = os.path.join(args["model_repository"], "GO")
        while args["model_instance_name"].endswith("_1") and not os.path.exists(go):
            time.sleep(0.02)

    def execute(self, requests):
        return []
"""


def _instances_config(count: int) -> str:
    return f'backend: "python"\ninstance_group [ {{ count: {count} kind: KIND_CPU }} ]\n'


def _ready_while_loading(server: dlserve.Server) -> int:
    """The READY instances of the versions the loads in flight start or add to."""
    return sum(
        instance.ready
        for version in server.engine.manager.loader.starting
        if isinstance(version, ModelVersion)
        for instance in [*version.instances, *version._adding]
    )


def test_a_load_cancelled_while_one_instance_initializes_ends_those_that_started(
    servers, make_repo
):
    """Cancelled while its second instance initializes, a load ends the first one's worker
    too: it had started, and ran on outside the index, past the server's stop."""
    two = {"config.pbtxt": _instances_config(2), "1/model.py": SECOND_INSTANCE_WAITS}
    repo = make_repo(extra={"two": two})
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    prefix = server.engine.segment_prefix
    load = asyncio.run_coroutine_threadsafe(server.engine.load("two"), server.loop)
    wait_until(lambda: _ready_while_loading(server) == 1)
    load.cancel()
    wait_until(lambda: not worker_processes(prefix), timeout=5)
    assert [row["name"] for row in server.engine.manager.index()] == ["two"]  # (not loaded)
    (repo / "two" / "GO").touch()
    server.load("two")
    assert server.model("two").ready() and len(worker_processes(prefix)) == 2


def test_a_stop_during_a_polls_load_ends_the_instances_that_started(servers, make_repo, tmp_path):
    """The stop cancels the poll loading a model whose second instance initializes: the
    first one's worker, started already, ends with the server (it ran on after stop())."""
    repo = make_repo("identity")
    server = servers.start(repo, model_control_mode=ModelControlMode.POLL, repository_poll_secs=0.1)
    new = tmp_path / "two"
    (new / "1").mkdir(parents=True)
    (new / "config.pbtxt").write_text(_instances_config(2))
    (new / "1" / "model.py").write_text(SECOND_INSTANCE_WAITS)
    new.rename(repo / "two")  # (whole, for the poll)
    wait_until(lambda: _ready_while_loading(server) == 1)
    servers.stop(server)  # (it checks that no worker of the server is left)


def test_a_cancelled_instance_group_update_ends_the_instances_it_started(servers, make_repo):
    """An update in place from one instance to three, cancelled while the third initializes:
    the second's worker ends (it ran on, in no instance list), the first serves on."""
    grow = {"config.pbtxt": _instances_config(1), "1/model.py": SECOND_INSTANCE_WAITS}
    repo = make_repo(extra={"grow": grow})
    server = servers.start(
        repo, model_control_mode=ModelControlMode.EXPLICIT, startup_models=["grow"]
    )
    prefix = server.engine.segment_prefix
    serving = worker_processes(prefix)
    (repo / "grow" / "config.pbtxt").write_text(_instances_config(3))
    load = asyncio.run_coroutine_threadsafe(server.engine.load("grow"), server.loop)
    wait_until(lambda: _ready_while_loading(server) == 2)  # (the one serving, one added)
    load.cancel()
    wait_until(lambda: worker_processes(prefix) == serving, timeout=5)
    assert server.model("grow").ready()
    stats = server.model("grow").statistics()["model_stats"][0]
    assert [instance["name"] for instance in stats["instances"]] == ["grow_0_0"]


FAILS_ONCE_ANOTHER_STARTED = """
import json
import os
import time


class TritonPythonModel:
    # The instance 'fails' names (version:index) raises once the one 'hangs' names has
    # started; that one's finalize then hangs.
    def initialize(self, args):
        roles = json.loads(args["model_config"])["parameters"]
        index = args["model_instance_name"].rsplit("_", 1)[1]
        me = f"{args['model_version']}:{index}"
        self.folder = args["model_repository"]
        self.hangs = me == roles["hangs"]["string_value"]
        started = os.path.join(self.folder, "STARTED")
        if me == roles["fails"]["string_value"]:
            while not os.path.exists(started):
                time.sleep(0.02)
            raise RuntimeError("it fails")
        if self.hangs:
            open(started, "w").close()

    def finalize(self):
        if self.hangs:
            open(os.path.join(self.folder, "FINALIZING"), "w").close()
            time.sleep(60)

    def execute(self, requests):
        return []
"""


def _roles(fails: str, hangs: str) -> str:
    return "".join(
        f'parameters {{ key: "{role}" value: {{ string_value: "{who}" }} }}\n'
        for role, who in {"fails": fails, "hangs": hangs}.items()
    )


def test_a_stop_while_a_polls_failed_load_stops_its_other_version_ends_it(
    servers, make_repo, tmp_path
):
    """Version 2 fails to start; the stop cancels the poll while version 1, started, is
    being stopped again (its finalize hangs): its worker ends with the server (it ran on,
    in no index, past stop())."""
    repo = make_repo("identity")
    server = servers.start(repo, model_control_mode=ModelControlMode.POLL, repository_poll_secs=0.1)
    new = tmp_path / "pair"
    config = _instances_config(1) + "version_policy: { all {} }\n" + _roles("2:0", "1:0")
    for version in ("1", "2"):
        (new / version).mkdir(parents=True)
        (new / version / "model.py").write_text(FAILS_ONCE_ANOTHER_STARTED)
    (new / "config.pbtxt").write_text(config)
    new.rename(repo / "pair")  # (whole, for the poll)
    wait_until(lambda: (repo / "pair" / "FINALIZING").exists())
    servers.stop(server)  # (it checks that no worker of the server is left)


def test_an_instance_group_update_cancelled_while_a_failed_start_stops_the_others_ends_them(
    servers, make_repo
):
    """An update in place from one instance to three whose third fails, cancelled while the
    second, started, is being stopped again (its finalize hangs): the second's worker ends
    (it ran on, in no instance list), the first serves on."""
    roles = _roles("1:2", "1:1")
    grow = {"config.pbtxt": _instances_config(1) + roles, "1/model.py": FAILS_ONCE_ANOTHER_STARTED}
    repo = make_repo(extra={"grow": grow})
    server = servers.start(
        repo, model_control_mode=ModelControlMode.EXPLICIT, startup_models=["grow"]
    )
    prefix = server.engine.segment_prefix
    serving = worker_processes(prefix)
    (repo / "grow" / "config.pbtxt").write_text(_instances_config(3) + roles)
    load = asyncio.run_coroutine_threadsafe(server.engine.load("grow"), server.loop)
    wait_until(lambda: (repo / "grow" / "FINALIZING").exists())
    load.cancel()
    wait_until(lambda: worker_processes(prefix) == serving, timeout=5)
    assert server.model("grow").ready()
    stats = server.model("grow").statistics()["model_stats"][0]
    assert [instance["name"] for instance in stats["instances"]] == ["grow_0_0"]


HANGS_IN_INITIALIZE = """
import time

class TritonPythonModel:
    def initialize(self, args):
        time.sleep(3600)

    def execute(self, requests):
        return []
"""


HANGS_IN_AUTO_COMPLETE = """
import time

class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        time.sleep(3600)
        return config

    def execute(self, requests):
        return []
"""


@pytest.mark.parametrize(
    ("model", "options"),
    [(HANGS_IN_INITIALIZE, {}), (HANGS_IN_INITIALIZE, {"model_load_retry_count": 2}), (HANGS_IN_AUTO_COMPLETE, {})],
    ids=["initialize", "initialize-with-retries", "auto-complete"],
)
def test_stop_ends_a_load_that_never_finishes_at_the_exit_timeout(servers, make_repo, model, options):
    config = 'backend: "python"\ninput [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
    repo = make_repo("identity", extra={"stuck": {"config.pbtxt": config, "1/model.py": model}})
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT, startup_models=["identity"],
                           exit_timeout=1, **options)
    outcome: list[BaseException | None] = []

    def load() -> None:
        try:
            server.load("stuck")
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            outcome.append(exc)

    loader = threading.Thread(target=load)
    loader.start()
    deadline = time.monotonic() + 20
    while not server.engine.manager.loader.starting:  # initialize or auto_complete running
        assert time.monotonic() < deadline
        time.sleep(0.05)
    stopper = threading.Thread(target=servers.stop, args=(server,))  # checks nothing leaked
    stopper.start()
    stopper.join(30)
    assert not stopper.is_alive(), "stop() waited on the stuck load"
    loader.join(10)
    assert outcome and isinstance(outcome[0], dlserve.TritonError)


SPINS_IN_AUTO_COMPLETE = """
class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        while True:  # holds the GIL: the stacks still come (faulthandler dumps from C)
            pass

    def execute(self, requests):
        return []
"""

HANGS_IN_WARMUP = """
import threading

class TritonPythonModel:
    def execute(self, requests):
        threading.Event().wait()
"""
_WARMUP = 'model_warmup [ { name: "w" batch_size: 1 inputs { key: "X" value { data_type: TYPE_FP32 dims: [ 1 ] zero_data: true } } } ]'

ASYNC_BLOCKS_IN_INITIALIZE = """
import time

class TritonPythonModel:
    async def initialize(self, args):  # (run on the worker's loop for the model)
        time.sleep(3600)

    async def execute(self, requests):
        return []
"""

ASYNC_AWAITS_IN_INITIALIZE = """
import asyncio

class TritonPythonModel:
    async def initialize(self, args):  # (suspended: on no thread's stack)
        await asyncio.sleep(3600)

    async def execute(self, requests):
        return []
"""


@pytest.mark.parametrize(
    ("model", "config", "options", "what", "where"),
    [
        (HANGS_IN_INITIALIZE, "", {}, "loading model instance 'stuck_0'", "in initialize"),
        (HANGS_IN_INITIALIZE, "", {"model_load_retry_count": 1}, "loading model instance 'stuck_0'",
         "in initialize"),
        (SPINS_IN_AUTO_COMPLETE, "", {}, "auto_complete_config of model 'stuck'", "in auto_complete_config"),
        (HANGS_IN_WARMUP, _WARMUP, {}, "loading model instance 'stuck_0'", "in execute"),
        (ASYNC_BLOCKS_IN_INITIALIZE, "", {}, "loading model instance 'stuck_0'", "in initialize"),
        (ASYNC_AWAITS_IN_INITIALIZE, "", {}, "loading model instance 'stuck_0'", None),
    ],
    ids=["initialize", "initialize-with-retries", "auto-complete", "warmup", "async-blocks", "async-awaits"],
)
def test_a_load_that_outlasts_the_model_load_timeout_fails_saying_where_the_model_was(
    servers, make_repo, model, config, options, what, where
):
    """``model_load_timeout`` (``--model-load-timeout-secs``) ends a worker stuck in
    starting, and the load's error shows the model's stack at that moment: the
    answer to "why is my model stuck loading" (Triton has no such limit)."""
    config = 'backend: "python"\ninput [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]\n' + config
    repo = make_repo("identity", extra={"stuck": {"config.pbtxt": config, "1/model.py": model}})
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT, startup_models=["identity"],
                           model_load_timeout=1, **options)
    prefix = server.engine.segment_prefix
    started = time.monotonic()
    with pytest.raises(dlserve.InvalidArgumentError) as failure:
        server.load("stuck")
    took = time.monotonic() - started
    message = failure.value.message
    assert f"{what} did not finish within 1 s (the model load timeout), so its worker was ended" in message
    if where is None:  # an async hook awaiting something is on no thread's stack
        assert "no thread was in the model's code (every thread's stack is in the log)" in message
    else:
        # Innermost first (a library's frames above the model's), down to the model's own
        # entry point: none of the worker's frames under it.
        frames = message.split("it was at (most recent call first):\n", 1)[1].rstrip().rstrip(";").splitlines()
        assert re.fullmatch(r'  File ".*/stuck/1/model\.py", line \d+ ' + where, frames[-1]), message
        assert not any("dlserve/ipc" in frame for frame in frames), message
    assert took < 1 + 20 * (1 + options.get("model_load_retry_count", 0))
    assert not server.model("stuck").ready()
    assert len(worker_processes(prefix)) == 1  # identity's; the stuck ones are gone
    x = np.ones(1, dtype=np.float32)
    (answer,) = server.model("identity").infer(inputs={"INPUT0": x})  # the server serves on
    np.testing.assert_array_equal(answer.outputs["OUTPUT0"].as_numpy(), x)


def test_asking_workers_for_their_stacks_as_they_start_does_not_kill_them(servers, make_repo):
    """A worker learns to dump its stacks (STACKS_SIGNAL) only once its Python runs: the
    signal stays blocked until then, else its default action ended a starting worker."""
    server = servers.start(make_repo("identity"), model_control_mode=ModelControlMode.EXPLICIT)
    asking = threading.Event()

    def ask() -> None:
        while not asking.wait(0.005):
            server.loop.call_soon_threadsafe(server.engine.dump_worker_stacks)

    asker = threading.Thread(target=ask)
    asker.start()
    try:
        for _ in range(3):
            server.load("identity")  # (raised "killed by signal 41" before)
            server.unload("identity", wait_until_unloaded=True)
    finally:
        asking.set()
        asker.join()


@pytest.mark.parametrize("timeout", [-1, float("nan")])
def test_a_negative_model_load_timeout_is_refused(servers, make_repo, timeout):
    with pytest.raises(dlserve.InvalidArgumentError, match="model_load_timeout must be >= 0"):
        servers.start(make_repo("identity"), model_load_timeout=timeout)


def test_poll_mode_loads_an_ensemble_again_once_its_failed_step_is_fixed(servers, make_repo):
    """As Triton's: an ensemble that failed to load because its step did not serve loads
    once a poll brings the step (it stayed unavailable until its own files changed)."""
    repo = make_repo("add_sub", "identity", "pipeline")
    model = repo / "identity" / "1" / "model.py"
    working = model.read_text()
    model.write_text("raise RuntimeError('broken step')\n" + working)
    polling = {"model_control_mode": ModelControlMode.POLL, "repository_poll_secs": 3600}
    server = servers.start(repo, exit_on_error=False, **polling)
    assert not server.model("pipeline").ready()
    server.poll_model_repository()  # nothing changed: nothing loads
    assert not server.model("pipeline").ready()
    model.write_text(working)
    server.poll_model_repository()
    assert server.model("identity").ready() and server.model("pipeline").ready()
    a = np.arange(16, dtype=np.float32)
    (answer,) = server.model("pipeline").infer(inputs={"A": a, "B": a})
    np.testing.assert_array_equal(answer.outputs["SUM"].as_numpy(), a * 2)


_SCALE_STEP = """
name: "scale" backend: "python" max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""
_SCALE_PY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2)]) for r in requests]
"""
_SCALED = """
name: "scaled" platform: "ensemble" max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [ { model_name: "scale" model_version: -1
  input_map { key: "X" value: "X" } output_map { key: "OUT" value: "Y" } } ] }
"""


def test_an_ensemble_a_reloaded_step_no_longer_fits_is_unloaded(servers, make_repo):
    """As Triton 2.51 (side by side): a step reloaded with new code serves the ensemble
    on; one reloaded with its output renamed unloads the ensemble (it stayed READY and
    failed every request)."""
    repo = make_repo(extra={
        "scale": {"config.pbtxt": _SCALE_STEP, "1/model.py": _SCALE_PY},
        "scaled": {"config.pbtxt": _SCALED, "1/.keep": ""},
    })
    server = servers.start(
        repo, model_control_mode=ModelControlMode.EXPLICIT, startup_models=["scaled"]
    )
    x = np.ones(4, dtype=np.float32)

    def scaled() -> list[float]:
        (answer,) = server.model("scaled").infer(inputs={"X": x})
        return answer.outputs["Y"].as_numpy().tolist()

    assert scaled() == [2.0] * 4
    code = repo / "scale" / "1" / "model.py"
    code.write_text(_SCALE_PY.replace("* 2", "* 10"))
    server.load("scale")
    assert scaled() == [10.0] * 4  # the same ensemble, on the step's new version
    config = repo / "scale" / "config.pbtxt"
    config.write_text(_SCALE_STEP.replace('"OUT"', '"RENAMED"'))
    code.write_text(_SCALE_PY.replace('"OUT"', '"RENAMED"'))
    server.load("scale")
    assert server.model("scale").ready() and not server.model("scaled").ready()
    index = {row["name"]: row for row in server.engine.manager.index()}
    assert index["scaled"]["state"] == "UNAVAILABLE" and index["scaled"]["reason"] == "unloaded"


def test_a_load_that_reaches_the_engine_after_stop_began_starts_no_worker(
    servers, make_repo, tmp_path
):
    """A load that outlives its client (it is shielded) may come after the stop unloaded
    the model: it starts nothing then, not even auto-complete's worker (which did start)."""
    marker = tmp_path / "auto_completed"
    model = (MODELS / "auto_complete" / "1" / "model.py").read_text().replace(
        "        config = auto_complete_model_config.as_dict()\n",
        f"        open({str(marker)!r}, 'w').close()\n"
        "        config = auto_complete_model_config.as_dict()\n",
    )
    repo = make_repo(extra={"late": {"config.pbtxt": 'backend: "python"\n', "1/model.py": model}})
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    server.engine.manager.loader.stopping = True  # (what stop() sets first)
    with pytest.raises(dlserve.UnavailableError, match="the server is stopping"):
        server.load("late")
    assert not marker.exists()


@pytest.mark.parametrize("value", ["No", "false", ""])
def test_force_cpu_only_input_tensors_takes_yes_or_no(servers, make_repo, value):
    """As Triton's Python backend: FORCE_CPU_ONLY_INPUT_TENSORS is "yes" or "no"; any other
    value fails the load, naming the parameter and the value (a typo is not read as yes)."""
    repo = make_repo("add_sub")
    config = repo / "add_sub" / "config.pbtxt"
    config.write_text(
        config.read_text()
        + f'parameters {{ key: "FORCE_CPU_ONLY_INPUT_TENSORS" value: {{ string_value: "{value}" }} }}\n'
    )
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    with pytest.raises(dlserve.TritonError, match=f"Incorrect value for FORCE_CPU_ONLY_INPUT_TENSORS: '{value}'"):
        server.load("add_sub")
    config.write_text(config.read_text().replace(f'string_value: "{value}"', 'string_value: "no"'))
    server.load("add_sub")  # "no" on a machine without CUDA: host inputs stay host inputs
    a = np.arange(16, dtype=np.float32)
    (response,) = server.model("add_sub").infer(inputs={"INPUT0": a, "INPUT1": a})
    np.testing.assert_array_equal(response.outputs["OUTPUT0"].as_numpy(), a + a)
