"""``dlserve perf`` input data: zero / random / perf_analyzer JSON (BYTES, shapes, batches)
and data directories,
and the requests encoded once (HTTP bytes, gRPC bytes, shared-memory plan)."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from dlserve.frontends.proto import grpc_service_pb2 as pb
from dlserve.perf.flags import UsageError
from dlserve.perf.inputs import (
    ModelInfo,
    expected_outputs,
    make_requests,
    raw_bytes,
    resolve_shapes,
)
from dlserve.perf.payloads import grpc_request, http_request, model_path, plan_shm
from dlserve.perf.shm import ShmRef

ADD_SUB = ModelInfo.from_json(
    {"name": "add_sub", "versions": ["1"],
     "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [16]},
                {"name": "INPUT1", "datatype": "FP32", "shape": [16]}],
     "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [16]},
                 {"name": "OUTPUT1", "datatype": "FP32", "shape": [16]}]},
    {"max_batch_size": 0},
)
IDENTITY = ModelInfo.from_json(
    {"name": "identity", "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1]}],
     "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1]}]},
    {},
)
STRINGS = ModelInfo.from_json(
    {"name": "bytes_model", "inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [-1]}],
     "outputs": [{"name": "OUTPUT0", "datatype": "BYTES", "shape": [-1]}]},
    {"max_batch_size": 0},
)
BATCHED = ModelInfo.from_json(  # shapes as gRPC's JSON mapping gives them (int64 as strings)
    {"name": "reshape", "inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": ["-1", "2", "2"]}],
     "outputs": [{"name": "OUTPUT0", "datatype": "INT32", "shape": ["-1", "2", "2"]}]},
    {"max_batch_size": 4, "model_transaction_policy": {"decoupled": False}},
)


def test_model_info():
    assert ADD_SUB.version == "1" and [t.name for t in ADD_SUB.inputs] == ["INPUT0", "INPUT1"]
    assert BATCHED.max_batch_size == 4 and BATCHED.inputs[0].dims == [2, 2]  # batch dim dropped
    assert ModelInfo.from_json({"name": "d", "inputs": [], "outputs": []},
                               {"model_transaction_policy": {"decoupled": True}}).decoupled


def test_zero_and_random():
    (zero,) = make_requests(ADD_SUB, 1, {}, "zero")
    assert zero["INPUT0"].dtype == np.float32 and zero["INPUT0"].shape == (16,) and not zero["INPUT0"].any()
    (rand,) = make_requests(ADD_SUB, 1, {}, "random", seed=1)
    assert rand["INPUT0"].shape == (16,) and rand["INPUT0"].any()
    assert ((rand["INPUT0"] >= 0) & (rand["INPUT0"] < 1)).all()


def test_shapes_for_variable_dims():
    (request,) = make_requests(IDENTITY, 1, {"INPUT0": [1024]}, "zero")
    assert request["INPUT0"].shape == (1024,)
    with pytest.raises(UsageError, match=r"variable shape \[-1\]: give it with --shape INPUT0:1"):
        make_requests(IDENTITY, 1, {}, "zero")
    with pytest.raises(UsageError, match="has no input 'INPUT9'"):
        resolve_shapes(IDENTITY, {"INPUT9": [4]})
    with pytest.raises(UsageError, match="does not fit the model's dims"):
        resolve_shapes(ADD_SUB, {"INPUT0": [8]})


def test_batches():
    (request,) = make_requests(BATCHED, 3, {}, "random", seed=0)
    assert request["INPUT0"].shape == (3, 2, 2) and request["INPUT0"].dtype == np.int32
    with pytest.raises(UsageError, match="does not support batching"):
        make_requests(ADD_SUB, 2, {}, "zero")
    with pytest.raises(UsageError, match="above model 'reshape''s max_batch_size 4"):
        make_requests(BATCHED, 5, {}, "zero")


def test_bytes_inputs():
    (request,) = make_requests(STRINGS, 1, {"INPUT0": [3]}, "random", string_length=7, seed=2)
    values = request["INPUT0"]
    assert values.dtype == np.object_ and values.shape == (3,)
    assert all(isinstance(v, bytes) and len(v) == 7 and v.isalnum() for v in values)
    (fixed,) = make_requests(STRINGS, 1, {"INPUT0": [2]}, "zero", string_data="hi")
    assert list(fixed["INPUT0"]) == [b"hi", b"hi"]
    assert raw_bytes(fixed["INPUT0"], "BYTES") == b"\x02\x00\x00\x00hi\x02\x00\x00\x00hi"


def write(tmp_path, document) -> str:
    path = tmp_path / "data.json"
    path.write_text(json.dumps(document))
    return str(path)


def test_json_data(tmp_path):
    a = [float(x) for x in range(16)]  # (FP32 content is written as floats: 0.0, not 0)
    b64 = base64.b64encode(np.arange(16, dtype=np.float32).tobytes()).decode()
    path = write(tmp_path, {"data": [
        {"INPUT0": a, "INPUT1": {"content": [a[:8], a[8:]], "shape": [16]}},  # nested content
        {"INPUT0": {"b64": b64}, "INPUT1": a},
    ]})
    requests = make_requests(ADD_SUB, 1, {}, path)
    assert len(requests) == 2
    assert requests[0]["INPUT1"].tolist() == a
    assert requests[1]["INPUT0"].tolist() == list(np.arange(16, dtype=np.float32))


def test_json_bytes_and_shapes(tmp_path):
    path = write(tmp_path, {"data": [[  # a stream: its steps in order
        {"INPUT0": {"content": ["a", "bb", "ccc"], "shape": [3]}},
        {"INPUT0": {"content": ["x"], "shape": [1]}},
    ]]})
    first, second = make_requests(STRINGS, 1, {}, path)
    assert list(first["INPUT0"]) == [b"a", b"bb", b"ccc"] and first["INPUT0"].shape == (3,)
    assert list(second["INPUT0"]) == [b"x"]


@pytest.mark.parametrize(
    ("info", "shapes", "value", "message"),
    [
        (STRINGS, {"INPUT0": [1]}, {"content": ["a", "b", "c"], "shape": [3]},
         "its shape [3] is incompatible with --shape [1]"),
        (IDENTITY, {"INPUT0": [4]}, {"content": [1.0] * 6, "shape": [2, 3]},
         "its shape [2, 3] is incompatible with --shape [4]"),
        (BATCHED, {}, {"content": [1, 2, 3, 4], "shape": [4]},
         "its shape [4] is incompatible with the model's input shape [2, 2]"),
        (IDENTITY, {"INPUT0": [4]}, [1.0] * 6, "has 6 elements, its shape [4] needs 4"),
    ],
)
def test_json_shapes_must_agree_with_the_shape_option(tmp_path, info, shapes, value, message):
    """As perf_analyzer: a step's shape is checked against the model's dims, with --shape
    for variable ones (a step's shape won over --shape, unchecked)."""
    with pytest.raises(UsageError) as exc:
        make_requests(info, 1, shapes, write(tmp_path, {"data": [{"INPUT0": value}]}))
    assert message in str(exc.value)


def _typed(datatype: str) -> ModelInfo:
    return ModelInfo.from_json(
        {"name": "typed", "inputs": [{"name": "X", "datatype": datatype, "shape": [1]}], "outputs": []},
        {"max_batch_size": 0},
    )


@pytest.mark.parametrize(
    ("datatype", "good", "bad", "message"),
    [
        ("FP32", 1.5, 1, "unable to find float data in json: 1 is not a number written with a decimal point"),
        ("FP32", 1e3, True, "unable to find float data in json: true is not"),
        ("FP64", -2.0, -2, "unable to find fp64 data in json: -2 is not"),
        ("FP16", 0.5, "0.5", 'unable to find float data in json: "0.5" is not'),
        ("INT32", -7, 1.5, "unable to find int32_t data in json: 1.5 is not an integer written without"),
        ("INT64", 3, True, "unable to find int64_t data in json: true is not an integer"),
        ("INT8", 1, 1e3, "unable to find int8_t data in json: 1000.0 is not an integer"),
        ("UINT8", 255, -1, "unable to find uint8_t data in json: -1 is not an integer of 0 or more"),
        ("UINT64", 0, "1", 'unable to find uint64_t data in json: "1" is not'),
        ("BOOL", False, 1, "unable to find bool data in json: 1 is not true or false"),
        ("INT16", 2, None, "unable to find int16_t data in json: null is not"),
    ],
)
def test_json_values_of_the_wrong_kind_are_refused_as_perf_analyzer_refuses_them(
    tmp_path, datatype, good, bad, message
):
    """numpy would turn 1.5 into 1 for INT32 and "1" into 1: perf_analyzer refuses
    them (and integers for floats), so a data file means the same to both."""
    info = _typed(datatype)
    (request,) = make_requests(info, 1, {}, write(tmp_path, {"data": [{"X": [good]}]}))
    assert request["X"].tolist() == [good]
    for content in ([bad], {"content": [[bad]], "shape": [1]}):  # flat and nested
        with pytest.raises(UsageError) as exc:
            make_requests(info, 1, {}, write(tmp_path, {"data": [{"X": content}]}))
        assert f"step 0: input 'X': {message}" in str(exc.value)


def test_json_batched_cycles_steps(tmp_path):
    steps = [{"INPUT0": [[i, i], [i, i]]} for i in range(3)]
    requests = make_requests(BATCHED, 2, {}, write(tmp_path, {"data": steps}))
    # 3 steps in batches of 2: requests (0,1) (2,0) (1,2), then it repeats
    assert [r["INPUT0"][:, 0, 0].tolist() for r in requests] == [[0, 1], [2, 0], [1, 2]]


def test_json_optional_inputs_may_be_left_out(tmp_path):
    """As perf_analyzer: a step may leave out an input the config marks optional (its
    requests go without it); with -b above 1 every step must give the same inputs."""
    info = ModelInfo.from_json(
        {"name": "opt", "inputs": [{"name": "A", "datatype": "INT32", "shape": [-1, 2]},
                                   {"name": "B", "datatype": "INT32", "shape": [-1, 1]}],
         "outputs": []},
        {"max_batch_size": 4, "input": [{"name": "A"}, {"name": "B", "optional": True}]},
    )
    assert [t.optional for t in info.inputs] == [False, True]
    path = write(tmp_path, {"data": [{"A": [1, 2]}, {"A": [3, 4], "B": [5]}]})
    first, second = make_requests(info, 1, {}, path)
    assert list(first) == ["A"] and list(second) == ["A", "B"] and second["B"].shape == (1, 1)
    with pytest.raises(UsageError, match="the same set of inputs must be specified for each batch"):
        make_requests(info, 2, {}, path)
    (request,) = make_requests(info, 2, {}, write(tmp_path, {"data": [{"A": [1, 2]}]}))
    assert list(request) == ["A"] and request["A"].shape == (2, 2)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"rows": []}, "expected {\"data\""),
        ({"data": []}, "at least one entry"),
        ({"data": [{"INPUT0": [1.0] * 16}]}, "no data for input 'INPUT1'"),
        ({"data": [{"INPUT0": [1.0] * 15, "INPUT1": [1.0] * 16}]}, "has 15 elements, its shape [16] needs 16"),
        ({"data": [{"INPUT0": [1.0] * 16, "INPUT1": [1.0] * 16, "EXTRA": [1]}]}, "has no input(s) EXTRA"),
        ({"data": [{"INPUT0": {"shape": [16]}, "INPUT1": [1.0] * 16}]}, "needs 'content' or 'b64'"),
        ({"data": [{"INPUT0": ["x"] * 16, "INPUT1": [1.0] * 16}]}, "input 'INPUT0'"),
        # (each of these ended the command with a Python traceback)
        ({"data": [{"INPUT0": {"content": [1.0] * 16, "shape": ["x"]}, "INPUT1": [1.0] * 16}]},
         "'shape' must be a list of non-negative integers, got [\"x\"]"),
        ({"data": [{"INPUT0": {"content": [1.0] * 16, "shape": 16}, "INPUT1": [1.0] * 16}]},
         "'shape' must be a list of non-negative integers, got 16"),
        ({"data": [{"INPUT0": {"b64": "AAAA"}, "INPUT1": [1.0] * 16}]},
         "'b64' holds 3 bytes, not whole FP32 elements of 4 bytes each"),
        ({"data": [{"INPUT0": {"b64": 5}, "INPUT1": [1.0] * 16}]},
         "'b64' must be a base64 string, got 5"),
        ({"data": [{"INPUT0": {"b64": "AAAAA"}, "INPUT1": [1.0] * 16}]}, "'b64' is not base64"),
    ],
)
def test_bad_json_data(tmp_path, document, message):
    with pytest.raises(UsageError) as exc:
        make_requests(ADD_SUB, 1, {}, write(tmp_path, document))
    assert message in str(exc.value)


