"""``pb_utils.InferenceRequest`` and ``pb_utils.InferenceResponse``."""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from typing import Any

from dlserve.pb_utils import _runtime
from dlserve.pb_utils.errors import TritonError, TritonModelException
from dlserve.pb_utils.sender import Exchange, InferenceResponseSender
from dlserve.pb_utils.tensor import Tensor


def _parameters_json(parameters: dict[str, Any] | str | None, what: str) -> str:
    """Parameters as the JSON object string Triton carries: str keys, bool/int/str values."""
    if parameters is None:
        return "{}"
    if isinstance(parameters, str):
        try:
            parameters = json.loads(parameters)
        except ValueError:
            raise TritonModelException(f"{what} parameters are not valid JSON") from None
    # (the words of Triton's later versions, which its QA tests look for)
    if not isinstance(parameters, dict):
        raise TritonModelException(f"Expect {what} parameters to be a dict, got {type(parameters)}")
    for key, value in parameters.items():
        if not isinstance(key, str):
            raise TritonModelException(f"Expect parameters keys to have type str, found type {type(key)} ({key!r})")
        if not isinstance(value, (bool, int, str)):
            raise TritonModelException(
                f"Expect parameters values to have type bool/int/str, found type {type(value)} "
                f"({what} parameter '{key}')"
            )
    return json.dumps(parameters)


RELEASE_ALL = 1
RELEASE_RESCHEDULE = 2


class MemoryType(enum.IntEnum):
    """Where a BLS call would like its outputs; the values of Triton's stub (GPU 0, CPU 1),
    not of the server's C API."""

    TRITONSERVER_MEMORY_GPU = 0
    TRITONSERVER_MEMORY_CPU = 1


MEMORY_CPU = MemoryType.TRITONSERVER_MEMORY_CPU
MEMORY_GPU = MemoryType.TRITONSERVER_MEMORY_GPU


class PreferredMemory:
    """Where a BLS call would like its outputs: ``PreferredMemory(TRITONSERVER_MEMORY_GPU, device_id=0)``.

    Taken as a preference only: outputs come where the callee made them (a GPU
    tensor stays on its GPU, a host one in shared memory), whatever is preferred.
    """

    __slots__ = ("preferred_memory_type", "preferred_device_id")

    def __init__(self, preferred_memory_type: int = MEMORY_CPU, preferred_device_id: int = 0) -> None:
        if preferred_memory_type not in (MEMORY_CPU, MEMORY_GPU):
            raise TritonModelException(
                "preferred_memory_type must be TRITONSERVER_MEMORY_CPU or TRITONSERVER_MEMORY_GPU, "
                f"got {preferred_memory_type!r}"
            )
        self.preferred_memory_type = int(preferred_memory_type)
        self.preferred_device_id = int(preferred_device_id)

    def __repr__(self) -> str:
        kind = "GPU" if self.preferred_memory_type == MEMORY_GPU else "CPU"
        return f"pb_utils.PreferredMemory({kind}, device_id={self.preferred_device_id})"


class InferenceTrace:
    """A request's trace (``request.trace()``). Passed on to a request the model makes
    (``pb_utils.InferenceRequest(..., trace=request.trace())``), it makes that call's trace
    a child of the request's, when the request is traced."""

    def __init__(self) -> None:
        self._id = 0  # the server's trace id; 0: not traced
        self._context: str | None = None

    @classmethod
    def _of(cls, wire: int | tuple[int, str]) -> InferenceTrace:
        """From the server's ``Trace.for_worker()``: an id, or an id and a context."""
        trace = cls()
        trace._id, trace._context = wire if isinstance(wire, tuple) else (wire, None)
        return trace

    def get_context(self) -> str | None:
        """The request's OpenTelemetry context as JSON (``{"traceparent": ...}``, the
        model's own span's) when it is traced in OpenTelemetry mode; else None, as in Triton."""
        return self._context


