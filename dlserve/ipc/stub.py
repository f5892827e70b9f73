"""The worker ("stub") process: hosts one instance of one Triton Python model.

Started by the server as ``python -m dlserve.ipc.stub --fd N ...`` with one end of
a socket pair. It imports only numpy, dlserve.memory, dlserve.ipc and pb_utils, so
it starts fast and never drags in the frontends. It serves commands in order:
AUTO_COMPLETE (in a throwaway worker), INIT, EXECUTE..., FINALIZE; end of file on
the socket means the server is gone, and a watchdog thread catches a server that
dies while the model is busy. Either way the worker unlinks its own segments.

What the model asks of the server while it runs (responses sent through a response
sender, BLS calls, cancellation checks, logs, metrics, model control) goes through
:class:`dlserve.ipc.runtime.WorkerRuntime`, from any thread.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import inspect
import json
import os
import signal
import socket
import sys
import threading
from typing import Any

from dlserve.errors import ErrorCode, TritonError
from dlserve.ipc.channel import WorkerChannel
from dlserve.ipc.model_code import (
    ANSWERED_TWICE,
    ModelFailure,
    describe_exception,
    load_module,
    not_a_response,
    response_list_problem,
)
from dlserve.ipc.polling import join_board
from dlserve.ipc.protocol import STACKS_SIGNAL, STREAMED, UNRUN, Kind
from dlserve.ipc.runtime import WorkerRuntime, current_handles, encode_response
from dlserve.ipc.tensors import Peer
from dlserve.memory.arena import Arena, MemorySpace
from dlserve.memory.cuda_regions import IpcImports
from dlserve.memory.tensor import MemoryType
from dlserve.pb_utils import _runtime
from dlserve.pb_utils.helpers import using_decoupled_model_transaction_policy
from dlserve.pb_utils.inference import InferenceRequest
from dlserve.pb_utils.logger import route_model_logging
from dlserve.pb_utils.model_config import ModelConfig
from dlserve.pb_utils.tensor import Tensor


def forces_cpu_inputs(config: dict[str, Any]) -> bool:
    """Whether the model takes its inputs in host memory only: Triton's
    ``FORCE_CPU_ONLY_INPUT_TENSORS`` parameter, "yes" (the default) or "no", as Triton
    reads it; any other value fails the load."""
    parameter = config.get("parameters", {}).get("FORCE_CPU_ONLY_INPUT_TENSORS", {})
    value = parameter.get("string_value", "yes")
    if value not in ("yes", "no"):
        raise ValueError(
            f"Incorrect value for FORCE_CPU_ONLY_INPUT_TENSORS: '{value}' (it takes 'yes' or 'no')"
        )
    return value == "yes"


def select_device(device_id: int) -> None:
    """Make ``device_id`` the current CUDA device before the model is imported, as
    Triton's stub does for a KIND_GPU instance, so frameworks default to it."""
    try:
        import cupy
    except ImportError:
        raise ModelFailure(
            f"KIND_GPU instance on device {device_id} needs cupy to select its device "
            "(pip install 'dlserve[gpu-cuda12]' or 'dlserve[gpu-cuda13]')"
        ) from None
    try:
        cupy.cuda.runtime.setDevice(device_id)
    except Exception as exc:  # noqa: BLE001 - any CUDA failure is a load failure
        raise ModelFailure(f"cannot select CUDA device {device_id}: {exc}") from None


async def _await(awaitable: Any) -> Any:
    return await awaitable


