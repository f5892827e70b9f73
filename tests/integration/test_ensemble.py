"""Ensembles: requests through other models' steps, over the in-process API and tritonclient;
step failures, cancellation, statistics, explicit-mode loading and config errors."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

import dlserve
from dlserve import ModelControlMode
from dlserve.frontends import KServeGrpc

from ..conftest import MODELS, frontend, serve, wait_until

LOADED = ["pipeline", "add_sub", "identity", "faulty", "stream_double", "decoupled", "double"]
REFERENCE = Path(__file__).parents[1] / "data" / "triton_reference"  # captured from Triton 2.51

GUARDED = """
name: "guarded"
platform: "ensemble"
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
ensemble_scheduling {
  step [
    { model_name: "identity" model_version: -1
      input_map { key: "INPUT0" value: "X" } output_map { key: "OUTPUT0" value: "copy" } },
    { model_name: "faulty" model_version: -1
      input_map { key: "INPUT0" value: "copy" } output_map { key: "OUTPUT0" value: "Y" } }
  ]
}
"""

A = np.arange(16, dtype=np.float32)
B = np.full(16, 2.0, np.float32)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    yield from serve(
        tmp_path_factory, LOADED, model_control_mode=ModelControlMode.EXPLICIT, startup_models=LOADED
    )


def load_guarded(server: dlserve.Server) -> None:
    """The guarded ensemble, through the repository API with its config and an empty version."""
    server.load("guarded", {"config": config_json(GUARDED), "file:1/.keep": b""})


def config_json(text: str) -> str:
    from google.protobuf import json_format, text_format

    from dlserve.engine.proto import model_config_pb2 as mc

    return json_format.MessageToJson(text_format.Parse(text, mc.ModelConfig()))


def outputs(response) -> dict[str, list[float]]:
    return {name: np.from_dlpack(t).tolist() for name, t in response.outputs.items()}


def test_a_request_flows_through_the_steps(server):
    (response,) = server.model("pipeline").infer(inputs={"A": A, "B": B})
    assert response.error is None
    assert outputs(response) == {"SUM": (A + B).tolist(), "DIFF": (A - B).tolist()}


def test_only_the_requested_outputs_come_back_and_only_their_steps_run(server):
    """As Triton 2.51 (side by side, upstream L0_simple_ensemble's one-output test): a
    step that makes nothing the request asks for does not run."""
    def runs() -> dict[str, int]:
        return {m: stats_of(server, m)["inference_count"] for m in ("add_sub", "identity")}

    before = runs()
    (response,) = server.model("pipeline").infer(inputs={"A": A, "B": B}, requested_output_names=["DIFF"])
    assert outputs(response) == {"DIFF": (A - B).tolist()}
    after = runs()
    assert {m: after[m] - before[m] for m in after} == {"add_sub": 1, "identity": 1}
    # none named is every output, as Triton reads it (and every step runs)
    (response,) = server.model("pipeline").infer(inputs={"A": A, "B": B}, requested_output_names=[])
    assert outputs(response) == {"SUM": (A + B).tolist(), "DIFF": (A - B).tolist()}


def test_tritonclient_grpc_sees_an_ordinary_model(server):
    for port in frontend(KServeGrpc, server):
        with grpcclient.InferenceServerClient(f"127.0.0.1:{port}") as client:
            assert client.get_model_metadata("pipeline").platform == "ensemble"
            a, b = grpcclient.InferInput("A", [16], "FP32"), grpcclient.InferInput("B", [16], "FP32")
            a.set_data_from_numpy(A)
            b.set_data_from_numpy(B)
            result = client.infer("pipeline", [a, b])
            np.testing.assert_array_equal(result.as_numpy("SUM"), A + B)
            np.testing.assert_array_equal(result.as_numpy("DIFF"), A - B)
            config = client.get_model_config("pipeline", as_json=True)["config"]
            assert [s["model_name"] for s in config["ensemble_scheduling"]["step"]] == [
                "add_sub",
                "identity",
                "identity",
            ]
            # Triton 2.51's ensembles answer with the request's sequence fields (measured).
            answered = client.infer("pipeline", [a, b], sequence_id=7, sequence_start=True).get_response()
            assert {key: str(value).strip() for key, value in answered.parameters.items()} == {
                "sequence_id": "int64_param: 7", "sequence_start": "bool_param: true",
                "sequence_end": "bool_param: false"}


def test_an_ensembles_response_carries_the_requests_sequence_fields(server):
    (response,) = server.model("pipeline").infer(inputs={"A": A, "B": B})
    assert response.parameters == {"sequence_id": 0, "sequence_start": False, "sequence_end": False}
    (response,) = server.model("pipeline").infer(inputs={"A": A, "B": B}, correlation_id="abc", flags=2)
    assert response.parameters == {"sequence_id": "abc", "sequence_start": False, "sequence_end": True}


def test_config_and_metadata_are_rendered_as_triton_renders_them(server):
    reference = json.loads((REFERENCE / "ensemble_pipeline.json").read_text())
    config = server.model("pipeline").config()
    # Newer than Triton 2.51's model_config.proto (our proto follows Triton's current one).
    assert config["ensemble_scheduling"].pop("max_inflight_requests") == 0
    assert config == reference["config"]  # maps compare regardless of order
    assert server.model("pipeline").metadata() == reference["metadata"]


def test_statistics_count_each_request_once_and_sum_the_steps_compute_times(server):
    """As Triton 2.51 counts an ensemble (checked on it with examples/models/pipeline):
    one execution per request, its own queue time, and compute times that are the sums
    of its steps' compute times."""
    def stats(model: str) -> dict:
        return server.model(model).statistics()["model_stats"][0]

    def ns(entry: dict, key: str) -> int:
        return int(entry["inference_stats"][key]["ns"])

    steps = ("add_sub", "identity")
    before = {m: stats(m) for m in ("pipeline", *steps)}
    for _ in range(3):
        (response,) = server.model("pipeline").infer(inputs={"A": A, "B": B})
        assert response.error is None
    after = {m: stats(m) for m in ("pipeline", *steps)}
    ensemble, was = after["pipeline"], before["pipeline"]
    successes = ensemble["inference_stats"]["success"]["count"]
    assert successes - was["inference_stats"]["success"]["count"] == 3
    assert ensemble["execution_count"] - was["execution_count"] == 3
    identity_runs = after["identity"]["inference_count"] - before["identity"]["inference_count"]
    assert identity_runs == 6  # two identity steps each
    for key in ("compute_input", "compute_infer", "compute_output"):
        spent = ns(ensemble, key) - ns(was, key)
        assert spent > 0
        assert spent == sum(ns(after[m], key) - ns(before[m], key) for m in steps), key
    (batch,) = [row for row in ensemble["batch_stats"] if row["batch_size"] == 1]
    assert int(batch["compute_infer"]["ns"]) == ns(ensemble, "compute_infer")
    # Its queue time is its own wait before the steps start, not the steps' queues.
    queued = ns(ensemble, "queue") - ns(was, "queue")
    assert 0 <= queued < ns(ensemble, "compute_infer") - ns(was, "compute_infer")


def test_a_failing_step_fails_the_request_with_its_error(server):
    load_guarded(server)
    x = np.arange(5, dtype=np.float32)
    (ok,) = server.model("guarded").infer(inputs={"X": x})
    assert outputs(ok) == {"Y": x.tolist()}
    (failed,) = server.model("guarded").infer(
        inputs={"X": x}, parameters={"mode": "raise"}, raise_on_error=False
    )
    assert isinstance(failed.error, dlserve.InternalError)
    assert failed.error.message.startswith("in ensemble 'guarded', ")
    assert "boom" in failed.error.message
    (coded,) = server.model("guarded").infer(
        inputs={"X": x}, parameters={"mode": "error:INVALID_ARG"}, raise_on_error=False
    )
    assert isinstance(coded.error, dlserve.InvalidArgumentError)
    # The step's failures are its BACKEND failures; the ensemble's, OTHER (Triton's labels).
    metrics = server.metrics()
    assert 'nv_inference_request_failure{model="guarded",reason="BACKEND",version="1"} 0' in metrics
    assert 'nv_inference_request_failure{model="guarded",reason="OTHER",version="1"} 2' in metrics


def test_cancelling_the_ensemble_cancels_the_running_step(server):
    load_guarded(server)

    async def run() -> tuple[object, float]:
        iterator = server.model("guarded").async_infer(
            inputs={"X": np.ones(3, np.float32)}, parameters={"mode": "sleep:3"}, raise_on_error=False
        )
        asyncio.get_running_loop().call_later(0.3, iterator.cancel)
        start = time.monotonic()
        async for response in iterator:
            return response, time.monotonic() - start
        raise AssertionError("no response")

    failed_before = stats_of(server, "guarded")["inference_stats"]["fail"]["count"]
    response, took = asyncio.run(run())
    assert isinstance(response.error, dlserve.CancelledError)
    assert response.error.message == "request was cancelled"  # the ensemble's own, not a step's
    assert took < 2.0  # answered at the cancel, not after the 3 s step
    # the step request was cancelled too: faulty is free again well before its sleep ends
    (after,) = server.model("guarded").infer(inputs={"X": np.ones(3, np.float32)})
    assert after.error is None
    assert stats_of(server, "guarded")["inference_stats"]["fail"]["count"] == failed_before + 1


# -- decoupled steps -----------------------------------------------------------------------
# What Triton 2.51 answered for the same repository (tests/models: stream_double,
# decoupled, double), over a tritonclient gRPC stream: each streamed value flows on
# through double as one response, the last one final; no values, one flag-only final.


def stream(server: dlserve.Server, values: list[int], **parameters):
    return list(
        server.model("stream_double").infer(
            inputs={"IN": np.array(values, np.int32)}, parameters=parameters, raise_on_error=False
        )
    )


def test_a_streaming_step_streams_through_the_steps_after_it(server):
    responses = stream(server, [5, 6, 7], mode="stream")  # all sent within execute
    assert [outputs(r) for r in responses] == [{"OUT": [10]}, {"OUT": [12]}, {"OUT": [14]}]
    assert [r.final for r in responses] == [False, False, True]


def test_a_step_streaming_from_a_thread_ends_with_one_final(server):
    # The model's thread sends the stream's end right after its last value. Whether the
    # last value's answer is already out by then (so a flag-only final follows it, as
    # in Triton when that happens) is a race between that flag and the steps after it:
    # both endings are right; values, order and a single final are not negotiable.
    responses = stream(server, [5, 6, 7], mode="thread", delay_ms=20)
    values = [r for r in responses if r.outputs]
    assert [outputs(r) for r in values] == [{"OUT": [10]}, {"OUT": [12]}, {"OUT": [14]}]
    assert [r.final for r in responses] == [False] * (len(responses) - 1) + [True]
    assert len(responses) == 3 or (len(responses) == 4 and not responses[-1].outputs)


def test_a_stream_of_nothing_is_one_flag_only_final(server):
    (response,) = stream(server, [])
    assert response.final and response.error is None and not response.outputs


def test_an_error_mid_stream_ends_the_ensemble_with_it(server):
    responses = stream(server, [5, 6, 7], mode="error_mid")
    assert responses[-1].final
    assert responses[-1].error.message == "in ensemble 'stream_double', failed halfway"
    assert isinstance(responses[-1].error, dlserve.InvalidArgumentError)


def test_a_decoupled_ensemble_streams_over_grpc(server):
    for port in frontend(KServeGrpc, server):
        with grpcclient.InferenceServerClient(f"127.0.0.1:{port}") as client:
            results: queue.Queue = queue.Queue()
            client.start_stream(callback=lambda result, error: results.put((result, error)))
            values = grpcclient.InferInput("IN", [3], "INT32")
            values.set_data_from_numpy(np.array([5, 6, 7], np.int32))
            client.async_stream_infer("stream_double", [values], enable_empty_final_response=True)
            got = []
            while not got or not got[-1][1]:
                result, error = results.get(timeout=10)
                assert error is None
                final = result.get_response().parameters["triton_final_response"].bool_param
                got.append((result.as_numpy("OUT").tolist(), final))
            client.stop_stream()
    assert got == [([10], False), ([12], False), ([14], True)]


def test_a_streaming_step_makes_the_ensemble_decoupled(server):
    """Triton's rule (measured on 2.51): an ensemble with a decoupled step is decoupled,
    whatever its config says; it answered every request with an error before."""
    server.load("not_decoupled", {"config": config_json(STREAMING_NOT_DECOUPLED), "file:1/.keep": b""})
    model = server.model("not_decoupled")
    assert model.config()["model_transaction_policy"] == {"decoupled": True}
    responses = list(model.infer(inputs={"IN": np.array([4, 5, 6], np.int32)}, raise_on_error=False))
    assert all(r.error is None for r in responses)
    assert len([r for r in responses if r.outputs]) == 3  # one per element, as the step sends
    assert [r.final for r in responses] == [False] * (len(responses) - 1) + [True]


def test_a_last_step_sending_its_last_value_with_the_final_flag_answers_it_as_final(server):
    """As Triton 2.51 (measured with its QA mock_llm ensemble): a decoupled last step whose
    last response carries the final flag makes that response the ensemble's final one; it
    came out as a non-final answer and a flag-only final after it."""
    server.load("not_decoupled", {"config": config_json(STREAMING_NOT_DECOUPLED), "file:1/.keep": b""})
    responses = list(server.model("not_decoupled").infer(
        inputs={"IN": np.array([4, 5, 6], np.int32)}, parameters={"mode": "final_with_last"},
    ))
    assert [(outputs(r)["OUT"], r.final) for r in responses] == [([4], False), ([5], False), ([6], True)]


STREAMING_NOT_DECOUPLED = """
name: "not_decoupled"
platform: "ensemble"
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
ensemble_scheduling {
  step [
    { model_name: "decoupled" model_version: -1
      input_map { key: "IN" value: "IN" } output_map { key: "OUT" value: "OUT" } }
  ]
}
"""


ADD_INT = {
    "config.pbtxt": """
name: "add_int"
backend: "python"
max_batch_size: 0
input [
  { name: "X" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] }
]
output [ { name: "SUM" data_type: TYPE_INT32 dims: [ 1 ] } ]
""",
    "1/model.py": """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("SUM", sum(
                pb_utils.get_input_tensor_by_name(r, n).as_numpy() for n in "XY"))])
            for r in requests
        ]
""",
}


def streaming_ensemble(name: str, steps: list[tuple[str, dict[str, str], dict[str, str]]]) -> str:
    """A decoupled ensemble of these steps (model, input_map, output_map) over INT32
    tensors: IN (the stream's values) and K ([1]) in, as used; OUT and OUT2 out, as made."""
    read = {t for _, inputs, _ in steps for t in inputs.values()}
    made = {t for _, _, outputs in steps for t in outputs.values()}
    tensors = [
        ("input", "IN", "-1"), ("input", "K", "1"), ("output", "OUT", "1"), ("output", "OUT2", "1")
    ]
    declared = "".join(
        f'{kind} [ {{ name: "{tensor}" data_type: TYPE_INT32 dims: [ {dims} ] }} ]\n'
        for kind, tensor, dims in tensors
        if tensor in (read if kind == "input" else made)
    )

    def maps(kind: str, mapping: dict[str, str]) -> str:
        return " ".join(f'{kind} {{ key: "{k}" value: "{v}" }}' for k, v in mapping.items())

    listed = ", ".join(
        f'{{ model_name: "{model}" model_version: -1 {maps("input_map", inputs)} '
        f'{maps("output_map", outputs)} }}'
        for model, inputs, outputs in steps
    )
    return (
        f'name: "{name}" platform: "ensemble" model_transaction_policy {{ decoupled: true }}\n'
        f"{declared}ensemble_scheduling {{ step [ {listed} ] }}\n"
    )


STREAM = ("decoupled", {"IN": "IN"}, {"OUT": "value"})


@pytest.mark.parametrize(
    "name, steps",
    [
        # a stream and a plain step beside it: each response waited for the plain
        # step's output, which only the request's first branch had (the stream hung)
        ("beside_a_plain_step", [STREAM, ("double", {"IN": "K"}, {"OUT": "twice"}),
                                 ("add_int", {"X": "value", "Y": "twice"}, {"SUM": "OUT"})]),
        # two streams into one step: neither stream's responses saw the other's (hung)
        ("two_streams", [STREAM, ("decoupled", {"IN": "IN"}, {"OUT": "other"}),
                         ("add_int", {"X": "value", "Y": "other"}, {"SUM": "OUT"})]),
        ("beside_an_input", [STREAM, ("add_int", {"X": "value", "Y": "K"}, {"SUM": "OUT"})]),
        ("outputs_apart", [("decoupled", {"IN": "IN"}, {"OUT": "OUT"}),
                           ("double", {"IN": "K"}, {"OUT": "OUT2"})]),
    ],
)
def test_a_step_reads_one_stream_or_none_as_in_triton(make_repo, servers, name, steps):
    """Triton 2.51 (side by side) refuses at load, in these words, an ensemble where a
    step, or the ensemble's outputs, read a decoupled step's responses and anything not
    made from them: another stream, another step's output, an ensemble input. A stream
    through plain steps that read it twice is fine."""
    merged = streaming_ensemble("merged", [
        STREAM, ("double", {"IN": "value"}, {"OUT": "twice"}),
        ("add_int", {"X": "value", "Y": "twice"}, {"SUM": "OUT"}),
    ])
    repo = make_repo("decoupled", "double", extra={
        "add_int": ADD_INT,
        "merged": {"config.pbtxt": merged, "1/.keep": ""},
        name: {"config.pbtxt": streaming_ensemble(name, steps), "1/.keep": ""},
    })
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    with pytest.raises(dlserve.InvalidArgumentError) as info:
        server.load(name)
    assert str(info.value) == (
        f"load failed for model '{name}': in ensemble {name}, step of model '{name}' receives "
        "inputs originated from different decoupled models\n"
    )
    server.load("merged")
    responses = server.model("merged").infer(inputs={"IN": np.array([1, 2], np.int32)})
    assert [outputs(r)["OUT"] for r in responses if r.outputs] == [[3], [6]]


def stats_of(server: dlserve.Server, model: str) -> dict:
    return server.model(model).statistics()["model_stats"][0]


def test_an_ensemble_whose_step_model_is_missing_fails_to_load_as_in_triton(make_repo, servers):
    """Triton 2.51 (measured) refuses it at load in these words (it loaded READY here and
    failed every request)."""
    repo = make_repo("pipeline", "identity")  # add_sub is missing
    server = servers.start(repo, exit_on_error=False)
    assert not server.model("pipeline").ready()
    (row,) = [r for r in server.engine.manager.index() if r["name"] == "pipeline"]
    assert (row["state"], row["reason"]) == (
        "UNAVAILABLE", "ensemble pipeline contains models that are not available or ambiguous: add_sub"
    )
    explicit = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    with pytest.raises(dlserve.InvalidArgumentError) as info:
        explicit.load("pipeline")
    assert str(info.value) == (
        "load failed for model 'pipeline': ensemble pipeline contains models that are not "
        "available or ambiguous: add_sub\n"
    )


def test_explicit_mode_loading_an_ensemble_loads_its_steps(make_repo, servers):
    server = servers.start(
        make_repo("pipeline", "add_sub", "identity"), model_control_mode=ModelControlMode.EXPLICIT
    )
    server.load("pipeline")
    assert server.model("add_sub").ready() and server.model("identity").ready()
    assert server.model("pipeline").ready()
    (response,) = server.model("pipeline").infer(inputs={"A": A, "B": B})
    assert outputs(response)["SUM"] == (A + B).tolist()
    server.unload("pipeline", unload_dependents=True)  # the steps' models go with it
    assert not any(server.model(m).ready() for m in ("pipeline", "add_sub", "identity"))


def test_unload_dependents_keeps_models_loaded_by_name_or_used_by_another_ensemble(make_repo, servers):
    second = (MODELS / "pipeline" / "config.pbtxt").read_text().replace('name: "pipeline"', 'name: "second"')
    repo = make_repo("pipeline", "add_sub", "identity", extra={"second": {"config.pbtxt": second, "1/.keep": ""}})
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    server.load("identity")  # by name: stays, as in Triton
    server.load("pipeline")  # loads add_sub for its steps
    server.load("second")
    server.unload("pipeline", unload_dependents=True)
    assert server.model("identity").ready() and server.model("add_sub").ready()  # second uses add_sub
    assert server.model("second").ready()
    server.unload("second", unload_dependents=True)
    assert not server.model("add_sub").ready()  # loaded only for the ensembles, now unused
    assert server.model("identity").ready()


OUTER = """
name: "outer"
platform: "ensemble"
input [ { name: "A" data_type: TYPE_FP32 dims: [ 16 ] }, { name: "B" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "SUM" data_type: TYPE_FP32 dims: [ 16 ] } ]
ensemble_scheduling { step [ {
  model_name: "pipeline" model_version: -1
  input_map { key: "A" value: "A" } input_map { key: "B" value: "B" }
  output_map { key: "SUM" value: "SUM" } } ] }
"""


def test_unload_dependents_goes_down_through_ensembles_of_ensembles(make_repo, servers):
    repo = make_repo("pipeline", "add_sub", "identity", extra={"outer": {"config.pbtxt": OUTER, "1/.keep": ""}})
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    server.load("outer")  # loads pipeline, which loads add_sub and identity
    assert all(server.model(m).ready() for m in ("outer", "pipeline", "add_sub", "identity"))
    server.unload("outer", unload_dependents=True)
    assert not any(server.model(m).ready() for m in ("outer", "pipeline", "add_sub", "identity"))


def test_an_ensemble_that_fails_to_load_leaves_no_step_model_it_loaded(make_repo, servers):
    failing = (MODELS / "init_fail" / "1" / "model.py").read_text()
    identity = {"config.pbtxt": (MODELS / "identity" / "config.pbtxt").read_text(), "1/model.py": failing}
    repo = make_repo("pipeline", "add_sub", extra={"identity": identity})
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    with pytest.raises(dlserve.InvalidArgumentError, match="its step model 'identity' did not load"):
        server.load("pipeline")
    assert not server.model("add_sub").ready()  # loaded for it (first, by name order), unloaded again
    server.load("add_sub")  # a model loaded by name is not the failed ensemble's to unload
    with pytest.raises(dlserve.InvalidArgumentError):
        server.load("pipeline")
    assert server.model("add_sub").ready()


def test_an_ensemble_loaded_while_its_step_unloads_loads_the_step_again(make_repo, servers, tmp_path):
    slow = (MODELS / "add_sub" / "1" / "model.py").read_text() + """

    def finalize(self):
        import time
        time.sleep(1.5)
"""
    add_sub = {"config.pbtxt": (MODELS / "add_sub" / "config.pbtxt").read_text(), "1/model.py": slow}
    repo = make_repo("pipeline", "identity", extra={"add_sub": add_sub})
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    server.load("add_sub")
    unloading = threading.Thread(target=server.unload, args=("add_sub",))
    unloading.start()
    time.sleep(0.5)  # add_sub is UNLOADING (its finalize sleeps)
    server.load("pipeline")
    unloading.join()
    assert server.model("pipeline").ready() and server.model("add_sub").ready()
    (response,) = server.model("pipeline").infer(inputs={"A": A, "B": B})
    assert outputs(response)["SUM"] == (A + B).tolist()


def test_unloading_a_step_model_unloads_the_ensembles_that_use_it(make_repo, servers):
    server = servers.start(
        make_repo("pipeline", "add_sub", "identity"), model_control_mode=ModelControlMode.EXPLICIT
    )
    server.load("pipeline")
    server.unload("add_sub")  # the ensemble cannot run without it: it goes too, as in Triton
    states = {name: (model.state, model.reason) for (name, _), model in server.models().items()}
    assert states["pipeline"] == states["add_sub"] == ("UNAVAILABLE", "unloaded")
    assert states["identity"][0] == "READY"
    assert server.ready()  # what is loaded is ready
    # loaded again, it brings the ensemble back with it, as Triton does
    server.load("add_sub")
    assert server.model("pipeline").ready()
    (response,) = server.model("pipeline").infer(inputs={"A": A, "B": B})
    assert outputs(response)["SUM"] == (A + B).tolist()
    # an ensemble unloaded by name stays unloaded when its steps come and go
    server.unload("pipeline")
    server.unload("add_sub")
    server.load("add_sub")
    assert not server.model("pipeline").ready()


def test_an_ensemble_comes_back_when_its_step_loads_for_another_ensemble(make_repo, servers):
    """Triton 2.51 (side by side): pipeline, unloaded with add_sub, loads again when
    add_sub comes back as the step of another ensemble being loaded; add_sub then stays
    when that one is unloaded with its dependents, pipeline using it."""
    over = {"over_add_sub": _ensemble_over("add_sub")}
    repo = make_repo("pipeline", "add_sub", "identity", extra=over)
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    server.load("pipeline")
    server.unload("add_sub")
    assert not server.model("pipeline").ready()
    server.load("over_add_sub")
    assert server.model("pipeline").ready()
    (response,) = server.model("pipeline").infer(inputs={"A": A, "B": B})
    assert outputs(response)["SUM"] == (A + B).tolist()
    server.unload("over_add_sub", unload_dependents=True, wait_until_unloaded=True)
    assert server.model("add_sub").ready() and server.model("pipeline").ready()


def test_a_load_while_an_ensemble_drains_does_not_lose_its_way_back(make_repo, servers, tmp_path):
    """guarded (identity then faulty) drains a held request while faulty unloads under it;
    a load of another model meanwhile must not take faulty for back (it still serves
    until guarded has drained): faulty loaded again brings guarded back."""
    guarded = {"guarded": {"config.pbtxt": GUARDED, "1/.keep": ""}}
    repo = make_repo("identity", "faulty", "double", extra=guarded)
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    server.load("guarded")
    release = tmp_path / "release"
    answers: list = []
    held = threading.Thread(target=lambda: answers.extend(server.model("guarded").infer(
        inputs={"X": np.ones(2, np.float32)},
        parameters={"mode": f"hold:{release}"},
        raise_on_error=False,
    )))
    held.start()
    wait_until(lambda: os.path.exists(f"{release}.held"))
    unloading = threading.Thread(target=lambda: server.unload("faulty", wait_until_unloaded=True))
    unloading.start()
    wait_until(lambda: not server.model("guarded").ready())  # draining
    server.load("double")
    release.touch()
    held.join(30)
    unloading.join(30)
    assert [a.error for a in answers] == [None]  # the held request was answered
    assert not server.model("guarded").ready() and not server.model("faulty").ready()
    server.load("faulty")
    assert server.model("guarded").ready()


def test_ensembles_of_ensembles_come_back_with_their_step_model_one_load_at_a_time(make_repo, servers):
    """outer runs pipeline runs add_sub: add_sub back brings pipeline, which brings outer, with
    model_load_thread_count 1 too (those loads take no turn of their own, so none waits for
    the one that started it)."""
    repo = make_repo("pipeline", "add_sub", "identity", extra={"outer": {"config.pbtxt": OUTER, "1/.keep": ""}})
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT, model_load_thread_count=1)
    server.load("outer")
    server.unload("add_sub")
    assert not server.model("outer").ready() and not server.model("pipeline").ready()
    server.load("add_sub")
    assert server.model("pipeline").ready() and server.model("outer").ready()
    (response,) = server.model("outer").infer(inputs={"A": A, "B": B})
    assert outputs(response)["SUM"] == (A + B).tolist()


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ("", "ensemble_scheduling must have at least one step"),
        (
            '{ model_name: "identity" input_map { key: "INPUT0" value: "nowhere" } '
            'output_map { key: "OUTPUT0" value: "Y" } }',
            "reads ['nowhere'], which no step makes",
        ),
        (
            '{ model_name: "identity" input_map { key: "INPUT0" value: "X" } '
            'output_map { key: "OUTPUT0" value: "other" } }',
            "no step makes the ensemble output 'Y'",
        ),
        (
            '{ model_name: "identity" input_map { key: "INPUT0" value: "X" } output_map { key: "OUTPUT0" value: "Y" } }, '
            '{ model_name: "identity" input_map { key: "INPUT0" value: "X" } output_map { key: "OUTPUT0" value: "Y" } }',
            "tensor 'Y' is made twice",
        ),
        (
            '{ model_name: "identity" input_map { key: "INPUT0" value: "b" } output_map { key: "OUTPUT0" value: "a" } }, '
            '{ model_name: "identity" input_map { key: "INPUT0" value: "a" } output_map { key: "OUTPUT0" value: "b" } }, '
            '{ model_name: "identity" input_map { key: "INPUT0" value: "X" } output_map { key: "OUTPUT0" value: "Y" } }',
            "wait on each other's outputs (a cycle)",
        ),
        # Triton 2.51's words (side by side, or from its source for the maps)
        (
            '{ model_name: "identity" output_map { key: "OUTPUT0" value: "Y" } }',
            "must specify 'input_map' in step 0 of ensemble 'bad'",
        ),
        (
            '{ model_name: "identity" input_map { key: "INPUT0" value: "X" } '
            'output_map { key: "OUTPUT0" value: "Y" } }, '
            '{ model_name: "identity" input_map { key: "INPUT0" value: "X" } }',
            "must specify 'output_map' in step 1 of ensemble 'bad'",
        ),
        (
            '{ model_name: "identity" input_map { key: "INPUT0" value: "X" } '
            'output_map { key: "OUTPUT0" value: "Y" } }, '
            '{ model_name: "identity" input_map { key: "INPUT0" value: "X" } '
            'output_map { key: "OUTPUT0" value: "spare" } }',
            "ensemble tensor 'spare' is unused in ensemble 'bad'",
        ),
    ],
    ids=[
        "no-steps", "unknown-tensor", "output-not-made", "made-twice", "cycle", "no-input-map",
        "no-output-map", "unused-tensor",
    ],
)
def test_a_bad_ensemble_config_is_refused_with_the_reason(make_repo, servers, steps, message):
    server = servers.start(make_repo("identity"), model_control_mode=ModelControlMode.EXPLICIT)
    text = GUARDED.replace("guarded", "bad").split("ensemble_scheduling")[0]
    text += f"ensemble_scheduling {{ step [ {steps} ] }}" if steps else "ensemble_scheduling { }"
    with pytest.raises(dlserve.InvalidArgumentError, match=re.escape(message)):
        server.load("bad", {"config": config_json(text), "file:1/.keep": b""})


