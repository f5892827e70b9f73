"""Google Vertex AI's protocol (``VertexAi`` service, ``dlserve serve`` under
``AIP_MODE=PREDICTION``): health and predict routes, the binary extension as
tritonclient builds it, the default model's rules, the redirect header to KServe
endpoints, errors, and the CLI driven by Vertex AI's variables."""

from __future__ import annotations

import http.client
import json
import os

import numpy as np
import pytest
import tritonclient.http as httpclient

import dlserve
from dlserve.frontends import VertexAi

from .test_cli import A, B, Serve, add_sub_body, free_port, refused, request

HEALTH, PREDICT = "/health", "/v1/endpoints/[^/]+/deployedModels/[^/]+:predict"
PREDICT_PATH = "/v1/endpoints/e1/deployedModels/m1:predict"
BINARY = "application/vnd.vertex-ai-triton.binary+json"


def call(port: int, path: str, body: bytes = b"", method: str = "POST", headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def vertex(server: dlserve.Server, **options) -> VertexAi:
    """A Vertex AI service on a free loopback port, to start with ``with``."""
    options = {"health_route": HEALTH, "predict_route": PREDICT, **options}
    return VertexAi(server, VertexAi.Options(address="127.0.0.1", port=0, **options))


def binary_add_sub_inputs() -> list[httpclient.InferInput]:
    inputs = [httpclient.InferInput(name, [16], "FP32") for name in ("INPUT0", "INPUT1")]
    inputs[0].set_data_from_numpy(A)
    inputs[1].set_data_from_numpy(B)
    return inputs


def test_health_and_predict_with_json_and_binary(servers, make_repo):
    server = servers.start(make_repo("add_sub"))
    with vertex(server) as service:
        assert call(service.port, HEALTH, method="GET")[::2] == (200, b"")
        status, headers, body = call(service.port, PREDICT_PATH, json.dumps(add_sub_body()).encode())
        assert status == 200, body
        outputs = {o["name"]: o["data"] for o in json.loads(body)["outputs"]}
        assert outputs["OUTPUT0"] == (A + B).tolist()
        inputs = binary_add_sub_inputs()
        wanted = [httpclient.InferRequestedOutput("OUTPUT1", binary_data=True)]
        raw, length = httpclient.InferenceServerClient.generate_request_body(inputs, outputs=wanted)
        status, headers, body = call(
            service.port, PREDICT_PATH, raw, headers={"Content-Type": f"{BINARY};json-header-size={length}"}
        )
        assert status == 200, body
        # Answered in KServe's binary form, as Triton answers Vertex AI.
        header_length = int(headers["Inference-Header-Content-Length"])
        result = httpclient.InferenceServerClient.parse_response_body(body, header_length=header_length)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)


def test_the_redirect_header_reaches_kserve_endpoints(servers, make_repo):
    server = servers.start(make_repo("add_sub"))
    with vertex(server) as service:

        def redirect(target: str, body: bytes = b"", method: str = "POST"):
            return call(service.port, PREDICT_PATH, body, method, {"X-Vertex-Ai-Triton-Redirect": target})

        assert redirect("v2/models/add_sub/ready")[0] == 200
        assert redirect("v2/health/live")[0] == 200
        status, _, body = redirect("v2/repository/index")
        assert status == 200 and json.loads(body)[0]["name"] == "add_sub"
        status, _, body = redirect("v2/models/add_sub/config")
        assert status == 200 and json.loads(body)["name"] == "add_sub"
        gzip_ok = {
            "X-Vertex-Ai-Triton-Redirect": "v2/models/add_sub/infer", "Accept-Encoding": "gzip"
        }
        body = json.dumps(add_sub_body()).encode()
        status, headers, body = call(service.port, PREDICT_PATH, body, "POST", gzip_ok)
        assert status == 200 and json.loads(body)["model_name"] == "add_sub"
        assert "Content-Encoding" not in headers  # (Triton 2.51 does not compress these either)
        # binary tensors as Vertex AI sends them, the header's size in the content type
        # (Triton 2.51 side by side; "+N" is read as N there too)
        client = httpclient.InferenceServerClient
        raw, length = client.generate_request_body(binary_add_sub_inputs())
        for size in (str(length), f"+{length}"):
            status, headers, body = call(service.port, PREDICT_PATH, raw, "POST", {
                "X-Vertex-Ai-Triton-Redirect": "v2/models/add_sub/infer",
                "Content-Type": f"{BINARY};json-header-size={size}",
            })
            assert status == 200, body
            header_length = int(headers["Inference-Header-Content-Length"])
            result = client.parse_response_body(body, header_length=header_length)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)
        status, _, body = call(service.port, PREDICT_PATH, raw, "POST", {
            "X-Vertex-Ai-Triton-Redirect": "v2/models/add_sub/infer",
            "Content-Type": f"{BINARY};json-header-size=abc",
        })
        assert (status, json.loads(body)) == (
            400, {"error": "json-header-size 'abc' in the content type is not a number"}
        )
        status, _, body = redirect("metrics")
        assert status == 200 and b'nv_inference_count{model="add_sub",version="1"} 3' in body
        for bad in ("foo", "/v2", "v2/", "v2/logging", "v2/models/add_sub/generate", "v2/trace/setting"):
            assert redirect(bad)[::2] == (400, b""), bad
        assert redirect("v2/health/live", method="GET")[::2] == (405, b"")


