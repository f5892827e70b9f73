"""Client of the pipeline ensemble: add_sub, then identity on each of its outputs.

    python examples/clients/pipeline_client.py

pipeline is an ensemble: it has no model.py, only steps (add_sub, then identity twice)
that the server runs, passing tensors from step to step by reference. SUM = INPUT0 +
INPUT1, DIFF = INPUT0 - INPUT1. The call is made twice: in-process, and over gRPC with
tritonclient against a KServe gRPC service on a free port, as a Triton client would.
"""

from __future__ import annotations

import numpy as np
import tritonclient.grpc as grpcclient

import dlserve
from _common import client_inputs, frontend, ready_model, run_alone
from dlserve.frontends import KServeGrpc

MODEL = "pipeline"
DEPENDENCIES = ["add_sub", "identity"]  # the models of its steps


def run(server: dlserve.Server) -> None:
    model = ready_model(server, MODEL)
    rng = np.random.default_rng(0)
    input0 = rng.random(4, dtype=np.float32)
    input1 = rng.random(4, dtype=np.float32)

    (response,) = model.infer(inputs={"INPUT0": input0, "INPUT1": input1})
    total = np.from_dlpack(response.outputs["SUM"])
    difference = np.from_dlpack(response.outputs["DIFF"])
    print(f"pipeline: SUM {total} (INPUT0 + INPUT1), DIFF {difference} (INPUT0 - INPUT1)")
    assert np.allclose(total, input0 + input1), "pipeline: wrong sum"
    assert np.allclose(difference, input0 - input1), "pipeline: wrong difference"

    # The same over gRPC: a KServe gRPC service on a free port (port=0), tritonclient.grpc.
    with frontend(server, KServeGrpc) as url, grpcclient.InferenceServerClient(url) as client:
        assert client.get_model_metadata(MODEL).platform == "ensemble"
        result = client.infer(MODEL, client_inputs(grpcclient, INPUT0=input0, INPUT1=input1))
        total, difference = result.as_numpy("SUM"), result.as_numpy("DIFF")
        print(f"pipeline over gRPC: SUM {total}, DIFF {difference}")
        assert np.allclose(total, input0 + input1), "pipeline: wrong sum (gRPC)"
        assert np.allclose(difference, input0 - input1), "pipeline: wrong difference (gRPC)"


if __name__ == "__main__":
    run_alone(run, MODEL)  # its step models load with it (explicit mode)
