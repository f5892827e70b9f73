"""The engine's request and response, and request validation against a model config.

These are the only types frontends and the in-process API hand to the engine:
tensors are :class:`dlserve.memory.tensor.Tensor`, errors are :mod:`dlserve.errors`.
Validation messages follow Triton's wording (captured from a real server in
``tests/data/triton_reference/``) so clients that match on them keep working.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dlserve.engine.proto import model_config_pb2 as mc
from dlserve.engine.tracing import Trace
from dlserve.errors import InternalError, InvalidArgumentError, TritonError
from dlserve.memory.bytes_codec import TruncatedElement
from dlserve.memory.dtypes import DataType
from dlserve.memory.tensor import ElementCountError, Tensor


@dataclasses.dataclass(slots=True)
class Response:
    """One response to a request; ``final`` marks the last one.

    ``flags_only`` marks a final that carries nothing (a decoupled model's
    ``send(flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL)``): frontends that stream
    pass it on only when the client asked for empty finals.
    """

    model_name: str
    model_version: int
    request_id: str = ""
    outputs: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    parameters: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: TritonError | None = None
    final: bool = True
    flags_only: bool = False


ResponseCallback = Callable[[Response], None]

# Request.flags (Triton's TRITONSERVER_REQUEST_FLAG_SEQUENCE_*).
SEQUENCE_START = 1
SEQUENCE_END = 2

# In an execute's results, in place of a request's response: the request is answered
# through responses its model streams (see Scheduler.stream_response).
STREAMING: Any = object()
# ... or: it was cancelled before its execute began, and did not run.
NOT_RUN: Any = object()


@dataclasses.dataclass(slots=True, eq=False)
class Request:
    """An inference request as the engine sees it.

    ``requested_outputs`` None means every output of the model. ``on_response`` is
    called on the engine's event loop for every response, the last with ``final``.
    ``output_buffers`` names outputs the worker should write straight into the given
    shared memory (a client's registered region), so the server never copies them.
    ``chain`` names the models waiting on this request (BLS callers, outermost
    first), so a call that would wait on itself is refused instead of hanging.
    ``filler`` marks a request the sequence batcher made up for an empty batch slot
    (see :mod:`dlserve.engine.sequence`): the model sees it, nobody gets its answers,
    and statistics count it only in the batch's size.

    The engine fills in the rest: ``finished`` once the final response went out
    (nothing is delivered after it), ``cancelled``, while the request executes
    ``cancel_hook`` to tell its worker, and the ``compute_*_ns`` its executions took
    (Triton's compute_input/infer/output; an ensemble adds up its steps' for its own).
    """

    model_name: str
    inputs: dict[str, Tensor]
    on_response: ResponseCallback
    model_version: int = -1
    request_id: str = ""
    correlation_id: int | str = 0
    flags: int = 0
    priority: int = 0
    timeout_us: int = 0
    parameters: dict[str, Any] = dataclasses.field(default_factory=dict)
    requested_outputs: list[str] | None = None
    # Shared memory (uint8 views) the worker writes named outputs into, e.g. a client's region.
    output_buffers: dict[str, np.ndarray] | None = None
    chain: tuple[str, ...] = ()
    filler: bool = False
    arrival_ns: int = dataclasses.field(default_factory=time.monotonic_ns)
    finished: bool = False
    counted: bool = False  # its success is in its model's statistics already (a streamed one's)
    from_client: bool = False  # counted by the loop's poller until finished (Engine.enqueue)
    cancelled: bool = False
    owner: Any = None  # who answers it: the scheduler that accepted it (or a model's warmup)
    cancel_hook: Callable[[bool], None] | None = None  # called with whether it is answered now
    compute_input_ns: int = 0
    compute_infer_ns: int = 0
    compute_output_ns: int = 0
    trace: Trace | None = None  # set when the request is sampled for tracing
    # W3C traceparent and tracestate the client sent (read in OpenTelemetry trace mode)
    trace_context: tuple[str, str] | None = None
    # (instance, handle) a rescheduled request keeps for its next execute on that instance
    resumes: tuple[Any, int] | None = None
    # an ensemble's step, sent to the version its request keeps (Scheduler.keep_for_ensemble)
    to_kept_version: bool = False

    @property
    def label(self) -> str:
        """Triton's prefix for request-level errors."""
        return f"[request id: {self.request_id or '<id_unknown>'}] "


# Parameters as a model reads them (request.parameters(), a BLS response's parameters()):
# compact JSON with text as UTF-8, as Triton's core writes it; one encoder, not one per call.
_parameters_encoder = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def parameters_json(parameters: dict[str, Any]) -> str:
    return _parameters_encoder(parameters) if parameters else "{}"


def parse_version(version: str | int | None) -> int:
    """A model version as a client names it: absent or empty for the server's choice (-1)."""
    if version in (None, ""):
        return -1
    try:
        value = int(version)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"invalid model version '{version}'") from None
    if value < 0:
        raise InvalidArgumentError(f"invalid model version '{version}'")
    return value


