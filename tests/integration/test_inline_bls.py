"""Inline BLS: a model with ``INLINE_BLS: "yes"`` runs in its BLS callers' own processes.

Real servers and workers: the callee reports the process it ran in, so each test sees
where a call went; the server's checks, errors, statistics and reloads are compared with
what the same call gets through the server.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import dlserve
from dlserve import ModelControlMode

from ..conftest import wait_until

CALLER = '''
import json, os, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            asked = json.loads(request.parameters())
            inputs = request.inputs()
            if asked.get("as_int32"):  # (an input the callee's config refuses)
                data = inputs[0].as_numpy().astype(np.int32)
                inputs = [pb_utils.Tensor("INPUT0", data)]
            info = {"pid": os.getpid(), "calls": []}
            tensors = []
            for _ in range(asked.get("repeat", 1)):
                call = pb_utils.InferenceRequest(
                    model_name=asked.get("callee", "inline_callee"),
                    model_version=asked.get("version", -1),
                    inputs=inputs,
                    requested_output_names=["OUTPUT0", "PID", "NOTE"],
                    parameters={"mode": asked.get("mode", "")},
                )
                answer = call.exec()
                if answer.has_error():
                    info["error"] = [answer.error().code(), answer.error().message()]
                    info["calls"].append("error")
                else:
                    tensors = [pb_utils.Tensor(t.name(), t.as_numpy()) for t in answer.output_tensors()]
                    info["calls"].append("ok")
                    for t in answer.output_tensors():
                        if t.name() == "NOTE":  # (text: bytes, as through the server)
                            note = t.as_numpy()[0]
                            info["note"] = [type(note).__name__, note.decode() if isinstance(note, bytes) else note]
                time.sleep(asked.get("gap", 0))
            info["input_after"] = inputs[0].as_numpy().tolist()
            tensors = [t for t in tensors if t.name() != "NOTE"] + [
                pb_utils.Tensor("INFO", np.array([json.dumps(info).encode()], np.object_))
            ]
            responses.append(pb_utils.InferenceResponse(tensors))
        return responses
'''

CALLER_CONFIG = """
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "PID" data_type: TYPE_INT64 dims: [ 1 ] },
  { name: "INFO" data_type: TYPE_STRING dims: [ 1 ] }
]
"""

CALLEE = '''
import json, os
import numpy as np
import triton_python_backend_utils as pb_utils

FACTOR = 2.0

class TritonPythonModel:
    def initialize(self, args):
        self.folder = pb_utils.get_model_dir()
        try:  # BLS is execute's: refused here, as by Triton
            pb_utils.InferenceRequest(
                model_name="plain_callee", requested_output_names=["OUTPUT0"],
                inputs=[pb_utils.Tensor("INPUT0", np.ones(1, np.float32))],
            ).exec()
            self.note = "a BLS call in initialize ran"
        except pb_utils.TritonModelException as error:
            self.note = str(error)

    def execute(self, requests):
        responses = []
        for request in requests:
            mode = json.loads(request.parameters()).get("mode")
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            if data.size and data[0] < 0:
                raise ValueError("a negative first element")
            if mode == "mutate":
                data *= 10
            response = pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", data * FACTOR),
                pb_utils.Tensor("PID", np.array([os.getpid()], np.int64)),
                pb_utils.Tensor("NOTE", np.array([self.note], np.object_)),
            ])
            if mode in ("sender", "abandon"):
                sender = request.get_response_sender()
                if mode == "sender":
                    sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                responses.append(None)  # (abandon: the sender goes unused)
            else:
                responses.append(response)
        return responses

    def finalize(self):
        with open(os.path.join(self.folder, f"finalized.{os.getpid()}"), "w") as f:
            f.write("done")
'''


def callee_config(inline: str | None) -> str:
    parameter = "" if inline is None else (
        f'parameters {{ key: "INLINE_BLS" value: {{ string_value: "{inline}" }} }}'
    )
    return f"""
backend: "python"
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [
  {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }},
  {{ name: "PID" data_type: TYPE_INT64 dims: [ 1 ] }},
  {{ name: "NOTE" data_type: TYPE_STRING dims: [ 1 ] }}
]
instance_group [ {{ kind: KIND_CPU }} ]
{parameter}
"""


def models(**callees: str | None) -> dict[str, dict[str, str]]:
    files = {"caller": {"config.pbtxt": CALLER_CONFIG, "1/model.py": CALLER}}
    for name, inline in callees.items():
        files[name] = {"config.pbtxt": callee_config(inline), "1/model.py": CALLEE}
    return files


def call(server: dlserve.Server, data: np.ndarray, **parameters: object) -> tuple[dict, dict]:
    (response,) = server.model("caller").infer(inputs={"INPUT0": data}, parameters=parameters)
    info = json.loads(response.outputs["INFO"].to_bytes_array()[0])
    outputs = {
        name: np.from_dlpack(tensor) for name, tensor in response.outputs.items() if name != "INFO"
    }
    return outputs, info


def counts(server: dlserve.Server, model: str) -> tuple[int, int, int, int]:
    """(inference_count, execution_count, successes, failures) of the model's statistics."""
    stats = server.model(model).statistics()["model_stats"][0]
    inference = stats["inference_stats"]
    return (
        stats["inference_count"],
        stats["execution_count"],
        inference["success"]["count"],
        inference["fail"]["count"],
    )