def test_a_limit_on_a_step_s_requests_in_flight_is_refused_not_ignored(make_repo, servers):
    """max_inflight_requests is newer than Triton 2.51 (which fails to parse it) and dlserve
    does not apply it: a config that sets it is refused with the reason."""
    server = servers.start(make_repo("identity"), model_control_mode=ModelControlMode.EXPLICIT)
    text = GUARDED.replace("guarded", "capped").split("ensemble_scheduling")[0]
    text += (
        'ensemble_scheduling { max_inflight_requests: 4 step [ { model_name: "identity" model_version: -1 '
        'input_map { key: "INPUT0" value: "X" } output_map { key: "OUTPUT0" value: "Y" } } ] }'
    )
    with pytest.raises(dlserve.InvalidArgumentError, match="max_inflight_requests is not supported"):
        server.load("capped", {"config": config_json(text), "file:1/.keep": b""})
    text = text.replace("max_inflight_requests: 4 ", "")
    server.load("capped", {"config": config_json(text), "file:1/.keep": b""})
    assert server.model("capped").ready()


def _ensemble_over(
    step: str, input_key: str = "INPUT0", output_key: str = "OUTPUT0", version: int = -1, batch: int = 0,
    out_type: str = "TYPE_FP32", in_dims: str = "-1",
) -> dict[str, str]:
    return {
        "config.pbtxt": f"""
platform: "ensemble"
max_batch_size: {batch}
input [ {{ name: "EIN" data_type: TYPE_FP32 dims: [ {in_dims} ] }} ]
output [ {{ name: "EOUT" data_type: {out_type} dims: [ -1 ] }} ]
ensemble_scheduling {{ step [ {{ model_name: "{step}" model_version: {version}
  input_map {{ key: "{input_key}" value: "EIN" }} output_map {{ key: "{output_key}" value: "EOUT" }} }} ] }}
""",
        "1/.keep": "",
    }


