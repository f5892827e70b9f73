"""Triton's HTTP generate extension (``/generate`` and ``/generate_stream``) against
clients nobody here wrote — raw sockets (exact bytes, chunk framing), ``http.client``,
``requests``, ``aiohttp`` and ``curl`` — compared with what real Triton 2.51 answered
(tests/data/triton_reference/decoupled_bls_generate.md, section 3).

One deliberate deviation is asserted as such: plain ``generate`` on a model that
produces 0 or 2+ responses answers 400 (Triton: 200) with Triton's message.

Models: ``generate_echo`` (fixed outputs of several types, and what it saw of the
request), ``generate_batched`` (max_batch_size 8, only required inputs) and the
decoupled test model ``decoupled`` (behaviour picked by the parameter "mode").
"""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import http.client
import json
import socket
import subprocess
import time
import zlib
from typing import Any

import aiohttp
import numpy as np
import pytest
import requests

from dlserve.frontends import KServeHttp

from ..conftest import frontend, serve
from .http_helpers import request

LOADED = ["generate_echo", "generate_batched", "decoupled", "pipeline", "add_sub", "identity"]
EVENT_STREAM = "text/event-stream; charset=utf-8"
FAILED = "Failed to process the request(s) for model 'decoupled_0', message: "
EXACTLY_ONE = (
    "generate expects model to produce exactly 1 response, use generate stream for model that "
    "generates various number of responses"
)
# What generate_echo answers besides the outputs that depend on the request.
ECHO_FIXED = {
    "bool_out": True,
    "empty": [],
    "fp1": 0.5,
    "fp3": [0.10000000149011612, 0.25, 3.0],
    "grid": ["x", "y", "z", "w"],
    "int3": [1, 2, 3],
    "model_name": "generate_echo",
    "model_version": "1",
}


# -- server ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def port(tmp_path_factory: pytest.TempPathFactory):
    for server in serve(tmp_path_factory, LOADED):
        assert server.ready()
        yield from frontend(KServeHttp, server)


def url(port: int, model: str, route: str = "generate") -> str:
    return f"http://127.0.0.1:{port}/v2/models/{model}/{route}"


# -- raw HTTP/1.1 --------------------------------------------------------------------------
@dataclasses.dataclass
class Raw:
    status_line: str
    headers: dict[str, str]  # lower-cased names
    chunks: list[bytes] | None  # None: framed by Content-Length
    body: bytes  # de-chunked
    wire: bytes  # everything received for this response, framing included

    @property
    def status(self) -> int:
        return int(self.status_line.split(" ")[1])

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[Any]:
        """The SSE events, checking each HTTP chunk is exactly one ``data: ...\\n\\n``."""
        assert self.chunks is not None, "not chunked"
        out = []
        for chunk in self.chunks:
            assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n"), chunk
            assert chunk.count(b"\n") == 2, chunk  # one line, then the blank line
            out.append(json.loads(chunk[len(b"data: ") : -2]))
        return out


