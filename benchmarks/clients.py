"""tritonclient-based pieces of the benchmarks: each section's answer check (run on every server
before it is measured, so that a fast wrong answer cannot pass) and the decoupled streaming
client that counts responses per second."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

TINY, BIG = 1, (4 << 20) // 4  # FP32 elements in the BLS section: 4 B and 4 MiB
STREAM_LEN = 1000  # responses per request to the decoupled ``repeat`` model


def size(elements: int) -> str:
    """FP32 elements as a byte size: ``4 B``, ``4 KiB``, ``16 MiB``."""
    nbytes = 4 * elements
    if nbytes >= 1 << 20:
        return f"{nbytes >> 20} MiB"
    return f"{nbytes >> 10} KiB" if nbytes >= 1 << 10 else f"{nbytes} B"


def _grpc(url: str) -> Any:
    import tritonclient.grpc as grpcclient

    return grpcclient, grpcclient.InferenceServerClient(url)


def _checked(problems: list[str], client: Any, body: Any) -> list[str]:
    try:
        body()
    except Exception as error:  # noqa: BLE001 -- reported with the results
        problems.append(f"{type(error).__name__}: {str(error)[:300]}")
    finally:
        client.close()
    return problems


def check_add_sub(
    url: str, models: tuple[str, ...] = ("add_sub",), n: int = 16, batched: bool = False
) -> list[str]:
    """Problems in add_sub-like answers (OUTPUT0 = a + b, OUTPUT1 = a - b); empty when right."""
    grpcclient, client = _grpc(url)
    problems: list[str] = []
    shape = [1, n] if batched else [n]
    a = np.arange(n, dtype=np.float32).reshape(shape)
    b = np.full(shape, 0.5, np.float32)

    def body() -> None:
        for model in models:
            inputs = [grpcclient.InferInput(name, shape, "FP32") for name in ("INPUT0", "INPUT1")]
            inputs[0].set_data_from_numpy(a)
            inputs[1].set_data_from_numpy(b)
            result = client.infer(model, inputs)
            added, subtracted = result.as_numpy("OUTPUT0"), result.as_numpy("OUTPUT1")
            if not (np.array_equal(added, a + b) and np.array_equal(subtracted, a - b)):
                problems.append(f"{model}: wrong answer")

    return _checked(problems, client, body)


def check_identity(url: str, models: tuple[str, ...], sizes: tuple[int, ...]) -> list[str]:
    """Problems in identity-like answers (OUTPUT0 == INPUT0, FP32[n]) for each n in ``sizes``."""
    grpcclient, client = _grpc(url)
    problems: list[str] = []

    def body() -> None:
        for model in models:
            for n in sizes:
                x = np.random.default_rng(n).standard_normal(n, dtype=np.float32)
                tensor = grpcclient.InferInput("INPUT0", [n], "FP32")
                tensor.set_data_from_numpy(x)
                got = client.infer(model, [tensor]).as_numpy("OUTPUT0")
                if got is None or not np.array_equal(got, x):
                    problems.append(f"{model} {size(n)}: output differs from input")

    return _checked(problems, client, body)


def check_string_upper(url: str) -> list[str]:
    grpcclient, client = _grpc(url)
    problems: list[str] = []
    values = np.array([b"hello", "grüße".encode(), b"", b"x" * 300], dtype=np.object_)

    def body() -> None:
        tensor = grpcclient.InferInput("INPUT0", [len(values)], "BYTES")
        tensor.set_data_from_numpy(values)
        got = client.infer("string_upper", [tensor]).as_numpy("OUTPUT0")
        expected = [v.decode().upper().encode() for v in values]
        if got is None or list(got) != expected:
            problems.append(f"string_upper: {None if got is None else list(got)[:2]}...")

    return _checked(problems, client, body)


# ---------------------------------------------------------------- decoupled streaming


class Stream:
    """One gRPC stream to ``repeat``; ``request()`` sends IN and waits for the flag-only final."""

    def __init__(self, url: str, length: int) -> None:
        grpcclient, self.client = _grpc(url)
        self.values = np.arange(length, dtype=np.int32) * 3 + 1
        self.inputs = [grpcclient.InferInput("IN", [length], "INT32")]
        self.inputs[0].set_data_from_numpy(self.values)
        self.done = threading.Event()
        self.keep: list | None = None  # responses kept for checking (only when asked)
        self.count = 0
        self.first = 0.0
        self.error: str | None = None
        self.client.start_stream(self._on_response)

    def _on_response(self, result: Any, error: Any) -> None:
        if error is not None:
            self.error = str(error)
            self.done.set()
            return
        response = result.get_response()
        final = response.parameters["triton_final_response"].bool_param
        if final and not response.outputs:
            self.done.set()
            return
        if self.count == 0:
            self.first = time.perf_counter()
        self.count += 1
        if self.keep is not None:
            self.keep.append(result)
        if final:
            self.done.set()

    def request(self, check: bool = False) -> tuple[float, float]:
        """(seconds to the final, seconds to the first response) for one request."""
        self.done.clear()
        self.count, self.error = 0, None
        self.keep = [] if check else None
        start = time.perf_counter()
        self.client.async_stream_infer("repeat", self.inputs, enable_empty_final_response=True)
        if not self.done.wait(120):
            raise RuntimeError(
                f"repeat: no final response after 120 s ({self.count} responses so far)"
            )
        elapsed = time.perf_counter() - start
        if self.error:
            raise RuntimeError(f"repeat: {self.error}")
        if self.count != len(self.values):
            raise RuntimeError(f"repeat: {self.count} responses, expected {len(self.values)}")
        if check:
            out = np.concatenate([r.as_numpy("OUT") for r in self.keep or []])
            idx = np.concatenate([r.as_numpy("IDX") for r in self.keep or []])
            if not (
                np.array_equal(idx, np.arange(len(self.values)))
                and np.array_equal(out, self.values)
            ):
                raise RuntimeError("repeat: responses out of order or wrong values")
        return elapsed, self.first - start

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def streaming(url: str, seconds: float, length: int = STREAM_LEN) -> dict[str, float] | str:
    """Responses/s over ``seconds`` of back-to-back requests on one stream (after one checked
    warm-up request), or what went wrong."""
    try:
        stream = Stream(url, length)
    except Exception as error:  # noqa: BLE001 -- reported with the results
        return f"{type(error).__name__}: {error}"
    try:
        stream.request(check=True)
        times, firsts = [], []
        begin = time.perf_counter()
        while time.perf_counter() - begin < seconds or len(times) < 3:
            elapsed, first = stream.request()
            times.append(elapsed)
            firsts.append(first)
        wall = time.perf_counter() - begin
    except Exception as error:  # noqa: BLE001 -- reported with the results
        return f"{type(error).__name__}: {error}"
    finally:
        stream.close()
    return {
        "responses_per_s": len(times) * length / wall,
        "requests": len(times),
        "request_ms": 1e3 * float(np.median(times)),
        "first_ms": 1e3 * float(np.median(firsts)),
    }