class Worker:
    """Executes the commands the server sends, in order.

    A model with ``async def execute`` gets its own event loop on a thread: each
    EXECUTE starts a coroutine there and the main thread goes straight back to
    reading the channel, so executes overlap (the server bounds how many) and the
    coroutines' BLS calls and cancellations are read while they wait.
    """

    def __init__(self, channel: WorkerChannel, runtime: WorkerRuntime, instance_name: str) -> None:
        self.channel = channel
        self.runtime = runtime
        self.peer = runtime.peer
        self.instance_name = instance_name
        self.model: Any = None
        self.decoupled = False
        self.host_inputs = True  # inputs in device memory copied to host (FORCE_CPU_ONLY_INPUT_TENSORS)
        self.sequence_batched = False
        self._loop = asyncio.new_event_loop()  # ``async def`` hooks of models with a sync execute
        self._model_loop: asyncio.AbstractEventLoop | None = None
        self._model_thread: threading.Thread | None = None

    def close(self) -> None:
        loop = self._model_loop
        if loop is not None and self._model_thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            self._model_thread.join(5.0)
        self._loop.close()

    def _run(self, result: Any) -> Any:
        """Run the coroutine an ``async def`` hook returned to completion."""
        if not inspect.isawaitable(result):
            return result
        if self._model_loop is None:
            return self._loop.run_until_complete(_await(result))
        future = asyncio.run_coroutine_threadsafe(_await(result), self._model_loop)
        # The model's coroutines may be waiting on the channel meanwhile: keep it read.
        threading.Thread(
            target=self.channel.serve_until, args=(future.done,), name="channel-reader", daemon=True
        ).start()
        return future.result()

    def _start_model_loop(self) -> None:
        loop = asyncio.new_event_loop()
        self._model_loop = self.runtime.loop = loop
        self._model_thread = threading.Thread(target=loop.run_forever, name="model-loop", daemon=True)
        self._model_thread.start()

    def serve(self) -> None:
        while True:
            try:
                kind, corr, body = self.channel.next_command()
            except EOFError:
                return
            try:
                if kind == Kind.EXECUTE:
                    if self._model_loop is not None:
                        requests = self._requests(body)
                        asyncio.run_coroutine_threadsafe(
                            self._execute_async(corr, requests), self._model_loop
                        )
                        del requests
                    else:
                        wire, held = self._execute(body)
                        self.channel.reply_letting_go(corr, wire, held)
                elif kind == Kind.INIT:
                    self._initialize(body)
                    self.channel.reply(
                        corr,
                        {
                            "has_is_ready": hasattr(self.model, "is_ready"),
                            "async_execute": self._model_loop is not None,
                        },
                    )
                elif kind == Kind.AUTO_COMPLETE:
                    self.channel.reply(corr, self._auto_complete(body))
                elif kind == Kind.IS_READY:
                    self.channel.reply(corr, self._is_ready())
                elif kind == Kind.INLINE_DROP:
                    self.runtime.inline.finalize_dropped()
                elif kind == Kind.RETIRE:
                    for name in body:
                        self.peer.space.forget_segment(name)
                    self.peer.forget_cuda(body)
                elif kind == Kind.FINALIZE:
                    self._finalize()
                    self.channel.reply(corr, None)
                    return
                else:
                    self.channel.reply_error(corr, ErrorCode.UNSUPPORTED, f"unknown command {kind}")
            except BaseException as exc:  # noqa: BLE001 - any model error goes back to the server
                self._reply_failure(corr, exc)
            # Views held by a failed call's traceback die only now; return them promptly.
            self.channel.flush_releases()

    def _reply_failure(self, corr: int, exc: BaseException) -> None:
        if isinstance(exc, ModelFailure):
            self.channel.reply_error(corr, exc.code, str(exc))
        elif isinstance(exc, TritonError):
            self.channel.reply_error(corr, exc.code, exc.message)
        elif isinstance(exc, Exception):
            self.channel.reply_error(corr, ErrorCode.INTERNAL, describe_exception(exc))
        else:
            raise exc

    # -- lifecycle ----------------------------------------------------------------------
    def _auto_complete(self, body: dict[str, Any]) -> str:
        module = load_module(body["model_file"], body["model_path"])
        hook = getattr(module.TritonPythonModel, "auto_complete_config", None)
        config = ModelConfig(body["config"])
        if hook is None:
            return json.dumps(config.as_dict())
        result = hook(config)
        if not isinstance(result, ModelConfig):
            raise ModelFailure(  # (Triton's words, then what it got)
                f"auto_complete_config function in model '{config.as_dict().get('name', '')}' "
                f"must return a valid pb.ModelConfig object. (It returned a "
                f"{type(result).__name__}.)"
            )
        return json.dumps(result.as_dict())

    def _initialize(self, body: dict[str, Any]) -> None:
        args = body["args"]
        config = json.loads(args["model_config"])
        self.decoupled = using_decoupled_model_transaction_policy(config)
        self.sequence_batched = "sequence_batching" in config
        self.host_inputs = forces_cpu_inputs(config)
        if args["model_instance_kind"] == "GPU":
            select_device(int(args["model_instance_device_id"]))
        module = load_module(body["model_file"], body["model_path"])
        self.model = module.TritonPythonModel()
        if inspect.iscoroutinefunction(getattr(self.model, "execute", None)):
            self._start_model_loop()
        initialize = getattr(self.model, "initialize", None)
        if initialize is not None:
            self.runtime.bls_allowed = False
            try:
                self._run(initialize(args))
            finally:
                self.runtime.bls_allowed = True

    def _is_ready(self) -> bool:
        hook = getattr(self.model, "is_ready", None)
        if hook is None:
            return True
        ready = self._run(hook())
        if not isinstance(ready, bool):  # (not ready, as in Triton: its QA returns_non_boolean)
            raise ModelFailure(f"is_ready() must return a bool, got {type(ready).__name__}")
        return ready

    def _finalize(self) -> None:
        self.runtime.bls_allowed = False  # (the worker ends after it)
        finalize = getattr(self.model, "finalize", None)
        try:
            if finalize is not None:
                self._run(finalize())
        finally:
            self.runtime.inline.close()  # (the models it ran for its BLS calls, after it)
        self.runtime.finalized = True

    # -- execute ------------------------------------------------------------------------
    def _execute(self, body: list[Any]) -> tuple[list[Any], list[Any]]:
        """The EXECUTE reply, and what it may refer to (to let go of as it is sent)."""
        self.channel.route_received()  # (its CANCEL may have come with it)
        requests = self._requests(body)
        # (the first request asked before all of them: it is rarely cancelled)
        if requests[0]._exchange.cancelled and all(  # type: ignore[union-attr]
            r._exchange.cancelled for r in requests  # type: ignore[union-attr]
        ):
            # Cancelled while it waited here behind the previous execute: dropped as a
            # queued request is, without running (the server sent it on early).
            for request in requests:
                request._exchange.closed = True  # type: ignore[union-attr]
            return [UNRUN for _ in requests], []
        token = current_handles.set(tuple([wire[0] for wire in body]))
        self.channel.releases_anywhere = True  # (its references are imported: see there)
        try:
            result = self.model.execute(requests)
        except BaseException as exc:  # noqa: BLE001 - SystemExit too: an error, as in Triton
            raise self._failed(requests, describe_exception(exc)) from None
        finally:
            self.channel.releases_anywhere = False
            current_handles.reset(token)
        wire = self._replies(result, requests)
        return wire, [requests, result]  # (held until the reply goes: reply_letting_go)

    async def _execute_async(self, corr: int, requests: list[InferenceRequest]) -> None:
        current_handles.set(tuple(r._exchange.handle for r in requests))  # type: ignore[union-attr]
        try:
            try:
                result = await self.model.execute(requests)
            except BaseException as exc:  # noqa: BLE001 - a CancelledError or SystemExit too
                raise self._failed(requests, describe_exception(exc)) from None
            wire = self._replies(result, requests)
            held = [requests, result]
            del requests, result
            self.channel.reply_letting_go(corr, wire, held)
        except Exception as exc:  # noqa: BLE001
            self._reply_failure(corr, exc)
            self.channel.flush_releases()

    def _failed(self, requests: list[InferenceRequest], message: str) -> ModelFailure:
        """Fail every request of the call; the server answers them all with the error."""
        for request in requests:
            request._exchange.closed = True  # type: ignore[union-attr]
        return ModelFailure(self._failure(message))

    def _requests(self, body: list[Any]) -> list[InferenceRequest]:
        try:
            inputs = self._inputs(body)
            return [self._request(wire, tensors) for wire, tensors in zip(body, inputs)]
        except BaseException:
            # None of the execute reaches the model: every reference it carried goes back
            # now, or the server would hold the memory (a client's region: "in use" for
            # good). Lease ids are never reused, so one already imported, whose view
            # releases it again when it dies, is harmlessly released twice.
            self.peer.discard([w for r in body for w in (*r[7], *(r[8] or ()))])
            raise

    def _inputs(self, body: list[Any]) -> list[list[Tensor]]:
        """Each request's input tensors; a batch's inputs of one name are imported
        together (back to back in memory, see Peer.import_many)."""
        if len(body) == 1:
            host = self.host_inputs
            return [[Tensor._received(*self.peer.import_(wire, host=host)) for wire in body[0][7]]]
        by_name: dict[str, list[tuple[int, int, Any]]] = {}
        for index, request in enumerate(body):
            for position, wire in enumerate(request[7]):
                by_name.setdefault(wire[0], []).append((index, position, wire))
        inputs: list[list[Any]] = [[None] * len(request[7]) for request in body]
        for group in by_name.values():
            imported = self.peer.import_many([wire for _, _, wire in group], host=self.host_inputs)
            for (index, position, _), (name, tensor) in zip(group, imported):
                inputs[index][position] = Tensor._received(name, tensor)
        return inputs

    def _request(self, wire: tuple[Any, ...], inputs: list[Tensor]) -> InferenceRequest:
        (handle, request_id, correlation_id, flags, timeout, parameters, requested, _, buffers,
         trace) = wire
        destinations = None
        if buffers:
            destinations = {}
            for buffer in buffers:
                name, tensor = self.peer.import_(buffer, shared=True)
                on_device = tensor.memory_type is MemoryType.GPU  # (a client's CUDA region)
                destinations[name] = tensor.device_array if on_device else tensor.storage()
        exchange = self.runtime.exchange(handle, requested, destinations, self.decoupled)
        return InferenceRequest._received(
            inputs, requested, request_id, correlation_id, flags, timeout, parameters, exchange,
            trace,
        )

    def _failure(self, message: str) -> str:
        return f"Failed to process the request(s) for model '{self.instance_name}', message: {message}"

    def _replies(self, result: Any, requests: list[InferenceRequest]) -> list[Any]:
        """The EXECUTE reply: per request a response, None (rescheduled) or
        STREAMED (answered through its response sender)."""
        if result is None:
            return [self._streamed(request) for request in requests]
        if self.decoupled:
            raise self._failed(
                requests,
                f"Python model '{self.instance_name}' is using the decoupled mode and the "
                "execute function must return None.",
            )
        self._check_responses(result, requests)
        replies: list[Any] = []
        try:
            self._encode_replies(result, requests, replies)
        except BaseException:  # none of them goes: the holds filed for those made go too
            made = [wire for reply in replies if isinstance(reply, tuple) for wire in reply[0]]
            self.peer.revoke(made)
            raise
        return replies

    def _encode_replies(
        self, result: list[Any], requests: list[InferenceRequest], replies: list[Any]
    ) -> None:
        for response, request in zip(result, requests):
            exchange = request._exchange
            assert exchange is not None
            if response is None:
                if request._sender is None and self._is_filler(request):
                    exchange.closed = True  # (its answer goes nowhere: nothing is owed)
                    replies.append(None)
                elif request._sender is not None or request.rescheduled():
                    replies.append(self._streamed(request))
                else:
                    # Triton skips it (a cancelled request has its answer; another never
                    # gets one): this request alone is answered, with Triton's words.
                    exchange.closed = True
                    replies.append(((), (int(ErrorCode.INTERNAL), not_a_response(response)), "{}"))
                continue
            with exchange.lock:  # (a send another thread has begun ends first: it counts)
                if exchange.responses or exchange.closed:
                    raise self._failed(requests, ANSWERED_TWICE)
                exchange.closed = True
            replies.append(encode_response(self.peer, response, exchange.requested, exchange.destinations))

    @staticmethod
    def _streamed(request: InferenceRequest) -> int | None:
        if request.rescheduled():
            request._exchange.rescheduled = True  # type: ignore[union-attr]
            return None
        return STREAMED

    def _is_filler(self, request: InferenceRequest) -> bool:
        """A sequence batcher's filler for an empty batch slot: in a sequence model the
        only request with no correlation ID. Nobody gets its answer, so None will do."""
        return self.sequence_batched and not request.correlation_id()

    def _check_responses(self, responses: Any, requests: list[InferenceRequest]) -> None:
        problem = response_list_problem(responses, requests)
        if problem is not None:
            raise self._failed(requests, problem)


