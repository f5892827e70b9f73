"""``--profile-export-file``: every measured request, written the way perf_analyzer writes
its profile export (compact JSON)::

    {"experiments": [{"experiment": {"mode": "concurrency", "value": 1},
                      "requests": [{"timestamp": ..., "sequence_id": ...,
                                    "request_inputs": {"INPUT0": [...]},
                                    "response_timestamps": [...],
                                    "response_outputs": [{"OUTPUT0": [...]}]}, ...],
                      "window_boundaries": [...]}, ...],
     "version": "...", "service_kind": "triton", "endpoint": ""}

One experiment per level measured (one over the latency limit, or the last that never
became stable, included), with the requests that ended in its measurement windows, window
by window; ``window_boundaries`` holds the first window's start, then each window's end
(``--periodic-concurrency-range``'s run: one experiment, one window).
Times are nanoseconds since the epoch (perf_analyzer's system_clock): the load measures on
``time.perf_counter_ns`` and each process's offset to the epoch turns them into that.
``sequence_id`` is there for sequence models only; ``response_timestamps`` hold one time
per response, a decoupled model's flag-only final included (it then has no outputs), the
last being the request's end. Tensor values follow perf_analyzer: a flat list, a single
element alone, BYTES as one string (its length-prefixed bytes less the first prefix), FP16
and BF16 as null; ``request_inputs`` hold a batch's first element, as perf_analyzer's do.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dlserve import __version__
from dlserve.perf.answers import Outputs, decoder
from dlserve.perf.inputs import ModelInfo, numpy_type, raw_bytes

# One request: (sent, [each answer's time], sequence ID or 0, index of its data, [answers])
Logged = tuple[int, list[int], int, int, list[Any]]


@dataclasses.dataclass
class RequestLog:
    """The requests of one process that ended in one window, on its perf_counter clock."""

    clock_ns: int  # that process's epoch ns less its perf_counter ns
    start_ns: int
    end_ns: int
    requests: list[Logged]


def clock_offset() -> int:
    """What turns this process's ``time.perf_counter_ns`` into nanoseconds since the epoch."""
    return time.time_ns() - time.perf_counter_ns()


class ProfileExport:
    """The levels' requests, gathered as they are measured and written at the end."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.info: ModelInfo | None = None
        self.requests: list[dict[str, np.ndarray]] = []
        self.experiments: list[tuple[str, float, list[list[RequestLog]]]] = []
        self._warned: set[str] = set()

    def model(self, info: ModelInfo, requests: list[dict[str, np.ndarray]]) -> None:
        """The model and the distinct requests sent (their data: ``request_inputs``)."""
        self.info, self.requests = info, requests

    def add(self, mode: str, value: float, windows: list[list[RequestLog]]) -> None:
        """A level measured: each window's logs (one per process)."""
        self.experiments.append((mode, value, windows))

    def write(self) -> None:
        with open(self.settings.profile_export_file, "w", encoding="utf-8") as f:
            json.dump(self.document(), f, separators=(",", ":"))

    def document(self) -> dict[str, Any]:
        inputs = [self._inputs(request) for request in self.requests]
        decode = decoder(self.settings.protocol, self.settings.streaming)
        return {
            "experiments": [self._experiment(*experiment, inputs, decode) for experiment in self.experiments],
            "version": __version__,
            "service_kind": "triton_c_api" if self.settings.protocol == "inprocess" else "triton",
            "endpoint": "",
        }

    def _experiment(self, mode: str, value: float, windows: list[list[RequestLog]], inputs: list[dict[str, Any]],
                    decode: Callable[[Any], Outputs]) -> dict[str, Any]:
        requests = []
        for logs in windows:
            for log in logs:
                for sent, times, sequence_id, index, answers in log.requests:
                    entry: dict[str, Any] = {"timestamp": log.clock_ns + sent}
                    if sequence_id:
                        entry["sequence_id"] = sequence_id
                    entry["request_inputs"] = inputs[index]
                    entry["response_timestamps"] = [log.clock_ns + t for t in times]
                    entry["response_outputs"] = [
                        {} if answer is None else self._tensors(decode(answer)) for answer in answers
                    ]
                    requests.append(entry)
        boundaries = [min(log.clock_ns + log.start_ns for log in windows[0])] if windows else []
        boundaries += [max(log.clock_ns + log.end_ns for log in logs) for logs in windows]
        return {
            "experiment": {"mode": mode, "value": int(value) if mode == "concurrency" else float(value)},
            "requests": requests,
            "window_boundaries": boundaries,
        }

    def _inputs(self, request: dict[str, np.ndarray]) -> dict[str, Any]:
        datatypes = {t.name: t.datatype for t in self.info.inputs} if self.info else {}
        batched = bool(self.info and self.info.max_batch_size)
        return self._tensors({
            name: (datatypes[name], raw_bytes(array[0] if batched else array, datatypes[name]))
            for name, array in request.items()
        })

    def _tensors(self, tensors: Outputs) -> dict[str, Any]:
        return {name: self._value(datatype, raw) for name, (datatype, raw) in tensors.items()}

    def _value(self, datatype: str, raw: bytes) -> Any:
        if datatype == "BYTES":
            return bytes(raw[4:]).decode("utf-8", "replace")
        if datatype in ("FP16", "BF16"):
            if datatype not in self._warned:  # (perf_analyzer warns for each one)
                self._warned.add(datatype)
                print(f"WARNING: unsupported data type: '{datatype}'", file=sys.stderr)
            return None
        values = np.frombuffer(raw, dtype=numpy_type(datatype).newbyteorder("<")).tolist()
        return values[0] if len(values) == 1 else values
