"""Model repositories while serving, as tritonserver's in-process API has them:
repositories registered and unregistered (with folders served under other names),
custom model configs (``model_config_name``), retried model starts
(``model_load_retry_count``), and ``Server.metrics()``."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

import dlserve
from dlserve import ModelControlMode

from ..conftest import MODELS

ONES = np.ones(16, dtype=np.float32)
EXPLICIT = ModelControlMode.EXPLICIT


def index(server: dlserve.Server) -> dict[str, str | None]:
    return {name: model.state for (name, _), model in server.models().items()}


def add_sub(server: dlserve.Server, name: str = "add_sub") -> np.ndarray:
    response = list(server.model(name).infer(inputs={"INPUT0": ONES, "INPUT1": ONES}))[0]
    assert response.error is None
    return np.from_dlpack(response.outputs["OUTPUT0"])


# -- register / unregister ---------------------------------------------------------------------
def test_a_registered_repository_serves_its_models_until_unregistered(servers, make_repo):
    server = servers.start(make_repo("identity"), model_control_mode=EXPLICIT)
    extra = make_repo("add_sub")
    assert "add_sub" not in index(server)
    with pytest.raises(dlserve.NotFoundError):
        server.load("add_sub")

    server.register_model_repository(str(extra))
    assert index(server) == {"add_sub": None, "identity": None}
    server.load("add_sub")
    assert (add_sub(server) == 2).all()

    server.unregister_model_repository(str(extra))
    # Loaded, it keeps serving (and stays listed) until it is unloaded...
    assert index(server)["add_sub"] == "READY"
    assert (add_sub(server) == 2).all()
    server.unload("add_sub")
    # ...and then it leaves the index (as in Triton, whose index lists what repositories
    # hold) and cannot be loaded again.
    assert "add_sub" not in index(server)
    with pytest.raises(dlserve.NotFoundError):
        server.load("add_sub")
    server.register_model_repository(str(extra))  # registered again, it is back
    server.load("add_sub")
    assert (add_sub(server) == 2).all()


def test_a_name_mapping_serves_a_folder_under_another_name(servers, make_repo):
    server = servers.start(make_repo("identity"), model_control_mode=EXPLICIT)
    extra = make_repo("add_sub")
    server.register_model_repository(str(extra), {"add_sub": "adder"})
    assert index(server) == {"adder": None, "identity": None}  # the folder's own name is not served
    server.load("adder")
    assert (add_sub(server, "adder") == 2).all()
    # The config's name is the one it is served under (its config.pbtxt says "add_sub").
    assert server.model("adder").config()["name"] == "adder"
    assert server.model("adder").metadata()["name"] == "adder"
    with pytest.raises(dlserve.NotFoundError):
        server.load("add_sub")


def test_registration_errors_are_tritons(servers, make_repo, tmp_path):
    first = make_repo("identity")
    server = servers.start(first, model_control_mode=EXPLICIT)
    missing = tmp_path / "nowhere"
    with pytest.raises(dlserve.InvalidArgumentError, match=f"failed to register '{missing}', repository not found"):
        server.register_model_repository(str(missing))
    with pytest.raises(dlserve.AlreadyExistsError, match="has already been registered"):
        server.register_model_repository(str(first))  # the startup repository counts
    extra = make_repo("add_sub")
    server.register_model_repository(str(extra), {"add_sub": "adder"})
    other = make_repo("add_sub")
    with pytest.raises(dlserve.AlreadyExistsError, match="there is a conflicting mapping for 'adder'"):
        server.register_model_repository(str(other), {"add_sub": "adder"})
    with pytest.raises(dlserve.InvalidArgumentError, match="path traversal"):
        server.register_model_repository(str(other), {"add_sub": "../adder"})
    with pytest.raises(dlserve.InvalidArgumentError, match=f"failed to unregister '{missing}', repository not found"):
        server.unregister_model_repository(str(missing))
    # A refused registration leaves nothing behind: the same folder registers afterwards.
    server.register_model_repository(str(other), {"add_sub": "adder2"})
    assert set(index(server)) == {"identity", "adder", "adder2"}
    # The server still serves.
    server.load("adder2")
    assert (add_sub(server, "adder2") == 2).all()


def test_two_repositories_holding_one_name_fail_that_model_only(servers, make_repo):
    server = servers.start(make_repo("add_sub", "identity"), model_control_mode=EXPLICIT)
    server.register_model_repository(str(make_repo("add_sub")))
    with pytest.raises(dlserve.InvalidArgumentError, match="appears in more than one model repository"):
        server.load("add_sub")
    server.load("identity")
    assert server.model("identity").ready()


def test_the_same_repository_path_given_twice_is_one_repository(servers, make_repo):
    """As tritonserver takes --model-repository twice with the same path (side by side);
    dlserve failed the model as being in more than one repository."""
    repo = str(make_repo("add_sub"))
    server = servers.start([repo, repo], exit_on_error=True)
    assert server.model("add_sub").ready()


@pytest.mark.parametrize("mode", [ModelControlMode.NONE, ModelControlMode.POLL])
def test_registration_needs_explicit_mode(servers, make_repo, mode):
    server = servers.start(make_repo("identity"), model_control_mode=mode, repository_poll_secs=60)
    extra = make_repo("add_sub")
    with pytest.raises(dlserve.UnsupportedError, match="repository registration is not allowed if model control mode is not EXPLICIT"):
        server.register_model_repository(str(extra))
    with pytest.raises(dlserve.UnsupportedError, match="repository unregistration is not allowed"):
        server.unregister_model_repository(str(extra))


# -- model_config_name ---------------------------------------------------------------------------
TWO_INSTANCES = (MODELS / "add_sub" / "config.pbtxt").read_text().replace("count: 1", "count: 2")


def test_model_config_name_picks_configs_folder_and_falls_back(servers, make_repo):
    repo = make_repo("add_sub", "identity", extra={"add_sub": {"configs/two.pbtxt": TWO_INSTANCES}})
    custom = servers.start(repo, model_config_name="two")
    assert len(custom.model("add_sub").config()["instance_group"]) == 1
    assert custom.model("add_sub").config()["instance_group"][0]["count"] == 2
    assert custom.model("identity").ready()  # no configs/two.pbtxt: its config.pbtxt
    assert (add_sub(custom) == 2).all()
    default = servers.start(repo)
    assert default.model("add_sub").config()["instance_group"][0]["count"] == 1


def test_a_bad_custom_config_is_named_in_the_error(make_repo):
    repo = make_repo("identity", extra={"identity": {"configs/bad.pbtxt": "bogus_field: 1\n"}})
    options = dlserve.Options(
        model_repository=str(repo), model_config_name="bad",
        model_control_mode=ModelControlMode.EXPLICIT,
    )
    server = dlserve.Server(options).start()
    try:
        with pytest.raises(dlserve.InvalidArgumentError) as info:
            server.load("identity")
        assert "failed to load model 'identity': configs/bad.pbtxt: 1:1 :" in str(info.value)
    finally:
        server.stop()


def test_a_model_config_name_must_be_a_file_name(make_repo):
    with pytest.raises(dlserve.InvalidArgumentError, match="model config name '../x' must be a file name"):
        dlserve.Server(dlserve.Options(model_repository=str(make_repo("identity")), model_config_name="../x")).start()


# -- model_load_retry_count ----------------------------------------------------------------------
# Fails its first initialize (leaving a mark in its model folder), then starts.
FLAKY = """
import os

