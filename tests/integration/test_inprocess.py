"""Triton-style models (importing triton_python_backend_utils) run through the
in-process API: outputs, dtypes, shapes, errors and their codes, parameters,
statistics."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import queue
import re
import threading
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import dlserve
from dlserve import DataType

from ..conftest import serve, wait_until

LOADED = [
    "add_sub",
    "identity",
    "dtypes_echo",
    "bytes_model",
    "faulty",
    "params_echo",
    "reshape",
    "async_model",
    "shm_output",
    "c_utils_user",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    yield from serve(tmp_path_factory, LOADED)


def infer_one(server: dlserve.Server, model: str, **kwargs):
    responses = list(server.model(model).infer(**kwargs))
    assert len(responses) == 1 and responses[0].final
    return responses[0]


def test_server_reports_ready_and_metadata(server):
    assert server.live() and server.ready()
    meta = server.metadata()
    assert meta["name"] == "dlserve" and "statistics" in meta["extensions"]
    models = server.models()
    assert ("add_sub", 1) in models and models[("add_sub", 1)].state == "READY"
    assert server.model("add_sub").ready()


def test_a_response_queue_gets_the_responses_as_tritonserver_gives_them(server):
    """tritonserver's response_queue: each response goes into the caller's queue, as
    the API's InferenceResponse object, and to its own request's iterator too."""
    a = np.arange(16, dtype=np.float32)
    responses: queue.SimpleQueue = queue.SimpleQueue()
    slow = server.model("faulty").infer(
        inputs={"INPUT0": np.ones(1, dtype=np.float32)}, parameters={"mode": "sleep:0.5"},
        request_id="slow", response_queue=responses,
    )
    fast = server.model("add_sub").infer(inputs={"INPUT0": a, "INPUT1": a}, response_queue=responses)
    assert next(slow).request_id == "slow"  # (the first answer in the shared queue is fast's)
    response = next(fast)
    assert isinstance(response, dlserve.InferenceResponse) and response.final
    assert response.model.name == "add_sub" and response.request_id == ""
    np.testing.assert_array_equal(response.outputs["OUTPUT0"].as_numpy(), a + a)
    shared = [responses.get(timeout=10), responses.get(timeout=10)]
    assert [r.request_id for r in shared] == ["", "slow"] and shared[0] is response
    with pytest.raises(dlserve.InvalidArgumentError, match="^queue.SimpleQueue must be used for response iterator$"):
        server.model("add_sub").infer(inputs={"INPUT0": a, "INPUT1": a}, response_queue=queue.Queue())


def test_inputs_made_as_tritonserver_makes_tensors(server):
    a = np.arange(16, dtype=np.float32)
    given = dlserve.Tensor(DataType.FP32, [16], dlserve.MemoryBuffer.from_dlpack(a))
    response = infer_one(server, "add_sub", inputs={"INPUT0": given, "INPUT1": a})
    np.testing.assert_array_equal(np.from_dlpack(response.outputs["OUTPUT0"]), a + a)


def test_async_infer_takes_an_asyncio_response_queue(server):
    a = np.arange(16, dtype=np.float32)

    async def run() -> Any:
        given: asyncio.Queue = asyncio.Queue()
        with pytest.raises(dlserve.InvalidArgumentError, match="^asyncio.Queue must be used for async response iterator$"):
            server.model("add_sub").async_infer(inputs={"INPUT0": a, "INPUT1": a}, response_queue=queue.SimpleQueue())
        mine = server.model("add_sub").async_infer(inputs={"INPUT0": a, "INPUT1": a}, response_queue=given)
        own = await asyncio.wait_for(mine.__anext__(), 10)
        assert await asyncio.wait_for(given.get(), 10) is own and given.empty()
        return own

    response = asyncio.run(run())
    assert isinstance(response, dlserve.InferenceResponse) and response.final
    np.testing.assert_array_equal(response.outputs["OUTPUT1"].as_numpy(), np.zeros(16))


@pytest.mark.parametrize(
    "value,message",
    [(np.zeros(16, np.complex64), "input 'INPUT0': .*complex64"), (object(), "input of type object")],
    ids=["complex", "not an array"],
)
def test_an_input_that_is_no_tensor_is_an_invalid_argument(server, value, message):
    """As tritonserver: an InvalidArgumentError (a complex array's TypeError escaped)."""
    with pytest.raises(dlserve.InvalidArgumentError, match=message):
        server.model("add_sub").infer(inputs={"INPUT0": value, "INPUT1": np.zeros(16, np.float32)})


@pytest.mark.parametrize("where", ["cpu:0", dlserve.MemoryType.CPU_PINNED, (dlserve.MemoryType.CPU, 0),
                                   (dlserve.DLDeviceType.kDLCPU, 0)], ids=str)
def test_output_memory_type_takes_tritonservers_host_forms(server, where):
    a = np.arange(16, dtype=np.float32)
    assert infer_one(server, "add_sub", inputs={"INPUT0": a, "INPUT1": a}, output_memory_type=where).error is None


@pytest.mark.skipif(dlserve.memory.cuda.device_count() > 0, reason="CUDA is here (tests/gpu)")
@pytest.mark.parametrize("where", ["gpu", "cuda:1", dlserve.MemoryType.GPU], ids=str)
def test_a_gpu_output_memory_type_without_cuda_is_refused_before_the_model_runs(server, where):
    a = np.arange(16, dtype=np.float32)
    with pytest.raises(dlserve.InvalidArgumentError, match="needs CUDA: "):
        server.model("add_sub").infer(inputs={"INPUT0": a, "INPUT1": a}, output_memory_type=where)


def test_add_sub(server):
    a = np.arange(16, dtype=np.float32)
    b = np.full(16, 2.0, dtype=np.float32)
    response = infer_one(server, "add_sub", inputs={"INPUT0": a, "INPUT1": b})
    assert response.error is None
    out0 = np.from_dlpack(response.outputs["OUTPUT0"])
    out1 = np.from_dlpack(response.outputs["OUTPUT1"])
    np.testing.assert_array_equal(out0, a + b)
    np.testing.assert_array_equal(out1, a - b)
    assert out0.dtype == np.float32 and out0.shape == (16,)
    assert response.outputs["OUTPUT0"].data_type is DataType.FP32


def test_inputs_as_lists_and_tensors(server):
    tensor = dlserve.Tensor.from_numpy(np.ones(16, dtype=np.float32))
    response = infer_one(server, "identity", inputs={"INPUT0": tensor})
    np.testing.assert_array_equal(response.outputs["OUTPUT0"].as_numpy(), np.ones(16))
    # A list of Python floats becomes FP64, which a FP32 input rejects by name.
    with pytest.raises(dlserve.InvalidArgumentError, match="data-type is 'FP64'"):
        server.model("identity").infer(inputs={"INPUT0": [1.0, 2.0]})


@pytest.mark.parametrize(
    "name,array",
    [
        ("BOOL", np.array([[True, False]])),
        ("UINT8", np.arange(6, dtype=np.uint8).reshape(2, 3)),
        ("UINT16", np.arange(6, dtype=np.uint16).reshape(3, 2)),
        ("UINT32", np.arange(4, dtype=np.uint32).reshape(1, 4)),
        ("UINT64", np.array([[2**63 + 5]], dtype=np.uint64)),
        ("INT8", np.array([[-128, 127]], dtype=np.int8)),
        ("INT16", np.arange(-3, 3, dtype=np.int16).reshape(2, 3)),
        ("INT32", np.arange(-3, 3, dtype=np.int32).reshape(3, 2)),
        ("INT64", np.array([[-(2**62), 2**62]], dtype=np.int64)),
        ("FP16", np.linspace(-1, 1, 6, dtype=np.float16).reshape(2, 3)),
        ("FP32", np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)),
        ("FP64", np.linspace(-1, 1, 6, dtype=np.float64).reshape(2, 3)),
        ("BF16", np.array([[1.5, -2.25, 3.0]], dtype=ml_dtypes.bfloat16)),
    ],
)
def test_every_fixed_size_dtype_round_trips(server, name, array):
    response = infer_one(server, "dtypes_echo", inputs={f"IN_{name}": array})
    out = response.outputs[f"OUT_{name}"]
    assert out.data_type is DataType.from_wire(name)
    assert out.shape == array.shape
    result = out.as_numpy()
    assert result.dtype == array.dtype
    np.testing.assert_array_equal(result, array)


