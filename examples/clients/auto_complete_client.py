"""Client of the auto_complete model, whose config.pbtxt names only the backend.

    python examples/clients/auto_complete_client.py

The model's ``auto_complete_config`` declared its inputs and outputs, max_batch_size
4 and dynamic batching; the completed configuration is what the server reports.
"""

from __future__ import annotations

import numpy as np

import dlserve
from _common import ready_model, run_alone

MODEL = "auto_complete"


def run(server: dlserve.Server) -> None:
    model = ready_model(server, MODEL)

    config = model.config()
    inputs = [(t["name"], t["data_type"], t["dims"]) for t in config["input"]]
    outputs = [(t["name"], t["data_type"], t["dims"]) for t in config["output"]]
    print(f"auto-completed config: max_batch_size {config['max_batch_size']}, "
          f"dynamic_batching {'dynamic_batching' in config}")
    print(f"  inputs  {inputs}")
    print(f"  outputs {outputs}")
    assert config["max_batch_size"] == 4, "auto_complete: max_batch_size was not set"
    assert "dynamic_batching" in config, "auto_complete: dynamic batching was not set"
    assert [name for name, _, _ in inputs] == ["INPUT0", "INPUT1"], "auto_complete: inputs"
    assert [name for name, _, _ in outputs] == ["OUTPUT0", "OUTPUT1"], "auto_complete: outputs"

    # max_batch_size > 0: inputs carry a leading batch dimension, here 2 rows of [4].
    input0 = np.arange(8, dtype=np.float32).reshape(2, 4)
    input1 = np.ones((2, 4), dtype=np.float32)
    (response,) = model.infer(inputs={"INPUT0": input0, "INPUT1": input1})
    output0 = np.from_dlpack(response.outputs["OUTPUT0"])
    output1 = np.from_dlpack(response.outputs["OUTPUT1"])
    print(f"OUTPUT0 = INPUT0 + INPUT1 = {output0.tolist()}")
    print(f"OUTPUT1 = INPUT0 - INPUT1 = {output1.tolist()}")
    assert output0.shape == (2, 4), "auto_complete: wrong shape"
    assert np.array_equal(output0, input0 + input1), "auto_complete: sum"
    assert np.array_equal(output1, input0 - input1), "auto_complete: difference"


if __name__ == "__main__":
    run_alone(run, MODEL)
