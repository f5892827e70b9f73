"""Calls a model makes from its worker: BLS inference requests and model control.

A BLS request becomes an ordinary engine request, scheduled like any other. Its
tensors never get copied on the way: inputs arrive as references into the
caller's shared memory (or into memory the caller got from the server), and the
callee's outputs go back to the caller as references into the callee's memory;
leases keep each block alive until the last process using it lets go.

Calls that would wait on themselves are refused at once instead of hanging: a call
into a model already waiting further up the call chain (a cycle), and a model
calling itself with no other instance free to run the call.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from typing import TYPE_CHECKING, Any, Protocol

from dlserve.engine import inline_offers
from dlserve.engine.request import (
    Request,
    Response,
    parameters_json,
    validate_request,
    version_from_string,
)
from dlserve.engine.scheduler import DefaultScheduler
from dlserve.errors import (
    InvalidArgumentError,
    NotFoundError,
    TritonError,
    UnavailableError,
    UnsupportedError,
)
from dlserve.ipc.protocol import Kind, refused_call

if TYPE_CHECKING:
    from dlserve.engine.instance import ModelInstance
    from dlserve.engine.model import ModelVersion
    from dlserve.engine.tracing import Tracer
    from dlserve.ipc.supervisor import WorkerProcess

log = logging.getLogger("dlserve.engine")

# pb_utils.is_model_ready's words for a negative version (Triton's Python backend)
_NEGATIVE_VERSION = (
    "failed to get model version from specified version string '{text}', "
    "version should be an integral value > 0"
)


class Host(Protocol):
    """What a model's calls need of the engine."""

    live: bool

    def model(self, name: str, version: int = -1, namespace: str | None = None) -> ModelVersion: ...

    tracer: Tracer

    def submit(self, request: Request, sample: bool = True, model: ModelVersion | None = None) -> None: ...

    def enqueue(self, model: ModelVersion, request: Request, sample: bool = True) -> None: ...

    def request_finished(self) -> None: ...

    async def load(self, name: str, parameters: dict[str, Any] | None = None) -> None: ...

    async def unload(self, name: str, unload_dependents: bool = False, wait: bool = True) -> None: ...

    async def model_ready(self, name: str, version: int = -1, namespace: str | None = None) -> bool: ...

    def segments_gone(self, names: list[str]) -> None: ...


