"""Client of the jax_add_sub model: AddSub in JAX on the request's own memory.

    python examples/clients/jax_add_sub_client.py

The model wraps its inputs without copying them
(``jax.dlpack.from_dlpack(pb_tensor)``) and returns
ZERO_COPY = True when the JAX tensors' data pointers are the inputs' addresses.
If jax is not installed the model does not load, and this example reports
"skipped: ..." and exits 0.
"""

from __future__ import annotations

import numpy as np

import dlserve
from _common import ready_model, run_alone

MODEL = "jax_add_sub"
# 4096 float32 = 16 KiB per input. Tensors of more than 4 KiB are placed in shared
# memory, 64-byte aligned, where the model's framework can wrap them without a copy;
# smaller ones travel inside the control message, and the model may have to copy them.
LENGTH = 4096


def run(server: dlserve.Server) -> None:
    model = ready_model(server, MODEL)  # raises Skipped when jax is not installed
    rng = np.random.default_rng(0)
    input0 = rng.random(LENGTH, dtype=np.float32)
    input1 = rng.random(LENGTH, dtype=np.float32)

    (response,) = model.infer(inputs={"INPUT0": input0, "INPUT1": input1})
    output0 = np.from_dlpack(response.outputs["OUTPUT0"])
    output1 = np.from_dlpack(response.outputs["OUTPUT1"])
    zero_copy = bool(response.outputs["ZERO_COPY"].as_numpy()[0])
    print(f"{MODEL}: OUTPUT0[:3] = {output0[:3]} (INPUT0 + INPUT1), "
          f"OUTPUT1[:3] = {output1[:3]} (INPUT0 - INPUT1)")
    print(f"{MODEL}: JAX used the inputs without copying them: {zero_copy}")
    assert np.allclose(output0, input0 + input1), "jax_add_sub: wrong sum"
    assert np.allclose(output1, input0 - input1), "jax_add_sub: wrong difference"
    assert zero_copy, "jax_add_sub: JAX copied the inputs"


if __name__ == "__main__":
    run_alone(run, MODEL)
