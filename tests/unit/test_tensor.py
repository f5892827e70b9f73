"""dlserve.Tensor (dlserve.memory.tensor): construction, views without copies, BYTES, DLPack."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import dlserve
from dlserve.errors import InvalidArgumentError, UnsupportedError
from dlserve.memory.dlpack import DLDeviceType, capsule_dtype
from dlserve.memory.dtypes import DataType
from dlserve.memory.tensor import MemoryBuffer, MemoryType, Tensor

NUMERIC = [
    (np.bool_, DataType.BOOL),
    (np.uint8, DataType.UINT8),
    (np.uint16, DataType.UINT16),
    (np.uint32, DataType.UINT32),
    (np.uint64, DataType.UINT64),
    (np.int8, DataType.INT8),
    (np.int16, DataType.INT16),
    (np.int32, DataType.INT32),
    (np.int64, DataType.INT64),
    (np.float16, DataType.FP16),
    (np.float32, DataType.FP32),
    (np.float64, DataType.FP64),
]


def ptr(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def test_is_the_public_tensor():
    assert dlserve.Tensor is Tensor


# -- from_numpy ----------------------------------------------------------------------------


@pytest.mark.parametrize("np_type,dt", NUMERIC, ids=lambda v: str(v))
def test_from_numpy_every_fixed_type_is_a_view(np_type, dt):
    arr = (np.arange(12) % 2).astype(np_type).reshape(3, 4)
    t = Tensor.from_numpy(arr)
    assert t.data_type is dt
    assert t.shape == (3, 4)
    assert t.element_count == 12
    out = t.as_numpy()
    assert out.dtype == np.dtype(np_type)
    assert ptr(out) == ptr(arr)  # no copy
    assert t.data_ptr == ptr(arr)
    assert t.size == 12 * dt.itemsize
    t.check_size()


def test_from_numpy_bf16_is_stored_as_uint16_and_viewed_as_bfloat16():
    arr = np.array([[1.5, -2.0], [0.25, 3.0]], dtype=ml_dtypes.bfloat16)
    t = Tensor.from_numpy(arr)
    assert t.data_type is DataType.BF16
    assert t.storage().dtype == np.uint16
    assert t.storage().tolist() == arr.view(np.uint16).tolist()
    view = t.as_numpy()
    assert view.dtype == np.dtype(ml_dtypes.bfloat16)
    assert view.shape == (2, 2)
    assert ptr(view) == ptr(arr)
    assert view.astype(np.float32).tolist() == [[1.5, -2.0], [0.25, 3.0]]
    t.check_size()


def test_from_numpy_copies_only_non_contiguous_input():
    arr = np.arange(12, dtype=np.int32).reshape(3, 4)
    t = Tensor.from_numpy(arr.T)
    assert t.shape == (4, 3)
    assert t.storage().flags.c_contiguous
    assert t.as_numpy().tolist() == arr.T.tolist()
    assert ptr(t.as_numpy()) != ptr(arr)


def test_from_numpy_zero_dim_and_empty():
    scalar = Tensor.from_numpy(np.array(5.0, dtype=np.float32))
    assert scalar.shape == () and scalar.element_count == 1 and scalar.size == 4
    empty = Tensor.from_numpy(np.zeros((0, 3), dtype=np.int64))
    assert empty.shape == (0, 3) and empty.element_count == 0 and empty.size == 0
    empty.check_size()


def test_from_numpy_rejects_types_triton_lacks():
    with pytest.raises(TypeError, match="complex64"):
        Tensor.from_numpy(np.zeros(2, dtype=np.complex64))


@pytest.mark.parametrize(
    "arr",
    [
        np.array([b"ab", b"c"], dtype=object),
        np.array([b"ab", b"c"]),
        np.array(["ab", "c"]),
    ],
    ids=["object", "S", "U"],
)
def test_from_numpy_text_arrays_are_bytes(arr):
    t = Tensor.from_numpy(arr)
    assert t.data_type is DataType.BYTES
    assert t.shape == (2,)
    assert t.storage().tobytes() == b"\x02\x00\x00\x00ab\x01\x00\x00\x00c"
    assert t.size == 11


# -- from_object ---------------------------------------------------------------------------


def test_from_object_returns_a_tensor_unchanged():
    t = Tensor.from_numpy(np.zeros(2, dtype=np.float32))
    assert Tensor.from_object(t) is t


def test_from_object_ndarray_is_a_view():
    arr = np.arange(6, dtype=np.int16)
    t = Tensor.from_object(arr)
    assert t.data_type is DataType.INT16 and ptr(t.as_numpy()) == ptr(arr)


@pytest.mark.parametrize(
    "scalar,dt",
    [(np.float32(2.5), DataType.FP32), (np.int8(-3), DataType.INT8), (np.bool_(True), DataType.BOOL)],
    ids=str,
)
def test_from_object_numpy_scalar(scalar, dt):
    t = Tensor.from_object(scalar)
    assert t.data_type is dt and t.shape == ()
    assert t.as_numpy().item() == scalar.item()


@pytest.mark.parametrize(
    "value,dt,shape",
    [
        ([1, 2, 3], DataType.INT64, (3,)),
        ([[1.0], [2.0]], DataType.FP64, (2, 1)),
        ([True, False], DataType.BOOL, (2,)),
        (["a", "bc"], DataType.BYTES, (2,)),
        ([b"a", b"bc"], DataType.BYTES, (2,)),
    ],
    ids=str,
)
def test_from_object_list(value, dt, shape):
    t = Tensor.from_object(value)
    assert t.data_type is dt and t.shape == shape


@pytest.mark.parametrize("value", [[[1], [1, 2]], [1j, 2j]], ids=["ragged", "complex"])
def test_from_object_bad_list(value):
    with pytest.raises(InvalidArgumentError, match="cannot convert list to a tensor"):
        Tensor.from_object(value)


@pytest.mark.parametrize("value", [{"a": 1}, 3, 2.5, "text", b"bytes", (1, 2), None, object()], ids=repr)
def test_from_object_unsupported_types(value):
    with pytest.raises(InvalidArgumentError, match=f"input of type {type(value).__name__} is not supported"):
        Tensor.from_object(value)


class Producer:
    """A minimal DLPack producer wrapping a numpy array."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def test_from_object_dlpack_producer_is_a_view():
    arr = np.arange(8, dtype=np.float64).reshape(2, 4)
    t = Tensor.from_object(Producer(arr))
    assert t.data_type is DataType.FP64 and t.shape == (2, 4)
    assert ptr(t.as_numpy()) == ptr(arr)
    arr[0, 0] = 42
    assert t.as_numpy()[0, 0] == 42