def binding_text(value: Any) -> str | None:
    """A text argument as Triton's bindings take it: a str, or bytes (UTF-8) such as
    the ``np.bytes_`` a model reads from a BYTES input; None for anything else."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return value if isinstance(value, str) else None


def _text(value: Any, what: str) -> str:
    text = binding_text(value)
    if text is None:
        raise TypeError(f"{what} must be a str, not {type(value).__name__}")
    return text


_REQUIRED: Any = object()  # (an argument Triton's InferenceRequest requires)


class InferenceRequest:
    """A request handed to ``execute``, or one a model builds to call another model (BLS)."""

    def __init__(
        self,
        request_id: str = "",
        correlation_id: int | str = 0,
        inputs: Sequence[Tensor] = _REQUIRED,
        requested_output_names: Sequence[str] = _REQUIRED,
        model_name: str = _REQUIRED,
        model_version: int = -1,
        flags: int = 0,
        timeout: int = 0,
        preferred_memory: Any = None,
        trace: Any = None,
        parameters: dict[str, Any] | str | None = None,
    ) -> None:
        """Triton's arguments, in its order; ``inputs``, ``requested_output_names`` and
        ``model_name`` must be given, as there."""
        # Wrong or missing arguments are TypeErrors, as Triton's constructor raises them.
        given = {"inputs": inputs, "requested_output_names": requested_output_names, "model_name": model_name}
        missing = [name for name, value in given.items() if value is _REQUIRED]
        if missing:
            raise TypeError(f"InferenceRequest() needs {', '.join(missing)} (Triton's constructor requires them)")
        model_name, request_id = _text(model_name, "model_name"), _text(request_id, "request_id")
        for tensor in inputs:
            if tensor is None:  # (Triton's words)
                raise TritonModelException(
                    f"Input tensor for request with id '{request_id}' and model name '{model_name}' "
                    "should not be empty."
                )
            if not isinstance(tensor, Tensor):
                raise TypeError("InferenceRequest inputs must be pb_utils.Tensor objects")
        if isinstance(requested_output_names, str):
            raise TypeError("requested_output_names must be a list of names, not a string")
        if preferred_memory is not None and not isinstance(preferred_memory, PreferredMemory):
            raise TypeError("preferred_memory must be a pb_utils.PreferredMemory")
        if trace is not None and not isinstance(trace, InferenceTrace):
            raise TypeError("trace must be a pb_utils.InferenceTrace (request.trace())")
        if not isinstance(correlation_id, (int, str)) or isinstance(correlation_id, bool):
            raise TypeError("correlation_id must be an int or a str")
        if isinstance(correlation_id, int) and not 0 <= correlation_id < 2**64:
            raise TritonModelException("correlation_id must be an unsigned 64-bit integer (or a str)")
        self._model_name = model_name
        self._model_version = int(model_version)
        self._inputs = list(inputs)
        self._requested = [_text(name, "requested_output_names") for name in requested_output_names]
        self._request_id = request_id
        self._correlation_id = correlation_id
        self._flags = int(flags)
        self._timeout = int(timeout)
        self._parameters = _parameters_json(parameters, "request")
        self._preferred_memory = preferred_memory
        self._trace = trace
        self._exchange: Exchange | None = None
        self._sender: InferenceResponseSender | None = None

    @classmethod
    def _received(
        cls,
        inputs: list[Tensor],
        requested_output_names: list[str],
        request_id: str,
        correlation_id: int | str,
        flags: int,
        timeout: int,
        parameters: str,
        exchange: Exchange,
        trace: int | tuple[int, str] = 0,
    ) -> InferenceRequest:
        """A request handed to ``execute``: built from trusted values, no re-validation."""
        request = cls.__new__(cls)
        request._exchange = exchange
        request._sender = None
        request._model_name = ""
        request._model_version = -1
        request._inputs = inputs
        request._requested = requested_output_names
        request._request_id = request_id
        request._correlation_id = correlation_id
        request._flags = flags
        request._timeout = timeout
        request._parameters = parameters
        request._preferred_memory = None
        request._trace = InferenceTrace._of(trace) if trace else None
        return request

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def get_response_sender(self) -> InferenceResponseSender:
        """The sender for this request's responses (the same one on every call)."""
        if self._exchange is None:
            raise TritonModelException("only a request handed to execute has a response sender")
        if self._sender is None:
            self._sender = InferenceResponseSender(self._exchange)
        return self._sender

    def is_cancelled(self) -> bool:
        """Whether the request was cancelled; cheap enough to poll in a loop."""
        exchange = self._exchange
        if exchange is None:
            return False
        runtime = exchange.answered_by()
        return runtime is not None and runtime.is_cancelled(exchange)

    def exec(self, decoupled: bool = False) -> Any:
        """Run this request on its model (BLS) and wait: an ``InferenceResponse``, or
        with ``decoupled=True`` an iterator over every response of a decoupled model.

        Errors come back inside the response (``has_error()``), not raised.
        """
        return self._runtime("exec").infer(self, bool(decoupled))

    async def async_exec(self, decoupled: bool = False) -> Any:
        """``exec`` for ``async def execute``: other coroutines run while this waits."""
        return await self._runtime("async_exec").async_infer(self, bool(decoupled))

    def _runtime(self, what: str) -> Any:
        runtime = _runtime.current()
        if runtime is None:
            raise TritonModelException(f"{what}() is only available inside a dlserve worker")
        return runtime

    def trace(self) -> InferenceTrace:
        """This request's trace, to hand on to the requests made for it (BLS)."""
        return self._trace if self._trace is not None else InferenceTrace()

    def preferred_memory(self) -> PreferredMemory:
        return self._preferred_memory or PreferredMemory()

    def set_release_flags(self, flags: int) -> None:
        """``TRITONSERVER_REQUEST_RELEASE_RESCHEDULE`` asks for this request to run again
        (iterative sequences): put ``None`` in its place in the list ``execute`` returns."""
        if flags not in (RELEASE_ALL, RELEASE_RESCHEDULE):
            raise TritonModelException(
                f"release flags must be TRITONSERVER_REQUEST_RELEASE_ALL or _RESCHEDULE, got {flags}"
            )
        self._release_flags = flags

    def rescheduled(self) -> bool:
        return getattr(self, "_release_flags", RELEASE_ALL) == RELEASE_RESCHEDULE

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def set_flags(self, flags: int) -> None:
        """The sequence flags a BLS request is sent with (``TRITONSERVER_REQUEST_FLAG_*``)."""
        self._flags = int(flags)

    def timeout(self) -> int:
        """The request's timeout in microseconds (0 = none)."""
        return self._timeout

    def parameters(self) -> str:
        """The request parameters as a JSON object string."""
        return self._parameters

    def requested_output_names(self) -> set[str]:
        """A set, as Triton's (order carries no meaning)."""
        return set(self._requested)

    def model_name(self) -> str:
        return self._model_name

    def model_version(self) -> int:
        return self._model_version

    def __repr__(self) -> str:
        return f"pb_utils.InferenceRequest(id={self._request_id!r}, inputs={self._inputs!r})"


