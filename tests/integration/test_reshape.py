"""A config's ``reshape`` with more than one variable dimension, through unmodified
tritonclient HTTP and gRPC: each variable dimension keeps its own size, both ways, as in
Triton 2.51 (side by side: an input [3,2,5] for dims [-1,2,-1] reshaped [-1,2,-1,1]
reaches the model as [3,2,5,1]), zero-sized ones too."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import dlserve
from dlserve.frontends import KServeGrpc, KServeHttp

from ..conftest import MODELS, frontend, serve, wait_until

MODEL = "reshape_variable"
BATCHED = "reshape_variable_batched"  # (its requests wait for a second one, 5 s at most)
BATCHING = "dynamic_batching { max_queue_delay_microseconds: 5000000 preferred_batch_size: 2 }\n"


@pytest.fixture(scope="module")
def urls(tmp_path_factory: pytest.TempPathFactory):
    for server in serve(tmp_path_factory, [MODEL]):
        for http_port in frontend(KServeHttp, server):
            for grpc_port in frontend(KServeGrpc, server):
                yield {"http": f"127.0.0.1:{http_port}", "grpc": f"127.0.0.1:{grpc_port}"}


@pytest.fixture
def batched_urls(servers, make_repo):
    """A server (HTTP only) with the model under a dynamic batcher."""
    files = {
        "config.pbtxt": (MODELS / MODEL / "config.pbtxt").read_text() + BATCHING,
        "1/model.py": (MODELS / MODEL / "1" / "model.py").read_text(),
    }
    server = servers.start(make_repo(extra={BATCHED: files}))
    wait_until(lambda: server.model(BATCHED).ready())
    for http_port in frontend(KServeHttp, server):
        yield {"http": f"127.0.0.1:{http_port}"}


def infer(urls: dict[str, str], protocol: str, x: np.ndarray, **kwargs):
    module = httpclient if protocol == "http" else grpcclient
    with module.InferenceServerClient(urls[protocol]) as client:
        tensor = module.InferInput("INPUT0", list(x.shape), "INT32")
        tensor.set_data_from_numpy(x)
        return client.infer(MODEL, [tensor], **kwargs)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("shape", [[2, 3, 2, 5], [1, 4, 2, 1], [1, 0, 2, 5], [3, 3, 2, 0]])
def test_each_variable_dimension_keeps_its_size(urls, protocol, shape):
    x = np.arange(np.prod(shape), dtype=np.int32).reshape(shape)
    result = infer(urls, protocol, x)
    assert result.as_numpy("SEEN_SHAPE").tolist() == [[*shape, 1]] * shape[0]
    out = result.as_numpy("OUTPUT0")
    assert out.shape == x.shape
    np.testing.assert_array_equal(out, x)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_output_its_reshape_cannot_take_fails_as_the_models_error(urls, protocol):
    x = np.zeros((1, 3, 2, 5), np.int32)
    with pytest.raises(InferenceServerException) as caught:
        infer(urls, protocol, x, parameters={"flatten": True})
    assert caught.value.status() == ("500" if protocol == "http" else "StatusCode.INTERNAL")
    assert caught.value.message() == (
        f"output 'OUTPUT0' of model '{MODEL}' has shape [1,30], which does not fit its "
        "reshape [-1,2,-1,1] (dims [-1,2,-1])"
    )
    assert infer(urls, protocol, x).as_numpy("OUTPUT0").shape == x.shape  # (still serving)


def test_an_output_its_reshape_cannot_take_fails_only_its_request_of_a_batch(batched_urls):
    """Batched with one whose output its reshape cannot take, a request gets its answer
    (it got the other's error: the whole batch failed)."""
    x = np.arange(3000, dtype=np.int32).reshape(1, 30, 2, 50)  # (outputs in shared memory)
    tensor = httpclient.InferInput("INPUT0", list(x.shape), "INT32")
    tensor.set_data_from_numpy(x)
    with httpclient.InferenceServerClient(batched_urls["http"], concurrency=2) as client:
        good, bad = (
            client.async_infer(BATCHED, [tensor], parameters=parameters)
            for parameters in (None, {"flatten": True})
        )
        np.testing.assert_array_equal(good.get_result().as_numpy("OUTPUT0"), x)
        with pytest.raises(InferenceServerException) as caught:
            bad.get_result()
        (stats,) = client.get_inference_statistics(BATCHED)["model_stats"]
    assert caught.value.status() == "500"
    assert caught.value.message() == (
        f"output 'OUTPUT0' of model '{BATCHED}' has shape [1,3000], which does not fit its "
        "reshape [-1,2,-1,1] (dims [-1,2,-1])"
    )
    batches = [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]]
    assert batches == [(2, 1)]
    assert stats["inference_stats"]["success"]["count"] == 2  # (a model's error, as Triton counts)


def test_a_refused_output_gives_the_workers_memory_back(servers, make_repo):
    """The worker's memory of a response refused for an output its reshape cannot take goes
    back at once: the server holds none of it (and the error holds no view of it)."""
    server = servers.start(make_repo(MODEL))
    x = np.zeros((1, 30, 2, 50), np.int32)  # (its flattened copy in the worker's arena)
    for _ in range(20):
        with pytest.raises(dlserve.InternalError, match="which does not fit its reshape") as caught:
            list(server.model(MODEL).infer(inputs={"INPUT0": x}, parameters={"flatten": True}))
        assert caught.value.__context__ is None and caught.value.__traceback__ is not None
    assert all(i.worker.peer.lease_count == 0 for i in server.engine.instances())