class TritonPythonModel:
    def initialize(self, args):
        mark = os.path.join(args["model_repository"], "tried")
        if not os.path.exists(mark):
            open(mark, "w").close()
            raise RuntimeError("first start fails")

    def execute(self, requests):
        return []
"""
FLAKY_CONFIG = 'backend: "python"\ninput [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'


def test_load_retry_count_starts_a_model_again(servers, make_repo):
    files = {"config.pbtxt": FLAKY_CONFIG, "1/model.py": FLAKY}
    retried = servers.start(make_repo(extra={"flaky": files}), model_load_retry_count=1)
    assert retried.model("flaky").ready()
    with pytest.raises(dlserve.InternalError, match="first start fails"):
        servers.start(make_repo(extra={"flaky": files}))  # no retry: exit_on_error stops the start


def test_load_retry_count_must_not_be_negative(make_repo):
    with pytest.raises(dlserve.InvalidArgumentError, match="model_load_retry_count"):
        dlserve.Server(dlserve.Options(model_repository=str(make_repo("identity")), model_load_retry_count=-1)).start()


# -- Server.metrics() ----------------------------------------------------------------------------
def test_server_metrics_render_the_metrics_ports_text(servers, make_repo):
    server = servers.start(make_repo("add_sub"))
    add_sub(server)
    text = server.metrics()
    assert "nv_inference_count" in server.metrics(dlserve.MetricFormat.PROMETHEUS)
    assert '# TYPE nv_inference_count counter' in text
    assert 'nv_inference_count{model="add_sub",version="1"} 1' in text
    assert 'nv_inference_request_success{model="add_sub",version="1"} 1' in text
    assert "nv_cpu_utilization" in text
    with pytest.raises(dlserve.UnsupportedError, match="unsupported metric format"):
        server.metrics(7)


def test_server_metrics_follow_the_options(servers, make_repo):
    repo = make_repo("identity")
    no_cpu = servers.start(repo, cpu_metrics=False)
    text = no_cpu.metrics()
    assert "nv_cpu_utilization" not in text and "nv_inference_count" in text
    disabled = servers.start(repo, metrics=False)
    with pytest.raises(dlserve.UnsupportedError, match="metrics are disabled"):
        disabled.metrics()


# -- tritonserver.Options fields dlserve does not act on ---------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [("host_policies", {"p": {"numa-node": "0"}}),
     ("model_load_device_limits", ["x"]), ("repo_agent_directory", "/opt/agents")],
)
def test_options_that_would_change_behaviour_are_refused(make_repo, field, value):
    options = dlserve.Options(model_repository=str(make_repo("identity")), **{field: value})
    with pytest.raises(dlserve.UnsupportedError, match=f"Options.{field} is not supported by dlserve"):
        dlserve.Server(options).start()


@pytest.mark.parametrize(
    "options",
    [
        {"server_id": 1},
        {"model_repository": 1},
        {"server_id": 1, "model_repository": None},
        {"strict_model_config": "yes"},
        {"exit_timeout": 2.5},
        {"model_load_retry_count": "1"},
        {"log_file": 7},
        {"backend_directory": None},
    ],
)
def test_options_of_the_wrong_type_are_type_errors_as_in_tritonserver(options, make_repo):
    """Triton's own L0_python_api test_invalid_option_type; the rest as tritonserver's
    bindings take them."""
    options.setdefault("model_repository", str(make_repo("identity")))
    with pytest.raises(TypeError, match=f"^{next(iter(options))} must be a "):
        dlserve.Server(**options).start()


def test_options_take_what_tritonserver_converts(servers, make_repo):
    """An int for a bool or a float field, a bool for an int one (pybind11 converts them)."""
    server = servers.start(make_repo("identity"), strict_model_config=0, metrics=1, exit_timeout=True, repository_poll_secs=2)
    assert server.ready()


def test_tuning_options_of_tritons_core_are_accepted_with_a_warning(servers, make_repo, caplog):
    server = servers.start(
        make_repo("identity"), buffer_manager_thread_count=8, pinned_memory_pool_size=1 << 20, log_warn=True,
        backend_configuration={"python": {"stub-timeout-seconds": "30", "shm-default-byte-size": str(1 << 24)}},
    )
    assert server.model("identity").ready()
    warned = [r.getMessage() for r in caplog.records if "has no effect in dlserve" in r.getMessage()]
    assert len(warned) == 3 and any("buffer_manager_thread_count" in m for m in warned), warned
    assert any("python backend setting 'stub-timeout-seconds'" in m for m in warned), warned


SLOW_INIT = """
import os
import time


