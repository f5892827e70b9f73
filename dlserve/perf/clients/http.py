"""HTTP/1.1: ``http.client`` for the control plane; for inference, one keep-alive
connection per slot driven by a minimal :class:`asyncio.Protocol`.

The hot path per request: one ``transport.write`` of the pre-encoded bytes, one future,
and a response parser that reads the status line and ``Content-Length`` and then only
counts body bytes (the body is kept only when the status is an error, or for
``--profile-export-file``).
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import time
from typing import Any
from urllib.parse import quote

from dlserve.perf.clients.base import (
    ControlClient,
    DataPlane,
    MissingEndpoint,
    RequestError,
    ServerError,
    Slot,
    no_delay,
)
from dlserve.perf.inputs import ModelInfo
from dlserve.perf.payloads import http_request, model_path
from dlserve.perf.shm import CudaRegion, SystemRegion

_now = time.perf_counter_ns


def split_url(url: str) -> tuple[str, int]:
    host, _, port = url.rpartition(":")
    return host.strip("[]"), int(port)


class HttpControl(ControlClient):
    def __init__(self, url: str, timeout: float = 30.0) -> None:
        self.url = url
        self.host, self.port = split_url(url)
        self.timeout = timeout
        self._conn: http.client.HTTPConnection | None = None

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        for attempt in (0, 1):
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            try:
                self._conn.request(method, path, body=data, headers=headers)
                response = self._conn.getresponse()
                payload = response.read()
                break
            except (OSError, http.client.HTTPException) as exc:
                self._conn.close()
                self._conn = None
                if isinstance(exc, http.client.BadStatusLine) and not isinstance(exc, OSError):
                    # (its "status line" is whatever came back: a gRPC port's HTTP/2 frames)
                    raise ServerError(f"the server at {self.url} does not answer HTTP/1.1 "
                                      "(a gRPC port? use -i grpc)") from None
                if attempt:
                    raise ServerError(f"cannot reach the server at {self.url}: {exc}") from None
        if response.status == 404 and path.endswith("/config"):
            raise MissingEndpoint(f"{method} {path}: 404")
        if response.status != 200:
            try:
                message = json.loads(payload).get("error") or payload.decode(errors="replace")
            except ValueError:
                message = payload.decode(errors="replace") or response.reason
            raise ServerError(f"{method} {path}: {response.status} {message}")
        return json.loads(payload) if payload else None

    def model_info(self, model: str, version: str) -> ModelInfo:
        metadata = self._call("GET", model_path(model, version))
        try:  # Triton's model configuration extension: batching, decoupled
            config = self._call("GET", model_path(model, version) + "/config")
        except MissingEndpoint:
            config = {}  # a plain KServe v2 server: the metadata alone
        return ModelInfo.from_json(metadata, config)

    def statistics(self, model: str, version: str) -> dict[str, Any]:
        return self._call("GET", model_path(model, version) + "/stats")

    def register(self, region: SystemRegion | CudaRegion) -> None:
        name = quote(region.name, safe="")
        if isinstance(region, SystemRegion):
            body: dict[str, Any] = {"key": region.key, "offset": 0, "byte_size": region.byte_size}
            self._call("POST", f"/v2/systemsharedmemory/region/{name}/register", body)
        else:
            body = {
                "raw_handle": {"b64": base64.b64encode(region.raw_handle).decode()},
                "device_id": region.device_id,
                "byte_size": region.byte_size,
            }
            self._call("POST", f"/v2/cudasharedmemory/region/{name}/register", body)

    def unregister(self, region: SystemRegion | CudaRegion) -> None:
        kind = "systemsharedmemory" if isinstance(region, SystemRegion) else "cudasharedmemory"
        self._call("POST", f"/v2/{kind}/region/{quote(region.name, safe='')}/unregister")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class _Connection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[int] | None = None
        self.head = b""  # response header bytes received so far
        self.remaining = -1  # body bytes still to come; -1 while reading the header
        self.status = 0
        self.body: bytes | bytearray = b""  # kept for error responses only, unless ``keep``
        self.keep = False  # --profile-export-file: keep every body
        self.header_length = -1  # its Inference-Header-Content-Length (-1: none)
        self.close_after = False
        self.first_ns = 0
        self.done_ns = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        no_delay(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(RequestError(f"connection closed by the server{f': {exc}' if exc else ''}"))

    def data_received(self, data: bytes) -> None:
        if self.remaining < 0:
            if not self.head:
                self.first_ns = _now()
                buffer = data
            else:
                buffer = self.head + data
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                self.head = buffer
                return
            self.head = b""
            try:
                self._parse_head(buffer[:end])
            except (ValueError, IndexError) as exc:
                self._fail(RequestError(f"malformed HTTP response: {exc}"))
                return
            data = buffer[end + 4 :]
        self.remaining -= len(data)
        if self.status != 200 or self.keep:
            self.body += data
        if self.remaining <= 0:
            self.remaining = -1
            self.done_ns = _now()
            waiter, self.waiter = self.waiter, None
            if waiter is not None and not waiter.done():
                waiter.set_result(self.status)

    def _parse_head(self, head: bytes) -> None:
        self.status = int(head[9:12])
        lower = head.lower()
        self.remaining = _header_int(lower, b"\r\ncontent-length:")
        if self.remaining < 0:
            if b"\r\ntransfer-encoding:" in lower:
                raise ValueError("chunked responses are not supported")
            raise ValueError("no Content-Length")
        self.body = bytearray() if self.keep else b""  # (kept whole: grown in place)
        self.close_after = b"\r\nconnection: close" in lower
        if self.keep:
            self.header_length = _header_int(lower, b"\r\ninference-header-content-length:")

    def _fail(self, exc: Exception) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        if self.transport is not None:
            self.transport.close()


def _header_int(lower: bytes, name: bytes) -> int:
    """The value of header ``name`` (``\\r\\n``, its name in lower case and its colon) in a
    lower-cased response head; -1 when it is not there."""
    at = lower.find(name)
    if at < 0:
        return -1
    stop = lower.find(b"\r\n", at + 2)
    return int(lower[at + len(name) : stop if stop > 0 else None])


class HttpSlot(Slot):
    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.conn: _Connection | None = None

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, self.conn = await loop.create_connection(_Connection, self.host, self.port)
        except OSError as exc:
            raise RequestError(f"cannot connect to {self.host}:{self.port}: {exc}") from None

    async def infer(self, payload: bytes) -> tuple[int, int]:
        conn = self.conn
        if conn is None or conn.transport is None or conn.close_after:
            await self.connect()
            conn = self.conn
            assert conn is not None
        waiter = asyncio.get_running_loop().create_future()
        conn.waiter = waiter
        conn.keep = self.captured is not None
        start = _now()
        conn.transport.write(payload)  # type: ignore[union-attr]
        sent = _now()
        status = await waiter
        if status != 200:
            raise RequestError(_error_message(status, conn.body))
        if conn.keep:
            self.captured = [(conn.done_ns, (conn.header_length, conn.body))]
        return sent - start, conn.done_ns - conn.first_ns

    async def close(self) -> None:
        if self.conn is not None and self.conn.transport is not None:
            self.conn.transport.close()
        self.conn = None


def _error_message(status: int, body: bytes) -> str:
    try:
        message = json.loads(body).get("error")
    except (ValueError, AttributeError):
        message = None
    return f"HTTP {status}: {message or body.decode(errors='replace')[:500]}"


class HttpDataPlane(DataPlane):
    async def setup(self) -> None:
        self.shared_memory()
        self.payloads = self.encode_all()
        self.host, self.port = split_url(self.settings.url)

    def encode(self, index: int, extra: dict[str, object] | None = None) -> bytes:
        settings = self.settings
        return http_request(
            settings.url, self.info, settings.version, self.requests[index],
            None if self.shm_inputs is None else self.shm_inputs[index], self.output_refs(index),
            self.parameters(extra), json_inputs=settings.json_inputs, json_outputs=settings.json_outputs,
            headers=settings.http_headers,
        )

    async def open_slot(self) -> Slot:
        slot = HttpSlot(self.host, self.port)
        await slot.connect()
        return slot