def test_bytes_round_trip(server):
    values = np.array([[b"hello", b""], ["\u00fcn\u00ef".encode(), b"\x00\xff"]], dtype=np.object_)
    response = infer_one(server, "dtypes_echo", inputs={"IN_STRING": values})
    out = response.outputs["OUT_STRING"]
    assert out.data_type is DataType.BYTES and out.shape == (2, 2)
    assert out.to_bytes_array().tolist() == values.tolist()


def test_bytes_model_upper_cases_strings(server):
    response = infer_one(
        server, "bytes_model", inputs={"INPUT0": np.array(["abc", "déf"], dtype=np.str_)}
    )
    assert response.outputs["OUTPUT0"].to_string_array().tolist() == ["ABC", "DéF"]


def test_large_tensor_round_trips_through_shared_memory(server):
    data = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)  # 4 MiB
    response = infer_one(server, "identity", inputs={"INPUT0": data})
    np.testing.assert_array_equal(np.from_dlpack(response.outputs["OUTPUT0"]), data)


def test_tensor_in_shared_memory_reaches_model_and_returns_without_copy(server):
    tensor = server.allocate_tensor([1 << 20], np.float32)
    view = np.from_dlpack(tensor)
    view[:] = np.arange(1 << 20, dtype=np.float32)
    response = infer_one(server, "identity", inputs={"INPUT0": tensor})
    out = response.outputs["OUTPUT0"]
    # Same address: the model read the caller's memory and returned it by reference.
    assert out.data_ptr == tensor.data_ptr
    assert np.from_dlpack(out)[12345] == 12345.0


