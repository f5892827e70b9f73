"""Client of the square model: a decoupled ``async def execute`` model over gRPC streaming.

    python examples/clients/square_client.py

For IN = n, square streams n responses each holding n; the last one carries the
final flag itself. IN = 0 gets only a flag-only final, and IN < 0 an error response
(INVALID_ARG). This client puts a KServe gRPC service (on a free port) in front of
the server it is given and streams to it twice: with tritonclient's sync client
(``start_stream`` / ``async_stream_infer``) and with its asyncio client
(``tritonclient.grpc.aio``, ``stream_infer`` over an async iterator of requests).
"""

from __future__ import annotations

import asyncio
import queue

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient

import dlserve
from _common import client_inputs, frontend, ready_model, run_alone
from dlserve.frontends import KServeGrpc

MODEL = "square"
TIMEOUT = 30  # seconds to wait for any one response


def square_input(n: int) -> list[grpcclient.InferInput]:
    return client_inputs(grpcclient, IN=np.array([n], dtype=np.int32))


def is_final(result: grpcclient.InferResult) -> bool:
    """Every streamed response says whether it is its request's last one."""
    return result.get_response().parameters["triton_final_response"].bool_param


def stream_with_the_sync_client(url: str) -> None:
    ns = [3, 0, 2]
    results: queue.SimpleQueue = queue.SimpleQueue()
    with grpcclient.InferenceServerClient(url) as client:
        # The callback runs on tritonclient's stream thread, once per response (or error).
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        try:
            # enable_empty_final_response: IN = 0 gets its flag-only final too (a
            # response without outputs); without it, that request would get nothing.
            for n in ns:
                client.async_stream_infer(
                    MODEL, square_input(n), request_id=f"n={n}", enable_empty_final_response=True
                )
            client.async_stream_infer(MODEL, square_input(-1), request_id="n=-1")
            received: dict[str, list] = {f"n={n}": [] for n in ns}
            errors = []
            open_requests = set(received) | {"n=-1"}
            while open_requests:
                result, error = results.get(timeout=TIMEOUT)
                if error is not None:  # an error response: the stream itself stays open
                    errors.append(error.message())
                    open_requests.remove("n=-1")
                    continue
                request_id = result.get_response().id
                out = result.as_numpy("OUT")  # None in a flag-only final
                value = None if out is None else int(out[0])
                received[request_id].append((value, is_final(result)))
                if is_final(result):
                    open_requests.remove(request_id)
        finally:
            client.stop_stream()
    for n in ns:
        print(f"square({n}) streamed (OUT, final) {received[f'n={n}']}")
    print(f"square(-1) -> error: {errors[0]}")
    # n responses of n, the last one final; for n = 0 just the flag-only final.
    assert received["n=3"] == [(3, False), (3, False), (3, True)], "square: wrong stream for 3"
    assert received["n=2"] == [(2, False), (2, True)], "square: wrong stream for 2"
    assert received["n=0"] == [(None, True)], "square: wrong stream for 0"
    assert errors == ["IN must be >= 0, got -1"], "square: wrong error for -1"


async def stream_with_the_aio_client(url: str) -> None:
    ns = [4, 0, 1]

    async def requests():
        # One dict per request: async_stream_infer's arguments. No
        # enable_empty_final_response this time, so IN = 0 gets no response at all.
        for n in ns:
            yield {"model_name": MODEL, "inputs": square_input(n), "request_id": f"n={n}"}

    received: dict[str, list[int]] = {f"n={n}": [] for n in ns}
    async with aioclient.InferenceServerClient(url) as client:
        # The response stream ends once the requests are all sent and all answered.
        async for result, error in client.stream_infer(requests(), stream_timeout=TIMEOUT):
            if error is not None:
                raise error
            received[result.get_response().id].append(int(result.as_numpy("OUT")[0]))
    print(f"aio stream: square({ns}) -> {received}")
    assert received == {"n=4": [4, 4, 4, 4], "n=0": [], "n=1": [1]}, "square: wrong aio stream"


def run(server: dlserve.Server) -> None:
    ready_model(server, MODEL)
    with frontend(server, KServeGrpc) as url:
        stream_with_the_sync_client(url)
        asyncio.run(stream_with_the_aio_client(url))


if __name__ == "__main__":
    run_alone(run, MODEL)
