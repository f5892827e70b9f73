"""Model warmup (``model_warmup``): what each instance's model receives, readiness
only after it, failures and bad samples failing the load with nothing left behind,
and decoupled models."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading

import numpy as np
import pytest

import dlserve
from dlserve import ModelControlMode

from ..conftest import MODELS, wait_until

# Writes one line per execute into <repository>/seen.jsonl: what a warmup looks like
# from inside the model. Sleeps when asked (to watch the load), fails when asked.
PROBE = """
import json, os, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.instance = args["model_instance_name"]
        self.seen = os.path.join(args["model_repository"], "seen.jsonl")
        self.behaviour = json.loads(args["model_config"])["parameters"].get("BEHAVIOUR", {}).get("string_value", "")

    def execute(self, requests):
        record = {"instance": self.instance, "requests": []}
        for request in requests:
            inputs = {}
            for tensor in request.inputs():
                array = tensor.as_numpy()
                values = [v.decode() if isinstance(v, bytes) else v for v in array.reshape(-1).tolist()]
                inputs[tensor.name()] = {"shape": list(array.shape), "values": values}
            record["requests"].append({"id": request.request_id(), "inputs": inputs,
                                       "outputs": sorted(request.requested_output_names())})
        with open(self.seen, "a") as f:
            f.write(json.dumps(record) + "\\n")
        if self.behaviour == "slow":
            time.sleep(1.0)
        if self.behaviour == "raise":
            raise RuntimeError("warmup broke the model")
        out = []
        for request in requests:
            if self.behaviour == "error":
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("no warmup for me")))
                continue
            f = pb_utils.get_input_tensor_by_name(request, "F").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", f * 2)]))
        return out
"""


def probe_config(warmup: str, behaviour: str = "", instances: int = 2) -> str:
    return f"""
