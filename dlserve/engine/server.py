"""The in-process API, modelled on Triton's ``tritonserver`` package.

``Server`` runs the :class:`Engine` on its own event loop in a background thread
(uvloop when installed), the way ``tritonserver`` runs Triton's C++ core. Calls
from user threads validate and copy inputs on the caller's thread and hand the
request to the loop; responses come back through a queue. Frontends run on the
same loop and call the engine directly, with no thread hop. The server's options
are in :mod:`dlserve.engine.server_options`, the requests, responses and response
iterators in :mod:`dlserve.engine.server_requests`.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import enum
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from dlserve.engine import prometheus
from dlserve.engine.core import Engine
from dlserve.engine.manager import ModelControlMode
from dlserve.engine.request import Request, Response
from dlserve.engine.server_options import Options
from dlserve.engine.server_requests import (
    AsyncResponseIterator,
    InferenceRequest,
    InferenceResponse,
    Placement,
    ResponseIterator,
    output_placement,
    to_engine_request,
)
from dlserve.errors import (
    InternalError,
    InvalidArgumentError,
    UnavailableError,
    UnsupportedError,
)
from dlserve.memory.dtypes import DataType
from dlserve.memory.tensor import Tensor

T = TypeVar("T")
log = logging.getLogger("dlserve.engine")


class MetricFormat(enum.IntEnum):
    PROMETHEUS = 0


class InstanceGroupKind(enum.IntEnum):
    AUTO = 0
    CPU = 1
    GPU = 2
    MODEL = 3


class ModelBatchFlag(enum.IntEnum):
    UNKNOWN = 1
    FIRST_DIM = 2


class ModelTxnPropertyFlag(enum.IntEnum):
    ONE_TO_ONE = 1
    DECOUPLED = 2


def _public(server: Server, response: Response, placement: Placement | None) -> InferenceResponse:
    """The engine's response as the API gives it (to the iterator and a response_queue),
    its outputs placed where the request asked (:func:`output_placement`)."""
    outputs, error = response.outputs, response.error
    if placement is not None and outputs:
        try:
            outputs = {name: placement(name, tensor) for name, tensor in outputs.items()}
        except Exception as exc:  # noqa: BLE001 - the caller's allocator (or the GPU) failed: this response did
            outputs, error = {}, InternalError(f"output memory allocator failed: {exc}")
    return InferenceResponse(
        model=Model(server, response.model_name, response.model_version),
        request_id=response.request_id,  # ('' without one, as tritonserver's)
        parameters=response.parameters,
        outputs=outputs,
        error=error,
        final=response.final,
    )


class _InOrder:
    """Hands one request's responses to ``hand_out`` on a thread of ``pool``, one at a
    time and in order, never on the engine's loop (see :meth:`Server._delivery`)."""

    def __init__(
        self, pool: concurrent.futures.Executor, hand_out: Callable[[Response], None]
    ) -> None:
        self._pool = pool
        self._hand_out = hand_out
        self._pending: collections.deque[Response] = collections.deque()  # the first: in hand
        self._lock = threading.Lock()

    def __call__(self, response: Response) -> None:
        with self._lock:
            self._pending.append(response)
            if len(self._pending) > 1:
                return  # the thread handing out the ones before takes it too
        try:
            self._pool.submit(self._run)
        except RuntimeError:  # (shut down: a response after stop()'s deadline) handed out here
            self._run()

    def _run(self) -> None:
        while True:
            with self._lock:
                response = self._pending[0]
            try:
                self._hand_out(response)
            except Exception:  # noqa: BLE001 - the next responses still go out
                log.exception("handing out a response of request '%s' failed", response.request_id)
            with self._lock:
                self._pending.popleft()
                if not self._pending:
                    return