DATA = np.arange(1, 9, dtype=np.float32)


@pytest.fixture
def both(make_repo, servers):
    """A server with an inline callee and the same model without the parameter."""
    repo = make_repo(extra=models(inline_callee="yes", plain_callee=None))
    server = servers.start(repo)
    wait_until(server.ready)
    return server


def test_the_call_runs_in_the_callers_process_and_counts_in_the_callees_statistics(both):
    before = counts(both, "inline_callee")
    for _ in range(5):
        outputs, info = call(both, DATA)
        np.testing.assert_array_equal(outputs["OUTPUT0"], DATA * 2)
        assert int(outputs["PID"][0]) == info["pid"]  # the callee ran where the caller runs
    after = counts(both, "inline_callee")
    assert [a - b for a, b in zip(after, before)] == [5, 5, 5, 0]
    # the callee's own worker never saw these requests
    instances = both.model("inline_callee").statistics()["model_stats"][0]["instances"]
    assert instances[0]["pid"] != info["pid"]


def test_without_the_parameter_the_call_goes_through_the_server(both):
    outputs, info = call(both, DATA, callee="plain_callee")
    np.testing.assert_array_equal(outputs["OUTPUT0"], DATA * 2)
    instances = both.model("plain_callee").statistics()["model_stats"][0]["instances"]
    assert int(outputs["PID"][0]) == instances[0]["pid"] != info["pid"]


def test_a_response_sent_through_the_sender_is_the_calls_answer(both):
    outputs, info = call(both, DATA, mode="sender")
    np.testing.assert_array_equal(outputs["OUTPUT0"], DATA * 2)
    assert int(outputs["PID"][0]) == info["pid"]


def test_errors_and_refusals_are_the_servers_words(both):
    """What the callee raises, and an input its config refuses, come back in the
    response as they do through the server (the model's name aside)."""
    results = {}
    for callee in ("inline_callee", "plain_callee"):
        _, raised = call(both, -DATA, callee=callee)
        _, refused = call(both, DATA, callee=callee, as_int32=True)
        results[callee] = (raised["error"], refused["error"])
    inline, plain = results["inline_callee"], results["plain_callee"]
    assert "a negative first element" in inline[0][1]
    assert inline[0][0] == plain[0][0] == dlserve.InternalError.code.value
    # the worker's prefix names the instance that failed: the caller's private one
    described = plain[0][1].split("message: ", 1)[1].replace("plain_callee", "inline_callee")
    assert inline[0][1].split("message: ", 1)[1] == described
    assert inline[1] == [plain[1][0], plain[1][1].replace("plain_callee", "inline_callee")]
    assert "inference input 'INPUT0' data-type is 'INT32'" in inline[1][1]
    _, _, _, failures = counts(both, "inline_callee")
    assert failures == 1  # the execute that raised; a refused request never ran


def test_a_reload_replaces_the_callers_copy(make_repo, servers):
    repo = make_repo(extra=models(inline_callee="yes"))
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    server.load("inline_callee")
    server.load("caller")
    outputs, info = call(server, DATA)
    np.testing.assert_array_equal(outputs["OUTPUT0"], DATA * 2)
    model_file = Path(repo, "inline_callee", "1", "model.py")
    model_file.write_text(CALLEE.replace("FACTOR = 2.0", "FACTOR = 3.0"))
    server.load("inline_callee")
    # the copy in the caller's worker was finalized (in that process, in its own folder)
    finalized = Path(repo, "inline_callee", "1", f"finalized.{info['pid']}")
    wait_until(finalized.exists)
    outputs, again = call(server, DATA)
    np.testing.assert_array_equal(outputs["OUTPUT0"], DATA * 3)
    assert again["pid"] == info["pid"] == int(outputs["PID"][0])
    server.unload("inline_callee")
    _, gone = call(server, DATA)
    assert "inline_callee" in gone["error"][1] and "not ready" in gone["error"][1]


