"""Triton's OpenTelemetry trace mode: sampled requests as spans, exported over OTLP/HTTP.

With ``--trace-config mode=opentelemetry`` a sampled request's :class:`Trace` becomes
spans when it is written, as Triton 2.51 exports them (captured side by side):

- ``InferRequest``, for a client's request only: from when it was picked for tracing
  until its answer was sent, with the frontend's events (HTTP_* or GRPC_*) and
  INFER_RESPONSE_COMPLETE. Its parent is the client's span when the request carried a
  W3C ``traceparent`` (HTTP header or gRPC metadata; ``tracestate`` goes to every span).
- a span named after the model, REQUEST_START to REQUEST_END, with those events and
  QUEUE_START, and the attributes ``triton.model_name``, ``triton.model_version``,
  ``triton.trace_id``, ``triton.trace_parent_id`` (0 at the top) and, when there is one,
  ``triton.request_id``. An ensemble's steps and a model's BLS calls are children of
  their parent's model span, in the same OpenTelemetry trace.
- a ``compute`` span per execution, COMPUTE_START to COMPUTE_END, with the four
  COMPUTE_* events.

Every span is of kind SERVER and carries no status, as Triton's. At level TENSORS alone
only a bare ``InferRequest`` is exported, and tensors are never exported.

Spans go to the collector as OTLP/HTTP JSON (Triton's exporter's encoding) from one
thread, batched as OpenTelemetry's batch span processor does: an export when
``bsp_max_export_batch_size`` spans wait or ``bsp_schedule_delay`` ms have passed, spans
beyond ``bsp_max_queue_size`` dropped, what waits sent at stop. A collector that cannot be
reached loses spans, never requests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import logging
import random
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import dlserve

if TYPE_CHECKING:
    from dlserve.engine.tracing import Trace

log = logging.getLogger("dlserve.trace")

MODE = "opentelemetry"
DEFAULT_URL = "http://localhost:4318/v1/traces"
# The batch span processor's settings and their defaults, in the order Triton lists them.
BATCHING = {
    "bsp_schedule_delay": 5000, "bsp_max_export_batch_size": 512, "bsp_max_queue_size": 2048,
}
SETTINGS = ("url", "resource", *BATCHING)  # what a trace/setting update leaves alone here
_EXPORT_TIMEOUT_S = 10.0
_STOPPING_TIMEOUT_S = 2.0  # a post's at stop, which a collector that does not answer must not hold
_SPANS_PER_TRACE = 3  # about (InferRequest, model, compute): to tell when enough wait
# The events each span takes from a trace.
_REQUEST_EVENTS = frozenset({
    "HTTP_RECV_START", "HTTP_RECV_END", "HTTP_SEND_START", "HTTP_SEND_END", "GRPC_WAITREAD_START",
    "GRPC_WAITREAD_END", "GRPC_SEND_START", "GRPC_SEND_END", "INFER_RESPONSE_COMPLETE",
})
_MODEL_EVENTS = frozenset({"REQUEST_START", "QUEUE_START", "REQUEST_END"})
_SERVER_KIND = 2  # SPAN_KIND_SERVER


@dataclasses.dataclass(frozen=True)
class OtelSettings:
    """``--trace-config opentelemetry,KEY=VALUE`` entries, in the order given. Keys
    dlserve does not use are kept and shown, as tritonserver shows them."""

    entries: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not all(
            isinstance(entry, tuple) and len(entry) == 2 and all(isinstance(s, str) for s in entry)
            for entry in self.entries
        ):
            raise TypeError(
                "OtelSettings takes (KEY, VALUE) string pairs in order, e.g. "
                "(('url', 'collector:4318/v1/traces'), ('resource', 'service.name=svc'))"
            )
        for key, value in self.entries:
            if key in BATCHING:
                try:
                    int(value)
                except ValueError:  # (tritonserver's words)
                    raise ValueError(
                        f'Bad option: "--trace-config opentelemetry,{key}". '
                        f"Invalid value for option. Got {value}"
                    ) from None

    def last(self, key: str) -> str | None:
        values = [value for k, value in self.entries if k == key]
        return values[-1] if values else None

    @property
    def url(self) -> str:
        url = self.last("url") or DEFAULT_URL
        return url if "://" in url else "http://" + url

    def batching(self, key: str) -> int:
        value = self.last(key)
        return BATCHING[key] if value is None else int(value)

    @property
    def resources(self) -> dict[str, str]:
        """``resource=KEY=VALUE`` entries; service.name defaults to Triton's."""
        pairs = (value.partition("=") for key, value in self.entries if key == "resource")
        given = {name: value for name, sep, value in pairs if sep and name}
        return {**given, "service.name": given.get("service.name", "triton-inference-server")}

    def wire(self) -> dict[str, Any]:
        """The settings as the trace extension shows them: as given (a key given more than
        once as a list), then the batching defaults not given."""
        shown: dict[str, Any] = {}
        for key, value in self.entries:
            if key in shown:
                earlier = shown[key]
                shown[key] = [*earlier, value] if isinstance(earlier, list) else [earlier, value]
            else:
                shown[key] = value
        for key, default in BATCHING.items():
            shown.setdefault(key, str(default))
        return shown


