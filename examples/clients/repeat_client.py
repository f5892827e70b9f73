"""Client of the repeat model: a decoupled model streamed over gRPC with tritonclient.

    python examples/clients/repeat_client.py

repeat answers one request with one response per element of IN (OUT = the element,
IDX = its index), then a flag-only final. Decoupled models cannot be called with a
plain (unary) ModelInfer: they are streamed over gRPC's bidirectional
ModelStreamInfer. This client puts a KServe gRPC service (on a free port) in front of
the server it is given and uses tritonclient's stream: ``start_stream(callback)``,
``async_stream_infer(...)`` for each request, ``stop_stream()``. It then starts a long
request and cancels it after two responses, and shows the server is unharmed.
"""

from __future__ import annotations

import queue
import time

import numpy as np
import tritonclient.grpc as grpcclient

import dlserve
from _common import client_inputs, frontend, ready_model, run_alone
from dlserve.frontends import KServeGrpc

MODEL = "repeat"
TIMEOUT = 30  # seconds to wait for any one response


def repeat_inputs(values, delays_ms=None) -> list[grpcclient.InferInput]:
    """IN (INT32) and, if given, DELAY (UINT32: milliseconds before each response)."""
    arrays = {"IN": np.array(values, dtype=np.int32)}
    if delays_ms is not None:
        arrays["DELAY"] = np.array(delays_ms, dtype=np.uint32)
    return client_inputs(grpcclient, **arrays)


def is_final(result: grpcclient.InferResult) -> bool:
    """Every streamed response says whether it is its request's last one."""
    return result.get_response().parameters["triton_final_response"].bool_param


def stream_two_requests(client: grpcclient.InferenceServerClient) -> None:
    # The callback runs on tritonclient's stream thread, once per response (or error).
    results: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    requests = {"a": [10, 20, 30], "b": [7, 8]}
    try:
        # Both requests go out on the one stream; their responses may interleave.
        # enable_empty_final_response: also send the flag-only final (a response with
        # no outputs), so the client sees where each request ends.
        client.async_stream_infer(
            MODEL, repeat_inputs(requests["a"]), request_id="a", enable_empty_final_response=True
        )
        client.async_stream_infer(
            MODEL, repeat_inputs(requests["b"], delays_ms=[5, 5]), request_id="b",
            enable_empty_final_response=True,
        )
        received: dict[str, list] = {"a": [], "b": []}
        open_requests = set(requests)
        while open_requests:
            result, error = results.get(timeout=TIMEOUT)
            if error is not None:
                raise error
            request_id = result.get_response().id
            if is_final(result):
                assert result.get_response().outputs == [], "repeat: the final has outputs"
                open_requests.remove(request_id)
                continue
            out, idx = result.as_numpy("OUT"), result.as_numpy("IDX")
            assert out.dtype == np.int32 and idx.dtype == np.uint32, "repeat: wrong types"
            received[request_id].append((int(out[0]), int(idx[0])))
    finally:
        client.stop_stream()  # waits for the stream to end
    for request_id, values in requests.items():
        got = received[request_id]
        print(f"repeat({values}) streamed (OUT, IDX) {got}, then a flag-only final")
        assert got == [(v, i) for i, v in enumerate(values)], "repeat: wrong stream"


def cancel_a_long_request(client: grpcclient.InferenceServerClient) -> None:
    results: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    # 50 responses, 20 ms apart: a second in all, unless it is cancelled.
    values = list(range(100, 150))
    client.async_stream_infer(
        MODEL, repeat_inputs(values, delays_ms=[20] * len(values)), request_id="long",
        enable_empty_final_response=True,
    )
    try:
        first_two = []
        for _ in range(2):
            result, error = results.get(timeout=TIMEOUT)
            if error is not None:
                raise error
            first_two.append(int(result.as_numpy("OUT")[0]))
    finally:
        # Closes the stream at once: the server cancels the requests still running on
        # it, so the model's request.is_cancelled() turns True and it stops early.
        client.stop_stream(cancel_requests=True)
    print(f"repeat(50 values, 20 ms apart): got {first_two}, then cancelled the stream")
    assert first_two == [100, 101], "repeat: wrong first responses"
    # stop_stream() returns once the callback has seen the last of the stream: perhaps
    # a response or two that were already on their way, then the stream's own
    # CANCELLED error. The request's later responses and its final never come.
    rest = []
    while not results.empty():
        rest.append(results.get())
    *late, (_, cancelled) = rest
    late_values = [int(result.as_numpy("OUT")[0]) for result, _ in late]
    assert cancelled is not None and cancelled.status() == "StatusCode.CANCELLED", (
        "repeat: the stream did not end CANCELLED"
    )
    print(f"repeat: after them {late_values}, then {cancelled.status()}")
    assert late_values == values[2 : 2 + len(late)] and len(late) < 10, "repeat: late responses"


def run(server: dlserve.Server) -> None:
    ready_model(server, MODEL)
    with frontend(server, KServeGrpc) as url, grpcclient.InferenceServerClient(url) as client:
        stream_two_requests(client)

        before = client.get_inference_statistics(MODEL).model_stats[0].inference_stats
        cancel_a_long_request(client)

        # The server is fine: live, the model ready, and the next stream works as before.
        # (Not is_server_ready(): it is False while any model of the server failed to
        # load, as when run_examples.py runs without a framework installed.)
        assert client.is_server_live() and client.is_model_ready(MODEL), "repeat: not ready"
        stream_two_requests(client)
        # A request answered from the model's thread counts when its execute returns, as
        # in Triton's statistics: the cancelled one is a success, like the two after it.
        deadline = time.monotonic() + TIMEOUT
        while True:
            after = client.get_inference_statistics(MODEL).model_stats[0].inference_stats
            failed = after.fail.count - before.fail.count
            succeeded = after.success.count - before.success.count
            if succeeded >= 3 or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        print(f"repeat: the server counted {succeeded} successes (the cancelled request, "
              f"whose execute had returned, and the 2 after it) and {failed} failures")
        assert failed == 0 and succeeded == 3, "repeat: unexpected statistics"


if __name__ == "__main__":
    run_alone(run, MODEL)
