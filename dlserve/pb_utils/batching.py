"""Batching helpers for models: one array for a batch of requests, and back.

Triton hands a Python model the *list* of requests a dynamic batch holds; joining
their tensors and splitting the results is the model's job (users have asked for
help since 2021). With these helpers::

    joined = pb_utils.join_inputs(requests, "INPUT0")       # rows of every request
    result = model(joined.array)                             # one call for the batch
    return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", part)])
            for part in joined.split(result)]

``join_inputs`` costs no copy when the requests' rows already sit back to back in
memory — dlserve places the small inputs of a batch that way — and one copy
otherwise. Requests whose non-batch dimensions differ are refused unless
``ragged="pad"``, which pads every request to the largest shape with ``pad_value``
(``joined.shapes`` keeps the original shapes, to trim results with).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from dlserve.pb_utils.errors import TritonModelException
from dlserve.pb_utils.helpers import get_input_tensor_by_name
from dlserve.pb_utils.inference import InferenceRequest


@dataclasses.dataclass
class JoinedInputs:
    """An input of several requests, joined along the first (batch) dimension."""

    array: np.ndarray
    sizes: list[int]  # rows contributed by each request, in request order
    shapes: list[tuple[int, ...]]  # each request's own shape (before any padding)
    copied: bool  # False when ``array`` is a view of the requests' own memory

    def split(self, output: Any) -> list[np.ndarray]:
        """Cut ``output`` (one row per joined row) into per-request views."""
        output = np.asarray(output)
        total = sum(self.sizes)
        if output.ndim == 0 or output.shape[0] != total:
            raise TritonModelException(
                f"cannot split an output of shape {list(output.shape)}: its first dimension "
                f"must be the {total} joined rows"
            )
        bounds = np.cumsum([0, *self.sizes])
        return [output[bounds[i] : bounds[i + 1]] for i in range(len(self.sizes))]


def _root(array: np.ndarray) -> Any:
    base: Any = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return base


def _adjacent_view(arrays: list[np.ndarray]) -> np.ndarray | None:
    """One view over arrays that lie back to back in one buffer, else None."""
    first = arrays[0]
    root = _root(first)
    address = first.__array_interface__["data"][0]
    for array in arrays:
        if (
            not array.flags.c_contiguous
            or array.dtype != first.dtype
            or array.__array_interface__["data"][0] != address
            or _root(array) is not root
        ):
            return None
        address += array.nbytes
    root_array = root if isinstance(root, np.ndarray) else np.frombuffer(root, dtype=np.uint8)
    offset = first.__array_interface__["data"][0] - root_array.__array_interface__["data"][0]
    rows = sum(a.shape[0] for a in arrays)
    return np.ndarray((rows, *first.shape[1:]), dtype=first.dtype, buffer=root_array, offset=offset)


def join_inputs(
    requests: Sequence[InferenceRequest],
    name: str,
    *,
    ragged: str = "reject",
    pad_value: Any = 0,
) -> JoinedInputs:
    """Join input ``name`` of ``requests`` along the batch dimension (see module docs)."""
    if ragged not in ("reject", "pad"):
        raise TritonModelException("ragged must be 'reject' or 'pad'")
    arrays = []
    for index, request in enumerate(requests):
        tensor = get_input_tensor_by_name(request, name)
        if tensor is None:
            raise TritonModelException(f"request {index} of the batch has no input '{name}'")
        if not tensor.is_cpu():
            raise TritonModelException(
                f"join_inputs joins host inputs; input '{name}' of request {index} is on a GPU "
                "(join GPU inputs with your framework, e.g. torch.cat of torch.from_dlpack(...))"
            )
        array = tensor._tensor.as_numpy()  # (BF16 too, which pb_utils' as_numpy refuses)
        if array.ndim == 0:
            raise TritonModelException(f"input '{name}' has no batch dimension to join along")
        arrays.append(array)
    if not arrays:
        raise TritonModelException("join_inputs needs at least one request")
    sizes = [a.shape[0] for a in arrays]
    shapes = [tuple(a.shape) for a in arrays]
    if len({(a.shape[1:], a.dtype) for a in arrays}) > 1:
        if ragged == "reject":
            raise TritonModelException(
                f"input '{name}' differs across the batch ({[list(s) for s in shapes]}); "
                "pass ragged='pad' to pad them to one shape"
            )
        if len({a.dtype for a in arrays}) > 1:
            raise TritonModelException(f"input '{name}' has different data types across the batch")
        rank = {a.ndim for a in arrays}
        if len(rank) > 1:
            raise TritonModelException(f"input '{name}' has different ranks across the batch")
        widest = tuple(max(a.shape[d] for a in arrays) for d in range(1, arrays[0].ndim))
        joined = np.full((sum(sizes), *widest), pad_value, dtype=arrays[0].dtype)
        row = 0
        for array in arrays:
            joined[(slice(row, row + array.shape[0]), *map(slice, array.shape[1:]))] = array
            row += array.shape[0]
        return JoinedInputs(joined, sizes, shapes, copied=True)
    if len(arrays) == 1:
        return JoinedInputs(arrays[0], sizes, shapes, copied=False)
    view = _adjacent_view(arrays)
    if view is not None:
        return JoinedInputs(view, sizes, shapes, copied=False)
    return JoinedInputs(np.concatenate(arrays, axis=0), sizes, shapes, copied=True)
