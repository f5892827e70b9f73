"""The data plane both network frontends share: KServe v2 semantics over the engine.

HTTP and gRPC decode their wire formats into :class:`InputSpec`/:class:`OutputSpec`
and hand them here; this module turns them into engine requests (data types,
shapes, byte sizes, shared-memory references, Triton's reserved parameters) and
runs them. Everything here runs on the engine's event loop and knows nothing of
HTTP status codes or gRPC codes: errors are :mod:`dlserve.errors`, which each
frontend maps to its own statuses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
from collections.abc import AsyncGenerator, Callable, Iterable
from typing import Any

import numpy as np

from dlserve.engine.core import Engine
from dlserve.engine.otel import w3c_context
from dlserve.engine.request import (
    SEQUENCE_END,
    SEQUENCE_START,
    Request,
    Response,
    parse_version,
    shape_text,
    string_count_error,
)
from dlserve.engine.tracing import Trace
from dlserve.errors import AlreadyExistsError, InvalidArgumentError
from dlserve.frontends import classification
from dlserve.memory import cuda
from dlserve.memory.dtypes import DataType
from dlserve.memory.regions import output_too_small
from dlserve.memory.tensor import MemoryType, Tensor

# Request parameters Triton consumes itself instead of passing to the model. Its
# documentation reserves "headers" and "binary_data_output" too, but Triton 2.51 hands
# both to the model (the HTTP frontend consumes binary_data_output itself).
RESERVED_PARAMETERS = frozenset(
    {
        "sequence_id",
        "sequence_start",
        "sequence_end",
        "priority",
        "timeout",
        "triton_enable_empty_final_response",
    }
)
SHM_REGION = "shared_memory_region"
SHM_OFFSET = "shared_memory_offset"
SHM_BYTE_SIZE = "shared_memory_byte_size"
CLASSIFICATION = "classification"


# What numpy (and any tensor in memory) can hold: its dimension limit, and elements an
# int64 can count (a zero dimension aside: with it, the others must still be that small).
_MAX_DIMS = 64
_MAX_ELEMENTS = 2**63 - 1


@dataclasses.dataclass
class ShmRef:
    region: str
    offset: int
    byte_size: int


@dataclasses.dataclass
class InputSpec:
    """An input as a transport decoded it.

    Exactly one of ``array`` (typed values, e.g. from JSON), ``raw`` (the tensor's
    bytes in Triton's binary layout) or ``shm`` is set.
    """

    name: str
    datatype: str
    shape: list[int]
    array: np.ndarray | None = None
    raw: Any = None
    shm: ShmRef | None = None


@dataclasses.dataclass
class OutputSpec:
    """A requested output. ``class_count`` > 0: answered as its top entries
    (the classification extension, :mod:`dlserve.frontends.classification`). Each
    transport checks the count as Triton's frontend for it does, in its words."""

    name: str
    parameters: dict[str, Any] = dataclasses.field(default_factory=dict)
    shm: ShmRef | None = None
    class_count: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.class_count = self.parameters.get(CLASSIFICATION, 0)


def shm_ref(parameters: dict[str, Any], what: str) -> ShmRef | None:
    """The shared-memory reference in an input's or output's parameters, checked."""
    region = parameters.get(SHM_REGION)
    if region is None:
        if SHM_BYTE_SIZE in parameters or SHM_OFFSET in parameters:
            raise InvalidArgumentError(f"{what}: '{SHM_REGION}' is required with shared memory sizes")
        return None
    size = parameters.get(SHM_BYTE_SIZE)
    offset = parameters.get(SHM_OFFSET, 0)
    if not isinstance(region, str) or not region:
        raise InvalidArgumentError(f"{what}: '{SHM_REGION}' must be a non-empty string")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise InvalidArgumentError(f"{what}: '{SHM_BYTE_SIZE}' must be a non-negative integer")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise InvalidArgumentError(f"{what}: '{SHM_OFFSET}' must be a non-negative integer")
    return ShmRef(region, offset, size)


class DataPlane:
    """KServe v2 operations over one engine, shared by the HTTP and gRPC frontends."""

    def __init__(self, engine: Engine, allow_client_shm: bool = False) -> None:
        self.engine = engine
        self.allow_client_shm = allow_client_shm

    # -- shared memory --------------------------------------------------------------------
    def _check_shm_allowed(self) -> None:
        if not self.allow_client_shm:
            raise InvalidArgumentError(
                "Client shared memory is disabled. Start the server with "
                "'--allow-client-shm=true' to enable."
            )

    def _check_name_free(self, name: str) -> None:
        """System and CUDA regions share one name space, as in Triton."""
        if name in self.engine.regions or name in self.engine.cuda_regions:
            raise AlreadyExistsError(f"shared memory region '{name}' already in manager")

    def register_system_shm(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self._check_shm_allowed()
        self._check_name_free(name)
        self.engine.regions.register(name, key, offset, byte_size)

    def unregister_system_shm(self, name: str | None = None) -> None:
        # Allowed when client shared memory is off (nothing is registered then): clients
        # clean up with an unregister-all before they start, and Triton answers it.
        self.engine.regions.unregister(name or None)

    def system_shm_status(self, name: str | None = None) -> list[dict[str, Any]]:
        return self.engine.regions.status(name or None)

    def register_cuda_shm(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        """``raw_handle``: the 64-byte cudaIpcMemHandle."""
        self._check_shm_allowed()
        self._check_name_free(name)
        self.engine.cuda_regions.register(name, raw_handle, device_id, byte_size)

    def unregister_cuda_shm(self, name: str | None = None) -> None:
        self.engine.cuda_regions.unregister(name or None)

    def cuda_shm_status(self, name: str | None = None) -> list[dict[str, Any]]:
        return self.engine.cuda_regions.status(name or None)

    # -- inference --------------------------------------------------------------------------
    def input_tensor(self, spec: InputSpec, label: str, model_name: str) -> Tensor:
        """Turn a decoded input into a tensor, checking type, shape and size."""
        try:
            data_type = DataType.from_wire(spec.datatype)
        except ValueError:
            raise InvalidArgumentError(f"invalid datatype for input {spec.name}") from None
        shape = tuple(spec.shape)
        if any(isinstance(d, bool) or not isinstance(d, int) for d in shape):
            raise InvalidArgumentError(f"{label}input '{spec.name}' has an invalid shape {list(spec.shape)}")
        if any(d < 0 for d in shape):  # (Triton's words)
            raise InvalidArgumentError(
                f"{label}All input dimensions should be specified for input '{spec.name}' for model "
                f"'{model_name}', got {shape_text(shape)}"
            )
        count = math.prod(shape)
        if (
            len(shape) > _MAX_DIMS
            or count > _MAX_ELEMENTS
            or (count == 0 and math.prod(d for d in shape if d) > _MAX_ELEMENTS)
        ):
            raise InvalidArgumentError(
                f"{label}input '{spec.name}' has a shape no tensor can have, {shape_text(shape)}: "
                f"at most {_MAX_DIMS} dimensions, of at most {_MAX_ELEMENTS} elements in all"
            )
        if spec.shm is not None:
            self._check_shm_allowed()
            raw = self._shm_bytes(spec.shm)
            return _from_bytes(spec.name, model_name, data_type, shape, count, raw, label)
        if spec.raw is not None:
            raw = spec.raw if isinstance(spec.raw, np.ndarray) else np.frombuffer(spec.raw, dtype=np.uint8)
            return _from_bytes(spec.name, model_name, data_type, shape, count, raw, label)
        array = spec.array
        if array is None:
            raise InvalidArgumentError(f"{label}input '{spec.name}' has no data")
        if array.size != count and data_type is DataType.BYTES:
            raise string_count_error(label, spec.name, model_name, count, array.size)
        if array.size != count:
            raise InvalidArgumentError(
                f"{label}input '{spec.name}' has {array.size} elements, but its shape "
                f"{list(shape)} needs {count}"
            )
        if data_type is DataType.BYTES:
            return Tensor(data_type, shape, objects=array.reshape(shape))
        return Tensor(data_type, shape, data=array.reshape(shape))

    def build_request(
        self,
        model_name: str,
        model_version: str | int | None,
        request_id: str,
        parameters: dict[str, Any],
        inputs: list[InputSpec],
        outputs: list[OutputSpec] | None,
        forwarded: Iterable[tuple[str, str]] = (),
    ) -> Request:
        """The engine request; ``forwarded`` headers reach the model as string
        parameters and never act as reserved ones (a ``priority`` header is not a
        priority), as in Triton."""
        request = Request(
            model_name=model_name,
            model_version=parse_version(model_version),
            inputs={},
            on_response=_unset,
            request_id=request_id,
        )
        label = request.label
        model_parameters: dict[str, Any] = {}
        for key, value in parameters.items():
            if key in RESERVED_PARAMETERS:
                continue
            if isinstance(value, (dict, list)) or value is None:
                raise InvalidArgumentError(  # Triton's words (and no request id label)
                    f"parameter '{key}' has invalid type. It should be either 'int', 'bool', or 'string'."
                )
            model_parameters[key] = value
        model_parameters.update(forwarded)
        request.parameters = model_parameters
        sequence_id = parameters.get("sequence_id")
        if sequence_id is not None:
            if isinstance(sequence_id, bool) or not isinstance(sequence_id, (int, str)):
                raise InvalidArgumentError(f"{label}'sequence_id' must be an integer or a string")
            request.correlation_id = sequence_id
        if parameters.get("sequence_start"):
            request.flags |= SEQUENCE_START
        if parameters.get("sequence_end"):
            request.flags |= SEQUENCE_END
        for key in ("priority", "timeout"):
            value = parameters.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(f"{label}'{key}' must be a non-negative integer")
        request.priority = int(parameters.get("priority", 0))
        request.timeout_us = int(parameters.get("timeout", 0))
        for spec in inputs:
            if spec.name in request.inputs:
                raise InvalidArgumentError(f"{label}input '{spec.name}' already exists in request")
            request.inputs[spec.name] = self.input_tensor(spec, label, model_name)
        if outputs:
            request.requested_outputs = [o.name for o in outputs]
            buffers = {}
            for output in outputs:
                ref = output.shm
                if ref is None:
                    continue
                self._check_shm_allowed()
                buffers[output.name] = self._shm_bytes(ref)
            request.output_buffers = buffers or None
        return request

    def _shm_bytes(self, ref: ShmRef) -> Any:
        """The bytes a reference names in a client's region: a view of a system region's
        shared memory, or of a CUDA region's device memory (no copy either way)."""
        if ref.region in self.engine.cuda_regions:
            return self.engine.cuda_regions.region_view(ref.region, ref.offset, ref.byte_size)
        return self.engine.regions.view(ref.region, ref.offset, ref.byte_size)

    def finished(self, response: Response, outputs: Iterable[OutputSpec]) -> Response:
        """``response`` (a successful one) as its client gets it: each output asked for as
        a classification replaced by its top entries, and any bound for a CUDA region that
        is not there yet (a worker writes its outputs there itself) copied there; raises
        TritonError where one does not fit, or the region went."""
        outputs = list(outputs)
        response = self._classified(response, outputs)
        to_cuda = [
            spec for spec in outputs
            if spec.shm is not None and spec.shm.region in self.engine.cuda_regions
        ]
        for spec in to_cuda:
            tensor = response.outputs.get(spec.name)
            if tensor is None:
                continue
            ref = spec.shm
            assert ref is not None
            if tensor.size > ref.byte_size:
                raise InvalidArgumentError(output_too_small(spec.name, ref.byte_size, tensor.size))
            tensor.write_into(self.engine.cuda_regions.region_view(ref.region, ref.offset, ref.byte_size))
        return response

    def _classified(self, response: Response, outputs: list[OutputSpec]) -> Response:
        """``response`` with each output asked for as a classification replaced by its
        top entries (``classification.top_k``); the response itself when none was."""
        counts = {spec.name: spec.class_count for spec in outputs if spec.class_count}
        if not counts or response.error is not None or not response.outputs:
            return response
        model = self.engine.model(response.model_name, response.model_version)
        label_files = {o.name: o.label_filename for o in model.config.output if o.label_filename}
        batched = model.config.max_batch_size > 0
        replaced = dict(response.outputs)
        for name, count in counts.items():
            tensor = replaced.get(name)
            if tensor is None:
                continue
            label_file = label_files.get(name)
            names = classification.labels(model.model_dir, label_file) if label_file else []
            replaced[name] = classification.top_k(name, tensor, count, batched, names)
        return dataclasses.replace(response, outputs=replaced)

    async def infer(
        self, request: Request, traced: Callable[[Trace], None] | None = None
    ) -> Response:
        """Run a one-response request and return its response (errors inside it).
        If the caller is cancelled (its client went away), so is the request.

        ``traced(trace)`` runs as soon as a request picked for tracing is queued: the
        frontend records when it received the request there, and may ``hold()`` the
        trace until it has sent the response (then ``release()`` it, sent or not)."""
        future: asyncio.Future[Response] = asyncio.get_running_loop().create_future()

        def deliver(response: Response) -> None:
            if not future.done():
                future.set_result(response)

        request.on_response = deliver
        self.engine.submit(request)
        if traced is not None and request.trace is not None:
            traced(request.trace)
        try:
            response = await future
        except asyncio.CancelledError:
            self.engine.cancel(request)
            raise
        return await _on_host(request, response)

    def stream(
        self, request: Request, traced: Callable[[Trace], None] | None = None
    ) -> AsyncGenerator[Response, None]:
        """Submit a request (raising now if it is refused) and return a generator of
        its responses as they come, the last one final. Closing the generator early
        (its client went away) cancels the request. ``traced`` as for :meth:`infer`."""
        responses: asyncio.Queue[Response] = asyncio.Queue()
        request.on_response = responses.put_nowait
        self.engine.submit(request)
        if traced is not None and request.trace is not None:
            traced(request.trace)
        return self._responses(request, responses)

    def trace_context(self, headers: Iterable[tuple[str, Any]]) -> tuple[str, str] | None:
        """The W3C trace context a request's headers (or gRPC metadata) carry, when the
        server traces in OpenTelemetry mode (else None: not even looked for)."""
        return w3c_context(headers) if self.engine.tracer.exporting else None

    async def _responses(
        self, request: Request, responses: asyncio.Queue[Response]
    ) -> AsyncGenerator[Response, None]:
        try:
            while True:
                response = await _on_host(request, await responses.get())
                yield response
                if response.final:
                    return
        finally:
            if not request.finished:
                self.engine.cancel(request)


def forward_pattern(pattern: str) -> re.Pattern[str] | None:
    """The header-forward pattern as Triton applies it: found anywhere in a header's
    name (RE2::PartialMatch), ignoring case unless the pattern begins with RE2's
    ``(?-i)``, which Python's ``re`` only knows in scoped form; None for no pattern.
    Raises ``re.error`` for a pattern that does not compile."""
    if not pattern:
        return None
    if pattern.startswith("(?-i)"):
        return re.compile(pattern[len("(?-i)") :])
    return re.compile(pattern, re.IGNORECASE)


def _from_bytes(
    name: str,
    model_name: str,
    data_type: DataType,
    shape: tuple[int, ...],
    count: int,
    raw: Any,
    label: str,
) -> Tensor:
    """A tensor over ``raw``: host bytes, or a CUDA region's device bytes (a GPU tensor;
    BYTES ones are copied to host, where they are decoded)."""
    on_device = not isinstance(raw, np.ndarray)
    if data_type is DataType.BYTES:
        return Tensor(data_type, shape, data=raw.get() if on_device else raw)
    expected = count * data_type.itemsize
    if raw.nbytes != expected:
        raise InvalidArgumentError(
            f"{label}input byte size mismatch for input '{name}' for model '{model_name}'. "
            f"Expected {expected}, got {raw.nbytes}"
        )
    if on_device and cuda.address_of(raw) % data_type.itemsize:  # (a GPU kernel would fault on it)
        raise InvalidArgumentError(
            f"{label}input '{name}' in CUDA shared memory is not aligned to its {data_type.name} "
            f"elements ({data_type.itemsize} bytes): give it an offset that is a multiple of that"
        )
    typed = raw.view(data_type.storage_dtype).reshape(shape)
    return Tensor(data_type, shape, device_array=typed) if on_device else Tensor(data_type, shape, data=typed)


async def _on_host(request: Request, response: Response) -> Response:
    """``response`` with its GPU outputs (a model's torch or cupy tensors, sent by
    reference through device memory) copied to host memory for the wire, on a thread of
    their own rather than on the event loop; those bound for a client's CUDA region stay."""
    bound = request.output_buffers or {}
    moving = {
        name: tensor for name, tensor in response.outputs.items()
        if tensor.memory_type is MemoryType.GPU and name not in bound
    }
    if not moving:
        return response
    hosted = await asyncio.to_thread(lambda: {name: t.to_host() for name, t in moving.items()})
    return dataclasses.replace(response, outputs={**response.outputs, **hosted})


def _unset(response: Response) -> None:  # pragma: no cover - replaced before submit
    raise AssertionError("request submitted without a response callback")
