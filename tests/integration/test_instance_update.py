"""A load whose config differs from the serving one only in ``instance_group`` updates the
version's instances in place, as Triton 2.51 does (measured side by side): the instances
the new config still asks for keep running (same worker, no initialize or finalize), only
the added ones start and the removed ones stop, once they have finished what they run;
the version stays READY and its statistics go on. Any other change reloads the version."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import dlserve
from dlserve import ModelControlMode

from ..conftest import pid_alive, wait_until, worker_processes

MODEL_PY = '''
import json, os, time
from pathlib import Path
import numpy as np
import triton_python_backend_utils as pb_utils


def note(args_or_self, what):
    events = Path(args_or_self["model_repository"]).parent.parent / "events.log"
    with open(events, "a") as f:
        f.write(json.dumps([what, args_or_self["model_instance_name"], os.getpid()]) + "\\n")


class TritonPythonModel:
    def initialize(self, args):
        self.args = args
        note(args, "init")
        if (Path(args["model_repository"]).parent.parent / "refuse_init").exists():
            raise pb_utils.TritonModelException("init refused for " + args["model_instance_name"])

    def execute(self, requests):
        responses = []
        for request in requests:
            delay = pb_utils.get_input_tensor_by_name(request, "DELAY").as_numpy()
            if float(delay.reshape(-1)[0]) < 0:  # rescheduled, which this model may not do
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                responses.append(None)
                continue
            time.sleep(float(delay.reshape(-1)[0]))
            shape = delay.shape
            name = np.full(shape, self.args["model_instance_name"].encode(), dtype=np.object_)
            pid = np.full(shape, os.getpid(), dtype=np.int64)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("NAME", name), pb_utils.Tensor("PID", pid)]))
        return responses

    def finalize(self):
        note(self.args, "fini")
'''

SEQUENCE_PY = '''
import json, os
from pathlib import Path
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.args = args
        self.sums = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            value = int(pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy().reshape(-1)[0])
            start = int(pb_utils.get_input_tensor_by_name(request, "START").as_numpy().reshape(-1)[0])
            key = request.correlation_id()
            self.sums[key] = (0 if start else self.sums[key]) + value
            name = np.array([self.args["model_instance_name"].encode()], dtype=np.object_)
            total = np.array([self.sums[key]], dtype=np.int64)
            pid = np.array([os.getpid()], dtype=np.int64)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("NAME", name), pb_utils.Tensor("SUM", total), pb_utils.Tensor("PID", pid)]))
        return responses
'''

DECOUPLED_PY = '''
import os, time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_instance_name"]

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            delay = float(pb_utils.get_input_tensor_by_name(request, "DELAY").as_numpy().reshape(-1)[0])
            for _ in range(4):
                time.sleep(delay / 4)
                name = np.array([self.name.encode()], dtype=np.object_)
                pid = np.array([os.getpid()], dtype=np.int64)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("NAME", name), pb_utils.Tensor("PID", pid)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''

OUTPUTS = [
    {"name": "NAME", "data_type": "TYPE_STRING", "dims": [1]},
    {"name": "PID", "data_type": "TYPE_INT64", "dims": [1]},
]


def config(count: int, group: str = "g", **extra) -> dict:
    return {
        "name": "ig",
        "backend": "python",
        "max_batch_size": 0,
        "input": [{"name": "DELAY", "data_type": "TYPE_FP32", "dims": [1]}],
        "output": OUTPUTS,
        "instance_group": [{"name": group, "count": count, "kind": "KIND_CPU"}],
        **extra,
    }


def to_pbtxt(cfg: dict) -> str:
    from google.protobuf import json_format, text_format

    from dlserve.engine.proto import model_config_pb2 as mc

    return text_format.MessageToString(json_format.ParseDict(cfg, mc.ModelConfig()))


@pytest.fixture
def repo(make_repo) -> Path:
    return make_repo(extra={"ig": {"config.pbtxt": to_pbtxt(config(2)), "1/model.py": MODEL_PY}})


@pytest.fixture
def server(servers, repo) -> dlserve.Server:
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    server.load("ig")
    return server


def load(server: dlserve.Server, cfg: dict, name: str = "ig") -> None:
    server.load(name, {"config": json.dumps(cfg)})


def pids(server: dlserve.Server, name: str = "ig") -> dict[str, int]:
    """Each instance's worker pid, by instance name."""
    (stats,) = server.model(name).statistics()["model_stats"]
    return {instance["name"]: instance["pid"] for instance in stats["instances"]}