class TritonPythonModel:
    def initialize(self, args):
        start = time.monotonic()
        time.sleep(1.0)
        with open(os.path.join(args["model_repository"], "..", "times"), "a") as out:
            out.write(f"{start} {time.monotonic()}\\n")

    def execute(self, requests):
        return []
"""


@pytest.mark.parametrize("threads", [1, 3])
def test_model_load_thread_count_bounds_the_models_loaded_at_once(servers, make_repo, threads):
    """Three models whose initialize takes a second: one at a time with 1 (as tritonserver's
    --model-load-thread-count), side by side with 3."""
    config = 'backend: "python"\ninput [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]\n' \
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
    repo = make_repo(extra={f"slow{i}": {"config.pbtxt": config, "1/model.py": SLOW_INIT} for i in range(3)})
    server = servers.start(repo, model_load_thread_count=threads)
    deadline = time.monotonic() + 60
    while not all(server.model(f"slow{i}").ready() for i in range(3)):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    spans = sorted(tuple(map(float, line.split())) for line in (repo / "times").read_text().splitlines())
    assert len(spans) == 3
    overlapping = any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:]))
    assert overlapping == (threads > 1), spans


def test_model_load_thread_count_must_be_positive(servers, make_repo):
    with pytest.raises(dlserve.InvalidArgumentError, match="model_load_thread_count must be >= 1"):
        servers.start(make_repo("identity"), model_load_thread_count=0)


def test_the_metrics_port_follows_the_same_options(servers, make_repo):
    from dlserve.frontends import Metrics

    from .test_metrics import get

    no_cpu = servers.start(make_repo("identity"), cpu_metrics=False)
    with Metrics(no_cpu, Metrics.Options(address="127.0.0.1", port=0)) as service:
        status, _, body = get(service.port)
    assert status == 200 and "nv_inference_count" in body and "nv_cpu_utilization" not in body
    disabled = servers.start(make_repo("identity"), metrics=False)
    with pytest.raises(dlserve.UnsupportedError, match="metrics are disabled"):
        Metrics(disabled, Metrics.Options(address="127.0.0.1", port=0)).start()


MULTI_FILE_MODEL = """
import json
import sys
import unittest

