"""Triton's classification extension (an output asked for with ``class_count``) through
unmodified tritonclient HTTP and gRPC, checked against what Triton 2.51 answered for the
same requests (tests/data/triton_reference/classification.json)."""

from __future__ import annotations

import json
import queue
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from dlserve import ModelControlMode
from dlserve.errors import InvalidArgumentError
from dlserve.frontends import KServeGrpc, KServeHttp
from dlserve.frontends.classification import labels, top_k
from dlserve.memory.dtypes import DataType
from dlserve.memory.tensor import Tensor

from ..conftest import frontend, serve

REFERENCE = json.loads(
    (Path(__file__).parents[1] / "data" / "triton_reference" / "classification.json").read_text()
)
SCORES = np.array(REFERENCE["input"]["data"], np.float32)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    yield from serve(tmp_path_factory, ["classifier", "classifier_nobatch"])


@pytest.fixture(scope="module")
def urls(server):
    for http_port in frontend(KServeHttp, server):
        for grpc_port in frontend(KServeGrpc, server):
            yield {"http": f"127.0.0.1:{http_port}", "grpc": f"127.0.0.1:{grpc_port}"}


def ask(urls, protocol: str, model: str, outputs: list, data: np.ndarray = SCORES):
    """What tritonclient reads back: per output (values, shape, datatype)."""
    module = httpclient if protocol == "http" else grpcclient
    with module.InferenceServerClient(urls[protocol]) as client:
        scores = module.InferInput("SCORES", list(data.shape), "FP32")
        scores.set_data_from_numpy(data)
        requested = [
            module.InferRequestedOutput(name, binary_data=binary, class_count=count)
            if protocol == "http"
            else module.InferRequestedOutput(name, class_count=count)
            for name, count, binary in outputs
        ]
        result = client.infer(model, [scores], outputs=requested)
        answer = {}
        for name, _, _ in outputs:
            array = result.as_numpy(name)
            output = result.get_output(name)
            datatype = output["datatype"] if protocol == "http" else output.datatype
            if array.dtype == object:  # bytes, or str when the output came as JSON
                values = [v.decode() if isinstance(v, bytes) else v for v in array.reshape(-1)]
            else:
                values = array.tolist()
            answer[name] = [values, list(array.shape), datatype]
        return answer


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("case", sorted(REFERENCE["cases"]))
def test_classification_answers_as_triton_does(urls, protocol, case):
    spec = REFERENCE["cases"][case]
    assert ask(urls, protocol, spec["model"], spec["outputs"]) == spec["triton"][protocol]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_negative_class_count_is_refused(urls, protocol):
    with pytest.raises(InferenceServerException) as caught:
        ask(urls, protocol, "classifier", [["PROBS", -1, True]])
    assert caught.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    assert caught.value.message() == {  # Triton 2.51's words (HTTP with its 500)
        "http": "Unable to set 'classification': attempt to access JSON "
        "non-unsigned-integer as unsigned-integer",
        "grpc": "invalid value for 'classification' parameter, expected >= 0",
    }[protocol]
    # the server stays up and answers the next request
    assert ask(urls, protocol, "classifier", [["PROBS", 1, True]])["PROBS"][1] == [2, 1]


def test_the_server_lists_the_extension(urls):
    with httpclient.InferenceServerClient(urls["http"]) as client:
        assert "classification" in client.get_server_metadata()["extensions"]


# -- top_k itself ----------------------------------------------------------------------------


def test_integers_print_as_integers_and_labels_stop_at_the_files_end():
    tensor = Tensor.from_object(np.array([[3, 9, 9, 1]], np.int64))
    out = top_k("OUT", tensor, 3, batched=True, labels=["a", "b"])
    assert out.data_type is DataType.BYTES and list(out.shape) == [1, 3]
    assert [v.decode() for v in out.as_numpy().reshape(-1)] == ["9:1:b", "9:2", "3:0:a"]


def test_unsigned_values_rank_by_value():
    tensor = Tensor.from_object(np.array([1, 255, 7], np.uint8))
    out = top_k("OUT", tensor, 2, batched=False, labels=[])
    assert [v.decode() for v in out.as_numpy()] == ["255:1", "7:2"]


@pytest.mark.parametrize("dtype", [np.float16, np.bool_, np.object_])
def test_types_without_an_order_triton_ranks_are_refused(dtype):
    values = np.array([b"x", b"y"], dtype) if dtype is np.object_ else np.array([0, 1], dtype)
    with pytest.raises(InvalidArgumentError, match="class result not available for output 'OUT'"):
        top_k("OUT", Tensor.from_object(values), 1, batched=False, labels=[])


def test_a_grpc_stream_classifies_too(urls):
    results: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(urls["grpc"]) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        scores = grpcclient.InferInput("SCORES", list(SCORES.shape), "FP32")
        scores.set_data_from_numpy(SCORES)
        outputs = [grpcclient.InferRequestedOutput("PROBS", class_count=2)]
        client.async_stream_infer("classifier", [scores], outputs=outputs)
        result, error = results.get(timeout=10)
        client.stop_stream()
    assert error is None
    expected = REFERENCE["cases"]["batched k=2 binary"]["triton"]["grpc"]["PROBS"]
    assert [v.decode() for v in result.as_numpy("PROBS").reshape(-1)] == expected[0]
    assert list(result.as_numpy("PROBS").shape) == expected[1]


def test_a_label_file_outside_the_model_directory_is_not_read(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "labels.txt").write_text("cat\ndog\r\n")
    (tmp_path / "secret.txt").write_text("not a label\n")
    assert labels(model_dir, "labels.txt") == ["cat", "dog"]
    with pytest.raises(InvalidArgumentError, match="lies outside the directory of its model"):
        labels(model_dir, "../secret.txt")
    with pytest.raises(InvalidArgumentError, match="'missing.txt' cannot be read"):
        labels(model_dir, "missing.txt")


def test_a_model_whose_label_file_is_missing_fails_to_load(servers, make_repo):
    """As in Triton 2.51 (measured), in its words: the model does not load READY and
    fail, or quietly go without labels, only once a client asks for a classification."""
    repo = make_repo("classifier")
    (repo / "classifier" / "labels.txt").unlink()
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    with pytest.raises(InvalidArgumentError) as info:
        server.load("classifier")
    missing = repo / "classifier" / "labels.txt"
    expected = f"Internal: failed to open text file for read {missing}: No such file or directory"
    assert expected in str(info.value)
    assert not server.model("classifier").ready()