class Model:
    """A handle on a model (and version) of a started :class:`Server`."""

    def __init__(
        self,
        server: Server,
        name: str,
        version: int = -1,
        state: str | None = None,
        reason: str | None = None,
    ) -> None:
        server._engine_or_raise()
        self._server = server
        self.name = name
        self.version = version
        self.state = state
        self.reason = reason

    def create_request(self, **kwargs: Any) -> InferenceRequest:
        kwargs.pop("model", None)
        return InferenceRequest(model=self, **kwargs)

    def _start(self, request: InferenceRequest, deliver: Any) -> Request:
        engine = self._server._engine_or_raise()
        engine_request = to_engine_request(request, deliver)
        for name, tensor in engine_request.inputs.items():
            engine_request.inputs[name] = engine.share(tensor)
        model = engine.prepare(engine_request)
        self._server._on_loop(engine.enqueue, model, engine_request)
        return engine_request

    def infer(
        self,
        inference_request: InferenceRequest | None = None,
        raise_on_error: bool = True,
        **kwargs: Any,
    ) -> ResponseIterator:
        """Run a request; iterate the returned object for its response(s).

        Bad requests (unknown model, wrong dtype or shape, ...) raise here; with
        ``raise_on_error`` an error response raises while iterating.
        """
        request = inference_request or self.create_request(**kwargs)
        # A response_queue (tritonserver's) gets each response too, as the iterator
        # does: a queue shared by several requests must not mix up their iterators.
        users = self._users_queue(request, queue.SimpleQueue, "queue.SimpleQueue")
        responses: queue.SimpleQueue[InferenceResponse] = queue.SimpleQueue()
        server, placement = self._server, output_placement(request)

        def deliver(response: Response) -> None:
            public = _public(server, response, placement)
            responses.put(public)
            if users is not None:
                users.put(public)

        engine_request = self._start(request, server._delivery(deliver, placement))
        return ResponseIterator(self._server, self, engine_request, raise_on_error, responses)

    @staticmethod
    def _users_queue(request: InferenceRequest, kind: type, what: str) -> Any:
        """The request's ``response_queue`` (None without one), checked to be a ``kind``."""
        given = request.response_queue
        if given is not None and not isinstance(given, kind):  # (tritonserver's words)
            iterator = "async response iterator" if kind is asyncio.Queue else "response iterator"
            raise InvalidArgumentError(f"{what} must be used for {iterator}")
        return given

    def async_infer(
        self,
        inference_request: InferenceRequest | None = None,
        raise_on_error: bool = True,
        **kwargs: Any,
    ) -> AsyncResponseIterator:
        """Like :meth:`infer`, for ``async for`` on the caller's running event loop."""
        loop = asyncio.get_running_loop()
        request = inference_request or self.create_request(**kwargs)
        users = self._users_queue(request, asyncio.Queue, "asyncio.Queue")
        responses: asyncio.Queue[InferenceResponse] = asyncio.Queue()
        server, placement = self._server, output_placement(request)

        def hand_out(public: InferenceResponse) -> None:
            responses.put_nowait(public)
            if users is not None:
                users.put_nowait(public)

        def deliver(response: Response) -> None:
            if not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(hand_out, _public(server, response, placement))
                    return
                except RuntimeError:
                    if not loop.is_closed():
                        raise
            # The caller's loop ended before the stream did (an asyncio.run left early):
            # nobody can read the responses, so they go, memory and all.
            if response.final:
                log.debug("async_infer's event loop closed: the responses of request '%s' "
                          "to '%s' were dropped", response.request_id, response.model_name)

        engine_request = self._start(request, server._delivery(deliver, placement))
        return AsyncResponseIterator(self._server, self, engine_request, raise_on_error, responses)

    def metadata(self) -> dict[str, Any]:
        return self._server._call_sync(lambda e: e.model_metadata(self.name, self.version))

    def config(self, config_version: int = 1) -> dict[str, Any]:
        return self._server._call_sync(lambda e: e.model_config(self.name, self.version))

    def ready(self) -> bool:
        return self._server._run(self._server.engine.model_ready(self.name, self.version))

    def statistics(self) -> dict[str, Any]:
        """Triton's statistics for this model, plus an ``instances`` list per version
        (name, kind, device, state, pid, restarts, last error)."""
        return self._server._call_sync(lambda e: e.statistics(self.name, self.version, instances=True))

    def batch_properties(self) -> ModelBatchFlag:
        config = self.config()
        return ModelBatchFlag.FIRST_DIM if config.get("max_batch_size", 0) > 0 else ModelBatchFlag.UNKNOWN

    def transaction_properties(self) -> ModelTxnPropertyFlag:
        policy = self.config().get("model_transaction_policy") or {}
        return ModelTxnPropertyFlag.DECOUPLED if policy.get("decoupled") else ModelTxnPropertyFlag.ONE_TO_ONE

    def __repr__(self) -> str:
        return str({"name": self.name, "version": self.version, "state": self.state})

    __str__ = __repr__


