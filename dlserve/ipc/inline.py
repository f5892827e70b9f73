"""Inline BLS, the worker's side: run a model that another model calls in the caller's
own process, on the calling thread.

A model whose config allows it (``INLINE_BLS: "yes"``; whether a caller may is the
server's decision, :mod:`dlserve.engine.inline_offers`) is run by its BLS callers
themselves: the first call asks the server for the model's INIT message, the worker
makes a private instance of it (its ``initialize`` runs then), and every later call is
a call of that instance's ``execute``, with the caller's tensors as they are: no
message, no copy, no other process. What the server would check still holds: the
request is checked against the model's config by the server's own code (imported here
on the first offer, not at start-up), outputs are reshaped as the config says, and each
call is counted in the model's statistics (``Kind.INLINE_DONE``).

A call goes to the server as before wherever running it here could differ from what the
server would do: a decoupled call, a sequence (correlation ID or flags), a traced request,
an input in GPU memory, a version other than the one offered, a call into an instance
this thread is running already, or one made while another thread runs it (an instance
runs one execute at a time, as the server's do).
"""

from __future__ import annotations

import inspect
import itertools
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from dlserve.errors import ErrorCode, TritonError
from dlserve.ipc.model_code import (
    ABANDONED,
    ANSWERED_TWICE,
    describe_exception,
    load_module,
    not_a_response,
    response_list_problem,
)
from dlserve.ipc.protocol import Kind, refused_call
from dlserve.memory.tensor import MemoryType
from dlserve.pb_utils import _runtime
from dlserve.pb_utils.errors import TritonError as ModelError
from dlserve.pb_utils.errors import TritonModelException
from dlserve.pb_utils.inference import InferenceRequest, InferenceResponse
from dlserve.pb_utils.logger import LogLevel
from dlserve.pb_utils.sender import Exchange
from dlserve.pb_utils.tensor import Tensor

if TYPE_CHECKING:
    from dlserve.ipc.runtime import WorkerRuntime

_aliases = itertools.count(1)


def _failure(code: int, message: str) -> InferenceResponse:
    return InferenceResponse._received([], ModelError(message, code), "{}")


class _Answers:
    """Where one inline request's answers go when its model uses the response sender:
    to the caller, waiting for the final one (a non-decoupled model sends one response,
    then the final flag, maybe from another thread after ``execute`` returned)."""

    def __init__(self) -> None:
        self.response: InferenceResponse | None = None
        self.final = threading.Event()

    def send_response(self, exchange: Exchange, response: InferenceResponse | None, final: bool) -> None:
        if response is not None:
            self.response = response
        if final:
            self.final.set()

    def abandon(self, exchange: Exchange) -> None:
        exchange.closed = True
        self.response = _failure(int(ErrorCode.INTERNAL), ABANDONED)
        self.final.set()

    def is_cancelled(self, exchange: Exchange) -> bool:
        return False  # (the caller is waiting on this very thread, or for the final)