def inference_count(server: dlserve.Server, name: str = "ig") -> int:
    (stats,) = server.model(name).statistics()["model_stats"]
    return stats["inference_count"]


def events(repo: Path) -> list[tuple[str, str, int]]:
    path = repo.parent / "events.log"
    return [tuple(json.loads(line)) for line in path.read_text().splitlines()] if path.exists() else []


def start(server: dlserve.Server, delay: float, name: str = "ig", shape: tuple[int, ...] = (1,)):
    """Send a request (it runs ``delay`` seconds); iterate the result for its responses."""
    return server.model(name).infer(inputs={"DELAY": np.full(shape, delay, dtype=np.float32)})


def answer(responses) -> tuple[str, int]:
    (response,) = list(responses)
    return response.outputs["NAME"].to_bytes_array().reshape(-1)[0].decode(), int(
        response.outputs["PID"].as_numpy().reshape(-1)[0]
    )


class ReadyWatch:
    """Asks the model's readiness over and over on a thread while a block runs."""

    def __init__(self, server: dlserve.Server, name: str = "ig") -> None:
        self.model = server.model(name)
        self.answers: list[bool] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.answers.append(self.model.ready())
            time.sleep(0.01)

    def __enter__(self) -> ReadyWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_count_up_and_down_keeps_the_other_instances(server, repo):
    before = pids(server)
    assert sorted(before) == ["g_0", "g_1"]
    with ReadyWatch(server) as watch:
        load(server, config(3))
    after_up = pids(server)
    assert sorted(after_up) == ["g_0", "g_1", "g_2"]
    assert {name: after_up[name] for name in before} == before  # the same workers
    assert sorted(e[:2] for e in events(repo)) == [("init", "g_0"), ("init", "g_1"), ("init", "g_2")]
    assert all(watch.answers) and watch.answers

    with ReadyWatch(server) as watch:
        load(server, config(1))
    assert pids(server) == {"g_0": before["g_0"]}
    finalized = sorted(e[1] for e in events(repo) if e[0] == "fini")
    assert finalized == ["g_1", "g_2"]  # by the time the load returned, as Triton's
    assert not pid_alive(after_up["g_1"]) and not pid_alive(after_up["g_2"])
    assert all(watch.answers) and watch.answers
    assert {answer(start(server, 0.0)) for _ in range(4)} == {("g_0", before["g_0"])}

    load(server, config(3))  # up again: the new ones take the names the group's have free
    again = pids(server)
    assert sorted(again) == ["g_0", "g_1", "g_2"] and again["g_0"] == before["g_0"]


def test_a_config_pbtxt_edit_loaded_again_updates_in_place(server, repo):
    before = pids(server)
    (repo / "ig" / "config.pbtxt").write_text(to_pbtxt(config(3)))
    server.load("ig")
    after = pids(server)
    assert sorted(after) == ["g_0", "g_1", "g_2"]
    assert {name: after[name] for name in before} == before
    # A renamed group with the same settings keeps its instances (and their names).
    (repo / "ig" / "config.pbtxt").write_text(to_pbtxt(config(3, group="h")))
    server.load("ig")
    assert pids(server) == after


def test_count_down_while_every_instance_executes(server, repo):
    load(server, config(3))
    kept = pids(server)
    counted = inference_count(server)
    running = [start(server, 1.0) for _ in range(6)]  # two on each instance
    time.sleep(0.3)
    with ReadyWatch(server) as watch:
        load(server, config(1))
    answers = [answer(r) for r in running]  # every one succeeds (answer raises on an error)
    assert {name for name, _ in answers} == {"g_0", "g_1", "g_2"}
    assert all(watch.answers) and watch.answers
    assert pids(server) == {"g_0": kept["g_0"]}
    assert not pid_alive(kept["g_1"]) and not pid_alive(kept["g_2"])
    assert inference_count(server) == counted + 6  # the statistics go on
    assert answer(start(server, 0.0)) == ("g_0", kept["g_0"])
    assert inference_count(server) == counted + 7