def test_from_object_torch_tensors():
    torch = pytest.importorskip("torch")
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    t = Tensor.from_object(x)
    assert t.data_type is DataType.FP32 and t.shape == (2, 3)
    assert t.data_ptr == x.data_ptr()
    bf = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    tb = Tensor.from_object(bf)
    assert tb.data_type is DataType.BF16
    assert tb.as_numpy().dtype == np.dtype(ml_dtypes.bfloat16)
    assert tb.as_numpy().astype(np.float32).tolist() == [1.5, -2.0]
    assert tb.data_ptr == bf.data_ptr()
    with pytest.raises(InvalidArgumentError, match="DLPack tensor is not contiguous"):
        Tensor.from_object(x.t())
    with pytest.raises(InvalidArgumentError, match="no Triton data type"):
        Tensor.from_object(torch.zeros(2, dtype=torch.complex64))


NO_CUDA = dlserve.memory.cuda.cuda_problem() is not None


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA (tests/gpu covers GPU tensors)")
def test_from_dlpack_of_a_cuda_tensor_without_cuda_says_what_is_missing():
    class OnGpu(Producer):
        def __dlpack_device__(self):
            return (int(DLDeviceType.kDLCUDA), 0)

    with pytest.raises(UnsupportedError, match="GPU tensors need CUDA: "):
        Tensor.from_object(OnGpu(np.zeros(2)))