class Wire:
    """A client socket that reads HTTP/1.1 responses one after the other, checking
    the chunked framing byte by byte (no trailers, CRLF after every chunk)."""

    def __init__(self, port: int, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.settimeout(timeout)
        self.buffer = b""
        self.taken = b""

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> None:
        data = self.sock.recv(1 << 16)
        if not data:
            raise EOFError(f"connection closed; unread: {self.buffer!r}")
        self.buffer += data

    def _take(self, n: int) -> bytes:
        while len(self.buffer) < n:
            self._fill()
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        self.taken += out
        return out

    def _line(self) -> bytes:
        while b"\r\n" not in self.buffer:
            self._fill()
        return self._take(self.buffer.index(b"\r\n") + 2)[:-2]

    def response(self) -> Raw:
        self.taken = b""
        status_line = self._line().decode("latin-1")
        headers: dict[str, str] = {}
        while line := self._line():
            name, _, value = line.decode("latin-1").partition(":")
            assert name.lower() not in headers, f"duplicate header {name}"
            headers[name.strip().lower()] = value.strip()
        chunks = None
        if headers.get("transfer-encoding") == "chunked":
            assert "content-length" not in headers
            chunks = []
            while size := int(self._line(), 16):
                chunks.append(self._take(size))
                assert self._take(2) == b"\r\n"
            assert self._line() == b"", "trailers or junk after the last chunk"
            body = b"".join(chunks)
        else:
            body = self._take(int(headers["content-length"]))
        return Raw(status_line, headers, chunks, body, self.taken)


def post_bytes(path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {"Content-Type": "application/json"}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def raw_post(port: int, path: str, body: Any, headers: dict[str, str] | None = None) -> Raw:
    """One POST on a fresh socket; ``body`` is JSON-encoded unless it is bytes."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    wire = Wire(port)
    try:
        wire.send(post_bytes(path, data, headers))
        return wire.response()
    finally:
        wire.close()


def gen_path(model: str, route: str = "generate", version: str | None = None) -> str:
    versions = f"/versions/{version}" if version else ""
    return f"/v2/models/{model}{versions}/{route}"


def event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def out(v: int) -> dict[str, Any]:
    return {"OUT": v, "model_name": "decoupled", "model_version": "1"}


def echo(port: int, body: dict[str, Any]) -> dict[str, Any]:
    reply = raw_post(port, gen_path("generate_echo"), body)
    assert reply.status == 200, reply.body
    return reply.json()


def notes(port: int) -> list[str]:
    """What the decoupled model noted (mode "notes"), read through generate itself."""
    reply = raw_post(port, gen_path("decoupled"), {"IN": [0], "parameters": {"mode": "notes"}})
    assert reply.status == 200, reply.body
    return json.loads(reply.json()["INFO"])


def eventually(check, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return False


# -- generate: the flat JSON answer ---------------------------------------------------------
def test_generate_answers_one_flat_object_with_sorted_keys(port):
    reply = raw_post(port, gen_path("generate_echo"), {"text_input": "hello"})
    assert reply.status_line == "HTTP/1.1 200 OK"
    assert reply.headers["content-type"] == "application/json"
    seen = {"text_input": {"dtype": "object", "shape": [1], "values": ["hello"]}}
    expected = (
        b'{"bool_out":true,"empty":[],"fp1":0.5,"fp3":[0.10000000149011612,0.25,3.0],'
        b'"grid":["x","y","z","w"],"inputs_seen":'
        + json.dumps(json.dumps(seen, sort_keys=True)).encode()
        + b',"int3":[1,2,3],"int_out":42,"model_name":"generate_echo","model_version":"1",'
        b'"params":"{}","text_output":"echo:hello"}'
    )
    assert reply.body == expected


def test_an_ensembles_answer_has_its_sequence_fields_as_in_triton(port):
    """Triton 2.51 renders a response's parameters as members too (measured on its QA
    mock_llm_ensemble: an ensemble answers with the request's sequence fields)."""
    reply = raw_post(port, gen_path("pipeline"), {"A": [1.0] * 16, "B": [1.0] * 16})
    assert reply.status_line == "HTTP/1.1 200 OK", reply.body
    answer = json.loads(reply.body)
    assert answer["SUM"] == [2.0] * 16 and answer["DIFF"] == [0.0] * 16
    assert {k: answer[k] for k in ("sequence_end", "sequence_id", "sequence_start")} == {
        "sequence_end": False, "sequence_id": 0, "sequence_start": False,
    }


def test_generate_spells_nan_and_infinities_as_triton_does(port):
    reply = raw_post(port, gen_path("generate_echo"), {"text_input": "nan"})
    assert reply.status == 200
    answer = json.loads(reply.body)  # Python's json reads NaN / Infinity, as Triton writes them
    assert np.isnan(answer["fp1"]) and answer["fp3"][1:] == [float("inf"), -float("inf")]


def test_keys_sort_by_byte_order_and_id_is_echoed(port):
    body = {"IN": [7], "id": "myid", "parameters": {"mode": "final_with_last"}}
    reply = raw_post(port, gen_path("decoupled"), body)
    assert reply.status == 200
    # uppercase sorts before lowercase; no "outputs", datatype or shape anywhere
    assert reply.body == b'{"OUT":7,"id":"myid","model_name":"decoupled","model_version":"1"}'
    body = echo(port, {"text_input": "a", "id": "r-1"})
    keys = list(body)
    assert keys == sorted(keys, key=lambda k: k.encode()) and body["id"] == "r-1"


def test_no_id_key_without_an_id(port):
    assert "id" not in echo(port, {"text_input": "a"})
    assert "id" not in echo(port, {"text_input": "a", "id": ""})


def test_inputs_from_matching_keys(port):
    body = echo(
        port,
        {
            "text_input": ["hi"],
            "int_in": 7,
            "fp_in": [0.1, 0.2, 0.3],
            "bool_in": True,
            "vec": [4, 5, 6],
        },
    )
    seen = json.loads(body["inputs_seen"])
    assert seen == {
        "bool_in": {"dtype": "bool", "shape": [1], "values": [True]},
        "fp_in": {
            "dtype": "float32",
            "shape": [3],
            "values": [0.10000000149011612, 0.20000000298023224, 0.30000001192092896],
        },
        "int_in": {"dtype": "int32", "shape": [1], "values": [7]},
        "text_input": {"dtype": "object", "shape": [1], "values": ["hi"]},
        "vec": {"dtype": "int64", "shape": [3], "values": [4, 5, 6]},
    }
    assert body["int_out"] == 7 and body["text_output"] == "echo:hi"
    assert {k: body[k] for k in ECHO_FIXED} == ECHO_FIXED


def test_scalar_and_one_element_list_both_give_shape_1(port):
    for vec in (5, [5]):
        seen = json.loads(echo(port, {"text_input": "a", "vec": vec})["inputs_seen"])
        assert seen["vec"] == {"dtype": "int64", "shape": [1], "values": [5]}
    seen = json.loads(echo(port, {"text_input": "a", "vec": []})["inputs_seen"])
    assert seen["vec"] == {"dtype": "int64", "shape": [0], "values": []}


def test_batched_model_gets_a_leading_1_and_answers_scalars(port):
    reply = raw_post(port, gen_path("generate_batched"), {"text_input": "b"})
    assert reply.status == 200, reply.body
    # text_output [1,1] is one element: a scalar; shape [1,2] is flat
    assert reply.body == (
        b'{"model_name":"generate_batched","model_version":"1",'
        b'"shape":[1,1],"text_output":"echo:b"}'
    )


def test_batched_model_takes_the_batch_from_values_that_fill_fixed_dims(port):
    """Triton's reading: with max_batch_size > 0 and fixed dims, N times the dims' worth of
    values is a batch of N (a wildcard in the dims keeps the batch at one)."""
    reply = raw_post(port, gen_path("generate_batched"), {"text_input": ["a", "b"]})
    assert reply.status == 200, reply.body
    assert reply.json()["shape"] == [2, 1, 2, 1] and reply.json()["text_output"] == ["echo:a", "echo:b"]
    reply = raw_post(port, gen_path("generate_batched"), {"text_input": list("abcdefghi")})
    assert reply.status == 400
    assert "inference request batch-size must be <= 8 for 'generate_batched'" in reply.json()["error"]


def test_parameters_naming_inputs_are_inputs(port):
    """As in Triton: a member of ``parameters`` named like an input is that input, not a
    parameter (LLM clients send e.g. max_tokens there)."""
    body = echo(port, {"parameters": {"text_input": "via parameters", "int_in": 5, "n": 1}})
    assert body["text_output"] == "echo:via parameters" and body["int_out"] == 5
    assert json.loads(body["params"]) == {"n": 1}
    seen = json.loads(body["inputs_seen"])
    assert seen["int_in"] == {"dtype": "int32", "shape": [1], "values": [5]}
    for route in ROUTES:
        reply = raw_post(port, gen_path("generate_echo", route), {"text_input": "a", "parameters": {"text_input": "b"}})
        assert check_plain_error(reply, 400) == "input 'text_input' already exists in request"
        reply = raw_post(port, gen_path("generate_echo", route), {"parameters": {"text_input": "a", "int_in": "x"}})
        assert "INT32 data must be JSON integers" in check_plain_error(reply, 400)
        # an input named twice at the top (upstream test_duplicate_inputs): refused, not the last taken
        twice = b'{"text_input": "hello", "n": 1, "text_input": "again"}'
        reply = raw_post(port, gen_path("generate_echo", route), twice)
        assert check_plain_error(reply, 400) == "input 'text_input' already exists in request"
    # the name's text twice, but once as a key: as before
    body = echo(port, {"text_input": "text_input", "parameters": {"note": "text_input"}})
    assert body["text_output"] == "echo:text_input"


def test_other_keys_and_parameters_reach_the_model(port):
    body = echo(
        port,
        {
            "text_input": "p",
            "unknown_key": 1,
            "max_tokens": 16,
            "parameters": {"x": 0.5, "n": 3, "foo": "bar", "flag": True, "triton_foo": "kept"},
        },
    )
    assert json.loads(body["params"]) == {
        "unknown_key": 1,
        "max_tokens": 16,
        "x": 0.5,
        "n": 3,
        "foo": "bar",
        "flag": True,
        "triton_foo": "kept",  # generate does not reject triton_* keys; they reach the model
    }
    # only outputs and the fixed keys in the answer: parameters are not echoed
    assert set(body) == set(ECHO_FIXED) | {"text_output", "int_out", "params", "inputs_seen"}


def test_id_is_also_a_parameter(port):
    body = echo(port, {"text_input": "p", "id": "myid"})
    assert body["id"] == "myid"
    assert json.loads(body["params"]) == {"id": "myid"}


def test_reserved_parameters_are_not_forwarded(port):
    parameters = {"priority": 1, "triton_enable_empty_final_response": True}
    body = echo(port, {"text_input": "p", "parameters": parameters})
    assert json.loads(body["params"]) == {}


def test_versioned_path(port):
    reply = raw_post(port, gen_path("generate_echo", version="1"), {"text_input": "v"})
    assert reply.status == 200 and reply.json()["model_version"] == "1"


def test_model_error_response_is_a_plain_error(port):
    reply = raw_post(port, gen_path("generate_echo"), {"text_input": "x", "fail": True})
    assert reply.status >= 400  # the exact status: test_model_errors_are_400 below
    assert reply.headers["content-type"] == "application/json"
    assert reply.body == b'{"error":"probe gen error"}'


@pytest.mark.parametrize(
    "model,body",
    [
        ("generate_echo", {"text_input": "x", "fail": True}),
        ("decoupled", {"IN": [], "parameters": {"mode": "raise_after_one"}}),
    ],
    ids=["error-response", "exception"],
)
def test_model_errors_are_400(port, model, body):
    assert raw_post(port, gen_path(model), body).status == 400


# -- generate on the decoupled model ---------------------------------------------------------
@pytest.mark.parametrize("mode", ["final_with_last", "stream"])
def test_generate_on_decoupled_model_with_one_response(port, mode):
    # one response carrying FINAL, or one response then a flag-only FINAL
    reply = raw_post(port, gen_path("decoupled"), {"IN": [4], "parameters": {"mode": mode}})
    assert reply.status == 200
    assert reply.headers["content-type"] == "application/json"
    assert reply.body == b'{"OUT":4,"model_name":"decoupled","model_version":"1"}'


@pytest.mark.parametrize(
    "values,mode", [([1, 2, 3], "final_with_last"), ([1, 2, 3], "stream"), ([], "stream")]
)
def test_generate_on_decoupled_model_with_0_or_many_responses_is_400(port, values, mode):
    """Deliberate deviation: Triton answers this with 200 (and the same body)."""
    reply = raw_post(port, gen_path("decoupled"), {"IN": values, "parameters": {"mode": mode}})
    assert reply.status == 400
    assert reply.headers["content-type"] == "application/json"
    assert reply.json() == {"error": EXACTLY_ONE}


def test_generate_exception_before_any_response_is_a_plain_error(port):
    # raise_after_one with no IN element raises IndexError before sending anything
    body = {"IN": [], "parameters": {"mode": "raise_after_one"}}
    reply = raw_post(port, gen_path("decoupled"), body)
    assert reply.status >= 400  # the exact status: test_model_errors_are_400
    error = check_plain_error(reply, reply.status)
    assert error.startswith(FAILED + "IndexError: list index out of range")


# -- generate_stream: server-sent events -----------------------------------------------------
def test_stream_exact_bytes(port):
    reply = raw_post(port, gen_path("decoupled", "generate_stream"), {"IN": [0, 1, 2]})
    assert reply.status_line == "HTTP/1.1 200 OK"
    assert reply.headers["content-type"] == EVENT_STREAM
    assert reply.headers["transfer-encoding"] == "chunked"
    body = reply.wire.partition(b"\r\n\r\n")[2]
    assert body == (
        b'3e\r\ndata: {"OUT":0,"model_name":"decoupled","model_version":"1"}\n\n\r\n'
        b'3e\r\ndata: {"OUT":1,"model_name":"decoupled","model_version":"1"}\n\n\r\n'
        b'3e\r\ndata: {"OUT":2,"model_name":"decoupled","model_version":"1"}\n\n\r\n'
        b"0\r\n\r\n"
    )
    assert reply.events() == [out(0), out(1), out(2)]  # no event for the flag-only final, no [DONE]


def test_stream_final_with_last_and_id(port):
    reply = raw_post(
        port,
        gen_path("decoupled", "generate_stream", version="1"),
        {"IN": [5, 6, 7], "id": "s1", "parameters": {"mode": "final_with_last"}},
    )
    assert reply.status == 200
    assert reply.events() == [{**out(v), "id": "s1"} for v in (5, 6, 7)]
    assert reply.chunks[0] == (
        b'data: {"OUT":5,"id":"s1","model_name":"decoupled","model_version":"1"}\n\n'
    )


def test_stream_many_events_in_order_from_a_thread(port):
    reply = raw_post(
        port,
        gen_path("decoupled", "generate_stream"),
        {"IN": list(range(50)), "parameters": {"mode": "thread"}},
    )
    assert reply.status == 200
    assert reply.events() == [out(v) for v in range(50)]


def test_stream_empty_final_response_parameter_has_no_visible_effect(port):
    reply = raw_post(
        port,
        gen_path("decoupled", "generate_stream"),
        {"IN": [1, 2], "parameters": {"triton_enable_empty_final_response": True}},
    )
    assert reply.status == 200 and reply.events() == [out(1), out(2)]


def test_stream_on_a_non_decoupled_model_is_one_event(port):
    reply = raw_post(port, gen_path("generate_echo", "generate_stream"), {"text_input": "s"})
    assert reply.status == 200 and reply.headers["content-type"] == EVENT_STREAM
    (only,) = reply.events()
    assert only["text_output"] == "echo:s" and {k: only[k] for k in ECHO_FIXED} == ECHO_FIXED


def test_stream_zero_responses_is_200_and_empty(port):
    body = {"IN": [], "parameters": {"mode": "stream"}}
    reply = raw_post(port, gen_path("decoupled", "generate_stream"), body)
    assert reply.status == 200 and reply.headers["content-type"] == EVENT_STREAM
    assert reply.chunks == [] and reply.wire.endswith(b"\r\n\r\n0\r\n\r\n")


def test_stream_error_after_events_is_an_error_event(port):
    body = {"IN": [5, 6], "parameters": {"mode": "error_mid"}}
    reply = raw_post(port, gen_path("decoupled", "generate_stream"), body)
    assert reply.status == 200 and reply.headers["content-type"] == EVENT_STREAM
    assert reply.chunks == [
        b'data: {"OUT":5,"model_name":"decoupled","model_version":"1"}\n\n',
        b'data: {"error":"failed halfway"}\n\n',
    ]


def test_stream_exception_after_one_event_ends_the_stream_with_an_error_event(port):
    reply = raw_post(
        port,
        gen_path("decoupled", "generate_stream"),
        {"IN": [3], "parameters": {"mode": "raise_after_one"}},
    )
    assert reply.status == 200
    first, error = reply.events()
    assert first == out(3)
    assert set(error) == {"error"}
    assert error["error"].startswith(FAILED)
    assert "execute broke after one response" in error["error"]
    # the traceback's newlines are escaped in the JSON: still one line
    assert b"\\n" in reply.chunks[1] and reply.chunks[1].count(b"\n") == 2


def test_stream_error_as_first_response_is_400_and_the_rest_follows(port):
    """Triton's stream: the first response's error makes the status 400, and the model's
    later responses are not lost: they follow as events."""
    body = {"IN": [7, 8], "parameters": {"mode": "error_first"}}
    reply = raw_post(port, gen_path("decoupled", "generate_stream"), body)
    assert reply.status_line == "HTTP/1.1 400 Bad Request"
    assert reply.headers["content-type"] == EVENT_STREAM
    assert reply.events() == [{"error": "failed first"}, out(7), out(8)]


@pytest.mark.parametrize(
    "model,body,error",
    [
        ("generate_echo", {"text_input": "x", "fail": True}, "probe gen error"),
        ("decoupled", {"IN": [], "parameters": {"mode": "error_mid"}}, None),  # IndexError first
    ],
)
def test_stream_error_as_first_response_is_400_with_one_event(port, model, body, error):
    reply = raw_post(port, gen_path(model, "generate_stream"), body)
    assert reply.status_line == "HTTP/1.1 400 Bad Request"
    assert reply.headers["content-type"] == EVENT_STREAM
    assert reply.body.startswith(b"data: ") and reply.body.endswith(b"\n\n")
    assert reply.body.count(b"\n") == 2
    (only,) = [json.loads(reply.body[6:-2])]
    assert set(only) == {"error"}
    if error is not None:
        assert reply.body == event({"error": error})
    else:
        assert only["error"].startswith(FAILED + "IndexError: list index out of range")


# -- errors before inference: plain JSON, not SSE -------------------------------------------
ROUTES = ["generate", "generate_stream"]


def check_plain_error(reply: Raw, status: int) -> str:
    assert reply.status == status, reply.wire
    assert reply.headers["content-type"] == "application/json"
    assert reply.chunks is None and "content-length" in reply.headers  # not a stream
    assert not reply.body.startswith(b"data:")
    return reply.json()["error"]


@pytest.mark.parametrize("route", ROUTES)
def test_unknown_model_and_version_are_404(port, route):
    error = check_plain_error(raw_post(port, gen_path("nope", route), {"text_input": "x"}), 404)
    assert error == "Request for unknown model: 'nope' is not found"
    reply = raw_post(port, gen_path("generate_echo", route, version="7"), {"text_input": "x"})
    error = check_plain_error(reply, 404)
    assert error == "Request for unknown model: 'generate_echo' version 7 is not found"


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("body", [b"not json", b"", b"[1,2]", b'"text"', b'{"text_input": '])
def test_bad_json_is_400(port, route, body):
    error = check_plain_error(raw_post(port, gen_path("generate_echo", route), body), 400)
    assert error


@pytest.mark.parametrize("route", ROUTES)
def test_bad_json_names_the_json_buffer(port, route):
    error = check_plain_error(raw_post(port, gen_path("generate_echo", route), b"not json"), 400)
    assert error.startswith("failed to parse the request JSON buffer: ")


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "body,name",
    [
        ({"text_input": "x", "int_in": "abc"}, "int_in"),
        ({"text_input": "x", "int_in": {"a": 1}}, "int_in"),
        ({"text_input": "x", "fp_in": ["a", "b", "c"]}, "fp_in"),
        ({"text_input": "x", "vec": [1, "two"]}, "vec"),
        ({"text_input": [["a"], "b"]}, "text_input"),
        ({"text_input": {"k": "v"}}, "text_input"),
    ],
)
def test_wrong_type_for_an_input_is_400_naming_it(port, route, body, name):
    error = check_plain_error(raw_post(port, gen_path("generate_echo", route), body), 400)
    assert f"'{name}'" in error


@pytest.mark.parametrize(
    "body",
    [
        {"text_input": "x", "int_in": "5"},
        {"text_input": "x", "int_in": 5.5},
        {"text_input": "x", "int_in": True},
        {"text_input": "x", "bool_in": 1},
        {"text_input": None},
    ],
    ids=["int-from-string", "int-from-float", "int-from-bool", "bool-from-int", "bytes-from-null"],
)
def test_json_values_of_another_type_are_refused(port, body):
    reply = raw_post(port, gen_path("generate_echo"), body)
    assert reply.status >= 400, reply.body


@pytest.mark.parametrize("route", ROUTES)
def test_wrong_number_of_elements_is_400(port, route):
    body = {"text_input": "x", "fp_in": [1.0, 2.0]}
    reply = raw_post(port, gen_path("generate_echo", route), body)
    assert "'fp_in'" in check_plain_error(reply, 400)


@pytest.mark.parametrize("route", ROUTES)
def test_missing_required_input_is_400_with_tritons_message(port, route):
    reply = raw_post(port, gen_path("generate_batched", route), {"parameters": {"x": 1}})
    assert check_plain_error(reply, 400) == (
        "[request id: <id_unknown>] expected 1 inputs but got 0 inputs for model "
        "'generate_batched'. Got input(s) [], but missing required input(s) ['text_input']. "
        "Please provide all required input(s)."
    )
    # With optional inputs too, Triton counts a range (measured on Triton 2.51).
    reply = raw_post(port, gen_path("generate_echo", route), {"int_in": 1})
    assert check_plain_error(reply, 400).startswith(
        "[request id: <id_unknown>] expected number of inputs between 1 and 5 but got 1 inputs "
        "for model 'generate_echo'. Got input(s) ['int_in'], but missing required input(s) "
        "['text_input']."
    )


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "body",
    [
        {"text_input": "x", "parameters": {"nested": {"a": 1}}},
        {"text_input": "x", "parameters": {"nested": [1]}},
        {"text_input": "x", "parameters": 5},
        {"text_input": "x", "id": 5},
    ],
)
def test_bad_parameters_or_id_are_400(port, route, body):
    check_plain_error(raw_post(port, gen_path("generate_echo", route), body), 400)


