"""Amazon SageMaker's inference protocol, as Triton's ``--allow-sagemaker`` serves it
(measured against Triton 2.51): a SageMaker container answers ``GET /ping`` and
``POST /invocations`` on port 8080.

* ``/ping``: 200 with an empty body when the server is ready (``SAGEMAKER_TRITON_PING_MODE
  =live``: when it is live), else 400.
* ``/invocations``: a KServe v2 inference request for the endpoint's model
  (``SAGEMAKER_TRITON_DEFAULT_MODEL_NAME``), answered as ``/v2/models/<it>/infer``
  answers. The binary tensor extension is spelled in the content type:
  ``application/vnd.sagemaker-triton.binary+json;json-header-size=N`` instead of an
  ``Inference-Header-Content-Length`` header, both ways.
* Any other path: 400 with an empty body, as in Triton.

Where no model is named, a server whose repository holds exactly one model serves it
(what Triton's SageMaker entry script does before starting the server). A body that
is not JSON is a 400 (Triton 2.51: 500). The multi-model endpoint routes
(``/models``...) are not served.
"""

from __future__ import annotations

import os

from dlserve.errors import InvalidArgumentError, NotFoundError, TritonError
from dlserve.frontends.http_api import HEADER_LENGTH, KServeHttpApi, empty, error_response, json_response
from dlserve.frontends.http_server import HttpRequest, HttpResponse

BINARY_JSON = "application/vnd.sagemaker-triton.binary+json"
_HEADER_SIZE = ";json-header-size="
DEFAULT_MODEL_VARIABLE = "SAGEMAKER_TRITON_DEFAULT_MODEL_NAME"
PING_MODE_VARIABLE = "SAGEMAKER_TRITON_PING_MODE"


class SageMakerApi:
    """``/ping`` and ``/invocations`` over the KServe API's inference."""

    def __init__(self, api: KServeHttpApi, model: str, ping_mode: str = "ready") -> None:
        if ping_mode not in ("ready", "live"):
            raise InvalidArgumentError(f"SageMaker ping mode must be 'ready' or 'live', got '{ping_mode}'")
        self.api = api
        self.model = model
        self.ping_mode = ping_mode

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.path == "/ping":
            if request.method != "GET":
                return json_response({"error": "Method Not Allowed"}, 405)
            engine = self.api.engine
            healthy = engine.live if self.ping_mode == "live" else engine.ready()
            return empty(200 if healthy else 400)
        if request.path == "/invocations":
            if request.method != "POST":
                return json_response({"error": "Method Not Allowed"}, 405)
            try:
                return _binary_out(await self._invoke(request))
            except TritonError as exc:
                return error_response(exc)
        return empty(400)

    async def _invoke(self, request: HttpRequest) -> HttpResponse:
        if not self.model:
            raise NotFoundError(
                f"Request for unknown model: no model to serve (set {DEFAULT_MODEL_VARIABLE})"
            )
        self.api.engine.model(self.model)  # NOT_FOUND before the body is read, as Triton
        content_type = request.header("content-type")
        headers = {k: v for k, v in request.headers.items() if k != HEADER_LENGTH}
        if content_type.startswith(BINARY_JSON + _HEADER_SIZE):
            text = content_type[len(BINARY_JSON + _HEADER_SIZE):].split(";", 1)[0].strip()
            if not text.isdigit():
                raise InvalidArgumentError(f"json-header-size '{text}' in the content type is not a number")
            headers[HEADER_LENGTH] = text
        elif BINARY_JSON in content_type:
            raise InvalidArgumentError(
                f"content type must be '{BINARY_JSON}{_HEADER_SIZE}<bytes>' for a binary request"
            )
        request.headers = headers
        return await self.api.infer(request, {"model": self.model})


def _binary_out(response: HttpResponse) -> HttpResponse:
    """A KServe binary response in SageMaker's spelling."""
    length = next((v for k, v in response.headers if k.lower() == HEADER_LENGTH), None)
    if length is not None:
        response.headers = [(k, v) for k, v in response.headers if k.lower() != HEADER_LENGTH]
        response.content_type = f"{BINARY_JSON}{_HEADER_SIZE}{length}"
    return response


def default_model(named: str | None, models: list[str]) -> str:
    """The endpoint's model: the one named (or in SAGEMAKER_TRITON_DEFAULT_MODEL_NAME),
    else the repository's only model; "" when there is no telling."""
    name = named or os.environ.get(DEFAULT_MODEL_VARIABLE, "")
    if name:
        return name
    return models[0] if len(models) == 1 else ""
