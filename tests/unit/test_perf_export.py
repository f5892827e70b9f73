"""``--profile-export-file``'s pieces alone: the answers each client keeps, decoded
(HTTP binary and JSON outputs, gRPC raw and typed contents, outputs left in shared
memory), tensor values as perf_analyzer writes them, and windows of several processes
merged onto the epoch clock."""

from __future__ import annotations

import json
import types

import numpy as np

from dlserve.frontends.proto import grpc_service_pb2 as pb
from dlserve.perf.answers import grpc_outputs, http_outputs, stream_outputs
from dlserve.perf.export import ProfileExport, RequestLog
from dlserve.perf.inputs import ModelInfo, TensorInfo


def http_answer(outputs: list[dict], binary: bytes = b"") -> tuple[int, bytes]:
    header = json.dumps({"model_name": "m", "outputs": outputs}).encode()
    return (len(header) if binary else -1), header + binary


def test_http_binary_json_and_shared_memory_outputs():
    data = np.array([1.5, -2.0], np.float32).tobytes()
    answer = http_answer([
        {"name": "A", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}},
        {"name": "B", "datatype": "BYTES", "shape": [2], "data": ["ab", "c"]},
        {"name": "C", "datatype": "INT32", "shape": [1], "parameters": {"shared_memory_region": "r"}},
        {"name": "D", "datatype": "INT64", "shape": [1], "parameters": {"binary_data_size": 8}},
    ], data + np.array([7], np.int64).tobytes())
    assert http_outputs(answer) == {
        "A": ("FP32", data),
        "B": ("BYTES", b"\x02\x00\x00\x00ab\x01\x00\x00\x00c"),
        "D": ("INT64", np.array([7], np.int64).tobytes()),
    }
    assert http_outputs(http_answer([{"name": "E", "datatype": "BOOL", "shape": [2], "data": [True, False]}])) == {
        "E": ("BOOL", b"\x01\x00")
    }


def test_grpc_raw_contents_and_shared_memory_outputs():
    response = pb.ModelInferResponse(model_name="m")
    response.outputs.add(name="A", datatype="INT32", shape=[2])
    response.outputs.add(name="B", datatype="FP32", shape=[1])  # in shared memory: an empty stand-in
    response.outputs.add(name="C", datatype="FP32", shape=[0])  # empty, really
    response.raw_output_contents.extend([np.array([1, 2], np.int32).tobytes(), b"", b""])
    assert grpc_outputs(response.SerializeToString()) == {
        "A": ("INT32", np.array([1, 2], np.int32).tobytes()), "C": ("FP32", b""),
    }
    typed = pb.ModelInferResponse()
    typed.outputs.add(name="S", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"hi")
    typed.outputs.add(name="U", datatype="UINT16", shape=[2]).contents.uint_contents.extend([3, 4])
    stream = pb.ModelStreamInferResponse(infer_response=typed).SerializeToString()
    assert stream_outputs(stream) == {
        "S": ("BYTES", b"\x02\x00\x00\x00hi"), "U": ("UINT16", np.array([3, 4], "<u2").tobytes()),
    }
    assert stream_outputs(pb.ModelStreamInferResponse().SerializeToString()) == {}  # a flag-only final


def test_values_as_perf_analyzer_writes_them(capsys):
    export = ProfileExport(types.SimpleNamespace(protocol="inprocess", streaming=False))
    value = export._value
    assert value("FP32", np.array([0.5, 2], np.float32).tobytes()) == [0.5, 2.0]
    assert value("INT64", np.array([-3], np.int64).tobytes()) == -3  # one element: alone
    assert value("BOOL", b"\x01\x00") == [True, False]
    assert value("UINT64", np.array([2**64 - 1], np.uint64).tobytes()) == 2**64 - 1
    assert value("BYTES", b"\x02\x00\x00\x00ab\x01\x00\x00\x00c") == "ab\x01\x00\x00\x00c"  # less the first prefix
    assert value("FP16", b"\x00\x3c") is None and value("FP16", b"\x00\x3c") is None
    assert capsys.readouterr().err == "WARNING: unsupported data type: 'FP16'\n"  # (once)


def test_windows_of_two_processes_on_the_epoch_clock():
    """Each process's perf_counter times with its own offset; the boundaries: the earliest
    start, then each window's latest end. Requests come window by window."""
    settings = types.SimpleNamespace(protocol="inprocess", streaming=False)
    export = ProfileExport(settings)
    info = ModelInfo("m", "1", [TensorInfo("IN", "INT32", [1])], [], max_batch_size=4, sequence=True)
    export.model(info, [{"IN": np.array([[5], [6]], np.int32)}])
    answer = {"OUT": ("INT32", np.array([9], np.int32).tobytes())}
    first = [RequestLog(1000, 10, 20, [(11, [15, 19], 7, 0, [answer, None])]), RequestLog(2000, 9, 21, [])]
    second = [RequestLog(1000, 20, 30, []), RequestLog(2000, 21, 32, [(25, [30], 8, 0, [answer])])]
    export.add("request_rate", 50, [first, second])
    document = export.document()
    assert document["service_kind"] == "triton_c_api"
    (experiment,) = document["experiments"]
    assert experiment["experiment"] == {"mode": "request_rate", "value": 50.0}
    assert experiment["window_boundaries"] == [1010, 2021, 2032]
    assert experiment["requests"] == [
        {"timestamp": 1011, "sequence_id": 7, "request_inputs": {"IN": 5},  # (a batch's first)
         "response_timestamps": [1015, 1019], "response_outputs": [{"OUT": 9}, {}]},
        {"timestamp": 2025, "sequence_id": 8, "request_inputs": {"IN": 5},
         "response_timestamps": [2030], "response_outputs": [{"OUT": 9}]},
    ]
