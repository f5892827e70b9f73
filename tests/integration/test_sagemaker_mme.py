"""SageMaker multi-model endpoints (``/models``): archives loaded, listed, invoked and
unloaded as SageMaker drives a container, the errors it can meet, and what is left
behind (nothing: workers end, repositories are unregistered)."""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from dlserve import ModelControlMode

from ..conftest import MODELS
from .test_cli import A, B, add_sub_body
from .test_sagemaker import BINARY, add_sub_inputs, post, sagemaker

TARGET = "X-Amzn-SageMaker-Target-Model"


def call(port: int, method: str, path: str, body: object = None, headers: dict | None = None):
    """(status, content type, body) of one request; ``body`` is JSON unless bytes."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    content_type = (headers or {}).get("Content-Type", "application/json")
    return post(port, path, data, content_type, method, headers)


def archive(root: Path, name: str, *models: str, model_folder: bool = False) -> Path:
    """What SageMaker unpacks for one model: ``root/name/model`` holding the model
    folder itself (``model_folder``) or model folders."""
    path = root / name / "model"
    if model_folder:
        shutil.copytree(MODELS / models[0], path)
    else:
        for model in models:
            shutil.copytree(MODELS / model, path / model)
    return path


@pytest.fixture
def endpoint(servers, tmp_path):
    """An EXPLICIT-mode server with an empty repository and its SageMaker service, with
    model namespacing, as deploy/sagemaker/serve runs it (and Triton's SageMaker image)."""
    (tmp_path / "empty").mkdir()
    server = servers.start(tmp_path / "empty", model_control_mode=ModelControlMode.EXPLICIT, model_namespacing=True)
    with sagemaker(server) as service:
        yield server, service.port


def test_a_model_archive_loaded_listed_invoked_and_unloaded(endpoint, tmp_path):
    server, port = endpoint
    url = archive(tmp_path / "models", "a1b2", "add_sub", model_folder=True)
    assert call(port, "POST", "/models", {"model_name": "a1b2", "url": str(url)}, {TARGET: "add.tar.gz"})[0] == 200
    assert server.model("add.tar.gz").ready()  # served as the target model
    listing = {"modelName": "a1b2", "modelUrl": str(url.parent)}
    assert json.loads(call(port, "GET", "/models")[2]) == {"models": [listing]}
    assert json.loads(call(port, "GET", "/models/a1b2")[2]) == listing

    # Invoked with the binary extension, as tritonclient builds the body for SageMaker.
    outputs = [httpclient.InferRequestedOutput(n, binary_data=True) for n in ("OUTPUT0", "OUTPUT1")]
    body, length = httpclient.InferenceServerClient.generate_request_body(add_sub_inputs(), outputs=outputs)
    status, content_type, raw = call(
        port, "POST", "/models/a1b2/invoke", body,
        {"Content-Type": f"{BINARY};json-header-size={length}", TARGET: "add.tar.gz"},
    )
    assert status == 200 and content_type.startswith(f"{BINARY};json-header-size="), raw
    result = httpclient.InferenceServerClient.parse_response_body(raw, header_length=int(content_type.split("=")[1]))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)
    # Without the header, the model it was loaded as.
    status, _, raw = call(port, "POST", "/models/a1b2/invoke", add_sub_body())
    assert status == 200 and json.loads(raw)["model_name"] == "add.tar.gz"

    pid = server.engine.manager.models.find("add.tar.gz").versions[1].instances[0].pid
    assert call(port, "DELETE", "/models/a1b2", headers={TARGET: "add.tar.gz"})[0] == 200
    assert not server.model("add.tar.gz").ready()
    assert not Path(f"/proc/{pid}").exists()  # its worker ended
    assert json.loads(call(port, "GET", "/models")[2]) == {"models": []}
    assert call(port, "GET", "/models/a1b2")[0] == 404
    # The repository was unregistered: the same archive loads again.
    assert call(port, "POST", "/models", {"model_name": "a1b2", "url": str(url)})[0] == 200
    assert call(port, "POST", "/models/a1b2/invoke", add_sub_body())[0] == 200


