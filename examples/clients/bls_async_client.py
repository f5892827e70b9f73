"""Client of the bls_async model: ``async def execute`` making two add_sub calls at once.

    python examples/clients/bls_async_client.py

For each request bls_async awaits ``add_sub(INPUT0, INPUT1)`` and
``add_sub(INPUT1, INPUT0)`` together (``async_exec()``), and returns OUTPUT0 =
INPUT0 + INPUT1 and OUTPUT1 = INPUT1 - INPUT0. add_sub must be loaded too. While its
calls are out, the instance takes more requests: several sent at once (here with
``async_infer`` on one event loop) are in the model together.
"""

from __future__ import annotations

import asyncio

import numpy as np

import dlserve
from _common import ready_model, run_alone

MODEL = "bls_async"
DEPENDENCIES = ["add_sub"]  # the model bls_async calls


def run(server: dlserve.Server) -> None:
    model = ready_model(server, MODEL)
    for dependency in DEPENDENCIES:
        ready_model(server, dependency)
    rng = np.random.default_rng(0)
    input0 = rng.random(4, dtype=np.float32)
    input1 = rng.random(4, dtype=np.float32)

    (response,) = model.infer(inputs={"INPUT0": input0, "INPUT1": input1})
    output0 = np.from_dlpack(response.outputs["OUTPUT0"])
    output1 = np.from_dlpack(response.outputs["OUTPUT1"])
    print(f"bls_async: OUTPUT0 {output0} (INPUT0 + INPUT1), OUTPUT1 {output1} (INPUT1 - INPUT0)")
    assert np.allclose(output0, input0 + input1), "bls_async: wrong sum"
    assert np.allclose(output1, input1 - input0), "bls_async: wrong difference"

    # Eight requests in flight at once, from asyncio: each one's answer is its own.
    async def one(i: int) -> tuple[np.ndarray, ...]:
        a, b = input0 * i, input1 + i
        (only,) = [r async for r in model.async_infer(inputs={"INPUT0": a, "INPUT1": b})]
        outputs = only.outputs
        return a, b, np.from_dlpack(outputs["OUTPUT0"]), np.from_dlpack(outputs["OUTPUT1"])

    async def many() -> list[tuple[np.ndarray, ...]]:
        return await asyncio.gather(*(one(i) for i in range(8)))

    answers = asyncio.run(many())
    for a, b, total, difference in answers:
        assert np.allclose(total, a + b), "bls_async: wrong sum in a concurrent request"
        assert np.allclose(difference, b - a), "bls_async: wrong difference in a concurrent request"
    print(f"bls_async: {len(answers)} concurrent requests, each answered right")


if __name__ == "__main__":
    run_alone(run, MODEL, *DEPENDENCIES)
