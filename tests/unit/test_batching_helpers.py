"""pb_utils.join_inputs / JoinedInputs.split outside a server."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import triton_python_backend_utils as pb_utils
from dlserve.ipc.tensors import InlineSlab


def request(array: np.ndarray, name: str = "X") -> pb_utils.InferenceRequest:
    return pb_utils.InferenceRequest(inputs=[pb_utils.Tensor(name, array)], requested_output_names=[], model_name="m")


def test_adjacent_rows_join_as_a_view():
    pieces = InlineSlab().copy_many([np.full((2, 3), i, np.float32).tobytes() for i in range(3)])
    requests = [request(p.view(np.float32).reshape(2, 3)) for p in pieces]
    joined = pb_utils.join_inputs(requests, "X")
    assert not joined.copied
    assert joined.array.shape == (6, 3)
    assert joined.array.__array_interface__["data"][0] == pieces[0].__array_interface__["data"][0]
    np.testing.assert_array_equal(joined.array[:, 0], [0, 0, 1, 1, 2, 2])
    joined.array[0, 0] = 42  # it is the requests' own memory
    assert requests[0].inputs()[0].as_numpy()[0, 0] == 42


def test_scattered_rows_are_copied_once():
    requests = [request(np.full((1, 2), i, np.int32)) for i in range(3)]
    joined = pb_utils.join_inputs(requests, "X")
    assert joined.copied and joined.sizes == [1, 1, 1]
    np.testing.assert_array_equal(joined.array, [[0, 0], [1, 1], [2, 2]])


def test_bf16_inputs_join_though_as_numpy_refuses_them():
    bf16 = ml_dtypes.bfloat16
    requests = [request(np.full((1, 2), i, bf16)) for i in range(2)]
    joined = pb_utils.join_inputs(requests, "X")
    assert joined.array.dtype == bf16 and joined.array.astype(np.float32).tolist() == [[0, 0], [1, 1]]


def test_split_gives_each_request_its_rows():
    requests = [request(np.zeros((n, 2), np.float32)) for n in (1, 3, 2)]
    joined = pb_utils.join_inputs(requests, "X")
    parts = joined.split(np.arange(6))
    assert [p.tolist() for p in parts] == [[0], [1, 2, 3], [4, 5]]
    with pytest.raises(pb_utils.TritonModelException, match="the 6 joined rows"):
        joined.split(np.arange(5))


def test_ragged_inputs_are_refused_or_padded():
    requests = [request(np.ones((1, 2), np.float32)), request(np.full((2, 4), 2, np.float32))]
    with pytest.raises(pb_utils.TritonModelException, match="ragged='pad'"):
        pb_utils.join_inputs(requests, "X")
    joined = pb_utils.join_inputs(requests, "X", ragged="pad", pad_value=-1)
    assert joined.shapes == [(1, 2), (2, 4)]
    np.testing.assert_array_equal(joined.array, [[1, 1, -1, -1], [2, 2, 2, 2], [2, 2, 2, 2]])


def test_missing_input_and_bad_arguments():
    with pytest.raises(pb_utils.TritonModelException, match="has no input 'Y'"):
        pb_utils.join_inputs([request(np.zeros((1, 1)))], "Y")
    with pytest.raises(pb_utils.TritonModelException, match="ragged must be"):
        pb_utils.join_inputs([request(np.zeros((1, 1)))], "X", ragged="stretch")
    with pytest.raises(pb_utils.TritonModelException, match="no batch dimension"):
        pb_utils.join_inputs([request(np.array(1.0, dtype=np.float32))], "X")