def test_an_ensemble_archive_serves_the_ensemble_and_unloads_its_steps(endpoint, tmp_path):
    server, port = endpoint
    url = archive(tmp_path / "models", "e1", "pipeline", "add_sub", "identity")
    assert call(port, "POST", "/models", {"model_name": "e1", "url": str(url)})[0] == 200
    body = {"inputs": [{"name": "A", "datatype": "FP32", "shape": [16], "data": A.tolist()},
                       {"name": "B", "datatype": "FP32", "shape": [16], "data": B.tolist()}]}
    status, _, raw = call(port, "POST", "/models/e1/invoke", body)
    assert status == 200, raw
    outputs = {o["name"]: o["data"] for o in json.loads(raw)["outputs"]}
    assert outputs == {"SUM": (A + B).tolist(), "DIFF": (A - B).tolist()}
    assert json.loads(call(port, "GET", "/models")[2])["models"] == [{"modelName": "e1", "modelUrl": str(url)}]
    assert call(port, "DELETE", "/models/e1")[0] == 200
    assert not any(model.ready() for model in server.models().values())  # steps too


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{not json", 400, "failed to parse"),
        ({"model_name": 5, "url": "x"}, 400, "must be non-empty strings"),
        ({"url": "/tmp"}, 400, "must be non-empty strings"),
        ({"model_name": "m", "url": "/proc/self"}, 400, "cannot be under /dev, /proc or /sys"),
        ({"model_name": "m", "url": "/nonexistent/model"}, 400, "repository not found"),
        ({"model_name": "m", "url": "TWO_MODELS"}, 400, "2 model folders and no ensemble"),
        ({"model_name": "m", "url": "FAILING"}, 400, "weights file is missing"),
        ({"model_name": "m", "url": "OUT_OF_MEMORY"}, 507, "out of memory"),
    ],
)
def test_bad_loads_get_clear_errors_and_leave_nothing_registered(endpoint, tmp_path, body, status, message):
    server, port = endpoint
    root = tmp_path / "models"
    urls = {
        "TWO_MODELS": archive(root, "two", "add_sub", "identity"),
        "FAILING": archive(root, "fail", "init_fail", model_folder=True),
        "OUT_OF_MEMORY": archive(root, "oom", "init_fail", model_folder=True),
    }
    model_py = urls["OUT_OF_MEMORY"] / "1" / "model.py"
    model_py.write_text(model_py.read_text().replace(
        'RuntimeError("cannot initialize: weights file is missing")', 'MemoryError("out of memory")'))
    url = urls.get(body.get("url")) if isinstance(body, dict) else None
    if url is not None:
        body = {**body, "url": str(url)}
    got, _, raw = call(port, "POST", "/models", body)
    assert got == status, raw
    assert message in json.loads(raw)["error"]
    assert json.loads(call(port, "GET", "/models")[2]) == {"models": []}
    if url is not None:  # a failed load leaves its repository unregistered
        server.register_model_repository(str(url.parent))
        server.unregister_model_repository(str(url.parent))
    good = archive(root, "good", "add_sub", model_folder=True)
    assert call(port, "POST", "/models", {"model_name": "m", "url": str(good)})[0] == 200


def test_names_and_paths_taken_unknown_models_and_other_methods(endpoint, tmp_path):
    server, port = endpoint
    url = archive(tmp_path / "models", "h", "add_sub", model_folder=True)
    assert call(port, "POST", "/models", {"model_name": "m", "url": str(url)})[0] == 200
    status, _, raw = call(port, "POST", "/models", {"model_name": "m", "url": str(url)})
    assert status == 409 and "already loaded" in json.loads(raw)["error"]
    status, _, raw = call(port, "POST", "/models", {"model_name": "other", "url": str(url)})
    assert status == 409 and "already been registered" in json.loads(raw)["error"]
    for method, path in [("GET", "/models/nope"), ("POST", "/models/nope/invoke"),
                         ("DELETE", "/models/nope"), ("DELETE", "/models")]:
        status, _, raw = call(port, method, path, add_sub_body() if method == "POST" else None)
        assert (status, raw) == (404, b"")
    status, _, raw = call(port, "PUT", "/models/m")
    assert (status, raw) == (400, b"")
    status, _, raw = call(port, "POST", "/models/m/invoke", {"inputs": []})
    assert status == 400 and "expected 2 inputs" in json.loads(raw)["error"]
    assert call(port, "POST", "/models/m/invoke", add_sub_body())[0] == 200  # still serving


def test_outside_explicit_mode_loads_are_refused(servers, make_repo):
    server = servers.start(make_repo("add_sub"))  # model control mode NONE
    with sagemaker(server, default_model="add_sub") as service:
        status, _, raw = call(service.port, "POST", "/models", {"model_name": "m", "url": str(MODELS / "identity")})
        assert status == 400 and "not allowed if model control mode is not EXPLICIT" in json.loads(raw)["error"]
        assert call(service.port, "POST", "/invocations", add_sub_body())[0] == 200