@pytest.mark.parametrize("shape", [[-1], [3, -2]])
def test_allocating_a_tensor_of_a_negative_shape_says_so_and_allocates_nothing(server, shape):
    used = server.engine.arena.bytes_in_use
    with pytest.raises(dlserve.InvalidArgumentError) as raised:
        server.allocate_tensor(shape, np.float32)
    assert raised.value.message == f"cannot allocate a tensor of shape {shape}: negative dimension"
    assert server.engine.arena.bytes_in_use == used


def test_output_allocated_in_shared_memory_by_the_model(server):
    response = infer_one(server, "shm_output", inputs={"N": np.array([100_000], dtype=np.int64)})
    out = np.from_dlpack(response.outputs["OUTPUT0"])
    np.testing.assert_array_equal(out, np.arange(100_000, dtype=np.float32))
    found = server.engine.space.locate(out)
    assert found is not None, "output should be a view of the worker's shared memory"
    anchor, _ = found
    assert "_w" in anchor.segment.name  # a worker-owned segment, not the server's


class RecordingAllocator(dlserve.MemoryAllocator):
    """tritonserver's example allocator: a numpy array per output; keeps what it gave."""

    def __init__(self, spare: int = 0) -> None:
        self.spare = spare
        self.given: dict[str, tuple[np.ndarray, int, dlserve.MemoryType, int]] = {}

    def allocate(self, size, memory_type, memory_type_id, tensor_name):
        array = np.zeros(max(size + self.spare, 0), dtype=np.uint8)
        self.given[tensor_name] = (array, size, memory_type, memory_type_id)
        return dlserve.MemoryBuffer.from_dlpack(array)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_outputs_go_into_memory_from_the_requests_allocator(server, asynchronous):
    """tritonserver's output_memory_allocator: each output is copied into the buffer the
    allocator gives for it (asked for its size, CPU memory), and stays valid after."""
    allocator = RecordingAllocator()
    a, b = np.arange(16, dtype=np.float32), np.ones(16, dtype=np.float32)
    request = server.model("add_sub").create_request(inputs={"INPUT0": a, "INPUT1": b}, output_memory_allocator=allocator)

    async def collect() -> list[Any]:
        return [r async for r in server.model("add_sub").async_infer(request)]

    (response,) = asyncio.run(collect()) if asynchronous else list(server.model("add_sub").infer(request))
    assert set(allocator.given) == {"OUTPUT0", "OUTPUT1"}
    for name, expected in (("OUTPUT0", a + b), ("OUTPUT1", a - b)):
        array, size, memory_type, device = allocator.given[name]
        assert (size, memory_type, device) == (64, dlserve.MemoryType.CPU, 0)
        out = response.outputs[name]
        assert out.data_ptr == array.ctypes.data  # in the allocator's memory
        np.testing.assert_array_equal(np.from_dlpack(out), expected)
    allocator.given.clear()  # the outputs alone keep their memory alive
    np.testing.assert_array_equal(np.from_dlpack(response.outputs["OUTPUT0"]), a + b)