def test_from_dlpack_of_another_device_is_unsupported():
    class OnRocm(Producer):
        def __dlpack_device__(self):
            return (int(DLDeviceType.kDLROCM), 0)

    with pytest.raises(UnsupportedError, match="kDLROCM are not supported"):
        Tensor.from_object(OnRocm(np.zeros(2)))


# -- BYTES ---------------------------------------------------------------------------------


def test_bytes_from_shared_encoding_decodes_to_bytes_objects():
    encoded = np.frombuffer(b"\x01\x00\x00\x00a\x02\x00\x00\x00\xc3\xa9\x00\x00\x00\x00\x01\x00\x00\x00z", np.uint8)
    t = Tensor(DataType.BYTES, (2, 2), data=encoded)
    t.check_size()
    arr = t.to_bytes_array()
    assert arr.dtype == np.object_ and arr.shape == (2, 2)
    assert arr.tolist() == [[b"a", "é".encode()], [b"", b"z"]]
    assert t.as_numpy() is arr  # decoded once
    s = t.to_string_array()
    assert s.dtype.kind == "U" and s.tolist() == [["a", "é"], ["", "z"]]
    assert t.storage() is encoded  # the encoding is not rebuilt


def test_bytes_from_objects_encodes_on_demand():
    arr = np.array([[b"ab", b"c"], [b"", b"\xff"]], dtype=object)
    t = Tensor.from_numpy(arr)
    assert t.to_bytes_array() is arr  # kept as given until the bytes must be shared
    assert t.storage().tobytes() == b"\x02\x00\x00\x00ab\x01\x00\x00\x00c\x00\x00\x00\x00\x01\x00\x00\x00\xff"
    assert t.size == 4 * 4 + 4
    assert t.memory_buffer.size == t.size


def test_to_string_array_is_utf8():
    t = Tensor.from_numpy(np.array(["héllo", "日本"], dtype=object))
    assert t.to_string_array().tolist() == ["héllo", "日本"]
    t = Tensor.from_bytes_array([b"caf\xc3\xa9", b"x"])
    assert t.to_string_array().tolist() == ["café", "x"]
    t = Tensor(DataType.BYTES, (1,), data=np.frombuffer(b"\x01\x00\x00\x00\xff", np.uint8))
    with pytest.raises(UnicodeDecodeError):
        t.to_string_array()


def test_from_bytes_array():
    t = Tensor.from_bytes_array([b"a", "b"])
    assert t.data_type is DataType.BYTES and t.shape == (2,)
    assert t.storage().tobytes() == b"\x01\x00\x00\x00a\x01\x00\x00\x00b"
    assert Tensor.from_string_array(np.array(["x"])).data_type is DataType.BYTES
    # bytes back, whatever went in (as tritonserver: str as UTF-8, other items as their str)
    assert t.to_bytes_array().tolist() == [b"a", b"b"]
    assert Tensor.from_string_array(["héllo", "b"]).to_bytes_array().tolist() == ["héllo".encode(), b"b"]
    assert Tensor.from_string_array(np.array(["ab", "c"])).to_bytes_array().tolist() == [b"ab", b"c"]
    assert Tensor.from_bytes_array(np.array([[1], [2]], dtype=object)).to_bytes_array().tolist() == [[b"1"], [b"2"]]
    with pytest.raises(InvalidArgumentError, match="cannot make a BYTES tensor from a float64"):
        Tensor.from_bytes_array(np.zeros(2))


def test_bytes_views_of_non_bytes_tensors_are_rejected():
    t = Tensor.from_numpy(np.zeros(2, dtype=np.float32))
    with pytest.raises(InvalidArgumentError, match="tensor is FP32, not BYTES"):
        t.to_bytes_array()
    with pytest.raises(InvalidArgumentError, match="not BYTES"):
        t.to_string_array()


def test_malformed_bytes_encoding_is_invalid_argument():
    t = Tensor(DataType.BYTES, (3,), data=np.frombuffer(b"\x01\x00\x00\x00a", np.uint8))
    with pytest.raises(InvalidArgumentError, match="malformed BYTES tensor: BYTES data holds 1 elements, expected 3"):
        t.to_bytes_array()
    t = Tensor(DataType.BYTES, (1,), data=np.frombuffer(b"\x09\x00\x00\x00a", np.uint8))
    with pytest.raises(InvalidArgumentError, match="malformed BYTES tensor"):
        t.as_numpy()


