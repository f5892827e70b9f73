"""An unload over HTTP or gRPC answers at once, as Triton 2.51's does (measured side by
side): the model is UNLOADING, refusing new requests, while its request in flight
finishes; then it is listed as unloaded. A load meanwhile waits for the unload to end.
A load whose client gives up on it completes all the same, as Triton's does."""

from __future__ import annotations

import http.client
import threading
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import dlserve
from dlserve import ModelControlMode
from dlserve.frontends import KServeGrpc, KServeHttp

from ..conftest import wait_until, worker_processes

X = np.ones([1], dtype=np.float32)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_unload_answers_at_once_and_the_request_in_flight_finishes(servers, make_repo, protocol):
    server = servers.start(make_repo("faulty"), model_control_mode=ModelControlMode.EXPLICIT, startup_models=["faulty"])
    kind, module = (KServeHttp, httpclient) if protocol == "http" else (KServeGrpc, grpcclient)
    service = kind(server, kind.Options(address="127.0.0.1", port=0))
    service.start()
    client: Any = module.InferenceServerClient(f"127.0.0.1:{service.port}")
    try:
        def request(mode: str) -> Any:
            tensor = module.InferInput("INPUT0", [1], "FP32")
            tensor.set_data_from_numpy(X)
            return client.infer("faulty", [tensor], parameters={"mode": mode})

        answers: list[Any] = []

        def slow() -> None:  # (in-process: tritonclient's clients are not thread-safe)
            (response,) = server.model("faulty").infer(inputs={"INPUT0": X}, parameters={"mode": "sleep:1.5"})
            answers.append(np.from_dlpack(response.outputs["OUTPUT0"]))

        in_flight = threading.Thread(target=slow)
        in_flight.start()
        wait_until(lambda: server.engine.model("faulty").instances[0].in_flight == 1)  # it executes
        client.unload_model("faulty")
        assert in_flight.is_alive()  # answered before the request in flight finished
        index = client.get_model_repository_index()
        rows = index if protocol == "http" else [
            {"name": m.name, "version": m.version, "state": m.state} for m in index.models
        ]
        assert rows == [{"name": "faulty", "version": "1", "state": "UNLOADING"}]
        assert not client.is_model_ready("faulty")
        with pytest.raises(InferenceServerException, match="has no available versions"):
            request("")
        client.load_model("faulty")  # waits for the unload, then loads it again
        in_flight.join()
        assert answers and answers[0].tolist() == X.tolist()
        assert client.is_model_ready("faulty")
        assert request("").as_numpy("OUTPUT0").tolist() == X.tolist()
    finally:
        client.close()
        service.stop()


def _passing(sleep: float) -> str:
    return (
        "import time\nimport triton_python_backend_utils as pb_utils\n\n\n"
        "class TritonPythonModel:\n    def execute(self, requests):\n"
        f"        time.sleep({sleep})\n"
        '        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", '
        'pb_utils.get_input_tensor_by_name(r, "X").as_numpy())]) for r in requests]\n'
    )


STEP = 'backend: "python"\ninput [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]\noutput [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
ENSEMBLE = """platform: "ensemble"
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
ensemble_scheduling { step [
  { model_name: "slow" model_version: -1 input_map { key: "X" value: "X" } output_map { key: "Y" value: "mid" } },
  { model_name: "fast" model_version: -1 input_map { key: "X" value: "mid" } output_map { key: "Y" value: "Y" } }
] }
"""


def test_a_load_after_an_unload_that_still_drains_is_not_undone(servers, make_repo):
    """Unloading 'fast' takes the ensemble that uses it too (no new requests from the
    start) and first drains it, its request in flight still reaching 'fast'; a load of
    'fast' sent meanwhile waits for that unload to end, so the model it loads stays
    loaded (the unload used to go on afterwards and unload it), and brings the ensemble
    back."""
    repo = make_repo(extra={
        "slow": {"config.pbtxt": STEP, "1/model.py": _passing(1.5)},
        "fast": {"config.pbtxt": STEP, "1/model.py": _passing(0)},
        "ens": {"config.pbtxt": ENSEMBLE, "1/.keep": ""},
    })
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT, startup_models=["ens"])
    service = KServeHttp(server, KServeHttp.Options(address="127.0.0.1", port=0))
    service.start()
    client = httpclient.InferenceServerClient(f"127.0.0.1:{service.port}")
    try:
        answers: list[Any] = []
        in_flight = threading.Thread(
            target=lambda: answers.extend(server.model("ens").infer(inputs={"X": X}, raise_on_error=False))
        )
        in_flight.start()
        wait_until(lambda: server.engine.model("slow").instances[0].in_flight == 1)
        client.unload_model("fast")  # at once: the ensemble's request still runs
        assert not client.is_model_ready("ens")  # it goes too: no new requests meanwhile
        # 'fast' takes the ensemble's step call, no one else's
        with pytest.raises(dlserve.UnavailableError, match="is not ready"):
            list(server.model("fast", 1).infer(inputs={"X": X}))
        client.load_model("fast")  # waits for the unload to end
        in_flight.join()
        # The ensemble's request in flight runs its later step on the 'fast' it started
        # with, as in Triton 2.51 (side by side; it used to fail: 'has no available versions')
        (answered,) = answers
        assert answered.error is None
        assert answered.outputs["Y"].as_numpy().tolist() == X.tolist()
        wait_until(lambda: not server.engine.manager.unloader.background)  # every unload has ended
        assert client.is_model_ready("fast")
        assert {m["name"]: m.get("state") for m in client.get_model_repository_index()}["fast"] == "READY"
        # ...and the ensemble it took comes back with it, as in Triton 2.51 (side by side:
        # after an unload over the network it used to stay unloaded for good)
        wait_until(lambda: client.is_model_ready("ens"))
        (answer,) = server.model("ens").infer(inputs={"X": X})
        assert answer.outputs["Y"].as_numpy().tolist() == X.tolist()
    finally:
        client.close()
        service.stop()


SLOW_INITIALIZE = """
import time


class TritonPythonModel:
    def initialize(self, args):
        time.sleep(2)

    def execute(self, requests):
        return []
"""


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_load_whose_client_gives_up_completes(servers, make_repo, protocol):
    """The client goes away (HTTP) or its deadline passes (gRPC) while the model's
    initialize runs: the load goes on to READY with no other load, and leaves one worker
    (cancelled halfway, it used to leave its worker running, and the model unloaded)."""
    slow = {"config.pbtxt": 'backend: "python"\n', "1/model.py": SLOW_INITIALIZE}
    repo = make_repo(extra={"slow": slow})
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    kind = KServeHttp if protocol == "http" else KServeGrpc
    service = kind(server, kind.Options(address="127.0.0.1", port=0))
    service.start()
    try:
        if protocol == "http":
            connection = http.client.HTTPConnection("127.0.0.1", service.port, timeout=0.5)
            try:
                connection.request("POST", "/v2/repository/models/slow/load", body=b"{}")
                with pytest.raises(TimeoutError):
                    connection.getresponse()
            finally:
                connection.close()
        else:
            with grpcclient.InferenceServerClient(f"127.0.0.1:{service.port}") as client:
                with pytest.raises(InferenceServerException, match="Deadline Exceeded"):
                    client.load_model("slow", client_timeout=0.5)
        wait_until(lambda: server.model("slow").ready(), timeout=15)
        assert len(worker_processes(server.engine.segment_prefix)) == 1
    finally:
        service.stop()
