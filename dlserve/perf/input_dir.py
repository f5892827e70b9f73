"""``--input-data DIRECTORY``, perf_analyzer's data directory: one file per input, named
after it, with the input's data for a batch-1 request, every request sending that data.

* BYTES: one element a line, in row-major order (split at each ``\\n``, nothing stripped:
  a ``\\r`` stays, an empty line is an empty element).
* Other types: the raw little-endian tensor, row-major.

The shapes are the model's, with ``--shape`` for variable ones. Each input needs its file,
an optional one too, of the size its shape takes; a file named after no input or output
is refused. Files named after outputs are allowed and not read: perf_analyzer's docs call
them expected outputs, but it does not check them (tried: a wrong one passes). The errors
are perf_analyzer's.
"""

from __future__ import annotations

import math
import os

import numpy as np

from dlserve.perf.flags import UsageError
from dlserve.perf.inputs import ModelInfo, TensorInfo, numpy_type


def read_directory(path: str, info: ModelInfo,
                   dims: dict[str, list[int]]) -> dict[str, np.ndarray]:
    """The one step of a data directory: each input's batch-1 tensor (``dims``: its shape)."""
    known = {t.name for t in info.inputs + info.outputs}
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        raise UsageError(f"--input-data {path}: {exc.strerror}") from None
    for name in names:
        if name not in known:
            raise UsageError(f"--input-data {path}: Provided data file '{name}' does not "
                             f"correspond to a valid model input or output of '{info.name}'")
    return {t.name: _read_input(path, t, dims[t.name]) for t in info.inputs}


def _read_input(directory: str, tensor: TensorInfo, shape: list[int]) -> np.ndarray:
    path = os.path.join(directory, tensor.name)
    where = f"--input-data {directory}"
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise UsageError(f"{where}: failed to open file '{path}': {exc.strerror}") from None
    if not raw:
        raise UsageError(f"{where}: file '{path}' is empty")
    count = math.prod(shape)
    if tensor.datatype == "BYTES":
        lines = raw.split(b"\n")
        if raw.endswith(b"\n"):
            lines.pop()
        if len(lines) != count:
            raise UsageError(f"{where}: provided data for input {tensor.name} has {len(lines)} "
                             f"elements, expect {count} (shape {shape}, one a line)")
        array = np.empty(count, dtype=np.object_)
        array[:] = lines
        return array.reshape(shape)
    dtype = numpy_type(tensor.datatype)
    if len(raw) != count * dtype.itemsize:
        raise UsageError(f"{where}: provided data for input {tensor.name} has byte size "
                         f"{len(raw)}, expect {count * dtype.itemsize} (shape {shape})")
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
