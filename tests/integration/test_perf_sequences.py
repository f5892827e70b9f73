"""``dlserve perf`` against a sequence model, as perf_analyzer drives one: every request
names its sequence, the first is flagged START and the last END, IDs count up from
``--sequence-id-range``'s start, lengths follow ``--sequence-length`` (or a JSON file's
streams), and a run that stops mid-sequence ends the sequence. The model writes down
every request it gets (``requests.log`` in its folder; not the fillers of empty batch
slots), which is what these tests read.
Also ``--request-parameter`` and ``-H`` (which reach the model as request parameters).
"""

from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from ..conftest import MODELS
from .test_perf_cli import QUICK, perf, run_server

SEQUENCE_CONFIG = """
backend: "python"
max_batch_size: 4
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] }
  ]
}
instance_group [ { count: 2 kind: KIND_CPU } ]
"""
SEQUENCE_MODEL = """
import json
import os

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.log = open(os.path.join(args["model_repository"], "requests.log"), "a", buffering=1)

    def execute(self, requests):
        responses = []
        for request in requests:
            def value(name):
                return int(pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)[0])

            if request.correlation_id() == 0:  # the sequence batcher's filler for an empty slot
                responses.append(None)
                continue
            record = {
                "id": request.correlation_id(), "start": value("START"), "end": value("END"),
                "input": value("INPUT"), "parameters": json.loads(request.parameters()),
            }
            self.log.write(json.dumps(record) + "\\n")
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy())]))
        return responses

    def finalize(self):
        self.log.close()
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("perf_sequences")
    repo = work / "repo"
    (repo / "steps" / "1").mkdir(parents=True)
    (repo / "steps" / "config.pbtxt").write_text(SEQUENCE_CONFIG)
    (repo / "steps" / "1" / "model.py").write_text(SEQUENCE_MODEL)
    shutil.copytree(MODELS / "add_sub", repo / "add_sub")
    yield from run_server(work, repo, "--http-header-forward-pattern", "x-perf-.*")


def url(server: dict[str, Any], protocol: str) -> list[str]:
    return ["-u", f"127.0.0.1:{server['ports'][protocol]}", "-i", protocol]


def run(server: dict[str, Any], *args: str) -> tuple[Any, dict[Any, list[dict[str, Any]]]]:
    """Run dlserve perf on the sequence model; its result and the requests the model got,
    by sequence, in the order it got them."""
    log = Path(server["repo"]) / "steps" / "requests.log"
    log.write_text("")
    result = perf("-m", "steps", *args)
    return result, by_sequence(log)


def by_sequence(log: Path) -> dict[Any, list[dict[str, Any]]]:
    sequences: dict[Any, list[dict[str, Any]]] = collections.defaultdict(list)
    for line in log.read_text().splitlines():
        record = json.loads(line)
        sequences[record["id"]].append(record)
    return sequences


def check_whole(sequences: dict[Any, list[dict[str, Any]]]) -> None:
    """Each ID's requests are whole sequences one after the other: START on the first,
    END on the last (an ID is used again once its sequence ended)."""
    assert sequences
    for key, steps in sequences.items():
        running = False
        for step in steps:
            assert step["start"] == (not running), (key, steps)
            running = not step["end"]
        assert not running, (key, steps)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_concurrency_sends_whole_sequences_of_the_given_length(server, protocol):
    result, sequences = run(server, *url(server, protocol), *QUICK, "--concurrency-range", "3",
                            "--sequence-length", "4", "--sequence-length-variation", "0", "--input-data", "zero")
    check_whole(sequences)
    assert "Stabilizing using average throughput" in result.stdout  # (perf_analyzer's rule for sequences)
    assert "Sequence count:" in result.stdout
    assert sorted(sequences)[:3] == [1, 2, 3]
    lengths = collections.Counter(len(steps) for steps in sequences.values())
    # Each of the 3 slots may have ended one sequence early when the run stopped.
    assert lengths[4] >= len(sequences) - 3 and set(lengths) <= {1, 2, 3, 4}, lengths


def test_lengths_vary_within_the_variation(server):
    _, sequences = run(server, *url(server, "http"), *QUICK, "--sequence-length", "10",
                       "--sequence-length-variation", "30", "--input-data", "zero")
    check_whole(sequences)
    finished = [len(steps) for steps in sequences.values()][:-1]  # (the last may have been cut short)
    assert all(7 <= n <= 13 for n in finished) and len(set(finished)) > 1, finished


def test_id_range_wraps_and_processes_take_their_own_ids(server):
    _, sequences = run(server, *url(server, "grpc"), *QUICK, "--concurrency-range", "2", "--processes", "2",
                       "--sequence-id-range", "100:104", "--sequence-length", "2", "--input-data", "zero")
    check_whole(sequences)
    assert set(sequences) == {100, 101, 102, 103}


def test_a_range_as_small_as_the_concurrency_never_shares_an_id(server):
    """Sequences of different lengths end at different times: the one that ends first
    must not wrap onto an ID the other still uses."""
    _, sequences = run(server, *url(server, "http"), *QUICK, "--concurrency-range", "2",
                       "--sequence-id-range", "1:3", "--sequence-length", "6", "--sequence-length-variation", "60",
                       "--input-data", "zero")
    check_whole(sequences)
    assert set(sequences) == {1, 2}


def test_request_rate_spreads_requests_over_sequences(server):
    result, sequences = run(server, *url(server, "grpc"), *QUICK, "--request-rate-range", "300",
                            "--num-of-sequences", "3", "--sequence-length", "5", "--input-data", "zero")
    check_whole(sequences)
    assert "Sequence count:" in result.stdout


def test_request_rate_spreads_requests_over_serial_sequences(server):
    result, sequences = run(server, *url(server, "grpc"), *QUICK, "--request-rate-range", "200",
                            "--num-of-sequences", "3", "--serial-sequences", "--sequence-length", "5",
                            "--input-data", "zero")
    check_whole(sequences)
    assert "Sequence count:" in result.stdout


def test_json_streams_are_sequences_whole(server, tmp_path):
    data = tmp_path / "streams.json"
    data.write_text(json.dumps({"data": [
        [{"INPUT": [1]}, {"INPUT": [2]}, {"INPUT": [3]}],
        [{"INPUT": [10]}, {"INPUT": [20]}],
    ]}))
    _, sequences = run(server, *url(server, "http"), *QUICK, "--input-data", str(data))
    check_whole(sequences)
    inputs = [[s["input"] for s in steps] for steps in sequences.values()]
    assert inputs[:4] == [[1, 2, 3], [10, 20], [1, 2, 3], [10, 20]]


def test_request_parameters_and_headers_reach_the_model(server):
    _, sequences = run(server, *url(server, "http"), *QUICK, "--input-data", "zero",
                       "--request-parameter", "answer:42:int", "--request-parameter", "mode:fast:string",
                       "--request-parameter", "on:true:bool", "-H", "X-Perf-Tag: seven")
    parameters = next(iter(sequences.values()))[0]["parameters"]
    assert parameters["answer"] == 42 and parameters["mode"] == "fast" and parameters["on"] is True
    # The header reaches the model under the name perf_analyzer sent, as Triton forwards it.
    assert parameters["X-Perf-Tag"] == "seven"


def test_inprocess(tmp_path):
    repo = tmp_path / "repo"
    (repo / "steps" / "1").mkdir(parents=True)
    (repo / "steps" / "config.pbtxt").write_text(SEQUENCE_CONFIG)
    (repo / "steps" / "1" / "model.py").write_text(SEQUENCE_MODEL)
    result = perf("-m", "steps", "-i", "inprocess", "--model-repository", str(repo), *QUICK,
                  "--sequence-length", "3", "--input-data", "zero", "--request-parameter", "k:v:string")
    assert "Sequence count:" in result.stdout
    sequences = by_sequence(repo / "steps" / "requests.log")
    check_whole(sequences)
    assert sequences[1][0]["parameters"] == {"k": "v"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--concurrency-range", "4", "--sequence-id-range", "1:3"], "fewer than the 4 sequences"),
        # each of 2 processes keeps 2 of the 4 going, from its own 2 of the 3 IDs (1 and 3) and 1 (2)
        (["--concurrency-range", "4", "--processes", "2", "--sequence-id-range", "1:4"],
         "(2 in each of 2 processes)"),
        (["--request-rate-range", "10", "--num-of-sequences", "1", "--processes", "2"],
         "--num-of-sequences 1 is fewer than --processes 2"),
        (["-b", "2"], "sequence batcher, which takes requests of batch size 1"),
        (["--concurrency-range", "1:0", "-l", "5"], "cannot be used for a sequence model"),
    ],
)
def test_what_cannot_work_with_sequences(server, args, message):
    result = perf("-m", "steps", *url(server, "http"), *QUICK, *args, expect=99)
    assert message in result.stderr


def test_validation_data_of_each_streams_steps(server, tmp_path):
    """validation_data shaped as the streams: each step's answer is checked against its own
    (the model answers each step's INPUT), two sequences on the way at once."""
    data = [[{"INPUT": [10 * s + i]} for i in range(3)] for s in range(2)]
    right = [[{"OUTPUT": step["INPUT"]} for step in stream] for stream in data]
    wrong = [right[0], [right[1][0], {"OUTPUT": [99]}, right[1][2]]]
    paths = []
    for name, expected in (("right", right), ("wrong", wrong)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps({"data": data, "validation_data": expected}))
    where = [*url(server, "grpc"), *QUICK, "--concurrency-range", "2"]
    _, sequences = run(server, *where, "--input-data", str(paths[0]))
    assert len(sequences) >= 2
    result = perf("-m", "steps", *where, "--input-data", str(paths[1]), expect=99)
    # (the second stream's second step: the fifth of the file)
    assert "Output doesn't match expected output (output 'OUTPUT', data index 4)" in result.stderr
