"""The KServe v2 REST API with Triton's extensions, over :mod:`http_server`.

Paths, JSON shapes, the binary tensor extension (``Inference-Header-Content-Length``,
``binary_data``, ``binary_data_size``, ``binary_data_output``, raw binary requests with
a header length of 0), shared-memory
references, restricted API categories and the error body ``{"error": "..."}`` follow
Triton's HTTP frontend. Status codes come from the error's Triton code (see
:data:`STATUS`); nothing below the frontends knows about HTTP.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import re
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote

import numpy as np
import orjson

from dlserve.engine.request import Response
from dlserve.errors import ErrorCode, InvalidArgumentError, TritonError, UnsupportedError
from dlserve.frontends import json_values
from dlserve.frontends.dataplane import (
    CLASSIFICATION,
    DataPlane,
    InputSpec,
    OutputSpec,
    forward_pattern,
    parse_version,
    shm_ref,
)
from dlserve.frontends.http_generate import GenerateApi
from dlserve.frontends.http_server import HttpRequest, HttpResponse, decode_body, encode_body
from dlserve.frontends.restrictions import Restriction, rules_by_category
from dlserve.memory.dtypes import DataType

STATUS = {
    ErrorCode.INTERNAL: 500,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.UNSUPPORTED: 501,
    ErrorCode.UNKNOWN: 400,
    ErrorCode.INVALID_ARG: 400,
    ErrorCode.ALREADY_EXISTS: 400,
    ErrorCode.CANCELLED: 400,
}
HEADER_LENGTH = "inference-header-content-length"


def json_response(obj: Any, status: int = 200) -> HttpResponse:
    return HttpResponse(status, [orjson.dumps(obj)])


log = logging.getLogger(__name__)
# Triton's verbose "HTTP request: <method> <path>" line numbers methods as its HTTP library does.
_METHOD_CODES = {"GET": 0, "HEAD": 1, "POST": 2, "PUT": 3, "DELETE": 4, "OPTIONS": 8, "TRACE": 13, "PATCH": 15}


def error_response(error: TritonError) -> HttpResponse:
    return json_response({"error": error.message}, STATUS.get(error.code, 500))


def empty(status: int) -> HttpResponse:
    return HttpResponse(status, [], "text/plain")


Route = Callable[[HttpRequest, dict[str, str]], Awaitable[HttpResponse]]


class KServeHttpApi:
    """Routes requests to handlers; one instance per HTTP service."""

    def __init__(
        self,
        dataplane: DataPlane,
        restrictions: list[Restriction] | None = None,
        header_forward_pattern: str = "",
    ) -> None:
        self.dataplane = dataplane
        self.engine = dataplane.engine
        self.rules = rules_by_category(restrictions or [])
        self.forward = forward_pattern(header_forward_pattern)
        generate = GenerateApi(dataplane)
        model = r"/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?"
        shm = r"(?:/region/(?P<region>[^/]+))?"
        table: list[tuple[str, set[str], str, Route]] = [
            (r"/v2/health/live", {"GET"}, "health", self.live),
            (r"/v2/health/ready", {"GET"}, "health", self.ready),
            (r"/v2", {"GET"}, "metadata", self.server_metadata),
            # before the model routes: "/v2/models/stats" is all models' statistics
            (r"/v2/models(?:/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?)?/stats", {"GET"}, "statistics", self.statistics),
            (model, {"GET"}, "metadata", self.model_metadata),
            (model + "/ready", {"GET"}, "health", self.model_ready),
            (model + "/config", {"GET"}, "model-config", self.model_config),
            (model + "/infer", {"POST"}, "inference", self.infer),
            (model + "/generate", {"POST"}, "inference", generate.generate),
            (model + "/generate_stream", {"POST"}, "inference", generate.generate_stream),
            (r"/v2/repository(?:/(?P<repo>[^/]+))?/index", {"POST"}, "model-repository", self.index),
            (r"/v2/repository(?:/(?P<repo>[^/]+))?/models/(?P<model>[^/]+)/load", {"POST"}, "model-repository", self.load),
            (r"/v2/repository(?:/(?P<repo>[^/]+))?/models/(?P<model>[^/]+)/unload", {"POST"}, "model-repository", self.unload),
            (r"/v2/systemsharedmemory" + shm + "/status", {"GET"}, "shared-memory", self.system_status),
            (r"/v2/systemsharedmemory" + shm + "/register", {"POST"}, "shared-memory", self.system_register),
            (r"/v2/systemsharedmemory" + shm + "/unregister", {"POST"}, "shared-memory", self.system_unregister),
            (r"/v2/cudasharedmemory" + shm + "/status", {"GET"}, "shared-memory", self.cuda_status),
            (r"/v2/cudasharedmemory" + shm + "/register", {"POST"}, "shared-memory", self.cuda_register),
            (r"/v2/cudasharedmemory" + shm + "/unregister", {"POST"}, "shared-memory", self.cuda_unregister),
            (r"/v2/logging", {"GET", "POST"}, "logging", self.logging),
            (r"/v2(?:/models/(?P<model>[^/]+))?/trace/setting", {"GET", "POST"}, "trace", self.trace_setting),
        ]
        self._routes = [(re.compile(f"^{p}$"), methods, category, fn) for p, methods, category, fn in table]
        self._matched: dict[str, tuple[set[str], str, Route, dict[str, str]]] = {}

    def methods_of(self, path: str) -> set[str] | None:
        """The methods ``path`` takes (None: no such endpoint)."""
        found = self._route(path)
        return None if found is None else found[0]

    def _route(self, path: str) -> tuple[set[str], str, Route, dict[str, str]] | None:
        cached = self._matched.get(path)
        if cached is not None:
            return cached
        for pattern, methods, category, route in self._routes:
            match = pattern.match(path)
            if match is not None:
                # Routed on the path as sent, its parts decoded after: an encoded '/' in a
                # model name (%2F) is part of the name, never a separator.
                args = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
                found = (methods, category, route, args)
                # Clients reuse a handful of paths; a long one (a path may be 64 KiB) is
                # matched anew rather than pinned for good.
                if len(self._matched) < 4096 and len(path) <= 256:
                    self._matched[path] = found
                return found
        return None

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        if log.isEnabledFor(logging.DEBUG):  # (--log-verbose 1, in Triton's words)
            log.debug("HTTP request: %d %s", _METHOD_CODES.get(request.method, 16), request.path)
        found = self._route(request.path)
        if found is None:
            return json_response({"error": "Not Found"}, 404)
        methods, category, route, args = found
        if request.method not in methods:
            return json_response({"error": "Method Not Allowed"}, 405)
        if self.rules[category]:
            denied = self._restricted(category, request)
            if denied is not None:
                return denied
        try:
            response = await route(request, args)
        except TritonError as exc:
            return error_response(exc)
        # Like Triton, only successful inference responses are compressed: tritonclient's
        # aio client decompresses only those itself (it reads an error body as it is).
        return encode_body(request, response) if route == self.infer and response.status == 200 else response

    def _restricted(self, category: str, request: HttpRequest) -> HttpResponse | None:
        for rule in self.rules[category]:
            if request.header(rule.header) != rule.value:
                return json_response(
                    {"error": f"This API is restricted, expecting header '{rule.header}'"}, 403
                )
        return None

    # -- health and metadata ------------------------------------------------------------
    async def live(self, request: HttpRequest, args: dict[str, str]) -> HttpResponse:
        return empty(200 if self.engine.live else 400)

    async def ready(self, request: HttpRequest, args: dict[str, str]) -> HttpResponse:
        return empty(200 if self.engine.ready() else 400)

    async def server_metadata(self, request: HttpRequest, args: dict[str, str]) -> HttpResponse:
        return json_response(self.engine.metadata())

    async def model_metadata(self, request: HttpRequest, args: dict[str, str]) -> HttpResponse:
        return json_response(self.engine.model_metadata(args["model"], _version(args)))

    async def model_ready(self, request: HttpRequest, args: dict[str, str]) -> HttpResponse:
        if await self.engine.model_ready(args["model"], _version(args)):
            return empty(200)
        return json_response({"error": "Model version not ready"}, 400)

    async def model_config(self, request: HttpRequest, args: dict[str, str]) -> HttpResponse:
        return json_response(self.engine.model_config(args["model"], _version(args)))

    async def statistics(self, request: HttpRequest, args: dict[str, str]) -> HttpResponse:
        return json_response(self.engine.statistics(args.get("model", ""), _version(args)))

    # -- model repository ---------------------------------------------------------------
    async def index(self, request: HttpRequest, args: dict[str, str]) -> HttpResponse:
        body = json_object(request, allow_empty=True)
        ready = body.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidArgumentError("'ready' must be a boolean")
        return json_response(await self.engine.repository_index(ready))

    async def load(self, request: HttpRequest, args: dict[str, str]) -> HttpResponse:
        parameters = json_object(request, allow_empty=True).get("parameters") or {}
        if not isinstance(parameters, dict):
            raise InvalidArgumentError("'parameters' must be an object")
        decoded: dict[str, Any] = {}
        for key, value in parameters.items():
            if key.startswith("file:"):
                if not isinstance(value, str):
                    raise InvalidArgumentError(f"'{key}' must be a base64 string")
                try:
                    decoded[key] = base64.b64decode(value, validate=True)
                except ValueError:
                    raise InvalidArgumentError(f"'{key}' is not valid base64") from None
            elif key == "config":
                decoded[key] = value if isinstance(value, str) else json.dumps(value)
            else:
                decoded[key] = value
        # Shielded: a client that goes away does not cancel it halfway; as Triton's, it
        # completes. (An unload needs none: it returns once it began, without a pause.)
        await asyncio.shield(self.engine.load(args["model"], decoded))
        return empty(200)  # as Triton: no body

    async def unload(self, request: HttpRequest, args: dict[str, str]) -> HttpResponse:
        parameters = json_object(request, allow_empty=True).get("parameters") or {}
        dependents = parameters.get("unload_dependents", False) if isinstance(parameters, dict) else False
        if not isinstance(dependents, bool):
            raise InvalidArgumentError("'unload_dependents' must be a boolean")
        await self.engine.unload(args["model"], dependents, wait=False)  # (as Triton: at once)
        return empty(200)  # as Triton: no body

    # -- shared memory --------------------------------------------------------------------
    async def system_status(self, request: HttpRequest, args: dict[str, str]) -> HttpResponse:
        return json_response(self.dataplane.system_shm_status(args.get("region")))

    async def system_register(self, request: HttpRequest, args: dict[str, str]) -> HttpResponse:
        region = _region_to_register(args, "system")
        body = json_object(request)
        key = body.get("key")
        offset = body.get("offset", 0)
        byte_size = body.get("byte_size")
        if not isinstance(key, str) or not _is_count(offset) or not _is_count(byte_size):
            raise InvalidArgumentError("register needs 'key' (string), 'offset' and 'byte_size' (integers)")
        self.dataplane.register_system_shm(region, key, offset, byte_size)
        return empty(200)  # as Triton: no body

    async def system_unregister(self, request: HttpRequest, args: dict[str, str]) -> HttpResponse:
        self.dataplane.unregister_system_shm(args.get("region"))
        return empty(200)  # as Triton: no body

    async def cuda_status(self, request: HttpRequest, args: dict[str, str]) -> HttpResponse:
        return json_response(self.dataplane.cuda_shm_status(args.get("region")))

    async def cuda_register(self, request: HttpRequest, args: dict[str, str]) -> HttpResponse:
        region = _region_to_register(args, "cuda")
        body = json_object(request)
        handle = body.get("raw_handle", {})
        raw = handle.get("b64") if isinstance(handle, dict) else None
        device_id, byte_size = body.get("device_id", 0), body.get("byte_size", 0)
        if not isinstance(raw, str) or not _is_count(device_id) or not _is_count(byte_size):
            raise InvalidArgumentError(
                "register needs 'raw_handle': {'b64': <base64 handle>}, 'device_id' and 'byte_size'"
            )
        try:
            raw = base64.b64decode(raw, validate=True)
        except ValueError:
            raise InvalidArgumentError("'raw_handle.b64' is not valid base64") from None
        self.dataplane.register_cuda_shm(region, raw, device_id, byte_size)
        return empty(200)  # as Triton: no body

    async def cuda_unregister(self, request: HttpRequest, args: dict[str, str]) -> HttpResponse:
        self.dataplane.unregister_cuda_shm(args.get("region"))
        return empty(200)  # as Triton: no body

    # -- logging --------------------------------------------------------------------------
    async def logging(self, request: HttpRequest, args: dict[str, str]) -> HttpResponse:
        settings = self.engine.settings.log
        if request.method == "POST":
            settings.update(json_object(request))
        return json_response(settings.as_dict())

    # -- trace ----------------------------------------------------------------------------
    async def trace_setting(self, request: HttpRequest, args: dict[str, str]) -> HttpResponse:
        tracer, model = self.engine.tracer, args.get("model")
        if request.method == "POST":
            return json_response(tracer.update(model, json_object(request, allow_empty=True)))
        return json_response(tracer.settings(model))

    # -- inference ------------------------------------------------------------------------
    async def infer(self, request: HttpRequest, args: dict[str, str]) -> HttpResponse:
        model = self.engine.model(args["model"], _version(args))
        if model.decoupled:
            raise UnsupportedError(
                "HTTP end point doesn't support models with decoupled transaction policy"
            )
        header, binary = _split_body(request)
        inputs: list[InputSpec]
        outputs: list[OutputSpec] | None = None
        if header is None:  # a raw binary request: the body is the model's one input
            request_id, parameters = "", {}
            inputs = [_raw_input(model.name, model.config, binary)]
        else:
            body = json_values.parse_object(header)
            request_id, parameters = json_values.id_and_parameters(body)
            json_values.check_infer_parameters(parameters)
            inputs = _decode_inputs(json_values.member(body, "inputs", list), binary, request_id)
            if "outputs" in body:
                outputs = _decode_outputs(json_values.member(body, "outputs", list))
        # (consumed here: the model does not see it, as with Triton's HTTP frontend)
        binary_default = header is None or bool(parameters.pop("binary_data_output", False))
        forwarded = []
        if self.forward is not None:
            for key, value in request.headers.items():
                name = request.header_names.get(key, key)  # (the model sees it as sent)
                if not key.startswith("_") and self.forward.search(name):
                    forwarded.append((name, value))
        engine_request = self.dataplane.build_request(
            args["model"], args.get("version"), request_id, parameters, inputs, outputs, forwarded
        )
        engine_request.trace_context = self.dataplane.trace_context(request.headers.items())
        traced = request.traced if self.engine.tracer.enabled else None
        response = await self.dataplane.infer(engine_request, traced)
        if response.error is not None:
            return error_response(response.error)
        response = self.dataplane.finished(response, outputs or [])
        return _encode_response(response, outputs or [], binary_default)


# -- request decoding -----------------------------------------------------------------------
def _version(args: dict[str, str]) -> int:
    return parse_version(args.get("version"))


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def json_object(request: HttpRequest, allow_empty: bool = False) -> dict[str, Any]:
    body = decode_body(request)
    if not len(body) and allow_empty:
        return {}
    return json_values.parse_object(body)


def _split_body(request: HttpRequest) -> tuple[Any, np.ndarray]:
    """(JSON header, binary tail as a uint8 array) per Inference-Header-Content-Length;
    a header length of 0 (a raw binary request) gives (None, the body)."""
    body = decode_body(request)
    data = body if isinstance(body, np.ndarray) else np.frombuffer(body, dtype=np.uint8)
    length_text = request.header(HEADER_LENGTH)
    if not length_text:  # (an empty body is a raw one, as Triton takes it)
        return (data, data[:0]) if data.nbytes else (None, data)
    if not (length_text.isascii() and length_text.isdigit()):  # (int() takes " +1_0", "١")
        raise InvalidArgumentError(f"invalid Inference-Header-Content-Length '{length_text}'")
    length = int(length_text)
    if length == 0:
        return None, data
    if length < 0 or length > data.nbytes:
        raise InvalidArgumentError(
            f"Inference-Header-Content-Length {length} is outside the {data.nbytes}-byte body"
        )
    return data[:length], data[length:]


def _raw_input(model: str, config: Any, data: np.ndarray) -> InputSpec:
    """A raw binary request's one input, as Triton deduces it: the data type and dims
    of the model's only input (a batch of 1 in front if the model batches), one
    variable dimension deduced from the size; BYTES only for dims [1], the whole body
    being its one element."""
    if len(config.input) != 1:  # (Triton's words)
        raise InvalidArgumentError(
            "[request id: <id_unknown>] Raw request must only have 1 input (found 1) to be deduced "
            f"but got {len(config.input)} inputs in '{model}' model configuration"
        )
    spec = config.input[0]
    data_type = DataType(spec.data_type)
    dims = [int(d) for d in spec.dims]
    batch = [1] if config.max_batch_size > 0 else []
    if data_type is DataType.BYTES:
        if dims != [1]:
            raise InvalidArgumentError(
                f"For BYTE datatype raw input '{spec.name}', the model must have input shape [1]"
            )
        array = np.empty(1, dtype=np.object_)
        array[0] = data.tobytes()
        return InputSpec(spec.name, data_type.wire_name, [*batch, 1], array=array)
    variable = [i for i, d in enumerate(dims) if d < 0]
    if len(variable) > 1:
        raise InvalidArgumentError(  # (Triton's words)
            f"[request id: <id_unknown>] The shape of the raw input '{spec.name}' can not be deduced "
            "because there are more than one variable-sized dimension"
        )
    row = data_type.itemsize * math.prod(d for d in dims if d >= 0)
    if variable and row:
        dims[variable[0]] = data.nbytes // row
    expected = math.prod(dims) * data_type.itemsize
    if expected != data.nbytes:
        raise InvalidArgumentError(
            f"input byte size mismatch for raw input '{spec.name}' for model '{model}'. "
            f"Expected {expected}, got {data.nbytes}"
        )
    return InputSpec(spec.name, data_type.wire_name, [*batch, *dims], raw=data)


def _decode_inputs(raw_inputs: list[Any], binary: np.ndarray, request_id: str) -> list[InputSpec]:
    label = f"[request id: {request_id or '<id_unknown>'}] "
    specs = []
    position = 0
    for item in raw_inputs:
        if not isinstance(item, dict):
            raise InvalidArgumentError("each input must be a JSON object")
        name = json_values.member(item, "name", str)
        datatype = json_values.member(item, "datatype", str)
        shape = json_values.member(item, "shape", list)
        if not all(_is_count(d) for d in shape):
            raise InvalidArgumentError(f"{label}input '{name}': shape must be non-negative integers")
        parameters = json_values.object_field(item.get("parameters"), f"parameters of input '{name}'")
        ref = shm_ref(parameters, f"input '{name}'")
        size = parameters.get("binary_data_size")
        has_data = "data" in item
        given = [
            field for field, is_set in
            (("data", has_data), ("binary_data_size", size is not None),
             ("shared_memory_region", ref is not None))
            if is_set
        ]
        if len(given) != 1:  # (Triton's words)
            raise InvalidArgumentError(
                "Input must set only one of the following fields: 'data', 'binary_data_size' in "
                "'parameters', 'shared_memory_region' in 'parameters'. But "
                + ("set " + " ".join(f"'{field}'" for field in given) if given else "no field is set")
            )
        spec = InputSpec(name, datatype, shape, shm=ref)
        if size is not None:
            if not _is_count(size):
                raise InvalidArgumentError(f"input '{name}': 'binary_data_size' must be a non-negative integer")
            if position + size > binary.nbytes:
                raise InvalidArgumentError(
                    f"unexpected end of binary data: input '{name}' needs {size} bytes at offset "
                    f"{position}, the body has {binary.nbytes}"
                )
            spec.raw = binary[position : position + size]
            position += size
        elif has_data:
            if not isinstance(item["data"], list):
                raise InvalidArgumentError(f"{label}input '{name}': 'data' must be a JSON array")
            spec.array = _json_data(name, datatype, shape, item["data"], label)
        specs.append(spec)
    if position != binary.nbytes:
        raise InvalidArgumentError(
            f"the request has {binary.nbytes - position} bytes of binary data no input claims"
        )
    return specs


def _json_data(name: str, datatype: str, shape: list[int], data: Any, label: str) -> np.ndarray:
    """JSON ``data`` as a flat array of the input's type (see :mod:`json_values`)."""
    try:
        data_type = DataType.from_wire(datatype)
    except ValueError:
        raise InvalidArgumentError(f"invalid datatype for input {name}") from None
    try:
        array = json_values.from_json(data_type, data)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidArgumentError(f"{label}Unable to parse 'data' of input '{name}': {exc}") from None
    count = math.prod(shape)
    if array.size != count:
        raise InvalidArgumentError(  # (Triton's words, which its QA greps, then which input and why)
            f"{label}Unable to parse 'data': Shape does not match true shape of 'data' field "
            f"(input '{name}' has {array.size} elements, shape {shape} needs {count})"
        )
    return array