class InferenceResponse:
    """``InferenceResponse(output_tensors=[...], error=None, parameters=None)``."""

    def __init__(
        self,
        output_tensors: Sequence[Tensor] = (),
        error: TritonError | None = None,
        parameters: dict[str, Any] | str | None = None,
    ) -> None:
        if output_tensors is None:  # (left out is an empty list; None is refused, as in Triton)
            raise TypeError("InferenceResponse output_tensors must be a list of pb_utils.Tensor, not None")
        tensors = list(output_tensors)
        for tensor in tensors:
            if tensor is None:  # (Triton's words)
                raise TritonModelException("Output tensor for inference response should not be empty.")
            if not isinstance(tensor, Tensor):  # (TypeErrors, as Triton's constructor raises)
                raise TypeError(
                    "InferenceResponse output_tensors must be pb_utils.Tensor objects, "
                    f"got {type(tensor).__name__}"
                )
        if error is not None and not isinstance(error, TritonError):
            raise TypeError(f"InferenceResponse error must be a pb_utils.TritonError, got {type(error).__name__}")
        names = [tensor._name for tensor in tensors]
        if len(set(names)) < len(names):  # (one would be lost, or both sent under one name)
            twice = sorted({name for name in names if names.count(name) > 1})
            raise TritonModelException(f"InferenceResponse has more than one output tensor named {twice}")
        self._outputs = tensors
        self._error = error
        self._parameters = _parameters_json(parameters, "response")

    @classmethod
    def _received(
        cls, outputs: list[Tensor], error: TritonError | None, parameters: str
    ) -> InferenceResponse:
        """A response a BLS call got back: trusted values, no re-validation."""
        response = cls.__new__(cls)
        response._outputs = outputs
        response._error = error
        response._parameters = parameters
        return response

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return self._parameters

    def __repr__(self) -> str:
        if self._error is not None:
            return f"pb_utils.InferenceResponse(error={self._error.message()!r})"
        return f"pb_utils.InferenceResponse(outputs={self._outputs!r})"