@pytest.mark.parametrize("route", ROUTES)
def test_get_is_405(port, route):
    reply = request(port, "GET", gen_path("generate_echo", route))
    assert reply.status == 405 and reply.body == b'{"error":"Method Not Allowed"}'


# -- /infer on a decoupled model ----------------------------------------------------------------
@pytest.mark.parametrize(
    "path", ["/v2/models/decoupled/infer", "/v2/models/decoupled/versions/1/infer"]
)
@pytest.mark.parametrize(
    "body", [b'{"inputs":[{"name":"IN","datatype":"INT32","shape":[1],"data":[1]}]}', b"not json"]
)
def test_infer_on_a_decoupled_model_is_501(port, path, body):
    reply = raw_post(port, path, body)
    assert reply.status_line == "HTTP/1.1 501 Not Implemented"
    assert reply.body == (
        b'{"error":"HTTP end point doesn\'t support models with decoupled transaction policy"}'
    )
    assert reply.headers["content-length"] == "83"


# -- real clients ---------------------------------------------------------------------------
def test_requests_streams_the_events(port):
    with requests.post(
        url(port, "decoupled", "generate_stream"),
        json={"IN": [10, 11, 12], "parameters": {"mode": "thread", "delay_ms": 5}},
        stream=True,
        timeout=10,
    ) as reply:
        assert reply.status_code == 200
        assert reply.headers["Content-Type"] == EVENT_STREAM
        assert reply.headers["Transfer-Encoding"] == "chunked"
        lines = list(reply.iter_lines())
    expected = []
    for v in (10, 11, 12):  # iter_lines splits "data: ...\n\n" into the line and an empty one
        expected += [b'data: {"OUT":%d,"model_name":"decoupled","model_version":"1"}' % v, b""]
    assert lines == expected