def _region_to_register(args: dict[str, str], kind: str) -> str:
    """The region named in a register path (Triton's words without one, and its 400)."""
    region = args.get("region")
    if not region:
        raise InvalidArgumentError(
            f"'region name' is necessary to register {kind} shared memory region"
        )
    return region


def _decode_outputs(raw: list[Any]) -> list[OutputSpec]:
    """The outputs a JSON request asks for; an output named twice is answered as its
    first entry asks (as Triton's HTTP frontend does: into shared memory or not)."""
    specs: dict[str, OutputSpec] = {}
    for item in raw:
        if not isinstance(item, dict):
            raise InvalidArgumentError("each requested output must be a JSON object")
        name = json_values.member(item, "name", str)
        parameters = json_values.object_field(item.get("parameters"), f"parameters of output '{name}'")
        binary = parameters.get("binary_data")
        if binary is not None and not isinstance(binary, bool):
            raise InvalidArgumentError(f"output '{name}': 'binary_data' must be a boolean")
        ref = shm_ref(parameters, f"output '{name}'")
        if ref is not None and binary:
            raise InvalidArgumentError("Output can't set both 'shared_memory_region' and 'binary_data'")
        if CLASSIFICATION in parameters:
            count = parameters[CLASSIFICATION]
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise InvalidArgumentError(  # Triton's words (with its 500)
                    f"Unable to set '{CLASSIFICATION}': attempt to access JSON "
                    "non-unsigned-integer as unsigned-integer"
                )
            if count == 0:  # as Triton: no classification
                parameters = {k: v for k, v in parameters.items() if k != CLASSIFICATION}
            elif ref is not None:
                raise InvalidArgumentError(
                    f"Output can't set both 'shared_memory_region' and '{CLASSIFICATION}'"
                )
        specs.setdefault(name, OutputSpec(name, parameters, ref))
    return list(specs.values())


