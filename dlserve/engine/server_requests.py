"""The in-process API's requests and responses: :class:`InferenceRequest`, what
:meth:`~dlserve.engine.server.Model.infer` makes of it for the engine, the
:class:`InferenceResponse` it hands back, and the iterators that hand them out."""

from __future__ import annotations

import asyncio
import dataclasses
import queue
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

from dlserve.engine.core import Engine
from dlserve.engine.request import Request
from dlserve.errors import InvalidArgumentError, TritonError
from dlserve.memory import cuda
from dlserve.memory.dtypes import DataType
from dlserve.memory.tensor import MemoryAllocator, Tensor, is_host_memory

if TYPE_CHECKING:
    from dlserve.engine.server import Model, Server


@dataclasses.dataclass
class InferenceRequest:
    """A request for :meth:`~dlserve.engine.server.Model.infer`; fields follow
    ``tritonserver.InferenceRequest``.

    ``output_memory_allocator`` (a :class:`dlserve.MemoryAllocator`) gives the memory
    each output is copied into, as tritonserver's. ``requested_output_names``
    (dlserve's) limits the outputs returned; None or empty: every output (as Triton reads
    a request that names none, a BLS request's ``requested_output_names=[]`` too).
    """

    model: Model
    request_id: str | None = None
    flags: int = 0
    correlation_id: int | str | None = None
    priority: int = 0
    timeout: int = 0
    inputs: dict[str, Any] = dataclasses.field(default_factory=dict)
    parameters: dict[str, str | int | bool | float] = dataclasses.field(default_factory=dict)
    output_memory_type: Any = None
    output_memory_allocator: MemoryAllocator | None = None
    response_queue: Any = None
    requested_output_names: list[str] | None = None


@dataclasses.dataclass
class InferenceResponse:
    """One response; ``outputs`` are :class:`dlserve.Tensor` views of shared memory."""

    model: Model
    request_id: str = ""
    parameters: dict[str, Any] = dataclasses.field(default_factory=dict)
    outputs: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    error: TritonError | None = None
    classification_label: str | None = None
    final: bool = False


_PARAMETER_TYPES = (str, int, bool, float)


def to_engine_request(request: InferenceRequest, deliver: Any) -> Request:
    """The engine's request for ``request``, its responses handed to ``deliver``;
    raises InvalidArgumentError for inputs, parameters or an output memory type
    dlserve cannot take."""
    inputs: dict[str, Tensor] = {}
    for name, value in request.inputs.items():
        try:
            inputs[name] = Tensor.from_object(value)
        except (TypeError, ValueError, BufferError) as exc:  # (tritonserver: InvalidArgumentError)
            raise InvalidArgumentError(f"input '{name}': {exc}") from None
    for key, value in request.parameters.items():
        if type(value) not in _PARAMETER_TYPES:
            raise InvalidArgumentError(
                f"Unsupported Value. Can't convert {type(value)} to Request Parameter ('{key}')"
            )
    if not is_host_memory(request.output_memory_type):  # (InvalidArgumentError for what names none)
        problem = cuda.cuda_problem()
        if problem is not None:
            raise InvalidArgumentError(
                f"output memory type {request.output_memory_type!r} needs CUDA: {problem}"
            )
    return Request(
        model_name=request.model.name,
        model_version=request.model.version,
        inputs=inputs,
        on_response=deliver,
        request_id=request.request_id or "",
        correlation_id=0 if request.correlation_id is None else request.correlation_id,
        flags=int(request.flags),
        priority=int(request.priority),
        timeout_us=int(request.timeout),
        parameters=dict(request.parameters),
        requested_outputs=list(request.requested_output_names or ()) or None,
    )


Placement = Callable[[str, Tensor], Tensor]


def output_placement(request: InferenceRequest) -> Placement | None:
    """Where each output of ``request``'s responses goes: into its allocator's memory,
    into the memory its ``output_memory_type`` names (host, or a GPU), or (None) left
    where the model made it."""
    allocator = request.output_memory_allocator
    if allocator is not None:
        return lambda name, tensor: tensor.allocated_by(allocator, name)
    where = request.output_memory_type
    if where is None:
        return None
    on_host = is_host_memory(where)

    def place(name: str, tensor: Tensor) -> Tensor:
        if tensor.data_type is DataType.BYTES and not on_host:
            return tensor  # (DLPack and GPUs know no strings: they stay in host memory)
        return tensor.to_device(where)

    return place


class _Iterator:
    """Shared state of the sync and async response iterators."""

    def __init__(self, server: Server, model: Model, request: Request, raise_on_error: bool) -> None:
        self._server = server
        self._model = model
        self._request = request
        self._raise_on_error = raise_on_error
        self._done = False

    def _hand_out(self, response: InferenceResponse) -> InferenceResponse:
        self._done = response.final
        if response.error is not None and self._raise_on_error:
            raise response.error
        return response

    def cancel(self) -> None:
        """Cancel the request: the iterator ends with a CANCELLED response at once; a
        queued request never runs, an executing one's ``is_cancelled()`` turns True."""
        self._server._on_loop(Engine.cancel, self._request)


class ResponseIterator(_Iterator):
    def __init__(self, server: Server, model: Model, request: Request, raise_on_error: bool,
                 responses: queue.SimpleQueue[InferenceResponse]) -> None:
        super().__init__(server, model, request, raise_on_error)
        self._responses = responses

    def __iter__(self) -> Iterator[InferenceResponse]:
        return self

    def __next__(self) -> InferenceResponse:
        if self._done:
            raise StopIteration
        return self._hand_out(self._responses.get())


class AsyncResponseIterator(_Iterator):
    def __init__(self, server: Server, model: Model, request: Request, raise_on_error: bool,
                 responses: asyncio.Queue[InferenceResponse]) -> None:
        super().__init__(server, model, request, raise_on_error)
        self._responses = responses

    def __aiter__(self) -> AsyncIterator[InferenceResponse]:
        return self

    async def __anext__(self) -> InferenceResponse:
        if self._done:
            raise StopAsyncIteration
        return self._hand_out(await self._responses.get())