def test_an_ensemble_that_does_not_fit_its_steps_fails_to_load_as_in_triton(make_repo, servers):
    """Checked at load against the steps' loaded configs, in Triton 2.51's words (they
    loaded READY and failed every request). Their names sort before the step's: the
    ensembles load after the models they run all the same."""
    repo = make_repo(
        "identity",
        extra={
            "a_bad_input": _ensemble_over("identity", input_key="NOPE"),
            "a_bad_output": _ensemble_over("identity", output_key="NOPE"),
            "a_pinned_missing": _ensemble_over("identity", version=7),
            "a_bigger_batches": _ensemble_over("identity", batch=8),
            "a_other_type": _ensemble_over("identity", out_type="TYPE_INT32"),
            "a_other_shape": _ensemble_over("identity", in_dims="2, 3"),
            "a_fine": _ensemble_over("identity"),
        },
    )
    server = servers.start(repo, exit_on_error=False)
    reasons = {name: entry.reason for (name, _), entry in server.models().items() if entry.state != "READY"}
    assert reasons == {
        "a_bad_input": "in ensemble a_bad_input, ensemble tensor EIN is mapping to non-existing "
        "input NOPE in model identity",
        "a_bad_output": "in ensemble a_bad_output, ensemble tensor EOUT is mapped from "
        "non-existing output NOPE in model identity",
        "a_pinned_missing": "ensemble 'a_pinned_missing' depends on 'identity' whose required version 7 is not loaded.",
        "a_bigger_batches": "ensemble a_bigger_batches allows maximum batch size 8, but it contains model "
        "identity which only allows maximum batch size to be 0",
        # (both loaded and answered with another type or shape than their metadata said)
        "a_other_type": "in ensemble a_other_type, ensemble tensor EOUT: inconsistent data type: TYPE_INT32 "
        "is inferred from model a_other_type while TYPE_FP32 is inferred from model identity",
        "a_other_shape": "in ensemble a_other_shape, ensemble tensor EIN: inconsistent shape: [2,3] is "
        "inferred from model a_other_shape while [-1] is inferred from model identity",
    }
    (response,) = server.model("a_fine").infer(inputs={"EIN": np.arange(3, dtype=np.float32)})
    np.testing.assert_array_equal(response.outputs["EOUT"].as_numpy(), np.arange(3))


