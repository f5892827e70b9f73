"""The tracer on its own: settings scopes, sampling, holds, and the files it writes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dlserve.engine.tracing import Tracer, TraceSettings
from dlserve.errors import InvalidArgumentError, UnsupportedError
from dlserve.memory.tensor import Tensor


def tracer(tmp_path, **settings: object) -> Tracer:
    values = {"file": str(tmp_path / "trace.json"), "level": ("TIMESTAMPS",), "rate": 1, **settings}
    return Tracer(TraceSettings(**values), has_model=lambda name: name in ("a", "b"))


def finish(trace) -> None:
    trace.record("REQUEST_START", 1)
    trace.release()


def test_a_models_settings_follow_the_servers_except_what_it_set(tmp_path):
    t = tracer(tmp_path)
    assert t.update("a", {"trace_rate": "3"})["trace_rate"] == "3"
    t.update(None, {"trace_rate": "5", "trace_level": ["TIMESTAMPS"], "trace_count": "9"})
    assert t.settings("a")["trace_rate"] == "3" and t.settings("a")["trace_count"] == "9"
    assert t.settings("b")["trace_rate"] == "5"
    assert t.update("a", {"trace_rate": None})["trace_rate"] == "5"  # back to the server's
    assert t.update(None, {"trace_rate": None})["trace_rate"] == "1"  # back to start-up
    with pytest.raises(InvalidArgumentError, match="unknown model : c"):
        t.settings("c")
    with pytest.raises(UnsupportedError, match="can not be updated"):
        t.update(None, {"trace_file": "x"})


def test_a_model_with_settings_of_its_own_samples_on_its_own(tmp_path):
    """As Triton: every trace_rate-th request of its scope, while its count lasts; a
    model with any setting of its own is a scope, which starts over when settings change."""
    t = tracer(tmp_path, rate=2, count=3)
    picked = [t.start("a", str(n)) is not None for n in range(4)]
    assert picked == [False, True, False, True]
    assert t.settings("a")["trace_count"] == "1"
    t.update("b", {"trace_rate": "1"})  # b's own count: what is left of the server's
    assert [t.start("b", "x") is not None for _ in range(3)] == [True, False, False]
    assert t.settings("b")["trace_count"] == "0" and t.settings("a")["trace_count"] == "1"
    t.update("b", {"trace_count": "2"})
    assert [t.start("b", "x") is not None for _ in range(3)] == [True, True, False]
    assert t.start("a", "x") is None and t.start("a", "x") is not None  # the 6th: its last
    assert [t.start("a", str(n)) is None for n in range(3)] == [True, True, True]
    t.update(None, {"trace_count": "2"})  # new settings: sampling starts over
    assert [t.start("a", str(n)) is not None for n in range(4)] == [False, True, False, True]
    t.update(None, {"trace_level": ["OFF"]})
    assert t.start("a", "x") is None and t.start("b", "x") is None


def test_a_rate_of_zero_is_taken_only_with_tracing_off_as_in_triton(tmp_path):
    t = tracer(tmp_path, level=("OFF",), rate=0)  # (--trace-config rate=0 starts)
    assert t.update(None, {"trace_rate": "0"})["trace_rate"] == "0"
    with pytest.raises(InvalidArgumentError, match="^Attempting to set invalid trace setting :sample rate must be non-zero$"):
        t.update(None, {"trace_level": ["TIMESTAMPS"]})
    with pytest.raises(InvalidArgumentError, match="sample rate must be non-zero"):
        t.update("a", {"trace_level": ["TIMESTAMPS"]})
    assert t.update("a", {"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})["trace_rate"] == "1"
    assert t.start("a", "x") is not None
    on = tracer(tmp_path, rate=0)  # (a setting that traces nothing, as Triton's invalid one)
    assert on.start("a", "x") is None


def test_no_file_or_level_off_traces_nothing(tmp_path):
    assert not Tracer(TraceSettings(level=("TIMESTAMPS",)), lambda name: True).enabled
    t = tracer(tmp_path, level=("OFF",))
    assert not t.enabled and t.start("a", "x") is None
    t.update("a", {"trace_level": ["TIMESTAMPS"]})
    assert t.enabled and t.start("a", "x") is not None and t.start("b", "x") is None


def test_a_trace_is_written_when_its_last_holder_lets_go(tmp_path):
    t = tracer(tmp_path, log_frequency=1)
    trace = t.start("a", "held")
    trace.hold()
    finish(trace)
    assert not (tmp_path / "trace.json.0").exists()
    trace.record("HTTP_SEND_END", 2)
    trace.release()
    entries = json.loads((tmp_path / "trace.json.0").read_text())
    head = {"id": trace.id, "model_name": "a", "model_version": -1, "request_id": "held"}
    assert entries[0] == head
    assert [e["timestamps"][0]["name"] for e in entries[1:]] == ["REQUEST_START", "HTTP_SEND_END"]
    dropped = t.start("a", "dropped")
    dropped.discard()
    t.close()
    assert not (tmp_path / "trace.json.1").exists()


def test_files_of_n_requests_and_the_rest_at_close(tmp_path):
    """A log frequency counts requests: a request's child traces (ensemble steps, BLS
    calls, theirs in turn) go into its file with it and are not counted, as in Triton."""
    t = tracer(tmp_path, log_frequency=2)
    for n in range(5):
        trace = t.start("a", f"r{n}")
        child = trace.child("b", f"r{n}")
        finish(child.child("a", f"r{n}"))
        finish(child)
        finish(trace)
    t.close()
    assert not (tmp_path / "trace.json.3").exists()
    files = [json.loads((tmp_path / f"trace.json.{i}").read_text()) for i in range(3)]
    heads = [[e for e in f if "model_name" in e] for f in files]
    assert [[h["request_id"] for h in file] for file in heads] == [
        ["r0"] * 3 + ["r1"] * 3, ["r2"] * 3 + ["r3"] * 3, ["r4"] * 3
    ]
    root, child, grandchild = heads[0][:3]
    assert "parent_id" not in root and child["parent_id"] == root["id"] and grandchild["parent_id"] == child["id"]


def test_a_trace_finishing_after_close_leaves_the_file_whole(tmp_path):
    t = tracer(tmp_path)
    finish(t.start("a", "early"))
    late = t.start("a", "late")
    t.close()
    finish(late)
    t.close()
    entries = json.loads((tmp_path / "trace.json").read_text())
    assert [e["request_id"] for e in entries if "model_name" in e] == ["early"]


def test_one_streamed_array_without_a_log_frequency(tmp_path):
    t = tracer(tmp_path)
    for n in range(3):
        finish(t.start("a", f"r{n}"))
    t.close()
    entries = json.loads((tmp_path / "trace.json").read_text())
    assert [e["request_id"] for e in entries if "model_name" in e] == ["r0", "r1", "r2"]


def request_ids(path) -> list[str]:
    return [e["request_id"] for e in json.loads(path.read_text()) if "model_name" in e]


def test_a_spent_count_writes_its_traces_to_a_numbered_file_at_once(tmp_path):
    """Triton's rule (upstream L0_trace's count case): the traces of a trace_count go to
    the next numbered file as soon as the count is spent and they have all finished;
    the traces before it stream into the main file."""
    t = tracer(tmp_path)
    for n in range(3):
        finish(t.start("a", f"before{n}"))
    t.update(None, {"trace_count": "2"})
    first = t.start("a", "counted0")
    finish(t.start("a", "counted1"))
    assert t.start("a", "not traced") is None
    assert not (tmp_path / "trace.json.0").exists()  # counted0 is still open
    finish(first)
    assert request_ids(tmp_path / "trace.json.0") == ["counted1", "counted0"]
    t.close()
    assert request_ids(tmp_path / "trace.json") == ["before0", "before1", "before2"]


def test_new_settings_write_what_the_old_ones_held(tmp_path):
    """A log_frequency's partial batch is written when the settings change (once its
    open traces finish), not merged into the next settings' batches."""
    t = tracer(tmp_path, log_frequency=3)
    finish(t.start("a", "r0"))
    still_open = t.start("a", "r1")
    t.update(None, {"trace_rate": "1"})
    assert not (tmp_path / "trace.json.0").exists()
    finish(still_open)
    assert request_ids(tmp_path / "trace.json.0") == ["r0", "r1"]
    for n in range(2, 6):
        finish(t.start("a", f"r{n}"))
    assert request_ids(tmp_path / "trace.json.1") == ["r2", "r3", "r4"]
    t.update(None, {"trace_count": "5"})  # (a count not spent: written at close)
    finish(t.start("a", "r6"))
    t.close()
    assert request_ids(tmp_path / "trace.json.2") == ["r5"]
    assert request_ids(tmp_path / "trace.json.3") == ["r6"]
    assert not (tmp_path / "trace.json").exists()


