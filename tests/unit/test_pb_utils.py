"""dlserve.pb_utils as models see it: ``import triton_python_backend_utils as pb_utils``.

Compared with what the real Triton 2.51 stub exposes (tests/data/triton_reference/
pb_utils_introspection.json) and with tritonclient.utils on the same data.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import sys
import types
import uuid
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tritonclient.utils as tc

import dlserve
import dlserve.pb_utils
import triton_python_backend_utils as pb_utils
from dlserve.memory.arena import Arena, MemorySpace
from dlserve.memory.dtypes import DataType
from dlserve.pb_utils import _runtime

INTROSPECTION = json.loads(
    (Path(__file__).parent.parent / "data" / "triton_reference" / "pb_utils_introspection.json").read_text()
)

# Modules Triton's file happens to import: not part of the API.
NOT_API = {"json", "np", "struct"}

# dir(c_python_backend_utils) in a model on Triton 2.51 (measured), less
# async_event_future_done_callback (its internals).
C_MODULE_NAMES = {
    "COUNTER", "GAUGE", "HISTOGRAM", "InferenceRequest", "InferenceResponse", "InferenceResponseSender",
    "InferenceTrace", "Logger", "MemoryType", "Metric", "MetricFamily", "MetricKind", "PreferredMemory", "ResponseIterator",
    "SharedMemory", "TRITONSERVER_MEMORY_CPU", "TRITONSERVER_MEMORY_GPU", "Tensor", "TritonError",
    "TritonModelException", "is_model_ready", "load_model", "shared_memory", "unload_model",
}


# -- the module ---------------------------------------------------------------------------


def test_triton_module_name_is_dlservs_pb_utils():
    assert pb_utils.Tensor is dlserve.pb_utils.Tensor
    assert pb_utils.InferenceResponse is dlserve.pb_utils.InferenceResponse
    assert set(pb_utils.__all__) == set(dlserve.pb_utils.__all__)
    for name in pb_utils.__all__:
        assert getattr(pb_utils, name) is getattr(dlserve.pb_utils, name)


def test_tritons_c_module_names_are_pb_utils_own():
    """``import c_python_backend_utils as c_utils``: Triton's names, the same objects as
    pb_utils' where pb_utils has them (as in Triton), and free_memory() outside a worker."""
    import c_python_backend_utils as c_utils

    assert set(c_utils.__all__) == C_MODULE_NAMES
    for name in C_MODULE_NAMES & set(pb_utils.__all__):
        assert getattr(c_utils, name) is getattr(pb_utils, name), name
    assert c_utils.shared_memory.free_memory() == 0


@pytest.mark.parametrize("name", sorted(set(INTROSPECTION["pb_utils_attrs"]) - NOT_API))
def test_tritons_attributes_exist(name):
    assert hasattr(pb_utils, name), f"pb_utils.{name} is missing"


def test_the_names_left_out_are_tritons():
    assert NOT_API <= set(INTROSPECTION["pb_utils_attrs"])


def test_triton_error_codes_match():
    for name, value in INTROSPECTION["TritonError_codes"].items():
        assert getattr(pb_utils.TritonError, name) == value
    for name in INTROSPECTION["TritonError_attrs"]:
        assert hasattr(pb_utils.TritonError, name)


def test_tensor_and_response_attributes_match():
    for name in INTROSPECTION["Tensor_attrs"]:
        assert hasattr(pb_utils.Tensor, name), f"Tensor.{name}"
    for name in INTROSPECTION["InferenceResponse_attrs"]:
        assert hasattr(pb_utils.InferenceResponse, name), f"InferenceResponse.{name}"


def test_inference_response_signature_starts_like_tritons():
    # Triton 2.51: InferenceResponse(output_tensors=[], error=None); dlserve adds parameters.
    params = list(inspect.signature(pb_utils.InferenceResponse).parameters)
    assert params[:2] == ["output_tensors", "error"]
    response = pb_utils.InferenceResponse()
    assert response.output_tensors() == [] and not response.has_error() and response.error() is None


def test_constants():
    assert pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START == 1
    assert pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END == 2
    assert pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL == 1
    assert pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL == 1
    assert pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE == 2
    # Triton 2.51's stub (measured): members of its MemoryType, GPU 0 and CPU 1.
    assert pb_utils.TRITONSERVER_MEMORY_CPU == 1 and pb_utils.TRITONSERVER_MEMORY_GPU == 0
    import c_python_backend_utils as c_utils

    assert c_utils.MemoryType(1) is pb_utils.TRITONSERVER_MEMORY_CPU


# -- TritonError ---------------------------------------------------------------------------


def test_triton_error_message_and_default_code():
    err = pb_utils.TritonError("custom")
    assert err.message() == "custom"
    assert err.code() == INTROSPECTION["TritonError_default_code"] == pb_utils.TritonError.INTERNAL == 1


@pytest.mark.parametrize("name", sorted(INTROSPECTION["TritonError_codes"]))
def test_triton_error_with_each_code(name):
    code = getattr(pb_utils.TritonError, name)
    err = pb_utils.TritonError("m", code)
    # An enum member, as Triton's (whose repr is <__ErrorCode.NOT_FOUND: 2>), equal to its int.
    assert err.code() == code == int(code) and err.code().name == name
    assert pb_utils.TritonError("m", int(code)).code() is code
    assert pb_utils.TritonError("m", code=code).code() == code