@pytest.mark.parametrize(
    ("info", "values", "message"),
    [
        (BATCHED, [{"content": [2**40] * 4, "shape": [2, 2]}], "out of bounds for int32"),
        (STRINGS, [{"content": [1.5], "shape": [1]}], "BYTES elements are strings, got 1.5"),
        (STRINGS, [{"content": [3], "shape": [1]}], "BYTES elements are strings, got 3"),
        (STRINGS, [{"content": [["a", "b"], ["c"]], "shape": [3]}], "input 'INPUT0'"),
    ],
)
def test_json_values_the_datatype_cannot_hold(tmp_path, info, values, message):
    document = {"data": [{"INPUT0": value} for value in values]}
    with pytest.raises(UsageError) as exc:  # (a traceback before; BYTES 3 was sent as 3 zero bytes)
        make_requests(info, 1, {}, write(tmp_path, document))
    assert message in str(exc.value)


def test_json_not_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(UsageError, match="--input-data"):
        make_requests(ADD_SUB, 1, {}, str(path))


def test_json_variable_shape_needs_a_shape(tmp_path):
    with pytest.raises(UsageError, match="variable shape"):
        make_requests(IDENTITY, 1, {}, write(tmp_path, {"data": [{"INPUT0": [1.0, 2.0]}]}))