import json

import numpy as np
import triton_python_backend_utils as pb_utils

import helper_beside
from . import helper_relative


class Checks(unittest.TestCase):
    def test_it_runs(self):
        self.assertEqual(helper_relative.VALUE, 2)


class TritonPythonModel:
    def execute(self, requests):
        # Triton's own QA models run unittest.main inside the model: it parses sys.argv.
        outcome = unittest.main("model", exit=False).result
        said = {"argv": sys.argv, "module": __name__, "values": [helper_beside.VALUE, helper_relative.VALUE],
                "passed": outcome.wasSuccessful()}
        out = np.array([json.dumps(said).encode()], dtype=np.object_)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", out)]) for _ in requests]
"""


def test_a_model_imports_the_files_beside_it_and_sees_tritons_argv(servers, make_repo):
    """As Triton's stub: model.py is module ``model`` of its version folder's package
    (``1.model``: relative imports work) and ``sys.argv`` is ``['']`` (unittest.main in a
    model, as Triton's own QA models run it, used to exit the worker on its flags)."""
    config = 'backend: "python"\noutput [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ 1 ] } ]\n'
    repo = make_repo(extra={"multi_file": {
        "config.pbtxt": config, "1/model.py": MULTI_FILE_MODEL,
        "1/helper_beside.py": "VALUE = 1\n", "1/helper_relative.py": "VALUE = 2\n",
    }})
    server = servers.start(repo)
    (response,) = server.model("multi_file").infer(inputs={})
    said = json.loads(response.outputs["OUTPUT0"].to_bytes_array()[0])
    assert said == {"argv": [""], "module": "1.model", "values": [1, 2], "passed": True}
