"""One model instance: a worker process, its lifecycle, and the execute round trip.

Each request sent to the worker gets a *handle*, by which the worker's responses
(streamed through a response sender, before or after ``execute`` returns) and the
server's cancellations name it. A request is *open* from its execute until its
final response.

An instance that dies (segfault, ``os._exit``, SIGKILL, OOM) fails its open
requests at once with the reason, is marked not ready, and is restarted with
exponential backoff; its ``initialize`` and its model's warmup run again, exactly as
on first load.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import itertools
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dlserve.engine import warmup
from dlserve.engine.backends import init_message
from dlserve.engine.calls import ModelCalls
from dlserve.engine.request import (
    NOT_RUN,
    STREAMING,
    Request,
    Response,
    output_as_declared,
    parameters_json,
)
from dlserve.errors import ErrorCode, InternalError, TritonError, UnavailableError
from dlserve.ipc.channel import WorkerGoneError
from dlserve.ipc.protocol import STREAMED, UNRUN, Kind, Message
from dlserve.ipc.supervisor import WorkerProcess
from dlserve.memory.tensor import Tensor
from dlserve.pb_utils.logger import PYTHON_LEVELS, LogLevel

if TYPE_CHECKING:
    from dlserve.engine.model import ModelVersion
    from dlserve.ipc.channel import ServerChannel

log = logging.getLogger("dlserve.engine")

RESTART_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
STABLE_AFTER_S = 30.0  # an instance up this long gets its backoff reset
IS_READY_TIMEOUT_S = 5.0  # as Triton: a model's is_ready() that takes longer means "not ready"
# Config parameter: how many executes of an ``async def execute`` model one instance
# runs at once (1 = Triton's behaviour for non-decoupled models).
ASYNC_CONCURRENCY_PARAMETER = "ASYNC_EXECUTE_CONCURRENCY"
DEFAULT_ASYNC_CONCURRENCY = 16


class InstanceState(enum.Enum):
    STARTING = "STARTING"
    WARMING = "WARMING"  # running its model's warmup samples: executes, but takes no requests
    READY = "READY"
    RESTARTING = "RESTARTING"
    STOPPED = "STOPPED"


_EXECUTING = (InstanceState.READY, InstanceState.WARMING)


class Timings:
    """Nanosecond split of one execution, for statistics."""

    __slots__ = ("input_ns", "infer_ns", "output_ns")

    def __init__(self, input_ns: int, infer_ns: int, output_ns: int) -> None:
        self.input_ns = input_ns
        self.infer_ns = infer_ns
        self.output_ns = output_ns


ExecuteCallback = Callable[[Any, "Timings | None"], None]


class ModelInstance:
    def __init__(
        self,
        model: ModelVersion,
        name: str,
        kind: str,
        device_id: int,
        serial: int,
        on_state_change: Callable[[ModelInstance], None],
        passive: bool = False,
    ) -> None:
        self.model = model
        self.name = name
        self.kind = kind
        self.passive = passive  # initialized and warmed up, never given requests (Triton's)
        self.device_id = device_id
        self.serial = serial
        self.signature = b""  # its group's settings and device (model.instance_signature)
        self.state = InstanceState.STARTING
        # Ready, and one the schedulers give requests to (not a passive one). Kept with the
        # state (_set_state), not a property: every request asks it.
        self.serves = False
        self.in_flight = 0  # executions sent to the worker and not answered yet
        self.concurrency: int | None = None  # executes at once (async models); None: scheduler's
        self.last_done_ns = 0  # when the last execute finished (monotonic ns)
        self.restarts = 0
        self._restart_streak = 0  # restarts since the instance last stayed up a while
        self.has_is_ready = False  # the model defines is_ready()
        self._readiness: asyncio.Future[bool] | None = None
        self.last_error = ""
        self._on_state_change = on_state_change
        self._worker: WorkerProcess | None = None
        self._restart_task: asyncio.Task[None] | None = None
        self._started_at = 0.0
        self._stopping = False
        self._log = logging.getLogger(f"dlserve.model.{model.name}")
        self._handles = itertools.count(1)
        self._executing: dict[int, Request] = {}  # handle -> request, from send to execute reply
        self._streaming: dict[int, Request] = {}  # handle -> request, after it, until the final
        self._held: dict[int, Response] = {}  # a default-mode model's response awaiting its final
        self.calls = ModelCalls(self)

    @property
    def ready(self) -> bool:
        return self.state is InstanceState.READY

    @property
    def worker(self) -> WorkerProcess | None:
        return self._worker

    @property
    def channel(self) -> ServerChannel | None:
        """The channel to the worker while it is alive (None otherwise)."""
        worker = self._worker
        return worker.channel if worker is not None and worker.alive else None

    @property
    def pid(self) -> int | None:
        return None if self._worker is None else self._worker.pid

    async def start(self) -> None:
        """Spawn the worker, run ``initialize`` and the model's warmup; raises with the
        model's error. A start that does not finish (cancelled, say) leaves no worker."""
        resources = self.model.resources
        worker = WorkerProcess(
            instance_name=self.name,
            segment_prefix=f"{resources.segment_prefix}_w{self.serial}r{self.restarts}",
            arena_bytes=resources.worker_arena_bytes,
            arena_growth_bytes=resources.worker_arena_growth_bytes,
            space=resources.space,
            arena=resources.arena,
            cuda=resources.cuda_regions,
            on_message=self._on_worker_message,
            on_exit=lambda description: self._on_worker_exit(worker, description),
            on_segments_gone=resources.host.segments_gone,
            # (its objects hold their families no more; their metrics stay)
            on_end=lambda: resources.custom_metrics.forget(worker),
            environment=self.model.environment,
            poll_us=resources.busy_poll_us,
        )
        self._worker = worker
        await worker.start()  # (a cancelled one ends its process itself)
        try:
            await asyncio.wait_for(self._initialize(worker), resources.load_timeout or None)
        except asyncio.TimeoutError:
            model = self.model
            error = await worker.end_stuck(
                f"loading model instance '{self.name}'",
                resources.load_timeout,
                [str(model.model_dir), str(model.code_file.parent)],
            )
            self._log.error("ERROR: Failed to create instance: %s", error.message)
            self._set_state(InstanceState.RESTARTING if self.restarts else InstanceState.STARTING)
            raise error from None
        except BaseException as exc:
            if not isinstance(exc, TritonError):  # (a model's error stopped it already)
                worker.kill()
            raise

    async def _initialize(self, worker: WorkerProcess) -> None:
        """``initialize`` and the warmup in a started worker, which a failure stops."""
        try:
            reply = await worker.request(
                Kind.INIT, init_message(self.model, self.kind, self.name, self.device_id)
            )
            if not worker.alive:  # it died right after answering, before it was READY
                raise WorkerGoneError("worker process is not running")
        except TritonError as exc:
            if isinstance(exc, WorkerGoneError):  # the worker died during initialize
                reason = await worker.death_reason()
            else:
                reason = exc.message
                self._log.info("Failed to initialize Python stub: %s", reason)
            self._log.error("ERROR: Failed to create instance: %s", reason)  # (Triton's lines, grepped)
            await worker.stop(time.monotonic() + 5.0, finalize=False)
            raise InternalError(reason) from None  # (the model's error, as Triton words the load's)
        self.has_is_ready = bool(reply["has_is_ready"])
        self.concurrency = self._async_concurrency() if reply["async_execute"] else None
        self._started_at = time.monotonic()
        if self.model.warmup_samples:
            self._set_state(InstanceState.WARMING)
            try:
                await warmup.warm_up(self, self.model.warmup_samples)
            except TritonError as exc:
                self._log.error("ERROR: Failed to create instance: %s", exc.message)  # (Triton's)
                await worker.stop(time.monotonic() + 5.0)  # finalize runs, as in Triton
                self._set_state(InstanceState.RESTARTING if self.restarts else InstanceState.STARTING)
                raise
        self._set_state(InstanceState.READY)

    def _async_concurrency(self) -> int:
        entry = self.model.config.parameters.get(ASYNC_CONCURRENCY_PARAMETER)
        return DEFAULT_ASYNC_CONCURRENCY if entry is None else int(entry.string_value)  # validated

    def _set_state(self, state: InstanceState) -> None:
        self.state = state
        self.serves = state is InstanceState.READY and not self.passive
        self._on_state_change(self)

    def _on_worker_message(self, message: Message) -> None:
        """Traffic the worker starts: responses, BLS calls, log lines, custom metrics."""
        kind, corr, body = message
        metrics = self.model.resources.custom_metrics
        if kind == Kind.RESPONSE:
            self._streamed(*body)
        elif kind in (Kind.BLS, Kind.BLS_CANCEL, Kind.MODEL_CONTROL, Kind.INLINE, Kind.INLINE_DONE):
            self.calls.handle(kind, corr, body)
        elif kind == Kind.LOG:
            self._model_log_line(body)
        elif kind == Kind.METRIC:
            op, name, labels, value = body
            try:
                if op == "create":
                    metrics.create(name, labels, value)
                elif op == "release":
                    metrics.release(name, self._worker)
                else:
                    metrics.update(op, name, labels, value)
            except TritonError as exc:
                self._log.warning("metric update from '%s' refused: %s", self.name, exc.message)
        elif kind in (Kind.METRIC_FAMILY, Kind.METRIC_VALUE):
            channel = self.channel
            if channel is None:
                return
            try:
                if kind == Kind.METRIC_FAMILY:
                    result = metrics.declare(*body, holder=self._worker)
                else:
                    result = metrics.value(*body)
            except TritonError as exc:
                channel.reply_error(corr, exc)
            else:
                channel.reply(corr, result)

    def _model_log_line(self, body: Any) -> None:
        """A line of the model's log, under the model file and line that logged it; a
        malformed one is said and dropped (the worker's channel goes on)."""
        try:
            level, text, filename, line = body
            python_level = PYTHON_LEVELS[LogLevel(level)]
        except (TypeError, ValueError):
            log.error("model instance '%s' sent a malformed log line: %.200r", self.name, body)
            return
        self._log.log(python_level, "%s", text, extra={"source": f"{filename}:{line}"})

    def _on_worker_exit(self, worker: WorkerProcess, description: str) -> None:
        if worker is self._worker and self.state is InstanceState.WARMING:
            # Its warmup's open requests fail (their start() fails with them).
            self.calls.close()
            self._fail_streaming(f"{description} while warming up")
            return
        if worker is not self._worker or self.state is not InstanceState.READY:
            # It died before it served (in or right after initialize): the start()
            # waiting for it fails, and whoever called it (a load, the restart loop)
            # deals with that.
            return
        self.last_error = description
        self.calls.close()
        # Requests whose execute returned but whose final never came; the ones still
        # executing fail through their execute (see _report_death).
        self._fail_streaming(f"{description} before sending the final response")
        if self._stopping:
            return
        self._set_state(InstanceState.RESTARTING)
        self._restart_task = asyncio.get_running_loop().create_task(self._restart())

    async def _restart(self) -> None:
        if time.monotonic() - self._started_at > STABLE_AFTER_S:
            self._restart_streak = 0
        while not self._stopping:
            delay = RESTART_BACKOFF_S[min(self._restart_streak, len(RESTART_BACKOFF_S) - 1)]
            self._restart_streak += 1
            await asyncio.sleep(delay)
            if self._stopping:
                return
            self.restarts += 1
            log.warning("restarting model instance '%s' (restart #%d)", self.name, self.restarts)
            try:
                await self.start()
                return
            except TritonError as exc:
                self.last_error = exc.message
                log.error("restart of '%s' failed: %s", self.name, exc.message)

    async def check_ready(self, timeout: float = IS_READY_TIMEOUT_S) -> bool:
        """Ready, and the model's own ``is_ready()`` (if any) says so within ``timeout``.

        Concurrent checks share one call into the worker, as in Triton.
        """
        if not self.ready or self._worker is None:
            return False
        if not self.has_is_ready:
            return True
        if self._readiness is None or self._readiness.done():
            self._readiness = asyncio.ensure_future(self._ask_ready(timeout))
        return await asyncio.shield(self._readiness)

    async def _ask_ready(self, timeout: float) -> bool:
        assert self._worker is not None
        try:
            return bool(await asyncio.wait_for(self._worker.request(Kind.IS_READY, None), timeout))
        except (asyncio.TimeoutError, TritonError) as exc:
            log.warning("is_ready() of '%s' failed: %s", self.name, exc or "timed out")
            return False

    def execute(
        self,
        requests: list[Request],
        done: ExecuteCallback,
        released: Callable[[], None] | None = None,
    ) -> None:
        """Send one execute to the worker; ``done`` gets (responses, timings) or
        (error, None) on the event loop when it completes. ``released()``, if given,
        runs before that, once the worker has replied: the worker is free for its next
        execute while this one's responses are read and delivered.

        Callback-driven rather than a coroutine: no task and no extra loop turns
        per request on the hot path. Raises at once if the instance is not ready.
        """
        worker = self._worker
        if worker is None or worker.peer is None or self.state not in _EXECUTING:
            raise UnavailableError(f"model instance '{self.name}' is not ready: {self.last_error}")
        model = self.model
        peer = worker.peer
        t0 = time.monotonic_ns()
        handles = [self._handle(r) for r in requests]
        with peer.exports() as out:
            body = [
                (
                    handle,
                    r.request_id,
                    r.correlation_id,
                    r.flags,
                    r.timeout_us,
                    parameters_json(r.parameters),
                    model.output_names if r.requested_outputs is None else r.requested_outputs,
                    [out.add(name, tensor) for name, tensor in r.inputs.items()],
                    None if not r.output_buffers else [
                        out.add(name, Tensor.of_bytes(view), by_reference=True)
                        for name, view in r.output_buffers.items()
                    ],
                    0 if r.trace is None else r.trace.for_worker(),  # for BLS calls, get_context()
                )
                for handle, r in zip(handles, requests)
            ]
        t1 = time.monotonic_ns()
        executing = self._executing
        traces: list[Any] = []  # (filled in once the execute is sent)

        def finished(replies: Any, error: BaseException | None) -> None:
            t2 = time.monotonic_ns()
            for handle in handles:
                executing.pop(handle, None)
            # (a dead worker's instance is released once its death is reported)
            if released is not None and not isinstance(error, WorkerGoneError):
                try:
                    released()
                except Exception:  # noqa: BLE001 - a failed next execute must not lose this one
                    log.exception("dispatching the next execute of '%s' failed", self.name)
            try:
                complete(replies, error, t2)
            finally:
                for trace in traces:
                    trace.release()
                # A response a default-mode model sent without its final belongs to a request
                # still open here; one whose execute answered otherwise is dropped (and its
                # memory goes back to the worker).
                held = self._held
                if held:
                    for handle in handles:
                        if handle not in self._streaming:
                            held.pop(handle, None)

        def complete(replies: Any, error: BaseException | None, t2: int) -> None:
            if isinstance(error, WorkerGoneError):  # the worker died mid-call
                asyncio.ensure_future(self._report_death(worker, done))
                return
            if error is not None:
                failure = error if isinstance(error, TritonError) else InternalError(str(error))
                log.error("%s", failure.message)  # (as Triton logs a failed execute)
                for handle, request in zip(handles, requests):
                    # As Triton: the one response a default-mode model already sent is its
                    # request's answer; the execute's error reaches only the log for it.
                    sent = self._held.pop(handle, None)
                    if sent is not None:
                        self._streaming.pop(handle, None)
                        sent.final = True
                        request.owner.stream_response(request, sent)
                done(failure, None)
                return
            try:
                results = [
                    self._result(handle, request, reply)
                    for handle, request, reply in zip(handles, requests, replies)
                ]
            except Exception as exc:  # noqa: BLE001 - answer the requests rather than hang them
                for reply in replies:
                    if isinstance(reply, tuple):
                        self._discard(reply)  # the worker's memory goes back at once
                done(self._unreadable(exc, "responses"), None)
                return
            t3 = time.monotonic_ns()
            for trace in traces:
                trace.record("COMPUTE_START", t0)
                trace.record("COMPUTE_INPUT_END", t1)
                trace.record("COMPUTE_OUTPUT_START", t2)
                trace.record("COMPUTE_END", t3)
            done(results, Timings(t1 - t0, t2 - t1, t3 - t2))

        worker.call(Kind.EXECUTE, body, finished)
        for handle, request in zip(handles, requests):
            executing[handle] = request
            request.cancel_hook = functools.partial(self._cancel, handle)
            if request.trace is not None:
                # Open until the execute returns, for its compute times: a model may end
                # the request before that (its response sender, a cancellation).
                request.trace.hold()
                traces.append(request.trace)

    def _handle(self, request: Request) -> int:
        """The name of ``request`` between the server and this instance's worker: a new
        one, or the one a rescheduled request keeps for its next execute here."""
        kept = request.resumes
        if kept is not None and kept[0] is self:
            return kept[1]
        return next(self._handles)

    def _result(self, handle: int, request: Request, reply: Any) -> Response | None:
        """What an execute reply says of one request (see Scheduler._finished)."""
        if reply == STREAMED:
            if not request.finished:
                self._streaming[handle] = request
            return STREAMING
        request.cancel_hook = None
        if reply == UNRUN:
            return NOT_RUN
        try:
            response = self._response(request, reply)
        except TritonError as exc:  # (this request's alone: an output its reshape cannot take)
            self._discard(reply)  # the worker's memory goes back at once
            model = self.model
            response = Response(model.name, model.version, request.request_id)
            response.error = self._unreadable(exc, "response")
        if response is None:
            # Rescheduled: a response sender the model kept answers it still, meanwhile
            # too (as in Triton), and sees a cancellation; its next execute here goes by
            # the same handle.
            if not request.finished:
                self._streaming[handle] = request
                request.cancel_hook = functools.partial(self._cancel, handle)
            request.resumes = (self, handle)
        else:
            self._streaming.pop(handle, None)
        return response

    def _streamed(self, handle: int, wire: Any, final: bool) -> None:
        """A RESPONSE message: one response (or just the final flag) for a request."""
        request = self._executing.get(handle) or self._streaming.get(handle)
        if request is None or request.finished:
            if wire is not None:
                self._discard(wire)  # the request was cancelled: return its memory at once
            self._streaming.pop(handle, None)
            self._held.pop(handle, None)
            return
        if final:
            self._streaming.pop(handle, None)
        try:
            response = self._response(request, wire) if wire is not None else None
        except Exception as exc:  # noqa: BLE001 - fail this request, keep the channel
            self._discard(wire)
            self._cancel(handle)  # the model stops making responses nobody will read
            request.owner.fail(request, self._unreadable(exc, "response"))
            return
        if not self.model.decoupled:
            # Default mode: the one response becomes final with the flag that closes it.
            if not final:
                if response is not None:
                    self._held[handle] = response
                return
            held = self._held.pop(handle, None)
            response = response or held
        if response is None:
            model = self.model
            response = Response(model.name, model.version, request.request_id, flags_only=True)
        response.final = final
        request.owner.stream_response(request, response)

    def _discard(self, wire: Any) -> None:
        worker = self._worker
        if worker is not None and worker.peer is not None:
            worker.peer.discard(wire[0])

    def let_go(self, handle: int) -> None:
        """A request this instance's model rescheduled has its final answer from elsewhere
        (failed, timed out, cancelled): its worker is told, if it still may answer it."""
        if handle in self._streaming:
            self._cancel(handle)

    def _cancel(self, handle: int, answered: bool = True) -> None:
        """Tell the worker. ``answered``: the scheduler answers the caller CANCELLED
        meanwhile, so nothing the model still sends is wanted; else its responses go on."""
        if answered:
            self._streaming.pop(handle, None)
            self._held.pop(handle, None)
        channel = self.channel
        if channel is not None:
            channel.notify(Kind.CANCEL, [handle])

    def _fail_streaming(self, reason: str) -> None:
        streaming, self._streaming = self._streaming, {}
        self._held.clear()
        error = InternalError(f"model instance '{self.name}': {reason}")
        for request in streaming.values():
            request.owner.fail(request, error)

    def open_requests(self, handles: list[int] | None) -> list[Request]:
        """The requests with these handles (all open ones for None) still open here."""
        if handles is None:
            return [*self._executing.values(), *self._streaming.values()]
        found = (self._executing.get(h) or self._streaming.get(h) for h in handles)
        return [r for r in found if r is not None]

    async def _report_death(self, worker: WorkerProcess, done: ExecuteCallback) -> None:
        """Fail the call with the worker's exit status (waited for briefly). A worker
        that serves is restarted; one that dies warming up fails its start instead."""
        warming = self.state is InstanceState.WARMING
        try:
            await asyncio.wait_for(worker.wait_exited(), 2.0)
        except asyncio.TimeoutError:
            pass
        reason = worker.exit_description or "worker process connection closed"
        what = "while warming up" if warming else "while executing the request(s); it is being restarted"
        self.calls.close()
        done(
            InternalError(
                f"Failed to process the request(s) for model instance '{self.name}', "
                f"message: {reason} {what}"
            ),
            None,
        )

    def _unreadable(self, exc: Exception, what: str) -> TritonError:
        """The error for requests whose answer from the worker could not be read: a
        TritonError as it is (e.g. outputs in memory that cannot be mapped), anything
        else logged as the bug it is. Without its traceback or the exception it was raised
        in the handling of: their frames hold the memory just given back."""
        if not isinstance(exc, TritonError):
            log.exception("reading the model's %s from '%s' failed", what, self.name)
            exc = InternalError(f"reading the model's {what} failed: {exc}")
        exc.__context__ = exc.__cause__ = None
        return exc.with_traceback(None)

    def _response(self, request: Request, reply: Any) -> Response | None:
        """The response a worker sent (None: the model rescheduled the request)."""
        if reply is None:
            return None
        model = self.model
        outputs_wire, error, parameters = reply
        response = Response(model.name, model.version, request.request_id)
        if parameters and parameters != "{}":
            response.parameters = json.loads(parameters)
        if error is not None:
            code, message = error
            response.error = TritonError.from_code(ErrorCode(code), message)
            return response
        peer = self._worker.peer if self._worker is not None else None
        if peer is None:
            raise UnavailableError(f"model instance '{self.name}' went away")
        signature = model.signature
        reshapes = signature.reshapes_outputs
        outputs = response.outputs
        for wire in outputs_wire:
            name, tensor = peer.import_(wire)
            outputs[name] = output_as_declared(signature, name, tensor) if reshapes else tensor
        return response

    def forget_segments(self, names: list[str]) -> None:
        """Tell the worker to drop its mappings of these segments (unlinked elsewhere)."""
        channel = self.channel
        if channel is not None:
            channel.notify(Kind.RETIRE, names)

    async def stop(self, deadline: float) -> bool:
        """Finalize and end the worker by ``deadline`` (``time.monotonic()``); whether it
        ended by then (False: it was killed, its finalize unfinished)."""
        self._stopping = True
        if self._restart_task is not None:
            self._restart_task.cancel()
        ended = True
        if self._worker is not None:
            ended = await self._worker.stop(deadline)
        self.calls.close()
        self._fail_streaming("the model was unloaded before it sent the final response")
        self._set_state(InstanceState.STOPPED)
        return ended

    def kill(self) -> None:
        self._stopping = True
        if self._worker is not None:
            self._worker.kill()

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "device_id": self.device_id,
            "state": self.state.value,
            "pid": self.pid,
            "restarts": self.restarts,
            "last_error": self.last_error,
        }
