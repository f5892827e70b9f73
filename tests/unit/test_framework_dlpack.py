"""Zero-copy DLPack hand-offs between dlserve tensors and numpy, torch, jax and
tensorflow, without a server.

Both tensor types are producers: ``dlserve.Tensor`` (what a client gets back) and
``pb_utils.Tensor`` (what a model gets). Every hand-off must be a view: the
consumer's data pointer is the producer's, and a write on one side shows on the
other. Capsules are inspected with ctypes here, independently of dlserve's own
DLPack code. Each framework's tests skip when it is not installed.
"""

from __future__ import annotations

import ctypes
import glob
import os
import uuid

import ml_dtypes
import numpy as np
import pytest

import dlserve
from dlserve import DataType, pb_utils
from dlserve.memory.arena import ALIGNMENT, Arena, MemorySpace

PRODUCERS = ["dlserve.Tensor", "pb_utils.Tensor"]
producers = pytest.mark.parametrize("producer", PRODUCERS)


def produce(producer: str, array: np.ndarray):
    if producer == "dlserve.Tensor":
        return dlserve.Tensor.from_numpy(array)
    return pb_utils.Tensor("x", array)


def address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def aligned(shape, dtype, fill=None) -> np.ndarray:
    """A C-contiguous array whose data is 64-byte aligned (jax copies unaligned buffers,
    and TensorFlow's kernels abort on them); numpy alone only promises 16 bytes."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    start = -address(raw) % ALIGNMENT
    array = raw[start : start + nbytes].view(dtype).reshape(shape)
    assert address(array) % ALIGNMENT == 0
    if fill is not None:
        array[...] = fill
    return array


# -- capsules, read through ctypes --------------------------------------------------------
_GetName = ctypes.pythonapi.PyCapsule_GetName
_GetName.restype = ctypes.c_char_p
_GetName.argtypes = [ctypes.py_object]
_GetPointer = ctypes.pythonapi.PyCapsule_GetPointer
_GetPointer.restype = ctypes.c_void_p
_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
READ_ONLY = 1 << 0


def capsule_name(capsule) -> str:
    return _GetName(capsule).decode()


def capsule_info(capsule) -> dict[str, int]:
    """Data address, flags and DLPack major version of an unconsumed capsule.

    DLManagedTensorVersioned is {version {u32 major, u32 minor}, manager_ctx, deleter,
    u64 flags, DLTensor} (DLTensor at byte 32); a legacy DLManagedTensor starts with its
    DLTensor, whose ``data`` pointer is at byte 0 and ``byte_offset`` at byte 40.
    """
    name = capsule_name(capsule)
    base = _GetPointer(capsule, name.encode())
    if name == "dltensor_versioned":
        major = ctypes.c_uint32.from_address(base).value
        flags = ctypes.c_uint64.from_address(base + 24).value
        tensor = base + 32
    else:
        assert name == "dltensor", name
        major, flags, tensor = 0, 0, base
    data = ctypes.c_void_p.from_address(tensor).value or 0
    byte_offset = ctypes.c_uint64.from_address(tensor + 40).value
    return {"data": data + byte_offset, "flags": flags, "major": major}


# -- frameworks, imported only by the tests that need them --------------------------------
@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def jax():
    module = pytest.importorskip("jax")
    pytest.importorskip("jax.dlpack")
    pytest.importorskip("jax.numpy")
    return module


@pytest.fixture(scope="module")
def tf():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return pytest.importorskip("tensorflow")


def tf_data_ptr(tf, tensor) -> int:
    """TensorFlow has no data-pointer accessor: read it from a fresh DLPack capsule."""
    return capsule_info(tf.experimental.dlpack.to_dlpack(tensor))["data"]


@pytest.fixture
def arena():
    prefix = f"dlserve_{os.getpid()}_unit{uuid.uuid4().hex[:8]}"
    arena = Arena(MemorySpace(), prefix, initial_size=1 << 20, growth_size=1 << 20)
    yield arena
    arena.close()
    assert not glob.glob(f"/dev/shm/{prefix}*")


# -- numpy --------------------------------------------------------------------------------
@producers
def test_numpy_views_the_tensor_memory(producer):
    source = np.arange(16, dtype=np.float32)
    tensor = produce(producer, source)
    view = np.from_dlpack(tensor)
    assert address(view) == address(source)
    assert view.flags.writeable
    view[3] = -1.0  # a write through the consumer ...
    assert source[3] == -1.0
    source[4] = -2.0  # ... and through the producer's array
    assert view[4] == -2.0


@pytest.mark.parametrize(
    "dtype",
    [np.bool_, np.uint8, np.uint16, np.uint32, np.uint64, np.int8, np.int16, np.int32,
     np.int64, np.float16, np.float32, np.float64],
)
@producers
def test_numpy_round_trips_every_fixed_size_dtype(producer, dtype):
    source = (np.arange(12) % 3).astype(dtype).reshape(3, 4)
    view = np.from_dlpack(produce(producer, source))
    assert view.dtype == source.dtype and view.shape == (3, 4)
    assert address(view) == address(source)
    back = dlserve.Tensor.from_dlpack(view)
    assert back.data_type is DataType.from_numpy(dtype) and back.data_ptr == address(source)


def test_numpy_arrays_are_imported_as_views():
    source = np.arange(6, dtype=np.int64).reshape(2, 3)
    tensor = dlserve.Tensor.from_dlpack(source)
    assert tensor.data_type is DataType.INT64 and tensor.shape == (2, 3)
    assert tensor.data_ptr == address(source)
    pb_tensor = pb_utils.Tensor.from_dlpack("y", source)
    assert pb_tensor.name() == "y" and pb_tensor.shape() == [2, 3]
    assert address(pb_tensor.as_numpy()) == address(source)
    source[1, 2] = 99
    assert tensor.as_numpy()[1, 2] == 99 and pb_tensor.as_numpy()[1, 2] == 99


@producers
def test_versioned_and_legacy_capsules(producer):
    source = np.arange(8, dtype=np.float32)
    tensor = produce(producer, source)

    versioned = tensor.__dlpack__(max_version=(1, 0))
    assert capsule_name(versioned) == "dltensor_versioned"
    info = capsule_info(versioned)
    assert info["major"] == 1 and info["data"] == address(source) and info["flags"] == 0

    for legacy in (tensor.__dlpack__(), tensor.__dlpack__(max_version=(0, 8))):
        assert capsule_name(legacy) == "dltensor"
        assert capsule_info(legacy)["data"] == address(source)
    if producer == "pb_utils.Tensor":
        assert capsule_name(tensor.to_dlpack()) == "dltensor"  # what TensorFlow takes

    # Raw capsules of both kinds import as views.
    for capsule in (tensor.__dlpack__(max_version=(1, 0)), tensor.__dlpack__()):
        assert dlserve.Tensor.from_dlpack(capsule).data_ptr == address(source)
    pb_tensor = pb_utils.Tensor.from_dlpack("y", tensor.__dlpack__())
    assert address(pb_tensor.as_numpy()) == address(source)
    assert tensor.__dlpack_device__() == (1, 0)  # kDLCPU


@producers
def test_read_only_arrays_export_the_read_only_flag(producer):
    source = np.arange(8, dtype=np.float32)
    source.flags.writeable = False
    tensor = produce(producer, source)

    capsule = tensor.__dlpack__(max_version=(1, 0))
    assert capsule_info(capsule)["flags"] & READ_ONLY
    view = np.from_dlpack(tensor)
    assert address(view) == address(source)
    assert not view.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        view[0] = 1.0
    # Importing a read-only export keeps it read-only.
    imported = dlserve.Tensor.from_dlpack(tensor.__dlpack__(max_version=(1, 0)))
    assert imported.data_ptr == address(source) and not imported.as_numpy().flags.writeable


@producers
def test_read_only_arrays_export_legacy_capsules_too(producer):
    """A legacy capsule (``to_dlpack()``, what TensorFlow and ``torch.utils.dlpack`` take)
    cannot say read-only; Triton exports read-only memory in one all the same (an array
    over ``bytes``, a jax array), the memory itself, not a copy (but for a response-cache
    hit's: test_response_cache)."""
    source = np.frombuffer(np.arange(8, dtype=np.float32).tobytes(), dtype=np.float32)
    assert not source.flags.writeable
    tensor = produce(producer, source)
    capsules = [tensor.__dlpack__(), tensor.__dlpack__(max_version=(0, 8))]
    if producer == "pb_utils.Tensor":
        capsules.append(tensor.to_dlpack())
    for capsule in capsules:
        assert capsule_name(capsule) == "dltensor"
        assert capsule_info(capsule)["data"] == address(source)
    imported = dlserve.Tensor.from_dlpack(capsules[-1])
    assert imported.data_ptr == address(source) and imported.as_numpy().tolist() == list(range(8))


@producers
def test_writable_arrays_export_no_read_only_flag(producer):
    tensor = produce(producer, np.arange(8, dtype=np.float32))
    assert not capsule_info(tensor.__dlpack__(max_version=(1, 0)))["flags"] & READ_ONLY


@producers
def test_bytes_tensors_cannot_be_exported(producer):
    tensor = produce(producer, np.array([b"abc", b"de"], dtype=np.object_))
    message = "^DLPack does not have support for string tensors\\.$"  # Triton's words, whole
    with pytest.raises(BufferError, match=message):
        tensor.__dlpack__()
    with pytest.raises(BufferError, match=message):
        tensor.__dlpack__(max_version=(1, 0))
    with pytest.raises(BufferError, match=message):
        np.from_dlpack(tensor)
    if producer == "pb_utils.Tensor":  # Triton's API raises its own exception (as 2.51 does)
        with pytest.raises(pb_utils.TritonModelException, match=message):
            tensor.to_dlpack()


def test_arena_blocks_are_aligned_and_handed_out_as_views(arena):
    for nbytes in (1, 4, 100, 4096, 65_536):
        anchor = arena.allocate(nbytes)
        block = np.frombuffer(anchor, dtype=np.uint8)
        assert address(block) % ALIGNMENT == 0
        view = np.from_dlpack(dlserve.Tensor.from_numpy(block))
        assert address(view) == address(block)
        del anchor, block, view


# -- torch --------------------------------------------------------------------------------
@producers
def test_torch_wraps_the_tensor_memory(torch, producer):
    source = np.arange(16, dtype=np.float32)
    tensor = produce(producer, source)
    wrapped = torch.from_dlpack(tensor)
    assert wrapped.data_ptr() == address(source)
    assert wrapped.dtype == torch.float32 and tuple(wrapped.shape) == (16,)
    wrapped[0] = 100.0
    assert source[0] == 100.0
    source[1] = 200.0
    assert wrapped[1].item() == 200.0


@pytest.mark.parametrize(
    "dtype,torch_dtype",
    [(np.bool_, "bool"), (np.uint8, "uint8"), (np.int8, "int8"), (np.int16, "int16"),
     (np.int32, "int32"), (np.int64, "int64"), (np.float16, "float16"), (np.float64, "float64")],
)
def test_torch_sees_each_dtype_as_its_own(torch, dtype, torch_dtype):
    source = (np.arange(8) % 2).astype(dtype)
    wrapped = torch.from_dlpack(dlserve.Tensor.from_numpy(source))
    assert wrapped.dtype == getattr(torch, torch_dtype)
    assert wrapped.data_ptr() == address(source)
    assert wrapped.tolist() == source.tolist()


def test_torch_tensors_are_imported_as_views(torch):
    source = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tensor = dlserve.Tensor.from_dlpack(source)
    assert tensor.data_type is DataType.FP32 and tensor.shape == (3, 4)
    assert tensor.data_ptr == source.data_ptr()
    pb_tensor = pb_utils.Tensor.from_dlpack("OUTPUT0", source)
    assert pb_tensor.triton_dtype() == int(DataType.FP32)
    assert address(pb_tensor.as_numpy()) == source.data_ptr()
    # torch exports writable memory: writes show both ways.
    tensor.as_numpy()[0, 0] = -5.0
    assert source[0, 0].item() == -5.0
    source[2, 3] = 42.0
    assert pb_tensor.as_numpy()[2, 3] == 42.0
    # A capsule from torch's legacy API works too.
    from torch.utils.dlpack import to_dlpack

    assert dlserve.Tensor.from_dlpack(to_dlpack(source)).data_ptr == source.data_ptr()
    # A legacy capsule has no read-only flag: its memory is writable, as in Triton.
    from_capsule = pb_utils.Tensor.from_dlpack("Z", to_dlpack(source)).as_numpy()
    from_capsule[1, 1] = 7.0
    assert source[1, 1].item() == 7.0


def test_a_transposed_tensor_is_refused_in_triton_s_words_not_read_in_the_wrong_order(torch):
    """Upstream dlpack_test's test_non_contiguous_error: a legacy capsule (numpy imports it
    read-only, and dlserve re-exposes it writable) once lost its strides on the way, so the
    transposed tensor passed the contiguity check and read back in storage order."""
    from torch.utils.dlpack import to_dlpack

    transposed = torch.arange(6, dtype=torch.float16).reshape(2, 3).t()
    for handed in (to_dlpack(transposed), transposed):
        with pytest.raises(pb_utils.TritonModelException) as raised:
            pb_utils.Tensor.from_dlpack("test_tensor", handed)
        assert str(raised.value) == (
            "DLPack tensor is not contiguous. Only contiguous DLPack tensors that are stored in C-Order are supported."
        )
    # A legacy capsule of a contiguous tensor still comes in whole and in order.
    contiguous = torch.arange(6, dtype=torch.float16).reshape(3, 2)
    imported = pb_utils.Tensor.from_dlpack("test_tensor", to_dlpack(contiguous)).as_numpy()
    assert imported.tolist() == contiguous.tolist()


def test_torch_bf16_round_trip(torch):
    source = torch.arange(64, dtype=torch.bfloat16) / 4
    tensor = dlserve.Tensor.from_dlpack(source)
    assert tensor.data_type is DataType.BF16 and tensor.data_ptr == source.data_ptr()
    assert tensor.as_numpy().dtype == ml_dtypes.bfloat16
    assert tensor.as_numpy().astype(np.float32).tolist() == source.float().tolist()
    back = torch.from_dlpack(tensor)
    assert back.dtype == torch.bfloat16 and back.data_ptr() == source.data_ptr()

    pb_tensor = pb_utils.Tensor.from_dlpack("b", source)
    assert pb_tensor.triton_dtype() == int(DataType.BF16)
    assert torch.from_dlpack(pb_tensor).data_ptr() == source.data_ptr()


@producers
def test_torch_reads_numpy_bf16_as_bfloat16(torch, producer):
    source = np.arange(8, dtype=np.float32).astype(ml_dtypes.bfloat16)
    wrapped = torch.from_dlpack(produce(producer, source))
    assert wrapped.dtype == torch.bfloat16 and wrapped.data_ptr() == address(source)
    assert wrapped.float().tolist() == list(range(8))


# -- jax ----------------------------------------------------------------------------------
@producers
@pytest.mark.parametrize("importer", ["jax.dlpack.from_dlpack", "jax.numpy.from_dlpack"])
def test_jax_wraps_aligned_tensor_memory(jax, producer, importer):
    from_dlpack = {
        "jax.dlpack.from_dlpack": jax.dlpack.from_dlpack,
        "jax.numpy.from_dlpack": jax.numpy.from_dlpack,
    }[importer]
    source = aligned((4, 16), np.float32, fill=np.arange(64).reshape(4, 16))
    wrapped = from_dlpack(produce(producer, source))
    assert wrapped.unsafe_buffer_pointer() == address(source)
    assert wrapped.dtype == jax.numpy.float32 and wrapped.shape == (4, 16)
    # jax arrays are immutable, but they are views: a write to the source shows.
    source[1, 2] = -7.0
    assert float(wrapped[1, 2]) == -7.0


def test_jax_wraps_arena_blocks(jax, arena):
    anchor = arena.allocate(256 * 4)
    source = np.frombuffer(anchor, dtype=np.float32)
    source[:] = np.arange(256)
    for tensor in (dlserve.Tensor.from_numpy(source), pb_utils.Tensor("x", source)):
        wrapped = jax.dlpack.from_dlpack(tensor)
        assert wrapped.unsafe_buffer_pointer() == address(source)
        assert float(wrapped.sum()) == float(np.arange(256).sum())
    del wrapped, tensor, source, anchor


def test_jax_arrays_are_imported_as_views(jax):
    source = jax.numpy.arange(24, dtype=jax.numpy.int32).reshape(2, 12)
    tensor = dlserve.Tensor.from_dlpack(source)
    assert tensor.data_type is DataType.INT32 and tensor.shape == (2, 12)
    assert tensor.data_ptr == source.unsafe_buffer_pointer()
    assert tensor.as_numpy().tolist() == np.arange(24).reshape(2, 12).tolist()
    pb_tensor = pb_utils.Tensor.from_dlpack("OUTPUT0", source)
    assert address(pb_tensor.as_numpy()) == source.unsafe_buffer_pointer()


def test_jax_bf16_round_trip(jax):
    source = aligned((64,), ml_dtypes.bfloat16, fill=np.arange(64) / 4)
    tensor = dlserve.Tensor.from_numpy(source)
    wrapped = jax.dlpack.from_dlpack(tensor)
    assert wrapped.dtype == jax.numpy.bfloat16
    assert wrapped.unsafe_buffer_pointer() == address(source)
    back = dlserve.Tensor.from_dlpack(wrapped)
    assert back.data_type is DataType.BF16 and back.data_ptr == address(source)
    assert back.as_numpy().dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(back.as_numpy(), source)

    native = jax.numpy.arange(32, dtype=jax.numpy.bfloat16)
    imported = pb_utils.Tensor.from_dlpack("b", native)
    assert imported.triton_dtype() == int(DataType.BF16)
    again = dlserve.Tensor.from_dlpack(imported)  # (pb_utils' as_numpy refuses BF16, as Triton's)
    assert again.data_ptr == native.unsafe_buffer_pointer()
    assert again.as_numpy().astype(np.float32).tolist() == list(range(32))


def test_jax_array_round_trips_through_dlserve_back_to_jax(jax):
    """jax's arrays are read-only, and jax asks for a legacy capsule: exported all the same."""
    source = jax.numpy.arange(64, dtype=jax.numpy.float32)
    tensor = dlserve.Tensor.from_dlpack(source)
    again = jax.dlpack.from_dlpack(tensor)
    assert again.unsafe_buffer_pointer() == source.unsafe_buffer_pointer()


# -- tensorflow ---------------------------------------------------------------------------
def tf_capsule(producer: str, tensor):
    """TensorFlow imports raw capsules: ``to_dlpack()`` of a pb_utils.Tensor (as in
    Triton's documentation), ``__dlpack__()`` of a dlserve.Tensor."""
    return tensor.to_dlpack() if producer == "pb_utils.Tensor" else tensor.__dlpack__()


@producers
def test_tensorflow_wraps_aligned_tensor_memory(tf, producer):
    source = aligned((8, 8), np.float32, fill=np.arange(64).reshape(8, 8))
    wrapped = tf.experimental.dlpack.from_dlpack(tf_capsule(producer, produce(producer, source)))
    assert tf_data_ptr(tf, wrapped) == address(source)
    assert wrapped.dtype == tf.float32 and tuple(wrapped.shape) == (8, 8)
    assert float(tf.reduce_sum(wrapped)) == float(np.arange(64).sum())
    # tf.Tensors are immutable, but this one is a view: a write to the source shows.
    source[3, 3] = 1000.0
    assert wrapped.numpy()[3, 3] == 1000.0


@pytest.mark.parametrize("dtype", ["float32", "int64", "bfloat16"])
def test_tensorflow_tensors_are_imported_as_views(tf, dtype):
    source = tf.cast(tf.reshape(tf.range(12), (3, 4)), getattr(tf, dtype))
    pointer = tf_data_ptr(tf, source)
    tensor = dlserve.Tensor.from_dlpack(tf.experimental.dlpack.to_dlpack(source))
    expected = {"float32": DataType.FP32, "int64": DataType.INT64, "bfloat16": DataType.BF16}[dtype]
    assert tensor.data_type is expected and tensor.shape == (3, 4)
    assert tensor.data_ptr == pointer
    assert tensor.as_numpy().astype(np.float64).tolist() == np.arange(12).reshape(3, 4).tolist()
    pb_tensor = pb_utils.Tensor.from_dlpack("OUTPUT0", tf.experimental.dlpack.to_dlpack(source))
    assert dlserve.Tensor.from_dlpack(pb_tensor).data_ptr == pointer