OPTIONAL_STEP_CONFIG = """
backend: "python"
input [
  { name: "X" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "OPT" data_type: TYPE_FP32 dims: [ -1 ] optional: true }
]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""
OPTIONAL_STEP_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            opt = pb_utils.get_input_tensor_by_name(request, "OPT")
            y = x * 2 if opt is None else x + opt.as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y)]))
        return responses
"""
OPTIONAL_ENSEMBLE = """
platform: "ensemble"
input [
  { name: "EX" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "EOPT" data_type: TYPE_FP32 dims: [ -1 ] optional: true }
]
output [ { name: "EY" data_type: TYPE_FP32 dims: [ -1 ] } ]
ensemble_scheduling { step [ { model_name: "opt_step" model_version: -1
  input_map { key: "X" value: "EX" } input_map { key: "OPT" value: "EOPT" }
  output_map { key: "Y" value: "EY" } } ] }
"""


def test_an_optional_input_the_request_leaves_out_is_left_out_of_the_steps(make_repo, servers):
    """As in Triton: the step runs without it (the request waited forever for a tensor
    that would never come)."""
    repo = make_repo(extra={
        "opt_step": {"config.pbtxt": OPTIONAL_STEP_CONFIG, "1/model.py": OPTIONAL_STEP_MODEL},
        "opt_ensemble": {"config.pbtxt": OPTIONAL_ENSEMBLE, "1/.keep": ""},
    })
    server = servers.start(repo)
    x = np.array([1.0, 2.0], dtype=np.float32)
    (without,) = server.model("opt_ensemble").infer(inputs={"EX": x})
    assert without.outputs["EY"].as_numpy().tolist() == [2.0, 4.0]
    (given,) = server.model("opt_ensemble").infer(inputs={"EX": x, "EOPT": np.ones(2, np.float32)})
    assert given.outputs["EY"].as_numpy().tolist() == [2.0, 3.0]



