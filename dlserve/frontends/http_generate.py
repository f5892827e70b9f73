"""Triton's generate extension: ``/generate`` and ``/generate_stream`` (server-sent events).

One flat JSON object in — keys naming model inputs become tensors (those inside
``parameters`` too, as Triton reads them: LLM clients put inputs such as
``max_tokens`` there), the other members of ``parameters`` are request parameters,
anything else is a parameter too — and for each response
one flat JSON object out, outputs as plain JSON values. This is the shape LLM
clients (LangChain, OpenAI-style proxies) speak. ``generate`` answers a model with
exactly one response; ``generate_stream`` sends every response as an SSE ``data:``
event as it is produced, so it serves decoupled models, and a client that
disconnects cancels its request.
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator
from typing import Any

import numpy as np
import orjson

from dlserve.engine.request import Request, Response, TensorSpec
from dlserve.errors import InvalidArgumentError
from dlserve.frontends import json_values
from dlserve.frontends.dataplane import DataPlane, InputSpec, parse_version
from dlserve.frontends.http_server import HttpRequest, HttpResponse, decode_body
from dlserve.memory.tensor import Tensor

EVENT_STREAM = "text/event-stream; charset=utf-8"


def _shape(dims: tuple[int, ...], count: int, batching: bool) -> list[int]:
    """The config's dims with a wildcard filled in from ``count`` values (or [count]);
    for a batching model, a batch dimension first: as many as the values fill fixed
    dims (Triton's reading), else one."""
    known = math.prod(d for d in dims if d != -1)
    wildcards = sum(1 for d in dims if d == -1)
    if wildcards == 0 and known and count % known == 0 and (batching or known == count):
        return [count // known, *dims] if batching else list(dims)
    if wildcards == 1 and known and count % known == 0:
        shape = [count // known if d == -1 else d for d in dims]
    else:
        shape = [count]
    return [1, *shape] if batching else shape


def _input(name: str, spec: TensorSpec, value: Any, batching: bool) -> InputSpec:
    """A JSON value (a scalar or a possibly nested list) as an input of the model."""
    try:
        array = json_values.from_json(spec.data_type, value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidArgumentError(f"generate: input '{name}': {exc}") from None
    shape = _shape(spec.dims, array.size, batching)
    return InputSpec(name, spec.data_type.wire_name, shape, array=array.reshape(shape))


def _json_value(tensor: Tensor) -> Any:
    """One element as a scalar, anything else as a flat list."""
    values = json_values.to_json(tensor)
    if isinstance(values, json_values.NonFinite):
        return json_values.NonFinite(values.values, scalar=len(values.values) == 1)
    if isinstance(values, np.ndarray):
        values = values.tolist()
    return values[0] if len(values) == 1 else values


class GenerateApi:
    """The two generate routes over the shared data plane."""

    def __init__(self, dataplane: DataPlane) -> None:
        self.dataplane = dataplane
        self.engine = dataplane.engine

    def _request(self, request: HttpRequest, args: dict[str, str]) -> Request:
        model = self.engine.model(args["model"], parse_version(args.get("version")))
        body = decode_body(request)
        document = json_values.parse_object(body)
        signature = model.signature
        repeated = json_values.repeated_keys(body, signature.inputs)
        if repeated:  # (Triton's words)
            raise InvalidArgumentError(f"input '{repeated[0]}' already exists in request")
        given = document.get("parameters")
        named_inputs: dict[str, Any] = {}
        if isinstance(given, dict) and any(key in signature.inputs for key in given):
            named_inputs = {k: v for k, v in given.items() if k in signature.inputs}
            document = {**document, "parameters": {k: v for k, v in given.items() if k not in named_inputs}}
        request_id, parameters = json_values.id_and_parameters(document)
        parameters = dict(parameters)
        batching = signature.max_batch_size > 0
        values: dict[str, Any] = {}
        for key, value in document.items():
            if key == "parameters":
                continue
            if key in signature.inputs:
                values[key] = value
            else:
                parameters[key] = value  # not an input: a parameter ("id" too, as in Triton)
        for key, value in named_inputs.items():
            if key in values:  # (Triton's words)
                raise InvalidArgumentError(f"input '{key}' already exists in request")
            values[key] = value
        inputs = [_input(key, signature.inputs[key], value, batching) for key, value in values.items()]
        built = self.dataplane.build_request(
            model.name, model.version, request_id, parameters, inputs, None
        )
        built.trace_context = self.dataplane.trace_context(request.headers.items())
        return built

    def _stream(self, request: HttpRequest, args: dict[str, str]) -> AsyncGenerator[Response, None]:
        traced = request.traced if self.engine.tracer.enabled else None
        return self.dataplane.stream(self._request(request, args), traced)

    async def generate(self, request: HttpRequest, args: dict[str, str]) -> HttpResponse:
        answers: list[Response] = []
        responses = self._stream(request, args)
        try:
            async for response in responses:
                if response.error is not None:
                    # Triton: the model's error is the request's fault, whatever its code.
                    return HttpResponse(400, [orjson.dumps({"error": response.error.message})])
                if not response.flags_only:
                    answers.append(response)
        finally:
            await responses.aclose()
        if len(answers) != 1:
            # Triton answers this with status 200; an error status says what it is.
            raise InvalidArgumentError(
                "generate expects model to produce exactly 1 response, use generate stream "
                "for model that generates various number of responses"
            )
        return HttpResponse(200, [_flat(answers[0])])


    async def generate_stream(self, request: HttpRequest, args: dict[str, str]) -> HttpResponse:
        """Server-sent events, one per response. The status waits for the first
        response: an error there makes it a 400; every error comes as an
        ``{"error": ...}`` event, and the responses after it follow (as in Triton)."""
        responses = self._stream(request, args)
        try:
            first = await anext(responses)
        except BaseException:
            await responses.aclose()
            raise
        return HttpResponse(
            400 if first.error is not None else 200,
            content_type=EVENT_STREAM,
            headers=[("Cache-Control", "no-cache")],
            stream=self._events(first, responses),
        )

    async def _events(
        self, first: Response, responses: AsyncGenerator[Response, None]
    ) -> AsyncGenerator[bytes, None]:
        try:
            if not first.flags_only:
                yield _event(first)
            async for response in responses:
                if not response.flags_only:
                    yield _event(response)
        finally:
            await responses.aclose()  # a client that went away cancels the request


def _event(response: Response) -> bytes:
    if response.error is not None:
        return b"data: " + orjson.dumps({"error": response.error.message}) + b"\n\n"
    return b"data: " + _flat(response) + b"\n\n"


def _flat(response: Response) -> bytes:
    """One response as Triton's generate renders it: a flat object of its outputs and
    parameters (an ensemble's sequence fields), keys sorted (an output named like a
    member of the response's own gives way to it)."""
    result: dict[str, Any] = {name: _json_value(tensor) for name, tensor in response.outputs.items()}
    result.update(response.parameters)
    result["model_name"] = response.model_name
    result["model_version"] = str(response.model_version)
    if response.request_id:
        result["id"] = response.request_id
    return json_values.dumps(result, sort_keys=True)
