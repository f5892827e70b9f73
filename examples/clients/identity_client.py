"""Client of the identity model: OUTPUT0 is INPUT0, and no byte of it is copied.

    python examples/clients/identity_client.py

``server.allocate_tensor`` gives a tensor in the server's shared memory. Filled in
place and sent as an input, it reaches the model where it is; the model returns the
same memory as its output, so the response's OUTPUT0 has the input's very address.
"""

from __future__ import annotations

import numpy as np

import dlserve
from _common import ready_model, run_alone

MODEL = "identity"


def run(server: dlserve.Server) -> None:
    model = ready_model(server, MODEL)

    # Any length: the model's dims are [-1].
    (response,) = model.infer(inputs={"INPUT0": np.array([1.0, 2.0, 3.0], dtype=np.float32)})
    small = np.from_dlpack(response.outputs["OUTPUT0"])
    print(f"identity([1, 2, 3]) = {small}")
    assert small.tolist() == [1.0, 2.0, 3.0], "identity: wrong output"

    # Zero copy, end to end: fill a shared-memory tensor in place and send it.
    tensor = server.allocate_tensor([1 << 20], np.float32)  # 4 MiB
    np.from_dlpack(tensor)[:] = np.arange(1 << 20, dtype=np.float32)
    (response,) = model.infer(inputs={"INPUT0": tensor})
    output = response.outputs["OUTPUT0"]
    same_memory = output.data_ptr == tensor.data_ptr
    print(f"identity(4 MiB tensor): OUTPUT0 is INPUT0's memory: {same_memory}")
    assert np.from_dlpack(output)[123_456] == 123_456.0, "identity: wrong output"
    assert same_memory, "identity: the output was copied"


if __name__ == "__main__":
    run_alone(run, MODEL)
