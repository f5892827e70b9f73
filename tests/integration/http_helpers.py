"""Small HTTP/1.1 tools for the HTTP frontend tests: one-shot requests through
``http.client``, raw socket exchanges, and a parser for a stream of responses
(pipelining, keep-alive, answers to malformed requests)."""

from __future__ import annotations

import dataclasses
import http.client
import json
import socket
import time
from typing import Any

import numpy as np


@dataclasses.dataclass
class Reply:
    status: int
    headers: dict[str, str]  # lower-cased names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def error(self) -> str:
        return self.json()["error"]


def request(
    port: int,
    method: str,
    path: str,
    body: bytes | str | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 10.0,
) -> Reply:
    """One request on a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        data = response.read()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, data)
    finally:
        conn.close()


def exchange(
    port: int, data: bytes, timeout: float = 5.0, until_close: bool = True
) -> tuple[bytes, bool]:
    """Send ``data`` on a new socket and read until the server closes it.

    Returns (bytes received, closed by server). ``closed`` is False when the
    server kept the connection open past ``timeout`` (or, with ``until_close``
    False, as soon as one full response is in).
    """
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(timeout)
    received = b""
    closed = False
    try:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may answer and close before taking everything
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(1 << 16)
            except TimeoutError:
                break
            except ConnectionResetError:
                closed = True
                break
            if not chunk:
                closed = True
                break
            received += chunk
            if not until_close and parse_responses(received, strict=False):
                break
    finally:
        sock.close()
    return received, closed


def parse_responses(data: bytes, strict: bool = True) -> list[Reply]:
    """Split a byte stream into HTTP/1.1 responses framed by Content-Length."""
    replies = []
    rest = data
    while rest:
        head_end = rest.find(b"\r\n\r\n")
        if head_end < 0:
            if strict:
                raise AssertionError(f"incomplete response head: {rest[:200]!r}")
            break
        lines = rest[:head_end].decode("latin-1").split("\r\n")
        version, status, *_ = lines[0].split(" ", 2)
        assert version == "HTTP/1.1", lines[0]
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        body_start = head_end + 4
        if len(rest) < body_start + length:
            if strict:
                raise AssertionError(f"truncated response body: {rest[:200]!r}")
            break
        replies.append(Reply(int(status), headers, rest[body_start : body_start + length]))
        rest = rest[body_start + length :]
    return replies


def http_request(
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    content_length: bool = True,
) -> bytes:
    """The bytes of one HTTP/1.1 request (Content-Length set from ``body`` unless told not to)."""
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}")
    if content_length and body and not any(k.lower() == "content-length" for k in (headers or {})):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def binary_infer_body(
    inputs: list[tuple[str, str, list[int], bytes | None, Any]],
    outputs: list[dict[str, Any]] | None = None,
    parameters: dict[str, Any] | None = None,
    request_id: str | None = None,
) -> tuple[bytes, int]:
    """A KServe v2 request with the binary extension.

    ``inputs`` are (name, datatype, shape, raw bytes or None, JSON data); an input
    with raw bytes is sent as binary, one with None as JSON ``data``. Returns
    (body, Inference-Header-Content-Length).
    """
    entries = []
    blobs = []
    for name, datatype, shape, raw, data in inputs:
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": shape}
        if raw is not None:
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = data
        entries.append(entry)
    header: dict[str, Any] = {"inputs": entries}
    if outputs is not None:
        header["outputs"] = outputs
    if parameters is not None:
        header["parameters"] = parameters
    if request_id is not None:
        header["id"] = request_id
    text = json.dumps(header).encode()
    return text + b"".join(blobs), len(text)


def split_binary_response(reply: Reply) -> tuple[dict[str, Any], dict[str, bytes]]:
    """(JSON header, {output name: raw bytes}) of a response using the binary extension."""
    length = int(reply.headers.get("inference-header-content-length", len(reply.body)))
    header = json.loads(reply.body[:length])
    blobs = {}
    position = length
    for output in header["outputs"]:
        size = output.get("parameters", {}).get("binary_data_size")
        if size is not None:
            blobs[output["name"]] = reply.body[position : position + size]
            position += size
    assert position == len(reply.body), "binary data beyond what the outputs claim"
    return header, blobs


def bytes_tensor(values: list[bytes]) -> bytes:
    """Triton's binary BYTES layout: a 4-byte little-endian length before each element."""
    return b"".join(len(v).to_bytes(4, "little") + v for v in values)


def fp32(values: Any) -> bytes:
    return np.asarray(values, dtype=np.float32).tobytes()
