"""Triton's request tracing: sampled requests' timestamps in a JSON file ("triton" mode)
or as OpenTelemetry spans sent to a collector ("opentelemetry" mode, :mod:`dlserve.engine.otel`).

Settings (``--trace-config``, the trace extension's ``trace/setting`` endpoints) live in
one :class:`Tracer`: server-wide values, and per model only the values a client set for
that model (the others follow the server-wide ones). Every ``trace_rate``-th request of a
scope is traced while that scope's ``trace_count`` (-1: no limit) lasts. As in Triton's
tracer, a model with any setting of its own is a scope of its own, the server the scope
of every other model, and a scope's counters start over whenever its settings change.

A :class:`Trace` collects a request's timestamps (``time.monotonic_ns``, the clock of
Triton's files) from whoever sees them: the frontend (HTTP_RECV_*, HTTP_SEND_*, GRPC_*),
the engine (REQUEST_START, QUEUE_START, INFER_RESPONSE_COMPLETE, REQUEST_END) and the
model instance (COMPUTE_*). An ensemble's steps, and BLS calls a model hands the trace
to, get child traces (``parent_id``). A trace is written when its last holder lets it
go: the engine after the final response, the instance when the execute returns, and a
frontend that took a hold when it has sent the response.

Level TENSORS adds the request's inputs as they are queued and each response's outputs
(``{"id", "activity": "TENSOR_QUEUE_INPUT" | "TENSOR_BACKEND_OUTPUT", "tensor": {"name",
"data", "shape", "dtype"}}``, the values written as Triton writes them: comma-separated,
floats as C++'s ``%g``, BYTES elements quoted; FP16 and BF16 left empty, as Triton does).

Files are Triton's: a JSON array of ``{"id", "model_name", "model_version", "request_id",
"parent_id"}`` and one ``{"id", "timestamps": [{"name", "ns"}]}`` per event, into
``trace_file`` (one array, closed at stop) or numbered files ``trace_file.0``, ``.1``, ...
by Triton's rules (see :class:`_Sampling`): N traces to a file with a ``log_frequency``
of N, and the traces of a ``trace_count`` to one file once it is spent. A model with
settings of its own has its traces gathered apart, into the same files.

In OpenTelemetry mode the same sampling picks the requests (one that carries a W3C
``traceparent`` is traced whatever the rate and count say, as in Triton) and each trace
goes to :class:`~dlserve.engine.otel.OtlpExporter` instead of a file; the settings shown
are Triton's for that mode (no file or log frequency; the OpenTelemetry ones).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import IO, Any, Protocol

from dlserve.engine import otel
from dlserve.engine.otel import OtelSettings, OtlpExporter, SpanIds
from dlserve.errors import InvalidArgumentError, UnsupportedError
from dlserve.memory.dtypes import DataType
from dlserve.memory.tensor import Tensor

log = logging.getLogger("dlserve.trace")

LEVELS = ("OFF", "TIMESTAMPS", "TENSORS")
# In the order Triton answers them.
_NAMES = ("trace_level", "trace_rate", "trace_count", "log_frequency", "trace_file", "trace_mode")
_SERVER_WIDE = ("trace_file", "trace_mode")
_OTEL_NAMES = ("trace_level", "trace_rate", "trace_count", "trace_mode")  # then its own


@dataclasses.dataclass
class TraceSettings:
    """Start-up settings, as ``--trace-config`` gives them."""

    file: str = ""
    level: tuple[str, ...] = ("OFF",)
    rate: int = 1000
    count: int = -1
    log_frequency: int = 0
    mode: str = "triton"  # or "opentelemetry"
    opentelemetry: OtelSettings = dataclasses.field(default_factory=OtelSettings)

    def values(self) -> dict[str, Any]:
        """The settings under their trace-extension names, checked."""
        values: dict[str, Any] = {"trace_file": self.file, "trace_mode": self.mode}
        if self.mode not in ("triton", otel.MODE):
            raise UnsupportedError(_unsupported_mode(self.mode))
        if not isinstance(self.opentelemetry, OtelSettings):
            raise InvalidArgumentError("TraceSettings.opentelemetry must be a dlserve.OtelSettings")
        for name, value in (
            ("trace_level", list(self.level)),
            ("trace_rate", str(self.rate)),
            ("trace_count", str(self.count)),
            ("log_frequency", str(self.log_frequency)),
        ):
            values[name] = _parse(name, value)
        return values


def _unsupported_mode(mode: str) -> str:  # (tritonserver's words)
    return (
        f"invalid value for trace mode option: {mode}. "
        'Available options are "triton" and "opentelemetry"'
    )


def _integer(name: str, value: Any, least: int) -> int:
    if not isinstance(value, str):
        raise InvalidArgumentError(
            f"trace setting '{name}' must be a string, got {json.dumps(value)}"
        )
    try:
        number = int(value)
    except ValueError:
        raise InvalidArgumentError(f"Unable to parse '{name}', got: {value}") from None
    if number < least:
        raise InvalidArgumentError(
            f"Unable to parse '{name}'. Expecting value >= {least}, got:{value}"
        )
    if number > _MOST[name]:  # Triton keeps them in 32 bits: its words
        raise InvalidArgumentError(
            f"Unable to parse '{name}', value is out of range [ {least}, {_MOST[name]} ], got: {value}"
        )
    return number


# (a rate of 0 samples nothing: Triton takes it, and refuses it only with tracing on)
_LEAST = {"trace_rate": 0, "trace_count": -1, "log_frequency": 0}  # the integer settings
_MOST = {"trace_rate": 2**32 - 1, "trace_count": 2**31 - 1, "log_frequency": 2**32 - 1}


def _parse(name: str, value: Any) -> Any:
    """A setting's wire value (a string; a list of strings for trace_level) as we keep it.
    Only level and the integer settings are parsed: file and mode are never updated."""
    if name == "trace_level":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise InvalidArgumentError("trace setting 'trace_level' must be an array of strings")
        levels = [v.upper() for v in value]
        for level in levels:
            if level not in LEVELS:
                raise InvalidArgumentError(
                    f"unknown trace level '{level}' (use OFF, TIMESTAMPS and/or TENSORS)"
                )
        if not levels:
            raise InvalidArgumentError("trace_level must be OFF, or TIMESTAMPS and/or TENSORS")
        if len(levels) > 1 and "OFF" in levels:  # (Triton's words)
            raise InvalidArgumentError("Expect only one trace level 'OFF' is specified")
        return _in_order(levels)
    return _integer(name, value, _LEAST[name])


def _in_order(levels: Iterable[str]) -> tuple[str, ...]:
    """Trace levels as Triton lists them, whatever order they were given in: TIMESTAMPS,
    then TENSORS, or OFF when neither."""
    given = set(levels)
    return tuple(level for level in LEVELS[1:] if level in given) or ("OFF",)


def _wire(name: str, value: Any) -> Any:
    return list(value) if name == "trace_level" else str(value)


class Trace:
    """One traced request: its identity and timestamps (see the module docstring)."""

    __slots__ = (
        "tracer", "id", "parent_id", "model_name", "model_version", "request_id", "levels",
        "events", "tensors", "sampling", "root", "group", "span_ids", "started_ns", "ended_ns",
        "_holds", "_discarded",
    )

    def __init__(
        self,
        tracer: Tracer,
        model_name: str,
        request_id: str,
        levels: tuple[str, ...],
        parent_id: int | None = None,
    ) -> None:
        self.tracer = tracer
        self.id = next(tracer._ids)
        self.parent_id = parent_id
        self.model_name = model_name
        self.model_version = -1  # the engine fills it in when it resolves the model
        self.request_id = request_id
        self.levels = levels
        self.events: list[tuple[str, int]] = []
        self.tensors: list[dict[str, Any]] | None = [] if "TENSORS" in levels else None
        self.sampling: _Sampling | None = None  # the one that sampled it (a child's: None)
        # A child is written with the trace of the request that began it all (its root),
        # as one sample, as Triton writes a request's traces: the root's group holds them.
        self.root: Trace | None = None
        self.group: list[Trace] = []
        self.span_ids: SpanIds | None = None  # in OpenTelemetry mode
        self.started_ns = time.monotonic_ns()
        self.ended_ns = 0  # when its last holder let go
        self._holds = 1  # the engine's, let go after the final response
        self._discarded = False
        tracer._open[self.id] = self

    def record(self, name: str, ns: int | None = None) -> None:
        if "TIMESTAMPS" in self.levels:
            self.events.append((name, time.monotonic_ns() if ns is None else ns))

    def record_tensors(self, activity: str, tensors: dict[str, Tensor]) -> None:
        """TENSOR_QUEUE_INPUT (a request's inputs) or TENSOR_BACKEND_OUTPUT (a response's
        outputs), when the level asks for tensors."""
        if self.tensors is not None:
            self.tensors.extend(
                {"id": self.id, "activity": activity, "tensor": _tensor_entry(name, tensor)}
                for name, tensor in tensors.items()
            )

    def child(self, model_name: str, request_id: str) -> Trace:
        """The trace of a request this one makes (an ensemble step, a BLS call)."""
        child = Trace(self.tracer, model_name, request_id, self.levels, parent_id=self.id)
        child.span_ids = None if self.span_ids is None else self.span_ids.child()
        child.root = self.root or self
        child.root.hold()  # (let go when the child is written into its group)
        return child

    def hold(self) -> None:
        """Keep the trace open past the engine's part (a frontend that still sends)."""
        self._holds += 1

    def release(self) -> None:
        self._holds -= 1
        if self._holds == 0:
            self.ended_ns = time.monotonic_ns()
            del self.tracer._open[self.id]
            if not self._discarded:
                self.tracer._finished(self)
            if self.root is not None:
                self.root.release()

    def release_soon(self) -> None:
        """Release after the current loop turn, so that a frontend answering inside it
        (its response callback, a hold taken right after submit) is still counted."""
        try:
            asyncio.get_running_loop().call_soon(self.release)
        except RuntimeError:  # no loop any more (the server is being killed)
            self.release()

    def for_worker(self) -> int | tuple[int, str]:
        """What the model's worker gets: the trace's id (for the model's BLS calls) and, in
        OpenTelemetry mode with timestamps, the context ``get_context()`` returns."""
        if self.span_ids is None or "TIMESTAMPS" not in self.levels:
            return self.id
        return (self.id, self.span_ids.context_json())

    def discard(self) -> None:
        """The request never started (refused before it was queued): write nothing."""
        self._discarded = True
        self.release()

    def entries(self) -> list[dict[str, Any]]:
        head: dict[str, Any] = {
            "id": self.id, "model_name": self.model_name, "model_version": self.model_version
        }
        if self.request_id:
            head["request_id"] = self.request_id
        if self.parent_id is not None:
            head["parent_id"] = self.parent_id
        return [
            head,
            *(
                {"id": self.id, "timestamps": [{"name": name, "ns": ns}]}
                for name, ns in self.events
            ),
            *(self.tensors or ()),
        ]


