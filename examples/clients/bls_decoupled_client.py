"""Client of the bls_decoupled model: BLS into the decoupled square model.

    python examples/clients/bls_decoupled_client.py

bls_decoupled is an ordinary model (one response per request) that calls square with
``exec(decoupled=True)`` and adds up what square streams back: for IN = n, square
sends n responses holding n, so SUM = n * n and COUNT = n. square must be loaded too.
An error from square (IN < 0) comes back as bls_decoupled's own error response.
"""

from __future__ import annotations

import numpy as np

import dlserve
from _common import ready_model, run_alone

MODEL = "bls_decoupled"
DEPENDENCIES = ["square"]  # the model bls_decoupled calls


def run(server: dlserve.Server) -> None:
    model = ready_model(server, MODEL)
    for dependency in DEPENDENCIES:
        ready_model(server, dependency)

    for n in (4, 1, 0, 7):
        (response,) = model.infer(inputs={"IN": np.array([n], dtype=np.int32)})
        total = int(np.from_dlpack(response.outputs["SUM"])[0])
        count = int(np.from_dlpack(response.outputs["COUNT"])[0])
        print(f"bls_decoupled({n}): square streamed {count} responses adding up to {total}")
        assert (total, count) == (n * n, n), f"bls_decoupled: wrong answer for {n}"

    # square refuses IN < 0; bls_decoupled passes its error on (code INVALID_ARG).
    try:
        list(model.infer(inputs={"IN": np.array([-3], dtype=np.int32)}))
    except dlserve.InvalidArgumentError as exc:
        print(f"bls_decoupled(-3) -> InvalidArgumentError: {exc}")
    else:
        raise AssertionError("bls_decoupled: IN = -3 was accepted")


if __name__ == "__main__":
    run_alone(run, MODEL, *DEPENDENCIES)