SOMETIMES_STEP_CONFIG = """
backend: "python"
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }, { name: "EXTRA" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""
SOMETIMES_STEP_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):  # EXTRA, which its config declares, it never returns
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2)])
            for r in requests
        ]
"""
SOMETIMES_ENSEMBLE = """
platform: "ensemble"
input [ { name: "EX" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "EY" data_type: TYPE_FP32 dims: [ -1 ] }, { name: "EEXTRA" data_type: TYPE_FP32 dims: [ -1 ] } ]
ensemble_scheduling { step [
  { model_name: "sometimes" model_version: -1 input_map { key: "X" value: "EX" }
    output_map [ { key: "Y" value: "EY" }, { key: "EXTRA" value: "EEXTRA" } ] }
] }
"""
FEEDING_ENSEMBLE = """
platform: "ensemble"
input [ { name: "EX" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "EY" data_type: TYPE_FP32 dims: [ -1 ] } ]
ensemble_scheduling { step [
  { model_name: "sometimes" model_version: -1 input_map { key: "X" value: "EX" }
    output_map [ { key: "Y" value: "doubled" }, { key: "EXTRA" value: "extra" } ] },
  { model_name: "%s" model_version: -1
    input_map [ { key: "X" value: "doubled" }, { key: "%s" value: "extra" } ] output_map { key: "Y" value: "EY" } }
] }
"""


