"""BLS and the memory its tensors live in (upstream's bls_memory, bls_memory_async and
test_bls_tensor_lifecycle, measured against Triton 2.51): outputs the callee returns by
reference reach every kind of caller, a long execute gives back each call's memory as it
goes, and a response iterator resumes, or is dropped, as Triton's does.
"""

from __future__ import annotations

import glob
import json
import threading

import numpy as np
import pytest

import dlserve

from ..conftest import wait_until

CONFIG = """
backend: "python"
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "INFO" data_type: TYPE_STRING dims: [ 1 ] } ]
"""

COMMON = '''
import asyncio
import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

SIZE = 16384  # 64 KiB of FP32: travels by reference, and identity hands it back so


def identity_call(value):
    data = np.full(SIZE, value, np.float32)
    return pb_utils.InferenceRequest(
        model_name="identity", inputs=[pb_utils.Tensor("INPUT0", data)], requested_output_names=["OUTPUT0"]
    )


def outcome(answer, value):
    if answer.has_error():
        return "error: " + answer.error().message()
    out = pb_utils.get_output_tensor_by_name(answer, "OUTPUT0").as_numpy()
    return "ok" if out.shape == (SIZE,) and (out == value).all() else "wrong data"


def info(text):
    return pb_utils.InferenceResponse([pb_utils.Tensor("INFO", np.array([text.encode()], np.object_))])
'''

ASYNC_CALLER = COMMON + '''

class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            answers = await asyncio.gather(*(identity_call(v).async_exec() for v in range(n)))
            responses.append(info(json.dumps([outcome(a, v) for v, a in enumerate(answers)])))
        return responses
'''

THREAD_CALLER = COMMON + '''

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            threading.Thread(target=self.calls, args=(request, n)).start()
        return None

    def calls(self, request, n):
        said = [outcome(identity_call(v).exec(), v) for v in range(n)]
        sender = request.get_response_sender()
        sender.send(info(json.dumps(said)), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''

LONG_CALLER = COMMON + '''

def shm_mapped():
    """How many shared-memory files this process maps now."""
    with open("/proc/self/maps") as maps:
        return len({line.split()[-1] for line in maps if "/dev/shm/" in line})


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            before, said = shm_mapped(), set()
            for v in range(n):
                data = np.full(1 << 20, v, np.float32)  # 4 MiB, dropped after each call
                answer = pb_utils.InferenceRequest(
                    model_name="identity", inputs=[pb_utils.Tensor("INPUT0", data)],
                    requested_output_names=["OUTPUT0"],
                ).exec()
                said.add(outcome(answer, v) if answer.has_error() else "ok")
            responses.append(info(json.dumps({"said": sorted(said), "grew": shm_mapped() - before})))
        return responses
'''

ITERATING_CALLER = COMMON + '''

def value(response):
    out = pb_utils.get_output_tensor_by_name(response, "OUT")
    return None if out is None else int(out.as_numpy()[0])


class TritonPythonModel:
    def execute(self, requests):
        call = pb_utils.InferenceRequest(
            model_name="decoupled", inputs=[pb_utils.Tensor("IN", np.arange(10, 15, dtype=np.int32))],
            requested_output_names=["OUT"],
        )
        responses = call.exec(decoupled=True)
        whole = [value(r) for r in responses]
        again = []
        for r in responses:
            again.append(value(r))
            if len(again) == 2:
                break
        following = value(next(responses))
        resumed = [value(r) for r in responses]
        said = {"whole": whole, "again": again, "next": following, "resumed": resumed}
        return [info(json.dumps(said)) for _ in requests]
