"""Python-based backends (Triton's): models whose config names a backend other than
"python" run ``<backend directory>/<backend>/model.py`` (tests/backends/arithmetic), with
their data in their version folders; driven in-process and, as Triton's
python_based_backends QA test drives them, through tritonclient over gRPC."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

import dlserve
from dlserve import ModelControlMode

from ..conftest import MODELS
from .test_cli import Serve

BACKENDS = Path(__file__).resolve().parent.parent / "backends"
A = np.arange(4, dtype=np.float32)
B = np.full(4, 0.5, dtype=np.float32)


def arithmetic_model(repo: Path, name: str, operation: str, versions: tuple[int, ...] = (1,), config: str = "") -> None:
    """A model of the arithmetic backend: only its config and, per version, its data."""
    for version in versions:
        folder = repo / name / str(version)
        folder.mkdir(parents=True)
        (folder / "model.json").write_text(json.dumps({"operation": operation}))
    (repo / name / "config.pbtxt").write_text(config or 'backend: "arithmetic"\n')


def infer(server: dlserve.Server, name: str, version: int = -1) -> tuple[np.ndarray, str]:
    (response,) = server.model(name, version).infer(inputs={"INPUT0": A, "INPUT1": B})
    assert response.error is None, response.error
    return np.from_dlpack(response.outputs["OUTPUT"]), response.outputs["MODEL_DIR"].to_string_array()[0]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    arithmetic_model(repo, "add", "add", versions=(1, 2))
    arithmetic_model(repo, "sub", "sub")
    return repo


def test_models_run_their_backends_model_py_with_their_own_data(servers, repo):
    server = servers.start(str(repo), backend_directory=str(BACKENDS), model_control_mode=ModelControlMode.EXPLICIT)
    # (Triton's QA test loads "add" this way: a config override, two versions)
    server.load("add", {"config": json.dumps({"backend": "arithmetic", "version_policy": {"latest": {"num_versions": 2}}})})
    server.load("sub")
    for version in (1, 2):
        output, model_dir = infer(server, "add", version)
        np.testing.assert_array_equal(output, A + B)
        assert model_dir == str(repo / "add" / str(version))  # pb_utils.get_model_dir()
    output, model_dir = infer(server, "sub")
    np.testing.assert_array_equal(output, A - B)
    assert model_dir == str(repo / "sub" / "1")
    config = server.model("sub").config()
    # its inputs and outputs come from the backend's auto_complete_config; runtime and
    # default_model_filename as Triton 2.51 shows them for such a model
    assert [i["name"] for i in config["input"]] == ["INPUT0", "INPUT1"]
    assert (config["backend"], config["runtime"], config["default_model_filename"]) == ("arithmetic", "model.py", "")


def test_a_python_model_beside_them_runs_its_own_file(servers, repo):
    (repo / "add_sub").symlink_to(MODELS / "add_sub")
    server = servers.start(str(repo), backend_directory=str(BACKENDS))
    x = np.ones(16, dtype=np.float32)
    (response,) = server.model("add_sub").infer(inputs={"INPUT0": x, "INPUT1": x})
    np.testing.assert_array_equal(np.from_dlpack(response.outputs["OUTPUT0"]), x + x)
    config = server.model("add_sub").config()
    assert (config["runtime"], config["default_model_filename"]) == ("", "model.py")
    np.testing.assert_array_equal(infer(server, "sub")[0], A - B)


@pytest.mark.parametrize(
    "config,code,words",
    [
        (
            'backend: "nowhere"\n',
            dlserve.InvalidArgumentError,
            "unable to find backend library for backend 'nowhere', try specifying runtime on the model configuration.",
        ),
        ('backend: "arithmetic"\nruntime: "other.py"\n', dlserve.UnsupportedError, "runtime 'other.py' is not served"),
        ('platform: "onnxruntime_onnx"\n', dlserve.UnsupportedError, "this config asks for 'onnxruntime_onnx'"),
    ],
)
def test_a_model_without_a_python_backend_fails_its_load_naming_why(servers, repo, config, code, words):
    arithmetic_model(repo, "bad", "add", config=config)
    server = servers.start(str(repo), backend_directory=str(BACKENDS), model_control_mode=ModelControlMode.EXPLICIT)
    with pytest.raises(dlserve.TritonError) as failure:
        server.load("bad")
    # (Triton's layout: the version's failure, with its code's words)
    assert failure.value.message.startswith("load failed for model 'bad': version 1 is at UNAVAILABLE state: ")
    assert isinstance(failure.value, code)
    assert words in failure.value.message
    assert server.models()[("bad", 1)].state == "UNAVAILABLE"
    server.load("sub")  # the server serves on
    np.testing.assert_array_equal(infer(server, "sub")[0], A - B)


def test_the_backend_directory_defaults_to_tritons(servers, repo):
    server = servers.start(str(repo), model_control_mode=ModelControlMode.EXPLICIT)
    with pytest.raises(dlserve.InvalidArgumentError, match="/opt/tritonserver/backends/arithmetic/model.py is not a file"):
        server.load("sub")


def test_tritonclient_over_grpc_against_the_command_line(tmp_path, repo):
    """Triton's python_based_backends QA flow, against ``dlserve serve --backend-directory``."""
    server = Serve(
        tmp_path,
        ["--model-repository", str(repo), "--model-control-mode", "explicit", "--backend-directory", str(BACKENDS)],
    )
    try:
        server.wait_started()
        with grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports['grpc']}") as client:
            client.load_model("add", config='{"backend":"arithmetic","version_policy":{"latest":{"num_versions":2}}}')
            client.load_model("sub")
            for name, version, expected in (("add", "2", A + B), ("add", "1", A + B), ("sub", "", A - B)):
                assert client.is_model_ready(name, version)
                inputs = [grpcclient.InferInput(n, [4], "FP32") for n in ("INPUT0", "INPUT1")]
                inputs[0].set_data_from_numpy(A)
                inputs[1].set_data_from_numpy(B)
                result = client.infer(name, inputs, model_version=version, outputs=[grpcclient.InferRequestedOutput("OUTPUT")])
                np.testing.assert_array_equal(result.as_numpy("OUTPUT"), expected)
            assert client.get_model_metadata("sub").platform == "arithmetic"
            arithmetic_model(repo, "nowhere", "add", config='backend: "nowhere"\n')
            with pytest.raises(InferenceServerException, match="unable to find backend library for backend 'nowhere'"):
                client.load_model("nowhere")
        assert server.stop()[0] == 0
        server.assert_clean()
    finally:
        server.kill()
