"""A model that writes into a tensor it was given, or refills one it has sent, changes
it for itself alone, as in Triton (whose stub copies inputs in, and outputs out at
send): a client's shared memory, a BLS caller's input, an ensemble's tensor another
step reads, and a response already sent keep their values. The tensors are bigger
than the inline limit, so they travel by reference."""

from __future__ import annotations

import json
import uuid
from multiprocessing import resource_tracker

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm

from dlserve.frontends import KServeHttp

from ..conftest import serve

LOADED = ["mutate_input", "mutate_twice", "bls", "identity", "refill", "negate"]
X = np.arange(1 << 14, dtype=np.float32)  # 64 KiB


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    # (opened for good by tritonclient's shared-memory utilities: before the leak check's
    # snapshot of this process's descriptors)
    resource_tracker.ensure_running()
    yield from serve(tmp_path_factory, LOADED)


@pytest.fixture(scope="module")
def client(server):
    options = KServeHttp.Options(address="127.0.0.1", port=0, allow_client_shm=True)
    service = KServeHttp(server, options)
    service.start()
    client = httpclient.InferenceServerClient(f"127.0.0.1:{service.port}")
    try:
        yield client
    finally:
        client.close()
        service.stop()


def test_a_model_writing_into_its_input_answers_what_it_wrote(server):
    (response,) = server.model("mutate_input").infer(inputs={"INPUT0": X})
    np.testing.assert_array_equal(np.from_dlpack(response.outputs["OUTPUT0"]), X + 1000)


def test_a_client_s_shared_memory_is_not_written_by_the_model(client):
    key = f"/in_place_{uuid.uuid4().hex[:8]}"
    region = shm.create_shared_memory_region("in_place_in", key, X.nbytes * 2)
    try:
        shm.set_shared_memory_region(region, [X])
        client.register_system_shared_memory("in_place_in", key, X.nbytes * 2)
        x = httpclient.InferInput("INPUT0", list(X.shape), "FP32")
        x.set_shared_memory("in_place_in", X.nbytes)
        out = httpclient.InferRequestedOutput("OUTPUT0")
        out.set_shared_memory("in_place_in", X.nbytes, offset=X.nbytes)  # (written for us)
        client.infer("mutate_input", [x], outputs=[out])
        np.testing.assert_array_equal(shm.get_contents_as_numpy(region, np.float32, X.shape), X)
        written = shm.get_contents_as_numpy(region, np.float32, X.shape, offset=X.nbytes)
        np.testing.assert_array_equal(written, X + 1000)
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(region)


def test_a_region_read_again_shows_what_its_owner_wrote_since(client):
    """A worker keeps the mapping of a big input no page of which it wrote, for the next
    request over the same range: that one must still show what the client wrote since,
    and a mapping the model wrote into is never handed out again."""
    n = 1 << 18  # 1 MiB of FP32: big enough for the worker to keep its mapping
    key = f"/in_place_{uuid.uuid4().hex[:8]}"
    region = shm.create_shared_memory_region("in_place_big", key, 4 * n)
    x = httpclient.InferInput("INPUT0", [n], "FP32")
    x.set_shared_memory("in_place_big", 4 * n)

    def answer(model: str, values: np.ndarray) -> np.ndarray:
        shm.set_shared_memory_region(region, [values])
        return client.infer(model, [x]).as_numpy("OUTPUT0")

    try:
        client.register_system_shared_memory("in_place_big", key, 4 * n)
        for step in range(3):  # (the second and third read the first one's mapping)
            values = np.full(n, step + 1, dtype=np.float32)
            np.testing.assert_array_equal(answer("negate", values), -values)
        for step in range(3):  # each written into: none is kept
            values = np.full(n, 10 * step, dtype=np.float32)
            np.testing.assert_array_equal(answer("mutate_input", values), values + 1000)
        values = np.arange(n, dtype=np.float32)
        np.testing.assert_array_equal(answer("negate", values), -values)
        assert client.is_server_live()
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(region)


def test_a_bls_caller_s_input_is_not_written_by_the_model_it_calls(server):
    (response,) = server.model("bls").infer(
        inputs={"INPUT0": X}, parameters={"route": "mutate_input", "mode": "check_input"}
    )
    info = json.loads(response.outputs["INFO"].to_bytes_array()[0])
    assert info["input_kept"], "the called model wrote into its caller's input"
    np.testing.assert_array_equal(np.from_dlpack(response.outputs["OUTPUT0"]), X + 1000)


def test_an_ensemble_step_sees_the_tensor_another_step_wrote_into_as_it_was(server):
    (response,) = server.model("mutate_twice").infer(inputs={"X": X})
    np.testing.assert_array_equal(np.from_dlpack(response.outputs["FIRST"]), X + 1000)
    np.testing.assert_array_equal(np.from_dlpack(response.outputs["SECOND"]), X + 1000)


def test_a_tensor_passed_on_unwritten_is_still_not_copied(server):
    """An identity model's output is its input, by reference."""
    tensor = server.allocate_tensor(list(X.shape), np.float32)
    np.from_dlpack(tensor)[:] = X
    (response,) = server.model("identity").infer(inputs={"INPUT0": tensor})
    assert response.outputs["OUTPUT0"].data_ptr == tensor.data_ptr


@pytest.mark.parametrize("buffer", ["empty", "input"])
def test_a_buffer_refilled_between_sends_reaches_each_response_as_sent(server, buffer):
    call = server.model("refill").infer(inputs={"INPUT0": X}, parameters={"buffer": buffer})
    responses = list(call)  # (all sent before any is read)
    sent = [np.from_dlpack(r.outputs["OUTPUT0"]) for r in responses if "OUTPUT0" in r.outputs]
    assert [np.unique(values).tolist() for values in sent] == [[i] for i in range(8)]