def test_bytes_outputs_go_into_allocated_memory_too(server):
    allocator = RecordingAllocator()
    values = np.array([[b"hello", b"", b"\x00\xff"]], dtype=np.object_)
    response = infer_one(server, "dtypes_echo", inputs={"IN_STRING": values}, output_memory_allocator=allocator)
    array, size, _, _ = allocator.given["OUT_STRING"]
    assert size == 4 * 3 + 5 + 2  # Triton's encoding: a 4-byte length before each element
    assert response.outputs["OUT_STRING"].data_ptr == array.ctypes.data
    assert response.outputs["OUT_STRING"].to_bytes_array().tolist() == values.tolist()


@pytest.mark.parametrize(
    "allocator,message",
    [
        (RecordingAllocator(spare=-1), "needs 64 bytes, but its destination holds 63"),
        (type("Broken", (dlserve.MemoryAllocator,), {"allocate": lambda *_: 1 / 0})(), "division by zero"),
        (type("Wrong", (dlserve.MemoryAllocator,), {"allocate": lambda *_: b"x" * 64})(), "not a MemoryBuffer"),
    ],
)
def test_an_allocator_that_fails_fails_the_response(server, allocator, message):
    a = np.arange(16, dtype=np.float32)
    response = infer_one(server, "add_sub", inputs={"INPUT0": a, "INPUT1": a}, output_memory_allocator=allocator,
                         raise_on_error=False)
    assert isinstance(response.error, dlserve.InternalError) and message in str(response.error)
    assert not response.outputs
    assert infer_one(server, "add_sub", inputs={"INPUT0": a, "INPUT1": a}).error is None  # the server goes on


class ConfigSizedAllocator(dlserve.MemoryAllocator):
    """Asks the server for the model's config before each buffer, as a user's allocator
    may to size its buffers (that deadlocked the server: allocators ran on the engine's
    loop, and the call waits for it); gives up after 5 s, so that such a server recovers."""

    def __init__(self, model: dlserve.Model) -> None:
        self.model = model
        self.given: list[np.ndarray] = []

    def allocate(self, size, memory_type, memory_type_id, tensor_name):
        configs: list[dict] = []
        asking = threading.Thread(target=lambda: configs.append(self.model.config()), daemon=True)
        asking.start()
        asking.join(5)
        if not configs:
            raise TimeoutError("the server did not answer model.config()")
        self.given.append(np.zeros(size, dtype=np.uint8))
        return dlserve.MemoryBuffer.from_dlpack(self.given[-1])


def test_responses_after_the_allocator_threads_stopped_are_still_handed_out():
    """A response that comes after stop() shut the allocator threads down (its deadline
    passed) is handed out on the thread that brings it, in order: it was lost."""
    from dlserve.engine.request import Response
    from dlserve.engine.server import _InOrder

    pool = concurrent.futures.ThreadPoolExecutor(1)
    pool.shutdown()
    seen: list[str] = []
    deliver = _InOrder(pool, lambda response: seen.append(response.request_id))
    for request_id in ("a", "b"):
        deliver(Response("m", 1, request_id))
    assert seen == ["a", "b"]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_an_allocator_may_call_the_server(servers, make_repo, asynchronous):
    """As tritonserver's, which calls allocators on its own threads: each response of the
    stream, in order, in the memory of an allocator that calls the server for it."""
    server = servers.start(make_repo("decoupled"))
    model = server.model("decoupled")
    allocator = ConfigSizedAllocator(model)
    request = model.create_request(inputs={"IN": np.arange(3, dtype=np.int32)},
                                   output_memory_allocator=allocator)

    async def collect() -> list[Any]:
        return [r async for r in model.async_infer(request)]

    responses = asyncio.run(collect()) if asynchronous else list(model.infer(request))
    assert len(responses) == 4 and responses[-1].final
    outputs = [r.outputs["OUT"] for r in responses[:-1]]  # (the final is flag-only)
    assert [int(out.as_numpy()[0]) for out in outputs] == [0, 1, 2]
    assert [out.data_ptr for out in outputs] == [array.ctypes.data for array in allocator.given]
    assert server.ready()