def test_tensor_entries_are_written_as_triton_writes_them(tmp_path):
    t = tracer(tmp_path, level=("TENSORS",), log_frequency=1)
    trace = t.start("a", "r")
    trace.record("REQUEST_START", 1)  # TENSORS alone: no timestamps
    trace.record_tensors("TENSOR_QUEUE_INPUT", {
        "B": Tensor.from_numpy(np.array([[True], [False]])),
        "I": Tensor.from_numpy(np.array([-1, 2], np.int8)),
        "H": Tensor.from_numpy(np.array([1.5], np.float16)),
        "D": Tensor.from_numpy(np.array([1e20, 0.1], np.float64)),
    })
    trace.release()
    entries = json.loads((tmp_path / "trace.json.0").read_text())
    assert not [e for e in entries if "timestamps" in e]
    tensors = {e["tensor"]["name"]: e["tensor"] for e in entries if "tensor" in e}
    assert tensors["B"] == {"name": "B", "data": "1,0", "shape": "2,1", "dtype": "BOOL"}
    assert tensors["I"]["data"] == "-1,2"  # numbers (Triton writes INT8 as raw characters)
    assert tensors["H"]["data"] == ""  # as Triton: FP16 and BF16 are not written out
    assert tensors["D"]["data"] == "1e+20,0.1"  # C++'s default float format
