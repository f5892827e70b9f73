"""Model namespacing (``model_namespacing`` / ``--model-namespacing``): each repository a
namespace, the same model name served from several, as Triton 2.51 does it (measured
side by side with the same two repositories): a bare name loaded from two repositories
is an error naming the ambiguity, an ensemble's steps run its own repository's models
(else the only one there is), BLS calls resolve the bare name, load and unload by name
take every model of that name, metrics carry a ``namespace`` label."""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import dlserve
from dlserve import ModelControlMode
from dlserve.frontends import KServeGrpc, KServeHttp, Metrics

from ..conftest import MODELS, wait_until

AMBIGUOUS = "There are 2 identifiers of model 'm' in global map, model namespace must be provided to resolve ambiguity."

ADDER = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.add = float(json.loads(args["model_config"])["parameters"]["ADD"]["string_value"])

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() + np.float32(self.add))])
            for r in requests
        ]
'''


def config(name: str, kind: str, rest: str) -> str:
    """A config.pbtxt: FP32[-1] INPUT0 in, OUTPUT0 out."""
    return f"""name: "{name}"
{kind}
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
{rest}
"""


def adder(name: str, add: int) -> dict[str, str]:
    rest = f'parameters {{ key: "ADD" value: {{ string_value: "{add}" }} }}'
    return {"config.pbtxt": config(name, 'backend: "python"', rest), "1/model.py": ADDER}


def ensemble(name: str, step: str) -> dict[str, str]:
    rest = f"""ensemble_scheduling {{ step [ {{ model_name: "{step}" model_version: -1
  input_map {{ key: "INPUT0" value: "INPUT0" }} output_map {{ key: "OUTPUT0" value: "OUTPUT0" }} }} ] }}"""
    return {"config.pbtxt": config(name, 'platform: "ensemble"', rest), "1/.keep": ""}


def write(repo: Path, models: dict[str, dict[str, str]]) -> Path:
    for name, files in models.items():
        for relative, text in files.items():
            path = repo / name / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return repo


@pytest.fixture
def repositories(tmp_path: Path) -> list[Path]:
    """R1: m (+1), only1 (+100), ens_1 -> m, bls1 (BLS to the model its request names);
    R2: m (+2), ens_2 -> m, cross -> only1 (found in R1 only)."""
    r1 = write(tmp_path / "R1", {"m": adder("m", 1), "only1": adder("only1", 100), "ens_1": ensemble("ens_1", "m")})
    shutil.copytree(MODELS / "bls", r1 / "bls1")
    r2 = write(tmp_path / "R2", {"m": adder("m", 2), "ens_2": ensemble("ens_2", "m"), "cross": ensemble("cross", "only1")})
    return [r1, r2]


X = np.array([10, 20], np.float32)


def run(server: dlserve.Server, model: str, **parameters: str) -> list[float]:
    (response,) = server.model(model).infer(inputs={"INPUT0": X}, parameters=parameters, raise_on_error=False)
    if response.error is not None:
        raise response.error
    return np.from_dlpack(response.outputs["OUTPUT0"]).tolist()


def test_each_repository_serves_its_own_model_and_a_bare_name_loaded_twice_is_ambiguous(servers, repositories):
    r1, r2 = repositories
    server = servers.start([str(r1), f"{r2}/"], model_namespacing=True)  # a namespace is the path as given
    wait_until(server.ready)
    rows = [(row["name"], row.get("state")) for row in server.engine.manager.index()]
    assert rows.count(("m", "READY")) == 2, rows
    # As Triton 2.51 lists them (side by side): by repository, then by name.
    assert [name for name, _ in rows] == ["bls1", "ens_1", "m", "only1", "cross", "ens_2", "m"]

    # Each ensemble runs its own repository's m; one may take the only model of a name
    # from another repository.
    assert run(server, "ens_1") == [11, 21]
    assert run(server, "ens_2") == [12, 22]
    assert run(server, "cross") == [110, 120]
    steps = {name: server.model(name).config()["ensemble_scheduling"]["step"][0]["model_namespace"]
             for name in ("ens_1", "ens_2", "cross")}
    assert steps == {"ens_1": str(r1), "ens_2": f"{r2}/", "cross": str(r1)}
    assert run(server, "only1") == [110, 120]  # a name in one repository is no problem

    with KServeHttp(server, KServeHttp.Options(address="127.0.0.1", port=0)) as service:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{service.port}")
        inputs = [httpclient.InferInput("INPUT0", [2], "FP32")]
        inputs[0].set_data_from_numpy(X)
        for call in (lambda: client.infer("m", inputs), lambda: client.get_model_metadata("m"),
                     lambda: client.get_model_config("m")):
            with pytest.raises(InferenceServerException) as caught:
                call()
            assert caught.value.status() == "400" and caught.value.message() == AMBIGUOUS
        with pytest.raises(InferenceServerException) as caught:  # (Triton 2.51's, side by side)
            client.get_inference_statistics("m")
        assert caught.value.status() == "400" and caught.value.message() == "requested model 'm' is not available"
        assert not client.is_model_ready("m")
        assert client.is_model_ready("ens_1") and client.is_model_ready("cross")
        index = [row for row in client.get_model_repository_index() if row["name"] == "m"]
        assert index == [{"name": "m", "version": "1", "state": "READY"}] * 2
        # A BLS call names a model, not a repository: ambiguous too.
        with pytest.raises(InferenceServerException, match="There are 2 identifiers of model 'm'"):
            client.infer("bls1", inputs, parameters={"route": "m"})
        client.close()
    with KServeGrpc(server, KServeGrpc.Options(address="127.0.0.1", port=0)) as service:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{service.port}")
        inputs = [grpcclient.InferInput("INPUT0", [2], "FP32")]
        inputs[0].set_data_from_numpy(X)
        with pytest.raises(InferenceServerException) as caught:
            client.infer("m", inputs)
        assert caught.value.status() == "StatusCode.INVALID_ARGUMENT" and caught.value.message() == AMBIGUOUS
        assert client.infer("ens_2", inputs).as_numpy("OUTPUT0").tolist() == [12, 22]
        assert not client.is_model_ready("m")
        client.close()

    # Every model's statistics (Triton 2.51 fails this request whenever namespacing is on).
    names = sorted(row["name"] for row in server.engine.statistics()["model_stats"])
    assert names == ["bls1", "cross", "ens_1", "ens_2", "m", "m", "only1"]


def test_metrics_carry_the_namespace(servers, repositories):
    r1, r2 = repositories
    server = servers.start([str(r1), str(r2)], model_namespacing=True)
    wait_until(server.ready)
    run(server, "ens_2")
    run(server, "ens_2")
    run(server, "ens_1")
    with Metrics(server, Metrics.Options(address="127.0.0.1", port=0)) as service:
        text = urllib.request.urlopen(f"http://127.0.0.1:{service.port}/metrics").read().decode()
    assert f'nv_inference_request_success{{model="m",namespace="{r1}",version="1"}} 1' in text
    assert f'nv_inference_request_success{{model="m",namespace="{r2}",version="1"}} 2' in text
    assert f'nv_inference_request_failure{{model="m",namespace="{r2}",reason="BACKEND",version="1"}} 0' in text


def test_explicit_load_and_unload_take_every_model_of_the_name(servers, repositories):
    server = servers.start([str(r) for r in repositories], model_namespacing=True,
                           model_control_mode=ModelControlMode.EXPLICIT)
    manager = server.engine.manager
    server.load("m")
    assert sorted(key for key, entry in manager.models.items() if entry.versions) == [
        (str(repositories[0]), "m"), (str(repositories[1]), "m")]
    server.unload("m")
    assert [row.get("reason") for row in manager.index() if row["name"] == "m"] == ["unloaded"] * 2

    # An ensemble loads its own repository's step (Triton 2.51 loaded both m's).
    server.load("ens_2")
    assert run(server, "ens_2") == [12, 22]
    assert [key for key, entry in manager.models.items() if entry.versions and key[1] == "m"] == [
        (str(repositories[1]), "m")]
    # The only m loaded now answers the bare name, BLS calls included (as in Triton).
    assert run(server, "m") == [12, 22]
    server.load("bls1")
    assert run(server, "bls1", route="m") == [12, 22]

    server.load("ens_1")  # its own m: now two are loaded, and the bare name is ambiguous again
    assert run(server, "ens_1") == [11, 21]
    with pytest.raises(dlserve.InvalidArgumentError, match="There are 2 identifiers"):
        run(server, "m")

    # unload_dependents takes the ensemble's own step only.
    server.unload("ens_1", unload_dependents=True)
    assert [key for key, entry in manager.models.items() if entry.versions and key[1] == "m"] == [
        (str(repositories[1]), "m")]
    assert run(server, "ens_2") == [12, 22]
    # Unloading a step unloads the ensembles that use it, not another repository's.
    server.load("ens_1")
    server.unload("m")
    assert not server.model("ens_1").ready() and not server.model("ens_2").ready()


def test_without_namespacing_a_name_in_two_repositories_is_refused(servers, repositories):
    server = servers.start([str(r) for r in repositories], exit_on_error=False, strict_readiness=False)
    rows = {row["name"]: row for row in server.engine.manager.index()}
    assert rows["m"]["state"] == "UNAVAILABLE"
    assert "appears in more than one model repository" in rows["m"]["reason"]
    assert "--model-namespacing" in rows["ens_1"]["reason"]
    assert run(server, "cross") == [110, 120]


def test_poll_reloads_only_the_changed_repository_s_model(servers, repositories):
    r1, r2 = repositories
    server = servers.start([str(r1), str(r2)], model_namespacing=True,
                           model_control_mode=ModelControlMode.POLL, repository_poll_secs=3600)
    wait_until(server.ready)
    manager = server.engine.manager
    pids = {key: manager.models[key].versions[1].instances[0].pid for key in ((str(r1), "m"), (str(r2), "m"))}
    config = r2 / "m" / "config.pbtxt"
    config.write_text(config.read_text().replace('string_value: "2"', 'string_value: "5"'))
    server.poll_model_repository()
    assert run(server, "ens_2") == [15, 25] and run(server, "ens_1") == [11, 21]
    assert manager.models[(str(r1), "m")].versions[1].instances[0].pid == pids[(str(r1), "m")]
    assert manager.models[(str(r2), "m")].versions[1].instances[0].pid != pids[(str(r2), "m")]
    shutil.rmtree(r2 / "m")
    server.poll_model_repository()
    # Its step went with the folder: the ensemble runs the m there is now, R1's, as Triton
    # 2.51 re-resolves it (upstream L0_model_namespacing test_dynamic_resolution, side by side).
    assert run(server, "ens_2") == [11, 21]
    assert run(server, "m") == [11, 21]  # and the bare name is R1's alone
    write(r2, {"m": adder("m", 2)})
    server.poll_model_repository()
    assert run(server, "ens_2") == [12, 22]  # its own repository's again
    assert run(server, "ens_1") == [11, 21]
    with pytest.raises(dlserve.InvalidArgumentError, match="There are 2 identifiers of model 'm'"):
        run(server, "m")


def test_an_upload_replaces_the_model_of_that_name_in_its_repository(servers, repositories):
    server = servers.start([str(r) for r in repositories], model_namespacing=True,
                           model_control_mode=ModelControlMode.EXPLICIT)
    server.load("ens_1")  # R1's m, as a step
    files = adder("m", 7)
    config = {"name": "m", "backend": "python", "parameters": {"ADD": {"string_value": "7"}},
              "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
              "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}]}
    server.load("m", {"config": json.dumps(config), "file:1/model.py": files["1/model.py"].encode()})
    assert run(server, "m") == [17, 27]  # one m, the upload
    assert run(server, "ens_1") == [17, 27]  # in R1's place


def test_a_step_whose_folder_went_is_taken_from_the_other_repository(servers, repositories):
    r1, r2 = repositories
    server = servers.start([str(r1), str(r2)], model_namespacing=True,
                           model_control_mode=ModelControlMode.EXPLICIT)
    server.load("ens_1")
    server.unload("ens_1", unload_dependents=True)
    shutil.rmtree(r1 / "m")
    server.load("ens_1")  # its own m is gone (an unloaded entry is left): R2's is the only one
    assert run(server, "ens_1") == [12, 22]
    assert server.model("ens_1").config()["ensemble_scheduling"]["step"][0]["model_namespace"] == str(r2)
    server.unload("ens_1", unload_dependents=True)
    assert not any(entry.versions for entry in server.engine.manager.models.values())


def test_loading_an_ensemble_again_takes_the_step_model_back_in_its_repository(servers, repositories):
    """Upstream L0_model_namespacing test_dynamic_resolution, explicit mode: an ensemble
    whose own step model was away ran another repository's; its step model back, loading it
    again (files unchanged) re-resolves it, as Triton 2.51 does (side by side)."""
    r1, r2 = repositories
    server = servers.start([str(r1), str(r2)], model_namespacing=True,
                           model_control_mode=ModelControlMode.EXPLICIT)
    away = r1.parent / "m_away"
    shutil.move(r1 / "m", away)
    server.load("ens_1")
    server.load("ens_2")
    assert run(server, "ens_1") == [12, 22] and run(server, "m") == [12, 22]
    shutil.move(away, r1 / "m")
    server.load("ens_1")
    assert run(server, "ens_1") == [11, 21] and run(server, "ens_2") == [12, 22]
    with pytest.raises(dlserve.InvalidArgumentError, match="There are 2 identifiers of model 'm'"):
        run(server, "m")



def test_a_model_that_is_unloading_no_longer_makes_its_name_ambiguous(servers, repositories):
    """Side by side with Triton 2.51: while R1's m unloads (its finalize takes a while),
    the index lists it as UNLOADING and the bare name means R2's m alone."""
    r1, r2 = repositories
    model_file = r1 / "m" / "1" / "model.py"
    model_file.write_text(model_file.read_text() + "\n    def finalize(self):\n"
                          "        import time\n        time.sleep(3)\n")
    server = servers.start([str(r1), str(r2)], model_namespacing=True,
                           model_control_mode=ModelControlMode.EXPLICIT)
    server.load("ens_1")
    server.load("ens_2")
    with KServeHttp(server, KServeHttp.Options(address="127.0.0.1", port=0)) as service:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{service.port}")
        try:
            client.unload_model("ens_1", unload_dependents=True)  # (answered before it ends)

            def states() -> list[str]:
                return sorted(row.get("state") for row in client.get_model_repository_index()
                              if row["name"] == "m")

            wait_until(lambda: states() == ["READY", "UNLOADING"], timeout=2.5)
            inputs = [httpclient.InferInput("INPUT0", [2], "FP32")]
            inputs[0].set_data_from_numpy(X)
            assert client.infer("m", inputs).as_numpy("OUTPUT0").tolist() == [12, 22]
            assert states() == ["READY", "UNLOADING"]  # (still: the answer came in that window)
        finally:
            client.close()
    wait_until(lambda: not server.engine.manager.models[(str(r1), "m")].versions)


def test_a_model_that_fails_to_load_is_logged_with_its_namespace(servers, repositories, caplog):
    r1, r2 = repositories
    (r2 / "m" / "config.pbtxt").write_text('name: "m"\nbackend: "python"\nmax_batch_size: -3\n')
    server = servers.start([str(r1), str(r2)], model_namespacing=True, exit_on_error=False)
    assert f"failed to load '{r2}::m'" in caplog.text  # as Triton writes it: ns::name
    assert run(server, "m") == [11, 21]  # R1's is the one m loaded