def test_a_stream_whose_async_caller_loop_closed_is_dropped_quietly(servers, make_repo, caplog):
    """The caller's ``asyncio.run`` ended after the first response: the rest go, with one
    debug line (each was an error traceback: 'Event loop is closed')."""
    server = servers.start(make_repo("decoupled"))
    values = np.arange(4, dtype=np.int32)

    async def first() -> Any:
        async for response in server.model("decoupled").async_infer(
            inputs={"IN": values}, parameters={"mode": "thread", "delay_ms": 50}
        ):
            return response

    with caplog.at_level(logging.DEBUG, logger="dlserve.engine"):
        assert int(asyncio.run(first()).outputs["OUT"].as_numpy()[0]) == 0
        dropped = "async_infer's event loop closed: the responses of request"
        wait_until(lambda: any(dropped in r.getMessage() for r in caplog.records), timeout=10)
    assert [r.getMessage() for r in caplog.records if r.levelno > logging.DEBUG] == []
    assert sum(dropped in r.getMessage() for r in caplog.records) == 1


def test_reshape_applies_to_inputs_and_outputs(server):
    x = np.arange(8, dtype=np.int32).reshape(2, 2, 2)
    response = infer_one(server, "reshape", inputs={"INPUT0": x})
    np.testing.assert_array_equal(response.outputs["SEEN_SHAPE"].as_numpy(), [[2, 4], [2, 4]])
    out = response.outputs["OUTPUT0"]
    assert out.shape == (2, 2, 2)
    np.testing.assert_array_equal(out.as_numpy(), x + 1)


def test_async_execute(server):
    response = infer_one(server, "async_model", inputs={"INPUT0": np.ones(3, dtype=np.float32)})
    np.testing.assert_array_equal(response.outputs["OUTPUT0"].as_numpy(), [3, 3, 3])


def test_requested_outputs_are_pruned(server):
    a = np.zeros(16, dtype=np.float32)
    response = infer_one(
        server, "add_sub", inputs={"INPUT0": a, "INPUT1": a}, requested_output_names=["OUTPUT1"]
    )
    assert list(response.outputs) == ["OUTPUT1"]


def test_request_fields_and_parameters_reach_the_model(server):
    response = infer_one(
        server,
        "params_echo",
        inputs={"INPUT0": np.ones(2, dtype=np.float32)},
        request_id="req-7",
        correlation_id="session-1",
        flags=1,
        timeout=250,
        parameters={"p_int": 5, "p_str": "s", "p_bool": True, "p_float": 1.5},
    )
    info = json.loads(response.outputs["INFO"].to_bytes_array()[0])
    assert info["request_id"] == "req-7"
    assert info["correlation_id"] == "session-1"
    assert info["flags"] == 1
    assert info["timeout"] == 250
    assert info["parameters"] == {"p_int": 5, "p_str": "s", "p_bool": True, "p_float": 1.5}
    assert info["requested_output_names"] == ["INFO", "OUTPUT0"]
    assert info["greeting"] == "hello"
    assert response.request_id == "req-7"
    assert response.parameters == {"echoed": True, "count": 1, "model": "params_echo"}


def test_models_written_against_tritons_c_module_run(server):
    """``import c_python_backend_utils as c_utils``, as user models do: its classes are
    pb_utils' own, and ``shared_memory.free_memory()`` tells the worker's free bytes."""
    response = infer_one(server, "c_utils_user", inputs={"INPUT0": np.arange(3, dtype=np.float32)})
    np.testing.assert_array_equal(response.outputs["OUTPUT0"].as_numpy(), [0, 2, 4])
    free = int(response.outputs["FREE"].as_numpy()[0])
    assert 0 < free <= 16 << 20  # (the worker's arena: shm-default-byte-size, 16 MiB)


def test_initialize_receives_tritons_args(server):
    response = infer_one(server, "params_echo", inputs={"INPUT0": np.ones(1, dtype=np.float32)})
    info = json.loads(response.outputs["INFO"].to_bytes_array()[0])
    assert info["model_dir"] == str(Path(info["args"]["model_repository"]) / "1")  # (Triton's: the version folder)
    args = info["args"]
    assert set(args) == {
        "model_config",
        "model_instance_kind",
        "model_instance_name",
        "model_instance_device_id",
        "model_repository",
        "model_version",
        "model_name",
    }
    assert args["model_instance_kind"] == "CPU"
    assert args["model_instance_name"] == "params_echo_0"
    assert args["model_instance_device_id"] == "0"
    assert args["model_version"] == "1"
    assert args["model_name"] == "params_echo"
    assert Path(args["model_repository"]).name == "params_echo"
    config = json.loads(args["model_config"])
    assert config["name"] == "params_echo" and config["backend"] == "python"
    assert config["parameters"] == {"greeting": {"string_value": "hello"}}


