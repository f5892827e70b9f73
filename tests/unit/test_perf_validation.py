"""``dlserve perf``'s ``validation_data`` (perf_analyzer's JSON key): each step's expected
outputs read into the bytes the answers carry, batched as the requests are, and each
answer checked against them byte for byte, with perf_analyzer's messages."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from dlserve.perf.answers import Validator, http_outputs
from dlserve.perf.clients.base import DataPlane, RequestError
from dlserve.perf.flags import UsageError
from dlserve.perf.inputs import expected_outputs, raw_bytes

from .test_perf_inputs import ADD_SUB, BATCHED, STRINGS, write

A = [float(i) for i in range(16)]
SUM = [2 * a for a in A]
DATA = {"INPUT0": A, "INPUT1": A}


def fp32(values: list[float]) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def test_no_validation_data_expects_nothing(tmp_path):
    assert expected_outputs(ADD_SUB, 1, write(tmp_path, {"data": [DATA]})) is None
    assert expected_outputs(ADD_SUB, 1, "random") is None


def test_every_form_of_expected_output(tmp_path):
    b64 = base64.b64encode(fp32(SUM)).decode()
    path = write(tmp_path, {"data": [DATA, DATA], "validation_data": [
        {"OUTPUT0": SUM, "OUTPUT1": {"content": [A[:8], A[8:]], "shape": [16]}},
        {"OUTPUT0": {"b64": b64}, "OUTPUT1": [0.0] * 16},
    ]})
    first, second = expected_outputs(ADD_SUB, 1, path)
    assert first == {"OUTPUT0": fp32(SUM), "OUTPUT1": fp32(A)}
    assert second == {"OUTPUT0": fp32(SUM), "OUTPUT1": fp32([0.0] * 16)}


def test_bytes_outputs_are_length_prefixed_as_on_the_wire(tmp_path):
    path = write(tmp_path, {"data": [{"INPUT0": ["ab", "c"]}],
                            "validation_data": [{"OUTPUT0": ["AB", "C"]}]})
    (expected,) = expected_outputs(STRINGS, 1, path)
    assert expected["OUTPUT0"] == b"\x02\x00\x00\x00AB\x01\x00\x00\x00C"


def test_a_batch_expects_its_steps_outputs_one_after_the_other(tmp_path):
    steps = [{"INPUT0": [[i, i], [i, i]]} for i in range(3)]
    outputs = [{"OUTPUT0": [i + 1] * 4} for i in range(3)]
    path = write(tmp_path, {"data": steps, "validation_data": outputs})
    expected = expected_outputs(BATCHED, 2, path)
    one = [np.full(4, i + 1, dtype="<i4").tobytes() for i in range(3)]
    # the requests' steps: (0,1) (2,0) (1,2)
    assert [e["OUTPUT0"] for e in expected] == [one[0] + one[1], one[2] + one[0], one[1] + one[2]]


def test_streams_and_files_without_validation_data(tmp_path):
    (tmp_path / "a").mkdir()
    first = write(tmp_path / "a", {"data": [[DATA, DATA]],
                                   "validation_data": [[{"OUTPUT0": SUM, "OUTPUT1": A},
                                                        {"OUTPUT0": A, "OUTPUT1": A}]]})
    second = write(tmp_path, {"data": [DATA]})
    expected = expected_outputs(ADD_SUB, 1, [first, second])
    assert [sorted(e) for e in expected] == [["OUTPUT0", "OUTPUT1"], ["OUTPUT0", "OUTPUT1"], []]
    assert expected[1]["OUTPUT0"] == fp32(A)


@pytest.mark.parametrize(
    ("validation", "message"),
    [
        ([{"OUTPUT0": SUM, "OUTPUT1": A}], "The 'validation_data' field doesn't align with 'data'"),
        ({"OUTPUT0": SUM}, "The 'validation_data' field doesn't align with 'data'"),
        ([[{"OUTPUT0": SUM, "OUTPUT1": A}]] * 2, "The 'validation_data' field doesn't align"),
        # as perf_analyzer: every output of the model, and only those
        ([{"OUTPUT0": SUM}] * 2, "validation_data step 0: no data for output 'OUTPUT1'"),
        ([{"OUTPUT0": SUM, "OUTPUT1": A, "X": [1]}] * 2, "model 'add_sub' has no output(s) X"),
        ([{"OUTPUT0": SUM[:3], "OUTPUT1": A}] * 2, "output 'OUTPUT0' has 3 elements"),
    ],
)
def test_validation_data_that_does_not_fit(tmp_path, validation, message):
    path = write(tmp_path, {"data": [DATA, DATA], "validation_data": validation})
    with pytest.raises(UsageError) as info:
        expected_outputs(ADD_SUB, 1, path)
    assert message in str(info.value)


def http_answer(outputs: dict[str, bytes]) -> tuple[int, bytes]:
    """An HTTP answer with binary outputs, as the HTTP slot keeps it."""
    header = json.dumps({"outputs": [
        {"name": name, "datatype": "FP32", "shape": [len(data) // 4],
         "parameters": {"binary_data_size": len(data)}} for name, data in outputs.items()
    ]}).encode()
    return len(header), header + b"".join(outputs.values())


def validator(expected: list[dict[str, bytes]]) -> Validator:
    plane = DataPlane(None, ADD_SUB, [], None)  # (no shared memory: outputs in the answers)
    return Validator(expected, http_outputs, plane)


def test_an_answer_is_checked_byte_for_byte():
    check = validator([{"OUTPUT0": fp32(SUM)}, {}]).check
    check([(0, http_answer({"OUTPUT0": fp32(SUM), "OUTPUT1": fp32(A)}))], 0)  # OUTPUT1: not named
    check([(0, http_answer({"OUTPUT0": fp32(A)}))], 1)  # nothing expected of request 1
    one_ulp = np.nextafter(np.float32(SUM[1]), np.float32(100))
    near = fp32(SUM[:1] + [float(one_ulp)] + SUM[2:])
    mismatch = r"^Output doesn't match expected output \(output 'OUTPUT0', data index 0\)"
    with pytest.raises(RequestError, match=mismatch):
        check([(0, http_answer({"OUTPUT0": near}))], 0)
    size = r"^Output size doesn't match expected size "
    with pytest.raises(RequestError, match=size + r".*60 bytes, expected 64"):
        check([(0, http_answer({"OUTPUT0": fp32(SUM[:15])}))], 0)
    with pytest.raises(RequestError, match=size + r".*no such output"):
        check([(0, http_answer({"OUTPUT1": fp32(SUM)}))], 0)


def test_the_last_answer_with_outputs_is_checked():
    """A decoupled stream's flag-only final has none: the answer before it is checked."""
    check = validator([{"OUTPUT0": raw_bytes(np.asarray(SUM, dtype=np.float32), "FP32")}]).check
    check([(0, http_answer({"OUTPUT0": fp32(A)})), (1, http_answer({"OUTPUT0": fp32(SUM)})),
           (2, http_answer({}))], 0)