'''


def ask(server, model: str, n: int) -> object:
    (response,) = server.model(model).infer(inputs={"N": np.array([n], np.int32)})
    return json.loads(response.outputs["INFO"].to_bytes_array()[0])


def repo_with(make_repo, name: str, source: str, config: str = CONFIG) -> object:
    return make_repo("identity", "decoupled", extra={name: {"config.pbtxt": config, "1/model.py": source}})


def test_outputs_returned_by_reference_reach_an_async_caller(servers, make_repo):
    """upstream bls_memory_async: the callee hands the caller's own input back; a RELEASE
    the server sends right behind the answer must not drop that memory before the caller
    has it (dlserve failed 2-8 of 8 gathered calls: 'no longer held')."""
    server = servers.start(repo_with(make_repo, "async_caller", ASYNC_CALLER))
    for _ in range(10):
        assert ask(server, "async_caller", 8) == ["ok"] * 8


def test_outputs_returned_by_reference_reach_a_callers_thread(servers, make_repo):
    decoupled = CONFIG + "model_transaction_policy { decoupled: true }\n"
    server = servers.start(repo_with(make_repo, "thread_caller", THREAD_CALLER, decoupled))
    for _ in range(5):
        assert ask(server, "thread_caller", 20) == ["ok"] * 20


def test_a_long_execute_gives_back_each_calls_memory_as_it_goes(servers, make_repo):
    """upstream test_bls_tensor_lifecycle: 30 calls of 4 MiB in one execute, each result
    dropped. The memory of each goes back while the execute runs (it was held until the
    execute returned: the worker's arena grew by every call)."""
    server = servers.start(repo_with(make_repo, "long_caller", LONG_CALLER))
    said = ask(server, "long_caller", 30)
    assert said["said"] == ["ok"]
    assert said["grew"] <= 1  # (one more segment may come; 30 × 4 MiB would be ~8)


RAISING_CALLER = COMMON + '''

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            data = np.full(1 << 18, n, np.float32)  # 1 MiB of its own arena, for each call
            answer = pb_utils.InferenceRequest(
                model_name="faulty", inputs=[pb_utils.Tensor("INPUT0", data)],
                requested_output_names=["OUTPUT0"], parameters={"mode": "raise"},
            ).exec()
            if answer.has_error():  # raised, not returned
                raise pb_utils.TritonModelException(answer.error().message())
        return []
