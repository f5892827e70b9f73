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

from dlserve.frontends import KServeGrpc, KServeHttp

from ..conftest import frontend, serve

MODEL = "reshape_variable"


@pytest.fixture(scope="module")
def urls(tmp_path_factory: pytest.TempPathFactory):
    for server in serve(tmp_path_factory, [MODEL]):
        for http_port in frontend(KServeHttp, server):
            for grpc_port in frontend(KServeGrpc, server):
                yield {"http": f"127.0.0.1:{http_port}", "grpc": f"127.0.0.1:{grpc_port}"}


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
