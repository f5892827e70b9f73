"""Inline BLS, the worker's side: run a model that another model calls in the caller's
own process, on the calling thread.

A model whose config allows it (``INLINE_BLS: "yes"``; whether a caller may is the
server's decision, :mod:`dlserve.engine.inline_offers`) is run by its BLS callers
themselves: the first call asks the server for the model's INIT message, the worker
makes a private instance of it (its ``initialize`` runs then), and every later call is
a call of that instance's ``execute``, with the caller's tensors (read-only views of
them): no message, no copy, no other process. What the server would check still holds:
the request is checked against the model's config by the server's own code (imported
here on the first offer, not at start-up), outputs are reshaped as the config says, text
travels as bytes, parameters as the server writes them, and each call is counted in the
model's statistics (``Kind.INLINE_DONE``).

A call goes to the server as before wherever running it here could differ from what the
server would do: a decoupled call, a sequence (correlation ID or flags), a request that
carries a trace, an input in GPU memory, a version other than the one offered, a call
into an instance this thread is running already, or one made while another thread runs
it (an instance runs one execute at a time, as the server's do). A model whose folders
hold Python modules of its own does not run inline at all: the worker has one
``sys.modules``, and its ``import helper`` would find the caller's.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import inspect
import itertools
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
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
from dlserve.memory.dtypes import DataType
from dlserve.memory.tensor import MemoryType
from dlserve.memory.tensor import Tensor as Array
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


def _as_sent(tensor: Array, read_only: bool) -> Array:
    """``tensor`` as the other model would get it through the server: BYTES as bytes
    (a str element is sent as its UTF-8), and, ``read_only``, without a way to write
    into the sender's memory (through the server, the receiver writes its own copy)."""
    if tensor.data_type is DataType.BYTES:
        return Array(DataType.BYTES, tensor.shape, data=tensor.storage())
    if not read_only:
        return tensor
    view = tensor.storage().view()
    view.flags.writeable = False
    return Array(tensor.data_type, tensor.shape, data=view)


def _parameters(text: str) -> str:
    """Request or response parameters as the server passes them on (compact JSON)."""
    if text == "{}":
        return text
    from dlserve.engine.request import parameters_json

    return parameters_json(json.loads(text))


def _own_modules(offer: dict[str, Any]) -> list[str]:
    """What the model's code could import from beside it (its folders join
    ``sys.path``): Python modules and packages, other than its own file."""
    model_file = os.path.abspath(offer["model_file"])
    code_dir = os.path.dirname(model_file)
    folders = [code_dir]
    if model_file == os.path.abspath(offer["model_path"]):
        folders.append(os.path.dirname(code_dir))  # (its model folder: see load_module)
    suffixes = tuple(importlib.machinery.all_suffixes())
    found = []
    for folder in folders:
        for entry in os.scandir(folder):
            if entry.path == model_file:
                continue
            if entry.is_file() and entry.name.endswith(suffixes):
                found.append(entry.name)
            elif entry.is_dir() and entry.name.isidentifier() and entry.name != "__pycache__":
                if any(f.endswith(suffixes) for f in os.listdir(entry.path)):
                    found.append(entry.name + "/")
    return sorted(found)


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
        own = _own_modules(offer)
        if own:
            raise TritonModelException(
                f"its folders hold modules of its own ({', '.join(own)}), which would share the "
                "caller's sys.modules"
            )
        self._alias = f"_dlserve_inline_{next(_aliases)}"
        try:
            with self._hook():
                code = load_module(offer["model_file"], offer["model_path"], self._alias)
                model = code.TritonPythonModel()
                if inspect.iscoroutinefunction(getattr(model, "execute", None)):
                    raise TritonModelException("its execute is a coroutine (async def)")
                initialize = getattr(model, "initialize", None)
                if initialize is not None:
                    result = initialize(args)
                    if inspect.isawaitable(result):
                        getattr(result, "close", lambda: None)()
                        raise TritonModelException("its initialize is a coroutine (async def)")
        except BaseException:
            self._forget_code()
            raise
        self._model: Any = model

    @contextlib.contextmanager
    def _hook(self) -> Iterator[None]:
        """Around the model's own code outside execute: its folder is get_model_dir()'s
        answer, and BLS is refused, as in Triton (on this thread only: the caller's
        others go on)."""
        token = _runtime.inline_model_dir.set(self._model_dir)
        self._runtime.bls_refused_here(True)
        try:
            yield
        finally:
            self._runtime.bls_refused_here(False)
            _runtime.inline_model_dir.reset(token)

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
                inputs[tensor.name()] = _as_sent(tensor._tensor, read_only=True)
            batch_size = validate_request(checked, self.signature)
        except TritonError as exc:
            return _failure(*refused_call(self.name, exc.message))
        requested = checked.requested_outputs or list(self.signature.output_names)
        answers = _Answers()
        begun = time.monotonic_ns()
        outcome = self._run(inputs, requested, request, answers)
        if outcome is None:  # answered through its response sender: wait for the final
            answers.final.wait()
            outcome = answers.response or _failure(int(ErrorCode.INTERNAL), ABANDONED)
        ended = time.monotonic_ns()
        failed = isinstance(outcome, str)
        if failed:
            response = _failure(int(ErrorCode.INTERNAL), self._failed(outcome))
            # (as the server logs an execute that failed)
            self._runtime.log(int(LogLevel.ERROR), response.error().message(), __file__, 0)
        elif outcome.error() is not None:  # (its outputs do not go with it, as through the server)
            response = InferenceResponse._received([], outcome.error(), _parameters(outcome.parameters()))
        else:
            try:
                outputs = [
                    Tensor(t.name(), output_as_declared(self.signature, t.name(), _as_sent(t._tensor, False)))
                    for t in outcome.output_tensors()
                    if t.name() in requested
                ]
            except TritonError as exc:
                response, failed = _failure(int(exc.code), exc.message), True
            else:
                response = InferenceResponse._received(outputs, None, _parameters(outcome.parameters()))
        done = time.monotonic_ns()
        timings = (begun - start, ended - begun, done - ended, done - start)
        self._runtime.notify(
            Kind.INLINE_DONE, (self.name, self.version, (batch_size, not failed, *timings))
        )
        return response

    def _run(
        self, inputs: dict[str, Any], requested: list[str], request: InferenceRequest, answers: _Answers
    ) -> InferenceResponse | str | None:
        """The model's execute of one request: its response, what went wrong (a str), or
        None where it answers through its response sender. Nothing of the request is
        left here when this returns, so that a model that lets go of its sender without
        the final abandons the request at once (and the wait for it ends)."""
        exchange = Exchange(0, requested, None, False)
        exchange.runtime = answers
        received = InferenceRequest._received(
            [Tensor(name, tensor) for name, tensor in inputs.items()],
            requested,
            request._request_id,
            0,
            0,
            request._timeout,
            _parameters(request._parameters),
            exchange,
        )
        token = _runtime.inline_model_dir.set(self._model_dir)
        try:
            result = self._model.execute([received])
            problem = response_list_problem(result, [received])
        except BaseException as exc:  # noqa: BLE001 - SystemExit too: an error, as in Triton
            problem = describe_exception(exc)
        finally:
            _runtime.inline_model_dir.reset(token)
        if problem is not None:
            exchange.closed = True
            return problem
        returned = result[0]
        if returned is not None:
            with exchange.lock:
                if exchange.responses or exchange.closed:
                    return ANSWERED_TWICE
                exchange.closed = True
            return returned
        if received.rescheduled():
            from dlserve.engine.request import reschedule_refused

            exchange.closed = True
            refused = reschedule_refused(self.name)
            return _failure(int(refused.code), refused.message)
        if received._sender is None:  # (this request alone is answered so, as by the worker)
            exchange.closed = True
            return _failure(int(ErrorCode.INTERNAL), not_a_response(returned))
        return None

    def _failed(self, problem: str) -> str:
        """The error of an execute that failed as a whole, as the worker words it."""
        return f"Failed to process the request(s) for model '{self.instance_name}', message: {problem}"

    def finalize(self) -> None:
        """Waits for a call running on another thread, then runs the model's ``finalize``
        and lets go of its code."""
        with self._busy:
            if self.closed and self._model is None:
                return
            self.closed = True
            model, self._model = self._model, None
            try:
                finalize = getattr(model, "finalize", None)
                if finalize is not None:
                    with self._hook():
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
                self._forget_code()

    def _forget_code(self) -> None:
        """Its modules leave ``sys.modules`` (a reload's copy imports its code afresh)."""
        for name in [n for n in sys.modules if n == self._alias or n.startswith(self._alias + ".")]:
            del sys.modules[name]