def test_triton_error_rejects_unknown_codes():
    with pytest.raises(ValueError):
        pb_utils.TritonError("m", 99)


def test_triton_model_exception_is_an_exception():
    with pytest.raises(pb_utils.TritonModelException, match="boom"):
        raise pb_utils.TritonModelException("boom")


# -- Tensor --------------------------------------------------------------------------------


def test_tensor_basics_and_zero_copy():
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = pb_utils.Tensor("OUT", arr)
    assert t.name() == "OUT"
    assert t.shape() == [2, 3]
    assert t.triton_dtype() == 11
    assert t.is_cpu()
    out = t.as_numpy()
    assert out.__array_interface__["data"][0] == arr.__array_interface__["data"][0]
    assert np.from_dlpack(t).tolist() == arr.tolist()
    assert "OUT" in repr(t) and "FP32" in repr(t)


def test_tensor_from_bytes():
    b = pb_utils.Tensor("B", np.array([b"x", b"yz"], dtype=object))
    assert b.triton_dtype() == 13 and b.as_numpy().tolist() == [b"x", b"yz"]


@pytest.mark.parametrize("name, value, match", [
    (5, np.zeros(1), "name must be a str, got int"),
    # (as Triton: a list would choose its own dtype, int64 for an INT32 output)
    ("A", [1, 2, 3], r"takes a numpy.ndarray, got list \(framework tensors: pb_utils.Tensor.from_dlpack\)"),
    ("A", np.int32(3), "takes a numpy.ndarray, got int32"),
])
def test_tensor_arguments_of_the_wrong_type_are_type_errors_as_in_triton(name, value, match):
    with pytest.raises(TypeError, match=match):
        pb_utils.Tensor(name, value)


def test_tensor_rejects_bad_names_and_types():
    with pytest.raises(pb_utils.TritonModelException, match="Tensor 'C'"):
        pb_utils.Tensor("C", np.zeros(2, dtype=np.complex64))
    # Triton's words; an unnamed output used to vanish from the response without a word.
    with pytest.raises(pb_utils.TritonModelException, match="^Tensor name cannot be an empty string.$"):
        pb_utils.Tensor("", np.zeros(1))


def test_an_exception_without_a_message_is_described_as_tritons_are():
    from dlserve.ipc.model_code import describe_exception

    def fail(exc: Exception) -> str:
        try:
            raise exc
        except Exception as caught:  # noqa: BLE001
            return describe_exception(caught).split("\n\nAt:\n")[0]

    assert fail(RuntimeError()) == "RuntimeError: <EMPTY MESSAGE>"
    assert fail(pb_utils.TritonModelException("")) == "TritonModelException: <EMPTY MESSAGE>"
    assert fail(ValueError("boom")) == "ValueError: boom"


def test_tensor_dlpack_round_trip():
    arr = np.arange(4, dtype=np.int32)
    capsule = pb_utils.Tensor("X", arr).to_dlpack()
    assert type(capsule).__name__ == "PyCapsule"
    back = pb_utils.Tensor.from_dlpack("Y", capsule)
    assert back.name() == "Y" and back.as_numpy().tolist() == [0, 1, 2, 3]
    assert back.as_numpy().__array_interface__["data"][0] == arr.__array_interface__["data"][0]
    with pytest.raises(pb_utils.TritonModelException):
        pb_utils.Tensor.from_dlpack("Z", [1, 2])


def test_a_dlpack_capsule_holds_its_tensor_as_triton_s_does():
    """Upstream's BLS QA asserts ``sys.getrefcount(t)`` grows by one with ``to_dlpack()``
    and falls back once the capsule is gone; what imports it takes the reference over."""
    t = pb_utils.Tensor("X", np.arange(6, dtype=np.float32).reshape(2, 3))
    before = sys.getrefcount(t)
    capsule = t.to_dlpack()
    assert sys.getrefcount(t) == before + 1
    del capsule
    assert sys.getrefcount(t) == before
    imported = np.from_dlpack(t)  # (through __dlpack__) a view of the same memory
    assert sys.getrefcount(t) == before + 1
    assert imported.__array_interface__["data"][0] == t.as_numpy().__array_interface__["data"][0]
    assert imported.flags.writeable and imported.tolist() == [[0, 1, 2], [3, 4, 5]]
    del imported
    assert sys.getrefcount(t) == before
    bf16 = pb_utils.Tensor("B", np.array([1.5, -2], dtype=ml_dtypes.bfloat16))
    back = pb_utils.Tensor.from_dlpack("C", bf16.to_dlpack())  # (the bf16 code survives)
    assert back.triton_dtype() == bf16.triton_dtype()
    assert dlserve.Tensor.from_dlpack(back).as_numpy().tolist() == [1.5, -2]
    # numpy has no bfloat16: as Triton's, as_numpy() refuses and points at DLPack
    for tensor in (bf16, back):
        with pytest.raises(pb_utils.TritonModelException) as raised:
            tensor.as_numpy()
        assert str(raised.value) == (
            "Tensor dtype is BF16 and cannot be converted to NumPy. Use to_dlpack() and from_dlpack() instead."
        )