def w3c_context(headers: Iterable[tuple[str, Any]]) -> tuple[str, str] | None:
    """A request's ``traceparent`` and ``tracestate`` (HTTP headers or gRPC metadata), or
    None without a traceparent."""
    parent, state = None, ""
    for key, value in headers:
        if not isinstance(value, str):
            continue
        name = key.lower()
        if name == "traceparent":
            parent = value
        elif name == "tracestate":
            state = value
    return None if parent is None else (parent, state)


def _hex_id(text: str, digits: int) -> bool:
    hex_digits = all(c in "0123456789abcdef" for c in text)
    return len(text) == digits and text != "0" * digits and hex_digits


def _new_id(bits: int) -> str:
    return format(random.getrandbits(bits) or 1, f"0{bits // 4}x")


class SpanIds:
    """The OpenTelemetry identity of a trace's spans, fixed when the trace starts so that
    its model can hand it on (``request.trace().get_context()``) before it is exported."""

    __slots__ = ("trace_id", "parent_span_id", "request_span_id", "model_span_id", "trace_state")

    def __init__(self, trace_id: str, parent_span_id: str, trace_state: str, top: bool) -> None:
        self.trace_id = trace_id
        self.parent_span_id = parent_span_id  # "" for a root with no client span
        self.trace_state = trace_state
        self.request_span_id = _new_id(64) if top else ""
        self.model_span_id = _new_id(64)

    @classmethod
    def for_request(cls, context: tuple[str, str] | None) -> SpanIds:
        """A client's request: under the client's span when ``context`` is a valid W3C
        traceparent (an invalid one is ignored, as Triton ignores it)."""
        if context is not None:
            parts = context[0].strip().split("-")
            trace_id, span_id = parts[1:3] if len(parts) >= 4 and parts[0] != "ff" else ("", "")
            if _hex_id(trace_id, 32) and _hex_id(span_id, 16):
                return cls(trace_id, span_id, context[1], top=True)
        return cls(_new_id(128), "", "", top=True)

    def child(self) -> SpanIds:
        """An ensemble step's or a BLS call's: under this trace's model span."""
        return SpanIds(self.trace_id, self.model_span_id, self.trace_state, top=False)

    def context_json(self) -> str:
        """What ``request.trace().get_context()`` returns in the model: its own span's."""
        context = {"traceparent": f"00-{self.trace_id}-{self.model_span_id}-01"}
        if self.trace_state:
            context["tracestate"] = self.trace_state
        return json.dumps(context, separators=(",", ":"))


def _attribute(key: str, value: str | int) -> dict[str, Any]:
    kind = {"intValue": str(value)} if isinstance(value, int) else {"stringValue": value}
    return {"key": key, "value": kind}