def test_bytes_tensors_have_no_dlpack_form():
    t = Tensor.from_numpy(np.array([b"a"], dtype=object))
    with pytest.raises(BufferError, match="DLPack does not have support for string tensors"):
        t.__dlpack__()
    with pytest.raises(BufferError):
        np.from_dlpack(t)


# -- check_size ----------------------------------------------------------------------------


def test_check_size_fixed_types():
    t = Tensor(DataType.FP32, [2, 2], data=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"byte size mismatch: shape \[2, 2\] of FP32 needs 16 bytes, got 12"):
        t.check_size()
    Tensor(DataType.FP32, [3], data=np.zeros(3, np.float32)).check_size()
    Tensor(DataType.BF16, [2], data=np.zeros(2, np.uint16)).check_size()
    with pytest.raises(ValueError, match="BF16 needs 6 bytes, got 4"):
        Tensor(DataType.BF16, [3], data=np.zeros(2, np.uint16)).check_size()


def test_check_size_bytes_counts_elements():
    encoded = np.frombuffer(b"\x01\x00\x00\x00a\x01\x00\x00\x00b", np.uint8)
    Tensor(DataType.BYTES, [2], data=encoded).check_size()
    with pytest.raises(ValueError, match=r"holds 2 BYTES elements, but its shape \[3\] needs 3"):
        Tensor(DataType.BYTES, [3], data=encoded).check_size()
    with pytest.raises(ValueError, match=r"ends inside an element of 1 bytes \(0 bytes left\)"):
        Tensor(DataType.BYTES, [2], data=encoded[:-1]).check_size()


def test_tensor_needs_data_or_objects():
    with pytest.raises(ValueError, match="needs storage data, BYTES objects or a device array"):
        Tensor(DataType.FP32, [1])


def test_constructor_normalises_type_and_shape():
    t = Tensor(11, [np.int64(2), 3], data=np.zeros(6, np.float32))
    assert t.data_type is DataType.FP32
    assert t.shape == (2, 3) and all(type(d) is int for d in t.shape)


# -- reshape -------------------------------------------------------------------------------


def test_reshape_is_a_view():
    arr = np.arange(6, dtype=np.int32)
    t = Tensor.from_numpy(arr)
    r = t.reshape([2, 3])
    assert r.shape == (2, 3) and r.data_type is DataType.INT32
    assert r.as_numpy().shape == (2, 3)
    assert ptr(r.as_numpy()) == ptr(arr)
    with pytest.raises(ValueError):
        t.reshape([4])


def test_reshape_bytes():
    t = Tensor.from_numpy(np.array([b"a", b"b", b"c", b"d"], dtype=object))
    r = t.reshape((2, 2))
    assert r.shape == (2, 2) and r.to_bytes_array().tolist() == [[b"a", b"b"], [b"c", b"d"]]
    encoded = Tensor(DataType.BYTES, (4,), data=t.storage())
    r2 = encoded.reshape([1, 4])
    assert r2.shape == (1, 4)
    assert r2.storage() is encoded.storage()
    assert r2.to_bytes_array().tolist() == [[b"a", b"b", b"c", b"d"]]


# -- DLPack --------------------------------------------------------------------------------


def test_dlpack_export_is_zero_copy():
    arr = np.arange(10, dtype=np.float32)
    t = Tensor.from_numpy(arr)
    assert t.__dlpack_device__() == (int(DLDeviceType.kDLCPU), 0)
    out = np.from_dlpack(t)
    assert ptr(out) == ptr(arr) and out.tolist() == arr.tolist()