def test_requests_generate_and_errors(port):
    reply = requests.post(
        url(port, "generate_echo"), json={"text_input": "rq", "id": "7"}, timeout=10
    )
    assert reply.status_code == 200 and reply.headers["Content-Type"] == "application/json"
    body = reply.json()
    assert body["id"] == "7" and body["text_output"] == "echo:rq"
    reply = requests.post(url(port, "decoupled"), json={"IN": [1, 2, 3]}, timeout=10)
    assert reply.status_code == 400 and reply.json() == {"error": EXACTLY_ONE}
    reply = requests.post(url(port, "decoupled", "infer"), json={}, timeout=10)
    assert reply.status_code == 501


def test_aiohttp_reads_the_stream(port):
    async def run() -> tuple[int, str, list[bytes], int]:
        async with aiohttp.ClientSession() as session:
            async with session.post(
                url(port, "decoupled", "generate_stream"),
                json={"IN": [1, 2], "parameters": {"mode": "error_mid"}},
            ) as reply:
                lines = [line async for line in reply.content]
                status, content_type = reply.status, reply.headers["Content-Type"]
            empty_stream = session.post(url(port, "decoupled", "generate_stream"), json={"IN": []})
            async with empty_stream as empty:
                assert await empty.read() == b""
                return status, content_type, lines, empty.status

    status, content_type, lines, empty_status = asyncio.run(run())
    assert (status, content_type, empty_status) == (200, EVENT_STREAM, 200)
    assert lines == [
        b'data: {"OUT":1,"model_name":"decoupled","model_version":"1"}\n',
        b"\n",
        b'data: {"error":"failed halfway"}\n',
        b"\n",
    ]


