"""What to send: the model's inputs (from its metadata and config) and their data.

``--input-data`` follows perf_analyzer:

* ``zero``   -- numeric inputs are zeros (BOOL: false).
* ``random`` -- numeric inputs get random values (floats in [0, 1), integers in [0, 100),
  BOOL random); one data set, sent with every request.
* ``FILE.json`` -- perf_analyzer's JSON format::

      {"data": [{"INPUT0": [1, 2, 3, 4], "INPUT1": {"content": [...], "shape": [2, 2]}},
                {"INPUT0": {"b64": "<base64 of the raw little-endian tensor>"}, ...}]}

  Each entry of ``data`` is one step; a list of lists (streams) is read as its steps in
  order. Content may be flat or nested; BYTES content is a list of strings; as in
  perf_analyzer, floats are written as floats (1.0, not 1), integers as integers and BOOL
  as true/false, else the file is refused (FP16 and BF16, which perf_analyzer takes only
  as b64, take floats here). A step
  without ``shape`` uses the model's dims, with ``--shape`` for variable ones; a step's
  ``shape`` must agree with those (so where ``--shape`` is given, be it), as perf_analyzer
  checks. A step may leave out an input the model's config marks ``optional``: its
  requests go without it (with ``-b`` above 1, every step must give the same inputs).
  Requests cycle through the steps; with ``-b B`` a request takes B consecutive steps.
  With several files, their steps follow each other, file after file. Other keys
  (``parameters``) are ignored.

  ``validation_data``, beside ``data`` and shaped as it (a step, or a stream of steps, for
  each of its entries), holds each step's expected outputs, in the same forms as inputs::

      "validation_data": [{"OUTPUT0": [2, 4, 6, 8], "OUTPUT1": {"b64": "..."}}, ...]

  As in perf_analyzer, each step names every output of the model, and each answer's
  outputs must equal them byte for byte (floats exactly; a batch: its steps' outputs one
  after the other), else the run fails with "Output doesn't match expected output" (or
  "Output size doesn't match expected size"). Unlike perf_analyzer, it also works with
  ``-b`` above 1, with ``--shared-memory system`` (outputs are read from their area, which
  each distinct request then has of its own), and for a variable-shaped output (the
  content, or the ``shape`` given, sets its size).

* ``DIRECTORY`` -- perf_analyzer's data directory, one file per input, the same data sent
  with every request: see :mod:`dlserve.perf.input_dir`. It is the only data of a run.

BYTES elements in the zero and random modes are ``--string-data`` when given, else random
printable strings of ``--string-length`` characters, as perf_analyzer's are.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import os
import string
from typing import Any

import numpy as np

from dlserve.memory.bytes_codec import serialize_bytes
from dlserve.memory.dtypes import DataType, numpy_dtype
from dlserve.perf.flags import UsageError

_LETTERS = np.frombuffer((string.ascii_letters + string.digits).encode(), dtype=np.uint8)


def numpy_type(datatype: str) -> np.dtype[Any]:
    """The numpy dtype of a wire datatype name (object for BYTES, bfloat16 for BF16)."""
    try:
        return numpy_dtype(DataType.from_wire(datatype))
    except (ValueError, TypeError) as exc:
        raise UsageError(f"datatype {datatype} is not supported: {exc}") from None


@dataclasses.dataclass
class TensorInfo:
    name: str
    datatype: str
    dims: list[int]  # without the batch dimension
    optional: bool = False  # an input the config marks optional: data may leave it out


@dataclasses.dataclass
class ModelInfo:
    name: str
    version: str
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    max_batch_size: int = 0
    decoupled: bool = False
    sequence: bool = False  # it has a sequence batcher: requests go in sequences

    @classmethod
    def from_json(cls, metadata: dict[str, Any], config: dict[str, Any]) -> ModelInfo:
        """From the KServe metadata JSON and Triton's config JSON (HTTP, gRPC or in-process)."""
        max_batch = int(config.get("max_batch_size", 0) or 0)
        policy = config.get("model_transaction_policy") or {}
        versions = metadata.get("versions") or []
        optional = {entry.get("name") for entry in config.get("input", []) if entry.get("optional")}

        def tensors(entries: list[dict[str, Any]]) -> list[TensorInfo]:
            out = []
            for entry in entries:
                dims = [int(d) for d in entry.get("shape", [])]
                if max_batch > 0 and dims:
                    dims = dims[1:]  # the -1 batch dimension
                out.append(TensorInfo(entry["name"], entry["datatype"], dims,
                                      entry["name"] in optional))
            return out

        return cls(
            name=metadata.get("name", ""),
            version=str(versions[-1]) if versions else "",
            inputs=tensors(metadata.get("inputs", [])),
            outputs=tensors(metadata.get("outputs", [])),
            max_batch_size=max_batch,
            decoupled=bool(policy.get("decoupled", False)),
            sequence="sequence_batching" in config,
        )