def test_an_output_a_step_does_not_return_is_left_out(make_repo, servers):
    """As Triton 2.51 answers it (measured side by side; TensorRT-LLM's ensemble maps
    optional outputs of its step): an ensemble output no step returned is left out of the
    answer, asked for or not, and a step reading such a tensor runs without it, so an
    optional input is simply absent and a required one fails that step's own input check."""
    repo = make_repo(extra={
        "sometimes": {"config.pbtxt": SOMETIMES_STEP_CONFIG, "1/model.py": SOMETIMES_STEP_MODEL},
        "opt_step": {"config.pbtxt": OPTIONAL_STEP_CONFIG, "1/model.py": OPTIONAL_STEP_MODEL},
        "sometimes_ensemble": {"config.pbtxt": SOMETIMES_ENSEMBLE, "1/.keep": ""},
        "optional_fed": {"config.pbtxt": FEEDING_ENSEMBLE % ("opt_step", "OPT"), "1/.keep": ""},
        "required_fed": {"config.pbtxt": FEEDING_ENSEMBLE % ("sometimes", "X"), "1/.keep": ""},
    })
    (repo / "required_fed" / "config.pbtxt").write_text(
        (repo / "required_fed" / "config.pbtxt").read_text().replace(
            '{ key: "X" value: "doubled" }, { key: "X" value: "extra" }', '{ key: "X" value: "extra" }'
        ).replace('{ key: "Y" value: "doubled" }, ', "")  # (an unused tensor fails the load)
    )
    server = servers.start(repo)
    x = np.array([1.0, 2.0], dtype=np.float32)
    for requested in (None, ["EY", "EEXTRA"]):
        (response,) = server.model("sometimes_ensemble").infer(inputs={"EX": x}, requested_output_names=requested)
        assert response.error is None
        assert outputs(response) == {"EY": [2.0, 4.0]}
    (fed,) = server.model("optional_fed").infer(inputs={"EX": x})
    assert outputs(fed) == {"EY": [4.0, 8.0]}  # opt_step ran without OPT: doubled twice
    (starved,) = server.model("required_fed").infer(inputs={"EX": x}, raise_on_error=False)
    assert isinstance(starved.error, dlserve.InvalidArgumentError)
    assert starved.error.message.startswith("in ensemble 'required_fed', ")
    assert "missing required input(s) ['X']" in starved.error.message