@pytest.mark.parametrize(
    "code,error_type",
    [
        ("NOT_FOUND", dlserve.NotFoundError),
        ("INVALID_ARG", dlserve.InvalidArgumentError),
        ("UNAVAILABLE", dlserve.UnavailableError),
        ("UNSUPPORTED", dlserve.UnsupportedError),
        ("ALREADY_EXISTS", dlserve.AlreadyExistsError),
        ("INTERNAL", dlserve.InternalError),
        ("UNKNOWN", dlserve.UnknownError),
        ("CANCELLED", dlserve.CancelledError),
    ],
)
def test_per_request_error_codes(server, code, error_type):
    inputs = {"INPUT0": np.ones(2, dtype=np.float32)}
    with pytest.raises(error_type, match="custom error"):
        infer_one(server, "faulty", inputs=inputs, parameters={"mode": f"error:{code}"})
    response = list(
        server.model("faulty").infer(
            inputs=inputs, parameters={"mode": f"error:{code}"}, raise_on_error=False
        )
    )[0]
    assert isinstance(response.error, error_type) and response.final


def test_exception_in_execute_is_internal_with_the_python_message(server, caplog):
    with caplog.at_level(logging.ERROR, logger="dlserve"), pytest.raises(dlserve.InternalError) as info:
        infer_one(server, "faulty", inputs={"INPUT0": np.ones(1, dtype=np.float32)}, parameters={"mode": "raise"})
    message = str(info.value)
    assert message.startswith("Failed to process the request(s) for model 'faulty_0', message: ValueError: boom")
    assert "model.py" in message  # the traceback points at the model's code
    # ...and the server's log says so too, as Triton's does, for its operators
    assert message in [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("not_list", "Expected a list in the execute return, found type '<class 'dict'>'."),
        ("wrong_length", "Number of InferenceResponse objects do not match the number of InferenceRequest objects"),
        ("none", "without sending its final response: execute returned None"),
        ("not_response", "Expected an 'InferenceResponse' object in the execute function return list, found type '<class 'str'>'."),
    ],
)
def test_malformed_execute_returns(server, mode, expected):
    with pytest.raises(dlserve.InternalError, match=expected.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        infer_one(server, "faulty", inputs={"INPUT0": np.ones(1, dtype=np.float32)}, parameters={"mode": mode})
    # the instance survives and keeps serving
    ok = infer_one(server, "faulty", inputs={"INPUT0": np.ones(1, dtype=np.float32)})
    assert ok.error is None



NONE_FOR_ONE = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        values = [float(pb_utils.get_input_tensor_by_name(r, "X").as_numpy()[0, 0]) for r in requests]
        return [
            None if v < 0 else pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([[v + 1]], np.float32))])
            for v in values
        ]
"""


def test_a_none_in_executes_list_answers_that_request_alone(servers, make_repo):
    """Triton 2.51 skips a None element (the others get their responses); dlserve did
    the same for none but failed the whole batch. The None's own request is answered
    with Triton's words instead of never (Triton leaves it waiting)."""
    config = (
        'backend: "python"\nmax_batch_size: 4\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        "dynamic_batching { max_queue_delay_microseconds: 2000000 preferred_batch_size: [ 2 ] }\n"
    )
    server = servers.start(make_repo(extra={"none_for_one": {"config.pbtxt": config, "1/model.py": NONE_FOR_ONE}}))
    model = server.model("none_for_one")

    async def both() -> list[Any]:
        async def one(value: float) -> Any:
            return [r async for r in model.async_infer(inputs={"X": np.array([[value]], np.float32)}, raise_on_error=False)]

        return await asyncio.gather(one(-1.0), one(20.0))

    skipped, answered = asyncio.run(both())
    assert np.from_dlpack(answered[0].outputs["Y"]).tolist() == [[21.0]]
    assert answered[0].error is None
    assert isinstance(skipped[0].error, dlserve.InternalError)
    assert "Expected an 'InferenceResponse' object in the execute function return list, found type '<class 'NoneType'>'." in str(skipped[0].error)
    stats = model.statistics()["model_stats"][0]
    assert stats["execution_count"] == 1  # (one execute: the two were one batch)