DIRECTORY_MODEL = ModelInfo.from_json(
    {"name": "dir", "inputs": [{"name": "A", "datatype": "FP32", "shape": [-1, 2, 2]},
                               {"name": "S", "datatype": "BYTES", "shape": [-1, -1]},
                               {"name": "B", "datatype": "INT32", "shape": [-1, 2]}],
     "outputs": [{"name": "OUT", "datatype": "FP32", "shape": [-1, 1]}]},
    {"max_batch_size": 4, "input": [{"name": "B", "optional": True}]},
)


def data_directory(tmp_path, **files: bytes) -> str:
    folder = tmp_path / "data"
    folder.mkdir(parents=True)
    defaults = {"A": np.arange(4, dtype=np.float32).tobytes(), "S": b"x\r\n\nzzz",
                "B": np.array([7, 8], dtype=np.int32).tobytes(), "OUT": b"not read"}
    for name, content in {**defaults, **files}.items():
        if content is not None:
            (folder / name).write_bytes(content)
    return str(folder)


def test_data_directory(tmp_path):
    """perf_analyzer's data directory: a file per input, raw (row-major, little-endian) or
    for BYTES one element a line (split at \\n only: \\r and empty lines stay); its one step
    sent in every request (-b: B copies). Files named after outputs are not read."""
    path = data_directory(tmp_path)
    (request,) = make_requests(DIRECTORY_MODEL, 2, {"S": [3]}, path)
    assert request["A"].dtype == np.float32 and request["A"].tolist() == [[[0, 1], [2, 3]]] * 2
    assert request["S"].tolist() == [[b"x\r", b"", b"zzz"]] * 2
    assert request["B"].dtype == np.int32 and request["B"].tolist() == [[7, 8]] * 2
    assert expected_outputs(DIRECTORY_MODEL, 2, path) is None
    with pytest.raises(UsageError, match="input 'S' has a variable shape"):
        make_requests(DIRECTORY_MODEL, 1, {}, path)  # (perf_analyzer: "provide shapes")


