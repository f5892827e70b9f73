"""The response cache on its own: what its key tells apart, LRU eviction by Triton's
entry size, and dropping one load's entries."""

from __future__ import annotations

import types

import numpy as np

from dlserve.engine.request import Request, Response
from dlserve.engine.response_cache import ResponseCache, _entry_size
from dlserve.memory.dtypes import DataType
from dlserve.memory.tensor import Tensor

MODEL = types.SimpleNamespace(name="m", version=1, generation=1)


def key(inputs: dict[str, Tensor], requested: list[str] | None = None, model=MODEL) -> bytes:
    request = Request("m", inputs, on_response=lambda _: None, requested_outputs=requested)
    return ResponseCache.key(model, request)


def strings(*values: bytes) -> Tensor:
    return Tensor.from_bytes_array(np.array(values, dtype=object))


def test_the_key_tells_apart_what_changes_the_answer():
    x = Tensor.from_numpy(np.arange(4, dtype=np.float32))
    same = Tensor.from_numpy(np.arange(4, dtype=np.float32))
    assert key({"X": x}) == key({"X": same})
    assert key({"X": x}, ["A"]) == key({"X": same}, ["A"])
    different = [
        key({"X": Tensor.from_numpy(np.arange(4, dtype=np.float32).reshape(2, 2))}),  # shape
        key({"X": Tensor.from_numpy(np.arange(4, dtype=np.int32))}),  # data type
        key({"Y": x}),  # input name
        key({"X": x}, ["A"]),  # outputs asked for
        key({"X": x}, model=types.SimpleNamespace(name="m", version=1, generation=2)),  # another load
        key({"X": x}, model=types.SimpleNamespace(name="m", version=2, generation=1)),  # another version
    ]
    assert len({key({"X": x}), *different}) == len(different) + 1
    # Strings split differently are different requests (their length prefixes are hashed).
    assert key({"S": strings(b"ab", b"c")}) != key({"S": strings(b"a", b"bc")})
    # Inputs in another order are the same request.
    y = Tensor.from_numpy(np.ones(2, dtype=np.float32))
    assert key({"X": x, "Y": y}) == key({"Y": y, "X": x})


def response(value: float, generation: int = 1) -> tuple[Response, int]:
    out = Response("m", 1, "")
    out.outputs["OUT"] = Tensor.from_numpy(np.full(4, value, dtype=np.float32))
    return out, generation


def test_entries_are_counted_as_triton_counts_them_and_the_oldest_go_first():
    size = _entry_size((("OUT", DataType.FP32, (4,), np.zeros(4, np.float32)),))
    assert size == 4 + (8 + 4 + 3 + 4 + 4 + 4 + 8 + 8 + 16)
    cache = ResponseCache(size * 2)
    cache.put(b"a", *response(1))
    cache.put(b"b", *response(2))
    assert cache.get(b"a") is not None  # now the most recently used
    cache.put(b"c", *response(3))  # evicts b
    assert cache.get(b"b") is None and cache.get(b"a") is not None and cache.get(b"c") is not None
    assert (cache.hits, cache.misses, cache.evictions, len(cache), cache.used) == (3, 1, 1, 2, size * 2)
    stored = cache.get(b"a").outputs[0][3]
    assert not stored.flags.writeable  # hits share it read-only
    np.testing.assert_array_equal(stored.view(np.float32), np.full(4, 1, np.float32))


def test_an_entry_bigger_than_the_cache_is_not_kept_and_forget_drops_one_load():
    cache = ResponseCache(10)
    cache.put(b"big", *response(1))
    assert len(cache) == 0 and cache.used == 0
    cache = ResponseCache(1 << 20)
    cache.put(b"old", *response(1, generation=1))
    cache.put(b"new", *response(2, generation=2))
    cache.forget(1)
    assert cache.get(b"old") is None and cache.get(b"new") is not None
    assert cache.used == _entry_size((("OUT", DataType.FP32, (4,), np.zeros(4, np.float32)),))