def test_the_callers_copy_is_finalized_when_the_caller_stops(make_repo, servers):
    repo = make_repo(extra=models(inline_callee="yes"))
    server = servers.start(repo)
    wait_until(server.ready)
    _, info = call(server, DATA)
    servers.stop(server)
    assert Path(repo, "inline_callee", "1", f"finalized.{info['pid']}").exists()


def test_an_async_caller_awaits_an_inline_call(make_repo, servers):
    extra = models(inline_callee="yes")
    extra["caller"]["1/model.py"] = CALLER.replace(
        "    def execute(self, requests):", "    async def execute(self, requests):"
    ).replace("answer = call.exec()", "answer = await call.async_exec()")
    server = servers.start(make_repo(extra=extra))
    wait_until(server.ready)
    outputs, info = call(server, DATA)
    np.testing.assert_array_equal(outputs["OUTPUT0"], DATA * 2)
    assert int(outputs["PID"][0]) == info["pid"]


def test_the_callee_gets_what_the_server_would_give_it(both):
    """Read-only views of the caller's inputs (through the server it writes a copy of its
    own; here its write fails and the caller's data stays as it was), text as bytes, and
    BLS refused in its initialize, as Triton refuses it (it waited for itself here)."""
    results = {}
    for callee in ("inline_callee", "plain_callee"):
        outputs, info = call(both, DATA, callee=callee)
        _, mutated = call(both, DATA, callee=callee, mode="mutate")
        results[callee] = (info["note"], mutated)
    (note, mutated), (plain_note, plain_mutated) = results["inline_callee"], results["plain_callee"]
    assert note == plain_note
    assert note[0] == "bytes" and note[1].startswith("BLS is only supported during the 'execute' function")
    assert plain_mutated["calls"] == ["ok"]  # its own copy
    assert mutated["calls"] == ["error"] and "read-only" in mutated["error"][1]
    assert mutated["input_after"] == plain_mutated["input_after"] == DATA.tolist()


def test_a_request_its_callee_lets_go_of_is_answered(both):
    """The callee takes its response sender and drops it without a response: the call
    is answered with the error the server gives (it waited for ever)."""
    _, plain = call(both, DATA, callee="plain_callee", mode="abandon")
    _, inline = call(both, DATA, mode="abandon")
    assert inline["error"] == plain["error"]
    assert "let go of the request without sending its final response" in inline["error"][1]


def test_a_model_with_modules_of_its_own_is_not_run_inline(make_repo, servers):
    """Its ``import helper`` would find the caller's helper in the one sys.modules the
    caller's worker has: its calls go through the server."""
    extra = models(inline_callee="yes")
    extra["inline_callee"]["1/helper.py"] = "WHO = 'callee'\n"
    server = servers.start(make_repo(extra=extra))
    wait_until(server.ready)
    outputs, info = call(server, DATA)
    np.testing.assert_array_equal(outputs["OUTPUT0"], DATA * 2)
    assert int(outputs["PID"][0]) != info["pid"]


def test_an_unload_reaches_a_caller_in_the_middle_of_its_execute(make_repo, servers):
    """The caller keeps calling through one long execute; once the callee is unloaded,
    its calls are refused as through the server (its copy answered to the end)."""
    repo = make_repo(extra=models(inline_callee="yes"))
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    server.load("inline_callee")
    server.load("caller")
    (pid,) = {i["pid"] for i in server.model("caller").statistics()["model_stats"][0]["instances"]}
    finalized = Path(repo, "inline_callee", "1", f"finalized.{pid}")
    results: list[dict] = []
    caller = threading.Thread(target=lambda: results.append(call(server, DATA, repeat=8, gap=0.25)[1]))
    caller.start()
    time.sleep(0.6)
    server.unload("inline_callee", wait_until_unloaded=True)
    caller.join()
    calls = results[0]["calls"]
    assert calls[0] == "ok" and calls[-1] == "error" and "not ready" in results[0]["error"][1]
    wait_until(finalized.exists)  # (once the execute ended: its own thread finalizes it)


def test_a_bad_value_fails_the_load(make_repo, servers):
    repo = make_repo(extra=models(inline_callee="sometimes"))
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    with pytest.raises(dlserve.InvalidArgumentError, match="Incorrect value for INLINE_BLS: 'sometimes'"):
        server.load("inline_callee")


def test_many_calls_leave_nothing_behind(both):
    """A thousand inline calls: the caller's worker holds no more memory or
    descriptors than after the first few (the harness checks segments and
    processes when the server stops)."""
    call(both, DATA)
    (pid,) = {i["pid"] for i in both.model("caller").statistics()["model_stats"][0]["instances"]}
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    for _ in range(1000):
        outputs, _ = call(both, DATA)
    np.testing.assert_array_equal(outputs["OUTPUT0"], DATA * 2)
    assert len(os.listdir(f"/proc/{pid}/fd")) <= fds + 2