def check_batch(info: ModelInfo, batch_size: int) -> None:
    if batch_size > 1 and info.max_batch_size == 0:
        raise UsageError(
            f"-b {batch_size}: model '{info.name}' does not support batching (max_batch_size 0)"
        )
    if info.sequence and batch_size > 1:
        raise UsageError(
            f"-b {batch_size}: model '{info.name}' has a sequence batcher, which takes requests of batch size 1"
        )
    if info.max_batch_size and batch_size > info.max_batch_size:
        raise UsageError(
            f"-b {batch_size} is above model '{info.name}''s max_batch_size {info.max_batch_size}"
        )


def _fits(shape: list[int], dims: list[int]) -> bool:
    return len(shape) == len(dims) and all(d < 0 or d == s for d, s in zip(dims, shape))


def _given_shapes(info: ModelInfo, shapes: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each input's dims (no batch dimension): the model's, with ``--shape`` for variable
    ones (-1 stays where none is given)."""
    names = {t.name for t in info.inputs}
    for name in shapes:
        if name not in names:
            raise UsageError(f"--shape: model '{info.name}' has no input '{name}' (inputs: {', '.join(sorted(names))})")
    out = {}
    for tensor in info.inputs:
        given = shapes.get(tensor.name)
        if given is not None and not _fits(given, tensor.dims):
            raise UsageError(
                f"--shape {tensor.name}:{','.join(map(str, given))} does not fit the model's dims {tensor.dims}"
            )
        out[tensor.name] = list(tensor.dims if given is None else given)
    return out


def resolve_shapes(info: ModelInfo, shapes: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each input's dims (no batch dimension): the model's, with ``--shape`` for variable
    ones, which each need one."""
    out = _given_shapes(info, shapes)
    for tensor in info.inputs:
        if any(d < 0 for d in out[tensor.name]):
            raise UsageError(
                f"input '{tensor.name}' has a variable shape {tensor.dims}: give it with "
                f"--shape {tensor.name}:" + ",".join("1" if d < 0 else str(d) for d in tensor.dims)
            )
    return out


def random_strings(count: int, length: int, rng: np.random.Generator) -> np.ndarray:
    letters = rng.choice(_LETTERS, size=(count, length)) if length else np.zeros((count, 0), np.uint8)
    out = np.empty(count, dtype=np.object_)
    for i in range(count):
        out[i] = letters[i].tobytes()
    return out


def generated_tensor(
    tensor: TensorInfo, shape: list[int], zero: bool, string_length: int, string_data: str | None,
    rng: np.random.Generator,
) -> np.ndarray:
    count = math.prod(shape)
    if tensor.datatype == "BYTES":
        if string_data is not None:
            flat = np.empty(count, dtype=np.object_)
            flat[:] = [string_data.encode()] * count
        else:
            flat = random_strings(count, string_length, rng)
        return flat.reshape(shape)
    dtype = numpy_type(tensor.datatype)
    if zero:
        return np.zeros(shape, dtype=dtype)
    if tensor.datatype == "BOOL":
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if tensor.datatype.startswith(("FP", "BF")):
        return rng.random(size=shape, dtype=np.float64).astype(dtype)
    return rng.integers(0, 100, size=shape).astype(dtype)


def _file_shape(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not all(type(d) is int and d >= 0 for d in value):
        raise UsageError(
            f"{where}: 'shape' must be a list of non-negative integers, got {json.dumps(value)}"
        )
    return value


def _b64_content(tensor: TensorInfo, value: Any, where: str) -> Any:
    if not isinstance(value, str):
        raise UsageError(f"{where}: 'b64' must be a base64 string, got {json.dumps(value)}")
    try:
        raw = base64.b64decode(value)
    except ValueError as exc:  # (binascii.Error: bad padding)
        raise UsageError(f"{where}: 'b64' is not base64: {exc}") from None
    if tensor.datatype == "BYTES":
        return [raw]
    dtype = numpy_type(tensor.datatype)
    if len(raw) % dtype.itemsize:
        raise UsageError(f"{where}: 'b64' holds {len(raw)} bytes, not whole {tensor.datatype} "
                         f"elements of {dtype.itemsize} bytes each")
    return np.frombuffer(raw, dtype=dtype).copy()


def _bytes_elements(content: Any, where: str) -> np.ndarray:
    """BYTES content, flat: strings (UTF-8 encoded) or the bytes of a 'b64'."""
    try:
        flat = np.asarray(content, dtype=np.object_).reshape(-1)
    except ValueError as exc:
        raise UsageError(f"{where}: {exc}") from None
    array = np.empty(flat.size, dtype=np.object_)
    for i, item in enumerate(flat):
        if isinstance(item, str):
            array[i] = item.encode()
        elif isinstance(item, bytes):
            array[i] = item
        else:
            raise UsageError(f"{where}: BYTES elements are strings, got {json.dumps(item)}")
    return array


def _step_tensor(tensor: TensorInfo, value: Any, default_shape: list[int] | None, where: str,
                 kind: str = "input") -> np.ndarray:
    shape = None
    at = f"{where}: {kind} '{tensor.name}'"
    if isinstance(value, dict):
        if "shape" in value:
            shape = _file_shape(value["shape"], at)
        if "b64" in value:
            content: Any = _b64_content(tensor, value["b64"], at)
        elif "content" in value:
            content = value["content"]
        else:
            raise UsageError(f"{at} needs 'content' or 'b64'")
    else:
        content = value
    if shape is not None and default_shape is not None and not _fits(shape, default_shape):
        source = "--shape" if default_shape != tensor.dims else "the model's input shape"
        raise UsageError(f"{at}: its shape {shape} is incompatible with {source} {default_shape}")
    if shape is None:
        shape = default_shape
    if tensor.datatype == "BYTES":
        array = _bytes_elements(content, at)
    elif isinstance(content, np.ndarray):
        array = content.reshape(-1)
    else:
        _check_json_values(content, tensor.datatype, at)
        try:
            array = np.asarray(content, dtype=numpy_type(tensor.datatype)).reshape(-1)
        except (TypeError, ValueError, OverflowError) as exc:
            raise UsageError(f"{at}: {exc}") from None
    if shape is None:  # an expected output's: its content's size where it varies
        shape = [array.size] if any(d < 0 for d in tensor.dims) else list(tensor.dims)
    elif any(d < 0 for d in shape):
        raise UsageError(
            f"{where}: input '{tensor.name}' has a variable shape {tensor.dims}: give a 'shape' "
            f"in the file or --shape {tensor.name}:..."
        )
    if math.prod(shape) != array.size:
        raise UsageError(
            f"{at} has {array.size} elements, its shape {shape} needs {math.prod(shape)}"
        )
    return array.reshape(shape)


# perf_analyzer's names for the types, in its message for content of the wrong kind
_C_TYPES = {"BOOL": "bool", "FP64": "fp64", "FP32": "float", "FP16": "float", "BF16": "float"}
_C_TYPES.update(
    {f"{sign}INT{bits}": f"{sign.lower()}int{bits}_t" for sign in ("", "U") for bits in (8, 16, 32, 64)}
)
# What each kind of type takes, and how the refusal says it
_FLOAT = (
    lambda v: isinstance(v, float),
    "a number written with a decimal point or an exponent (1.0, not 1)",
)
_KINDS = {
    "BOOL": (lambda v: isinstance(v, bool), "true or false"),
    "INT": (lambda v: type(v) is int, "an integer written without a decimal point or an exponent"),
    "UINT": (
        lambda v: type(v) is int and v >= 0,
        "an integer of 0 or more written without a decimal point or an exponent",
    ),
    "FP16": _FLOAT, "FP32": _FLOAT, "FP64": _FLOAT, "BF16": _FLOAT,
}


def _check_json_values(content: Any, datatype: str, at: str) -> None:
    """Refuse JSON values of the wrong kind for ``datatype``, as perf_analyzer does, so
    that a data file means the same to both: BOOL takes true/false, integers take
    integers (not 1.0, true or "1"; unsigned ones not below 0), floats take numbers
    written as floats (1.0, not 1). numpy would convert them all, 1.5 to 1 included.
    (perf_analyzer refuses FP16 and BF16 content altogether; here they take floats.)"""
    values = content if isinstance(content, list) else [content]
    while any(isinstance(v, list) for v in values):  # (nested content)
        values = [x for v in values for x in (v if isinstance(v, list) else [v])]
    fits, takes = _KINDS.get(datatype) or _KINDS[datatype.rstrip("0123456789")]
    for value in values:
        if not fits(value):
            raise UsageError(
                f"{at}: unable to find {_C_TYPES[datatype]} data in json: {json.dumps(value)} "
                f"is not {takes}"
            )


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            document = json.load(f)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--input-data {path}: {exc}") from None
    data = document.get("data") if isinstance(document, dict) else None
    if not isinstance(data, list) or not data:
        raise UsageError(f"--input-data {path}: expected {{\"data\": [{{...}}, ...]}} with at least one entry")
    return document


def _flat(entries: list[Any]) -> list[Any]:
    """The steps of ``data`` (or ``validation_data``): a stream (a list) is its steps in order."""
    steps: list[Any] = []
    for entry in entries:
        if isinstance(entry, list):
            steps.extend(entry)
        else:
            steps.append(entry)
    return steps


def _step_tensors(step: Any, model: str, tensors: list[TensorInfo], shapes: dict[str, list[int]],
                  where: str, kind: str) -> dict[str, np.ndarray]:
    if not isinstance(step, dict):
        raise UsageError(f"{where}: expected an object of {kind} name -> data")
    out = {}
    for tensor in tensors:
        if tensor.name not in step:
            if tensor.optional:  # (sent without it, as perf_analyzer does)
                continue
            raise UsageError(f"{where}: no data for {kind} '{tensor.name}'")
        value, shape = step[tensor.name], shapes.get(tensor.name)
        out[tensor.name] = _step_tensor(tensor, value, shape, where, kind)
    unknown = set(step) - {t.name for t in tensors}
    if unknown:
        raise UsageError(f"{where}: model '{model}' has no {kind}(s) {', '.join(sorted(unknown))}")
    return out


def load_json_steps(path: str, info: ModelInfo,
                    shapes: dict[str, list[int]]) -> list[dict[str, np.ndarray]]:
    """The steps of a perf_analyzer JSON data file, one dict of batch-1 tensors each."""
    steps = _flat(_read_json(path)["data"])
    dims = _given_shapes(info, shapes)
    return [
        _step_tensors(step, info.name, info.inputs, dims, f"--input-data {path}: step {i}",
                      "input")
        for i, step in enumerate(steps)
    ]


def load_validation(path: str, info: ModelInfo) -> list[dict[str, bytes]]:
    """The expected outputs of each step of a JSON data file (their bytes on the wire);
    nothing for each step of a file without ``validation_data``."""
    document = _read_json(path)
    data, expected = document["data"], document.get("validation_data")
    if expected is None:
        return [{} for _ in _flat(data)]
    aligned = isinstance(expected, list) and len(expected) == len(data) and all(
        isinstance(v, list) == isinstance(d, list) and (not isinstance(d, list) or len(v) == len(d))
        for d, v in zip(data, expected)
    )
    if not aligned:  # (perf_analyzer's words)
        raise UsageError(
            f"--input-data {path}: The 'validation_data' field doesn't align with 'data' field"
        )
    types = {t.name: t.datatype for t in info.outputs}
    out = []
    for index, step in enumerate(_flat(expected)):
        where = f"--input-data {path}: validation_data step {index}"
        tensors = _step_tensors(step, info.name, info.outputs, {}, where, "output")
        out.append({name: raw_bytes(array, types[name]) for name, array in tensors.items()})
    return out


def _batch_steps(info: ModelInfo, count: int, batch_size: int) -> list[list[int]]:
    """The steps of each request: with batching, request k takes steps kB .. kB+B-1 (cyclic)."""
    if info.max_batch_size == 0:
        return [[index] for index in range(count)]
    requests = count // math.gcd(count, batch_size)
    return [[(k * batch_size + j) % count for j in range(batch_size)] for k in range(requests)]


def _batched(info: ModelInfo, steps: list[dict[str, np.ndarray]], batch_size: int) -> list[dict[str, np.ndarray]]:
    if info.max_batch_size == 0:
        return steps
    if batch_size > 1 and len({frozenset(step) for step in steps}) > 1:  # (perf_analyzer's words)
        raise UsageError(
            "--input-data: For batch sizes larger than 1, the same set of inputs must be specified "
            "for each batch. You cannot use different set of optional inputs for each individual "
            "batch."
        )
    requests = []
    for indices in _batch_steps(info, len(steps), batch_size):
        chosen = [steps[index] for index in indices]
        request = {}
        for tensor in info.inputs:
            if tensor.name not in chosen[0]:
                continue
            parts = [step[tensor.name] for step in chosen]
            if len({p.shape for p in parts}) != 1:
                raise UsageError(
                    f"--input-data: input '{tensor.name}' has different shapes in the steps batched "
                    "together; use steps of one shape or -b 1"
                )
            request[tensor.name] = np.stack(parts)
        requests.append(request)
    return requests


def _named_paths(input_data: str | list[str]) -> list[str]:
    if input_data in ("zero", "random"):
        return []
    return [input_data] if isinstance(input_data, str) else list(input_data)


def data_directory(input_data: str | list[str]) -> str | None:
    """The directory ``--input-data`` names, if it names one (it then names nothing else)."""
    paths = _named_paths(input_data)
    return paths[0] if len(paths) == 1 and os.path.isdir(paths[0]) else None


def json_files(input_data: str | list[str]) -> list[str]:
    """The JSON data files ``--input-data`` names, in turn (none for generated data or a
    data directory)."""
    return [] if data_directory(input_data) is not None else _named_paths(input_data)


def make_requests(
    info: ModelInfo,
    batch_size: int,
    shapes: dict[str, list[int]],
    input_data: str | list[str],
    string_length: int = 128,
    string_data: str | None = None,
    seed: int | None = None,
) -> list[dict[str, np.ndarray]]:
    """The distinct requests to cycle through: input name -> array (with the batch dim
    when the model batches)."""
    check_batch(info, batch_size)
    directory = data_directory(input_data)
    if input_data in ("zero", "random"):
        dims = resolve_shapes(info, shapes)
        rng = np.random.default_rng(seed)
        step = {
            t.name: generated_tensor(t, dims[t.name], input_data == "zero", string_length, string_data, rng)
            for t in info.inputs
        }
        steps = [step]
    elif directory is not None:
        from dlserve.perf.input_dir import read_directory  # (it imports this module)

        steps = [read_directory(directory, info, resolve_shapes(info, shapes))]
    else:
        steps = [
            step for path in json_files(input_data) for step in load_json_steps(path, info, shapes)
        ]
    return _batched(info, steps, batch_size)


def expected_outputs(info: ModelInfo, batch_size: int,
                     input_data: str | list[str]) -> list[dict[str, bytes]] | None:
    """Each distinct request's expected outputs (as :func:`make_requests` orders them): the
    bytes of its steps' ``validation_data``, one step after the other; None when no file has
    any. The steps of a file without it expect nothing."""
    steps = [step for path in json_files(input_data) for step in load_validation(path, info)]
    if not any(steps):
        return None
    requests = []
    for indices in _batch_steps(info, len(steps), batch_size):
        chosen = [steps[index] for index in indices]
        requests.append({name: b"".join(step[name] for step in chosen)
                         for name in chosen[0] if all(name in step for step in chosen)})
    return requests


def raw_bytes(array: np.ndarray, datatype: str) -> bytes:
    """A tensor's bytes on the wire (binary tensor extension / raw_input_contents)."""
    if datatype == "BYTES":
        return serialize_bytes(array).tobytes()
    return np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