def test_tensor_empty_outside_a_worker_is_a_plain_array():
    t = pb_utils.Tensor.empty("OUT", [2, 5], np.float32)
    out = t.as_numpy()
    assert type(out) is np.ndarray
    assert out.shape == (2, 5) and out.dtype == np.float32
    assert t.shape() == [2, 5] and t.triton_dtype() == 11
    out[:] = 3.0  # filled in place
    assert t.as_numpy().sum() == 30.0
    assert pb_utils.Tensor.empty("I", (3,), DataType.INT8).as_numpy().dtype == np.int8
    bf = pb_utils.Tensor.empty("BF", [4], ml_dtypes.bfloat16)
    assert bf.triton_dtype() == 14 and bf.shape() == [4]  # (filled through DLPack: no numpy bf16)
    view = dlserve.Tensor.from_dlpack(bf).as_numpy()
    assert view.dtype == np.dtype(ml_dtypes.bfloat16) and view.shape == (4,)
    with pytest.raises(pb_utils.TritonModelException, match="cannot allocate BYTES"):
        pb_utils.Tensor.empty("S", [1], np.object_)


@pytest.mark.parametrize("shape", [[-1], [3, -2]])
def test_tensor_empty_of_a_negative_shape_says_so_and_allocates_nothing(shape):
    arena = Arena(MemorySpace(), f"dlserve_{os.getpid()}_unit{uuid.uuid4().hex[:8]}", 1 << 20, 1 << 20)
    try:
        for runtime in (None, types.SimpleNamespace(arena=arena)):  # outside a worker, and in one
            _runtime.install(runtime)
            with pytest.raises(pb_utils.TritonModelException) as raised:
                pb_utils.Tensor.empty("OUT", shape, np.float32)
            assert str(raised.value) == (
                f"Tensor.empty('OUT'): cannot allocate a tensor of shape {shape}: negative dimension"
            )
        assert arena.bytes_in_use == 0
    finally:
        _runtime.install(None)
        arena.close()


def test_tensor_empty_takes_a_triton_data_type_number():
    like = pb_utils.Tensor("X", np.zeros(2, np.int16))
    t = pb_utils.Tensor.empty("OUT", like.shape(), like.triton_dtype())
    assert t.as_numpy().dtype == np.int16 and t.shape() == [2]
    # A numpy integer is a number too (it was read as a numpy dtype: its own type, INT64)
    assert pb_utils.Tensor.empty("OUT", [2], np.int64(11)).triton_dtype() == 11  # (FP32)
    assert pb_utils.Tensor.empty("OUT", [2], np.uint8(12)).as_numpy().dtype == np.float64


DTYPE_ACCEPTED = "dtype must be a numpy dtype such as numpy.float32 or a Triton data type number"


def test_tensor_empty_takes_whole_float_dimensions():
    """As int() took them (a shape computed with np.ceil or /); 2.5 is refused (below)."""
    assert pb_utils.Tensor.empty("OUT", [2.0, np.float64(3)], np.float32).shape() == [2, 3]


@pytest.mark.parametrize(
    "shape, dtype, message",
    [
        ([2], "TYPE_FP32", f"{DTYPE_ACCEPTED} such as triton_dtype() returns, got 'TYPE_FP32' "
         "(config.pbtxt names: pb_utils.triton_string_to_numpy)"),
        ([2], "FP32", f"{DTYPE_ACCEPTED} such as triton_dtype() returns, got 'FP32' "
         "(config.pbtxt names: pb_utils.triton_string_to_numpy)"),
        ([2], None, f"{DTYPE_ACCEPTED} such as triton_dtype() returns, got None"),
        ([2], 99, f"{DTYPE_ACCEPTED} such as triton_dtype() returns, got 99"),
        ([2], 0, f"{DTYPE_ACCEPTED} such as triton_dtype() returns, got 0"),
        ([2], np.int64(99), f"{DTYPE_ACCEPTED} such as triton_dtype() returns, got np.int64(99)"),
        ([2], np.bool_(True), f"{DTYPE_ACCEPTED} such as triton_dtype() returns, got np.True_"),
        ([2], np.float32(11), f"{DTYPE_ACCEPTED} such as triton_dtype() returns, "
         "got np.float32(11.0)"),
        ([2], np.complex64, f"{DTYPE_ACCEPTED} such as triton_dtype() returns, "
         "got <class 'numpy.complex64'>"),
        ([2], object(), DTYPE_ACCEPTED),
        (None, np.float32, "shape must be a sequence of ints, got None"),
        (4, np.float32, "shape must be a sequence of ints, got 4"),
        ([2.5], np.float32, "shape must be a sequence of ints, got [2.5]"),
        (["2"], np.float32, "shape must be a sequence of ints, got ['2']"),
    ],
)
def test_tensor_empty_of_a_wrong_dtype_or_shape_says_what_it_takes(shape, dtype, message):
    arena = Arena(MemorySpace(), f"dlserve_{os.getpid()}_unit{uuid.uuid4().hex[:8]}", 1 << 20, 1 << 20)
    try:
        for runtime in (None, types.SimpleNamespace(arena=arena)):  # outside a worker, and in one
            _runtime.install(runtime)
            with pytest.raises(pb_utils.TritonModelException) as raised:
                pb_utils.Tensor.empty("OUT", shape, dtype)
            assert str(raised.value).startswith(f"Tensor.empty('OUT'): {message}")
        assert arena.bytes_in_use == 0
    finally:
        _runtime.install(None)
        arena.close()