class _Spans:
    """Converts finished traces into OTLP JSON spans (times as Unix nanoseconds)."""

    def __init__(self) -> None:
        self.offset = time.time_ns() - time.monotonic_ns()  # monotonic -> Unix time

    def span(
        self, ids: SpanIds, span_id: str, parent: str, name: str, start: int, end: int,
        events: list[tuple[str, int]], attributes: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        span: dict[str, Any] = {
            "traceId": ids.trace_id, "spanId": span_id, "name": name, "kind": _SERVER_KIND,
            "startTimeUnixNano": str(start + self.offset),
            "endTimeUnixNano": str(end + self.offset),
            "events": [{"name": n, "timeUnixNano": str(ns + self.offset)} for n, ns in events],
        }
        if parent:
            span["parentSpanId"] = parent
        if ids.trace_state:
            span["traceState"] = ids.trace_state
        if attributes:
            span["attributes"] = attributes
        return span

    def of(self, trace: Trace) -> list[dict[str, Any]]:
        """A trace's spans, in the order they ended (compute, model, InferRequest)."""
        ids = trace.span_ids
        assert ids is not None
        spans: list[dict[str, Any]] = []
        model_events = [(n, ns) for n, ns in trace.events if n in _MODEL_EVENTS]
        if model_events:
            computes: list[tuple[str, int]] = []
            compute_ends: list[int] = []
            for name, ns in trace.events:
                if name.startswith("COMPUTE_"):
                    computes.append((name, ns))
                    if name == "COMPUTE_END":
                        compute_ends.append(ns)
                        spans.append(self.span(
                            ids, _new_id(64), ids.model_span_id, "compute",
                            computes[0][1], ns, computes,
                        ))
                        computes = []
            attributes = [
                _attribute("triton.model_name", trace.model_name),
                _attribute("triton.model_version", trace.model_version),
                _attribute("triton.trace_id", trace.id),
                _attribute("triton.trace_parent_id", trace.parent_id or 0),
            ]
            if trace.request_id:
                attributes.append(_attribute("triton.request_id", trace.request_id))
            times = dict(model_events)  # (the last of each name)
            start = times.get("REQUEST_START", model_events[0][1])
            # (a cancelled request ends before its execute does: the span holds its computes)
            end = max([times.get("REQUEST_END", model_events[-1][1]), *compute_ends])
            parent = ids.request_span_id or ids.parent_span_id
            spans.append(self.span(
                ids, ids.model_span_id, parent, trace.model_name, start, end, model_events,
                attributes,
            ))
        if ids.request_span_id:
            events = [(n, ns) for n, ns in trace.events if n in _REQUEST_EVENTS]
            # From its first event (it was read, or arrived, a moment before it was picked).
            start = min(
                [trace.started_ns, *(ns for _, ns in events), *(ns for _, ns in model_events)]
            )
            spans.append(self.span(
                ids, ids.request_span_id, ids.parent_span_id, "InferRequest",
                start, trace.ended_ns or time.monotonic_ns(), events,
            ))
        return spans


class OtlpExporter:
    """Sends finished traces' spans to an OTLP/HTTP collector from a thread of its own
    (see the module docstring); the trace file's stand-in for :class:`Tracer`. The thread
    also turns the traces into spans, so the server's loop only hands them over."""

    def __init__(self, settings: OtelSettings) -> None:
        self.url = urllib.parse.urlsplit(settings.url)
        self.delay_s = max(settings.batching("bsp_schedule_delay"), 1) / 1000
        self.batch_size = max(settings.batching("bsp_max_export_batch_size"), 1)
        self.queue_size = max(settings.batching("bsp_max_queue_size"), 1)
        # An export starts once a batch or half the queue waits (as in OpenTelemetry's
        # batch span processor), else every schedule delay.
        self._enough = max(1, min(self.batch_size, self.queue_size // 2))
        resources = {
            "telemetry.sdk.name": "dlserve", "telemetry.sdk.language": "python",
            "telemetry.sdk.version": dlserve.__version__, **settings.resources,
        }
        self._resource = {"attributes": [_attribute(k, v) for k, v in resources.items()]}
        self._spans = _Spans()
        self._traces: list[Trace] = []  # finished, for the thread to turn into spans
        # (at most as many as would fill the queue: the rest are dropped at once)
        self._most_traces = max(1, self.queue_size // _SPANS_PER_TRACE)
        self._traces_dropped = 0
        self._waiting: list[dict[str, Any]] = []  # spans to send (the thread's own)
        self._dropping = False
        self._failing = False
        self._closed = False
        self._cut = False  # the stop cut a post short: post no more
        self._connection: http.client.HTTPConnection | None = None  # the post under way
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def write(self, traces: list[Trace], numbered: bool = False) -> None:
        """Hand ``traces`` over for export (``numbered`` is the trace file's; unused)."""
        with self._wake:
            if self._closed:  # (a trace let go after the stop, by a server being killed)
                log.debug("OpenTelemetry: %d trace(s) finished after the stop", len(traces))
                return
            room = max(self._most_traces - len(self._traces), 0)
            self._traces.extend(traces[:room])
            self._traces_dropped += max(len(traces) - room, 0)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dlserve-otlp", daemon=True)
                self._thread.start()
            if _SPANS_PER_TRACE * len(self._traces) >= self._enough:
                self._wake.notify()

    def close(self) -> None:
        """Send what waits, then stop, within a few seconds: a post a collector does not
        answer is cut short (what is left then is dropped)."""
        with self._wake:
            self._closed = True
            self._wake.notify()
            thread = self._thread
        if thread is None:
            return
        thread.join(_STOPPING_TIMEOUT_S + 1)
        if thread.is_alive():
            self._cut = True
            connection = self._connection
            sock = connection.sock if connection is not None else None
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            thread.join(1)

    def _run(self) -> None:
        while True:
            with self._wake:
                if _SPANS_PER_TRACE * len(self._traces) < self._enough and not self._closed:
                    self._wake.wait(self.delay_s)
                traces, self._traces = self._traces, []
                dropped, self._traces_dropped = self._traces_dropped, 0
                closed = self._closed
            try:
                self._export(traces, dropped, closed)
            except Exception:  # noqa: BLE001 - a bug loses these spans, not the thread
                log.exception("OpenTelemetry: spans lost")
                self._waiting.clear()
            if closed:
                return

    def _export(self, traces: list[Trace], traces_dropped: int, closed: bool) -> None:
        """Queue ``traces``' spans and send what waits, batch by batch."""
        self._queue(traces, traces_dropped)
        timeout = _STOPPING_TIMEOUT_S if closed else _EXPORT_TIMEOUT_S
        while self._waiting:  # (as the batch processor: until nothing waits)
            batch = self._waiting[:self.batch_size]
            del self._waiting[:self.batch_size]
            if not self._post(batch, timeout):
                if closed or self._closed:  # (the collector is gone or the stop came)
                    self._waiting.clear()
                break

    def _queue(self, traces: list[Trace], traces_dropped: int) -> None:
        """The traces' spans into the queue, past its size dropped (said once a streak,
        with the traces the server dropped before they became spans)."""
        spans: list[dict[str, Any]] = []
        for trace in traces:
            try:
                spans.extend(self._spans.of(trace))
            except Exception:  # noqa: BLE001 - a bug loses that trace, not the thread
                log.exception("OpenTelemetry: trace %d could not be made into spans", trace.id)
        room = max(self.queue_size - len(self._waiting), 0)
        self._waiting.extend(spans[:room])
        dropped = max(len(spans) - room, 0)
        if dropped or traces_dropped:
            (log.debug if self._dropping else log.warning)(
                "OpenTelemetry: %d span(s) and %d trace(s) dropped: more than "
                "bsp_max_queue_size waited", dropped, traces_dropped,
            )
        self._dropping = bool(dropped or traces_dropped)

    def _post(self, spans: list[dict[str, Any]], timeout: float) -> bool:
        """Send one batch; whether the collector took it."""
        if self._cut:
            return False
        body = json.dumps({"resourceSpans": [{
            "resource": self._resource,
            "scopeSpans": [{"scope": {"name": "triton-server"}, "spans": spans}],
        }]}, separators=(",", ":")).encode()
        url = self.url
        secure = url.scheme == "https"
        connection_type = http.client.HTTPSConnection if secure else http.client.HTTPConnection
        connection = self._connection = connection_type(url.netloc, timeout=timeout)
        target = (url.path or "/v1/traces") + (f"?{url.query}" if url.query else "")
        try:
            connection.request(
                "POST", target, body,
                {
                    "Content-Type": "application/json",
                    "User-Agent": f"dlserve/{dlserve.__version__}",
                },
            )
            status = connection.getresponse().status
            if status >= 300:
                raise OSError(f"the collector answered HTTP {status}")
            self._failing = False
            return True
        except (OSError, ValueError, http.client.HTTPException) as exc:  # (ValueError: a bad host)
            # Said once per streak of failures: a collector that is down loses spans only.
            (log.debug if self._failing else log.warning)(
                "OpenTelemetry: %d span(s) not exported to %s: %s", len(spans), url.geturl(), exc
            )
            self._failing = True
            return False
        finally:
            self._connection = None
            connection.close()