class ModelDictionary(dict):  # type: ignore[type-arg]
    """``{(name, version): Model}``; indexing by a bare name returns a fresh Model."""

    def __init__(self, server: Server, models: dict[tuple[str, int], Model]) -> None:
        super().__init__(models)
        self._server = server

    def __getitem__(self, key: Any) -> Model:
        if isinstance(key, str):
            if any(name == key for name, _ in self.keys()):
                return Model(self._server, key)
            raise KeyError(f"Unknown Model: {key}")
        if key not in self.keys():
            raise KeyError(f"Unknown Model: {key}")
        return super().__getitem__(key)


async def _all(coroutines: list[Coroutine[Any, Any, None]]) -> None:
    """Run ``coroutines`` at once; when all have ended, raise the first one's error."""
    for outcome in await asyncio.gather(*coroutines, return_exceptions=True):
        if isinstance(outcome, BaseException):
            raise outcome


async def _cancel_the_rest(within: float = 5.0) -> None:
    """Cancel every other task on the loop and wait until they have ended (as asyncio.run
    does before it closes its loop), but no longer than ``within`` seconds: a task that
    swallows its cancellation must not hold the stop forever."""
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    for task in tasks:
        task.cancel()
    if tasks:
        done, _ = await asyncio.wait(tasks, timeout=within)
        for task in done:  # (what they raised is of no use now: retrieved, not logged)
            if not task.cancelled():
                task.exception()


def _result(future: concurrent.futures.Future[T]) -> T:
    """A call's result on the loop; one the server's stop cancelled raises as a call
    on a stopped server does."""
    try:
        return future.result()
    except concurrent.futures.CancelledError:
        raise InvalidArgumentError("Server not started") from None


