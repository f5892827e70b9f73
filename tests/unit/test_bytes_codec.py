"""dlserve.memory.bytes_codec: Triton's BYTES encoding (4-byte little-endian length, then the bytes)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import tritonclient.utils as tc

from dlserve.memory.bytes_codec import (
    TruncatedElement,
    count_elements,
    deserialize_bytes,
    serialize_bytes,
    serialized_size,
)


def encode_by_hand(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(i)) + i for i in items)


def objects(*items: object, shape: tuple[int, ...] | None = None) -> np.ndarray:
    arr = np.empty(len(items), dtype=object)
    arr[:] = list(items)
    return arr if shape is None else arr.reshape(shape)


def assert_bytes_array(actual: np.ndarray, expected: list[bytes]) -> None:
    assert actual.dtype == np.object_
    assert actual.ndim == 1
    assert actual.tolist() == expected
    assert all(type(x) is bytes for x in actual.tolist())


# -- serialize ---------------------------------------------------------------------------


def test_serialize_returns_flat_uint8():
    out = serialize_bytes(objects(b"ab", b"c"))
    assert out.dtype == np.uint8 and out.ndim == 1 and out.flags.c_contiguous
    assert out.tobytes() == b"\x02\x00\x00\x00ab\x01\x00\x00\x00c"


def test_serialize_object_bytes():
    items = [b"hello", b"", b"\x00\x01\xff", b"x" * 300]
    assert serialize_bytes(objects(*items)).tobytes() == encode_by_hand(items)


def test_serialize_object_str_is_utf8():
    out = serialize_bytes(objects("héllo", "日本", ""))
    assert out.tobytes() == encode_by_hand(["héllo".encode(), "日本".encode(), b""])


def test_serialize_mixed_objects_and_numbers_use_str():
    arr = objects(b"raw", "txt", 7, 1.5, True, None)
    assert serialize_bytes(arr).tobytes() == encode_by_hand(
        [b"raw", b"txt", b"7", b"1.5", b"True", b"None"]
    )


def test_serialize_bytes_like_objects_keep_their_bytes():
    arr = objects(bytearray(b"ab"), memoryview(b"cd"), np.bytes_(b"ef"))
    assert serialize_bytes(arr).tobytes() == encode_by_hand([b"ab", b"cd", b"ef"])


def test_serialize_fixed_width_bytes_array():
    arr = np.array([b"abc", b"d", b""], dtype="S3")
    assert serialize_bytes(arr).tobytes() == encode_by_hand([b"abc", b"d", b""])


def test_serialize_fixed_width_str_array():
    arr = np.array(["a", "ßß", "€"])
    assert arr.dtype.kind == "U"
    assert serialize_bytes(arr).tobytes() == encode_by_hand([b"a", "ßß".encode(), "€".encode()])


def test_serialize_all_empty_elements():
    assert serialize_bytes(objects(b"", b"", b"")).tobytes() == b"\x00" * 12


def test_serialize_empty_array():
    out = serialize_bytes(np.empty((0, 3), dtype=object))
    assert out.dtype == np.uint8 and out.size == 0


def test_serialize_multi_dim_is_c_order():
    arr = objects(b"a", b"bb", b"ccc", b"dddd", b"e", b"ff", shape=(2, 3))
    expected = encode_by_hand([b"a", b"bb", b"ccc", b"dddd", b"e", b"ff"])
    assert serialize_bytes(arr).tobytes() == expected
    # A transposed (Fortran-ordered) view is encoded in its own logical C order.
    transposed = arr.T
    assert not transposed.flags.c_contiguous
    assert serialize_bytes(transposed).tobytes() == encode_by_hand(
        [b"a", b"dddd", b"bb", b"e", b"ccc", b"ff"]
    )


def test_serialize_rejects_numeric_arrays():
    with pytest.raises(TypeError, match="cannot serialize a int64 array as BYTES"):
        serialize_bytes(np.arange(3, dtype=np.int64))


def test_serialize_non_utf8_bytes_unchanged():
    items = [b"\xff\xfe\x80", b"\xc3"]
    assert serialize_bytes(objects(*items)).tobytes() == encode_by_hand(items)


# -- deserialize -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "items",
    [
        [b"hello", b"", b"world!"],
        [b""],
        [b"", b"", b""],
        [b"\xff\x00\x80", b"\x00", b"abc\x00\x00"],
        [b"same", b"size", b"each"],  # uniform-length fast path
        [b"x" * 1000] * 50,
        [bytes([i]) for i in range(1, 256)],
    ],
    ids=["mixed", "one-empty", "all-empty", "non-utf8", "uniform", "uniform-long", "one-byte-each"],
)
def test_round_trip_with_and_without_count(items):
    encoded = serialize_bytes(objects(*items))
    assert_bytes_array(deserialize_bytes(encoded, len(items)), items)
    assert_bytes_array(deserialize_bytes(encoded), items)
    assert_bytes_array(deserialize_bytes(encoded.tobytes(), len(items)), items)


def test_round_trip_of_strings_gives_utf8_bytes():
    arr = np.array(["héllo", "wörld", "日本語"])
    out = deserialize_bytes(serialize_bytes(arr), 3)
    assert [b.decode("utf-8") for b in out] == arr.tolist()


def test_round_trip_multi_dim_needs_reshape():
    arr = objects(*[f"{i:03d}".encode() for i in range(24)], shape=(2, 3, 4))
    out = deserialize_bytes(serialize_bytes(arr), 24)
    assert out.shape == (24,)
    assert (out.reshape(2, 3, 4) == arr).all()


@pytest.mark.parametrize(
    "items",
    [
        [b"a\x00", b"b\x00", b"c\x00"],  # every element ends in NUL
        [b"ab", b"c\x00"],  # only the last one
        [b"\x00\x00", b"\x00\x00"],  # nothing but NULs
        [b"\x00a", b"\x00b"],  # leading NULs
    ],
    ids=["all-trailing", "last-trailing", "only-nul", "leading"],
)
def test_uniform_length_elements_keep_nul_bytes(items):
    encoded = serialize_bytes(objects(*items))
    assert_bytes_array(deserialize_bytes(encoded, len(items)), items)
    assert_bytes_array(deserialize_bytes(encoded), items)


def test_uniform_fast_path_accepts_any_buffer_type():
    items = [b"abcd"] * 8
    raw = encode_by_hand(items)
    for buf in (raw, bytearray(raw), memoryview(raw), np.frombuffer(raw, dtype=np.uint8)):
        assert_bytes_array(deserialize_bytes(buf, 8), items)


def test_deserialize_from_a_non_zero_offset_view():
    raw = b"JUNK" + encode_by_hand([b"ab", b"cd"])
    view = np.frombuffer(raw, dtype=np.uint8)[4:]
    assert_bytes_array(deserialize_bytes(view, 2), [b"ab", b"cd"])


def test_deserialized_elements_do_not_alias_the_buffer():
    buf = bytearray(encode_by_hand([b"ab", b"cd"]))
    out = deserialize_bytes(buf, 2)
    buf[4:6] = b"ZZ"
    assert out.tolist() == [b"ab", b"cd"]


def test_empty_buffer():
    assert deserialize_bytes(b"").shape == (0,)
    assert deserialize_bytes(b"", 0).shape == (0,)
    assert deserialize_bytes(b"").dtype == np.object_


@pytest.mark.parametrize("count", [1, 2, 4, 100])
def test_count_mismatch_raises(count):
    encoded = encode_by_hand([b"ab", b"cd", b"ef"])
    with pytest.raises(ValueError, match=f"BYTES data holds 3 elements, expected {count}"):
        deserialize_bytes(encoded, count)


def test_count_mismatch_for_empty_buffer():
    with pytest.raises(ValueError, match="holds 0 elements, expected 2"):
        deserialize_bytes(b"", 2)


def test_count_zero_with_data_raises():
    with pytest.raises(ValueError, match="holds 1 elements, expected 0"):
        deserialize_bytes(encode_by_hand([b"x"]), 0)


@pytest.mark.parametrize("count", [None, 2])
def test_truncated_inside_element_raises(count):
    encoded = encode_by_hand([b"ab", b"cdef"])[:-1]
    with pytest.raises(TruncatedElement, match=r"inside an element of 4 bytes \(3 bytes left\)") as info:
        deserialize_bytes(encoded, count)
    assert (info.value.in_prefix, info.value.expected, info.value.available) == (False, 4, 3)


@pytest.mark.parametrize("cut", [1, 2, 3])
def test_truncated_inside_length_prefix_raises(cut):
    encoded = encode_by_hand([b"ab"]) + b"\x05\x00\x00\x00"[:cut]
    with pytest.raises(TruncatedElement, match="ends inside an element's length prefix") as info:
        deserialize_bytes(encoded)
    assert (info.value.in_prefix, info.value.available) == (True, cut)
    with pytest.raises(TruncatedElement, match="ends inside an element's length prefix"):
        count_elements(encoded)


def test_huge_length_prefix_raises():
    with pytest.raises(TruncatedElement, match="of 4294967295 bytes"):
        deserialize_bytes(b"\xff\xff\xff\xffabc", 1)


def test_uniform_prefix_but_wrong_total_falls_back_and_validates():
    # Two 2-byte elements but a third prefix that also says 2 and is cut short.
    encoded = encode_by_hand([b"ab", b"cd"]) + b"\x02\x00\x00\x00c"
    with pytest.raises(TruncatedElement, match=r"of 2 bytes \(1 bytes left\)"):
        deserialize_bytes(encoded, 3)


# -- serialized_size / count_elements ----------------------------------------------------


@pytest.mark.parametrize(
    "arr",
    [
        objects(b"ab", b"", "é", 12),
        np.array([b"abc", b"d"], dtype="S3"),
        np.array(["a", "日本"]),
        np.empty(0, dtype=object),
        objects(*[b"x"] * 6, shape=(2, 3)),
    ],
    ids=["objects", "S", "U", "empty", "2d"],
)
def test_serialized_size_matches_serialize(arr):
    assert serialized_size(arr) == serialize_bytes(arr).nbytes


def test_serialized_size_by_hand():
    assert serialized_size(objects(b"ab", "é")) == 4 + 2 + 4 + 2


@pytest.mark.parametrize("n", [0, 1, 3, 257])
def test_count_elements(n):
    items = [bytes(i % 5) for i in range(n)]
    assert count_elements(encode_by_hand(items)) == n
    assert count_elements(np.frombuffer(encode_by_hand(items), dtype=np.uint8)) == n


def test_count_elements_rejects_truncated_data():
    with pytest.raises(TruncatedElement, match=r"of 3 bytes \(2 bytes left\)"):
        count_elements(encode_by_hand([b"abc"])[:-1])


# -- agreement with tritonclient -------------------------------------------------------

TRITON_INPUTS = {
    "bytes": objects(b"hello", b"", b"\xff\x00", b"x" * 70),
    "str": objects("héllo", "日本", ""),
    "mixed": objects(b"raw", "txt", 7, -2.5, False, None),
    "uniform": objects(*[b"abcd"] * 10),
    "uniform-nul": objects(b"a\x00", b"b\x00"),
    "2d": objects(*[f"e{i}".encode() for i in range(12)], shape=(3, 4)),
    "transposed": objects(*[f"e{i}".encode() for i in range(12)], shape=(3, 4)).T,
    "S": np.array([b"ab", b"c", b""], dtype="S2"),
    "S-2d": np.array([[b"ab", b"c"], [b"d", b"ef"]]),
}


@pytest.mark.parametrize("name", list(TRITON_INPUTS))
def test_serialize_matches_tritonclient_byte_for_byte(name):
    arr = TRITON_INPUTS[name]
    theirs = tc.serialize_byte_tensor(arr)
    assert serialize_bytes(arr).tobytes() == theirs.item()


@pytest.mark.parametrize("name", list(TRITON_INPUTS))
def test_deserialize_matches_tritonclient(name):
    arr = TRITON_INPUTS[name]
    encoded = tc.serialize_byte_tensor(arr).item()
    theirs = tc.deserialize_bytes_tensor(encoded)
    ours = deserialize_bytes(encoded, arr.size)
    assert ours.dtype == theirs.dtype == np.object_
    assert ours.shape == theirs.shape
    assert ours.tolist() == theirs.tolist()
    assert deserialize_bytes(encoded).tolist() == theirs.tolist()


def test_both_empty_for_empty_input():
    empty = np.empty(0, dtype=object)
    assert tc.serialize_byte_tensor(empty).size == 0
    assert serialize_bytes(empty).size == 0
