"""The worker ("stub") process: hosts one instance of one Triton Python model.

Started by the server as ``python -m dlserve.ipc.stub --fd N ...`` with one end of
a socket pair. It imports only numpy, dlserve.memory, dlserve.ipc and pb_utils, so
it starts fast and never drags in the frontends. It serves commands in order:
AUTO_COMPLETE (in a throwaway worker), INIT, EXECUTE..., FINALIZE; end of file on
the socket means the server is gone, and a watchdog thread catches a server that
dies while the model is busy. Either way the worker unlinks its own segments.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import inspect
import json
import os
import socket
import sys
import threading
import traceback
from types import ModuleType
from typing import Any


from dlserve.errors import ErrorCode, TritonError
from dlserve.ipc.channel import WorkerChannel
from dlserve.ipc.protocol import Kind
from dlserve.ipc.tensors import Peer
from dlserve.memory.arena import Arena, MemorySpace
from dlserve.pb_utils import _runtime
from dlserve.pb_utils.errors import TritonModelException
from dlserve.pb_utils.inference import InferenceRequest, InferenceResponse
from dlserve.pb_utils.model_config import ModelConfig
from dlserve.pb_utils.tensor import Tensor


class ModelFailure(Exception):
    """Fails every request of one execute call (Triton's batch-level error)."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.INTERNAL) -> None:
        super().__init__(message)
        self.code = code


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def describe_exception(exc: BaseException) -> str:
    """``Type: message`` and where in the model it happened, innermost frame first
    (Triton's layout), without dlserve's own frames."""
    frames = [
        frame
        for frame in traceback.extract_tb(exc.__traceback__)
        if not frame.filename.startswith(_PACKAGE_DIR)
    ]
    where = "".join(f"  {f.filename}({f.lineno}): {f.name}\n" for f in reversed(frames))
    return f"{type(exc).__name__}: {exc}\n\nAt:\n{where}" if where else f"{type(exc).__name__}: {exc}"


class WorkerRuntime:
    """What pb_utils reaches through :mod:`dlserve.pb_utils._runtime` in this process."""

    def __init__(self, channel: WorkerChannel, arena: Arena) -> None:
        self.channel = channel
        self.arena = arena

    def log(self, level: int, message: str) -> None:
        self.channel.send(Kind.LOG, 0, (level, message))

    def request(self, kind: int, body: Any) -> Any:
        try:
            return self.channel.request(kind, body)
        except TritonError as exc:
            raise TritonModelException(exc.message) from None

    def notify(self, kind: int, body: Any) -> None:
        self.channel.send(kind, 0, body)


def load_module(model_file: str) -> ModuleType:
    """Import ``model.py`` with its version folder and model folder on ``sys.path``."""
    version_dir = os.path.dirname(os.path.abspath(model_file))
    for path in (os.path.dirname(version_dir), version_dir):
        if path not in sys.path:
            sys.path.insert(0, path)
    spec = importlib.util.spec_from_file_location("model", model_file)
    if spec is None or spec.loader is None:
        raise ModelFailure(f"cannot import {model_file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["model"] = module
    spec.loader.exec_module(module)
    if not hasattr(module, "TritonPythonModel"):
        raise ModelFailure(f"{model_file} does not define class TritonPythonModel")
    return module


async def _await(awaitable: Any) -> Any:
    return await awaitable


class Worker:
    """Executes the commands the server sends, one at a time."""

    def __init__(self, channel: WorkerChannel, peer: Peer, instance_name: str) -> None:
        self.channel = channel
        self.peer = peer
        self.instance_name = instance_name
        self.model: Any = None
        self._loop = asyncio.new_event_loop()  # runs ``async def`` hooks, kept across calls

    def close(self) -> None:
        self._loop.close()

    def _run(self, result: Any) -> Any:
        """Run the coroutine an ``async def`` hook returned to completion."""
        if inspect.isawaitable(result):
            return self._loop.run_until_complete(_await(result))
        return result

    def serve(self) -> None:
        while True:
            try:
                kind, corr, body = self.channel.next_command()
            except EOFError:
                return
            try:
                if kind == Kind.EXECUTE:
                    self.channel.reply(corr, self._execute(body))
                elif kind == Kind.INIT:
                    self._initialize(body)
                    self.channel.reply(corr, {"has_is_ready": hasattr(self.model, "is_ready")})
                elif kind == Kind.AUTO_COMPLETE:
                    self.channel.reply(corr, self._auto_complete(body))
                elif kind == Kind.IS_READY:
                    self.channel.reply(corr, self._is_ready())
                elif kind == Kind.RELEASE:
                    self.peer.release(body)
                elif kind == Kind.RETIRE:
                    for name in body:
                        self.peer.space.forget_segment(name)
                elif kind == Kind.FINALIZE:
                    self._finalize()
                    self.channel.reply(corr, None)
                    return
                else:
                    self.channel.reply_error(corr, ErrorCode.UNSUPPORTED, f"unknown command {kind}")
            except ModelFailure as exc:
                self.channel.reply_error(corr, exc.code, str(exc))
            except TritonError as exc:
                self.channel.reply_error(corr, exc.code, exc.message)
            except Exception as exc:  # noqa: BLE001 - any model error goes back to the server
                self.channel.reply_error(corr, ErrorCode.INTERNAL, describe_exception(exc))
            # Views held by a failed call's traceback die only now; return them promptly.
            self.channel.flush_releases()

    # -- lifecycle ----------------------------------------------------------------------
    def _auto_complete(self, body: dict[str, Any]) -> str:
        module = load_module(body["model_file"])
        hook = getattr(module.TritonPythonModel, "auto_complete_config", None)
        config = ModelConfig(body["config"])
        if hook is None:
            return json.dumps(config.as_dict())
        result = hook(config)
        if not isinstance(result, ModelConfig):
            raise ModelFailure(
                "auto_complete_config must return the pb_utils.ModelConfig it was given, "
                f"got {type(result).__name__}"
            )
        return json.dumps(result.as_dict())

    def _initialize(self, body: dict[str, Any]) -> None:
        module = load_module(body["model_file"])
        self.model = module.TritonPythonModel()
        initialize = getattr(self.model, "initialize", None)
        if initialize is not None:
            self._run(initialize(body["args"]))

    def _is_ready(self) -> bool:
        hook = getattr(self.model, "is_ready", None)
        return True if hook is None else bool(self._run(hook()))

    def _finalize(self) -> None:
        finalize = getattr(self.model, "finalize", None)
        if finalize is not None:
            self._run(finalize())

    # -- execute ------------------------------------------------------------------------
    def _execute(self, body: list[Any]) -> list[Any]:
        inputs = self._inputs(body)
        requests = [self._request(wire, tensors) for wire, tensors in zip(body, inputs)]
        try:
            responses = self._run(self.model.execute(requests))
        except Exception as exc:  # noqa: BLE001
            raise ModelFailure(self._failure(describe_exception(exc))) from None
        self._check_responses(responses, requests)
        wire = [
            None if resp is None else self._response(resp, req)  # None: rescheduled
            for resp, req in zip(responses, requests)
        ]
        # Drop our views before replying so their releases ride on the reply.
        del requests, responses
        return wire

    def _inputs(self, body: list[Any]) -> list[list[Tensor]]:
        """Each request's input tensors; a batch's inputs of one name are imported
        together (back to back in memory, see Peer.import_many)."""
        if len(body) == 1:
            return [[Tensor(*self.peer.import_(wire)) for wire in body[0][6]]]
        by_name: dict[str, list[tuple[int, int, Any]]] = {}
        for index, request in enumerate(body):
            for position, wire in enumerate(request[6]):
                by_name.setdefault(wire[0], []).append((index, position, wire))
        inputs: list[list[Any]] = [[None] * len(request[6]) for request in body]
        for group in by_name.values():
            imported = self.peer.import_many([wire for _, _, wire in group])
            for (index, position, _), (name, tensor) in zip(group, imported):
                inputs[index][position] = Tensor(name, tensor)
        return inputs

    def _request(self, wire: tuple[Any, ...], inputs: list[Tensor]) -> InferenceRequest:
        request_id, correlation_id, flags, timeout, parameters, requested, _, buffers = wire
        destinations = None
        if buffers:
            destinations = {}
            for buffer in buffers:
                name, tensor = self.peer.import_(buffer)
                destinations[name] = tensor.storage()
        return InferenceRequest._received(
            inputs,
            requested,
            request_id,
            correlation_id,
            flags,
            timeout,
            parameters,
            destinations,
        )

    def _failure(self, message: str) -> str:
        return f"Failed to process the request(s) for model '{self.instance_name}', message: {message}"

    def _check_responses(self, responses: Any, requests: list[InferenceRequest]) -> None:
        expected = len(requests)
        if responses is None:
            raise ModelFailure(
                self._failure(
                    "execute returned None, but a model in default (non-decoupled) mode must "
                    "return a list with one InferenceResponse per request"
                )
            )
        if not isinstance(responses, list):
            raise ModelFailure(
                self._failure(
                    f"Expected a list in the execute return, found type '{type(responses)}'."
                )
            )
        if len(responses) != expected:
            raise ModelFailure(
                self._failure(
                    "Number of InferenceResponse objects do not match the number of "
                    f"InferenceRequest objects. InferenceRequest(s) size is:{expected}, "
                    f"and InferenceResponse(s) size is:{len(responses)}\n"
                )
            )
        for response, request in zip(responses, requests):
            if response is None and request.rescheduled():
                continue
            if not isinstance(response, InferenceResponse):
                raise ModelFailure(
                    self._failure(
                        "each element of the execute return must be a pb_utils.InferenceResponse, "
                        f"found type '{type(response)}'"
                    )
                )

    def _response(self, response: InferenceResponse, request: InferenceRequest) -> tuple[Any, ...]:
        error = response.error()
        if error is not None:
            return ((), (error.code(), error.message()), response.parameters())
        requested = set(request.requested_output_names())
        destinations = request._destinations or {}
        outputs = []
        for tensor in response.output_tensors():
            name = tensor.name()
            if name not in requested:
                continue
            destination = destinations.get(name)
            if destination is None:
                outputs.append(self.peer.export(name, tensor._tensor))
                continue
            try:
                placed = tensor._tensor.write_into(destination)
            except ValueError as exc:
                message = f"output '{name}' {exc} (its shared memory region)"
                return ((), (int(ErrorCode.INVALID_ARG), message), response.parameters())
            outputs.append(self.peer.export(name, placed, by_reference=True))
        return (outputs, None, response.parameters())


def _watch_parent(parent: int, arena: Arena) -> None:
    """End the worker when the server dies while the model is busy (no EOF seen)."""
    while True:
        threading.Event().wait(1.0)
        if os.getppid() != parent:
            arena.close()
            os._exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dlserve-stub")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--segment-prefix", required=True)
    parser.add_argument("--arena-bytes", type=int, required=True)
    parser.add_argument("--instance-name", required=True)
    args = parser.parse_args(argv)

    sock = socket.socket(fileno=args.fd)
    channel = WorkerChannel(sock)
    space = MemorySpace()
    arena = Arena(
        space,
        args.segment_prefix,
        initial_size=args.arena_bytes,
        growth_size=args.arena_bytes,
        on_retire=lambda name: channel.send(Kind.RETIRE, 0, [name]),
    )
    peer = Peer(space, arena, channel.queue_releases)
    _runtime.install(WorkerRuntime(channel, arena))
    threading.Thread(
        target=_watch_parent, args=(os.getppid(), arena), name="parent-watch", daemon=True
    ).start()
    worker = Worker(channel, peer, args.instance_name)
    try:
        worker.serve()
    finally:
        worker.close()
        peer.close()
        arena.close()
        channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

