"""Requests encoded once, before the load starts; the hot loop only sends these bytes.

* HTTP: the whole request -- request line, headers and body -- with the binary tensor
  extension (JSON header, then the raw tensors; outputs asked for as binary), or with
  shared-memory references instead of data.
* gRPC: a serialized ``ModelInferRequest`` with ``raw_input_contents`` (or shared-memory
  parameters), sent through a generic call whose serializers are the identity.
"""

from __future__ import annotations

import dataclasses
import json
import math
from urllib.parse import quote

import numpy as np

from dlserve.memory.dtypes import DataType
from dlserve.perf.inputs import ModelInfo, TensorInfo, raw_bytes
from dlserve.perf.shm import Layout, ShmRef


@dataclasses.dataclass
class ShmPlan:
    """Where each request's inputs and each output live in the client's region: the output
    areas are shared by every request, or (``separate``) each request has its own."""

    layout: Layout
    inputs: list[dict[str, tuple[int, int]]]  # per request: name -> (offset, size)
    outputs: list[dict[str, tuple[int, int]]]  # one set, or one per request

    def refs(self, region: str) -> tuple[list[dict[str, ShmRef]], list[dict[str, ShmRef]]]:
        inputs = [{n: ShmRef(region, o, s) for n, (o, s) in req.items()} for req in self.inputs]
        outputs = [{n: ShmRef(region, o, s) for n, (o, s) in req.items()} for req in self.outputs]
        return inputs, outputs


def plan_shm(requests: list[dict[str, np.ndarray]], info: ModelInfo, output_size: int,
             separate: bool = False) -> ShmPlan:
    """``separate``: each request's outputs get areas of their own, so that what one
    request's answer left there can be read while others are on the way."""
    layout = Layout()
    types = {t.name: t.datatype for t in info.inputs}
    inputs = [
        {name: layout.add_blob(raw_bytes(array, types[name])) for name, array in request.items()}
        for request in requests
    ]
    batching = info.max_batch_size > 0 and requests and requests[0]
    batch = next(iter(requests[0].values())).shape[0] if batching else 1
    outputs = [
        {t.name: layout.add_area(_output_bytes(t, batch, output_size)) for t in info.outputs}
        for _ in range(len(requests) if separate else 1)
    ]
    return ShmPlan(layout, inputs, outputs)


def _output_bytes(tensor: TensorInfo, batch: int, given: int) -> int:
    """An output's region: what its fixed shape takes, as perf_analyzer sizes it; for a
    variable shape or BYTES, ``--output-shared-memory-size``."""
    if tensor.datatype == "BYTES" or any(d < 0 for d in tensor.dims):
        return given
    return batch * math.prod(tensor.dims) * DataType.from_wire(tensor.datatype).itemsize


def model_path(model: str, version: str) -> str:
    """``/v2/models/<model>[/versions/<version>]``, each part URL-quoted."""
    path = "/v2/models/" + quote(model, safe="")
    if version:
        path += "/versions/" + quote(version, safe="")
    return path


def _shm_parameters(ref: ShmRef) -> dict[str, object]:
    return {
        "shared_memory_region": ref.region,
        "shared_memory_byte_size": ref.byte_size,
        "shared_memory_offset": ref.offset,
    }


def json_data(array: np.ndarray) -> list[object]:
    """A tensor's values for a JSON request: flat, strings for BYTES."""
    if array.dtype == np.object_:
        return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in array.reshape(-1)]
    if array.dtype == np.float16:
        array = array.astype(np.float32)
    return array.reshape(-1).tolist()


