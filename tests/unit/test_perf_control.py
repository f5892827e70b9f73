"""dlserve perf's control calls against a server that only speaks KServe v2 core:
no model-configuration endpoint (as MLServer). A tiny real HTTP server stands in
for it; dlserve perf must fall back to the metadata."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import pytest

from dlserve.perf.clients.base import ServerError
from dlserve.perf.clients.http import HttpControl

METADATA = {
    "name": "add_sub",
    "versions": ["1"],
    "platform": "mlserver",
    "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [16]}],
    "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [16]}],
}


class PlainKServe(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path == "/v2/models/add_sub":
            status, body = 200, METADATA
        elif self.path == "/v2/models/broken":
            status, body = 500, {"error": "boom"}
        else:
            status, body = 404, {"detail": "Not Found"}
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), PlainKServe)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_model_info_without_a_config_endpoint_uses_the_metadata(url):
    control = HttpControl(url)
    try:
        info = control.model_info("add_sub", "")
    finally:
        control.close()
    assert [t.name for t in info.inputs] == ["INPUT0"] and info.inputs[0].dims == [16]
    assert info.max_batch_size == 0 and not info.decoupled and info.version == "1"


def test_other_errors_still_fail_with_the_servers_message(url):
    control = HttpControl(url)
    try:
        with pytest.raises(ServerError, match="500 boom"):
            control.model_info("broken", "")
    finally:
        control.close()
