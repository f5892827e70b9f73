"""``dlserve perf --input-data`` against a real ``dlserve serve``, checked against what
perf_analyzer does with the same data: data directories, JSON steps that leave out
optional inputs, and JSON shapes against ``--shape``.

What the server got is read back from ``--profile-export-file``: generate_echo answers
``inputs_seen``, each input it was given with its shape and values.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ..conftest import MODELS
from .test_perf_cli import QUICK, perf, run_server, url


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("perf_input_data")
    repo = work / "repo"
    shutil.copytree(MODELS / "generate_echo", repo / "generate_echo")
    yield from run_server(work, repo)


def inputs_seen(export: Path) -> list[dict[str, Any]]:
    """What generate_echo was given, each distinct request once (in the order first seen)."""
    (experiment,) = json.loads(export.read_text())["experiments"]
    seen = []
    for request in experiment["requests"]:
        (answer,) = request["response_outputs"]
        inputs = json.loads(answer["inputs_seen"])
        if inputs not in seen:
            seen.append(inputs)
    return seen


def echo_directory(folder: Path) -> Path:
    """A data directory for generate_echo: every input's file, and one named after an output
    (allowed; perf_analyzer does not read it)."""
    folder.mkdir()
    (folder / "text_input").write_bytes(b"hello\n")
    (folder / "int_in").write_bytes(np.array([5], dtype=np.int32).tobytes())
    (folder / "fp_in").write_bytes(np.array([0.5, 1.5, 2.5], dtype=np.float32).tobytes())
    (folder / "bool_in").write_bytes(b"\x01")
    (folder / "vec").write_bytes(np.array([3, 4], dtype=np.int64).tobytes())
    (folder / "text_output").write_bytes(b"not read")
    return folder


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_data_directory_is_sent_with_every_request(server, tmp_path, protocol):
    """perf_analyzer's --input-data DIRECTORY (it was refused: "is a directory")."""
    folder, export = echo_directory(tmp_path / "data"), tmp_path / "export.json"
    perf("-m", "generate_echo", *url(server, protocol), *QUICK, "--input-data", str(folder),
         "--shape", "vec:2", "--profile-export-file", str(export))
    assert inputs_seen(export) == [{
        "text_input": {"dtype": "object", "shape": [1], "values": ["hello"]},
        "int_in": {"dtype": "int32", "shape": [1], "values": [5]},
        "fp_in": {"dtype": "float32", "shape": [3], "values": [0.5, 1.5, 2.5]},
        "bool_in": {"dtype": "bool", "shape": [1], "values": [True]},
        "vec": {"dtype": "int64", "shape": [2], "values": [3, 4]},
    }]


@pytest.mark.parametrize(
    ("change", "message"),
    [  # perf_analyzer's errors
        ("fp_in", "failed to open file '{folder}/fp_in'"),
        ("vec", "provided data for input vec has byte size 8, expect 16"),
        ("README", "Provided data file 'README' does not correspond to a valid model input or "
                   "output"),
    ],
)
def test_a_data_directory_without_the_right_files_is_refused(server, tmp_path, change, message):
    folder = echo_directory(tmp_path / "data")
    if change == "fp_in":
        (folder / "fp_in").unlink()
    else:
        (folder / change).write_bytes(b"\0" * 8)
    result = perf("-m", "generate_echo", *url(server, "http"), *QUICK, "--input-data",
                  str(folder), "--shape", "vec:2", expect=99)
    assert message.format(folder=folder) in result.stderr


def test_json_steps_may_leave_out_optional_inputs(server, tmp_path):
    """As perf_analyzer: a step without an input the config marks optional is sent without
    it (it was refused: "no data for input 'int_in'"); a required one is still needed."""
    data, export = tmp_path / "data.json", tmp_path / "export.json"
    data.write_text(json.dumps({"data": [
        {"text_input": ["a"]},
        {"text_input": ["b"], "int_in": [7]},
    ]}))
    perf("-m", "generate_echo", *url(server, "http"), *QUICK, "--input-data", str(data),
         "--profile-export-file", str(export))
    expected = [
        {"text_input": {"dtype": "object", "shape": [1], "values": ["a"]}},
        {"text_input": {"dtype": "object", "shape": [1], "values": ["b"]},
         "int_in": {"dtype": "int32", "shape": [1], "values": [7]}},
    ]
    # (in either order: the steps alternate, and which one the measured window begins
    # with depends on how many requests ran before it)
    def order(inputs: dict[str, Any]) -> str:
        return json.dumps(inputs, sort_keys=True)

    assert sorted(inputs_seen(export), key=order) == sorted(expected, key=order)
    data.write_text(json.dumps({"data": [{"int_in": [7]}]}))
    result = perf("-m", "generate_echo", *url(server, "http"), *QUICK, "--input-data", str(data),
                  expect=99)
    assert "step 0: no data for input 'text_input'" in result.stderr


def test_a_json_shape_must_agree_with_the_shape_option(server, tmp_path):
    """As perf_analyzer: a step's shape for a variable input must be the --shape given for it
    (the step's won, unchecked); without --shape, the step's is used."""
    data, export = tmp_path / "data.json", tmp_path / "export.json"
    data.write_text(json.dumps({"data": [
        {"text_input": ["a"], "vec": {"content": [1, 2, 3], "shape": [3]}},
    ]}))
    where = ["-m", "generate_echo", *url(server, "grpc"), *QUICK, "--input-data", str(data)]
    result = perf(*where, "--shape", "vec:2", expect=99)
    assert "step 0: input 'vec': its shape [3] is incompatible with --shape [2]" in result.stderr
    for extra in ([], ["--shape", "vec:3"]):
        export.unlink(missing_ok=True)
        perf(*where, *extra, "--profile-export-file", str(export))
        (seen,) = inputs_seen(export)
        assert seen["vec"] == {"dtype": "int64", "shape": [3], "values": [1, 2, 3]}