def test_dlpack_capsule_dtypes():
    t = Tensor.from_numpy(np.zeros(3, dtype=np.int16))
    assert capsule_dtype(t.__dlpack__()) == (0, 16, 1)
    bf = Tensor.from_numpy(np.zeros(3, dtype=ml_dtypes.bfloat16))
    assert capsule_dtype(bf.__dlpack__()) == (4, 16, 1)  # kDLBfloat, not uint16
    assert capsule_dtype(bf.__dlpack__(max_version=(1, 0))) == (4, 16, 1)


def test_dlpack_rejects_streams_and_other_devices():
    t = Tensor.from_numpy(np.zeros(3, dtype=np.float32))
    with pytest.raises(BufferError, match="takes no stream"):
        t.__dlpack__(stream=1)
    with pytest.raises(BufferError, match="cannot export a CPU tensor to device"):
        t.__dlpack__(dl_device=(int(DLDeviceType.kDLCUDA), 0))
    t.__dlpack__(stream=None, dl_device=(int(DLDeviceType.kDLCPU), 0))


def test_dlpack_to_torch_including_bf16():
    torch = pytest.importorskip("torch")
    arr = np.arange(4, dtype=np.int64)
    x = torch.from_dlpack(Tensor.from_numpy(arr))
    assert x.dtype == torch.int64 and x.data_ptr() == ptr(arr)
    bf = np.array([1.5, 2.0], dtype=ml_dtypes.bfloat16)
    y = torch.from_dlpack(Tensor.from_numpy(bf))
    assert y.dtype == torch.bfloat16 and y.data_ptr() == ptr(bf)
    assert y.float().tolist() == [1.5, 2.0]


# -- buffers and devices -------------------------------------------------------------------


def test_memory_buffer_fields():
    arr = np.arange(6, dtype=np.float64)
    t = Tensor.from_numpy(arr)
    buf = t.memory_buffer
    assert isinstance(buf, MemoryBuffer)
    assert buf.data_ptr == ptr(arr)
    assert buf.memory_type is MemoryType.CPU
    assert buf.memory_type_id == 0
    assert buf.size == 48
    assert buf.owner is arr
    assert (t.memory_type, t.memory_type_id) == (MemoryType.CPU, 0)
    assert (int(MemoryType.CPU), int(MemoryType.CPU_PINNED), int(MemoryType.GPU)) == (0, 1, 2)


@pytest.mark.parametrize(
    "device",
    ["cpu", "CPU", "cpu:0", MemoryType.CPU, MemoryType.CPU_PINNED, (MemoryType.CPU, 0), (DLDeviceType.kDLCPU, 0),
     DLDeviceType.kDLCUDAHost],
    ids=str,
)  # (the forms tritonserver's parse_device_or_memory_type takes)
def test_to_device_cpu_returns_self(device):
    t = Tensor.from_numpy(np.zeros(2, dtype=np.float32))
    assert t.to_device(device) is t
    assert t.to_host() is t


@pytest.mark.parametrize("device", ["gpu", "cuda", "cuda:0", MemoryType.GPU, (MemoryType.GPU, 0)], ids=str)
@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA (tests/gpu covers GPU tensors)")
def test_to_device_gpu_without_cuda_says_what_is_missing(device):
    t = Tensor.from_numpy(np.zeros(2, dtype=np.float32))
    with pytest.raises(UnsupportedError, match="GPU tensors need CUDA: "):
        t.to_device(device)


@pytest.mark.parametrize("device", ["bogus", "cpu:x", 7, (DLDeviceType.kDLOpenCL, 0), object()], ids=str)
def test_to_device_refuses_what_names_no_memory(device):
    t = Tensor.from_numpy(np.zeros(2, dtype=np.float32))
    with pytest.raises(InvalidArgumentError, match="unsupported memory type or device"):
        t.to_device(device)


def test_repr():
    assert repr(Tensor.from_numpy(np.zeros((2, 3), np.uint8))) == "Tensor(data_type=UINT8, shape=[2, 3])"