def _tensor_entry(name: str, tensor: Tensor) -> dict[str, str]:
    """A tensor as Triton's trace files show it (see the module docstring)."""
    data_type = tensor.data_type
    if data_type is DataType.BYTES:
        values = [
            '"' + item.decode("utf-8", "replace") + '"' for item in tensor.to_bytes_array().ravel()
        ]
    elif data_type in (DataType.FP16, DataType.BF16):
        values = []
    elif data_type in (DataType.FP32, DataType.FP64):
        values = [format(x, "g") for x in tensor.storage().ravel().tolist()]
    else:  # integers, and BOOL as 0 / 1
        values = [str(int(x)) for x in tensor.storage().ravel().tolist()]
    return {
        "name": name,
        "data": ",".join(values),
        "shape": ",".join(str(d) for d in tensor.shape),
        "dtype": data_type.wire_name,
    }


class _Output(Protocol):
    """Where finished traces go: the trace file (:class:`_Writer`) or a collector
    (:class:`~dlserve.engine.otel.OtlpExporter`)."""

    def write(self, traces: list[Trace], numbered: bool) -> None: ...

    def close(self) -> None: ...


class _Writer:
    """The trace file, streamed as one JSON array closed at stop, and its numbered
    files. Locked: the server's loop writes, and a server being killed closes from
    another thread."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stream: IO[str] | None = None
        self._index = 0
        self._closed = False

    def write(self, traces: list[Trace], numbered: bool) -> None:
        """``traces`` into the streamed file, or into the next numbered one."""
        with self._lock:
            if self._closed:  # finished after the server stopped: the file is complete
                log.debug("%d trace(s) finished after the trace file was closed", len(traces))
                return
            try:
                if numbered:
                    self._write_numbered(traces)
                else:
                    self._write_streamed(traces)
            except OSError as exc:
                log.error("cannot write trace file %s: %s", self.path, exc)

    def _write_streamed(self, traces: list[Trace]) -> None:
        entries = ",".join(
            json.dumps(entry, separators=(",", ":")) for trace in traces for entry in trace.entries()
        )
        if self._stream is None:
            self._stream = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - open until close()
            self._stream.write("[" + entries)
        else:
            self._stream.write("," + entries)

    def _write_numbered(self, traces: list[Trace]) -> None:
        entries = [entry for trace in traces for entry in trace.entries()]
        target = f"{self.path}.{self._index}"
        # Written aside (a hidden name no "PATH.*" matches), then renamed: whoever
        # watches the folder sees each file whole.
        folder, name = os.path.split(target)
        scratch = os.path.join(folder, f".{name}.tmp")
        with open(scratch, "w", encoding="utf-8") as out:
            json.dump(entries, out, separators=(",", ":"))
        os.replace(scratch, target)
        self._index += 1

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._stream is not None:
                try:
                    self._stream.write("]")
                    self._stream.close()
                except OSError as exc:
                    log.error("cannot write trace file %s: %s", self.path, exc)
                self._stream = None


class _Sampling:
    """One scope's sampling under one version of its settings (Triton's TraceSetting):
    every ``rate``-th request is traced while ``count`` lasts (-1: no limit), and its
    traces are written as Triton writes them: N to a numbered file with a log
    frequency N; those of a count to a numbered file once the count is spent and they
    have all finished; what is left when the settings change or the server stops to
    the numbered files with a log frequency, else to the streamed file. With neither a
    count nor a log frequency each trace is streamed as it finishes (Triton holds them
    in memory until then). With ``holds`` False (OpenTelemetry: spans go out as their
    requests end, as Triton's) every trace is written as it finishes, whatever the count
    and log frequency."""

    __slots__ = ("rate", "left", "log_frequency", "limited", "seen", "started", "finished", "pending", "retired")

    def __init__(self, rate: int, count: int, log_frequency: int, holds: bool = True) -> None:
        self.rate = rate
        self.left = count  # traces still to start (-1: no limit)
        self.log_frequency = log_frequency if holds else 0
        self.limited = count >= 0 and holds
        self.seen = 0  # requests counted toward the rate
        self.started = 0
        self.finished = 0
        self.pending: list[list[Trace]] = []  # samples held
        self.retired = False  # replaced by newer settings: write the rest once all finish

    def sample(self) -> bool:
        if self.left == 0 or self.rate == 0:  # spent: requests no longer count toward the rate either
            return False
        self.seen += 1
        if self.seen % self.rate:
            return False
        if self.left > 0:
            self.left -= 1
        self.started += 1
        return True

    def admit(self) -> None:
        """A request traced whatever the rate and count say (a client's OpenTelemetry span)."""
        self.started += 1

    def finish(self, traces: list[Trace], writer: _Output) -> None:
        """Write one sample (a request's traces) or hold it."""
        self.finished += 1
        if not self.limited and not self.log_frequency:
            writer.write(traces, numbered=False)
            return
        self.pending.append(traces)
        if self.log_frequency and len(self.pending) >= self.log_frequency:
            self.flush(writer, numbered=True)
        elif self.limited and self.left == 0 and self.finished == self.started:
            self.flush(writer, numbered=True)
        elif self.retired and self.finished == self.started:
            self.flush(writer, numbered=self.log_frequency > 0)

    def retire(self, writer: _Output) -> None:
        """Newer settings replace these: what is held goes out once all have finished."""
        self.retired = True
        if self.finished == self.started:
            self.flush(writer, numbered=self.log_frequency > 0)

    def flush(self, writer: _Output, numbered: bool) -> None:
        if self.pending:
            pending, self.pending = self.pending, []
            writer.write([trace for sample in pending for trace in sample], numbered)


class Tracer:
    """The server's trace settings, sampling and trace file (see the module docstring)."""

    def __init__(self, settings: TraceSettings, has_model: Callable[[str], bool]) -> None:
        self._startup = settings.values()
        self.exporting = settings.mode == otel.MODE  # OpenTelemetry: spans, not a file
        self._otel = settings.opentelemetry
        self._global = dict(self._startup)
        self._models: dict[str, dict[str, Any]] = {}
        self._has_model = has_model
        self._scopes: dict[str | None, _Sampling] = {}  # the server's (None) and models' own
        self._retired: list[_Sampling] = []  # replaced ones whose traces are still open
        self._ids = itertools.count(1)
        self._open: dict[int, Trace] = {}  # traces not written yet, by id
        self._writer: _Output = (
            OtlpExporter(settings.opentelemetry)
            if self.exporting
            else _Writer(self._global["trace_file"])
        )
        self._resample(None, self._global["trace_count"])
        self.enabled = False  # may any request be traced now (a cheap check per request)
        self._refresh()

    # -- settings -----------------------------------------------------------------------
    def settings(self, model: str | None = None) -> dict[str, Any]:
        """The settings in effect, server-wide or for ``model``, in the wire form."""
        if model is not None:
            self._check_model(model)
        own = self._models.get(model, {}) if model is not None else {}
        values = {**self._global, **own}
        values["trace_count"] = self._scopes[model if own else None].left  # what is left, as Triton shows
        if self.exporting:
            shown = {name: _wire(name, values[name]) for name in _OTEL_NAMES}
            return {**shown, **self._otel.wire()}
        return {name: _wire(name, values[name]) for name in _NAMES}

    def update(self, model: str | None, changes: dict[str, Any]) -> dict[str, Any]:
        """Apply a partial update (a None value clears: a model's back to the server's,
        the server's back to its start-up value) and return the settings now in effect.

        As in Triton, a model with settings of its own samples on its own: its rate
        counter and what is left of its count start over whenever its settings change
        (the count it did not set from what is left of the server's)."""
        if model is not None:
            self._check_model(model)
        parsed: dict[str, Any] = {}
        for name, value in changes.items():
            # Start-up settings (Triton ignores a new mode or OpenTelemetry setting: refused
            # here, so that a client does not believe it took effect).
            if name == "trace_mode" and value in (None, self._global["trace_mode"]):
                continue
            if self.exporting and name in otel.SETTINGS and value == self._otel.wire().get(name):
                continue  # (as shown: a client writing back what it read changes nothing)
            if name in ("trace_mode", *otel.SETTINGS) and (self.exporting or name == "trace_mode"):
                raise UnsupportedError(f"'{name}' can not be updated through network protocol")
            if name not in _NAMES:
                raise InvalidArgumentError(f"unknown trace setting '{name}'")
            if name == "trace_file":
                raise UnsupportedError(
                    "trace file location can not be updated through network protocol"
                )
            if value is None:
                parsed[name] = None
                continue
            if model is not None and name in _SERVER_WIDE:
                raise InvalidArgumentError(
                    f"'{name}' is a server-wide trace setting: set it without a model"
                )
            parsed[name] = _parse(name, value)
        level_on = parsed.get("trace_level") not in (None, ("OFF",))
        if level_on and not self._global["trace_file"] and not self.exporting:
            # (Triton's words: nothing could be written, so nothing would be traced)
            raise InvalidArgumentError("Attempting to set invalid trace setting :trace file name is not given")
        if model is None:
            after = {**self._global, **{k: self._startup[k] if v is None else v for k, v in parsed.items()}}
        else:
            own = {**self._models.get(model, {}), **parsed}
            after = {**self._global, **{k: v for k, v in own.items() if v is not None}}
        if after["trace_level"] != ("OFF",) and after["trace_rate"] == 0:  # (Triton's words)
            raise InvalidArgumentError("Attempting to set invalid trace setting :sample rate must be non-zero")
        if model is None:
            for name, value in parsed.items():
                self._global[name] = self._startup[name] if value is None else value
            left = self._global["trace_count"] if "trace_count" in parsed else self._scopes[None].left
            self._resample(None, left)
            for name in list(self._models):
                self._restart(name)
        else:
            own = self._models.setdefault(model, {})
            for name, value in parsed.items():
                if value is None:
                    own.pop(name, None)
                else:
                    own[name] = value
            if own:
                self._restart(model)
            else:
                del self._models[model]
                sampling = self._scopes.pop(model, None)
                if sampling is not None:
                    self._retire(sampling)
        self._refresh()
        return self.settings(model)

    def _restart(self, model: str) -> None:
        """A model's own sampling starts over (its settings or the server's changed)."""
        self._resample(model, self._models[model].get("trace_count", self._scopes[None].left))

    def _resample(self, scope: str | None, count: int) -> None:
        """A scope's sampling starts over under its settings now; the old one retires."""
        values = {**self._global, **self._models.get(scope or "", {})} if scope else self._global
        old = self._scopes.get(scope)
        self._scopes[scope] = _Sampling(
            values["trace_rate"], count, values["log_frequency"], holds=not self.exporting
        )
        if old is not None:
            self._retire(old)

    def _retire(self, sampling: _Sampling) -> None:
        sampling.retire(self._writer)
        # (kept while traces of it are open, to write what they leave at a stop)
        self._retired = [s for s in (*self._retired, sampling) if s.finished < s.started or s.pending]

    def _check_model(self, model: str) -> None:
        if not self._has_model(model):
            raise InvalidArgumentError(f"Request for unknown model : {model}")

    def _refresh(self) -> None:
        scopes = [self._global, *({**self._global, **m} for m in self._models.values())]
        self.enabled = (self.exporting or bool(self._global["trace_file"])) and any(
            values["trace_level"] != ("OFF",) for values in scopes
        )

    # -- tracing ------------------------------------------------------------------------
    def start(
        self, model_name: str, request_id: str, context: tuple[str, str] | None = None
    ) -> Trace | None:
        """A new trace for a request to ``model_name``, or None when it is not sampled.
        ``context``: the W3C traceparent and tracestate the client sent, if any."""
        if not self.enabled:
            return None
        scope = model_name if model_name in self._models else None
        own = self._models.get(model_name, {})
        levels = own.get("trace_level", self._global["trace_level"])
        if levels == ("OFF",):
            return None
        sampling = self._scopes[scope]
        ids = SpanIds.for_request(context) if self.exporting and context is not None else None
        if ids is not None and ids.parent_span_id:
            sampling.admit()
        elif not sampling.sample():
            return None
        trace = Trace(self, model_name, request_id, levels)
        trace.sampling = sampling
        if self.exporting:
            trace.span_ids = ids or SpanIds.for_request(None)
        return trace

    def open_trace(self, trace_id: int) -> Trace | None:
        """A trace still collecting events (a model hands it to the requests it makes)."""
        return self._open.get(trace_id)

    def _finished(self, trace: Trace) -> None:
        if trace.root is not None:  # written with its root, which it holds open until now
            trace.root.group.append(trace)
        elif trace.sampling is not None:
            sample = sorted([trace, *trace.group], key=lambda t: t.id)  # (the order they began)
            trace.sampling.finish(sample, self._writer)

    def close(self) -> None:
        """The server stops: write what is held and end the file."""
        for sampling in [*self._scopes.values(), *self._retired]:
            sampling.flush(self._writer, numbered=sampling.log_frequency > 0)
        self._writer.close()
