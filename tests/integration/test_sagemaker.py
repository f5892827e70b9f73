"""Amazon SageMaker's protocol (``SageMaker`` service, ``dlserve serve --allow-sagemaker``):
/ping, /invocations with JSON and with the binary extension as tritonclient builds and
parses it for SageMaker, the endpoint's model, errors, and the CLI."""

from __future__ import annotations

import http.client
import json

import numpy as np
import pytest
import tritonclient.http as httpclient

import dlserve
from dlserve.frontends import SageMaker

from .test_cli import A, B, Serve, add_sub_body, free_port, request

BINARY = "application/vnd.sagemaker-triton.binary+json"


def post(port: int, path: str, body: bytes, content_type: str = "application/json", method: str = "POST",
         headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": content_type, **(headers or {})})
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type"), response.read()
    finally:
        conn.close()


def sagemaker(server: dlserve.Server, **options) -> SageMaker:
    """A SageMaker service on a free loopback port, to start with ``with``."""
    return SageMaker(server, SageMaker.Options(address="127.0.0.1", port=0, **options))


def add_sub_inputs(binary: bool = True) -> list:
    inputs = [httpclient.InferInput(name, [16], "FP32") for name in ("INPUT0", "INPUT1")]
    inputs[0].set_data_from_numpy(A, binary_data=binary)
    inputs[1].set_data_from_numpy(B, binary_data=binary)
    return inputs


def test_ping_and_invocations_with_json(servers, make_repo):
    server = servers.start(make_repo("add_sub"))
    with sagemaker(server) as service:
        status, _, body = post(service.port, "/ping", b"", method="GET")
        assert (status, body) == (200, b"")
        status, content_type, body = post(service.port, "/invocations", json.dumps(add_sub_body()).encode())
        assert status == 200 and content_type == "application/json"
        answer = json.loads(body)
        assert answer["model_name"] == "add_sub"  # the repository's only model
        outputs = {o["name"]: o["data"] for o in answer["outputs"]}
        assert outputs["OUTPUT0"] == (A + B).tolist() and outputs["OUTPUT1"] == (A - B).tolist()


def test_binary_invocations_as_tritonclient_builds_them_for_sagemaker(servers, make_repo):
    server = servers.start(make_repo("add_sub", "identity"))
    with sagemaker(server, default_model="add_sub") as service:
        outputs = [httpclient.InferRequestedOutput(name, binary_data=True) for name in ("OUTPUT0", "OUTPUT1")]
        body, header_length = httpclient.InferenceServerClient.generate_request_body(
            add_sub_inputs(), outputs=outputs, request_id="7"
        )
        status, content_type, raw = post(service.port, "/invocations", body, f"{BINARY};json-header-size={header_length}")
        assert status == 200, raw
        assert content_type.startswith(f"{BINARY};json-header-size=")
        length = int(content_type.split("=", 1)[1])
        result = httpclient.InferenceServerClient.parse_response_body(raw, header_length=length)
        assert result.get_response()["id"] == "7"
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)


@pytest.mark.parametrize(
    ("path", "method", "body", "content_type", "status", "message"),
    [
        ("/nowhere", "GET", b"", "application/json", 400, ""),
        ("/invocations/", "POST", b"{}", "application/json", 400, ""),
        ("/invocations", "GET", b"", "application/json", 405, "Method Not Allowed"),
        ("/ping", "POST", b"", "application/json", 405, "Method Not Allowed"),
        ("/invocations", "POST", b"{not json", "application/json", 400, "failed to parse"),
        ("/invocations", "POST", b"{}", f"{BINARY};json-header-size=abc", 400, "json-header-size 'abc'"),
        ("/invocations", "POST", b"{}", f"{BINARY};json-header-size=99", 400,
         "inference header size should be in range (0, 2), got: 99"),
        ("/invocations", "POST", b"{}", f"{BINARY};json-header-size=-1", 400,
         "inference header size should be in range (0, 2), got: -1"),
        ("/invocations", "POST", b"{}", f"text/plain; {BINARY}", 400, "content type must be"),
    ],
)
def test_bad_requests_get_clear_errors_and_the_server_serves_on(servers, make_repo, path, method, body,
                                                               content_type, status, message):
    server = servers.start(make_repo("add_sub"))
    with sagemaker(server) as service:
        got, _, text = post(service.port, path, body, content_type, method)
        assert got == status, text
        assert (message in json.loads(text)["error"]) if message else text == b""
        assert post(service.port, "/invocations", json.dumps(add_sub_body()).encode())[0] == 200


def test_the_model_named_by_the_environment_and_none_to_choose(servers, make_repo, monkeypatch):
    server = servers.start(make_repo("add_sub", "identity"))
    with sagemaker(server) as service:  # two models, none named
        status, _, text = post(service.port, "/invocations", json.dumps(add_sub_body()).encode())
        assert status == 404 and "SAGEMAKER_TRITON_DEFAULT_MODEL_NAME" in json.loads(text)["error"]
    monkeypatch.setenv("SAGEMAKER_TRITON_DEFAULT_MODEL_NAME", "identity")
    with sagemaker(server) as service:
        body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [2], "data": [1, 2]}]}
        status, _, text = post(service.port, "/invocations", json.dumps(body).encode())
        assert status == 200 and json.loads(text)["model_name"] == "identity"
    monkeypatch.setenv("SAGEMAKER_TRITON_DEFAULT_MODEL_NAME", "nope")
    with sagemaker(server) as service:
        status, _, text = post(service.port, "/invocations", json.dumps(add_sub_body()).encode())
        assert status == 404 and "nope" in json.loads(text)["error"]


def test_ping_follows_readiness_or_liveness(servers, make_repo, monkeypatch):
    server = servers.start(make_repo("add_sub", "init_fail"), exit_on_error=False)  # not ready: a model failed
    with sagemaker(server, default_model="add_sub") as service:
        assert post(service.port, "/ping", b"", method="GET")[0] == 400
        assert post(service.port, "/invocations", json.dumps(add_sub_body()).encode())[0] == 200
    monkeypatch.setenv("SAGEMAKER_TRITON_PING_MODE", "live")
    with sagemaker(server, default_model="add_sub") as service:
        assert post(service.port, "/ping", b"", method="GET")[0] == 200
    with pytest.raises(dlserve.InvalidArgumentError, match="ping_mode must be 'ready' or 'live'"):
        SageMaker.Options(ping_mode="sometimes")
    for unknown in ("", "sometimes"):  # from the environment: readiness, as tritonserver reads it
        monkeypatch.setenv("SAGEMAKER_TRITON_PING_MODE", unknown)
        with sagemaker(server, default_model="add_sub") as service:
            assert post(service.port, "/ping", b"", method="GET")[0] == 400


def test_dlserve_serve_allow_sagemaker(make_repo, tmp_path):
    process = Serve(tmp_path, ["--model-repository", str(make_repo("add_sub")), "--allow-sagemaker"],
                    ports={"sagemaker": free_port()})
    try:
        process.wait_started()
        port = process.ports["sagemaker"]
        assert request(port, "/ping")[0] == 200
        status, body = request(port, "/invocations", "POST", add_sub_body())
        assert status == 200 and json.loads(body)["model_name"] == "add_sub"
        code, _ = process.stop()
        assert code == 0, process.output()
        process.assert_clean()
    finally:
        process.kill()
