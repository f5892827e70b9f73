"""The engine's request and response, and request validation against a model config.

These are the only types frontends and the in-process API hand to the engine:
tensors are :class:`dlserve.memory.tensor.Tensor`, errors are :mod:`dlserve.errors`.
Validation messages follow Triton's wording (captured from a real server in
``tests/data/triton_reference/``) so clients that match on them keep working.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dlserve.engine.proto import model_config_pb2 as mc
from dlserve.errors import InvalidArgumentError, TritonError
from dlserve.memory.dtypes import DataType
from dlserve.memory.tensor import Tensor


@dataclasses.dataclass(slots=True)
class Response:
    """One response to a request; ``final`` marks the last one."""

    model_name: str
    model_version: int
    request_id: str = ""
    outputs: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    parameters: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: TritonError | None = None
    final: bool = True


ResponseCallback = Callable[[Response], None]


@dataclasses.dataclass(slots=True, eq=False)
class Request:
    """An inference request as the engine sees it.

    ``requested_outputs`` None means every output of the model. ``on_response`` is
    called on the engine's event loop for every response, the last with ``final``.
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
    arrival_ns: int = dataclasses.field(default_factory=time.monotonic_ns)

    @property
    def label(self) -> str:
        """Triton's prefix for request-level errors."""
        return f"[request id: {self.request_id or '<id_unknown>'}] "


def _shape_text(shape: Any) -> str:
    return "[" + ",".join(str(int(d)) for d in shape) + "]"


def _matches(dims: list[int], shape: tuple[int, ...]) -> bool:
    return len(dims) == len(shape) and all(d == -1 or d == s for d, s in zip(dims, shape))


def validate_request(request: Request, config: mc.ModelConfig) -> int:
    """Check inputs and requested outputs against ``config``; returns the batch size.

    Applies the config's ``reshape`` to inputs, as Triton does before ``execute``.
    """
    name = config.name
    label = request.label
    batching = config.max_batch_size > 0
    declared = {tensor.name: tensor for tensor in config.input}
    for input_name in request.inputs:
        if input_name not in declared:
            raise InvalidArgumentError(
                f"{label}unexpected inference input '{input_name}' for model '{name}'"
            )
    missing = [t.name for t in config.input if not t.optional and t.name not in request.inputs]
    if missing:
        got = ",".join(f"'{n}'" for n in request.inputs)
        raise InvalidArgumentError(
            f"{label}expected {len(config.input)} inputs but got {len(request.inputs)} inputs "
            f"for model '{name}'. Got input(s) [{got}], but missing required input(s) "
            f"[{','.join(repr(m) for m in missing)}]. Please provide all required input(s)."
        )
    batch_size = 0
    for input_name, tensor in request.inputs.items():
        spec = declared[input_name]
        expected_type = DataType(spec.data_type)
        if tensor.data_type is not expected_type:
            raise InvalidArgumentError(
                f"{label}inference input '{input_name}' data-type is '{tensor.data_type.wire_name}', "
                f"but model '{name}' expects '{expected_type.wire_name}'"
            )
        dims = list(spec.dims)
        shape = tensor.shape
        if batching:
            if len(shape) == 0 or not _matches(dims, shape[1:]):
                raise InvalidArgumentError(
                    f"{label}unexpected shape for input '{input_name}' for model '{name}'. "
                    f"Expected {_shape_text([-1] + dims)}, got {_shape_text(shape)}. NOTE: Setting a "
                    "non-zero max_batch_size in the model config requires a batch dimension to be "
                    "prepended to each input shape. If you want to specify the full shape including "
                    "the batch dim in your input dims config, try setting max_batch_size to zero. "
                    "See the model configuration docs for more info on max_batch_size."
                )
            if batch_size and shape[0] != batch_size:
                raise InvalidArgumentError(
                    f"{label}inputs of model '{name}' disagree on the batch size "
                    f"({batch_size} and {shape[0]})"
                )
            batch_size = shape[0]
            if shape[0] > config.max_batch_size:
                raise InvalidArgumentError(
                    f"{label}inference request batch-size must be <= {config.max_batch_size} "
                    f"for '{name}'"
                )
        elif not _matches(dims, shape):
            raise InvalidArgumentError(
                f"{label}unexpected shape for input '{input_name}' for model '{name}'. "
                f"Expected {_shape_text(dims)}, got {_shape_text(shape)}. "
            )
        _check_byte_size(label, input_name, tensor)
        if spec.HasField("reshape"):
            request.inputs[input_name] = reshaped(tensor, list(spec.reshape.shape), batching)
    if request.requested_outputs is not None:
        known = {tensor.name for tensor in config.output}
        for output_name in request.requested_outputs:
            if output_name not in known:
                raise InvalidArgumentError(
                    f"unexpected inference output '{output_name}' for model '{name}'"
                )
    return batch_size if batching else 1


def _check_byte_size(label: str, name: str, tensor: Tensor) -> None:
    try:
        tensor.check_size()
    except ValueError as exc:
        raise InvalidArgumentError(f"{label}input '{name}': {exc}") from None


def reshaped(tensor: Tensor, shape: list[int], batching: bool) -> Tensor:
    """The same bytes under a config ``reshape`` (``-1`` filled in from the element count)."""
    target = ([tensor.shape[0]] if batching and tensor.shape else []) + shape
    if -1 in target:
        known = int(np.prod([d for d in target if d != -1], dtype=np.int64)) or 1
        target = [tensor.element_count // known if d == -1 else d for d in target]
    return tensor.reshape(target)