'''


def arena_metric(server: dlserve.Server, name: str) -> int:
    prefix = f"dlserve_shm_arena_{name} "
    (line,) = [line for line in server.metrics().splitlines() if line.startswith(prefix)]
    return int(float(line.split()[1]))


def test_failing_calls_of_a_caller_that_raises_give_all_their_memory_back(servers, make_repo):
    """Triton's issue 7481 (shared memory leaking in BLS, where callers raise the callee's
    error rather than return it): 40 calls of 1 MiB from the caller's arena to a callee
    that raises, each caller raising in turn, leave no block held anywhere: the caller's
    arena did not grow, no worker holds a lease, and the server's arena, as its metrics
    say, has nothing in use."""
    raiser = {"config.pbtxt": CONFIG, "1/model.py": RAISING_CALLER}
    repo = make_repo("faulty", extra={"raiser": raiser})
    server = servers.start(repo)
    held = server.allocate_tensor([1 << 18], np.float32)  # the metrics follow the arena
    assert arena_metric(server, "used_bytes") >= 1 << 20
    del held
    assert arena_metric(server, "used_bytes") == 0
    segments = sorted(glob.glob(f"/dev/shm/{server.engine.segment_prefix}_w*"))
    for n in range(40):
        with pytest.raises(dlserve.InternalError, match="ValueError: boom"):
            list(server.model("raiser").infer(inputs={"N": np.array([n], np.int32)}))
    assert sorted(glob.glob(f"/dev/shm/{server.engine.segment_prefix}_w*")) == segments
    assert all(i.worker.peer.lease_count == 0 for i in server.engine.instances())
    assert arena_metric(server, "used_bytes") == 0
    assert arena_metric(server, "reserved_bytes") == server.options.shm_arena_size


def test_a_response_iterator_resumes_a_loop_left_early_as_triton_s_does(servers, make_repo):
    """Triton's iterator starts over only once a pass has reached its end; a loop left
    with ``break`` resumes where it stopped (upstream test_response_iterator)."""
    server = servers.start(repo_with(make_repo, "iterating_caller", ITERATING_CALLER))
    said = ask(server, "iterating_caller", 0)
    assert said == {
        "whole": [10, 11, 12, 13, 14, None],  # the last, flags-only final, has no output
        "again": [10, 11],
        "next": 12,
        "resumed": [13, 14, None],
    }


STREAMER = '''
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            sender, sent = request.get_response_sender(), 0
            for v in range(n):
                time.sleep(0.05)
                if request.is_cancelled():
                    break
                big = pb_utils.Tensor("BIG", np.full(2048, v, np.float32))  # (by reference)
                sender.send(pb_utils.InferenceResponse([big]))
                sent += 1
            with open(REPORT, "w") as report:
                report.write(f"sent {sent} of {n}, cancelled={request.is_cancelled()}")
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''
STREAMER_CONFIG = """
backend: "python"
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "BIG" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""
DROPPING_CALLER = COMMON + '''

class TritonPythonModel:
    def execute(self, requests):
        n = pb_utils.get_input_tensor_by_name(requests[0], "N")
        responses = pb_utils.InferenceRequest(
            model_name="streamer", inputs=[n], requested_output_names=["BIG"]
        ).exec(decoupled=True)
        first = pb_utils.get_output_tensor_by_name(next(responses), "BIG").as_numpy()[0]
        del responses  # stops reading: the call goes on
        return [info(json.dumps({"first": float(first)})) for _ in requests]
'''


def test_a_response_iterator_dropped_early_lets_the_callee_run_on(servers, make_repo, tmp_path):
    """As Triton's, a caller that drops its iterator after one response does not cancel
    the call (dlserve's did): the callee sends all it would have, and the memory of the
    responses nobody reads goes back."""
    report = tmp_path / "streamer.txt"
    streamer = f"REPORT = {str(report)!r}\n" + STREAMER
    server = servers.start(make_repo(extra={
        "streamer": {"config.pbtxt": STREAMER_CONFIG, "1/model.py": streamer},
        "caller": {"config.pbtxt": CONFIG, "1/model.py": DROPPING_CALLER},
    }))
    assert ask(server, "caller", 5) == {"first": 0.0}
    wait_until(lambda: report.exists() and report.read_text() != "", timeout=10)
    assert report.read_text() == "sent 5 of 5, cancelled=False"
    instances = server.engine.instances()
    wait_until(lambda: not any(i.worker.peer.lease_count for i in instances), timeout=10)


def unlinked_mappings(pid: int) -> int:
    """How many of dlserve's shared-memory segments, unlinked by now, a process still maps."""
    with open(f"/proc/{pid}/maps") as maps:
        return sum(1 for line in maps if "/dev/shm/dlserve" in line and "(deleted)" in line)


SUMMER = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        outputs = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            total = pb_utils.Tensor("SUM", np.array([data.sum()], np.int64))
            outputs.append(pb_utils.InferenceResponse([total]))
        return outputs
'''
SUMMER_CONFIG = """
backend: "python"
input [ { name: "IN" data_type: TYPE_UINT8 dims: [ -1 ] } ]
output [ { name: "SUM" data_type: TYPE_INT64 dims: [ 1 ] } ]
"""


def test_segments_the_servers_arena_retires_are_unmapped_by_workers(servers, make_repo):
    """Large inputs grow the server's arena, whose emptied extra segments are retired:
    the worker that read them drops its mappings too (it kept them, and their memory,
    for as long as it lived)."""
    repo = make_repo(extra={"summer": {"config.pbtxt": SUMMER_CONFIG, "1/model.py": SUMMER}})
    server = servers.start(repo, shm_arena_size=1 << 20)
    pid = server.engine.model("summer").instances[0].worker.pid
    for mib in (2, 3, 4, 5):
        data = np.ones(mib << 20, np.uint8)
        (answer,) = server.model("summer").infer(inputs={"IN": data})
        assert int(answer.outputs["SUM"].as_numpy()[0]) == data.sum()
        del answer
    wait_until(lambda: unlinked_mappings(pid) == 0, timeout=10)


BIG_OUTPUT = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.ones(1 << 20, np.uint8))])
                for _ in requests]
'''
SUM_OF_BIG = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        call = pb_utils.InferenceRequest(
            model_name="big", requested_output_names=["OUT"],
            inputs=[pb_utils.Tensor("N", np.array([1], np.int32))],
        )
        result = call.exec()
        total = int(result.output_tensors()[0].as_numpy().sum())
        del result
        info = pb_utils.Tensor("INFO", np.array([str(total)], object))
        return [pb_utils.InferenceResponse([info]) for _ in requests]
'''


def test_a_bls_callers_worker_unmaps_a_gone_callees_segments(servers, make_repo):
    """A caller maps the callee's shared memory to read its outputs; when the callee's
    worker goes (an unload here; a reload or restart alike), the caller drops those
    mappings (it kept them for good: memory never freed, one more with every callee)."""
    big = (
        'backend: "python"\ninput [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_UINT8 dims: [ -1 ] } ]\n'
    )
    repo = make_repo(extra={
        "big": {"config.pbtxt": big, "1/model.py": BIG_OUTPUT},
        "caller": {"config.pbtxt": CONFIG, "1/model.py": SUM_OF_BIG},
    })
    server = servers.start(
        repo, model_control_mode=dlserve.ModelControlMode.EXPLICIT, startup_models=["big", "caller"]
    )
    pid = server.engine.model("caller").instances[0].worker.pid
    for _ in range(2):
        assert ask(server, "caller", 0) == 1 << 20
        server.unload("big", wait_until_unloaded=True)
        wait_until(lambda: unlinked_mappings(pid) == 0, timeout=10)
        server.load("big")


MAPPED = '''
def shm_mapped_mib():
    """Shared memory of dlserve's this worker maps now, MiB."""
    total = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "/dev/shm/dlserve" in line:
                low, high = (int(x, 16) for x in line.split()[0].split("-"))
                total += high - low
    return total >> 20
'''
POOL_CALLER = COMMON + MAPPED + '''

def big_call(value):
    data = np.full(1 << 20, value, np.float32)  # 4 MiB
    answer = pb_utils.InferenceRequest(
        model_name="identity", inputs=[pb_utils.Tensor("INPUT0", data)], requested_output_names=["OUTPUT0"]
    ).exec()
    return not answer.has_error()


class TritonPythonModel:
    def execute(self, requests):
        import concurrent.futures

        n = int(pb_utils.get_input_tensor_by_name(requests[0], "N").as_numpy()[0])
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # execute waits on the futures
            ok = all(pool.map(big_call, range(n)))
        info = json.dumps({"ok": ok, "mapped_mib": shm_mapped_mib()})
        return [pb_utils.InferenceResponse([pb_utils.Tensor("INFO", np.array([info], object))])]
'''
MAIN_THREAD_STREAMER = MAPPED + """
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            sender = request.get_response_sender()
            for i in range(n):  # from execute's own thread: nobody else reads the channel
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.full(1 << 18, i, np.float32))]))
                time.sleep(0.002)  # (the client keeps up)
            mapped = np.array([shm_mapped_mib()], np.float32)
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", mapped)]),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""
FP32_STREAMER_CONFIG = """
backend: "python"
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


def test_calls_made_on_the_models_threads_give_their_memory_back_as_they_go(servers, make_repo):
    """An execute that waits on a thread pool's BLS calls (not on the channel): the
    server's releases are applied by the threads that read, not kept for the main
    thread until execute ends (200 calls of 4 MiB mapped 832 MiB)."""
    server = servers.start(repo_with(make_repo, "pool_caller", POOL_CALLER))
    info = ask(server, "pool_caller", 100)
    assert info["ok"] and info["mapped_mib"] <= 96


def test_a_stream_sent_from_execute_gives_each_responses_memory_back(servers, make_repo):
    """A decoupled model streaming 1 MiB responses from execute's own thread: the memory
    of each response the client has read goes back while the stream goes on (it was all
    held until execute returned)."""
    repo = make_repo(extra={"streamer": {"config.pbtxt": FP32_STREAMER_CONFIG, "1/model.py": MAIN_THREAD_STREAMER}})
    server = servers.start(repo)
    last = None
    for response in server.model("streamer").infer(inputs={"N": np.array([150], np.int32)}):
        values = np.from_dlpack(response.outputs["OUT"])
        if values.size == 1:
            last = float(values[0])
        del values, response
    assert last is not None and last <= 64


PRODUCER = {
    "config.pbtxt": """
backend: "python"
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 16384 ] } ]
response_cache { enable: true }
""",
    "1/model.py": '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            n = pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0]
            out = pb_utils.Tensor("OUT", np.full(16384, n, np.float32))
            responses.append(pb_utils.InferenceResponse([out]))
        return responses
''',
}