# -- MemoryBuffer (an output memory allocator's) -------------------------------------------
def test_memory_buffer_from_dlpack_keeps_the_memory_alive_and_views_it():
    array = np.arange(64, dtype=np.uint8)
    buffer = MemoryBuffer.from_dlpack(array)
    assert (buffer.data_ptr, buffer.size, buffer.memory_type) == (array.ctypes.data, 64, MemoryType.CPU)
    view = buffer.host_view()
    view[:4] = 9
    assert array[:4].tolist() == [9, 9, 9, 9]  # the same memory
    # A raw capsule: the memory must outlive the capsule's source (it used to be freed).
    capsule = np.full(1 << 20, 7, dtype=np.uint8).__dlpack__(max_version=(1, 0))
    assert MemoryBuffer.from_dlpack(capsule).host_view()[-1] == 7
    # (a legacy capsule cannot say whether its memory may be written: one handed over
    # raw is taken as writable, as Triton takes it; numpy 2 alone takes it as read-only)
    source = np.full(16, 7, dtype=np.uint8)
    legacy = MemoryBuffer.from_dlpack(source.__dlpack__())
    legacy.host_view()[-1] = 8
    assert source[-1] == 8


def test_memory_buffer_of_read_only_memory_is_never_written():
    read_only = np.zeros(16, dtype=np.uint8)
    read_only.flags.writeable = False
    immutable = np.frombuffer(b"\0" * 16, dtype=np.uint8)
    for array in (read_only, immutable):
        with pytest.raises(InvalidArgumentError, match="read-only"):
            MemoryBuffer.from_dlpack(array).host_view()
    assert not read_only.any() and not immutable.any()


def test_a_tensor_made_as_tritonserver_makes_one_views_its_memory_buffer():
    """tritonserver's ``Tensor(data_type, shape, memory_buffer)``."""
    source = np.arange(6, dtype=np.float32)
    tensor = Tensor(DataType.FP32, [2, 3], MemoryBuffer.from_dlpack(source))
    assert tensor.data_ptr == source.ctypes.data and tensor.shape == (2, 3)
    assert np.from_dlpack(tensor).tolist() == [[0, 1, 2], [3, 4, 5]]
    read_only = np.frombuffer(Tensor.from_bytes_array([b"ab", b"c"]).storage().tobytes(), dtype=np.uint8)
    strings = Tensor(DataType.BYTES, [2], MemoryBuffer.from_dlpack(read_only))
    assert strings.to_bytes_array().tolist() == [b"ab", b"c"]
    with pytest.raises(InvalidArgumentError, match="holds 24 bytes, but FP32 \\[4\\] needs 16"):
        Tensor(DataType.FP32, [4], MemoryBuffer.from_dlpack(source))
    with pytest.raises(InvalidArgumentError, match="must be a MemoryBuffer, not list"):
        Tensor(DataType.FP32, [4], [1.0, 2.0, 3.0, 4.0])


def test_memory_buffer_of_what_has_no_dlpack_is_an_invalid_argument():
    with pytest.raises(InvalidArgumentError, match="list does not implement the DLPack protocol"):
        MemoryBuffer.from_dlpack([1, 2])


def test_tritonservers_default_allocator_keyword_buffer_and_a_new_shape():
    """As Triton's own in-process API tests use them (L0_python_api / core test_api.py)."""
    buffer = dlserve.default_memory_allocators[MemoryType.CPU].allocate(
        memory_type=MemoryType.CPU, memory_type_id=0, size=32
    )
    assert isinstance(buffer.owner, np.ndarray) and buffer.size == 32
    tensor = dlserve.Tensor(DataType.FP32, shape=[8], memory_buffer=buffer)
    np.from_dlpack(tensor)[:] = np.arange(8, dtype=np.float32)  # (writes land in the buffer)
    tensor.shape = [2, 4]  # (tritonserver's Tensor is a dataclass: its shape may be set)
    assert np.from_dlpack(tensor).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert tensor.as_numpy().shape == (2, 4)
    tensor.shape = [3, 3]
    with pytest.raises(InvalidArgumentError, match=r"tensor shape \[3, 3\] does not fit its 8 elements"):
        np.from_dlpack(tensor)
    with pytest.raises(UnsupportedError):
        dlserve.default_memory_allocators[MemoryType.CPU].allocate(32, MemoryType.GPU, 0, "x")