# -- helpers -------------------------------------------------------------------------------


def test_get_tensor_by_name():
    a, b = pb_utils.Tensor("A", np.zeros(1)), pb_utils.Tensor("B", np.ones(1))
    request = pb_utils.InferenceRequest(inputs=[a, b], requested_output_names=["C"], model_name="m")
    assert pb_utils.get_input_tensor_by_name(request, "B") is b
    assert pb_utils.get_input_tensor_by_name(request, "A") is a
    assert pb_utils.get_input_tensor_by_name(request, "Z") is None
    response = pb_utils.InferenceResponse(output_tensors=[b])
    assert pb_utils.get_output_tensor_by_name(response, "B") is b
    assert pb_utils.get_output_tensor_by_name(response, "A") is None


def test_the_lookup_helpers_ask_each_tensor_its_name():
    """As Triton's helpers (plain Python calling ``name()``): a model's unit test may hand
    them stand-in requests whose tensors only answer ``name()``."""

    class StandIn:
        def __init__(self, name):
            self._label = name

        def name(self):
            return self._label

    class Request:
        def inputs(self):
            return [StandIn("A"), StandIn("B")]

    assert pb_utils.get_input_tensor_by_name(Request(), "B").name() == "B"
    assert pb_utils.get_input_tensor_by_name(Request(), "Z") is None


def test_get_config_by_name():
    config = {
        "input": [{"name": "IN0", "data_type": "TYPE_FP32"}, {"name": "IN1", "data_type": "TYPE_INT8"}],
        "output": [{"name": "OUT0", "data_type": "TYPE_STRING"}],
    }
    assert pb_utils.get_input_config_by_name(config, "IN1") == {"name": "IN1", "data_type": "TYPE_INT8"}
    assert pb_utils.get_input_config_by_name(config, "OUT0") is None
    assert pb_utils.get_output_config_by_name(config, "OUT0")["data_type"] == "TYPE_STRING"
    assert pb_utils.get_output_config_by_name(config, "IN0") is None
    assert pb_utils.get_input_config_by_name({}, "IN0") is None


def test_using_decoupled_model_transaction_policy():
    assert pb_utils.using_decoupled_model_transaction_policy({"model_transaction_policy": {"decoupled": True}})
    assert not pb_utils.using_decoupled_model_transaction_policy({"model_transaction_policy": {"decoupled": False}})
    assert not pb_utils.using_decoupled_model_transaction_policy({"model_transaction_policy": {}})
    assert not pb_utils.using_decoupled_model_transaction_policy({})


def test_triton_string_to_numpy():
    expected = {
        "TYPE_BOOL": bool,
        "TYPE_UINT8": np.uint8,
        "TYPE_UINT16": np.uint16,
        "TYPE_UINT32": np.uint32,
        "TYPE_UINT64": np.uint64,
        "TYPE_INT8": np.int8,
        "TYPE_INT16": np.int16,
        "TYPE_INT32": np.int32,
        "TYPE_INT64": np.int64,
        "TYPE_FP16": np.float16,
        "TYPE_FP32": np.float32,
        "TYPE_FP64": np.float64,
        "TYPE_STRING": np.object_,
    }
    assert pb_utils.TRITON_STRING_TO_NUMPY == expected
    for name, np_type in expected.items():
        assert pb_utils.triton_string_to_numpy(name) is np_type
    with pytest.raises(KeyError):
        pb_utils.triton_string_to_numpy("TYPE_BF16")


@pytest.mark.parametrize("dt", [d for d in DataType if d not in (DataType.INVALID, DataType.BF16)], ids=str)
def test_triton_to_numpy_type_agrees_with_tritonclient(dt):
    ours = pb_utils.triton_to_numpy_type(int(dt))
    theirs = tc.triton_to_np_dtype(dt.wire_name)
    assert np.dtype(ours) == np.dtype(theirs)


def test_triton_to_numpy_type_edges():
    assert pb_utils.triton_to_numpy_type(13) is np.object_
    assert pb_utils.triton_to_numpy_type(14) is None  # Triton's helper has no BF16
    assert pb_utils.triton_to_numpy_type(0) is None
    assert pb_utils.triton_to_numpy_type(99) is None


@pytest.mark.parametrize(
    "np_type",
    [bool, np.bool_, np.uint8, np.uint16, np.uint32, np.uint64, np.int8, np.int16, np.int32, np.int64,
     np.float16, np.float32, np.float64, np.object_, np.bytes_, "S4"],
    ids=str,
)
def test_numpy_to_triton_type_agrees_with_tritonclient(np_type):
    theirs = tc.np_to_triton_dtype(np.dtype(np_type))
    assert pb_utils.numpy_to_triton_type(np_type) == int(DataType.from_wire(theirs))


def test_numpy_to_triton_type_edges():
    assert pb_utils.numpy_to_triton_type(np.complex64) is None
    assert pb_utils.numpy_to_triton_type(np.float32) == 11
    # Wider than tritonclient (which returns None): str arrays are accepted as BYTES.
    assert pb_utils.numpy_to_triton_type(np.str_) == 13


BYTES_INPUTS = {
    "bytes": np.array([b"hello", b"", b"\xff\x00"], dtype=object),
    "str": np.array(["héllo", "x"], dtype=object),
    "mixed": np.array([b"a", "b", 3, 1.5], dtype=object),
    "uniform-nul": np.array([b"a\x00", b"b\x00"], dtype=object),
    "2d": np.array([[b"a", b"bb"], [b"ccc", b""]], dtype=object),
    "S": np.array([b"ab", b"c"]),
}