backend: "python"
max_batch_size: 4
input [
  {{ name: "F" data_type: TYPE_FP32 dims: [ 3 ] }},
  {{ name: "S" data_type: TYPE_STRING dims: [ 2 ] }},
  {{ name: "I" data_type: TYPE_INT32 dims: [ 2 ] }}
]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 3 ] }} ]
instance_group [ {{ count: {instances} kind: KIND_CPU }} ]
parameters {{ key: "BEHAVIOUR" value {{ string_value: "{behaviour}" }} }}
{warmup}
"""


SAMPLES = """
model_warmup [
  {
    name: "zeros"
    batch_size: 2
    count: 2
    inputs { key: "F" value { data_type: TYPE_FP32 dims: [ 3 ] zero_data: true } }
    inputs { key: "S" value { data_type: TYPE_STRING dims: [ 2 ] zero_data: true } }
    inputs { key: "I" value { data_type: TYPE_INT32 dims: [ 2 ] input_data_file: "ints.bin" } }
  },
  {
    name: "random"
    batch_size: 1
    inputs { key: "F" value { data_type: TYPE_FP32 dims: [ 3 ] random_data: true } }
    inputs { key: "S" value { data_type: TYPE_STRING dims: [ 2 ] random_data: true } }
    inputs { key: "I" value { data_type: TYPE_INT32 dims: [ 2 ] random_data: true } }
  },
  { name: "skipped" batch_size: 0 }
]
"""


def probe_repo(make_repo, config: str, files: dict[str, bytes] | None = None):
    repo = make_repo(extra={"probe": {"config.pbtxt": config, "1/model.py": PROBE}})
    warmup = repo / "probe" / "warmup"
    warmup.mkdir()
    (warmup / "ints.bin").write_bytes(np.array([7, 9], dtype=np.int32).tobytes())
    for name, data in (files or {}).items():
        (warmup / name).write_bytes(data)
    return repo


def seen(repo) -> list[dict]:
    path = repo / "probe" / "seen.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_every_instance_runs_every_sample_before_the_model_is_ready(servers, make_repo, caplog):
    repo = probe_repo(make_repo, probe_config(SAMPLES))
    with caplog.at_level(logging.DEBUG, logger="dlserve"):
        server = servers.start(repo, log_verbose=1)
    # Triton's verbose lines, which its QA (L0_warmup) greps
    lines = [r.getMessage() for r in caplog.records]
    assert "Skipping batch 0 warmup sample 'skipped'" in lines
    assert "Generating warmup sample data for 'zeros'" in lines
    running = [line for line in lines if "is running warmup sample" in line]
    assert sorted(running) == sorted(
        f"model 'probe' instance probe_0_{i} is running warmup sample '{name}' for iteration {n}"
        for i in (0, 1) for name, n in (("zeros", 1), ("zeros", 2), ("random", 1))
    )
    assert server.model("probe").ready()
    executes = seen(repo)
    by_instance: dict[str, list[dict]] = {}
    for record in executes:
        by_instance.setdefault(record["instance"], []).append(record)
    assert sorted(by_instance) == ["probe_0_0", "probe_0_1"]
    for records in by_instance.values():
        # "zeros" twice (2 requests each), then "random" once (1 request); "skipped" never.
        assert [len(r["requests"]) for r in records] == [2, 2, 1]
        zeros = records[0]["requests"][0]
        assert zeros["id"] == "" and zeros["outputs"] == ["OUT"]
        assert zeros["inputs"]["F"] == {"shape": [1, 3], "values": [0.0, 0.0, 0.0]}
        assert zeros["inputs"]["S"] == {"shape": [1, 2], "values": ["", ""]}
        assert zeros["inputs"]["I"] == {"shape": [1, 2], "values": [7, 9]}  # from warmup/ints.bin
        random = records[2]["requests"][0]["inputs"]
        assert random["F"]["shape"] == [1, 3] and random["S"]["shape"] == [1, 2]
        assert all(len(s) == 8 and s.isalpha() for s in random["S"]["values"])
    # The same random data at every load (and on every instance).
    randoms = [r["requests"][0]["inputs"]["I"]["values"] for r in executes if len(r["requests"]) == 1]
    assert len(randoms) == 2 and randoms[0] == randoms[1]
    # Warmup is not traffic: the statistics start at zero.
    stats = server.model("probe").statistics()["model_stats"][0]
    assert stats["inference_count"] == 0 and stats["execution_count"] == 0
    a = np.ones((1, 3), dtype=np.float32)
    inputs = {"F": a, "S": np.array([[b"x", b"y"]], dtype=object), "I": np.zeros((1, 2), np.int32)}
    (response,) = server.model("probe").infer(inputs=inputs)
    np.testing.assert_array_equal(np.from_dlpack(response.outputs["OUT"]), a * 2)


def test_a_model_is_loading_while_it_warms_up(servers, make_repo):
    repo = probe_repo(make_repo, probe_config(SAMPLES, behaviour="slow", instances=1))
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    loader = threading.Thread(target=server.load, args=("probe",))
    loader.start()
    try:
        wait_until(lambda: len(seen(repo)) >= 1)  # warming up: initialize is done
        states = {name: model.state for (name, _), model in server.models().items()}
        assert states["probe"] == "LOADING"
        assert not server.model("probe").ready()
        with pytest.raises(dlserve.TritonError):
            list(server.model("probe").infer(inputs={"F": np.ones((1, 3), np.float32)}))
    finally:
        loader.join(30)
    assert server.model("probe").ready() and len(seen(repo)) == 3


@pytest.mark.parametrize(
    ("behaviour", "message"),
    [
        ("error", "failed to run warmup sample 'zeros': no warmup for me; no warmup for me; "),
        ("raise", "failed to run warmup sample 'zeros': Failed to process the request(s) for model 'probe_0_0'"),
    ],
)
def test_a_failing_warmup_fails_the_load(servers, make_repo, behaviour, message, caplog):
    repo = probe_repo(make_repo, probe_config(SAMPLES, behaviour=behaviour, instances=1))
    server = servers.start(repo, exit_on_error=False)
    (row,) = server.models().values()
    assert row.state == "UNAVAILABLE" and message in row.reason, row.reason
    # Triton's error line for it (its QA greps "failed to run warmup sample")
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any(e.startswith("ERROR: Failed to create instance: " + message) for e in errors), errors
    assert len(seen(repo)) == 1  # the first failing execute ended it
    with pytest.raises(dlserve.InternalError, match="failed to run warmup sample 'zeros'"):
        servers.start(repo)  # exit_on_error: the start fails, no worker left (the harness checks)


def _sample(inputs: str, batch_size: int = 1) -> str:
    return f'model_warmup [ {{ name: "bad" batch_size: {batch_size} {inputs} }} ]'


F_ZERO = 'inputs { key: "F" value { data_type: TYPE_FP32 dims: [ 3 ] zero_data: true } }'
S_ZERO = 'inputs { key: "S" value { data_type: TYPE_STRING dims: [ 2 ] zero_data: true } }'
I_FILE = 'inputs {{ key: "I" value {{ data_type: TYPE_INT32 dims: [ 2 ] input_data_file: "{}" }} }}'
I_ZERO = 'inputs { key: "I" value { data_type: TYPE_INT32 dims: [ 2 ] zero_data: true } }'


@pytest.mark.parametrize(
    ("warmup", "message"),
    [
        (_sample(f'inputs {{ key: "F" value {{ data_type: TYPE_FP32 dims: [ -1 ] zero_data: true }} }} {S_ZERO} {I_ZERO}'),
         "input 'F': warmup needs every dimension given, got dims [-1]"),
        (_sample(f'inputs {{ key: "F" value {{ data_type: TYPE_FP32 dims: [ 3 ] }} }} {S_ZERO} {I_ZERO}'),
         "input 'F': set one of zero_data, random_data or input_data_file"),
        (_sample(f'inputs {{ key: "F" value {{ dims: [ 3 ] zero_data: true }} }} {S_ZERO} {I_ZERO}'),
         "input 'F': data_type is not set"),
        (_sample(f'inputs {{ key: "F" value {{ data_type: TYPE_INT32 dims: [ 3 ] zero_data: true }} }} {S_ZERO} {I_ZERO}'),
         "inference input 'F' data-type is 'INT32', but model 'probe' expects 'FP32'"),
        (_sample(f"{F_ZERO} {S_ZERO}"), "missing required input(s) ['I']"),
        (_sample(f"{F_ZERO} {S_ZERO} {I_FILE.format('nope.bin')}"), "cannot read input_data_file 'nope.bin': No such file or directory"),
        (_sample(f"{F_ZERO} {S_ZERO} {I_FILE.format('short.bin')}"), "input_data_file 'short.bin' holds 4 bytes, the input needs 8"),
        (_sample(f"{F_ZERO} {S_ZERO} {I_FILE.format('../config.pbtxt')}"), "input_data_file '../config.pbtxt' is not in the model's warmup folder"),
        (_sample(f"{F_ZERO} {I_ZERO} " + 'inputs { key: "S" value { data_type: TYPE_STRING dims: [ 2 ] input_data_file: "one.txt" } }'),
         "input_data_file 'one.txt' holds 1 strings, the input needs 2"),
        (_sample(f"{F_ZERO} {I_ZERO} " + 'inputs { key: "S" value { data_type: TYPE_STRING dims: [ 2 ] input_data_file: "text.txt" } }'),
         "input_data_file 'text.txt' does not hold length-prefixed strings"),
        (_sample(f"{F_ZERO} {S_ZERO} {I_ZERO}", batch_size=5), "batch_size 5 is more than the model's max_batch_size 4"),
    ],
)
def test_bad_samples_fail_the_load_naming_the_problem(servers, make_repo, warmup, message):
    one = len("x").to_bytes(4, "little") + b"x"
    files = {"short.bin": b"\0" * 4, "one.txt": one, "text.txt": b"hello world"}
    repo = probe_repo(make_repo, probe_config(warmup, instances=1), files)
    server = servers.start(repo, exit_on_error=False)
    (row,) = server.models().values()
    assert row.state == "UNAVAILABLE"
    assert "model 'probe', warmup sample 'bad'" in row.reason and message in row.reason, row.reason
    assert seen(repo) == []  # refused before any worker started


def test_a_sample_input_the_config_does_not_declare_reaches_the_model(servers, make_repo):
    """As in Triton 2.51 (upstream's bls_model_loading warms up with INPUT0/INPUT1, which
    its config does not list): the sample's inputs are overrides, not checked by name."""
    extra = 'inputs { key: "X" value { data_type: TYPE_FP32 dims: [ 1 ] zero_data: true } }'
    repo = probe_repo(make_repo, probe_config(_sample(f"{F_ZERO} {S_ZERO} {I_ZERO} {extra}"), instances=1))
    server = servers.start(repo)
    wait_until(lambda: server.model("probe").ready(), 30)
    (record,) = seen(repo)
    assert record["requests"][0]["inputs"]["X"] == {"shape": [1, 1], "values": [0.0]}