# -- response encoding -------------------------------------------------------------------------
def _encode_response(response: Response, outputs: list[OutputSpec], binary_default: bool) -> HttpResponse:
    wanted = {spec.name: spec for spec in outputs}
    result: dict[str, Any] = {}
    if response.request_id:
        result["id"] = response.request_id
    result["model_name"] = response.model_name
    result["model_version"] = str(response.model_version)
    if response.parameters:
        result["parameters"] = response.parameters
    entries = []
    buffers: list[Any] = []
    for name, tensor in response.outputs.items():
        spec = wanted.get(name)
        entry: dict[str, Any] = {
            "name": name,
            "datatype": tensor.data_type.wire_name,
            "shape": list(tensor.shape),
        }
        if spec is not None and spec.shm is not None:
            pass  # written into the client's region: like Triton, no data and no parameters
        # A listed output is binary only if it says so: Triton 2.51 reads the request's
        # binary_data_output only when no outputs are listed.
        elif (spec.parameters.get("binary_data", False) if spec else binary_default):
            data = tensor.storage()
            entry["parameters"] = {"binary_data_size": int(data.nbytes)}
            buffers.append(data.reshape(-1).view(np.uint8) if data.nbytes else b"")
        else:
            entry["data"] = json_values.to_json(tensor)
        entries.append(entry)
    result["outputs"] = entries
    header = json_values.dumps(result)
    if not any(len(buffer) for buffer in buffers):  # (binary outputs of 0 bytes: JSON, as Triton)
        return HttpResponse(200, [header])
    return HttpResponse(
        200,
        [header, *buffers],
        "application/octet-stream",
        [("Inference-Header-Content-Length", str(len(header)))],
    )