def test_a_load_whose_client_hangs_up_still_completes_and_is_recorded(endpoint, tmp_path):
    server, port = endpoint
    url = archive(tmp_path / "models", "slow", "add_sub", model_folder=True)
    model_py = url / "1" / "model.py"
    model_py.write_text(model_py.read_text().replace(
        "    def initialize(self, args):\n", "    def initialize(self, args):\n        __import__('time').sleep(1.0)\n", 1))
    body = json.dumps({"model_name": "slow", "url": str(url)}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /models HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.3)  # the load is under way; the client goes away
    deadline = time.monotonic() + 30
    while call(port, "GET", "/models/slow")[0] != 200:
        assert time.monotonic() < deadline, "the load was dropped with its client"
        time.sleep(0.1)
    assert call(port, "POST", "/models/slow/invoke", add_sub_body())[0] == 200
    assert call(port, "DELETE", "/models/slow")[0] == 200
    assert call(port, "POST", "/models", {"model_name": "slow", "url": str(url)})[0] == 200  # nothing left over


def test_a_failed_ensemble_archive_leaves_no_model_loaded(endpoint, tmp_path):
    server, port = endpoint
    url = archive(tmp_path / "models", "bad", "pipeline", "add_sub", "identity")
    model_py = url / "identity" / "1" / "model.py"
    model_py.write_text((MODELS / "init_fail" / "1" / "model.py").read_text())
    status, _, raw = call(port, "POST", "/models", {"model_name": "bad", "url": str(url)})
    assert status == 400 and "did not load" in json.loads(raw)["error"], raw
    assert not any(model.ready() for model in server.models().values())  # add_sub went again
    server.register_model_repository(str(url))  # and the repository is not registered
    server.unregister_model_repository(str(url))


def test_two_ensemble_archives_with_steps_of_the_same_name_each_run_their_own(endpoint, tmp_path):
    """Model namespacing: each archive's ensemble runs the step models of its own archive,
    and unloading one archive leaves the other's steps serving."""
    server, port = endpoint
    first = archive(tmp_path / "models", "e1", "pipeline", "add_sub", "identity")
    second = archive(tmp_path / "models", "e2", "pipeline", "add_sub", "identity")
    swapped = second / "add_sub" / "1" / "model.py"  # the second's add_sub answers a - b, a + b
    swapped.write_text(swapped.read_text().replace('"OUTPUT0"', '"OUTPUTx"').replace('"OUTPUT1"', '"OUTPUT0"')
                       .replace('"OUTPUTx"', '"OUTPUT1"'))
    body = {"inputs": [{"name": "A", "datatype": "FP32", "shape": [16], "data": A.tolist()},
                       {"name": "B", "datatype": "FP32", "shape": [16], "data": B.tolist()}],
            "outputs": [{"name": "SUM"}]}

    def total(name: str) -> list[float]:
        status, _, raw = call(port, "POST", f"/models/{name}/invoke", body)
        assert status == 200, raw
        return json.loads(raw)["outputs"][0]["data"]

    assert call(port, "POST", "/models", {"model_name": "e1", "url": str(first)})[0] == 200
    assert call(port, "POST", "/models", {"model_name": "e2", "url": str(second)})[0] == 200
    assert total("e1") == (A + B).tolist() and total("e2") == (A - B).tolist()
    assert call(port, "DELETE", "/models/e1")[0] == 200
    assert total("e2") == (A - B).tolist()
    assert sorted(key[1] for key, entry in server.engine.manager.models.items() if entry.versions) == [
        "add_sub", "e2", "identity"]


@pytest.mark.parametrize("first_single", [True, False])
def test_an_archive_whose_model_is_named_as_another_archive_s_target_is_refused(endpoint, tmp_path, first_single):
    """Step names may repeat across archives, but not a target's: it is served by name."""
    server, port = endpoint
    single = ("add_sub", archive(tmp_path / "models", "add_sub", "add_sub", model_folder=True))
    pipeline = ("e1", archive(tmp_path / "models", "e1", "pipeline", "add_sub", "identity"))
    first, second = (single, pipeline) if first_single else (pipeline, single)
    assert call(port, "POST", "/models", {"model_name": first[0], "url": str(first[1])})[0] == 200
    status, _, raw = call(port, "POST", "/models", {"model_name": second[0], "url": str(second[1])})
    assert status == 409 and "already has a model of that name" in json.loads(raw)["error"], raw
    assert call(port, "GET", f"/models/{second[0]}")[0] == 404
    invoke = add_sub_body() if first is single else {"inputs": [
        {"name": "A", "datatype": "FP32", "shape": [16], "data": A.tolist()},
        {"name": "B", "datatype": "FP32", "shape": [16], "data": B.tolist()}]}
    assert call(port, "POST", f"/models/{first[0]}/invoke", invoke)[0] == 200  # untouched
    assert call(port, "DELETE", f"/models/{first[0]}")[0] == 200
    assert not any(entry.versions for entry in server.engine.manager.models.values())

