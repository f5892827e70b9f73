"""Client of the add_sub model: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1.

    python examples/clients/add_sub_client.py
"""

from __future__ import annotations

import numpy as np

import dlserve
from _common import ready_model, run_alone

MODEL = "add_sub"


def run(server: dlserve.Server) -> None:
    model = ready_model(server, MODEL)
    rng = np.random.default_rng(0)
    input0 = rng.random(4, dtype=np.float32)
    input1 = rng.random(4, dtype=np.float32)

    # One request, one response. Inputs may be numpy arrays, lists of numbers,
    # dlserve.Tensors or anything that speaks DLPack (a torch tensor, a jax array...).
    (response,) = model.infer(inputs={"INPUT0": input0, "INPUT1": input1})

    # Outputs are dlserve.Tensors: np.from_dlpack views them without a copy.
    output0 = np.from_dlpack(response.outputs["OUTPUT0"])
    output1 = np.from_dlpack(response.outputs["OUTPUT1"])
    print(f"INPUT0 {input0} + INPUT1 {input1} = OUTPUT0 {output0}")
    print(f"INPUT0 {input0} - INPUT1 {input1} = OUTPUT1 {output1}")
    assert np.allclose(output0, input0 + input1), "add_sub: wrong sum"
    assert np.allclose(output1, input0 - input1), "add_sub: wrong difference"


if __name__ == "__main__":
    run_alone(run, MODEL)