FORWARDER = {
    "config.pbtxt": """
backend: "python"
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 16384 ] } ]
""",
    "1/model.py": '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            answer = await pb_utils.InferenceRequest(
                model_name="producer", inputs=[pb_utils.get_input_tensor_by_name(request, "N")],
                requested_output_names=["OUT"],
            ).async_exec()
            if answer.has_error():
                raise pb_utils.TritonModelException(answer.error().message())
            out = pb_utils.get_output_tensor_by_name(answer, "OUT")
            responses.append(pb_utils.InferenceResponse([out]))
        return responses
''',
}


def test_a_bls_output_a_caller_returns_is_held_until_its_reply_is_sent(servers, make_repo):
    """The caller hands the server's own memory (a cached answer it was lent) back in its
    reply; its views die as the reply is made, and their RELEASE must not reach the server
    ahead of the reply. Another thread's send (here the async model's loop, the main thread
    reading) used to carry it first now and then: the server freed the block and answered
    'no longer held', or another request's bytes that had taken its place (review, with
    this model pair: 10-209 failures in 10,000 requests)."""
    repo = make_repo(extra={"producer": PRODUCER, "forwarder": FORWARDER})
    server = servers.start(repo, cache_config={"local": {"size": str(1 << 24)}})
    wait_until(lambda: server.model("forwarder").ready(), timeout=60)
    outcomes: dict[str, int] = {}
    numbers = iter(range(6000))
    lock = threading.Lock()

    def client() -> None:
        model = server.model("forwarder")
        while True:
            with lock:
                n = next(numbers, None)
            if n is None:
                return
            value = n % 4  # (four answers, each cached: served from the server's memory)
            try:
                (response,) = model.infer(inputs={"N": np.array([value], np.int32)})
                out = np.from_dlpack(response.outputs["OUT"])
                outcome = "ok" if (out == value).all() else "another request's data"
            except dlserve.TritonError as exc:
                outcome = exc.message
            with lock:
                outcomes[outcome] = outcomes.get(outcome, 0) + 1

    threads = [threading.Thread(target=client) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes == {"ok": 6000}


SLOW_TO_FREE = {
    "config.pbtxt": """
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
""",
    "1/model.py": '''
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class SlowToFree(bytearray):
    """Memory whose teardown takes a while, as a framework tensor's deleter may."""

    def __del__(self):
        time.sleep(0.02)


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            out = np.frombuffer(SlowToFree(x.tobytes()), np.float32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", out)]))
        return responses
''',
}


def test_an_input_lent_to_the_worker_is_back_when_its_answer_arrives(servers, make_repo):
    """The worker lets go of an execute's requests and responses before it replies, and
    the releases ride in the reply's frame: however long the teardown takes, the server
    holds nothing lent for a request once its answer is out (a client may unregister
    the region its input came from right away)."""
    server = servers.start(make_repo(extra={"slow_to_free": SLOW_TO_FREE}))
    model = server.model("slow_to_free")
    x = np.full(1 << 14, 3.0, np.float32)  # 64 KiB: lent to the worker, by reference
    lent = []
    for _ in range(10):
        (response,) = list(model.infer(inputs={"INPUT0": x}))
        assert response.error is None
        del response
        lent.append(sum(i.worker.peer.lease_count for i in server.engine.instances()))
    assert lent == [0] * 10