def _watch_parent(parent: int, arena: Arena) -> None:
    """End the worker when the server dies while the model is busy (no EOF seen)."""
    while True:
        threading.Event().wait(1.0)
        if os.getppid() != parent:
            arena.close()
            os._exit(1)


_worker_pid = 0  # the worker's own (main sets it): forked children have others


def _disregard(signum: int, frame: Any) -> None:
    """SIGINT and SIGTERM reach a worker only to be disregarded (see :func:`main`). In a
    child forked outside Python's fork hooks (native code), they are the child's."""
    if os.getpid() != _worker_pid:
        _default_signals()
        os.kill(os.getpid(), signum)


_DISREGARDED = {signal.SIGINT, signal.SIGTERM}


def _hold_signals() -> None:
    """Before a fork: the forking thread holds SIGINT and SIGTERM back, so that one sent
    to the child before it has its own handlers waits for them (Python clears the
    signals it caught in a child before its fork hooks run)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, _DISREGARDED)


def _release_signals() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _DISREGARDED)


def _default_signals() -> None:
    """In a process the model forked: SIGINT and SIGTERM act as in any Python process
    (multiprocessing's ``Pool.terminate()`` ends its workers with SIGTERM; they were
    left running, and the pool's exit waited for them forever)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _release_signals()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dlserve-stub")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--segment-prefix", required=True)
    parser.add_argument("--arena-bytes", type=int, required=True)
    parser.add_argument("--arena-growth-bytes", type=int, required=True)
    parser.add_argument("--instance-name", required=True)
    parser.add_argument("--poll-us", type=int, default=0)
    parser.add_argument("--poll-board", type=int, help="descriptor of the server's PollerBoard")
    parser.add_argument("--poll-slot", type=int, help="this worker's slot on it")
    args = parser.parse_args(argv)
    # Started with the working directory off sys.path (environments.SAFE_PATH): models may
    # still import from it, after everything else, and what they start runs as usual.
    os.environ.pop("PYTHONSAFEPATH", None)
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    # A crash in native code (an extension's segfault) prints the Python stack first: the
    # server passes the worker's last output on with the news of its death.
    faulthandler.enable()
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {STACKS_SIGNAL})  # (blocked by the server)
    # Ctrl-C in a terminal, or a supervisor's SIGTERM to the whole process group, reaches
    # the workers too: the server shuts down in order (the model's finalize included); a
    # worker stopped by the signal would crash instead. (The server ends its workers
    # itself, and a worker whose server is gone exits on its own.) A handler that does
    # nothing, not SIG_IGN: an ignored signal stays ignored in every program the model
    # runs (exec keeps it), and the model could not terminate its own subprocesses.
    global _worker_pid
    _worker_pid = os.getpid()
    signal.signal(signal.SIGINT, _disregard)
    signal.signal(signal.SIGTERM, _disregard)
    os.register_at_fork(before=_hold_signals, after_in_parent=_release_signals, after_in_child=_default_signals)
    # The worker's own flags are no business of the model's: a model that parses sys.argv
    # (argparse, unittest.main) sees what Triton's stub shows it.
    sys.argv = [""]

    sock = socket.socket(fileno=args.fd)
    channel = WorkerChannel(sock)
    space = MemorySpace()
    arena = Arena(
        space,
        args.segment_prefix,
        initial_size=args.arena_bytes,
        growth_size=args.arena_growth_bytes,
        on_retire=lambda name: channel.send(Kind.RETIRE, 0, [name]),
    )
    peer = Peer(space, arena, channel.queue_releases, copy_on_write=True, cuda=IpcImports())
    runtime = WorkerRuntime(channel, peer, arena, args.instance_name)
    _runtime.install(runtime)
    os.register_at_fork(after_in_child=_runtime.forked)
    route_model_logging()
    threading.Thread(
        target=_watch_parent, args=(os.getppid(), arena), name="parent-watch", daemon=True
    ).start()
    if args.poll_board is not None and args.poll_slot is not None:
        try:
            join_board(args.poll_board, args.poll_slot)
        except OSError:  # polls on its own, counting every poller as work, as before boards
            pass
    channel.poll_reads(args.poll_us / 1e6)
    worker = Worker(channel, runtime, args.instance_name)
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