class ModelCalls:
    """The BLS and model-control traffic of one model instance's worker."""

    def __init__(self, instance: ModelInstance) -> None:
        self.instance = instance
        self._calls: dict[int, Request] = {}  # corr of the worker's call -> its request
        self._controls: set[asyncio.Future[None]] = set()  # model-control calls running

    @property
    def host(self) -> Host:
        return self.instance.model.resources.host

    def handle(self, kind: int, corr: int, body: Any) -> None:
        if kind == Kind.BLS:
            self._infer(corr, body)
        elif kind == Kind.BLS_CANCEL:
            request = self._calls.get(body)
            if request is not None and request.owner is not None:
                request.owner.cancel(request, answer=False)
        elif kind == Kind.INLINE:
            self._offer_inline(corr, *body)
        elif kind == Kind.INLINE_DONE:
            name, version, record = body
            target = self._loaded(name, version)
            if target is not None:
                inline_offers.record(target, record)
        else:
            # The reply goes to the worker that asked: a restarted worker numbers its
            # calls afresh, so a late reply must not reach its successor.
            task = asyncio.ensure_future(self._control(self.instance.worker, corr, body))
            self._controls.add(task)
            task.add_done_callback(self._controls.discard)

    def close(self) -> None:
        """The worker is gone: nobody waits for its calls any more."""
        calls, self._calls = self._calls, {}
        for request in calls.values():
            if request.owner is not None:
                request.owner.cancel(request)

    # -- BLS -----------------------------------------------------------------------------
    def _infer(self, corr: int, body: Any) -> None:
        (
            model_name,
            version,
            inputs_wire,
            requested,
            request_id,
            correlation_id,
            flags,
            timeout_us,
            parameters,
            decoupled,
            handles,
            trace_id,
        ) = body
        worker = self.instance.worker
        if worker is None or worker.peer is None:
            return
        imported = 0
        try:
            inputs = {}
            for wire in inputs_wire:
                name, tensor = worker.peer.import_(wire)
                imported += 1
                if name in inputs:
                    raise InvalidArgumentError(f"input '{name}' already exists in request")
                inputs[name] = tensor
            request = Request(
                model_name=model_name,
                inputs=inputs,
                on_response=functools.partial(self._respond, corr),
                model_version=version,
                request_id=request_id,
                correlation_id=correlation_id,
                flags=flags,
                timeout_us=timeout_us,
                parameters=json.loads(parameters) if parameters != "{}" else {},
                requested_outputs=requested,
                chain=self._chain(handles),
            )
            if not self.host.live:
                raise UnavailableError("the server is stopping and takes no new requests")
            try:
                target = self.host.model(model_name, version)
            except (NotFoundError, UnavailableError):  # (Triton's words for both)
                raise NotFoundError(
                    f"Failed for execute the inference request. Model '{model_name}' is not ready."
                ) from None
            if target.decoupled and not decoupled:  # (Triton's words, its stray quote too)
                raise UnsupportedError(
                    f"Model {model_name} is using the decoupled. The current BLS request call "
                    "doesn't support models using the decoupled transaction policy. Please use "
                    "'decoupled=True' argument to the 'exec' or 'async_exec' calls for "
                    "decoupled models.'"
                )
            self._check_cycle(request, target)
            self._check_resources(target)
            validate_request(request, target.signature)
            if trace_id:  # the model passed on a traced request's trace (trace=request.trace())
                parent = self.host.tracer.open_trace(trace_id)
                if parent is not None:
                    request.trace = parent.child(model_name, request_id)
        except Exception as exc:  # noqa: BLE001 - refused in the response, never left waiting
            reason = exc.message if isinstance(exc, TritonError) else str(exc)
            worker.peer.discard(inputs_wire[imported:])  # (those never imported go back now)
            self._send(corr, ((), refused_call(model_name, reason), "{}"), True)
            return
        self._calls[corr] = request
        self.host.enqueue(target, request, sample=False)

    # -- inline BLS (dlserve.engine.inline_offers) ---------------------------------------
    def _offer_inline(self, corr: int, name: str, version: int) -> None:
        offer = inline_offers.offer(name, self._loaded(name, version), self.instance)
        channel = self.instance.channel
        if channel is not None:
            channel.reply(corr, offer)

    def _loaded(self, name: str, version: int) -> ModelVersion | None:
        try:
            return self.host.model(name, version)
        except TritonError:
            return None

    def _chain(self, handles: list[int] | None) -> tuple[str, ...]:
        """The models waiting on a call: those waiting on the requests it is made
        for (all the instance's open ones if the model did not say), then ours."""
        chain: list[str] = []
        for request in self.instance.open_requests(handles):
            chain.extend(name for name in request.chain if name not in chain)
        caller = self.instance.model.name
        if caller not in chain:
            chain.append(caller)
        return tuple(chain)

    def _check_cycle(self, request: Request, target: ModelVersion) -> None:
        name = target.name
        if name not in request.chain:
            return
        caller = self.instance.model.name
        path = " -> ".join((*request.chain, name))
        if self._runs_at_once(target):
            return
        if name != caller:
            raise InvalidArgumentError(
                f"BLS call cycle {path}: model '{name}' is waiting on this very call, and "
                "no instance of it is sure to run the call first (a free one, in a model that "
                "takes its requests in order), so the call could wait on itself forever"
            )
        raise UnavailableError(
            f"model '{name}' called itself ({path}) with no other instance free to run "
            "the call first (or the rate limiter's resources the caller holds leave it none, "
            "or a dynamic batcher could give the instance to a later request): it could wait "
            "on itself forever. Give it more instances (instance_group count) or do the work "
            "without the self-call"
        )

    def _check_resources(self, target: ModelVersion) -> None:
        """With the rate limiter on, a call into a model none of whose instances could
        run while the caller holds its own resources would wait forever: refused."""
        limiter = self.instance.model.resources.rate_limiter
        if limiter is None or target.is_ensemble or target.name == self.instance.model.name:
            return  # (self-calls: _check_cycle decides, instance by instance)
        if target.instances and not any(limiter.fits_beside(i, self.instance) for i in target.instances):
            raise UnavailableError(
                f"model '{target.name}' needs rate limiter resources that the calling instance "
                f"'{self.instance.name}' holds while it waits for the call: it would wait forever. "
                "Give the pool more copies (--rate-limit-resource) or the models separate resources"
            )

    def _runs_at_once(self, target: ModelVersion) -> bool:
        """Whether a call into ``target`` starts at once on an instance of its own, so
        that it cannot wait on the very model waiting for it: ``target`` takes requests
        in arrival order with no batching delay or priorities (the default scheduler),
        none is queued (it would take the instance first, and might wait on this call),
        and an instance is free (another one, or the caller's own where a thread of the
        model calls while no execute runs). With a dynamic batcher or priorities a
        request arriving later could still go first: such calls are refused."""
        scheduler = target.scheduler
        if type(scheduler) is not DefaultScheduler or scheduler.pending:
            return False
        return any(self._has_room_for(i) for i in target.instances)

    def _has_room_for(self, instance: ModelInstance) -> bool:
        """An ``async def execute`` instance runs up to its concurrency at once, the
        caller's own execute included; any other is free only when idle (its next
        execute would wait behind the one making the call: the caller's own instance
        is idle only when the call comes from a thread of the model with no execute
        running), and only if the rate limiter's resources the caller holds leave room
        for it."""
        if not instance.serves:  # (a passive instance is ready, and is given no work)
            return False
        limiter = self.instance.model.resources.rate_limiter
        if limiter is not None and not limiter.fits_beside(instance, self.instance):
            return False
        if instance.concurrency:
            return instance.in_flight < instance.concurrency
        return instance.in_flight == 0

    def _respond(self, corr: int, response: Response) -> None:
        if response.final:
            self._calls.pop(corr, None)
        worker = self.instance.worker
        if worker is None or worker.peer is None or not worker.alive:
            return  # the caller died: the outputs are dropped with its leases
        if response.flags_only:
            self._send(corr, None, response.final)
            return
        parameters = parameters_json(response.parameters)
        if response.error is not None:
            error = response.error
            self._send(corr, ((), (int(error.code), error.message), parameters), response.final)
            return
        try:
            with worker.peer.exports() as out:
                outputs = [out.add(name, tensor) for name, tensor in response.outputs.items()]
        except Exception as exc:  # noqa: BLE001 - the caller gets the error instead of waiting forever
            message = f"cannot hand the outputs of model '{response.model_name}' over: {exc}"
            self._send(corr, ((), (int(InvalidArgumentError.code), message), "{}"), response.final)
            return
        self._send(corr, (outputs, None, parameters), response.final)

    def _send(self, corr: int, wire: Any, final: bool) -> None:
        channel = self.instance.channel
        if channel is not None:
            channel.send(Kind.BLS_RESPONSE, corr, (wire, final))

    # -- model control ------------------------------------------------------------------
    async def _control(self, worker: WorkerProcess | None, corr: int, body: Any) -> None:
        operation, arguments = body
        result: Any = None
        try:
            name = arguments[0]
            if name == self.instance.model.name and operation == "load":
                raise InvalidArgumentError(
                    f"model '{name}' cannot load itself: its own load would wait for the "
                    "very call asking for it"
                )
            if operation == "load":
                _, config, files = arguments
                parameters: dict[str, Any] = dict(files)
                if config:
                    parameters["config"] = config
                await self.host.load(name, parameters)
            elif operation == "unload":
                # Returns once the unload began, as Triton's: the model may unload itself
                # (vLLM's backend does when its engine is unhealthy), the request asking
                # for it finishing first.
                await self.host.unload(name, bool(arguments[1]), wait=False)
            elif operation == "ready":
                # (Triton's Python backend: "" is the server's choice; a negative one refused)
                version = version_from_string(arguments[1], _NEGATIVE_VERSION)
                result = await self.host.model_ready(name, version)
            else:
                raise UnsupportedError(f"unknown model control operation '{operation}'")
        except TritonError as exc:
            error: TritonError | None = exc
        except Exception as exc:  # noqa: BLE001 - the model gets the error, the server stays up
            log.exception("model control call from '%s' failed", self.instance.name)
            error = InvalidArgumentError(f"{operation} failed: {exc}")
        else:
            error = None
        channel = self.instance.channel
        if worker is not self.instance.worker or channel is None:
            return  # the worker that asked is gone
        if error is None:
            channel.reply(corr, result)
        else:
            channel.reply_error(corr, error)