def test_decoupled_models_warm_up_through_their_response_senders(servers, make_repo):
    config = (MODELS / "decoupled" / "config.pbtxt").read_text() + """
model_warmup [ { name: "stream" batch_size: 1 count: 3
  inputs { key: "IN" value { data_type: TYPE_INT32 dims: [ 3 ] zero_data: true } } } ]
"""
    server = servers.start(make_repo("decoupled", extra={"decoupled": {"config.pbtxt": config}}))
    assert server.model("decoupled").ready()
    responses = list(server.model("decoupled").infer(inputs={"IN": np.array([1, 2], np.int32)}))
    assert [int(np.from_dlpack(r.outputs["OUT"])[0]) for r in responses if "OUT" in r.outputs] == [1, 2]


def test_ensembles_cannot_have_warmup(servers, make_repo):
    config = (MODELS / "pipeline" / "config.pbtxt").read_text() + _sample(F_ZERO) + "\n"
    repo = make_repo("add_sub", "identity", extra={"pipeline": {"config.pbtxt": config}})
    (repo / "pipeline" / "1").mkdir()
    server = servers.start(repo, exit_on_error=False)
    reason = {name: m.reason for (name, _), m in server.models().items()}["pipeline"]
    assert "model_warmup can not be specified for ensemble 'pipeline'" in reason
    assert server.model("add_sub").ready()