@pytest.mark.parametrize(
    ("files", "message"),
    [  # perf_analyzer's errors
        ({"B": None}, "failed to open file '{path}/B'"),  # (an optional input's too)
        ({"A": b"\0" * 12}, "provided data for input A has byte size 12, expect 16"),
        ({"S": b"x\ny\n"}, "provided data for input S has 2 elements, expect 3"),
        ({"A": b""}, "file '{path}/A' is empty"),
        ({"README": b"hi"},
         "Provided data file 'README' does not correspond to a valid model input or output"),
    ],
)
def test_data_directory_errors(tmp_path, files, message):
    path = data_directory(tmp_path, **files)
    with pytest.raises(UsageError) as exc:
        make_requests(DIRECTORY_MODEL, 1, {"S": [3]}, path)
    assert message.format(path=path) in str(exc.value)


# -- encoded requests --------------------------------------------------------------------------
def split_http(raw: bytes) -> tuple[list[str], dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    return lines, headers, body


def test_http_request_with_binary_tensors():
    (request,) = make_requests(ADD_SUB, 1, {}, "random", seed=3)
    raw = http_request("127.0.0.1:8000", ADD_SUB, "", request)
    lines, headers, body = split_http(raw)
    assert lines[0] == "POST /v2/models/add_sub/infer HTTP/1.1"
    assert headers["host"] == "127.0.0.1:8000" and int(headers["content-length"]) == len(body)
    json_size = int(headers["inference-header-content-length"])
    document = json.loads(body[:json_size])
    assert document["inputs"][0] == {"name": "INPUT0", "shape": [16], "datatype": "FP32",
                                      "parameters": {"binary_data_size": 64}}
    assert document["outputs"] == [{"name": "OUTPUT0", "parameters": {"binary_data": True}},
                                   {"name": "OUTPUT1", "parameters": {"binary_data": True}}]
    tensors = body[json_size:]
    assert tensors == request["INPUT0"].tobytes() + request["INPUT1"].tobytes()
    assert model_path("a b", "2") == "/v2/models/a%20b/versions/2"


def test_http_request_with_json_tensors():
    """For servers without Triton's binary extension (MLServer): plain KServe v2 JSON."""
    (request,) = make_requests(STRINGS, 1, {"INPUT0": [2]}, "zero", string_data="ab")
    raw = http_request("h:1", STRINGS, "", request, json_inputs=True, json_outputs=True)
    lines, headers, body = split_http(raw)
    assert "inference-header-content-length" not in headers and headers["content-type"] == "application/json"
    document = json.loads(body)
    assert document["inputs"] == [{"name": "INPUT0", "shape": [2], "datatype": "BYTES", "data": ["ab", "ab"]}]
    assert document["outputs"] == [{"name": "OUTPUT0", "parameters": {"binary_data": False}}]
    (numbers,) = make_requests(ADD_SUB, 1, {}, "random", seed=1)
    document = json.loads(split_http(http_request("h:1", ADD_SUB, "", numbers, json_inputs=True))[2])
    assert document["inputs"][0]["data"] == numbers["INPUT0"].tolist()
    assert document["outputs"][0]["parameters"] == {"binary_data": True}


def test_http_request_with_shared_memory():
    (request,) = make_requests(IDENTITY, 1, {"INPUT0": [4]}, "zero")
    raw = http_request(
        "h:1", IDENTITY, "1", request, {"INPUT0": ShmRef("r", 64, 16)}, {"OUTPUT0": ShmRef("r", 128, 100)}
    )
    lines, headers, body = split_http(raw)
    assert lines[0] == "POST /v2/models/identity/versions/1/infer HTTP/1.1"
    assert "inference-header-content-length" not in headers and headers["content-type"] == "application/json"
    document = json.loads(body)
    assert document["inputs"][0]["parameters"] == {
        "shared_memory_region": "r", "shared_memory_byte_size": 16, "shared_memory_offset": 64}
    assert document["outputs"][0]["parameters"]["shared_memory_byte_size"] == 100


def test_grpc_request():
    (request,) = make_requests(STRINGS, 1, {"INPUT0": [2]}, "zero", string_data="ab")
    parsed = pb.ModelInferRequest.FromString(grpc_request(STRINGS, "", request))
    assert parsed.model_name == "bytes_model" and parsed.inputs[0].datatype == "BYTES"
    assert list(parsed.inputs[0].shape) == [2] and [o.name for o in parsed.outputs] == ["OUTPUT0"]
    assert parsed.raw_input_contents[0] == b"\x02\x00\x00\x00ab" * 2
    shm = pb.ModelInferRequest.FromString(grpc_request(
        STRINGS, "3", request, {"INPUT0": ShmRef("r", 0, 12)}, {"OUTPUT0": ShmRef("r", 64, 50)},
        {"triton_enable_empty_final_response": True},
    ))
    assert shm.model_version == "3" and not shm.raw_input_contents
    assert shm.inputs[0].parameters["shared_memory_region"].string_param == "r"
    assert shm.outputs[0].parameters["shared_memory_offset"].int64_param == 64
    assert shm.parameters["triton_enable_empty_final_response"].bool_param


def test_shared_memory_plan():
    requests = make_requests(ADD_SUB, 1, {}, "zero")
    plan = plan_shm(requests, ADD_SUB, 100)
    inputs, (outputs,) = plan.refs("region")
    assert inputs[0]["INPUT0"] == ShmRef("region", 0, 64) and inputs[0]["INPUT1"] == ShmRef("region", 64, 64)
    # fixed-shape outputs take their own size (FP32 [16]), not the 100 given (perf_analyzer's)
    assert outputs["OUTPUT0"] == ShmRef("region", 128, 64) and outputs["OUTPUT1"] == ShmRef("region", 192, 64)
    assert plan.layout.size == 256 and all(o % 64 == 0 for o, _ in plan.layout.blobs)


def test_shared_memory_plan_with_outputs_of_each_request():
    """validation_data's: each request's outputs can be read while others are on the way."""
    requests = make_requests(ADD_SUB, 1, {}, "zero") * 2
    _, outputs = plan_shm(requests, ADD_SUB, 100, separate=True).refs("region")
    assert [o["OUTPUT0"].offset for o in outputs] == [256, 384]