def test_bad_requests_raise_before_running(server):
    model = server.model("add_sub")
    a = np.zeros(16, dtype=np.float32)
    with pytest.raises(dlserve.InvalidArgumentError, match="data-type is 'INT32', but model 'add_sub' expects 'FP32'"):
        model.infer(inputs={"INPUT0": a.astype(np.int32), "INPUT1": a})
    # with two wrong, the one sent last is named, as Triton 2.51 names it (its QA compares)
    with pytest.raises(dlserve.InvalidArgumentError, match="input 'INPUT1' data-type is 'INT32'"):
        model.infer(inputs={"INPUT0": a.astype(np.int32), "INPUT1": a.astype(np.int32)})
    with pytest.raises(dlserve.InvalidArgumentError, match=r"unexpected shape for input 'INPUT0' for model 'add_sub'. Expected \[16\], got \[2,8\]"):
        model.infer(inputs={"INPUT0": a.reshape(2, 8), "INPUT1": a})
    with pytest.raises(dlserve.InvalidArgumentError, match=r"missing required input\(s\) \['INPUT1'\]"):
        model.infer(inputs={"INPUT0": a})
    with pytest.raises(dlserve.InvalidArgumentError, match="^unexpected inference input 'NOPE' for model 'add_sub'$"):
        model.infer(inputs={"INPUT0": a, "NOPE": a}, request_id="r0")
    # one too many: the count is said first, as Triton 2.51 says it (upstream L0_logging)
    with pytest.raises(dlserve.InvalidArgumentError, match=re.escape(
        "[request id: r0] expected 2 inputs but got 3 inputs for model 'add_sub'. Got input(s) "
        "['NOPE','INPUT1','INPUT0'], but missing required input(s) []."
    )):
        model.infer(inputs={"INPUT0": a, "INPUT1": a, "NOPE": a}, request_id="r0")
    with pytest.raises(dlserve.InvalidArgumentError, match="unexpected inference output 'OUTPUT9'"):
        model.infer(inputs={"INPUT0": a, "INPUT1": a}, requested_output_names=["OUTPUT9"])
    with pytest.raises(dlserve.InvalidArgumentError, match=r"\[request id: r1\] "):
        model.infer(inputs={"INPUT0": a}, request_id="r1")
    with pytest.raises(dlserve.InvalidArgumentError, match="Unsupported Value"):
        model.infer(inputs={"INPUT0": a, "INPUT1": a}, parameters={"bad": [1, 2]})
    with pytest.raises(dlserve.InvalidArgumentError, match="not supported"):
        model.infer(inputs={"INPUT0": object(), "INPUT1": a})
    with pytest.raises(dlserve.NotFoundError, match="Request for unknown model: 'nope' is not found"):
        server.model("nope").infer(inputs={"INPUT0": a})
    with pytest.raises(dlserve.NotFoundError, match="'add_sub' version 7 is not found"):
        server.model("add_sub", 7).infer(inputs={"INPUT0": a, "INPUT1": a})
    assert infer_one(server, "add_sub", inputs={"INPUT0": a, "INPUT1": a}).error is None


COUNT_INPUTS = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("N", np.array([len(r.inputs())], np.int32))])
            for r in requests
        ]