@pytest.mark.parametrize("name", list(BYTES_INPUTS))
def test_serialize_byte_tensor_is_the_python_backends(name):
    """Triton 2.51's Python backend helper returns the encoding as ``bytes`` (side by
    side; tritonclient's wraps the same bytes in a 0-d object array), so a model may
    ``np.frombuffer`` it or write it out."""
    arr = BYTES_INPUTS[name]
    ours = pb_utils.serialize_byte_tensor(arr)
    assert type(ours) is bytes
    assert ours == tc.serialize_byte_tensor(arr).item()
    assert np.frombuffer(ours, dtype=np.uint8).size == len(ours)


@pytest.mark.parametrize("name", list(BYTES_INPUTS))
def test_deserialize_bytes_tensor_matches_tritonclient(name):
    encoded = tc.serialize_byte_tensor(BYTES_INPUTS[name]).item()
    theirs = tc.deserialize_bytes_tensor(encoded)
    for given in (encoded, pb_utils.serialize_byte_tensor(BYTES_INPUTS[name])):
        ours = pb_utils.deserialize_bytes_tensor(given)
        assert ours.dtype == np.object_ and ours.shape == theirs.shape
        assert ours.tolist() == theirs.tolist()


def test_serialize_byte_tensor_edges_are_the_python_backends():
    assert pb_utils.serialize_byte_tensor(np.array([], dtype=object)) == ()
    assert pb_utils.serialize_byte_tensor(np.zeros(3)) is None


# -- InferenceRequest / InferenceResponse --------------------------------------------------


def test_inference_response_holds_outputs_and_errors():
    t = pb_utils.Tensor("OUT", np.zeros(2))
    ok = pb_utils.InferenceResponse(output_tensors=[t])
    assert ok.output_tensors() == [t] and not ok.has_error() and ok.parameters() == "{}"
    err = pb_utils.TritonError("bad", pb_utils.TritonError.INVALID_ARG)
    failed = pb_utils.InferenceResponse(error=err)
    assert failed.has_error() and failed.error() is err
    assert "bad" in repr(failed)


def test_inference_response_parameters():
    params = {"p_int": 5, "p_str": "s", "p_bool": True, "neg": -(2**40)}
    response = pb_utils.InferenceResponse(output_tensors=[], parameters=params)
    assert json.loads(response.parameters()) == params
    assert json.loads(pb_utils.InferenceResponse(parameters='{"a": 1}').parameters()) == {"a": 1}


@pytest.mark.parametrize(
    "outputs,error,match",
    [
        ([np.zeros(2)], None, "output_tensors must be pb_utils.Tensor objects, got ndarray"),
        (["x"], None, "got str"),
        ([], "oops", "error must be a pb_utils.TritonError, got str"),
        ([], ValueError("x"), "got ValueError"),
    ],
    ids=["ndarray", "str", "str-error", "exception-error"],
)
def test_inference_response_rejects_bad_arguments(outputs, error, match):
    with pytest.raises(TypeError, match=match):  # (as Triton's constructor)
        pb_utils.InferenceResponse(output_tensors=outputs, error=error)


def test_an_inference_response_holds_each_output_once():
    a, b = pb_utils.Tensor("A", np.zeros(1)), pb_utils.Tensor("B", np.zeros(1))
    with pytest.raises(pb_utils.TritonModelException, match=r"more than one output tensor named \['A'\]"):
        pb_utils.InferenceResponse(output_tensors=[a, b, pb_utils.Tensor("A", np.ones(2))])


@pytest.mark.parametrize(
    "parameters,match",
    [
        ({"f": 1.5}, r"^Expect parameters values to have type bool/int/str, found type <class 'float'> \(response parameter 'f'\)$"),
        ({"d": {"x": 1}}, "found type <class 'dict'>"),
        ({"l": [1]}, "found type <class 'list'>"),
        ({"n": None}, "found type <class 'NoneType'>"),
        ({1: "x"}, "^Expect parameters keys to have type str, found type <class 'int'>"),
        ([("a", 1)], "^Expect response parameters to be a dict, got <class 'list'>$"),
        (5, "got <class 'int'>"),
    ],
    ids=["float", "dict", "list", "none", "int-key", "list-of-pairs", "int"],
)
def test_inference_response_rejects_bad_parameters(parameters, match):
    with pytest.raises(pb_utils.TritonModelException, match=match):
        pb_utils.InferenceResponse(parameters=parameters)


@pytest.mark.parametrize("parameters", ['{"f": 1.5}', '{"d": {"x": 1}}', "[1, 2]", '"text"', "not json"])
def test_inference_response_validates_parameters_given_as_json(parameters):
    with pytest.raises(pb_utils.TritonModelException):
        pb_utils.InferenceResponse(parameters=parameters)