class InlineCalls:
    """A worker's inline instances, by the model name and version its BLS calls name."""

    def __init__(self, runtime: WorkerRuntime) -> None:
        self._runtime = runtime
        # None: the server said no (or the model failed to start here): ask again only
        # after the server says a version of that model loaded or unloaded.
        self._models: dict[tuple[str, int], InlineModel | None] = {}
        self._table = threading.Lock()  # held briefly, never across a call to the server
        self._starting = threading.Lock()  # one question to the server at a time
        self._drops: dict[str, int] = {}  # per model name, how many INLINE_DROPs came
        self._dropped: list[InlineModel] = []  # taken out of use, their finalize to run

    def call(self, request: InferenceRequest, decoupled: bool) -> InferenceResponse | None:
        """``request``'s response, run here; None where the server must run it."""
        trace = request._trace
        if decoupled or request._flags or request._correlation_id or (trace is not None and trace._id):
            return None
        self._runtime.look_at_channel()  # (an INLINE_DROP may be waiting: nobody else reads)
        key = (request._model_name, request._model_version)
        model = self._models.get(key, False)
        if model is False:
            with self._starting:
                model = self._models.get(key, False)
                if model is False:
                    model = self._start(*key)
        return None if model is None else model.call(request)

    def _start(self, name: str, version: int) -> InlineModel | None:
        drops = self._drops.get(name, 0)
        model = self._make(name, version)
        with self._table:
            if self._drops.get(name, 0) == drops:  # (a drop that came meanwhile is for it too)
                self._models[(name, version)] = model
                return model
        if model is not None:
            model.finalize()
        return None

    def _make(self, name: str, version: int) -> InlineModel | None:
        try:
            offer = self._runtime.channel.request(Kind.INLINE, (name, version))
        except (TritonError, EOFError, OSError):
            return None
        if offer is None:
            return None
        for model in list(self._models.values()):  # (the same version, asked for by number)
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

    def forget(self, names: list[str]) -> None:
        """The server's INLINE_DROP, as it arrives (on whichever thread reads): calls of
        these models go to the server from now on; their instances here are finalized
        later, on the command thread (:meth:`finalize_dropped`)."""
        with self._table:
            for name in names:
                self._drops[name] = self._drops.get(name, 0) + 1
            keys = [key for key in self._models if key[0] in names]
            gone = {id(m): m for m in (self._models.pop(key) for key in keys) if m is not None}
            for model in gone.values():
                model.closed = True
            self._dropped.extend(gone.values())

    def finalize_dropped(self) -> None:
        with self._table:
            dropped, self._dropped = self._dropped, []
        for model in dropped:
            model.finalize()

    def close(self) -> None:
        """The worker ends: every inline instance's finalize runs."""
        self.forget(list({name for name, _ in self._models}))
        self.finalize_dropped()
