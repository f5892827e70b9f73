"""dlserve perf's sequences (IDs, lengths, streams) and the flags that shape them."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from dlserve.perf.cli import Settings
from dlserve.perf.flags import parse_header, parse_id_range, parse_request_parameter
from dlserve.perf.sequences import SequenceMaker, stream_lengths


def maker(streams: list[int] | None = None, part: int = 0, parts: int = 1, **changes: object) -> SequenceMaker:
    settings = dataclasses.replace(Settings(model="m"), **changes)
    return SequenceMaker(settings, streams, part, parts, seed=1)


def flags(steps) -> list[tuple[bool, bool]]:
    return [(s.start, s.end) for s in steps]


def test_a_sequence_starts_and_ends_once():
    steps = maker(sequence_length=4, sequence_length_variation=0).new()
    assert flags(steps) == [(True, False), (False, False), (False, False), (False, True)]
    assert {s.sequence_id for s in steps} == {1} and {s.data for s in steps} == {0}
    (single,) = maker(sequence_length=1).new()
    assert (single.start, single.end) == (True, True)


def test_ids_count_up_wrap_before_the_end_and_are_split_between_processes():
    def ids(made: SequenceMaker, count: int) -> list[int]:
        taken: list[int] = []
        for _ in range(count):  # one source: each sequence ends before the next
            taken.append(made.new(ended=taken[-1] if taken else None)[0].sequence_id)
        return taken

    assert ids(maker(sequence_id_start=5, sequence_id_end=8), 5) == [5, 6, 7, 5, 6]
    assert ids(maker(part=1, parts=2, sequence_id_start=5, sequence_id_end=9), 3) == [6, 8, 6]


def test_a_wrapped_range_skips_the_ids_of_sequences_still_going():
    ids = maker(sequence_id_start=1, sequence_id_end=4)
    first, second = ids.new()[0].sequence_id, ids.new()[0].sequence_id
    assert (first, second) == (1, 2)
    third = ids.new(ended=first)[0].sequence_id  # 1 ended; 2 goes on
    assert third == 3
    assert ids.new(ended=third)[0].sequence_id == 1  # wraps to 1 (free)
    assert ids.new()[0].sequence_id == 3  # skips 2 (still going)
    with pytest.raises(RuntimeError, match="every sequence ID"):
        ids.new()  # 1, 2 and 3 all going on


def test_lengths_vary_by_the_percentage():
    varied = maker(sequence_length=20, sequence_length_variation=20)
    lengths = {len(varied.new()) for _ in range(200)}
    assert lengths <= set(range(16, 25)) and len(lengths) > 3
    assert {len(maker(sequence_length=20, sequence_length_variation=0).new()) for _ in range(5)} == {20}


def test_the_streams_of_several_files_follow_each_other(tmp_path):
    flat, streams = tmp_path / "flat.json", tmp_path / "streams.json"
    flat.write_text(json.dumps({"data": [{"INPUT": [1]}] * 3}))
    streams.write_text(json.dumps({"data": [[{"INPUT": [1]}] * 2, [{"INPUT": [1]}] * 4]}))
    assert stream_lengths([str(flat), str(streams)]) == [3, 2, 4]
    assert stream_lengths(str(streams)) == [2, 4] and stream_lengths("zero") is None
    # a data directory's one step: sequences of --sequence-length, as perf_analyzer's
    assert stream_lengths([str(tmp_path)]) is None


def test_streams_are_taken_whole_in_turn_unless_a_length_is_given():
    streams = maker(streams=[3, 2])
    assert [[s.data for s in streams.new()] for _ in range(3)] == [[0, 1, 2], [3, 4], [0, 1, 2]]
    fixed = maker(streams=[3, 2], sequence_length=4, sequence_length_variation=0)
    assert [[s.data for s in fixed.new()] for _ in range(2)] == [[0, 1, 2, 0], [3, 4, 3, 4]]


@pytest.mark.parametrize(("text", "expected"), [("1", (1, 0)), ("10:20", (10, 20)), ("3:4", (3, 4))])
def test_id_ranges(text, expected):
    assert parse_id_range(text) == expected


@pytest.mark.parametrize("text", ["0", "5:5", "5:2", "a", "1:2:3", str(2**64)])
def test_bad_id_ranges(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_id_range(text)


def test_request_parameters_and_headers():
    assert parse_request_parameter("max_tokens:256:int") == ("max_tokens", 256)
    assert parse_request_parameter("url:http://x:string") == ("url", "http://x")  # (the value may hold colons)
    assert parse_request_parameter("stream:True:bool") == ("stream", True)
    for bad in ("x:1", "x:1:float", "x:y:int", "x:maybe:bool", ":1:int"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_request_parameter(bad)
    assert parse_header("X-Api-Key: secret:1") == ("X-Api-Key", "secret:1")
    for bad in ("no-colon", "Bad Name: v", ": v"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_header(bad)