def test_inference_request_accessors():
    a = pb_utils.Tensor("A", np.zeros(1))
    request = pb_utils.InferenceRequest(
        model_name="m",
        inputs=[a],
        requested_output_names=["OUT"],
        request_id="r1",
        correlation_id=7,
        flags=pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,
        timeout=100,
        parameters={"k": "v"},
    )
    assert request.inputs() == [a]
    assert request.request_id() == "r1"
    assert request.correlation_id() == 7
    assert request.flags() == 1
    assert request.timeout() == 100
    assert json.loads(request.parameters()) == {"k": "v"}
    assert request.requested_output_names() == {"OUT"}  # a set, as Triton's
    request.set_flags(pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END)
    assert request.flags() == 2
    # Triton's order of arguments, inputs, requested_output_names and model_name required
    positional = pb_utils.InferenceRequest("r2", 8, [a], ["OUT"], "m", 3)
    assert (positional.request_id(), positional.correlation_id(), positional.model_version()) == ("r2", 8, 3)
    for missing in ("inputs", "requested_output_names", "model_name"):
        arguments = {"inputs": [a], "requested_output_names": [], "model_name": "m"}
        del arguments[missing]
        with pytest.raises(TypeError, match=f"needs {missing} "):
            pb_utils.InferenceRequest(**arguments)
    required = {"inputs": [], "requested_output_names": [], "model_name": "m"}
    assert pb_utils.InferenceRequest(correlation_id=2**64 - 1, **required).correlation_id() == 2**64 - 1
    for bad in (-5, 2**64):  # Triton's is a uint64 (it raises on -5 too)
        with pytest.raises(pb_utils.TritonModelException, match="unsigned 64-bit"):
            pb_utils.InferenceRequest(correlation_id=bad, **required)
    assert pb_utils.InferenceRequest(**required).parameters() == "{}"
    with pytest.raises(TypeError, match="inputs must be pb_utils.Tensor"):  # (as Triton's constructor)
        pb_utils.InferenceRequest(inputs=[np.zeros(1)], requested_output_names=[], model_name="m")
    with pytest.raises(pb_utils.TritonModelException, match="found type <class .float.>"):
        pb_utils.InferenceRequest(parameters={"f": 0.5}, **required)


# -- ModelConfig (auto_complete_config) ----------------------------------------------------


def model_config(**fields) -> pb_utils.ModelConfig:
    base = {"name": "m", "max_batch_size": 0, "input": [], "output": []}
    base.update(fields)
    return pb_utils.ModelConfig(json.dumps(base))


def test_model_config_from_json_and_defaults():
    config = pb_utils.ModelConfig('{"name": "m"}')
    assert config.as_dict() == {"name": "m", "input": [], "output": [], "max_batch_size": 0}
    as_dict = {"name": "d"}
    assert pb_utils.ModelConfig(as_dict).as_dict()["name"] == "d"


def test_set_max_batch_size():
    config = model_config(max_batch_size=4)
    config.set_max_batch_size(8)
    assert config.as_dict()["max_batch_size"] == 8
    config.set_max_batch_size(8)  # equal is fine
    with pytest.raises(ValueError, match=re.escape(  # Triton's words, as all below
        "configuration specified max_batch_size 8, but in auto-complete-config function for "
        "model 'm' specified max_batch_size 2"
    )):
        config.set_max_batch_size(2)
    assert config.as_dict()["max_batch_size"] == 8


def test_set_dynamic_batching():
    config = model_config()
    config.set_dynamic_batching()
    assert config.as_dict()["dynamic_batching"] == {}
    kept = model_config(dynamic_batching={"max_queue_delay_microseconds": 5})
    kept.set_dynamic_batching()
    assert kept.as_dict()["dynamic_batching"] == {"max_queue_delay_microseconds": 5}
    with pytest.raises(ValueError, match=re.escape(
        "Configuration specified scheduling_choice as 'sequence_batching', but "
        "auto-complete-config function for model 'm' tries to set scheduling_choice as "
        "'dynamic_batching'"
    )):
        model_config(sequence_batching={}).set_dynamic_batching()


def test_add_input_and_output():
    config = model_config()
    config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [4], "optional": True})
    config.add_output({"name": "OUT", "data_type": "TYPE_STRING", "dims": [-1]})
    assert config.as_dict()["input"] == [{"name": "IN", "data_type": "TYPE_FP32", "dims": [4], "optional": True}]
    assert config.as_dict()["output"] == [{"name": "OUT", "data_type": "TYPE_STRING", "dims": [-1]}]


@pytest.mark.parametrize("kind", ["input", "output"])
def test_add_tensor_rejects_unknown_properties(kind):
    add = getattr(model_config(), f"add_{kind}")
    allowed = {
        "input": "'name', 'data_type', 'dims' and 'optional'",
        "output": "'name', 'data_type' and 'dims'",
    }[kind]
    with pytest.raises(ValueError, match=re.escape(
        f"{kind} 'X' in auto-complete-config function for model 'm' contains property other "
        f"than {allowed}."
    )):
        add({"name": "X", "data_type": "TYPE_FP32", "dims": [1], "format": "FORMAT_NONE"})


def test_optional_is_for_inputs_only():
    with pytest.raises(ValueError, match="property other than 'name', 'data_type' and 'dims'"):
        model_config().add_output({"name": "X", "data_type": "TYPE_FP32", "dims": [1], "optional": True})


@pytest.mark.parametrize("missing", ["name", "data_type", "dims"])
@pytest.mark.parametrize("kind", ["input", "output"])
def test_add_tensor_requires_name_type_and_dims(kind, missing):
    tensor = {"name": "X", "data_type": "TYPE_FP32", "dims": [1]}
    del tensor[missing]
    named = "" if missing == "name" else " 'X'"
    with pytest.raises(ValueError, match=re.escape(
        f"{kind}{named} in auto-complete-config function for model 'm' is missing "
        f"'{missing}' property."
    )):
        getattr(model_config(), f"add_{kind}")(tensor)


