"""Sequence models: requests grouped into sequences, the way perf_analyzer sends them.

A model with ``sequence_batching`` takes each request as a step of a sequence: every
request names its sequence (``sequence_id``), the first says ``sequence_start``, the last
``sequence_end``. perf_analyzer's rules, which dlserve perf follows:

* IDs count up from ``--sequence-id-range`` START; with an END (excluded) they wrap back
  to START, skipping IDs of sequences still going. With ``--processes N`` process k takes
  every Nth ID from START + k, so the processes never share one.
* A sequence is ``--sequence-length`` requests (20), give or take
  ``--sequence-length-variation`` percent (20) at random. With a JSON data file and no
  ``--sequence-length``, a sequence is one stream of the file, whole; streams are taken
  in turn (a file without streams is one stream). A data directory's one step is sent
  in sequences of ``--sequence-length``, as generated data is.
* Concurrency N keeps N sequences going, each slot sending one sequence's requests one
  after the other; request rate R spreads its requests over ``--num-of-sequences`` live
  sequences (one picked at random per request; with ``--serial-sequences`` only one
  whose previous request was answered).
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

from dlserve.perf.flags import UsageError
from dlserve.perf.inputs import json_files

DEFAULT_LENGTH = 20


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """One request of a sequence: which data to send, and its sequence parameters."""

    data: int  # index into the distinct requests
    sequence_id: int
    start: bool
    end: bool

    def parameters(self) -> dict[str, object]:
        """The request parameters, as tritonclient sends them."""
        return {"sequence_id": self.sequence_id, "sequence_start": self.start, "sequence_end": self.end}


def stream_lengths(input_data: str | list[str]) -> list[int] | None:
    """The lengths of the JSON data files' streams, file after file (one stream for a file
    without any); None for generated data and a data directory's (its one step is every
    request's, as perf_analyzer sends it). The files were checked by
    :func:`dlserve.perf.inputs.load_json_steps`."""
    paths = json_files(input_data)
    if not paths:
        return None
    return [length for path in paths for length in _file_streams(path)]


def _file_streams(path: str) -> list[int]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)["data"]
    if all(isinstance(entry, list) for entry in data):
        lengths = [len(entry) for entry in data]
        if not all(lengths):
            raise UsageError(f"--input-data {path}: a stream has no steps")
        return lengths
    if any(isinstance(entry, list) for entry in data):
        raise UsageError(
            f"--input-data {path}: either every entry of 'data' is a stream (a list) or none is"
        )
    return [len(data)]


class SequenceMaker:
    """Makes one process's sequences: IDs, lengths, and the data of each step."""

    def __init__(self, settings: Any, streams: list[int] | None, part: int = 0, parts: int = 1,
                 seed: int | None = None) -> None:
        self.start_id = settings.sequence_id_start
        self.end_id = settings.sequence_id_end  # 0: no end
        self.stride = parts
        self.first = self.start_id + part
        self._next_id = self.first
        self.live: set[int] = set()  # IDs of the sequences going on (a wrapped range skips them)
        self.base_length = settings.sequence_length
        self.variation = settings.sequence_length_variation / 100.0
        # The first request index of each stream, and its length.
        lengths = streams or [1]
        offsets = [sum(lengths[:i]) for i in range(len(lengths))]
        self.streams = list(zip(offsets, lengths))
        self.whole_streams = streams is not None and self.base_length is None
        self._stream = 0
        self.rng = random.Random(seed)

    def _take_id(self) -> int:
        for _ in range(len(self.live) + 1):  # (check_id_range leaves one free)
            sequence_id = self._next_id
            self._next_id += self.stride
            if self.end_id and self._next_id >= self.end_id:
                self._next_id = self.first
            if sequence_id not in self.live:
                self.live.add(sequence_id)
                return sequence_id
        raise RuntimeError(f"every sequence ID of --sequence-id-range is in use ({len(self.live)})")

    def _length(self, stream_length: int) -> int:
        if self.whole_streams:
            return stream_length
        base = self.base_length or DEFAULT_LENGTH
        offset = base * self.rng.uniform(-self.variation, self.variation)
        return max(1, int(base + offset))

    def new(self, ended: int | None = None) -> list[Step]:
        """The steps of the next sequence, for a source whose sequence ``ended`` (its
        ID free again)."""
        self.live.discard(ended)  # type: ignore[arg-type]
        offset, stream_length = self.streams[self._stream]
        self._stream = (self._stream + 1) % len(self.streams)
        length = self._length(stream_length)
        sequence_id = self._take_id()
        return [
            Step(offset + i % stream_length, sequence_id, i == 0, i == length - 1)
            for i in range(length)
        ]


def check_id_range(settings: Any, sequences: list[int]) -> None:
    """perf_analyzer's refusal of an ID range smaller than the sequences kept going at
    once (two would share an ID); ``sequences``: how many each process keeps going,
    from its own share of the IDs."""
    start, end = settings.sequence_id_start, settings.sequence_id_end
    parts = len(sequences)
    for part, most in enumerate(sequences):
        ids = len(range(start + part, end, parts)) if end else most
        if ids < most:
            raise UsageError(
                f"--sequence-id-range {start}:{end} holds {end - start} sequence IDs, fewer than the "
                f"{sum(sequences)} sequences this run keeps going at once"
                + (f" ({most} in each of {parts} processes)" if parts > 1 else "")
            )