def http_request(
    host: str,
    info: ModelInfo,
    version: str,
    inputs: dict[str, np.ndarray],
    shm_inputs: dict[str, ShmRef] | None = None,
    shm_outputs: dict[str, ShmRef] | None = None,
    parameters: dict[str, object] | None = None,
    json_inputs: bool = False,
    json_outputs: bool = False,
    headers: list[tuple[str, str]] | None = None,
) -> bytes:
    """One complete HTTP/1.1 request (keep-alive), ready for ``transport.write``.

    Tensors travel with Triton's binary extension unless ``json_inputs`` /
    ``json_outputs`` ask for plain KServe v2 JSON (servers without the extension).
    ``headers`` are added as given (``-H``).
    """
    types = {t.name: t.datatype for t in info.inputs}
    header_inputs = []
    blobs = []
    for name, array in inputs.items():
        entry: dict[str, object] = {"name": name, "shape": list(array.shape), "datatype": types[name]}
        if shm_inputs is not None:
            entry["parameters"] = _shm_parameters(shm_inputs[name])
        elif json_inputs:
            entry["data"] = json_data(array)
        else:
            blob = raw_bytes(array, types[name])
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        header_inputs.append(entry)
    outputs = []
    for tensor in info.outputs:
        if shm_outputs is not None:
            outputs.append({"name": tensor.name, "parameters": _shm_parameters(shm_outputs[tensor.name])})
        else:
            outputs.append({"name": tensor.name, "parameters": {"binary_data": not json_outputs}})
    document: dict[str, object] = {"inputs": header_inputs, "outputs": outputs}
    if parameters:
        document["parameters"] = parameters
    head = json.dumps(document, separators=(",", ":")).encode()
    body = head + b"".join(blobs)
    lines = [
        f"POST {model_path(info.name, version)}/infer HTTP/1.1",
        f"Host: {host}",
        f"Content-Length: {len(body)}",
    ]
    if blobs:
        lines.append("Content-Type: application/octet-stream")
        lines.append(f"Inference-Header-Content-Length: {len(head)}")
    else:
        lines.append("Content-Type: application/json")
    lines += [f"{name}: {value}" for name, value in headers or ()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def grpc_request(
    info: ModelInfo,
    version: str,
    inputs: dict[str, np.ndarray],
    shm_inputs: dict[str, ShmRef] | None = None,
    shm_outputs: dict[str, ShmRef] | None = None,
    parameters: dict[str, bool | int | str] | None = None,
) -> bytes:
    """A serialized ``inference.ModelInferRequest``."""
    from dlserve.frontends.proto import grpc_service_pb2 as pb

    types = {t.name: t.datatype for t in info.inputs}
    request = pb.ModelInferRequest(model_name=info.name, model_version=version)
    for key, value in (parameters or {}).items():
        _set_parameter(request.parameters[key], value)
    for name, array in inputs.items():
        tensor = request.inputs.add(name=name, datatype=types[name], shape=list(array.shape))
        if shm_inputs is not None:
            _shm_grpc(tensor.parameters, shm_inputs[name])
        else:
            request.raw_input_contents.append(raw_bytes(array, types[name]))
    for output in info.outputs:
        requested = request.outputs.add(name=output.name)
        if shm_outputs is not None:
            _shm_grpc(requested.parameters, shm_outputs[output.name])
    return request.SerializeToString()


def _set_parameter(parameter: object, value: bool | int | str) -> None:
    if isinstance(value, bool):
        parameter.bool_param = value  # type: ignore[attr-defined]
    elif isinstance(value, int) and value >= 2**63:  # (a sequence ID may use all 64 bits)
        parameter.uint64_param = value  # type: ignore[attr-defined]
    elif isinstance(value, int):
        parameter.int64_param = value  # type: ignore[attr-defined]
    else:
        parameter.string_param = str(value)  # type: ignore[attr-defined]


def _shm_grpc(parameters: object, ref: ShmRef) -> None:
    params = parameters  # a protobuf map<string, InferParameter>
    params["shared_memory_region"].string_param = ref.region  # type: ignore[index]
    params["shared_memory_byte_size"].int64_param = ref.byte_size  # type: ignore[index]
    params["shared_memory_offset"].int64_param = ref.offset  # type: ignore[index]
