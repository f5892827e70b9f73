"""Triton's classification extension: an output asked for with ``classification: k``
comes back as its top k entries, as BYTES strings ``"<value>:<index>[:<label>]"``.

The shapes, order and text follow what Triton 2.51 answered for the same model
(tests/data/triton_reference/classification.json): a batched model's output is
ranked per batch entry (shape ``[batch, k]``), any other output as one flattened
tensor (shape ``[k]``); ``k`` is capped at the number of entries; ties keep index
order; floating-point values print with six decimals (C's ``%f``), integers as they
are; the label is line ``index`` of the output's ``label_filename`` (beside
config.pbtxt), left out past the file's end.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

from dlserve.errors import InvalidArgumentError
from dlserve.memory.dtypes import DataType
from dlserve.memory.tensor import Tensor

_INTEGERS = {
    DataType.UINT8, DataType.UINT16, DataType.UINT32, DataType.UINT64,
    DataType.INT8, DataType.INT16, DataType.INT32, DataType.INT64,
}  # fmt: skip
_FLOATS = {DataType.FP32, DataType.FP64}


def top_k(name: str, tensor: Tensor, count: int, batched: bool, labels: list[str]) -> Tensor:
    """``tensor`` as its ``count`` largest entries (per batch entry when ``batched``)."""
    if tensor.data_type in _FLOATS:
        text = "{:f}".format
    elif tensor.data_type in _INTEGERS:
        text = str
    else:
        raise InvalidArgumentError(
            f"class result not available for output '{name}' due to unsupported type "
            f"'{tensor.data_type.wire_name}'"
        )
    values = tensor.as_numpy()
    rows = values.reshape(values.shape[0] if batched and values.ndim else 1, -1)
    k = min(count, rows.shape[1])
    results = []
    for row in rows.tolist():
        # Python's sort is stable, also reversed: equal values keep their index order.
        for index in sorted(range(len(row)), key=row.__getitem__, reverse=True)[:k]:
            entry = f"{text(row[index])}:{index}"
            if index < len(labels):
                entry += f":{labels[index]}"
            results.append(entry.encode())
    shape = (rows.shape[0], k) if batched and values.ndim else (k,)
    objects = np.empty(len(results), dtype=np.object_)
    objects[:] = results
    return Tensor(DataType.BYTES, shape, objects=objects.reshape(shape))


def labels(model_dir: Path, label_filename: str) -> list[str]:
    """The lines of a model's label file, read again only when it changes. The file
    must lie inside the model's directory: a config (which a repository client may
    load) must not make a response carry some other file."""
    root = model_dir.resolve()
    path = (root / label_filename).resolve()
    if not path.is_relative_to(root):
        raise InvalidArgumentError(
            f"label file '{label_filename}' lies outside the directory of its model"
        )
    try:
        stamp = os.stat(path).st_mtime_ns
    except OSError:
        raise InvalidArgumentError(f"label file '{label_filename}' cannot be read") from None
    return _read_labels(str(path), stamp)


@functools.lru_cache(maxsize=64)
def _read_labels(path: str, stamp: int) -> list[str]:
    with open(path, encoding="utf-8", errors="replace") as file:
        return [line.rstrip("\r\n") for line in file]