class InlineModel:
    """A private instance of a model, run by its BLS callers in their own process."""

    def __init__(self, offer: dict[str, Any], runtime: WorkerRuntime) -> None:
        # The server's request checks: a worker that runs no inline call never imports them.
        from dlserve.engine.config_forms import parse_json
        from dlserve.engine.request import Signature

        args = offer["args"]
        self.name: str = offer["name"]
        self.version: int = offer["version"]
        self.instance_name: str = args["model_instance_name"]
        self.signature = Signature(parse_json(args["model_config"], self.name))
        self._runtime = runtime
        self._model_dir = os.path.dirname(os.path.abspath(offer["model_path"]))
        self._busy = threading.Lock()  # one execute at a time; held through finalize
        self.closed = False
        token = _runtime.inline_model_dir.set(self._model_dir)
        try:
            alias = f"_dlserve_inline_{next(_aliases)}"
            model = load_module(offer["model_file"], offer["model_path"], alias).TritonPythonModel()
            if inspect.iscoroutinefunction(getattr(model, "execute", None)):
                raise TritonModelException("its execute is a coroutine (async def)")
            initialize = getattr(model, "initialize", None)
            if initialize is not None:
                result = initialize(args)
                if inspect.isawaitable(result):
                    getattr(result, "close", lambda: None)()
                    raise TritonModelException("its initialize is a coroutine (async def)")
        finally:
            _runtime.inline_model_dir.reset(token)
        self._model = model

    def call(self, request: InferenceRequest) -> InferenceResponse | None:
        """``request``'s response, or None where the server must run it."""
        if any(t._tensor.memory_type is not MemoryType.CPU for t in request._inputs):
            return None
        if not self._busy.acquire(blocking=False):
            return None  # (another thread runs it, or this one, further up its stack)
        try:
            return None if self.closed else self._execute(request)
        finally:
            self._busy.release()

    def _execute(self, request: InferenceRequest) -> InferenceResponse:
        from dlserve.engine.request import Request, output_as_declared, validate_request

        start = time.monotonic_ns()
        inputs: dict[str, Any] = {}
        checked = Request(
            model_name=self.name,
            inputs=inputs,
            on_response=lambda response: None,
            model_version=self.version,
            request_id=request._request_id,
            requested_outputs=list(request._requested) or None,
        )
        try:
            for tensor in request._inputs:
                if tensor.name() in inputs:
                    raise TritonError.from_code(
                        ErrorCode.INVALID_ARG, f"input '{tensor.name()}' already exists in request"
                    )
                inputs[tensor.name()] = tensor._tensor
            batch_size = validate_request(checked, self.signature)
        except TritonError as exc:
            return _failure(*refused_call(self.name, exc.message))
        requested = checked.requested_outputs or list(self.signature.output_names)
        answers = _Answers()
        exchange = Exchange(0, requested, None, False)
        exchange.runtime = answers
        received = InferenceRequest._received(
            [Tensor(name, tensor) for name, tensor in inputs.items()],
            requested,
            request._request_id,
            0,
            0,
            request._timeout,
            request._parameters,
            exchange,
        )
        begun = time.monotonic_ns()
        token = _runtime.inline_model_dir.set(self._model_dir)
        try:
            result = self._model.execute([received])
            problem = response_list_problem(result, [received])
        except BaseException as exc:  # noqa: BLE001 - SystemExit too: an error, as in Triton
            result, problem = None, describe_exception(exc)
        finally:
            _runtime.inline_model_dir.reset(token)
        ended = time.monotonic_ns()
        if problem is None:
            response = self._answer(result[0], received, exchange, answers)
        else:
            exchange.closed = True
            response = _failure(int(ErrorCode.INTERNAL), self._failed(problem))
            # (as the server logs an execute that failed)
            self._runtime.log(int(LogLevel.ERROR), response.error().message(), __file__, 0)
        del received, result
        if response.error() is None:
            try:
                outputs = [
                    Tensor(t.name(), output_as_declared(self.signature, t.name(), t._tensor))
                    for t in response.output_tensors()
                    if t.name() in requested
                ]
            except TritonError as exc:
                response, problem = _failure(int(exc.code), exc.message), exc.message
            else:
                response = InferenceResponse._received(outputs, None, response.parameters())
        done = time.monotonic_ns()
        timings = (begun - start, ended - begun, done - ended, done - start)
        self._runtime.notify(
            Kind.INLINE_DONE,
            (self.name, self.version, (batch_size, problem is None, *timings)),
        )
        return response

    def _answer(
        self, returned: Any, request: InferenceRequest, exchange: Exchange, answers: _Answers
    ) -> InferenceResponse:
        """The request's one response: returned by ``execute``, or sent (then ``execute``
        returned None), as the server's instance takes it."""
        if returned is not None:
            with exchange.lock:
                if exchange.responses or exchange.closed:
                    return _failure(int(ErrorCode.INTERNAL), self._failed(ANSWERED_TWICE))
                exchange.closed = True
            return returned
        if request.rescheduled():
            from dlserve.engine.request import reschedule_refused

            exchange.closed = True
            refused = reschedule_refused(self.name)
            return _failure(int(refused.code), refused.message)
        if request._sender is None:
            exchange.closed = True
            return _failure(int(ErrorCode.INTERNAL), not_a_response(returned))
        del request  # (a model that dropped its sender without the final: abandoned now)
        answers.final.wait()
        return answers.response or _failure(int(ErrorCode.INTERNAL), "no response was sent")

    def _failed(self, problem: str) -> str:
        """The error of an execute that failed as a whole, as the worker words it."""
        return f"Failed to process the request(s) for model '{self.instance_name}', message: {problem}"

    def finalize(self) -> None:
        """Waits for a call running on another thread, then runs the model's ``finalize``."""
        with self._busy:
            if self.closed:
                return
            self.closed = True
            finalize = getattr(self._model, "finalize", None)
            if finalize is None:
                return
            token = _runtime.inline_model_dir.set(self._model_dir)
            try:
                result = finalize()
                if inspect.isawaitable(result):
                    getattr(result, "close", lambda: None)()
            except Exception as exc:  # noqa: BLE001 - the caller's worker goes on
                self._runtime.log(
                    int(LogLevel.ERROR),
                    f"finalize of inline instance '{self.instance_name}' failed: "
                    f"{describe_exception(exc)}",
                    __file__,
                    0,
                )
            finally:
                _runtime.inline_model_dir.reset(token)


class InlineCalls:
    """A worker's inline instances, by the model name and version its BLS calls name."""

    def __init__(self, runtime: WorkerRuntime) -> None:
        self._runtime = runtime
        # None: the server said no (or the model failed to start here): ask again only
        # after the server says a version of that model loaded or unloaded.
        self._models: dict[tuple[str, int], InlineModel | None] = {}
        self._lock = threading.Lock()  # one question to the server at a time

    def call(self, request: InferenceRequest, decoupled: bool) -> InferenceResponse | None:
        """``request``'s response, run here; None where the server must run it."""
        if decoupled or request._flags or request._correlation_id or request._trace is not None:
            return None
        key = (request._model_name, request._model_version)
        model = self._models.get(key, False)
        if model is False:
            with self._lock:
                model = self._models.get(key, False)
                if model is False:
                    model = self._models[key] = self._start(*key)
        return None if model is None else model.call(request)

    def _start(self, name: str, version: int) -> InlineModel | None:
        try:
            offer = self._runtime.channel.request(Kind.INLINE, (name, version))
        except (TritonError, EOFError, OSError):
            return None
        if offer is None:
            return None
        for model in self._models.values():  # (the same version, asked for by number)
            if model is not None and model.name == name and model.version == offer["version"]:
                return model
        try:
            return InlineModel(offer, self._runtime)
        except Exception as exc:  # noqa: BLE001 - its calls go through the server instead
            self._runtime.log(
                int(LogLevel.WARNING),
                f"model '{name}' does not run inline in '{self._runtime.instance_name}', its BLS "
                f"calls go through the server: {describe_exception(exc)}",
                __file__,
                0,
            )
            return None

    def drop(self, names: list[str]) -> None:
        """The server's INLINE_DROP: these models' instances here go (their finalize runs)."""
        with self._lock:
            keys = [key for key in self._models if key[0] in names]
            gone = {id(m): m for m in (self._models.pop(key) for key in keys) if m is not None}
        for model in gone.values():
            model.finalize()

    def close(self) -> None:
        """The worker ends: every inline instance's finalize runs."""
        self.drop(list({name for name, _ in self._models}))