"""


def test_a_request_with_no_inputs_needs_a_model_that_does_not_batch(servers, make_repo):
    """Every input optional, none sent: a model without batching runs it (as Triton 2.51),
    a batching one cannot tell its batch size and refuses it, in Triton 2.51's words
    (side by side; before, dlserve ran it with a batch of 0)."""
    def config(max_batch_size: int) -> str:
        return (
            f'backend: "python"\nmax_batch_size: {max_batch_size}\n'
            'input [ { name: "A" data_type: TYPE_FP32 dims: [ 1 ] optional: true } ]\n'
            'output [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        )

    server = servers.start(make_repo(extra={
        "batching": {"config.pbtxt": config(4), "1/model.py": COUNT_INPUTS},
        "unbatched": {"config.pbtxt": config(0), "1/model.py": COUNT_INPUTS},
    }))
    with pytest.raises(dlserve.InvalidArgumentError, match=re.escape(
        "[request id: r7] out of bounds index 0: request has 0 inputs; model 'batching' batches"
    )):
        server.model("batching").infer(inputs={}, request_id="r7")
    answer = infer_one(server, "unbatched", inputs={})
    assert np.from_dlpack(answer.outputs["N"]).tolist() == [0]
    one = infer_one(server, "batching", inputs={"A": np.ones((1, 1), np.float32)})
    assert np.from_dlpack(one.outputs["N"]).tolist() == [1]


def test_batch_dimension_rules(server):
    model = server.model("reshape")
    with pytest.raises(dlserve.InvalidArgumentError, match="batch-size must be <= 4"):
        model.infer(inputs={"INPUT0": np.zeros((5, 2, 2), dtype=np.int32)})
    with pytest.raises(dlserve.InvalidArgumentError, match="batch-size must be >= 1"):
        model.infer(inputs={"INPUT0": np.zeros((0, 2, 2), dtype=np.int32)})
    with pytest.raises(dlserve.InvalidArgumentError, match="requires a batch dimension"):
        model.infer(inputs={"INPUT0": np.zeros((2, 2), dtype=np.int32)})
    # a first dimension too big is said as a batch too big, dims wrong or not, as Triton says it
    with pytest.raises(dlserve.InvalidArgumentError, match="batch-size must be <= 4"):
        model.infer(inputs={"INPUT0": np.zeros((5, 2), dtype=np.int32)})


def test_async_infer(server):
    async def run() -> list[float]:
        a = np.arange(16, dtype=np.float32)
        results = []
        async for response in server.model("add_sub").async_infer(inputs={"INPUT0": a, "INPUT1": a}):
            results.append(float(np.from_dlpack(response.outputs["OUTPUT0"])[3]))
        return results

    assert asyncio.run(run()) == [6.0]


def test_async_infer_runs_requests_concurrently(server):
    async def run() -> list[int]:
        async def one(i: int) -> int:
            x = np.full(4, i, dtype=np.float32)
            async for response in server.model("identity").async_infer(inputs={"INPUT0": x}):
                return int(response.outputs["OUTPUT0"].as_numpy()[0])
            return -1

        return await asyncio.gather(*(one(i) for i in range(20)))

    assert asyncio.run(run()) == list(range(20))


def test_statistics_follow_tritons_definitions(server):
    before = server.model("add_sub").statistics()["model_stats"][0]
    a = np.zeros(16, dtype=np.float32)
    for _ in range(3):
        infer_one(server, "add_sub", inputs={"INPUT0": a, "INPUT1": a})
    stats = server.model("add_sub").statistics()["model_stats"][0]
    assert stats["name"] == "add_sub" and stats["version"] == "1"
    assert stats["inference_count"] - before["inference_count"] == 3
    assert stats["execution_count"] - before["execution_count"] == 3
    inference = stats["inference_stats"]
    for key in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        assert inference[key]["count"] - before["inference_stats"][key]["count"] == 3, key
        assert inference[key]["ns"] > before["inference_stats"][key]["ns"], key
    assert stats["last_inference"] > 0
    assert stats["batch_stats"][0]["batch_size"] == 1


def test_failures_are_counted(server):
    before = server.model("faulty").statistics()["model_stats"][0]["inference_stats"]["fail"]["count"]
    with pytest.raises(dlserve.InternalError):
        infer_one(server, "faulty", inputs={"INPUT0": np.ones(1, dtype=np.float32)}, parameters={"mode": "raise"})
    after = server.model("faulty").statistics()["model_stats"][0]["inference_stats"]["fail"]["count"]
    assert after == before + 1


def test_model_config_and_metadata(server):
    config = server.model("add_sub").config()
    assert config["name"] == "add_sub" and config["input"][0]["dims"] == [16]
    meta = server.model("reshape").metadata()
    assert meta == {
        "name": "reshape",
        "versions": ["1"],
        "platform": "python",
        "inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [-1, 2, 2]}],
        "outputs": [
            {"name": "OUTPUT0", "datatype": "INT32", "shape": [-1, 2, 2]},
            {"name": "SEEN_SHAPE", "datatype": "INT64", "shape": [-1, 2]},
        ],
    }
    assert server.model("reshape").batch_properties() is dlserve.ModelBatchFlag.FIRST_DIM
    assert server.model("add_sub").batch_properties() is dlserve.ModelBatchFlag.UNKNOWN
    assert server.model("add_sub").transaction_properties() is dlserve.ModelTxnPropertyFlag.ONE_TO_ONE