class Server:
    """An in-process dlserve server: ``Server(Options(model_repository=...)).start()``."""

    def __init__(self, options: Options | None = None, **kwargs: Any) -> None:
        self.options = options if options is not None else Options(**kwargs)
        self._engine: Engine | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._services: list[Any] = []  # frontends running on our loop, stopped with us
        self._cpu = prometheus.CpuSampler()  # CPU use between calls of metrics()
        self._loading = False  # start() is loading the models
        self._allocating: concurrent.futures.ThreadPoolExecutor | None = None  # (_delivery)
        # Handing work to the loop, against a stop ending the loop (see _shutdown): re-entrant,
        # for a signal handler's call on a thread handing work already. And one stop at a
        # time; which thread runs it; which threads are the allocators' (it waits for them).
        self._handing = threading.RLock()
        self._stopping = threading.Lock()
        self._stopper: int | None = None
        self._thread_role = threading.local()

    # -- plumbing -----------------------------------------------------------------------
    def _engine_or_raise(self) -> Engine:
        if self._engine is None:
            raise InvalidArgumentError("Server not started")
        return self._engine

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The engine's event loop (frontends run their servers on it)."""
        if self._loop is None:
            raise InvalidArgumentError("Server not started")
        return self._loop

    @property
    def engine(self) -> Engine:
        return self._engine_or_raise()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return _result(self._submit(coro))

    def _run_waking(self, coro: Coroutine[Any, Any, T]) -> T:
        """``_run`` for a long wait: the caller's thread wakes every 0.1 s, so that the
        main thread's signal handlers run even when the kernel handed the signal to
        another thread (a thread blocked in one wait would see it only when it ends)."""
        future = self._submit(coro)
        while not concurrent.futures.wait([future], timeout=0.1).done:
            pass
        return _result(future)

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; a server not started (or stopped, or ending its
        loop) closes it unrun as it refuses, so that it is not left "never awaited"."""
        try:
            with self._handing:
                return asyncio.run_coroutine_threadsafe(coro, self.loop)
        except BaseException:
            coro.close()
            raise

    def _call_sync(self, fn: Any) -> Any:
        """Run ``fn(engine)`` on the loop and return its result (or raise its error)."""
        engine = self._engine_or_raise()

        async def call() -> Any:
            return fn(engine)

        return self._run(call())

    def _on_loop(self, fn: Any, *args: Any) -> None:
        with self._handing:
            self.loop.call_soon_threadsafe(fn, *args)

    def _delivery(
        self, deliver: Callable[[Response], None], placement: Placement | None
    ) -> Callable[[Response], None]:
        """What the engine hands a request's responses to: ``deliver``, on the engine's
        loop; where outputs are placed (by an output allocator, which ``deliver`` calls, or
        by a copy to a GPU), ``deliver`` in order on threads of the server's own, as Triton
        calls allocators on its threads: the user's allocator may call the server
        (``model.config()`` to size its buffers), and that waits for the loop."""
        if placement is None:
            return deliver
        if self._allocating is None:
            raise InvalidArgumentError("Server not started")
        return _InOrder(self._allocating, deliver)

    # -- lifecycle ----------------------------------------------------------------------
    def start(
        self,
        wait_until_ready: bool = False,
        polling_interval: float = 0.1,
        timeout: float | None = None,
    ) -> Server:
        if self._engine is not None:
            raise InvalidArgumentError("Server already started")
        settings = self.options.engine_settings()
        loop = _new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="dlserve-engine", daemon=True)
        thread.start()
        engine = Engine(settings)
        self._engine, self._loop, self._thread = engine, loop, thread
        self._allocating = concurrent.futures.ThreadPoolExecutor(
            thread_name_prefix="dlserve-allocator", initializer=self._mark_allocator
        )
        _LIVE_SERVERS.add(self)
        try:
            self._loading = True
            try:
                errors = self._run_waking(engine.start())  # (a signal may stop it: cli.serve)
            finally:
                self._loading = False
        except BaseException:
            self._shutdown()
            raise
        if errors and settings.exit_on_error:
            self._shutdown()
            raise InternalError("failed to load all models: " + "; ".join(errors))
        if wait_until_ready:
            deadline = None if timeout is None else time.monotonic() + timeout
            while not self.ready():
                if deadline is not None and time.monotonic() > deadline:
                    raise UnavailableError("Timeout before ready")
                time.sleep(polling_interval)
        return self

    @property
    def loading(self) -> bool:
        """Whether :meth:`start` is loading the models. An exception raised in its
        thread meanwhile (a signal handler's) makes it shut down what it started
        and raise it; at any other time, stop() is the way."""
        return self._loading

    def stop(self, wait_for_sequences: bool = False) -> None:
        """Drain in-flight requests (up to ``exit_timeout``), finalize models, end workers.
        Raises InternalError, as tritonserver does, when the exit timeout expired and the
        requests still in flight were dropped; the server is stopped all the same.

        ``wait_for_sequences``: first let the sequences open now end (their END, or their
        idle time), taking their next requests meanwhile and refusing others, as
        tritonserver does when it exits (``dlserve serve`` does so on SIGTERM); all within
        the same ``exit_timeout``.

        A stop() racing another (from another thread) returns once that one is done. One
        that cannot wait returns at once, the stop going on: one made inside the stop
        running on its own thread (a signal handler's), and one made by an output
        allocator, whose thread the stop waits for (it starts the stop on a thread of its
        own if none runs)."""
        self._engine_or_raise()
        if not self._shutdown(wait_for_sequences):
            raise InternalError("Exit timeout expired. Exiting immediately.")

    def _mark_allocator(self) -> None:
        self._thread_role.allocator = True

    def _shutdown(self, wait_for_sequences: bool = False) -> bool:
        if self._stopper == threading.get_ident():
            return True
        if getattr(self._thread_role, "allocator", False):
            if not self._stopping.locked():
                threading.Thread(
                    target=self._shutdown, args=(wait_for_sequences,), name="dlserve-stop"
                ).start()
            return True
        with self._stopping:
            self._stopper = threading.get_ident()
            try:
                return self._shutdown_now(wait_for_sequences)
            finally:
                self._stopper = None

    def _shutdown_now(self, wait_for_sequences: bool) -> bool:
        engine, loop, thread = self._engine, self._loop, self._thread
        if engine is None or loop is None:
            return True
        # One budget for the whole shutdown: the services drain, then the engine.
        deadline = time.monotonic() + engine.settings.exit_timeout
        # As Triton's exiting server: the network's requests in flight finish, new ones
        # (on a gRPC stream or a keep-alive connection still open) are refused.
        self._run(engine.begin_stop(deadline))
        if wait_for_sequences:  # (the services take their requests, on new connections too)
            self._run_waking(engine.sequences_ended(deadline))
        # No new requests from the network then: every service stops accepting at
        # once, then each drains what it has in flight.
        stopping = [
            c
            for service in list(self._services)
            if (c := service._stopping(deadline)) is not None
        ]
        if stopping:
            self._run(_all(stopping))
        try:
            return asyncio.run_coroutine_threadsafe(engine.stop(deadline), loop).result()
        finally:
            if self._allocating is not None:
                # The last responses go out while the loop still runs (their allocator may
                # call the server).
                self._allocating.shutdown()
            # An API call racing the stop is refused from now on ("Server not started");
            # what one handed the loop before runs, or is cancelled, before the loop stops:
            # a call handed to a stopped loop would wait forever.
            with self._handing:
                self._loop = None
            asyncio.run_coroutine_threadsafe(_cancel_the_rest(), loop).result()
            loop.call_soon_threadsafe(loop.stop)
            if thread is not None:
                thread.join()
            loop.close()
            self._engine = self._thread = self._allocating = None
            _LIVE_SERVERS.discard(self)

    def _attach(self, service: Any) -> None:
        self._services.append(service)

    def _detach(self, service: Any) -> None:
        if service in self._services:
            self._services.remove(service)

    def _kill(self) -> None:
        """Interpreter exit without stop(): end workers, unlink segments."""
        if self._engine is not None:
            self._engine.kill()

    # -- queries ------------------------------------------------------------------------
    def live(self) -> bool:
        return self._call_sync(lambda e: e.live)

    def ready(self) -> bool:
        return self._call_sync(lambda e: e.ready())

    def metadata(self) -> dict[str, Any]:
        return self._call_sync(lambda e: e.metadata())

    def model(self, model_name: str, model_version: int = -1) -> Model:
        return Model(self, model_name, model_version)

    def models(self, exclude_not_ready: bool = False) -> ModelDictionary:
        rows = self._run(self._engine_or_raise().repository_index(exclude_not_ready))
        models = {}
        for row in rows:
            version = int(row["version"]) if "version" in row else -1
            models[(row["name"], version)] = Model(
                self, row["name"], version, row.get("state"), row.get("reason")
            )
        return ModelDictionary(self, models)

    def load(self, model_name: str, parameters: dict[str, Any] | None = None) -> Model:
        self._run(self._engine_or_raise().load(model_name, parameters))
        return self.model(model_name)

    def unload(
        self,
        model: str | Model,
        unload_dependents: bool = False,
        wait_until_unloaded: bool = False,
        polling_interval: float = 0.1,
        timeout: float | None = None,
    ) -> None:
        """Unload every version; unloading finishes before this returns in dlserve."""
        name = model.name if isinstance(model, Model) else model
        self._run(self._engine_or_raise().unload(name, unload_dependents))

    def register_model_repository(
        self, repository_path: str, name_mapping: dict[str, str] | None = None
    ) -> None:
        """Add a model repository (EXPLICIT mode); ``name_mapping`` serves some of its
        model folders under other names: ``{folder: model name}``. Its models load on
        request, like the others'."""
        self._run(self._engine_or_raise().register_repository(str(repository_path), name_mapping))

    def unregister_model_repository(self, repository_path: str) -> None:
        """Remove a model repository (EXPLICIT mode); its loaded models keep serving
        until they are unloaded."""
        self._call_sync(lambda engine: engine.unregister_repository(str(repository_path)))

    def metrics(self, metric_format: MetricFormat = MetricFormat.PROMETHEUS) -> str:
        """The metrics the metrics port serves, as Prometheus text."""
        if not self.options.metrics:
            raise UnsupportedError("metrics are disabled (Options.metrics is False)")
        if metric_format not in (MetricFormat.PROMETHEUS,):
            raise UnsupportedError(f"unsupported metric format {metric_format!r}")
        cpu = self._cpu if self.options.cpu_metrics else None
        gpu = self.options.gpu_metrics
        return self._call_sync(lambda engine: prometheus.render(engine, cpu, gpu))

    def poll_model_repository(self) -> None:
        engine = self._engine_or_raise()
        if engine.settings.control_mode is not ModelControlMode.POLL:
            raise UnavailableError("poll_model_repository needs model control mode POLL")
        assert engine.manager is not None
        self._run(engine.manager.poll())

    def allocate_tensor(self, shape: list[int] | tuple[int, ...], data_type: Any) -> Tensor:
        """A tensor in the server's shared memory, to fill in place (e.g. ``np.from_dlpack``).

        Passing it as an input costs no copy at all: the model reads it where it is.
        """
        dt = data_type if isinstance(data_type, DataType) else DataType.from_numpy(data_type)
        return self._engine_or_raise().allocate([int(d) for d in shape], dt)


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; stay usable without it
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


_LIVE_SERVERS: weakref.WeakSet[Server] = weakref.WeakSet()


@atexit.register
def kill_live_servers() -> None:
    """End the workers and unlink the segments of every in-process server not stopped: at
    interpreter exit, and for a command leaving at once (``os._exit`` skips atexit)."""
    for server in list(_LIVE_SERVERS):
        server._kill()
