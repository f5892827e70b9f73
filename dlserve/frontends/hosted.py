"""The protocols of managed hosting services, over the KServe API's handlers: Amazon
SageMaker (Triton's ``--allow-sagemaker``) and Google Vertex AI (``--allow-vertex-ai``),
as Triton 2.51 answers them (measured).

**SageMaker** (port 8080): ``GET /ping`` answers 200 (empty) when the server is ready
(``SAGEMAKER_TRITON_PING_MODE=live``: live), else 400; ``POST /invocations`` is a KServe
v2 inference request for the endpoint's model (``SAGEMAKER_TRITON_DEFAULT_MODEL_NAME``;
without it, a repository's only model, as Triton's SageMaker entry script picks it).
The binary extension is spelled in the content type,
``application/vnd.sagemaker-triton.binary+json;json-header-size=N``, both ways. Other
paths: 400, empty. Multi-model endpoints (``/models``...): :mod:`dlserve.frontends.sagemaker_models`.

**Vertex AI** (port ``AIP_HTTP_PORT``): the health route (``AIP_HEALTH_ROUTE``) answers
as ``/ping`` does; the predict route (``AIP_PREDICT_ROUTE``) is a KServe v2 inference
request for the default model (``--vertex-ai-default-model``, else the one loaded
model), the binary extension's request spelled
``application/vnd.vertex-ai-triton.binary+json;json-header-size=N`` (its responses are
KServe's). A predict request with ``X-Vertex-Ai-Triton-Redirect: <path>`` goes to that
KServe endpoint instead (``v2/models/m/ready``, ``v2/repository/index``, ``metrics``...;
not generate, trace or logging). Both routes are regular expressions, as Vertex AI
allows. Other paths: 400, empty.

Where dlserve differs: a body that is not JSON is a 400 (Triton: 500), and a
json-header-size that is not a number is refused (Triton reads it as 0: a raw body).
"""

from __future__ import annotations

import os
import re
from urllib.parse import unquote

from dlserve.engine import prometheus
from dlserve.errors import InvalidArgumentError, NotFoundError, TritonError
from dlserve.frontends.http_api import (
    HEADER_LENGTH,
    KServeHttpApi,
    empty,
    error_response,
    json_response,
)
from dlserve.frontends.http_server import HttpRequest, HttpResponse
from dlserve.frontends.sagemaker_models import ROUTE as MODELS_ROUTE
from dlserve.frontends.sagemaker_models import MultiModelEndpoint

SAGEMAKER_BINARY = "application/vnd.sagemaker-triton.binary+json"
VERTEX_BINARY = "application/vnd.vertex-ai-triton.binary+json"
_HEADER_SIZE = ";json-header-size="
DEFAULT_MODEL_VARIABLE = "SAGEMAKER_TRITON_DEFAULT_MODEL_NAME"
PING_MODE_VARIABLE = "SAGEMAKER_TRITON_PING_MODE"
REDIRECT_HEADER = "x-vertex-ai-triton-redirect"
# The KServe endpoints a Vertex AI redirect may reach (Triton's list).
_REDIRECTS = re.compile(
    r"/(?:metrics|v2|v2/health/(?:live|ready)|v2/models/stats"
    r"|v2/models/[^/]+(?:/versions/[^/]+)?(?:/(?:infer|ready|config|stats))?"
    r"|v2/(?:system|cuda)sharedmemory(?:/region/[^/]+)?/(?:status|register|unregister)"
    r"|v2/repository(?:/[^/]+)?/(?:index|models/[^/]+/(?:load|unload)))"
)


def _method_not_allowed() -> HttpResponse:
    return json_response({"error": "Method Not Allowed"}, 405)


class _HostedApi:
    """What both protocols share: health, and inference for one model with the binary
    extension's header length read from the content type."""

    binary_type = ""
    unnamed = ""  # how to name the model, for the error when there is none

    def __init__(self, api: KServeHttpApi, model: str, health_mode: str = "ready") -> None:
        self.api = api
        self.model = model
        self.health_mode = health_mode

    def health(self, request: HttpRequest) -> HttpResponse:
        if request.method != "GET":
            return _method_not_allowed()
        engine = self.api.engine
        return empty(200 if (engine.live if self.health_mode == "live" else engine.ready()) else 400)

    async def infer(self, request: HttpRequest, model: str | None = None) -> HttpResponse:
        """An inference request for ``model`` (default: the endpoint's model)."""
        if request.method != "POST":
            return _method_not_allowed()
        model = model or self.model
        try:
            if not model:
                raise NotFoundError(f"Request for unknown model: no model to serve ({self.unnamed})")
            self.api.engine.model(model)  # NOT_FOUND before the body is parsed, as Triton
            request.headers = self._binary_header(request)
            return await self.api.infer(request, {"model": model})
        except TritonError as exc:
            return error_response(exc)

    def _binary_header(self, request: HttpRequest) -> dict[str, str]:
        """The request's headers with the binary extension's header length taken from
        the content type (and no Inference-Header-Content-Length of its own)."""
        content_type = request.header("content-type")
        headers = {k: v for k, v in request.headers.items() if k != HEADER_LENGTH}
        if content_type.startswith(self.binary_type + _HEADER_SIZE):
            text = content_type[len(self.binary_type + _HEADER_SIZE) :].split(";", 1)[0].strip()
            try:  # ("+320" too, as Triton reads it)
                size = int(text)
            except ValueError:
                raise InvalidArgumentError(
                    f"json-header-size '{text}' in the content type is not a number"
                ) from None
            # Triton's words (an encoded body's size is checked once it is decoded)
            body_size = len(request.body)
            plain = request.header("content-encoding").strip().lower() in ("", "identity")
            if plain and not 0 <= size <= body_size:
                raise InvalidArgumentError(
                    f"inference header size should be in range (0, {body_size}), got: {size}"
                )
            headers[HEADER_LENGTH] = str(size)
        elif self.binary_type in content_type:
            raise InvalidArgumentError(
                f"content type must be '{self.binary_type}{_HEADER_SIZE}<bytes>' for a binary request"
            )
        return headers


