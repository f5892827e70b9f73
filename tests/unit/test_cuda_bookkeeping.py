"""The parts of dlserve's GPU memory handling that need no GPU: the device pool's free list
(first fit, merged on free), how references into device memory are told from host ones and
which lease ids they carry, and the FORCE_CPU_ONLY_INPUT_TENSORS reading. (tests/gpu runs
the rest on a GPU.)"""

from __future__ import annotations

import random

import pytest

from dlserve.ipc.stub import forces_cpu_inputs
from dlserve.ipc.tensors import _leases
from dlserve.memory.cuda_pool import ALIGNMENT, _Chunk
from dlserve.memory.cuda_regions import is_cuda_ref


def free_list(size: int) -> _Chunk:
    """A chunk's bookkeeping alone (no device memory behind it)."""
    chunk = _Chunk.__new__(_Chunk)
    chunk.size = size
    chunk._free = [(0, size)]
    return chunk


def test_blocks_are_aligned_first_fit_and_merge_back_into_one_range():
    chunk = free_list(64 * ALIGNMENT)
    a, b, c = chunk.take(1), chunk.take(ALIGNMENT + 1), chunk.take(0)
    assert (a, b, c) == (0, ALIGNMENT, 3 * ALIGNMENT)  # (each rounded up to the alignment)
    chunk.give(b, ALIGNMENT + 1)
    assert chunk.take(ALIGNMENT) == ALIGNMENT  # first fit: the hole b left
    chunk.give(ALIGNMENT, ALIGNMENT)
    for offset, nbytes in ((a, 1), (c, 0)):
        chunk.give(offset, nbytes)
    assert chunk._free == [(0, 64 * ALIGNMENT)]
    assert chunk.take(65 * ALIGNMENT) is None


def test_random_takes_and_gives_never_overlap_and_leave_the_chunk_whole():
    rng = random.Random(7)
    chunk = free_list(1 << 20)
    held: dict[int, int] = {}
    for _ in range(3000):
        if held and rng.random() < 0.45:
            offset = rng.choice(list(held))
            chunk.give(offset, held.pop(offset))
        else:
            nbytes = rng.choice([0, 1, 511, 512, 513, 4096, 70000])
            offset = chunk.take(nbytes)
            if offset is not None:
                held[offset] = nbytes
        spans = sorted((o, o + max(ALIGNMENT, -(-n // ALIGNMENT) * ALIGNMENT)) for o, n in held.items())
        spans += [(o, o + n) for o, n in chunk._free]
        spans.sort()
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), "overlap"
        assert sum(end - start for start, end in spans) == chunk.size, "bytes lost"
    for offset, nbytes in list(held.items()):
        chunk.give(offset, nbytes)
    assert chunk._free == [(0, 1 << 20)]


def test_cuda_references_are_told_from_host_ones_and_carry_their_leases():
    host = ("dlserve_1_s_0", 64, 128, 5)
    device = ("cuda", "pool:1:0", b"\0" * 64, 0, 1 << 25, 512, 128, 9)
    region = ("cuda", "cuda:0", b"\0" * 64, 0, 4096, 0, 16, 0)
    assert not is_cuda_ref(host) and is_cuda_ref(device) and is_cuda_ref(region)
    wires = [("a", 0, (4,), host), ("b", 0, (4,), device), ("c", 0, (4,), region), ("d", 0, (1,), b"x")]
    assert _leases(wires) == [5, 9]  # (a client's region and inline bytes hold none)


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [({}, True), ({"FORCE_CPU_ONLY_INPUT_TENSORS": {"string_value": "yes"}}, True),
     ({"FORCE_CPU_ONLY_INPUT_TENSORS": {"string_value": "no"}}, False)],
)
def test_force_cpu_only_input_tensors(parameters, expected):
    assert forces_cpu_inputs({"parameters": parameters}) is expected


@pytest.mark.parametrize("value", ["No", "false", "0", " no"])
def test_force_cpu_only_input_tensors_refuses_what_triton_refuses(value):
    with pytest.raises(ValueError, match=f"Incorrect value for FORCE_CPU_ONLY_INPUT_TENSORS: '{value}'"):
        forces_cpu_inputs({"parameters": {"FORCE_CPU_ONLY_INPUT_TENSORS": {"string_value": value}}})