@pytest.mark.parametrize(
    ("path", "method", "body", "headers", "status", "message"),
    [
        ("/v2/health/ready", "GET", b"", {}, 400, ""),  # KServe paths only through the redirect
        ("/health", "POST", b"", {}, 405, "Method Not Allowed"),
        (PREDICT_PATH, "GET", b"", {}, 405, "Method Not Allowed"),
        (PREDICT_PATH + "/", "POST", b"{}", {}, 400, ""),
        (PREDICT_PATH, "POST", b"{not json", {}, 400, "failed to parse"),
        (PREDICT_PATH, "POST", b"{}", {"Content-Type": f"{BINARY};json-header-size=x"}, 400, "json-header-size 'x'"),
    ],
)
def test_bad_requests_get_clear_errors_and_the_server_serves_on(servers, make_repo, path, method, body, headers,
                                                               status, message):
    server = servers.start(make_repo("add_sub"))
    with vertex(server) as service:
        got, _, text = call(service.port, path, body, method, headers)
        assert got == status, text
        assert (message in json.loads(text)["error"]) if message else text == b""
        assert call(service.port, PREDICT_PATH, json.dumps(add_sub_body()).encode())[0] == 200


def test_the_default_models_rules(servers, make_repo):
    two = servers.start(make_repo("add_sub", "identity"))
    with pytest.raises(dlserve.InvalidArgumentError, match="contains only a single model if default model is not specified"):
        vertex(two).start()
    with pytest.raises(dlserve.InvalidArgumentError, match="Expect the default model 'nope' is loaded"):
        vertex(two, default_model="nope").start()
    with vertex(two, default_model="identity") as service:
        body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [2], "data": [1, 2]}]}
        status, _, text = call(service.port, PREDICT_PATH, json.dumps(body).encode())
        assert status == 200 and json.loads(text)["model_name"] == "identity"


def test_routes_must_be_given(monkeypatch):
    monkeypatch.delenv("AIP_PREDICT_ROUTE", raising=False)
    monkeypatch.setenv("AIP_HEALTH_ROUTE", "/h")
    with pytest.raises(dlserve.InvalidArgumentError, match="AIP_PREDICT_ROUTE"):
        VertexAi.Options()
    monkeypatch.setenv("AIP_PREDICT_ROUTE", "/p")
    monkeypatch.setenv("AIP_HTTP_PORT", "9123")
    options = VertexAi.Options()
    assert (options.port, options.health_route, options.predict_route) == (9123, "/h", "/p")


def test_dlserve_serve_as_a_vertex_ai_container(make_repo, tmp_path):
    port = free_port()
    env = dict(os.environ, AIP_MODE="PREDICTION", AIP_HTTP_PORT=str(port), AIP_HEALTH_ROUTE=HEALTH,
               AIP_PREDICT_ROUTE=PREDICT, AIP_STORAGE_URI=str(make_repo("add_sub")))
    process = Serve(tmp_path, [], env=env, ports={"vertex-ai": port})
    try:
        process.wait_started()
        assert request(port, HEALTH)[0] == 200
        status, body = request(port, PREDICT_PATH, "POST", add_sub_body())
        assert status == 200 and json.loads(body)["model_name"] == "add_sub"
        assert refused(process.ports["http"]) and refused(process.ports["grpc"])  # off under AIP_MODE
        code, _ = process.stop()
        assert code == 0, process.output()
        process.assert_clean()
    finally:
        process.kill()