class SageMakerApi(_HostedApi):
    binary_type = SAGEMAKER_BINARY
    unnamed = f"set {DEFAULT_MODEL_VARIABLE}"

    def __init__(self, api: KServeHttpApi, model: str, health_mode: str = "ready") -> None:
        super().__init__(api, model, health_mode)
        self.endpoint = MultiModelEndpoint(api.engine, self._invoke)

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.path == "/ping":
            return self.health(request)
        if request.path == "/invocations":
            return await self._invoke(request)
        found = MODELS_ROUTE.fullmatch(request.path)
        if found is not None:
            return await self.endpoint(request, unquote(found.group(1) or ""), bool(found.group(2)))
        return empty(400)

    async def _invoke(self, request: HttpRequest, model: str | None = None) -> HttpResponse:
        return _sagemaker_binary(await self.infer(request, model))


def _sagemaker_binary(response: HttpResponse) -> HttpResponse:
    """A KServe binary response in SageMaker's spelling."""
    length = next((v for k, v in response.headers if k.lower() == HEADER_LENGTH), None)
    if length is not None:
        response.headers = [(k, v) for k, v in response.headers if k.lower() != HEADER_LENGTH]
        response.content_type = f"{SAGEMAKER_BINARY}{_HEADER_SIZE}{length}"
    return response


def sagemaker_model(named: str | None, models: list[str]) -> str:
    """The SageMaker endpoint's model: the one named (or in
    SAGEMAKER_TRITON_DEFAULT_MODEL_NAME), else the repository's only model; "" when
    there is no telling."""
    name = named or os.environ.get(DEFAULT_MODEL_VARIABLE, "")
    if name:
        return name
    return models[0] if len(models) == 1 else ""


class VertexAiApi(_HostedApi):
    binary_type = VERTEX_BINARY
    unnamed = "set the default model"

    def __init__(self, api: KServeHttpApi, model: str, health_route: str, predict_route: str) -> None:
        super().__init__(api, model)
        try:
            self.health_route = re.compile(health_route)
            self.predict_route = re.compile(predict_route)
        except re.error as exc:
            raise InvalidArgumentError(f"Vertex AI route is not a valid regular expression: {exc}") from None

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        if self.health_route.fullmatch(request.path):
            return self.health(request)
        if not self.predict_route.fullmatch(request.path):
            return empty(400)
        target = request.header(REDIRECT_HEADER)
        if not target:
            return await self.infer(request)
        if request.method != "POST":
            return empty(405)
        path = "/" + target
        if not _REDIRECTS.fullmatch(path):
            return empty(400)
        if path == "/metrics":
            return HttpResponse(200, [prometheus.render(self.api.engine).encode()], prometheus.CONTENT_TYPE)
        methods = self.api.methods_of(path)
        if self.binary_type in request.header("content-type"):  # (an infer's binary tensors)
            try:
                request.headers = self._binary_header(request)
            except TritonError as exc:
                return error_response(exc)
        # Answered uncompressed, as Triton answers Vertex AI (its predict route never compresses)
        request.headers = {k: v for k, v in request.headers.items() if k != "accept-encoding"}
        request.path = path
        request.method = "POST" if methods is None or "POST" in methods else "GET"
        return await self.api(request)


def vertex_model(named: str | None, loaded: list[str]) -> str:
    """The Vertex AI endpoint's default model (Triton's rules: the one named must be
    loaded; unnamed, there must be exactly one loaded model)."""
    if named:
        if named not in loaded:
            raise InvalidArgumentError(f"Expect the default model '{named}' is loaded")
        return named
    if len(loaded) != 1:
        raise InvalidArgumentError(
            "Expect the model repository contains only a single model if default model is not specified"
        )
    return loaded[0]