CHAIN = """
name: "chain"
platform: "ensemble"
input [ { name: "A" data_type: TYPE_FP32 dims: [ 16 ] },
        { name: "B" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "SUM" data_type: TYPE_FP32 dims: [ 16 ] },
         { name: "COPY" data_type: TYPE_FP32 dims: [ -1 ] } ]
ensemble_scheduling { step [
  { model_name: "add_sub" model_version: -1
    input_map [ { key: "INPUT0" value: "A" }, { key: "INPUT1" value: "B" } ]
    output_map { key: "OUTPUT0" value: "SUM" } },
  { model_name: "identity" model_version: -1
    input_map { key: "INPUT0" value: "SUM" } output_map { key: "OUTPUT0" value: "COPY" } }
] }
"""


def test_an_output_that_also_feeds_a_later_step_is_answered_without_running_it(make_repo, servers):
    """Asking only for SUM, which identity also reads, runs add_sub alone. (Triton 2.51
    answers that request with "unexpected deadlock, at least one output is not set while
    no more ensemble steps can be made": a fault of its pruning dlserve does not copy.)"""
    chain = {"chain": {"config.pbtxt": CHAIN, "1/.keep": ""}}
    server = servers.start(make_repo("add_sub", "identity", extra=chain))
    model = server.model("chain")

    def identity_runs() -> int:
        return stats_of(server, "identity")["inference_count"]

    (response,) = model.infer(inputs={"A": A, "B": B}, requested_output_names=["SUM"])
    assert outputs(response) == {"SUM": (A + B).tolist()}
    assert identity_runs() == 0
    (response,) = model.infer(inputs={"A": A, "B": B}, requested_output_names=["COPY"])
    assert outputs(response) == {"COPY": (A + B).tolist()}
    assert identity_runs() == 1