def test_add_input_conflicts_with_config_pbtxt():
    existing = {"name": "IN", "data_type": "TYPE_FP32", "dims": [4], "optional": False}
    config = model_config(input=[existing])
    with pytest.raises(ValueError, match=re.escape(
        "unable to load model 'm', configuration expects datatype TYPE_FP32 for input 'IN', model "
        "provides TYPE_INT32"
    )):
        config.add_input({"name": "IN", "data_type": "TYPE_INT32", "dims": [4]})
    with pytest.raises(ValueError, match=re.escape(
        "model 'm', tensor 'IN': the model expects dims [8] but the model configuration "
        "specifies dims [4]"
    )):
        config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [8]})
    with pytest.raises(ValueError, match=re.escape(
        "the model expects optional True but the model configuration specifies optional False"
    )):
        config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [4], "optional": True})
    assert config.as_dict()["input"] == [existing]  # untouched by the failures


@pytest.mark.parametrize("dims,shown", [(["4"], "['4']"), ("4", "4"), (4, "4")])
def test_add_input_compares_dims_as_given_as_triton_does(dims, shown):
    """Triton 2.51 (measured): dims the model gives as strings or as one value conflict
    with config.pbtxt's dims even when they would parse to them."""
    config = model_config(input=[{"name": "IN", "data_type": "TYPE_FP32", "dims": [4], "optional": False}])
    with pytest.raises(ValueError, match=re.escape(
        f"the model expects dims {shown} but the model configuration specifies dims [4]"
    )):
        config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": dims})
    config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": (4,)})  # a tuple is a list here


def test_add_output_conflicts_with_config_pbtxt():
    config = model_config(output=[{"name": "OUT", "data_type": "TYPE_FP32", "dims": [2]}])
    with pytest.raises(ValueError, match=re.escape(
        "configuration expects datatype TYPE_FP32 for output 'OUT', model provides TYPE_FP16"
    )):
        config.add_output({"name": "OUT", "data_type": "TYPE_FP16", "dims": [2]})
    with pytest.raises(ValueError, match="dims"):
        config.add_output({"name": "OUT", "data_type": "TYPE_FP32", "dims": [3]})


def test_add_tensor_merges_a_matching_entry():
    config = model_config(
        input=[
            {"name": "IN", "data_type": "TYPE_INVALID", "dims": [], "optional": False, "format": "FORMAT_NONE"},
            {"name": "SAME", "data_type": "TYPE_INT8", "dims": [2], "optional": False},
        ]
    )
    config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [4]})
    config.add_input({"name": "SAME", "data_type": "TYPE_INT8", "dims": [2], "optional": False})
    assert config.as_dict()["input"] == [
        {"name": "IN", "data_type": "TYPE_FP32", "dims": [4], "optional": False, "format": "FORMAT_NONE"},
        {"name": "SAME", "data_type": "TYPE_INT8", "dims": [2], "optional": False},
    ]


def test_set_model_transaction_policy():
    config = model_config()
    config.set_model_transaction_policy({"decoupled": False})
    assert config.as_dict()["model_transaction_policy"] == {"decoupled": False}
    config.set_model_transaction_policy({"decoupled": False})  # same value again is fine
    with pytest.raises(ValueError, match=re.escape(
        "trying to change decoupled property in auto-complete-config for model 'm', which is "
        "already set to 'False'."
    )):
        config.set_model_transaction_policy({"decoupled": True})
    with pytest.raises(ValueError, match=re.escape(
        "model transaction property in auto-complete-config function for model 'm' contains "
        "property other than 'decoupled'."
    )):
        model_config().set_model_transaction_policy({"ordered": True})
    fresh = model_config()
    fresh.set_model_transaction_policy({"decoupled": True})
    assert fresh.as_dict()["model_transaction_policy"] == {"decoupled": True}


# -- Logger --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call,level",
    [
        (lambda m: pb_utils.Logger.log_info(m), logging.INFO),
        (lambda m: pb_utils.Logger.log_warn(m), logging.WARNING),
        (lambda m: pb_utils.Logger.log_error(m), logging.ERROR),
        (lambda m: pb_utils.Logger.log_verbose(m), logging.DEBUG),
        (lambda m: pb_utils.Logger.log(m), logging.INFO),
        (lambda m: pb_utils.Logger.log(m, pb_utils.Logger.WARNING), logging.WARNING),
        (lambda m: pb_utils.Logger.log(m, pb_utils.Logger.ERROR), logging.ERROR),
        (lambda m: pb_utils.Logger.log(m, pb_utils.Logger.VERBOSE), logging.DEBUG),
    ],
    ids=["info", "warn", "error", "verbose", "log", "log-warning", "log-error", "log-verbose"],
)
def test_logger_outside_a_worker_uses_python_logging(caplog, call, level):
    with caplog.at_level(logging.DEBUG, logger="dlserve.model"):
        call("a model line")
    records = [r for r in caplog.records if r.name == "dlserve.model"]
    assert [(r.levelno, r.getMessage()) for r in records] == [(level, "a model line")]