def test_dynamic_batcher_count_down_in_flight(servers, make_repo):
    cfg = config(2, max_batch_size=4, dynamic_batching={"max_queue_delay_microseconds": 1000})
    cfg["name"] = "igdyn"
    repo = make_repo(extra={"igdyn": {"config.pbtxt": to_pbtxt(cfg), "1/model.py": MODEL_PY}})
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    server.load("igdyn")
    before = pids(server, "igdyn")
    running = [start(server, 0.5, "igdyn", (1, 1)) for _ in range(10)]
    time.sleep(0.2)
    load(server, {**cfg, "instance_group": [{"name": "g", "count": 1, "kind": "KIND_CPU"}]}, "igdyn")
    assert all(answer(r)[0] in ("g_0", "g_1") for r in running)
    assert pids(server, "igdyn") == {"g_0": before["g_0"]}
    assert inference_count(server, "igdyn") == 10


def test_decoupled_streams_on_a_removed_instance_finish(servers, make_repo):
    cfg = config(2, model_transaction_policy={"decoupled": True})
    cfg["name"] = "igdec"
    repo = make_repo(extra={"igdec": {"config.pbtxt": to_pbtxt(cfg), "1/model.py": DECOUPLED_PY}})
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    server.load("igdec")
    before = pids(server, "igdec")
    streams = [start(server, 1.0, "igdec") for _ in range(4)]
    time.sleep(0.3)
    load(server, {**cfg, "instance_group": [{"name": "g", "count": 1, "kind": "KIND_CPU"}]}, "igdec")
    for stream in streams:
        answers = [r for r in stream if r.outputs]
        assert len(answers) == 4
    assert pids(server, "igdec") == {"g_0": before["g_0"]}
    assert not pid_alive(before["g_1"])


SEQUENCE_CONFIG = {
    "name": "igseq",
    "backend": "python",
    "max_batch_size": 0,
    "sequence_batching": {
        "max_sequence_idle_microseconds": 60_000_000,
        "control_input": [
            {"name": "START", "control": [{"kind": "CONTROL_SEQUENCE_START", "int32_false_true": [0, 1]}]}
        ],
    },
    "input": [{"name": "INPUT", "data_type": "TYPE_INT32", "dims": [1]}],
    "output": [*OUTPUTS, {"name": "SUM", "data_type": "TYPE_INT64", "dims": [1]}],
    "instance_group": [{"name": "s", "count": 2, "kind": "KIND_CPU"}],
}


def test_sequences_on_a_removed_instance_run_to_their_end(servers, make_repo):
    """As in Triton: a sequence bound to an instance the update removes goes on there
    (its state with it) until its END; the instance stops after that. New sequences go
    to the instances that stay."""
    repo = make_repo(extra={"igseq": {"config.pbtxt": to_pbtxt(SEQUENCE_CONFIG), "1/model.py": SEQUENCE_PY}})
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    server.load("igseq")
    model = server.model("igseq")

    def step(key: int, value: int, flags: int = 0) -> tuple[str, int, int]:
        (response,) = list(model.infer(inputs={"INPUT": np.array([value], np.int32)}, correlation_id=key, flags=flags))
        return (
            response.outputs["NAME"].to_bytes_array()[0].decode(),
            int(response.outputs["SUM"].as_numpy()[0]),
            int(response.outputs["PID"].as_numpy()[0]),
        )

    START, END = 1, 2
    first = step(1, 1, START)
    second = step(2, 10, START)
    assert {first[0], second[0]} == {"s_0", "s_1"}
    removed = first if first[0] == "s_1" else second
    key = 1 if removed is first else 2
    t = time.monotonic()
    load(server, {**SEQUENCE_CONFIG, "instance_group": [{"name": "s", "count": 1, "kind": "KIND_CPU"}]}, "igseq")
    assert time.monotonic() - t < 5  # (the load does not wait for the sequence)
    assert sorted(pids(server, "igseq")) == ["s_0"]
    assert pid_alive(removed[2])  # still holds a sequence
    assert step(key, 100) == ("s_1", removed[1] + 100, removed[2])  # where its state is
    # Back to two while s_1 still ends its sequence: the new one takes a name of its own.
    load(server, {**SEQUENCE_CONFIG, "instance_group": [{"name": "s", "count": 2, "kind": "KIND_CPU"}]}, "igseq")
    assert sorted(pids(server, "igseq")) == ["s_0", "s_2"]
    assert step(key, 1000, END) == ("s_1", removed[1] + 1100, removed[2])
    wait_until(lambda: not pid_alive(removed[2]), 10)
    assert step(3, 5, START | END)[0] in ("s_0", "s_2")