RANKED = """
name: "ranked"
platform: "ensemble"
max_batch_size: 1
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "ORDER" data_type: TYPE_INT64 dims: [ 1 ] } ]
ensemble_scheduling {
  step [
    { model_name: "batcher" model_version: -1
      input_map { key: "INPUT0" value: "X" } output_map { key: "ORDER" value: "ORDER" } }
  ]
}
"""

PRIORITISED_BATCHER = (MODELS / "batcher" / "config.pbtxt").read_text().replace(
    "max_batch_size: 8", "max_batch_size: 1"
).replace("dynamic_batching { }", "dynamic_batching { priority_levels: 2 default_priority_level: 2 }")


def test_a_step_runs_at_the_ensemble_requests_priority(make_repo, servers):
    """As Triton, a step's request carries the ensemble request's priority: a priority-1
    request through the ensemble overtakes default-level ones queued at the step model."""
    repo = make_repo("batcher", extra={
        "batcher": {"config.pbtxt": PRIORITISED_BATCHER},
        "ranked": {"config.pbtxt": RANKED, "1/.keep": ""},
    })
    server = servers.start(repo)
    row = np.ones((1, 4), np.float32)

    async def first(model: str, **kwargs) -> dlserve.InferenceResponse:
        async for response in server.model(model).async_infer(inputs=kwargs.pop("inputs"), **kwargs):
            return response
        raise AssertionError("no response")

    async def run() -> tuple[list[int], int]:
        holder = asyncio.ensure_future(first("batcher", inputs={"INPUT0": row}, parameters={"sleep": 0.4}))
        await asyncio.sleep(0.1)  # the holder is executing; what follows queues
        low = [asyncio.ensure_future(first("batcher", inputs={"INPUT0": row})) for _ in range(3)]
        await asyncio.sleep(0.05)
        high = asyncio.ensure_future(first("ranked", inputs={"X": row}, priority=1))
        await holder
        order = [int(np.from_dlpack((await f).outputs["ORDER"])[0, 0]) for f in low]
        return order, int(np.from_dlpack((await high).outputs["ORDER"])[0, 0])

    low, high = asyncio.run(run())
    assert high < min(low)