def test_logger_level_values_are_tritons():
    assert (pb_utils.Logger.INFO, pb_utils.Logger.WARNING, pb_utils.Logger.ERROR, pb_utils.Logger.VERBOSE) == (0, 1, 2, 3)


def test_get_model_dir_outside_a_worker_is_the_calling_files_folder():
    assert pb_utils.get_model_dir() == os.path.dirname(os.path.abspath(__file__))


def test_a_metric_whose_family_is_gone_refuses_every_operation():
    """As Triton's (its QA custom_metrics test_metric_lifetime_error); outside a worker
    the metrics live in this process."""
    family = pb_utils.MetricFamily("lifetime_gauge", "a gauge", pb_utils.MetricFamily.GAUGE)
    metric = family.Metric(labels={"k": "v"})
    metric.set(3.0)
    assert metric.value() == 3.0
    del family
    gone = (
        "Invalid metric operation as the corresponding 'MetricFamily' has been deleted. The "
        "'MetricFamily' object should be deleted AFTER its corresponding 'Metric' objects have "
        "been deleted."
    )
    for verb, operation in (
        ("increment", lambda: metric.increment(1.0)),
        ("set", lambda: metric.set(1.0)),
        ("observe", lambda: metric.observe(1.0)),
        ("get", metric.value),
    ):  # (Triton 2.51's words, side by side)
        with pytest.raises(pb_utils.TritonModelException) as raised:
            operation()
        assert str(raised.value) == f"Failed to {verb} metric value: {gone}"


def test_metric_misuse_outside_a_worker_is_refused_in_tritons_words():
    """As in a worker (tests/integration/test_metrics.py, Triton 2.51 side by side), less the
    model instance the refusal names there: outside a worker there is none."""
    counters = pb_utils.MetricFamily("misuse_counter", "c", pb_utils.MetricFamily.COUNTER)
    histograms = pb_utils.MetricFamily("misuse_histogram", "h", pb_utils.MetricFamily.HISTOGRAM)
    counter = counters.Metric()
    for make, message in (
        (
            lambda: counter.increment(-1),
            "Failed to increment metric value: TRITONSERVER_METRIC_KIND_COUNTER can only be "
            "incremented monotonically by non-negative values.",
        ),
        (
            lambda: counter.set(1),
            "Failed to set metric value: TRITONSERVER_METRIC_KIND_COUNTER does not support Set",
        ),
        (lambda: histograms.Metric(), "Failed to create metric. Missing required buckets."),
        (
            lambda: histograms.Metric(buckets=[2.0, 1.0]),
            "Error when creating Metric: Bucket Boundaries must be strictly sorted",
        ),
        (
            lambda: pb_utils.MetricFamily("bad name", "x", pb_utils.MetricFamily.GAUGE),
            "Error when creating MetricFamily: Invalid metric name",
        ),
    ):
        with pytest.raises(pb_utils.TritonModelException) as raised:
            make()
        assert str(raised.value) == message
    with pytest.raises(TypeError, match=r"^increment\(\): incompatible function arguments"):
        counter.increment("1")
    assert counter.value() == 0.0


def test_arguments_triton_checks_first_are_checked_first_in_its_words():
    """As Triton's QA argument_validation model checks them."""
    with pytest.raises(pb_utils.TritonModelException, match="^Input tensor for request with id '' and model name 'm' should not be empty.$"):
        pb_utils.InferenceRequest(inputs=[None], model_name="m", requested_output_names=["o"])
    with pytest.raises(pb_utils.TritonModelException, match="^Output tensor for inference response should not be empty.$"):
        pb_utils.InferenceResponse(output_tensors=[None])
    with pytest.raises(TypeError):  # (None given; left out, it is an empty list)
        pb_utils.InferenceResponse(output_tensors=None)
    assert pb_utils.InferenceResponse().output_tensors() == []
    with pytest.raises(TypeError):  # (the array's type before the name's value)
        pb_utils.Tensor("", None)
    with pytest.raises(pb_utils.TritonModelException, match="^Tensor name cannot be an empty string.$"):
        pb_utils.Tensor("", np.zeros(1))


def test_metric_values_are_written_as_triton_writes_them():
    """Triton 2.51's metrics library: 16 significant digits, "Nan", signed infinities."""
    from dlserve.engine.custom_metrics import sample

    cases = {
        0.1 + 0.2: "0.3", 1e15: "1000000000000000", 1.2345678901234568e17: "1.234567890123457e+17",
        -0.0: "-0", 5e-324: "4.940656458412465e-324", 3: "3", float("nan"): "Nan",
        float("inf"): "+Inf", float("-inf"): "-Inf",
    }
    for value, written in cases.items():
        assert sample("m", (("a", "b"),), value) == f'm{{a="b"}} {written}'


def test_a_process_the_model_forked_names_its_instance_in_errors_that_need_no_server():
    _runtime.install(types.SimpleNamespace(instance_name="m_0"))
    try:
        _runtime.forked()
        error = _runtime.failure("Failed to set metric value", "the reason")
        assert str(error) == (
            "Failed to set metric value: Failed to process the request for model 'm_0', "
            "message: the reason"
        )
        with pytest.raises(pb_utils.TritonModelException, match="cannot reach the server"):
            _runtime.current().request  # noqa: B018 - what needs the server still refuses
    finally:
        _runtime.install(None)