def test_a_change_outside_instance_group_reloads(server, repo):
    before = pids(server)
    load(server, config(3))  # instance_group only: in place
    updated = pids(server)
    assert {name: updated[name] for name in before} == before
    load(server, config(3, parameters={"X": {"string_value": "1"}}))  # and something else: a reload
    after = pids(server)
    assert sorted(after) == ["g_0", "g_1", "g_2"]
    assert not set(after.values()) & set(updated.values())  # every worker is new
    assert sorted(e[1] for e in events(repo) if e[0] == "init") == ["g_0", "g_0", "g_1", "g_1", "g_2", "g_2"]


def test_an_update_whose_new_instance_fails_leaves_the_model_as_it_was(server, repo):
    before = pids(server)
    (repo.parent / "refuse_init").touch()
    with pytest.raises(dlserve.InvalidArgumentError) as failure:
        load(server, config(3))
    assert "version 1 is at READY state" in str(failure.value)
    assert "init refused for g_2" in str(failure.value)
    assert pids(server) == before
    assert server.model("ig").ready()
    listed = server.models()[("ig", 1)]
    assert listed.state == "READY" and "init refused for g_2" in listed.reason  # (Triton's index says so too)
    (repo.parent / "refuse_init").unlink()
    load(server, config(3))
    assert sorted(pids(server)) == ["g_0", "g_1", "g_2"]
    assert server.models()[("ig", 1)].reason in ("", None)


def test_an_update_to_invalid_groups_leaves_the_model_ready_with_the_reason(server, repo):
    """As Triton 2.51 (upstream instance_update_test's GPU cases, side by side): groups the
    config check refuses fail an instance update as one whose instance did not start."""
    before = pids(server)
    bad = config(2)
    bad["instance_group"][0]["gpus"] = [0]
    with pytest.raises(dlserve.InvalidArgumentError) as failure:
        load(server, bad)
    assert str(failure.value) == (
        "load failed for model 'ig': version 1 is at READY state: Invalid argument: instance group g "
        "of model ig has kind KIND_CPU but specifies one or more GPUs;\n"
    )
    assert pids(server) == before and server.model("ig").ready()
    listed = server.models()[("ig", 1)]
    assert listed.state == "READY" and "specifies one or more GPUs" in listed.reason
    load(server, config(len(before)))
    assert server.models()[("ig", 1)].reason in ("", None)


def test_no_worker_or_segment_left_after_updates_and_unload(servers, repo):
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    server.load("ig")
    prefix = server.engine.segment_prefix
    for count in (3, 1, 4, 2):
        load(server, config(count))
    assert len(worker_processes(prefix)) == 2
    server.unload("ig")
    wait_until(lambda: not worker_processes(prefix), 10)
    assert not list(Path("/dev/shm").glob(f"{prefix}_w*"))


def test_a_removed_instance_does_not_wait_for_requests_it_rescheduled_and_lost(server, repo):
    """A request the model rescheduled and the scheduler then failed (no iterative
    sequence) is done: removing its instance neither waits the exit timeout for it nor
    skips the instance's finalize."""
    for _ in range(4):
        (failed,) = server.model("ig").infer(inputs={"DELAY": np.full(1, -1.0, np.float32)}, raise_on_error=False)
        assert "rescheduled a request" in str(failed.error)
    started = time.monotonic()
    load(server, config(1))
    assert time.monotonic() - started < 3.0  # (the harness's exit timeout is 5 s)
    assert [e[0] for e in events(repo) if e[1] == "g_1"] == ["init", "fini"]


def test_a_custom_config_changed_only_in_instance_group_updates_in_place(servers, make_repo):
    """With --model-config-name the config the load reads is configs/<name>.pbtxt: its
    instance_group edit updates in place too (other files unchanged)."""
    repo = make_repo(extra={"ig": {"configs/small.pbtxt": to_pbtxt(config(2)), "1/model.py": MODEL_PY}})
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT, model_config_name="small")
    server.load("ig")
    before = pids(server)
    (repo / "ig" / "configs" / "small.pbtxt").write_text(to_pbtxt(config(3)))
    server.load("ig")
    after = pids(server)
    assert sorted(after) == ["g_0", "g_1", "g_2"]
    assert {name: after[name] for name in before} == before
