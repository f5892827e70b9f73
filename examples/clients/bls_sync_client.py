"""Client of the bls_sync model: a model that calls add_sub (BLS) with a blocking exec().

    python examples/clients/bls_sync_client.py

bls_sync hands each request on to add_sub (``pb_utils.InferenceRequest(...).exec()``)
and returns add_sub's outputs: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1.
add_sub must be loaded too. The call is made twice: in-process, and over HTTP with
tritonclient against a KServe HTTP service on a free port, exactly as a Triton client
would call it.
"""

from __future__ import annotations

import numpy as np
import tritonclient.http as httpclient

import dlserve
from _common import client_inputs, frontend, ready_model, run_alone
from dlserve.frontends import KServeHttp

MODEL = "bls_sync"
DEPENDENCIES = ["add_sub"]  # the model bls_sync calls


def run(server: dlserve.Server) -> None:
    model = ready_model(server, MODEL)
    for dependency in DEPENDENCIES:
        ready_model(server, dependency)
    rng = np.random.default_rng(0)
    input0 = rng.random(4, dtype=np.float32)
    input1 = rng.random(4, dtype=np.float32)

    # In-process: one request, one response, computed by add_sub inside bls_sync.
    (response,) = model.infer(inputs={"INPUT0": input0, "INPUT1": input1})
    output0 = np.from_dlpack(response.outputs["OUTPUT0"])
    output1 = np.from_dlpack(response.outputs["OUTPUT1"])
    print(f"bls_sync -> add_sub: OUTPUT0 {output0} (INPUT0 + INPUT1), "
          f"OUTPUT1 {output1} (INPUT0 - INPUT1)")
    assert np.allclose(output0, input0 + input1), "bls_sync: wrong sum"
    assert np.allclose(output1, input0 - input1), "bls_sync: wrong difference"

    # The same over HTTP: a KServe HTTP service on a free port (port=0), tritonclient.http.
    with frontend(server, KServeHttp) as url, httpclient.InferenceServerClient(url) as client:
        inputs = client_inputs(httpclient, INPUT0=input0, INPUT1=input1)
        result = client.infer(MODEL, inputs)
        output0, output1 = result.as_numpy("OUTPUT0"), result.as_numpy("OUTPUT1")
        print(f"bls_sync over HTTP: OUTPUT0 {output0}, OUTPUT1 {output1}")
        assert np.allclose(output0, input0 + input1), "bls_sync: wrong sum (HTTP)"
        assert np.allclose(output1, input0 - input1), "bls_sync: wrong difference (HTTP)"


if __name__ == "__main__":
    run_alone(run, MODEL, *DEPENDENCIES)
