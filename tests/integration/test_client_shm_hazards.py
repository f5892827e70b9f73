"""What a client can do to its own registered shared memory behind the server's back:
shrink the object while a request uses it (touching it would be a SIGBUS that kills
the server: the requests concerned fail with a clear error instead, and the server
serves on), or remove it and create another object under the same key (a region
keeps meaning the object it was registered on, as in Triton), or unregister a region
a request still uses (refused in Triton's words: the request finishes, its output lands
where the client was promised, and no mapping outlives the region)."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
import uuid

import gevent
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from dlserve.frontends import KServeHttp

from ..conftest import MODELS

N = 1 << 14  # FP32 values: 64 KiB, passed by reference (not inline)


@pytest.fixture
def url(servers, make_repo):
    server = servers.start(make_repo("identity", "faulty"))
    service = KServeHttp(server, KServeHttp.Options(address="127.0.0.1", port=0, allow_client_shm=True))
    service.start()
    try:
        yield f"127.0.0.1:{service.port}"
    finally:
        service.stop()


@pytest.fixture
def client(url):
    client = httpclient.InferenceServerClient(url, network_timeout=60, concurrency=2)
    try:
        yield client
    finally:
        client.unregister_system_shared_memory()
        client.close()


@pytest.fixture
def key():
    name = f"client_shm_test_{uuid.uuid4().hex[:8]}"
    yield name
    if os.path.exists(f"/dev/shm/{name}"):
        os.unlink(f"/dev/shm/{name}")


def make_object(key: str, values: np.ndarray) -> None:
    with open(f"/dev/shm/{key}", "wb") as f:
        f.write(values.tobytes())


def input_in(region: str) -> httpclient.InferInput:
    tensor = httpclient.InferInput("INPUT0", [N], "FP32")
    tensor.set_shared_memory(region, N * 4)
    return tensor


def assert_serving(client: httpclient.InferenceServerClient) -> None:
    tensor = httpclient.InferInput("INPUT0", [3], "FP32")
    tensor.set_data_from_numpy(np.arange(3, dtype=np.float32))
    np.testing.assert_array_equal(client.infer("identity", [tensor]).as_numpy("OUTPUT0"), np.arange(3))


def test_an_object_shrunk_while_its_request_runs_fails_that_request_not_the_server(client, key):
    make_object(key, np.ones(N, np.float32))
    client.register_system_shared_memory("in", f"/{key}", N * 4)
    # The model hands its input back: the answer refers to the client's object, which
    # the server would read to write the response; it is shrunk while the model sleeps.
    shrink = threading.Timer(0.5, os.truncate, (f"/dev/shm/{key}", 0))
    shrink.start()
    with pytest.raises(InferenceServerException, match="a shared memory region the request uses was shrunk"):
        client.infer("faulty", [input_in("in")], parameters={"mode": "sleep:1.5"})
    shrink.join()
    assert_serving(client)
    with pytest.raises(InferenceServerException, match="'in' was shrunk by its owner"):
        client.infer("identity", [input_in("in")])  # already shrunk: refused before it runs
    client.unregister_system_shared_memory("in")
    make_object(key, np.full(N, 2.0, np.float32))
    client.register_system_shared_memory("in", f"/{key}", N * 4)
    np.testing.assert_array_equal(client.infer("identity", [input_in("in")]).as_numpy("OUTPUT0"), 2.0)
    # Shrunk to half: what lies in the half that is left still serves (as in Triton).
    os.truncate(f"/dev/shm/{key}", N * 2)
    half = httpclient.InferInput("INPUT0", [N // 2], "FP32")
    half.set_shared_memory("in", N * 2)
    np.testing.assert_array_equal(client.infer("identity", [half]).as_numpy("OUTPUT0"), 2.0)
    with pytest.raises(InferenceServerException, match="'in' was shrunk by its owner"):
        client.infer("identity", [input_in("in")])


@pytest.mark.parametrize("use", ["input", "output"])
def test_a_region_keeps_meaning_the_object_it_was_registered_on(client, key, use):
    """As in Triton: the client may remove its object once registered, or create
    another under the same key; the region still reads and writes the first."""
    make_object(key, np.ones(N, np.float32))
    client.register_system_shared_memory("A", f"/{key}", N * 4)
    os.unlink(f"/dev/shm/{key}")  # "create, register, remove": nothing left in /dev/shm
    tensor = input_in("A") if use == "input" else httpclient.InferInput("INPUT0", [N], "FP32")
    output = httpclient.InferRequestedOutput("OUTPUT0")
    if use == "output":
        tensor.set_data_from_numpy(np.full(N, 3.0, np.float32))
        output.set_shared_memory("A", N * 4)
    result = client.infer("identity", [tensor], outputs=[output])
    if use == "input":
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 1.0)  # A's object, removed
    make_object(key, np.full(N, 9.0, np.float32))  # another object under the same key
    client.register_system_shared_memory("B", f"/{key}", N * 4)
    result = client.infer("identity", [tensor], outputs=[output])
    if use == "input":
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 1.0)  # still A's object
    assert np.array_equal(np.fromfile(f"/dev/shm/{key}", np.float32), np.full(N, 9.0, np.float32))
    np.testing.assert_array_equal(client.infer("identity", [input_in("B")]).as_numpy("OUTPUT0"), 9.0)
    client.unregister_system_shared_memory("A")
    client.register_system_shared_memory("A", f"/{key}", N * 4)  # registered again: the new object
    np.testing.assert_array_equal(client.infer("identity", [input_in("A")]).as_numpy("OUTPUT0"), 9.0)
    assert_serving(client)


def test_a_region_in_use_cannot_be_unregistered(client, url, key):
    make_object(key, np.ones(2 * N, np.float32))
    client.register_system_shared_memory("io", f"/{key}", 2 * N * 4)
    client.register_system_shared_memory("idle", f"/{key}", 4)
    output = httpclient.InferRequestedOutput("OUTPUT0")
    output.set_shared_memory("io", N * 4, offset=N * 4)
    tensor = httpclient.InferInput("INPUT0", [N], "FP32")
    tensor.set_shared_memory("io", N * 4)
    running = client.async_infer("faulty", [tensor], outputs=[output], parameters={"mode": "sleep:1.0"})
    gevent.sleep(0.4)  # (tritonclient's greenlet sends it meanwhile; the model sleeps 1 s)
    with pytest.raises(InferenceServerException) as info:
        client.unregister_system_shared_memory("io")
    assert info.value.status() == "500"
    assert info.value.message() == "Cannot unregister shared memory region 'io', it is currently in use."
    with pytest.raises(InferenceServerException) as info:
        client.unregister_system_shared_memory()  # the others go, the one in use stays
    assert info.value.message() == "Failed to unregister the following system shared memory regions: io ,"
    assert [r["name"] for r in client.get_system_shared_memory_status()] == ["io"]
    running.get_result()  # the request finished well
    np.testing.assert_array_equal(np.fromfile(f"/dev/shm/{key}", np.float32)[N:], 1.0)
    client.unregister_system_shared_memory("io")  # done: it goes now
    assert client.get_system_shared_memory_status() == []
    assert_serving(client)  # (and the harness checks that no descriptor or mapping is left)



def test_a_region_is_free_as_soon_as_the_answer_of_the_request_using_it_arrives(client, key):
    """The worker gives back its view of a request's input in the frame of its reply, so
    by the time the client has the answer the server holds nothing of the region: an
    unregister right after it is never refused as "in use"."""
    make_object(key, np.full(N, 2.0, np.float32))
    for _ in range(100):
        client.register_system_shared_memory("r", f"/{key}", N * 4)
        answer = client.infer("identity", [input_in("r")])
        np.testing.assert_array_equal(answer.as_numpy("OUTPUT0"), 2.0)
        client.unregister_system_shared_memory("r")
    assert client.get_system_shared_memory_status() == []


@pytest.mark.parametrize("use", ["input", "output"])
def test_a_request_refused_by_its_worker_leaves_its_region_free(client, url, key, use):
    """The region passes the server's check, the request waits behind a busy instance,
    the client shrinks its object meanwhile and the worker refuses it: the request fails
    and the region can be unregistered (the server held its reference for good)."""
    make_object(key, np.ones(N, np.float32))
    client.register_system_shared_memory("q", f"/{key}", N * 4)
    body = {
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1], "data": [1]}],
        "parameters": {"mode": "sleep:1.5"},
    }
    request = urllib.request.Request(f"http://{url}/v2/models/faulty/infer", data=json.dumps(body).encode())
    busy = threading.Thread(target=lambda: urllib.request.urlopen(request, timeout=30).read())
    busy.start()  # (its own client: tritonclient's is gevent's, one thread)
    time.sleep(0.3)  # faulty's one instance sleeps now; the next request queues behind it
    outputs = None
    if use == "input":
        tensor = input_in("q")
    else:
        tensor = httpclient.InferInput("INPUT0", [N], "FP32")
        tensor.set_data_from_numpy(np.full(N, 2.0, np.float32))
        outputs = [httpclient.InferRequestedOutput("OUTPUT0")]
        outputs[0].set_shared_memory("q", N * 4)
    shrink = threading.Timer(0.5, os.truncate, (f"/dev/shm/{key}", 0))
    shrink.start()
    with pytest.raises(InferenceServerException, match="shrunk by its owner"):
        client.infer("faulty", [tensor], outputs=outputs)
    busy.join()
    shrink.join()
    client.unregister_system_shared_memory("q")  # refused as "in use" before
    assert client.get_system_shared_memory_status() == []
    assert_serving(client)


def test_a_key_that_is_a_link_or_a_folder_is_not_opened(client, key, tmp_path):
    """As shm_open does (O_NOFOLLOW): a symbolic link in /dev/shm would otherwise map,
    for anyone who can register a region, any file the server can open."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"SECRET!!" * 16)
    os.symlink(secret, f"/dev/shm/{key}")
    with pytest.raises(InferenceServerException, match=f"Unable to open shared memory region: '/{key}'"):
        client.register_system_shared_memory("link", f"/{key}", 64)
    os.unlink(f"/dev/shm/{key}")
    os.mkdir(f"/dev/shm/{key}")
    try:
        with pytest.raises(InferenceServerException, match=f"Unable to open shared memory region: '/{key}'"):
            client.register_system_shared_memory("folder", f"/{key}", 64)
    finally:
        os.rmdir(f"/dev/shm/{key}")
    assert client.get_system_shared_memory_status() == []
    assert_serving(client)