def curl(port: int, path: str, data: bytes, *headers: str) -> tuple[bytes, bytes]:
    args = ["curl", "-sS", "-N", "-i", "--max-time", "10", "-X", "POST", "--data-binary", "@-"]
    for header in ("Content-Type: application/json", *headers):
        args += ["-H", header]
    done = subprocess.run(
        [*args, f"http://127.0.0.1:{port}{path}"],
        input=data,
        capture_output=True,
        timeout=20,
        check=True,
    )
    head, _, body = done.stdout.partition(b"\r\n\r\n")
    return head, body


def test_curl_streams_the_events(port):
    head, body = curl(port, gen_path("decoupled", "generate_stream"), b'{"IN":[8,9]}')
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"\r\nContent-Type: text/event-stream; charset=utf-8" in head
    assert b"\r\nTransfer-Encoding: chunked" in head
    assert body == event(out(8)) + event(out(9))


def test_curl_gzip_request_body(port):
    data = gzip.compress(b'{"IN":[1],"parameters":{"mode":"final_with_last"}}')
    head, body = curl(port, gen_path("decoupled"), data, "Content-Encoding: gzip")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert body == b'{"OUT":1,"model_name":"decoupled","model_version":"1"}'


# -- gzip ------------------------------------------------------------------------------------
@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_compressed_request_body_is_accepted(port, encoding):
    plain = json.dumps({"text_input": "zipped", "parameters": {"k": "v"}}).encode()
    data = gzip.compress(plain) if encoding == "gzip" else zlib.compress(plain)
    reply = raw_post(
        port,
        gen_path("generate_echo"),
        data,
        {"Content-Type": "application/json", "Content-Encoding": encoding},
    )
    assert reply.status == 200, reply.body
    assert reply.json()["text_output"] == "echo:zipped"
    assert json.loads(reply.json()["params"]) == {"k": "v"}
    reply = raw_post(
        port,
        gen_path("decoupled", "generate_stream"),
        gzip.compress(b'{"IN":[3,4]}'),
        {"Content-Type": "application/json", "Content-Encoding": "gzip"},
    )
    assert reply.status == 200 and reply.events() == [out(3), out(4)]


