"""The gRPC frontend (KServe v2 + Triton's extensions) driven by unmodified clients:
``tritonclient.grpc`` (sync), ``tritonclient.grpc.aio``, the raw stub and the gRPC
health stub. Error codes and texts are checked against what a real Triton answered
(``tests/data/triton_reference/grpc_cases.json``)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import queue
import shutil
import subprocess
import time
import uuid
from multiprocessing import resource_tracker
from pathlib import Path

import grpc
import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
import tritonclient.utils.shared_memory as shm
from google.protobuf import json_format, text_format
from google.protobuf.message import DecodeError
from tritonclient.utils import InferenceServerException, deserialize_bytes_tensor

import dlserve
from dlserve import ModelControlMode
from dlserve.engine import scheduler
from dlserve.frontends import KServeGrpc
from dlserve.frontends.grpc_server import transport_settings
from dlserve.frontends.proto import grpc_service_pb2 as pb
from dlserve.frontends.proto import grpc_service_pb2_grpc as pb_grpc
from dlserve.frontends.proto import health_pb2, health_pb2_grpc

from ..conftest import MODELS, ServerHarness, open_fds

REFERENCE = Path(__file__).parent.parent / "data" / "triton_reference"
PROBE_REPO = REFERENCE / "probe_repo"
TEST_MODELS = ["add_sub", "identity", "bytes_model", "dtypes_echo", "faulty", "params_echo"]
# Models of the repository real Triton answered grpc_cases.json from (distinct names).
PROBE_MODELS = ["per_request_error", "raiser", "bad_return_len", "bad_return_notlist"]
A = np.arange(16, dtype=np.float32)
ONES = np.ones(16, dtype=np.float32)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    repo = tmp_path_factory.mktemp("repo")
    for name in TEST_MODELS:
        shutil.copytree(MODELS / name, repo / name)
    for name in PROBE_MODELS:
        shutil.copytree(PROBE_REPO / name, repo / name)
    # tritonclient's shared-memory helpers use multiprocessing.shared_memory, whose
    # resource tracker keeps a pipe open for the life of the process: start it before
    # the harness counts file descriptors.
    resource_tracker.ensure_running()
    # gRPC core creates its pollers with the first channel or server and closes them
    # on a background thread a while after the last one goes: keep one channel open
    # for the whole module so they are there both times the harness counts.
    anchor = grpc.insecure_channel("127.0.0.1:1")
    harness = ServerHarness()
    srv = harness.start(repo)
    yield srv
    stop_and_settle(harness)
    anchor.close()


def stop_and_settle(harness: ServerHarness, timeout: float = 5.0) -> None:
    """Stop the harness's servers, then give gRPC's threads a moment to finish closing
    connection sockets (they close asynchronously) before the harness counts them."""
    for srv in list(harness.servers):
        harness.stop(srv)
    deadline = time.monotonic() + timeout
    while open_fds() - harness.fds_before and time.monotonic() < deadline:
        time.sleep(0.02)
    harness.close()


def start_grpc(server: dlserve.Server, **options) -> KServeGrpc:
    options.setdefault("address", "127.0.0.1")
    options.setdefault("port", 0)
    service = KServeGrpc(server, KServeGrpc.Options(**options))
    service.start()
    return service


@pytest.fixture(scope="module")
def service(server):
    svc = start_grpc(server, allow_client_shm=True)
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def url(service) -> str:
    return f"127.0.0.1:{service.port}"


@pytest.fixture
def client(url):
    with grpcclient.InferenceServerClient(url) as c:
        yield c


@pytest.fixture
def stub(url):
    with grpc.insecure_channel(url) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def add_sub_inputs(a=A, b=ONES) -> list[grpcclient.InferInput]:
    inputs = []
    for name, data in (("INPUT0", a), ("INPUT1", b)):
        tensor = grpcclient.InferInput(name, list(data.shape), "FP32")
        tensor.set_data_from_numpy(data)
        inputs.append(tensor)
    return inputs


def fp32_input(name: str, data: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    return tensor


def rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def raw_request(model: str = "add_sub", **fields) -> pb.ModelInferRequest:
    """add_sub with INPUT0/INPUT1 as raw contents unless ``fields`` says otherwise."""
    request = pb.ModelInferRequest(model_name=model, **fields)
    if not fields.get("inputs"):
        for name in ("INPUT0", "INPUT1"):
            request.inputs.add(name=name, datatype="FP32", shape=[16])
        request.raw_input_contents.extend([A.tobytes(), ONES.tobytes()])
    return request


# -- replaying what real Triton answered ------------------------------------------------------
# Differences that come from the engine, the data plane or the model stub rather than the
# gRPC frontend: only the status code is compared for these.
KNOWN_DEVIATIONS = {
    "unexpected extra input": "engine: names the extra input instead of Triton's count message",
    "RepositoryModelLoad (mode none)": "engine: adds a hint to the message",
    "RepositoryModelUnload (mode none)": "engine: adds a hint to the message",
}
# Successful answers that depend on the server or model implementation, not on the protocol.
IMPLEMENTATION_SPECIFIC = ("ServerReady", "ServerMetadata", "RepositoryIndex", "ModelStatistics")
ABSENT = ("args_probe", "bad_return_none", "broken_config", "version_abc", "auto_complete")
TRITON_REPO = "/tmp/triton_probe_repo"  # where the reference server's models lived


def as_in_reference(server: dlserve.Server, text: str) -> str:
    """Model file paths (in execute errors) as they were in the reference repository."""
    return text.replace(str(server.options.model_repository), TRITON_REPO)


def _reference_cases() -> list[dict]:
    cases = json.loads((REFERENCE / "grpc_cases.json").read_text())
    return [
        case
        for case in cases
        if "request_text" in case
        and not any(f'"{name}' in case["request_text"] for name in ABSENT)
        and not case["label"].startswith(IMPLEMENTATION_SPECIFIC)
    ]


@pytest.mark.parametrize("case", _reference_cases(), ids=lambda case: case["label"])
def test_matches_triton_reference(server, stub, case):
    request = text_format.Parse(case["request_text"], getattr(pb, case["rpc"] + "Request")())
    call = getattr(stub, case["rpc"])
    if not case["ok"]:
        error = rpc_error(lambda: call(request, timeout=30))
        assert error.code().name == case["code"], error.details()
        if case["label"] not in KNOWN_DEVIATIONS:
            assert as_in_reference(server, error.details()) == case["details"]
        return
    response = call(request, timeout=30)
    if '"bytes_model"' in case["request_text"] or '"params_echo"' in case["request_text"]:
        return  # dlserve's test models of these names compute different outputs
    assert (
        json_format.MessageToDict(response, preserving_proto_field_name=True)
        == case["response_json"]
    )


def test_stream_matches_triton_reference(server, stub):
    """Errors arrive in the stream, which stays open, as in the captured Triton stream."""
    (case,) = [
        c
        for c in json.loads((REFERENCE / "grpc_cases.json").read_text())
        if c["rpc"] == "ModelStreamInfer"
    ]
    x = np.zeros(4, dtype=np.float32)
    requests = [
        raw_request(id="s1"),
        pb.ModelInferRequest(
            model_name="raiser",
            id="s2",
            inputs=[
                pb.ModelInferRequest.InferInputTensor(name="INPUT0", datatype="FP32", shape=[4])
            ],
            raw_input_contents=[x.tobytes()],
        ),
        raw_request("nope", id="s3"),
        pb.ModelInferRequest(
            model_name="per_request_error",
            inputs=[
                pb.ModelInferRequest.InferInputTensor(name="INPUT0", datatype="FP32", shape=[4])
            ],
            raw_input_contents=[np.array([1, 0, 0, 0], dtype=np.float32).tobytes()],
        ),
    ]
    got = list(stub.ModelStreamInfer(iter(requests), timeout=30))
    expected = case["responses"]
    assert len(got) == len(expected)

    def key(model_name: str, request_id: str) -> str:
        return f"{model_name}/{request_id}"

    by_key = {key(r.infer_response.model_name, r.infer_response.id): r for r in got}
    for reference in expected:
        infer = text_format.Parse(reference["infer_response_text"], pb.ModelInferResponse())
        mine = by_key[key(infer.model_name, infer.id)]
        assert as_in_reference(server, mine.error_message) == reference["error_message"]
        assert mine.infer_response == infer


# -- health and metadata ---------------------------------------------------------------------------
def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("add_sub")
    assert client.is_model_ready("add_sub", "1")
    assert not client.is_model_ready("add_sub", "7")
    assert not client.is_model_ready("nope")
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "dlserve" and "statistics" in meta["extensions"]
    model = client.get_model_metadata("dtypes_echo", as_json=True)
    assert model["name"] == "dtypes_echo" and model["versions"] == ["1"]
    inputs = {t["name"]: (t["datatype"], t["shape"]) for t in model["inputs"]}
    assert inputs["IN_STRING"] == ("BYTES", ["-1", "-1"]) and inputs["IN_BF16"] == (
        "BF16",
        ["-1", "-1"],
    )
    with pytest.raises(
        InferenceServerException, match="Request for unknown model: 'nope' is not found"
    ) as info:
        client.get_model_metadata("nope")
    assert info.value.status() == "StatusCode.NOT_FOUND"


def test_grpc_health_service(url):
    with grpc.insecure_channel(url) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        error = rpc_error(lambda: list(health.Watch(health_pb2.HealthCheckRequest(), timeout=10)))
        assert error.code() == grpc.StatusCode.UNIMPLEMENTED


def test_model_config_matches_the_engine(server, client):
    for name in ("params_echo", "dtypes_echo", "faulty"):
        config = client.get_model_config(name, as_json=True)["config"]
        engine = server.model(name).config()
        assert config["name"] == engine["name"] == name and config["backend"] == "python"
        assert config.get("max_batch_size", 0) == engine["max_batch_size"]
        assert [
            (i["name"], i["data_type"], [int(d) for d in i["dims"]], i.get("optional", False))
            for i in config["input"]
        ] == [(i["name"], i["data_type"], i["dims"], i["optional"]) for i in engine["input"]]
        assert [(o["name"], o["data_type"]) for o in config["output"]] == [
            (o["name"], o["data_type"]) for o in engine["output"]
        ]
        assert [g["name"] for g in config["instance_group"]] == [
            g["name"] for g in engine["instance_group"]
        ]
    params = client.get_model_config("params_echo", as_json=True)["config"]
    assert params["parameters"] == {"greeting": {"string_value": "hello"}}
    with pytest.raises(InferenceServerException, match="Request for unknown model") as info:
        client.get_model_config("nope")
    assert info.value.status() == "StatusCode.NOT_FOUND"


# -- inference -------------------------------------------------------------------------------------
def test_infer_add_sub_raw(client):
    result = client.infer("add_sub", add_sub_inputs(), request_id="r-1")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + 1)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - 1)
    response = result.get_response()
    assert (
        response.id == "r-1" and response.model_name == "add_sub" and response.model_version == "1"
    )
    assert (
        len(response.raw_output_contents) == 2 and not response.parameters
    )  # unary: no final flag
    only = client.infer(
        "add_sub", add_sub_inputs(), outputs=[grpcclient.InferRequestedOutput("OUTPUT1")]
    )
    assert [o.name for o in only.get_response().outputs] == ["OUTPUT1"]
    np.testing.assert_array_equal(only.as_numpy("OUTPUT1"), A - 1)


def test_infer_with_the_aio_client(url):
    async def run():
        async with aioclient.InferenceServerClient(url) as c:
            assert await c.is_server_live() and await c.is_model_ready("add_sub")
            results = await asyncio.gather(
                *(c.infer("add_sub", add_sub_inputs(A * i)) for i in range(8))
            )
            for i, result in enumerate(results):
                np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A * i + 1)
            with pytest.raises(InferenceServerException) as info:
                await c.infer("nope", add_sub_inputs())
            assert info.value.status() == "StatusCode.NOT_FOUND"

    asyncio.run(run())


TYPED = [
    ("BOOL", "bool_contents", np.array([[True, False, True]])),
    ("INT8", "int_contents", np.array([[-128, 0, 127]], dtype=np.int8)),
    ("INT16", "int_contents", np.array([[-32768, 1, 32767]], dtype=np.int16)),
    ("INT32", "int_contents", np.array([[-(2**31), 2, 2**31 - 1]], dtype=np.int32)),
    ("INT64", "int64_contents", np.array([[-(2**63), 3, 2**63 - 1]], dtype=np.int64)),
    ("UINT8", "uint_contents", np.array([[0, 1, 255]], dtype=np.uint8)),
    ("UINT16", "uint_contents", np.array([[0, 2, 65535]], dtype=np.uint16)),
    ("UINT32", "uint_contents", np.array([[0, 3, 2**32 - 1]], dtype=np.uint32)),
    ("UINT64", "uint64_contents", np.array([[0, 4, 2**64 - 1]], dtype=np.uint64)),
    ("FP32", "fp32_contents", np.array([[0.5, -1.25, 3.0]], dtype=np.float32)),
    ("FP64", "fp64_contents", np.array([[0.1, -2.5, 1e300]], dtype=np.float64)),
]


def _typed_request(datatype: str, field: str, values, shape) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="dtypes_echo")
    tensor = request.inputs.add(
        name=f"IN_{datatype if datatype != 'BYTES' else 'STRING'}", datatype=datatype, shape=shape
    )
    getattr(tensor.contents, field).extend(values)
    return request


@pytest.mark.parametrize("datatype,field,data", TYPED, ids=[t[0] for t in TYPED])
def test_typed_contents_every_type(stub, datatype, field, data):
    request = _typed_request(datatype, field, data.reshape(-1).tolist(), list(data.shape))
    response = stub.ModelInfer(request, timeout=30)
    (output,) = response.outputs
    assert (
        output.name == f"OUT_{datatype}"
        and output.datatype == datatype
        and list(output.shape) == [1, 3]
    )
    echoed = np.frombuffer(response.raw_output_contents[0], dtype=data.dtype).reshape(data.shape)
    np.testing.assert_array_equal(echoed, data)


def test_typed_contents_add_sub_and_bytes(stub):
    request = pb.ModelInferRequest(model_name="add_sub")
    for name, data in (("INPUT0", A), ("INPUT1", ONES)):
        request.inputs.add(name=name, datatype="FP32", shape=[16]).contents.fp32_contents.extend(
            data.tolist()
        )
    response = stub.ModelInfer(request, timeout=30)
    np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[0], np.float32), A + 1)
    request = _typed_request("BYTES", "bytes_contents", [b"ab", b"", b"\x00\xff"], [1, 3])
    response = stub.ModelInfer(request, timeout=30)
    assert response.raw_output_contents[0] == b"".join(
        len(v).to_bytes(4, "little") + v for v in (b"ab", b"", b"\x00\xff")
    )


def test_typed_contents_errors(stub):
    fp16 = _typed_request("FP16", "fp32_contents", [1.0, 2.0], [1, 2])
    fp16.inputs[0].name = "IN_FP16"
    error = rpc_error(lambda: stub.ModelInfer(fp16, timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == (
        "unexpected explicit tensor data for input tensor 'IN_FP16' for model 'dtypes_echo' "
        "of type 'FP32', expected datatype 'FP16'"
    )
    wrong = _typed_request("INT8", "uint_contents", [1, 2], [1, 2])
    error = rpc_error(lambda: stub.ModelInfer(wrong, timeout=30))
    # as in Triton: uint_contents hold UINT32 values unless the input is UINT8/UINT16
    assert error.details().endswith("of type 'UINT32', expected datatype 'INT8'")
    twice = _typed_request("INT32", "int_contents", [1], [1, 1])
    twice.inputs[0].contents.int64_contents.append(2)
    error = rpc_error(lambda: stub.ModelInfer(twice, timeout=30))
    assert "binary data was already supplied" in error.details()
    shm_and_contents = _typed_request("INT32", "int_contents", [1], [1, 1])
    shm_and_contents.inputs[0].parameters["shared_memory_region"].string_param = "r"
    shm_and_contents.inputs[0].parameters["shared_memory_byte_size"].int64_param = 4
    error = rpc_error(lambda: stub.ModelInfer(shm_and_contents, timeout=30))
    assert error.details() == (
        "unexpected 'content' provided when using shared memory for input tensor 'IN_INT32' "
        "for model 'dtypes_echo'"
    )


def _dtype_inputs() -> dict[str, tuple[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    shape = (2, 3)
    arrays = {
        "BOOL": rng.integers(0, 2, shape).astype(np.bool_),
        "FP16": rng.standard_normal(shape).astype(np.float16),
        "FP32": rng.standard_normal(shape).astype(np.float32),
        "FP64": rng.standard_normal(shape),
        "BF16": rng.standard_normal(shape).astype(ml_dtypes.bfloat16),
        "BYTES": np.array(
            [[b"a", b"", b"\x00\xff"], [b"long" * 100, b"x", "é".encode()]], dtype=np.object_
        ),
    }
    for dtype in (np.uint8, np.uint16, np.uint32, np.uint64, np.int8, np.int16, np.int32, np.int64):
        info = np.iinfo(dtype)
        arrays[np.dtype(dtype).name.upper()] = rng.integers(
            info.min, info.max, shape, dtype=dtype, endpoint=True
        )
    return {name: ("STRING" if name == "BYTES" else name, data) for name, data in arrays.items()}


def test_every_dtype_through_dtypes_echo(client):
    inputs, outputs = [], []
    specs = _dtype_inputs()
    for datatype, (suffix, data) in specs.items():
        tensor = grpcclient.InferInput(f"IN_{suffix}", list(data.shape), datatype)
        tensor.set_data_from_numpy(data)
        inputs.append(tensor)
        outputs.append(grpcclient.InferRequestedOutput(f"OUT_{suffix}"))
    result = client.infer("dtypes_echo", inputs, outputs=outputs)
    for datatype, (suffix, data) in specs.items():
        echoed = result.as_numpy(f"OUT_{suffix}")
        assert result.get_output(f"OUT_{suffix}").datatype == datatype
        assert echoed.shape == data.shape and echoed.dtype == data.dtype, datatype
        if datatype == "BYTES":
            assert echoed.tolist() == data.tolist()
        else:
            np.testing.assert_array_equal(echoed.view(np.uint8), data.view(np.uint8))


def test_request_id_and_parameters_reach_the_model(client):
    result = client.infer(
        "params_echo",
        [fp32_input("INPUT0", np.array([1.0, 2.0], dtype=np.float32))],
        request_id="rid-7",
        sequence_id=9,
        sequence_start=True,
        timeout=5000,
        priority=2,
        parameters={"p_int": 5, "p_str": "s", "p_bool": True, "p_float": 1.5, "p_neg": -3},
        outputs=[
            grpcclient.InferRequestedOutput("INFO"),
            grpcclient.InferRequestedOutput("OUTPUT0"),
        ],
    )
    info = json.loads(result.as_numpy("INFO")[0])
    assert info["request_id"] == "rid-7"
    assert info["parameters"] == {
        "p_int": 5,
        "p_str": "s",
        "p_bool": True,
        "p_float": 1.5,
        "p_neg": -3,
    }
    assert info["correlation_id"] == 9 and info["flags"] == 1 and info["timeout"] == 5000
    assert info["requested_output_names"] == ["INFO", "OUTPUT0"]
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [2.0, 4.0])
    response = result.get_response()
    assert response.id == "rid-7"
    params = json_format.MessageToDict(response, preserving_proto_field_name=True)["parameters"]
    assert params == {
        "echoed": {"bool_param": True},
        "count": {"int64_param": "1"},
        "model": {"string_param": "params_echo"},
    }
    text = client.infer(
        "params_echo",
        [fp32_input("INPUT0", np.ones(1, np.float32))],
        sequence_id="abc",
        sequence_end=True,
    )
    info = json.loads(text.as_numpy("INFO")[0])
    assert info["correlation_id"] == "abc" and info["flags"] == 2 and info["request_id"] == ""


def test_parameter_types_are_checked(stub):
    def request(key: str, **value) -> pb.ModelInferRequest:
        message = pb.ModelInferRequest(model_name="params_echo")
        message.inputs.add(name="INPUT0", datatype="FP32", shape=[1])
        message.raw_input_contents.append(np.ones(1, np.float32).tobytes())
        message.parameters[key].MergeFrom(pb.InferParameter(**value))
        return message

    cases = [
        (
            request("p_u", uint64_param=7),
            "invalid value type for 'p_u' parameter, expected "
            "int64_param, bool_param, or string_param.",
        ),
        (
            request("sequence_id", bool_param=True),
            "invalid value type for 'sequence_id' parameter, expected int64_param or string_param.",
        ),
        (
            request("sequence_start", int64_param=1),
            "invalid value type for 'sequence_start' parameter, expected bool_param.",
        ),
        (
            request("timeout", string_param="x"),
            "invalid value type for 'timeout' parameter, expected int64_param.",
        ),
        (request("priority", int64_param=-1), "invalid value for 'priority', expected value >= 0."),
        (
            request("triton_foo", bool_param=True),
            "parameter keys starting with 'triton_' are reserved",
        ),
    ]
    for message, text in cases:
        error = rpc_error(lambda message=message: stub.ModelInfer(message, timeout=30))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith(text)
    ok = stub.ModelInfer(request("priority", uint64_param=3), timeout=30)
    assert ok.model_name == "params_echo"
    # Reserved in Triton's documentation, but Triton 2.51 hands these to the model over
    # gRPC (measured side by side); dropping them silently lost what a client sent.
    message = request("headers", string_param="h")
    message.parameters["binary_data_output"].bool_param = True
    message.outputs.add(name="INFO")
    reply = stub.ModelInfer(message, timeout=30)
    info = json.loads(deserialize_bytes_tensor(reply.raw_output_contents[0])[0])
    assert info["parameters"] == {"headers": "h", "binary_data_output": True}


CODES = {
    "NOT_FOUND": "NOT_FOUND",
    "INVALID_ARG": "INVALID_ARGUMENT",
    "INTERNAL": "INTERNAL",
    "UNAVAILABLE": "UNAVAILABLE",
    "UNSUPPORTED": "UNIMPLEMENTED",
    "ALREADY_EXISTS": "ALREADY_EXISTS",
    "UNKNOWN": "UNKNOWN",
    "CANCELLED": "CANCELLED",
}


def faulty(client, mode: str, **kwargs):
    return client.infer(
        "faulty",
        [fp32_input("INPUT0", np.ones(2, np.float32))],
        parameters={"mode": mode},
        **kwargs,
    )


@pytest.mark.parametrize("code", list(CODES))
def test_per_request_error_codes(client, code):
    with pytest.raises(InferenceServerException) as info:
        faulty(client, f"error:{code}")
    assert info.value.status() == f"StatusCode.{CODES[code]}"
    assert info.value.message() == "custom error"


def test_execute_exceptions_are_internal(client):
    for mode, text in (
        ("raise", "ValueError: boom"),
        ("not_list", "Expected a list in the execute return"),
    ):
        with pytest.raises(InferenceServerException) as info:
            faulty(client, mode)
        assert info.value.status() == "StatusCode.INTERNAL"
        assert info.value.message().startswith("Failed to process the request(s) for model 'faulty")
        assert text in info.value.message()
    np.testing.assert_array_equal(faulty(client, "ok").as_numpy("OUTPUT0"), [1.0, 1.0])


def test_bad_requests(client, stub):
    def status(call):
        with pytest.raises(InferenceServerException) as info:
            call()
        return info.value.status().removeprefix("StatusCode."), info.value.message()

    assert status(lambda: client.infer("nope", add_sub_inputs())) == (
        "NOT_FOUND",
        "Request for unknown model: 'nope' is not found",
    )
    assert status(lambda: client.infer("add_sub", add_sub_inputs(), model_version="7")) == (
        "NOT_FOUND",
        "Request for unknown model: 'add_sub' version 7 is not found",
    )
    code, text = status(lambda: client.infer("add_sub", add_sub_inputs(), model_version="x"))
    assert code == "INVALID_ARGUMENT" and "version string 'x'" in text
    wrong_type = grpcclient.InferInput("INPUT0", [16], "INT32")
    wrong_type.set_data_from_numpy(np.arange(16, dtype=np.int32))
    assert status(lambda: client.infer("add_sub", [wrong_type, add_sub_inputs()[1]])) == (
        "INVALID_ARGUMENT",
        "[request id: <id_unknown>] inference input 'INPUT0' data-type is 'INT32', "
        "but model 'add_sub' expects 'FP32'",
    )
    code, text = status(lambda: client.infer("add_sub", add_sub_inputs(A.reshape(2, 8), ONES)))
    assert code == "INVALID_ARGUMENT" and "Expected [16], got [2,8]" in text
    code, text = status(lambda: client.infer("add_sub", add_sub_inputs()[:1], request_id="q"))
    assert code == "INVALID_ARGUMENT" and text.startswith(
        "[request id: q] expected 2 inputs but got 1 inputs"
    )
    code, text = status(
        lambda: client.infer(
            "add_sub", add_sub_inputs(), outputs=[grpcclient.InferRequestedOutput("NOPE")]
        )
    )
    assert (code, text) == (
        "INVALID_ARGUMENT",
        "unexpected inference output 'NOPE' for model 'add_sub'",
    )
    code, text = status(
        lambda: client.infer(
            "add_sub",
            add_sub_inputs(),
            outputs=[grpcclient.InferRequestedOutput("OUTPUT0", class_count=-2)],
        )
    )
    assert (code, text) == (
        "INVALID_ARGUMENT",
        "invalid value for 'classification' parameter, expected >= 0",  # (Triton's)
    )

    # raw_input_contents: one per input, the right number of bytes
    too_few = raw_request()
    del too_few.raw_input_contents[1]
    error = rpc_error(lambda: stub.ModelInfer(too_few, timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        error.details()
        == "unable to find data for input tensor 'INPUT1' for model 'add_sub' in request."
    )
    too_many = raw_request()
    too_many.raw_input_contents.append(b"\x00" * 64)
    error = rpc_error(lambda: stub.ModelInfer(too_many, timeout=30))
    assert (
        error.code() == grpc.StatusCode.INVALID_ARGUMENT and "raw_input_contents" in error.details()
    )
    short = raw_request()
    short.raw_input_contents[0] = A[:15].tobytes()
    error = rpc_error(lambda: stub.ModelInfer(short, timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        "input byte size mismatch for input 'INPUT0'" in error.details()
        and "Expected 64, got 60" in error.details()
    )
    mixed = raw_request()
    mixed.inputs[0].contents.fp32_contents.extend(A.tolist())
    error = rpc_error(lambda: stub.ModelInfer(mixed, timeout=30))
    assert (
        error.details()
        == "contents field must not be specified when using raw_input_contents for 'INPUT0' "
        "for model 'add_sub'"
    )
    bad_bytes = pb.ModelInferRequest(
        model_name="bytes_model", raw_input_contents=[b"\x05\x00\x00\x00ab"]
    )
    bad_bytes.inputs.add(name="INPUT0", datatype="BYTES", shape=[1])
    error = rpc_error(lambda: stub.ModelInfer(bad_bytes, timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    # (Triton's words for these two)
    few_strings = pb.ModelInferRequest(model_name="bytes_model")
    few_strings.inputs.add(name="INPUT0", datatype="BYTES", shape=[3]).contents.bytes_contents.extend([b"a", b"b"])
    error = rpc_error(lambda: stub.ModelInfer(few_strings, timeout=30))
    assert error.details() == (
        "[request id: <id_unknown>] expected 3 string elements for inference input 'INPUT0' for model "
        "'bytes_model', got 2"
    )
    # too many, as contents or as raw bytes: Triton counts one past the last it expects
    many_strings = pb.ModelInferRequest(model_name="bytes_model")
    many_strings.inputs.add(name="INPUT0", datatype="BYTES", shape=[3]).contents.bytes_contents.extend([b"a"] * 5)
    many_raw = pb.ModelInferRequest(model_name="bytes_model", raw_input_contents=[b"\x01\x00\x00\x00a" * 5])
    many_raw.inputs.add(name="INPUT0", datatype="BYTES", shape=[3])
    for many in (many_strings, many_raw):
        error = rpc_error(lambda: stub.ModelInfer(many, timeout=30))  # noqa: B023
        assert error.details() == (
            "[request id: <id_unknown>] unexpected number of string elements 4 for inference input 'INPUT0' "
            "for model 'bytes_model', expecting 3"
        )
    unspecified = raw_request()
    unspecified.inputs[0].shape[:] = [-1]
    error = rpc_error(lambda: stub.ModelInfer(unspecified, timeout=30))
    assert error.details() == (
        "[request id: <id_unknown>] All input dimensions should be specified for input 'INPUT0' for model "
        "'add_sub', got [-1]"
    )
    unknown_type = raw_request()
    unknown_type.inputs[0].datatype = "FLOAT"
    error = rpc_error(lambda: stub.ModelInfer(unknown_type, timeout=30))
    assert error.details() == (
        "[request id: <id_unknown>] inference input 'INPUT0' data-type is '<invalid>', "
        "but model 'add_sub' expects 'FP32'"
    )


# -- streaming -------------------------------------------------------------------------------------
def test_stream_with_errors_in_the_middle(client):
    results: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("add_sub", add_sub_inputs(), request_id="s1")
        client.async_stream_infer(
            "faulty",
            [fp32_input("INPUT0", ONES[:2])],
            request_id="s2",
            parameters={"mode": "raise"},
        )
        client.async_stream_infer("nope", add_sub_inputs(), request_id="s3")
        client.async_stream_infer(
            "faulty",
            [fp32_input("INPUT0", ONES[:2])],
            request_id="s4",
            parameters={"mode": "error:NOT_FOUND"},
        )
        client.async_stream_infer("add_sub", add_sub_inputs(A * 2), request_id="s5")
        got = [results.get(timeout=30) for _ in range(5)]
    finally:
        client.stop_stream()
    ok = {r.get_response().id: r for r, e in got if e is None}
    errors = [str(e.message()) for r, e in got if e is not None]
    assert sorted(ok) == ["s1", "s5"]
    np.testing.assert_array_equal(ok["s1"].as_numpy("OUTPUT0"), A + 1)
    np.testing.assert_array_equal(ok["s5"].as_numpy("OUTPUT1"), A * 2 - 1)
    assert ok["s1"].get_response().parameters["triton_final_response"].bool_param is True
    assert len(errors) == 3
    assert "Request for unknown model: 'nope' is not found" in errors
    assert "custom error" in errors
    assert any(e.startswith("Failed to process the request(s) for model 'faulty") for e in errors)


def test_a_stream_answers_requests_to_non_decoupled_models_in_request_order(client):
    """As Triton 2.51 (side by side): a slow request's answer, a refusal and a fast
    request's answer come back in the order the requests were sent (dlserve sent them
    as they finished: the refusal and the fast one first)."""
    results: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(
            "faulty", [fp32_input("INPUT0", ONES[:2])], request_id="slow", parameters={"mode": "sleep:0.5"}
        )
        client.async_stream_infer("nope", add_sub_inputs(), request_id="refused")
        client.async_stream_infer("add_sub", add_sub_inputs(), request_id="fast")
        got = [results.get(timeout=30) for _ in range(3)]
    finally:
        client.stop_stream()
    order = [result.get_response().id if error is None else error.message() for result, error in got]
    assert order == ["slow", "Request for unknown model: 'nope' is not found", "fast"]


def test_a_stream_asking_for_triton_grpc_error_ends_with_the_first_errors_status(client):
    """As Triton 2.51 (its QA lifecycle test_triton_grpc_error_*): with the
    ``triton_grpc_error: true`` header the first error ends the stream with its gRPC
    status, and the client can send no more on it."""
    results: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(
        callback=lambda result, error: results.put((result, error)), headers={"triton_grpc_error": "true"}
    )
    try:
        client.async_stream_infer("add_sub", add_sub_inputs(), request_id="s1")
        answered = results.get(timeout=30)
        client.async_stream_infer(
            "faulty", [fp32_input("INPUT0", ONES[:2])], request_id="s2", parameters={"mode": "error:NOT_FOUND"},
        )
        ended = results.get(timeout=30)
        with pytest.raises(InferenceServerException, match="no longer in valid state"):
            client.async_stream_infer("add_sub", add_sub_inputs(), request_id="s3")
    finally:
        client.stop_stream()
    assert answered[1] is None and answered[0].get_response().id == "s1"
    assert ended[0] is None and ended[1].status() == "StatusCode.NOT_FOUND"
    assert "custom error" in ended[1].message()


def test_triton_grpc_error_leaves_refusals_on_the_stream_and_reads_only_true(client):
    """As Triton 2.51, side by side: with ``triton_grpc_error: true`` a request refused
    before it reaches a model (unknown model, bad input) is answered on the stream, which
    goes on; and only "true" as written asks for the mode ("True" does not)."""
    for header, model_error_ends_call in (("true", True), ("True", False)):
        results: queue.SimpleQueue = queue.SimpleQueue()
        client.start_stream(
            callback=lambda result, error: results.put((result, error)),
            headers={"triton_grpc_error": header},
        )
        try:
            client.async_stream_infer("nope", add_sub_inputs(), request_id="r1")
            client.async_stream_infer("add_sub", [fp32_input("INPUT0", A)], request_id="r2")
            client.async_stream_infer("add_sub", add_sub_inputs(), request_id="r3")
            got = [results.get(timeout=30) for _ in range(3)]
            client.async_stream_infer(
                "faulty", [fp32_input("INPUT0", ONES[:2])], request_id="r4",
                parameters={"mode": "error:NOT_FOUND"},
            )
            failed = results.get(timeout=30)
            if not model_error_ends_call:
                client.async_stream_infer("add_sub", add_sub_inputs(), request_id="r5")
                after = results.get(timeout=30)
                assert after[1] is None and after[0].get_response().id == "r5"
        finally:
            client.stop_stream()
        assert got[0][1].message() == "Request for unknown model: 'nope' is not found"
        assert "INPUT1" in got[1][1].message()
        assert got[2][1] is None and got[2][0].get_response().id == "r3"
        assert "custom error" in failed[1].message()
        assert (failed[1].status() == "StatusCode.NOT_FOUND") is model_error_ends_call


def test_stream_error_responses_carry_ids(stub):
    requests = [raw_request("nope", id="a"), raw_request(id="b")]
    responses = {r.infer_response.id: r for r in stub.ModelStreamInfer(iter(requests), timeout=30)}
    assert responses["a"].error_message == "Request for unknown model: 'nope' is not found"
    assert (
        responses["b"].error_message == ""
        and len(responses["b"].infer_response.raw_output_contents) == 2
    )
    assert responses["b"].infer_response.parameters["triton_final_response"].bool_param


def test_stream_with_the_aio_client(url):
    async def run():
        async def requests():
            for i in range(6):
                yield {
                    "model_name": "add_sub",
                    "inputs": add_sub_inputs(A * i),
                    "request_id": str(i),
                }
            yield {
                "model_name": "faulty",
                "inputs": [fp32_input("INPUT0", ONES[:2])],
                "request_id": "bad",
                "parameters": {"mode": "error:UNAVAILABLE"},
            }

        async with aioclient.InferenceServerClient(url) as c:
            seen, errors = {}, []
            async for result, error in c.stream_infer(requests()):
                if error is not None:
                    errors.append(error.message())
                else:
                    seen[result.get_response().id] = result.as_numpy("OUTPUT0")
            assert errors == ["custom error"]
            assert sorted(seen) == [str(i) for i in range(6)]
            for i in range(6):
                np.testing.assert_array_equal(seen[str(i)], A * i + 1)

    asyncio.run(run())


# -- statistics, logging, trace --------------------------------------------------------------------
def test_statistics(client):
    before = client.get_inference_statistics("identity").model_stats[0]
    for _ in range(3):
        client.infer("identity", [fp32_input("INPUT0", ONES)])
    after = client.get_inference_statistics("identity", as_json=True)["model_stats"][0]
    assert after["name"] == "identity" and after["version"] == "1"
    assert int(after["inference_count"]) == before.inference_count + 3
    assert (
        int(after["inference_stats"]["success"]["count"])
        == before.inference_stats.success.count + 3
    )
    assert int(after["last_inference"]) > 0 and after["batch_stats"][0]["batch_size"] == "1"
    everything = client.get_inference_statistics()
    assert {"identity", "add_sub", "faulty"} <= {s.name for s in everything.model_stats}
    with pytest.raises(
        InferenceServerException, match="requested model 'nope' is not available"
    ) as info:
        client.get_inference_statistics("nope")
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"


def test_log_settings(server, client):
    original = client.get_log_settings(as_json=True)["settings"]
    assert set(original) == {
        "log_file",
        "log_info",
        "log_warning",
        "log_error",
        "log_verbose_level",
        "log_format",
    }
    try:
        updated = client.update_log_settings(
            {"log_verbose_level": 2, "log_info": True}, as_json=True
        )["settings"]
        assert updated["log_verbose_level"] == {"uint32_param": 2} and updated["log_info"] == {
            "bool_param": True
        }
        assert server.engine.settings.log.log_verbose_level == 2
        with pytest.raises(InferenceServerException) as info:
            client.update_log_settings({"log_format": "nonsense"})
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    finally:
        client.update_log_settings(
            {
                k: next(iter(v.values())) if v else False
                for k, v in original.items()
                if k != "log_file"
            }
        )
    assert client.get_log_settings(as_json=True)["settings"] == original


@pytest.mark.parametrize(
    "key,code,message",
    [
        ("log_info", grpc.StatusCode.INVALID_ARGUMENT, "expect boolean for 'log_info'"),
        ("log_verbose_level", grpc.StatusCode.INVALID_ARGUMENT, "expect int32 for 'log_verbose_level'"),
        ("log_format", grpc.StatusCode.INVALID_ARGUMENT, "expect string for 'log_format'"),
        ("log_file", grpc.StatusCode.UNIMPLEMENTED, "log file location can not be updated"),
        ("not_a_setting", None, None),
    ],
)
def test_log_setting_sent_without_a_value(server, client, stub, key, code, message):
    """Triton refuses a known setting whose value is unset (and ignores an unknown one)."""
    before = client.get_log_settings(as_json=True)["settings"]
    request = pb.LogSettingsRequest()
    request.settings[key].CopyFrom(pb.LogSettingsRequest.SettingValue())
    if code is None:
        stub.LogSettings(request)
    else:
        with pytest.raises(grpc.RpcError) as info:
            stub.LogSettings(request)
        assert info.value.code() == code and message in info.value.details()
    assert client.get_log_settings(as_json=True)["settings"] == before


def test_trace_settings_are_off_by_default(client):
    # Tracing is off by default, as in Triton (test_trace.py covers it turned on).
    settings = client.get_trace_settings(as_json=True)["settings"]
    assert settings["trace_level"]["value"] == ["OFF"] and settings["trace_rate"]["value"] == ["1000"]


@pytest.mark.skipif(dlserve.memory.cuda.device_count() > 0, reason="CUDA is here (tests/gpu)")
def test_cuda_shared_memory_without_cuda_is_unimplemented(client):
    assert len(client.get_cuda_shared_memory_status().regions) == 0
    with pytest.raises(InferenceServerException) as info:
        client.register_cuda_shared_memory("gpu", b"\x00" * 64, 0, 64)
    assert info.value.status() == "StatusCode.UNIMPLEMENTED"


# -- model repository ------------------------------------------------------------------------------
def test_load_and_unload_refused_outside_explicit_mode(client):
    for call in (lambda: client.load_model("add_sub"), lambda: client.unload_model("add_sub")):
        with pytest.raises(
            InferenceServerException, match="explicit model load / unload is not allowed"
        ) as info:
            call()
        assert info.value.status() == "StatusCode.UNAVAILABLE"


def test_repository_index_load_unload(servers, make_repo):
    server = servers.start(
        make_repo("add_sub", "identity", "init_fail"), model_control_mode=ModelControlMode.EXPLICIT
    )
    service = start_grpc(server)
    with grpcclient.InferenceServerClient(f"127.0.0.1:{service.port}") as c:
        index = c.get_model_repository_index(as_json=True)["models"]
        assert [m["name"] for m in index] == ["add_sub", "identity", "init_fail"]
        assert all("state" not in m for m in index)
        assert c.get_model_repository_index().models[0].name == "add_sub"

        c.load_model("identity")
        assert c.is_model_ready("identity")
        ready = c.get_model_repository_index(as_json=True)["models"]
        assert {"name": "identity", "version": "1", "state": "READY"} in ready
        np.testing.assert_array_equal(
            c.infer("identity", [fp32_input("INPUT0", A)]).as_numpy("OUTPUT0"), A
        )

        # a config override and uploaded files, as tritonclient sends them
        config = json.dumps(
            {
                "backend": "python",
                "input": [
                    {"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [16]},
                    {"name": "INPUT1", "data_type": "TYPE_FP32", "dims": [16]},
                ],
                "output": [
                    {"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [16]},
                    {"name": "OUTPUT1", "data_type": "TYPE_FP32", "dims": [16]},
                ],
            }
        )
        model_py = (MODELS / "add_sub" / "1" / "model.py").read_bytes()
        c.load_model("uploaded", config=config, files={"file:1/model.py": model_py})
        np.testing.assert_array_equal(
            c.infer("uploaded", add_sub_inputs()).as_numpy("OUTPUT0"), A + 1
        )

        c.unload_model("identity")
        assert not c.is_model_ready("identity")
        c.unload_model("uploaded", unload_dependents=True)
        with pytest.raises(InferenceServerException) as info:
            c.infer("identity", [fp32_input("INPUT0", A)])
        assert info.value.status() == "StatusCode.NOT_FOUND"

        with pytest.raises(InferenceServerException) as info:
            c.load_model("nope")
        assert info.value.status() == "StatusCode.NOT_FOUND"

        with grpc.insecure_channel(f"127.0.0.1:{service.port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            error = rpc_error(
                lambda: stub.RepositoryIndex(
                    pb.RepositoryIndexRequest(repository_name="other"), timeout=10
                )
            )
            assert error.code() == grpc.StatusCode.UNIMPLEMENTED
            bad = pb.RepositoryModelLoadRequest(model_name="identity")
            bad.parameters["config"].bytes_param = b"{}"
            error = rpc_error(lambda: stub.RepositoryModelLoad(bad, timeout=10))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.details() == "invalid value type for load parameter 'config', expected string_param."
            bad = pb.RepositoryModelUnloadRequest(model_name="identity")
            bad.parameters["unload_dependents"].string_param = "true"
            error = rpc_error(lambda: stub.RepositoryModelUnload(bad, timeout=10))
            assert error.details() == "invalid value type for 'unload_dependents' parameter, expected bool_param."

            # a model that fails to load: the server is live but not ready
            with pytest.raises(InferenceServerException, match="weights file is missing"):
                c.load_model("init_fail")
            assert c.is_server_live() and not c.is_server_ready()
            health = health_pb2_grpc.HealthStub(channel)
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    stop_and_settle(servers)


# -- shared memory ---------------------------------------------------------------------------------
def test_system_shared_memory(client):
    tag = uuid.uuid4().hex[:8]
    data = np.arange(64, dtype=np.float32)
    nbytes = data.nbytes
    inp = shm.create_shared_memory_region(f"in_{tag}", f"/grpc_in_{tag}", nbytes)
    out = shm.create_shared_memory_region(f"out_{tag}", f"/grpc_out_{tag}", nbytes * 2)
    try:
        shm.set_shared_memory_region(inp, [data])
        client.register_system_shared_memory(f"in_{tag}", f"/grpc_in_{tag}", nbytes)
        client.register_system_shared_memory(
            f"out_{tag}", f"/grpc_out_{tag}", nbytes, offset=nbytes
        )
        status = client.get_system_shared_memory_status(as_json=True)["regions"]
        region = status[f"out_{tag}"]
        assert region["name"] == f"out_{tag}" and region["key"] == f"/grpc_out_{tag}"
        assert (region["offset"], region["byte_size"]) == (str(nbytes), str(nbytes))
        with pytest.raises(InferenceServerException) as info:
            client.register_system_shared_memory(f"in_{tag}", f"/grpc_in_{tag}", nbytes)
        assert info.value.status() == "StatusCode.ALREADY_EXISTS"
        with pytest.raises(InferenceServerException) as info:  # (upstream L0_grpc's aio test)
            client.register_system_shared_memory("", "", 0)
        assert info.value.status() == "StatusCode.INTERNAL"
        assert info.value.message() == "Unable to open shared memory region: ''"

        tensor = grpcclient.InferInput("INPUT0", [64], "FP32")
        tensor.set_shared_memory(f"in_{tag}", nbytes)
        output = grpcclient.InferRequestedOutput("OUTPUT0")
        output.set_shared_memory(f"out_{tag}", nbytes)
        result = client.infer("identity", [tensor], outputs=[output])
        assert not result.get_output("OUTPUT0").parameters  # as Triton 2.51: nothing echoed
        assert result.get_response().raw_output_contents == [b""]
        written = shm.get_contents_as_numpy(out, np.float32, [128])
        np.testing.assert_array_equal(written[64:], data)

        # an output in shared memory before one that is not: raw contents stay aligned
        a = grpcclient.InferInput("INPUT0", [16], "FP32")
        a.set_shared_memory(f"in_{tag}", 64)
        b = grpcclient.InferInput("INPUT1", [16], "FP32")
        b.set_shared_memory(f"in_{tag}", 64, offset=64)
        first = grpcclient.InferRequestedOutput("OUTPUT0")
        first.set_shared_memory(f"out_{tag}", 64)
        result = client.infer(
            "add_sub", [a, b], outputs=[first, grpcclient.InferRequestedOutput("OUTPUT1")]
        )
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), data[:16] - data[16:32])
        np.testing.assert_array_equal(
            shm.get_contents_as_numpy(out, np.float32, [128])[64:80], data[:16] + data[16:32]
        )

        client.unregister_system_shared_memory(f"in_{tag}")
        assert f"in_{tag}" not in client.get_system_shared_memory_status(as_json=True).get(
            "regions", {}
        )
        with pytest.raises(InferenceServerException) as info:
            client.get_system_shared_memory_status(f"in_{tag}")
        assert info.value.status() == "StatusCode.NOT_FOUND"
        with pytest.raises(InferenceServerException) as info:
            client.infer("identity", [tensor])
        assert info.value.status() == "StatusCode.NOT_FOUND"  # (Triton's)
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(inp)
        shm.destroy_shared_memory_region(out)
    assert not client.get_system_shared_memory_status(as_json=True).get("regions")


def test_a_refused_request_lets_go_of_the_clients_shared_memory(client):
    """The server held a client's object (mapping and descriptors) after an infer that
    failed over gRPC, until the cyclic garbage collector happened to run; with it off,
    nothing may be left once the region is unregistered."""
    tag = uuid.uuid4().hex[:8]
    path = f"/dev/shm/grpc_refused_{tag}"
    with open(path, "wb") as f:  # made without a mapping of ours: what is mapped is the server's
        f.write(np.arange(64, dtype=np.float32).tobytes())

    def held() -> list[str]:
        maps = [line for line in Path("/proc/self/maps").read_text().splitlines() if path in line]
        fds = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{fd}") == path:
                    fds.append(fd)
        return maps + fds

    gc.disable()
    try:
        client.register_system_shared_memory(f"r_{tag}", f"/grpc_refused_{tag}", 256)
        a = grpcclient.InferInput("INPUT0", [16], "FP32")
        a.set_shared_memory(f"r_{tag}", 64)
        b = grpcclient.InferInput("INPUT1", [16], "FP32")
        b.set_shared_memory(f"r_{tag}", 64, offset=64)
        small = grpcclient.InferRequestedOutput("OUTPUT0")
        small.set_shared_memory(f"r_{tag}", 32, offset=128)  # 64 bytes needed
        with pytest.raises(InferenceServerException, match="should be at least 64 bytes"):
            client.infer("add_sub", [a, b], outputs=[small])
        client.unregister_system_shared_memory(f"r_{tag}")
        assert held() == []
    finally:
        gc.enable()
        client.unregister_system_shared_memory()
        os.unlink(path)


def test_shared_memory_disabled(server):
    service = start_grpc(server)  # allow_client_shm defaults to False
    try:
        with grpcclient.InferenceServerClient(f"127.0.0.1:{service.port}") as c:
            with pytest.raises(
                InferenceServerException, match="Client shared memory is disabled"
            ) as info:
                c.register_system_shared_memory("r", "/grpc_disabled", 64)
            assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
            tensor = grpcclient.InferInput("INPUT0", [16], "FP32")
            tensor.set_shared_memory("r", 64)
            with pytest.raises(InferenceServerException, match="Client shared memory is disabled"):
                c.infer("identity", [tensor])
            c.unregister_system_shared_memory()  # clean-up code's habit: nothing to do
            c.unregister_cuda_shared_memory()
    finally:
        service.stop()


# -- service options -------------------------------------------------------------------------------
def test_restricted_protocols(server):
    service = start_grpc(server, restricted_protocols=["inference,health:infer-key=secret"])
    url = f"127.0.0.1:{service.port}"
    try:
        with grpcclient.InferenceServerClient(url) as c:
            for call in (lambda: c.infer("add_sub", add_sub_inputs()), c.is_server_live):
                with pytest.raises(InferenceServerException) as info:
                    call()
                assert info.value.status() == "StatusCode.UNAVAILABLE"
                assert (
                    info.value.message()
                    == "This protocol is restricted, expecting header 'triton-grpc-protocol-infer-key'"
                )
            with pytest.raises(InferenceServerException, match="restricted"):
                c.is_server_live(headers={"triton-grpc-protocol-infer-key": "wrong"})
            with pytest.raises(InferenceServerException, match="restricted"):  # (as Triton 2.51)
                c.is_server_live(headers={"infer-key": "secret"})
            assert c.get_server_metadata().name == "dlserve"  # metadata is not restricted
            assert c.is_server_live(headers={"triton-grpc-protocol-infer-key": "secret"})
            # Triton's clients send the header with its gRPC prefix
            result = c.infer(
                "add_sub", add_sub_inputs(), headers={"triton-grpc-protocol-infer-key": "secret"}
            )
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + 1)
        with grpc.insecure_channel(url) as channel:
            stream = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
                iter([raw_request()]), timeout=10
            )
            error = rpc_error(lambda: list(stream))
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            health = health_pb2_grpc.HealthStub(channel)
            error = rpc_error(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=10))
            assert error.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        service.stop()
    with pytest.raises(dlserve.InvalidArgumentError, match=r"^unknown restricted protocol 'bogus' \(known: health, "):
        start_grpc(server, restricted_protocols=["bogus:h=v"])
    with pytest.raises(dlserve.InvalidArgumentError, match="^restricted protocol 'health' can not be specified in multiple config groups$"):
        start_grpc(server, restricted_protocols=["health,metadata:a=1", "health:b=2"])  # (Triton's words)


def test_large_tensors_both_ways(client, stub):
    """Tensors above the size from which the server cuts raw inputs out of the request
    (instead of parsing them) and sends outputs as views: unary and streamed, several
    raw inputs, typed fields after the raw contents on the wire."""
    rng = np.random.default_rng(7)
    a = rng.random(1 << 17, dtype=np.float32)  # 512 KiB
    result = client.infer("identity", [fp32_input("INPUT0", a)])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a)

    f64 = rng.random((2, 1 << 16))  # 1 MiB
    request = pb.ModelInferRequest(model_name="dtypes_echo", id="big")
    request.raw_input_contents.extend([a.tobytes(), f64.tobytes()])
    # the inputs after the raw contents on the wire: protobuf does not fix the order
    request.inputs.add(name="IN_FP32", datatype="FP32", shape=[1, a.size])
    request.inputs.add(name="IN_FP64", datatype="FP64", shape=list(f64.shape))
    request.outputs.add(name="OUT_FP32")
    request.outputs.add(name="OUT_FP64")
    reordered = (
        pb.ModelInferRequest(raw_input_contents=request.raw_input_contents).SerializeToString()
        + pb.ModelInferRequest(
            model_name="dtypes_echo", id="big", inputs=request.inputs, outputs=request.outputs
        ).SerializeToString()
    )

    def check(response: pb.ModelInferResponse) -> None:
        assert response.id == "big" and [o.name for o in response.outputs] == [
            "OUT_FP32",
            "OUT_FP64",
        ]
        got = response.raw_output_contents
        np.testing.assert_array_equal(np.frombuffer(got[0], np.float32), a)
        np.testing.assert_array_equal(np.frombuffer(got[1], np.float64).reshape(f64.shape), f64)

    for body in (request.SerializeToString(), reordered):
        check(stub.ModelInfer(pb.ModelInferRequest.FromString(body), timeout=30))
    streamed = list(stub.ModelStreamInfer(iter([request, request]), timeout=30))
    assert [r.error_message for r in streamed] == ["", ""]
    for item in streamed:
        check(item.infer_response)
        assert item.infer_response.parameters["triton_final_response"].bool_param


def test_parse_infer_request_cuts_raw_inputs_out():
    from dlserve.frontends.grpc_codec import parse_infer_request

    big = bytes(range(256)) * 512  # 128 KiB: above the scanning threshold
    request = pb.ModelInferRequest(model_name="m", model_version="2", id="x")
    request.inputs.add(name="IN", datatype="UINT8", shape=[len(big)])
    request.outputs.add(name="OUT")
    request.parameters["k"].string_param = "v"
    request.raw_input_contents.extend([big, b"", b"tail"])
    body = bytearray(request.SerializeToString())
    message, raws = parse_infer_request(body)
    assert [bytes(raw) for raw in raws] == [big, b"", b"tail"]
    assert isinstance(raws[0], memoryview) and raws[0].obj is body  # a view, not a copy
    assert not message.raw_input_contents
    request.ClearField("raw_input_contents")
    assert message == request
    with pytest.raises(DecodeError):
        parse_infer_request(body[: len(body) - 2])
    small, raws = parse_infer_request(pb.ModelInferRequest(model_name="m").SerializeToString())
    assert small.model_name == "m" and not raws


def test_compression_and_message_size(server):
    service = start_grpc(
        server,
        infer_compression_level=KServeGrpc.Grpc_compression_level.HIGH,
        max_message_size=1 << 16,
    )
    try:
        with grpcclient.InferenceServerClient(f"127.0.0.1:{service.port}") as c:
            big = np.zeros(4096, dtype=np.float32)
            np.testing.assert_array_equal(
                c.infer("identity", [fp32_input("INPUT0", big)]).as_numpy("OUTPUT0"), big
            )
            too_big = np.zeros(1 << 15, dtype=np.float32)  # 128 KiB > 64 KiB
            with pytest.raises(InferenceServerException) as info:
                c.infer("identity", [fp32_input("INPUT0", too_big)])
            assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    finally:
        service.stop()


def test_a_message_over_64_mib_is_taken_by_default(client):
    """tritonserver takes gRPC messages up to INT32_MAX bytes, and tritonclient sends them:
    an 80 MiB tensor goes through unchanged (dlserve's default was 64 MiB)."""
    big = np.arange(20 << 20, dtype=np.float32)
    np.testing.assert_array_equal(client.infer("identity", [fp32_input("INPUT0", big)]).as_numpy("OUTPUT0"), big)
    assert KServeGrpc.Options().max_message_size == 2**31 - 1


def test_options_become_transport_settings():
    options = KServeGrpc.Options(
        keepalive_time_ms=1000,
        keepalive_timeout_ms=2000,
        keepalive_permit_without_calls=True,
        http2_max_pings_without_data=3,
        http2_min_recv_ping_interval_without_data_ms=4000,
        http2_max_ping_strikes=5,
        max_connection_age_ms=6000,
        max_connection_age_grace_ms=7000,
        max_message_size=1 << 20,
    )
    settings = transport_settings(options)
    assert (settings.keepalive_time_ms, settings.keepalive_timeout_ms) == (1000, 2000)
    assert settings.keepalive_permit_without_calls is True
    assert settings.http2_min_recv_ping_interval_without_data_ms == 4000
    assert settings.http2_max_ping_strikes == 5
    assert (settings.max_connection_age_ms, settings.max_connection_age_grace_ms) == (6000, 7000)
    assert settings.max_message_size == 1 << 20


def test_forward_header_pattern(server):
    service = start_grpc(server, forward_header_pattern="^x-fwd-")
    try:
        with grpcclient.InferenceServerClient(f"127.0.0.1:{service.port}") as c:
            result = c.infer(
                "params_echo",
                [fp32_input("INPUT0", ONES[:1])],
                headers={"x-fwd-user": "alice", "x-other": "no", "x-fwd-tag-bin": b"abc", "x-fwd-nul-bin": b"\0\xff"},
                parameters={"p": 1},
            )
            assert json.loads(result.as_numpy("INFO")[0])["parameters"] == {
                "p": 1,
                "x-fwd-user": "alice",
                "x-fwd-tag-bin": "abc",  # (binary headers as Triton 2.51 forwards them)
                "x-fwd-nul-bin": "",
            }
    finally:
        service.stop()


def test_forward_header_pattern_ignores_case_and_never_makes_reserved_parameters(server):
    # (gRPC metadata names arrive lower-cased; Triton matches them ignoring case)
    service = start_grpc(server, forward_header_pattern="^(X-FWD-.*|PRIORITY|sequence_id)$")
    try:
        with grpcclient.InferenceServerClient(f"127.0.0.1:{service.port}") as c:
            result = c.infer(
                "params_echo",
                [fp32_input("INPUT0", ONES[:1])],
                headers={"x-fwd-user": "alice", "priority": "high", "sequence_id": "42"},
            )
            info = json.loads(result.as_numpy("INFO")[0])
            assert info["parameters"] == {"x-fwd-user": "alice", "priority": "high", "sequence_id": "42"}
            assert (info["correlation_id"], info["flags"]) == (0, 0)
    finally:
        service.stop()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_mutual_tls(server, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    service = start_grpc(
        server,
        use_ssl=True,
        server_cert=str(cert),
        server_key=str(key),
        root_cert=str(cert),
        use_mutual_auth=True,
    )
    url = f"127.0.0.1:{service.port}"
    try:
        with grpcclient.InferenceServerClient(
            url,
            ssl=True,
            root_certificates=str(cert),
            private_key=str(key),
            certificate_chain=str(cert),
        ) as c:
            assert c.is_server_live()
            np.testing.assert_array_equal(
                c.infer("add_sub", add_sub_inputs()).as_numpy("OUTPUT0"), A + 1
            )
        anonymous = grpcclient.InferenceServerClient(url, ssl=True, root_certificates=str(cert))
        plain = grpcclient.InferenceServerClient(url)
        for refused in (anonymous, plain):  # no client certificate; no TLS at all
            with refused, pytest.raises(InferenceServerException):
                refused.is_server_live(client_timeout=5)
    finally:
        service.stop()
    # Without mutual TLS a root certificate has no use: a missing one does not stop the
    # service (nor tritonserver, side by side).
    service = start_grpc(
        server,
        use_ssl=True,
        server_cert=str(cert),
        server_key=str(key),
        root_cert=str(tmp_path / "missing.pem"),
    )
    try:
        with grpcclient.InferenceServerClient(
            f"127.0.0.1:{service.port}", ssl=True, root_certificates=str(cert)
        ) as c:
            assert c.is_server_live()
    finally:
        service.stop()


# -- cancellation ----------------------------------------------------------------------------------
def test_cancelled_calls_leave_the_server_healthy(client, url):
    """Calls whose deadline passes are answered CANCELLED at once; the ones still
    queued never run, nor does the one already sent to the worker behind the running one
    (dropped there, as a queued one is)."""
    before = client.get_inference_statistics("faulty").model_stats[0]
    depth = scheduler.Scheduler.pipeline_depth  # executes handed to one worker at once
    waiting = depth + 2

    async def run():
        async with aioclient.InferenceServerClient(url) as c:
            inputs = [fp32_input("INPUT0", ONES[:2])]
            # executing when its deadline passes
            sleeper = asyncio.ensure_future(
                c.infer("faulty", inputs, parameters={"mode": "sleep:1"}, client_timeout=0.3)
            )
            await asyncio.sleep(0.1)
            behind = [
                asyncio.ensure_future(
                    c.infer("faulty", inputs, parameters={"mode": "ok"}, client_timeout=0.3)
                )
                for _ in range(waiting)
            ]
            for call in (sleeper, *behind):
                with pytest.raises(InferenceServerException) as info:
                    await call
                assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED"

    asyncio.run(run())
    result = faulty(client, "ok")  # waits for the sleeping request, then runs
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [1.0, 1.0])
    after = client.get_inference_statistics("faulty").model_stats[0]
    cancelled = after.inference_stats.fail.count - before.inference_stats.fail.count
    executed = after.execution_count - before.execution_count
    assert cancelled == 1 + waiting
    assert executed == 2  # the sleeper and the last call
    assert client.is_server_live() and client.is_server_ready()
