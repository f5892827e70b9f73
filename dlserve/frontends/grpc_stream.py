"""ModelStreamInfer: one call's requests in, its answers out.

As in Triton, a decoupled model's answers go out as they come, and every other answer
(a refusal included) in the order of the requests, so a client may match answers to its
requests by order. Each request on the stream is answered with a ``ModelStreamInferResponse``
(``triton_final_response`` set on the final one); a failed request puts its message in
``error_message`` and the stream stays open, unless the call's metadata holds
``triton_grpc_error: true``: then, as in Triton, the first error ends the call with its
gRPC status and message.

When the server stops, a stream ends with UNAVAILABLE (:data:`SHUTTING_DOWN`) as soon as no
request of it is in flight, after the answers to those that were: an open stream would
otherwise hold the stop until the exit timeout. Meanwhile it still reads its client's
requests, which the stopping engine refuses, each answered on the stream.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc

from dlserve.engine.request import Request, Response
from dlserve.engine.tracing import Trace
from dlserve.errors import InternalError, TritonError
from dlserve.frontends.dataplane import OutputSpec
from dlserve.frontends.grpc_calls import Abort, status_of
from dlserve.frontends.grpc_codec import (
    EMPTY_FINAL,
    FINAL_RESPONSE,
    Answer,
    InferCall,
    encode_response,
    encode_stream_response,
)
from dlserve.frontends.proto import grpc_service_pb2 as pb

if TYPE_CHECKING:
    from dlserve.frontends.grpc_servicer import InferenceServicer

log = logging.getLogger("dlserve.frontends.grpc")
# Answers one ModelStreamInfer call may hold unsent (the client's window is shut)
# before it reads no more of the client's requests (see InferStream).
STREAM_BACKLOG = 128
ERRORS_END_CALL = "triton_grpc_error"  # the metadata key that makes the first error end the call
SHUTTING_DOWN = "The server is shutting down"  # how a stream open at the server's stop ends


@dataclasses.dataclass(eq=False)  # (each place is itself, whatever it holds)
class _InOrder:
    """The place of a request whose answer goes out in request order: what waits there."""

    answers: list[tuple[Answer, Trace | None]] = dataclasses.field(default_factory=list)
    done: bool = False


class InferStream:
    """One ModelStreamInfer call: requests in, responses out (see the module docstring).

    A client that reads no answers is held back: while :data:`STREAM_BACKLOG` answers
    wait unsent (its window is shut), the call reads no more of its requests, which stay
    with the transport, which reopens the client's window only as they are read. Only
    answers count: requests in flight do not, since a model may hold some open until a
    later one arrives (a decoupled model answering a whole utterance at its end), and
    not reading that one would hang the stream. Two bounds are the models' to set: how
    many requests wait to execute (``max_queue_size`` of a dynamic batcher, as in
    Triton), and how many answers a decoupled model sends for one request."""

    def __init__(self, servicer: InferenceServicer, context: Any) -> None:
        self.servicer = servicer
        self.context = context
        # answers to send, each with the trace it holds open until it is sent
        self.queue: asyncio.Queue[tuple[Answer, Trace | None] | None] = asyncio.Queue()
        # places of the requests answered in order whose turn has not come, oldest first
        self.in_order: collections.deque[_InOrder] = collections.deque()
        self.waiting_since: int = context.started_ns  # for the next request's GRPC_WAITREAD_START
        self.pending: set[Request] = set()
        self.room = asyncio.Event()  # set when an answer leaves the queue
        self.reading = True
        self.stopping = False  # the server's stop has begun (see stop)
        self.failure: Abort | None = None
        self.errors_end_call = any(  # (only "true" as written, as Triton reads it)
            key.lower() == ERRORS_END_CALL and value == "true"
            for key, value in context.invocation_metadata()
        )

    async def read(self, requests: AsyncIterator[InferCall]) -> None:
        try:
            async for message in requests:
                if self.failure is not None:
                    break  # (triton_grpc_error: an error ended the call)
                self.submit(message)
                while self.queue.qsize() >= STREAM_BACKLOG:
                    self.room.clear()
                    await self.room.wait()
        except Abort as abort:
            self.failure = abort
            self.queue.put_nowait(None)
        finally:
            self.reading = False
            self._end_if_done()

    def stop(self) -> None:
        """The server's stop has begun (``context.on_server_stop``): the call ends once
        no request of it is in flight."""
        self.stopping = True
        self._end_if_done()

    def _end_if_done(self) -> None:
        """End the call after what is queued if it has nothing in flight and its client
        sent all it will (OK) or the server is stopping (UNAVAILABLE)."""
        if self.pending or self.failure is not None:
            return
        if self.reading:
            if not self.stopping:
                return
            self.failure = Abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
        self.queue.put_nowait(None)

    def submit(self, inbound: InferCall) -> None:
        received = time.monotonic_ns()
        message = inbound.message
        place = None  # (a refused request keeps its place in the order)
        try:
            request, specs, model = self.servicer.decode(inbound, self.context, unary=False)
            empty_final = message.parameters.get(EMPTY_FINAL)
            place = None if model.decoupled else self._place()
            wants_empty_final = empty_final is not None and empty_final.bool_param
            request.on_response = functools.partial(
                self.deliver, request, specs, wants_empty_final, place
            )
            self.pending.add(request)
            try:
                self.servicer.engine.submit(request)
            except BaseException:
                self.pending.discard(request)
                raise
            if request.trace is not None:
                request.trace.record("GRPC_WAITREAD_START", self.waiting_since)
                request.trace.record("GRPC_WAITREAD_END", received)
        except TritonError as exc:
            self.refuse(message, exc, place)
        except Exception as exc:  # noqa: BLE001 - a bug answers this request, not the stream
            log.exception("gRPC stream request failed")
            self.refuse(message, InternalError(f"{type(exc).__name__}: {exc}"), place)
        self.waiting_since = time.monotonic_ns()

    def end_with(self, error: TritonError) -> None:
        """``triton_grpc_error``: the call ends with this error's status, after what is
        already queued; nothing else is answered."""
        self.failure = Abort(status_of(error), error.message)
        self.reading = False
        self.queue.put_nowait(None)

    def refuse(
        self, message: pb.ModelInferRequest, error: TritonError, place: _InOrder | None = None
    ) -> None:
        """A request refused before it reached a model: answered on the stream with just
        its id, which goes on, with or without ``triton_grpc_error`` (as in Triton,
        whose header ends the call only on a model's errors)."""
        answer = pb.ModelStreamInferResponse(
            error_message=error.message, infer_response=pb.ModelInferResponse(id=message.id)
        )
        self._send(place or self._place(), (answer, None), final=True)

    def _place(self) -> _InOrder:
        place = _InOrder()
        self.in_order.append(place)
        return place

    def _send(
        self, place: _InOrder | None, entry: tuple[Answer, Trace | None] | None, final: bool
    ) -> None:
        """Queue an answer (``entry``; None: nothing to send, only the request's end) at
        once, or with ``place`` once every request before it is answered."""
        if place is None:
            if entry is not None:
                self.queue.put_nowait(entry)
            return
        if entry is not None:
            place.answers.append(entry)
        place.done = place.done or final
        while self.in_order and (self.in_order[0].answers or self.in_order[0].done):
            head = self.in_order[0]
            for waiting in head.answers:
                self.queue.put_nowait(waiting)
            head.answers.clear()
            if not head.done:
                break
            self.in_order.popleft()

    def deliver(
        self,
        request: Request,
        specs: dict[str, OutputSpec] | None,
        empty_final: bool,
        place: _InOrder | None,
        response: Response,
    ) -> None:
        if request not in self.pending or self.failure is not None:
            return  # cancelled meanwhile, or the call has ended
        if response.final:
            self.pending.discard(request)
        if response.error is not None and self.errors_end_call:
            self.end_with(response.error)
            return
        if response.flags_only and not empty_final:
            # Only clients that asked for it get a final with nothing in it.
            self._send(place, None, response.final)
            self._end_if_done()
            return
        error = response.error.message if response.error is not None else ""
        item: Answer | None = None
        if not error and not response.flags_only:
            try:
                if specs:
                    response = self.servicer.dataplane.finished(response, specs.values())
                item = encode_stream_response(encode_response(response, specs, response.final))
            except TritonError as exc:  # (an output that does not fit its CUDA region)
                error = exc.message
            except Exception as exc:  # noqa: BLE001 - one bad response must not end the stream
                log.exception("encoding a stream response failed")
                error = f"{type(exc).__name__}: {exc}"
        if item is None:  # Triton: the model name and id, no version, no outputs
            infer = pb.ModelInferResponse(model_name=response.model_name, id=response.request_id)
            infer.parameters[FINAL_RESPONSE].bool_param = response.final
            item = pb.ModelStreamInferResponse(error_message=error, infer_response=infer)
        trace = request.trace
        if trace is not None:  # still open: this runs inside the engine's delivery
            trace.record("GRPC_SEND_START")
            trace.hold()  # until the answer is sent
        self._send(place, (item, trace), response.final)
        self._end_if_done()

    def release_traces(self) -> None:
        """The call is over: the traces of answers never sent are let go, those queued
        and those still waiting for an earlier request's answer."""
        entries: list[tuple[Answer, Trace | None] | None]
        entries = [entry for place in self.in_order for entry in place.answers]
        self.in_order.clear()
        while not self.queue.empty():
            entries.append(self.queue.get_nowait())
        for entry in entries:
            if entry is not None and entry[1] is not None:
                entry[1].release()

    def cancel_pending(self) -> None:
        pending, self.pending = self.pending, set()
        for request in pending:
            self.servicer.engine.cancel(request)


__all__ = ["SHUTTING_DOWN", "STREAM_BACKLOG", "InferStream"]