def test_an_answered_request_does_not_hold_its_region_until_its_queue_deadline(servers, make_repo, key):
    """A queue policy's timeout applies while the request waits: once it ran, nothing
    holds it (and the client's region it read) until the deadline, 60 s later."""
    timed = (MODELS / "identity" / "config.pbtxt").read_text() + (
        "dynamic_batching { default_queue_policy { default_timeout_microseconds: 60000000 } }\n"
    )
    repo = make_repo(
        extra={"timed": {"config.pbtxt": timed, "1/model.py": (MODELS / "identity" / "1" / "model.py").read_text()}}
    )
    server = servers.start(repo)
    service = KServeHttp(server, KServeHttp.Options(address="127.0.0.1", port=0, allow_client_shm=True))
    service.start()
    client = httpclient.InferenceServerClient(f"127.0.0.1:{service.port}", network_timeout=60)
    try:
        make_object(key, np.full(N, 5.0, np.float32))
        client.register_system_shared_memory("held", f"/{key}", N * 4)
        for _ in range(3):
            np.testing.assert_array_equal(client.infer("timed", [input_in("held")]).as_numpy("OUTPUT0"), 5.0)
        client.unregister_system_shared_memory("held")  # "currently in use" for 60 s before
        assert client.get_system_shared_memory_status() == []
    finally:
        client.close()
        service.stop()