_STOL = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)")  # (ASCII only, as C's isspace and isdigit)


def stol(text: str) -> int | None:
    """C++'s ``std::stol``, as Triton reads version strings: leading whitespace, a sign and
    digits, the rest ignored ("1.5" is 1); None where it throws (no number, out of range)."""
    match = _STOL.match(text)
    value = int(match.group(1)) if match else None
    return value if value is not None and -(1 << 63) <= value < (1 << 63) else None


def version_from_string(text: str, negative: str) -> int:
    """A version string as Triton reads one: "" is -1 (the version policy's choice), else
    ``std::stol``'s number, refused in Triton's words where there is none, or where it is
    negative in ``negative``'s (``{text}`` in it: the string; the words differ by caller)."""
    if not text:
        return -1
    value = stol(text)
    if value is None:
        raise InvalidArgumentError(
            f"failed to get model version from specified version string '{text}' (details: stol), "
            "version should be an integral value > 0"
        )
    if value < 0:
        raise InvalidArgumentError(negative.format(text=text))
    return value


def shape_text(shape: Any) -> str:
    """A shape as Triton writes it in messages: [2,3]."""
    return "[" + ",".join(str(int(d)) for d in shape) + "]"


def _matches(dims: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    if dims == shape:  # (most requests: no -1 to look at one by one)
        return True
    return len(dims) == len(shape) and all(d == -1 or d == s for d, s in zip(dims, shape))


@dataclasses.dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    data_type: DataType
    dims: tuple[int, ...]
    optional: bool
    reshape: tuple[int, ...] | None


def _spec(tensor: Any) -> TensorSpec:
    return TensorSpec(
        tensor.name,
        DataType(tensor.data_type),
        tuple(tensor.dims),
        bool(getattr(tensor, "optional", False)),
        tuple(tensor.reshape.shape) if tensor.HasField("reshape") else None,
    )


class Signature:
    """What requests are checked against, read out of the config once per load."""

    def __init__(self, config: mc.ModelConfig) -> None:
        self.name = config.name
        self.max_batch_size = config.max_batch_size
        self.inputs = {t.name: _spec(t) for t in config.input}
        self.required = tuple(name for name, spec in self.inputs.items() if not spec.optional)
        self._required_set = frozenset(self.required)
        self.outputs = {t.name: _spec(t) for t in config.output}
        self.output_names = tuple(self.outputs)
        # Whether any output has a reshape (output_as_declared has nothing to do if none)
        self.reshapes_outputs = any(spec.reshape is not None for spec in self.outputs.values())

    def lacks_required(self, inputs: dict[str, Any]) -> bool:
        return not inputs.keys() >= self._required_set


def _batched_shape_error(
    request: Request, input_name: str, signature: Signature, shape: tuple[int, ...]
) -> InvalidArgumentError:
    dims = signature.inputs[input_name].dims
    return InvalidArgumentError(  # (Triton's words)
        f"{request.label}unexpected shape for input '{input_name}' for model '{signature.name}'. "
        f"Expected {shape_text((-1,) + dims)}, got {shape_text(shape)}. NOTE: "
        "Setting a non-zero max_batch_size in the model config requires a batch "
        "dimension to be prepended to each input shape. If you want to specify the full "
        "shape including the batch dim in your input dims config, try setting "
        "max_batch_size to zero. See the model configuration docs for more info on "
        "max_batch_size."
    )


def _count_error(request: Request, signature: Signature, inputs: dict[str, Any]) -> InvalidArgumentError:
    """Triton's answer to a request whose inputs are not the model's required ones."""
    missing = [n for n in signature.required if n not in inputs]
    got = ",".join(f"'{n}'" for n in reversed(inputs))  # (see validate_request's loop)
    required, total = len(signature.required), len(signature.inputs)
    expected = f"{total} inputs"
    if required < total:  # Triton's wording where optional inputs make it a range
        expected = f"number of inputs between {required} and {total}"
    return InvalidArgumentError(
        f"{request.label}expected {expected} but got {len(inputs)} inputs "
        f"for model '{signature.name}'. Got input(s) [{got}], but missing required input(s) "
        f"[{','.join(repr(m) for m in missing)}]. Please provide all required input(s)."
    )


def validate_request(request: Request, signature: Signature) -> int:
    """Check inputs and requested outputs against the model; returns the batch size.

    Applies the config's ``reshape`` to inputs, as Triton does before ``execute``.
    """
    name = signature.name
    batching = signature.max_batch_size > 0
    declared = signature.inputs
    inputs = request.inputs
    required, total = len(signature.required), len(declared)
    # The count first, as Triton: too many or too few is said so before any unknown name.
    if not required <= len(inputs) <= total:
        raise _count_error(request, signature, inputs)
    for input_name in inputs:
        if input_name not in declared:
            raise InvalidArgumentError(  # (without the request id, as Triton says it)
                f"unexpected inference input '{input_name}' for model '{name}'"
            )
    if signature.lacks_required(inputs):
        raise _count_error(request, signature, inputs)
    if batching and not inputs:  # (all inputs optional, none sent: no batch size to read)
        raise InvalidArgumentError(  # (Triton 2.51's words, then why)
            f"{request.label}out of bounds index 0: request has 0 inputs; model '{name}' "
            "batches, so a request needs at least one input to give its batch size"
        )
    batch_size = 0
    # Last sent first, as Triton 2.51 goes through them (its map's order, measured): with
    # more than one wrong, the one named is the one Triton names (its QA compares them).
    for input_name, tensor in reversed(inputs.items()):
        spec = declared[input_name]
        if tensor.data_type is not spec.data_type:
            raise InvalidArgumentError(
                f"{request.label}inference input '{input_name}' data-type is "
                f"'{tensor.data_type.wire_name}', but model '{name}' expects "
                f"'{spec.data_type.wire_name}'"
            )
        shape = tensor.shape
        if batching:
            # (the batch size before the dims, as Triton checks them: [3] for dims [-1] and
            # max_batch_size 2 is a batch of 3 too many)
            if len(shape) == 0:
                raise _batched_shape_error(request, input_name, signature, shape)
            if batch_size and shape[0] != batch_size:
                raise InvalidArgumentError(  # (Triton's words)
                    f"{request.label}input '{input_name}' batch size does not match other inputs "
                    f"for '{name}'"
                )
            batch_size = shape[0]
            if batch_size == 0:  # (Triton 2.51 answers a byte size mismatch, hangs or crashes,
                # by the model: side by side. Named plainly here.)
                raise InvalidArgumentError(
                    f"{request.label}inference request batch-size must be >= 1 for '{name}'"
                )
            if batch_size > signature.max_batch_size:
                raise InvalidArgumentError(
                    f"{request.label}inference request batch-size must be <= "
                    f"{signature.max_batch_size} for '{name}'"
                )
            if not _matches(spec.dims, shape[1:]):
                raise _batched_shape_error(request, input_name, signature, shape)
        elif not _matches(spec.dims, shape):
            raise InvalidArgumentError(
                f"{request.label}unexpected shape for input '{input_name}' for model '{name}'. "
                f"Expected {shape_text(spec.dims)}, got {shape_text(shape)}. "
            )
        _check_byte_size(request, input_name, name, tensor)
        if spec.reshape is not None:
            inputs[input_name] = reshaped(tensor, spec.dims, spec.reshape, batching)
    if request.requested_outputs is not None:
        for output_name in request.requested_outputs:
            if output_name not in signature.outputs:
                raise InvalidArgumentError(
                    f"unexpected inference output '{output_name}' for model '{name}'"
                )
    return batch_size if batching else 1


def _check_byte_size(request: Request, name: str, model: str, tensor: Tensor) -> None:
    try:
        tensor.check_size()
    except ElementCountError as exc:
        raise string_count_error(request.label, name, model, exc.expected, exc.count) from None
    except TruncatedElement as exc:  # (Triton 2.51's words, side by side; the second without label)
        if exc.in_prefix:
            raise InvalidArgumentError(
                f"{request.label}incomplete string length indicator for inference input "
                f"'{name}' for model '{model}', expecting 4 bytes but only {exc.available} "
                "bytes available. "
                "Please make sure the string length indicator is in one buffer."
            ) from None
        raise InvalidArgumentError(
            f"incomplete string data for inference input '{name}', expecting string of length "
            f"{exc.expected} but only {exc.available} bytes available"
        ) from None
    except ValueError as exc:
        raise InvalidArgumentError(f"{request.label}input '{name}': {exc}") from None


def string_count_error(label: str, name: str, model: str, expected: int, count: int) -> InvalidArgumentError:
    """A BYTES input with more or fewer elements than its shape, in Triton 2.51's words (which
    count one past the last expected element when there are too many, as it stops there)."""
    if count < expected:
        return InvalidArgumentError(
            f"{label}expected {expected} string elements for inference input '{name}' for model "
            f"'{model}', got {count}"
        )
    return InvalidArgumentError(
        f"{label}unexpected number of string elements {expected + 1} for inference input '{name}' "
        f"for model '{model}', expecting {expected}"
    )


def reschedule_refused(model_name: str) -> InvalidArgumentError:
    """A model asked to run a request again (TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
    where only an iterative sequence may."""
    return InvalidArgumentError(
        f"model '{model_name}' rescheduled a request, which needs "
        "sequence_batching { iterative_sequence: true }"
    )


def output_as_declared(signature: Signature, name: str, tensor: Tensor) -> Tensor:
    """A model's output under its config's dims where the config reshapes it (the
    model made it in the reshape's shape); raises InternalError, naming the model's
    fault, when it does not fit."""
    spec = signature.outputs.get(name)
    if spec is None or spec.reshape is None:
        return tensor
    try:
        return reshaped(tensor, spec.reshape, spec.dims, signature.max_batch_size > 0)
    except ValueError:  # (the model's fault: said as such, not logged as ours)
        raise InternalError(
            f"output '{name}' of model '{signature.name}' has shape {shape_text(tensor.shape)}, "
            f"which does not fit its reshape {shape_text(spec.reshape)} (dims {shape_text(spec.dims)})"
        ) from None


def reshaped(
    tensor: Tensor, dims: tuple[int, ...], shape: tuple[int, ...], batching: bool
) -> Tensor:
    """The same bytes under a config ``reshape``, from ``dims`` to ``shape`` (an input's
    dims to its reshape; an output's reshape to its dims), as Triton does it: the sizes of
    the tensor's dimensions where ``dims`` has -1 fill the -1 of ``shape``, in order (config
    validation makes them as many). Raises ValueError when the elements do not fit (a
    model's output that is not of its reshape)."""
    batch = list(tensor.shape[:1]) if batching else []
    sizes = iter([size for dim, size in zip(dims, tensor.shape[len(batch) :]) if dim == -1])
    target = batch + [next(sizes, -1) if dim == -1 else dim for dim in shape]
    if -1 in target or math.prod(target) != tensor.element_count:
        raise ValueError(f"shape {shape_text(tensor.shape)} cannot become {shape_text(target)}")
    return tensor.reshape(target)
