"""Client of the string_upper model: BYTES (strings) in, upper-cased strings out.

    python examples/clients/string_upper_client.py
"""

from __future__ import annotations

import numpy as np

import dlserve
from _common import ready_model, run_alone

MODEL = "string_upper"


def run(server: dlserve.Server) -> None:
    model = ready_model(server, MODEL)
    words = ["hello", "dlserve", "grüße"]

    # A numpy array of str (or bytes, or an object array of either) is a BYTES tensor.
    (response,) = model.infer(inputs={"INPUT0": np.array(words)})

    # BYTES outputs: to_bytes_array() gives bytes objects, to_string_array() decodes UTF-8.
    output = response.outputs["OUTPUT0"].to_string_array().tolist()
    print(f"string_upper({words}) = {output}")
    assert output == [word.upper() for word in words], "string_upper: wrong output"

    # Text that is not UTF-8 gets an error response (code INVALID_ARG).
    try:
        list(model.infer(inputs={"INPUT0": np.array([b"\xff"], dtype=np.object_)}))
    except dlserve.InvalidArgumentError as exc:
        print(f"string_upper([b'\\xff']) -> InvalidArgumentError: {exc}")
    else:
        raise AssertionError("string_upper: invalid UTF-8 was accepted")


if __name__ == "__main__":
    run_alone(run, MODEL)