def test_corrupt_gzip_body_is_a_plain_400(port):
    reply = raw_post(
        port,
        gen_path("generate_echo"),
        b"not gzip",
        {"Content-Type": "application/json", "Content-Encoding": "gzip"},
    )
    assert check_plain_error(reply, 400)


# -- connections: keep-alive, pipelining, disconnects --------------------------------------------
def test_keep_alive_two_streams_on_one_connection(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        for values in ([1, 2], [3, 4, 5]):
            conn.request(
                "POST",
                gen_path("decoupled", "generate_stream"),
                body=json.dumps({"IN": values}),
                headers={"Content-Type": "application/json"},
            )
            reply = conn.getresponse()
            assert reply.status == 200 and reply.getheader("Transfer-Encoding") == "chunked"
            assert reply.read() == b"".join(event(out(v)) for v in values)
            assert not reply.will_close
        sock = conn.sock
        conn.request("POST", gen_path("generate_echo"), body=b'{"text_input":"after"}')
        reply = conn.getresponse()
        assert reply.status == 200 and json.loads(reply.read())["text_output"] == "echo:after"
        assert conn.sock is sock  # the same connection all along
    finally:
        conn.close()


def test_pipelined_streams_and_errors_on_one_connection(port):
    wire = Wire(port)
    try:
        stream = gen_path("decoupled", "generate_stream")
        wire.send(
            post_bytes(stream, b'{"IN":[1,2],"parameters":{"mode":"thread","delay_ms":20}}')
            + post_bytes(stream, b'{"IN":[3]}')
            + post_bytes(stream, b"not json")
            + post_bytes(stream, b'{"IN":[],"parameters":{"mode":"error_mid"}}')
            + post_bytes(gen_path("decoupled"), b'{"IN":[4]}')
            + post_bytes(stream, b'{"IN":[]}')
        )
        first, second, bad, failed, plain, empty = (wire.response() for _ in range(6))
        assert first.status == 200 and first.events() == [out(1), out(2)]
        assert second.status == 200 and second.events() == [out(3)]
        assert bad.status == 400 and bad.headers["content-type"] == "application/json"
        assert failed.status == 400 and failed.headers["content-type"] == EVENT_STREAM
        assert plain.status == 200 and plain.json() == out(4)
        assert empty.status == 200 and empty.chunks == []
        replies = (first, second, bad, failed, plain, empty)
        assert all("connection" not in r.headers for r in replies)  # kept alive throughout
        wire.sock.settimeout(0.2)
        with pytest.raises(TimeoutError):
            wire._fill()  # nothing more: no stray bytes after the last response, still open
    finally:
        wire.close()


def test_connection_close_after_a_stream(port):
    reply = raw_post(
        port, gen_path("decoupled", "generate_stream"), {"IN": [1]},
        {"Content-Type": "application/json", "Connection": "close"},
    )
    assert reply.status == 200 and reply.headers["connection"] == "close"
    assert reply.events() == [out(1)]


def test_client_disconnect_mid_stream_cancels_and_server_keeps_serving(port):
    seen = notes(port).count("cancelled while streaming")
    total = 400
    received = []
    with requests.post(
        url(port, "decoupled", "generate_stream"),
        json={"IN": list(range(total)), "parameters": {"mode": "thread", "delay_ms": 10}},
        stream=True,
        timeout=10,
    ) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line:
                received.append(json.loads(line.removeprefix(b"data: ")))
            if len(received) == 3:
                break
        # while that stream runs, other connections are served
        assert echo(port, {"text_input": "meanwhile"})["text_output"] == "echo:meanwhile"
        body = {"IN": [9], "parameters": {"mode": "thread"}}
        other = raw_post(port, gen_path("decoupled", "generate_stream"), body)
        assert other.events() == [out(9)]
    # leaving the block closed the half-read response, and with it the connection
    assert received == [out(0), out(1), out(2)]
    assert eventually(lambda: notes(port).count("cancelled while streaming") == seen + 1)
    reply = raw_post(port, gen_path("decoupled", "generate_stream"), {"IN": [1, 2]})
    assert reply.status == 200 and reply.events() == [out(1), out(2)]


def test_half_sent_request_does_not_disturb_others(port):
    sock = socket.create_connection(("127.0.0.1", port))
    try:
        sock.sendall(post_bytes(gen_path("decoupled", "generate_stream"), b'{"IN":[1,2,3]}')[:-5])
        reply = raw_post(port, gen_path("decoupled", "generate_stream"), {"IN": [1]})
        assert reply.events() == [out(1)]
    finally:
        sock.close()
    assert raw_post(port, gen_path("decoupled"), {"IN": [2]}).json() == out(2)