def test_reloading_a_model_warms_the_new_instances_while_the_old_serve(servers, make_repo):
    repo = probe_repo(make_repo, probe_config(SAMPLES, instances=1))
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT, startup_models=["probe"])
    assert len(seen(repo)) == 3
    slow = probe_config(SAMPLES, behaviour="slow", instances=1)
    (repo / "probe" / "config.pbtxt").write_text(slow)
    loader = threading.Thread(target=server.load, args=("probe",))
    loader.start()
    try:
        wait_until(lambda: len(seen(repo)) >= 4)  # the new instance is warming up
        assert server.model("probe").ready()  # the old one still serves
        inputs = {"F": np.ones((1, 3), np.float32), "S": np.array([[b"a", b"b"]], dtype=object),
                  "I": np.zeros((1, 2), np.int32)}
        (response,) = server.model("probe").infer(inputs=inputs, request_id="during")
        np.testing.assert_array_equal(np.from_dlpack(response.outputs["OUT"]), inputs["F"] * 2)
    finally:
        loader.join(30)
    assert len(seen(repo)) == 7


def test_a_restarted_instance_warms_up_again_before_it_serves(servers, make_repo):
    repo = probe_repo(make_repo, probe_config(SAMPLES, instances=1))
    server = servers.start(repo)
    assert len(seen(repo)) == 3
    (instance,) = server.engine.model("probe").instances
    os.kill(instance.pid, signal.SIGKILL)
    wait_until(lambda: instance.restarts == 1 and instance.ready, timeout=30)
    records = seen(repo)
    assert [len(r["requests"]) for r in records] == [2, 2, 1, 2, 2, 1]  # the samples again
    inputs = {"F": np.ones((1, 3), np.float32), "S": np.array([[b"a", b"b"]], dtype=object),
              "I": np.zeros((1, 2), np.int32)}
    (response,) = server.model("probe").infer(inputs=inputs)
    assert response.error is None


def test_the_warmup_folder_is_not_taken_for_a_version(servers, make_repo, caplog):
    repo = probe_repo(make_repo, probe_config(SAMPLES, instances=1))
    servers.start(repo, log_warn=True)
    assert not [r for r in caplog.records if "ignoring folder" in r.getMessage()]


DIES_WHILE_STREAMING = """
import os, threading, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        sender = requests[0].get_response_sender()

        def later():
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.zeros(1, np.int32))]))
            time.sleep(0.2)
            os._exit(3)

        threading.Thread(target=later).start()
        return None
"""


def test_a_worker_that_dies_while_its_warmup_streams_fails_the_load(servers, make_repo):
    config = (MODELS / "decoupled" / "config.pbtxt").read_text() + """
model_warmup [ { name: "w" batch_size: 1
  inputs { key: "IN" value { data_type: TYPE_INT32 dims: [ 3 ] zero_data: true } } } ]
"""
    repo = make_repo(extra={"dies": {"config.pbtxt": config, "1/model.py": DIES_WHILE_STREAMING}})
    server = servers.start(repo, exit_on_error=False)  # returns: the load did not hang
    (row,) = server.models().values()
    assert row.state == "UNAVAILABLE"
    assert "failed to run warmup sample 'w'" in row.reason and "while warming up" in row.reason, row.reason


def test_a_worker_that_dies_in_a_warmup_execute_fails_the_load_and_says_so(servers, make_repo):
    config = (MODELS / "add_sub" / "config.pbtxt").read_text() + """
model_warmup [ { name: "w" batch_size: 1
  inputs { key: "INPUT0" value { data_type: TYPE_FP32 dims: [ 16 ] zero_data: true } }
  inputs { key: "INPUT1" value { data_type: TYPE_FP32 dims: [ 16 ] zero_data: true } } } ]
"""
    model = "import os\n\nclass TritonPythonModel:\n    def execute(self, requests):\n        os._exit(3)\n"
    repo = make_repo(extra={"add_sub": {"config.pbtxt": config, "1/model.py": model}})
    server = servers.start(repo, exit_on_error=False)
    (row,) = server.models().values()
    assert row.state == "UNAVAILABLE"
    assert "failed to run warmup sample 'w'" in row.reason and "while warming up" in row.reason, row.reason
    assert "restarted" not in row.reason
