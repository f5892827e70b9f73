"""A worker that dies fails its in-flight requests at once, is restarted with
backoff, and leaves nothing behind: no segment in /dev/shm, no process."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import signal
import subprocess
import threading
import time

import numpy as np
import pytest

import dlserve
from dlserve.frontends import Metrics
from dlserve.memory.shm import hold_prefix

from ..conftest import pid_alive, wait_until, worker_processes
from .test_metrics import scrape, value

X = np.ones(4, dtype=np.float32)


def worker_pid(server: dlserve.Server) -> int:
    response = list(server.model("faulty").infer(inputs={"INPUT0": X}))[0]
    return int(response.outputs["PID"].as_numpy()[0])


def worker_segments(server: dlserve.Server) -> list[str]:
    return glob.glob(f"/dev/shm/{server.engine.segment_prefix}_w*")


@pytest.fixture
def server(servers, make_repo):
    srv = servers.start(make_repo("faulty"))
    assert srv.model("faulty").ready()
    return srv


@pytest.mark.parametrize(
    "mode,reason",
    [
        ("kill", "was killed by SIGKILL"),
        ("exit", "exited with code 3"),
        ("segv", "was killed by SIGSEGV"),
    ],
)
def test_worker_death_during_execute(server, mode, reason):
    old_pid = worker_pid(server)
    old_segments = worker_segments(server)
    assert old_segments, "a running worker owns an arena segment"

    with pytest.raises(dlserve.InternalError) as info:
        list(server.model("faulty").infer(inputs={"INPUT0": X}, parameters={"mode": mode}))
    message = str(info.value)
    assert "faulty_0" in message and reason in message and "restarted" in message

    # The dead worker is gone, with its shared memory; a new one takes over.
    assert not pid_alive(old_pid)
    wait_until(lambda: server.model("faulty").ready())
    new_pid = worker_pid(server)
    assert new_pid != old_pid
    assert not any(os.path.exists(path) for path in old_segments)
    assert server.ready()


def test_kill_from_outside_fails_the_request_at_once(server):
    pid = worker_pid(server)
    errors: list[BaseException] = []

    def slow_request() -> None:
        try:
            list(server.model("faulty").infer(inputs={"INPUT0": X}, parameters={"mode": "sleep:30"}))
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion below
            errors.append(exc)

    thread = threading.Thread(target=slow_request)
    thread.start()
    time.sleep(0.5)  # the request is now executing in the worker
    started = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert time.monotonic() - started < 5, "the error must not wait for the 30 s execute"
    assert isinstance(errors[0], dlserve.InternalError)
    assert "was killed by SIGKILL" in str(errors[0])
    wait_until(lambda: server.model("faulty").ready())


def test_every_request_queued_or_executing_fails_at_once_when_the_worker_is_killed(server):
    """Triton's issues 8448 and 5381 (a stub OOM-killed or a zombie under high concurrency,
    and the server hangs): with one request executing and more queued behind it, a
    SIGKILL answers every one of them at once, and the restarted worker serves."""
    pid = worker_pid(server)

    async def flood() -> list[BaseException | None]:
        async def one() -> BaseException | None:
            try:
                async for _ in server.model("faulty").async_infer(
                    inputs={"INPUT0": X}, parameters={"mode": "sleep:30"}
                ):
                    pass
            except dlserve.TritonError as exc:
                return exc
            return None

        calls = [asyncio.ensure_future(one()) for _ in range(12)]
        await asyncio.sleep(0.5)  # the first executes, the others wait for the instance
        os.kill(pid, signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*calls), 10)  # not the 30 s executes

    outcomes = asyncio.run(flood())
    assert all(isinstance(outcome, dlserve.TritonError) for outcome in outcomes), outcomes
    assert "was killed by SIGKILL" in str(outcomes[0])
    wait_until(lambda: server.model("faulty").ready())
    assert worker_pid(server) != pid


@pytest.fixture
def metrics_port(server):
    service = Metrics(server, Metrics.Options(address="127.0.0.1", port=0))
    service.start()
    yield service.port
    service.stop()


def test_readiness_reflects_a_dead_worker_and_requests_fail_fast(server, metrics_port):
    """...in the model's readiness, its statistics and the metrics."""
    pid = worker_pid(server)
    instance = server.engine.model("faulty").instances[0]
    # Keep the worker from coming back for a while so the "down" window is observable.
    original = instance.start

    release = threading.Event()

    async def delayed_start() -> None:
        while not release.is_set():
            await asyncio.sleep(0.05)
        await original()

    instance.start = delayed_start  # type: ignore[method-assign]
    labels = {"model": "faulty", "version": "1", "model_instance": "faulty_0"}
    _, scraped = scrape(metrics_port)
    assert value(scraped, "dlserve_instance_ready", **labels) == 1
    assert value(scraped, "dlserve_instance_restarts", **labels) == 0
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not server.model("faulty").ready())
    _, scraped = scrape(metrics_port)
    assert value(scraped, "dlserve_instance_ready", **labels) == 0
    assert not server.ready()  # strict readiness: every model must be ready
    entry = server.models()[("faulty", 1)]
    assert entry.state == "UNAVAILABLE" and "was killed by SIGKILL" in entry.reason
    with pytest.raises(dlserve.UnavailableError, match="has no ready instance"):
        list(server.model("faulty").infer(inputs={"INPUT0": X}))
    (down,) = server.model("faulty").statistics()["model_stats"][0]["instances"]
    assert down["state"] == "RESTARTING" and "was killed by SIGKILL" in down["last_error"]
    release.set()
    wait_until(lambda: server.model("faulty").ready())
    assert worker_pid(server) != pid
    assert instance.restarts == 1
    (up,) = server.model("faulty").statistics()["model_stats"][0]["instances"]
    assert up["state"] == "READY" and up["restarts"] == 1 and up["pid"] == worker_pid(server)
    _, scraped = scrape(metrics_port)
    assert value(scraped, "dlserve_instance_ready", **labels) == 1
    assert value(scraped, "dlserve_instance_restarts", **labels) == 1


def test_repeated_crashes_back_off_and_recover(server):
    for _ in range(3):
        with pytest.raises(dlserve.InternalError):
            list(server.model("faulty").infer(inputs={"INPUT0": X}, parameters={"mode": "exit"}))
        wait_until(lambda: server.model("faulty").ready())
    instance = server.engine.model("faulty").instances[0]
    assert instance.restarts == 3
    assert worker_pid(server) > 0


def test_a_worker_whose_channel_cannot_be_set_up_is_killed_and_reaped(server, monkeypatch):
    """Spawned, but no channel to it (the connection failed or the start was
    cancelled): the process is killed and reaped, and its poller-board slot is free."""
    from dlserve.ipc import supervisor
    from dlserve.ipc.polling import loop_poller

    def no_channel(*args: object) -> None:
        raise OSError("no channel for this worker")

    monkeypatch.setattr(supervisor, "ServerChannel", no_channel)
    resources = server.engine.model("faulty").resources
    board = loop_poller(server.loop).board
    slots_before = board.free_slots

    async def start_and_fail() -> supervisor.WorkerProcess:
        worker = supervisor.WorkerProcess(
            instance_name="doomed",
            segment_prefix=f"{resources.segment_prefix}_doomed",
            arena_bytes=resources.worker_arena_bytes,
            space=resources.space,
            arena=resources.arena,
            on_message=lambda message: None,
            on_exit=lambda description: None,
            poll_us=1000,
        )
        with pytest.raises(OSError, match="no channel for this worker"):
            await worker.start()
        await asyncio.wait_for(worker.wait_exited(), 10)
        return worker

    worker = asyncio.run_coroutine_threadsafe(start_and_fail(), server.loop).result(20)
    assert worker.process is not None and worker.process.returncode == -signal.SIGKILL
    assert not pid_alive(worker.process.pid)
    assert board.free_slots == slots_before
    assert worker_pid(server) > 0  # the model's own worker is untouched


def test_a_worker_that_dies_while_restarting_leaves_one_restart_going(server):
    """Workers that die in initialize() during a restart are the restart's failures,
    not new crashes: one restart loop keeps trying, with backoff, and once the model
    comes up again exactly one worker runs (no second loop starting workers of its own)."""
    model_dir = server.engine.model("faulty").model_dir
    instance = server.engine.model("faulty").instances[0]
    marker = model_dir / "CRASH_ON_INITIALIZE"
    marker.write_text("")
    os.kill(worker_pid(server), signal.SIGKILL)
    # Restarts after 0.2, 0.5 and 1.0 s of backoff each die in initialize.
    wait_until(lambda: instance.restarts >= 3, timeout=30)
    assert not server.model("faulty").ready()
    assert "exited with code 5" in instance.last_error
    marker.unlink()
    wait_until(lambda: server.model("faulty").ready(), timeout=30)
    time.sleep(3)  # room for any other restart loop to start a worker of its own
    assert worker_processes(server.engine.segment_prefix) == [worker_pid(server)]
    assert server.model("faulty").ready()


def test_a_live_worker_that_answers_unavailable_is_not_taken_for_dead(server):
    """A worker that cannot place an output in shared memory (as with a full /dev/shm)
    answers UNAVAILABLE: the request fails at once with that reason, and the worker,
    alive, keeps serving; it is not waited for, reported dead or restarted."""
    pid = worker_pid(server)
    started = time.monotonic()
    with pytest.raises(dlserve.UnavailableError, match="failed to allocate .* shared memory"):
        list(server.model("faulty").infer(inputs={"INPUT0": X}, parameters={"mode": "no_shm"}))
    assert time.monotonic() - started < 1.5
    assert server.model("faulty").ready()
    assert worker_pid(server) == pid
    assert server.engine.model("faulty").instances[0].restarts == 0


def test_a_worker_that_dies_right_after_initialize_is_never_left_ready(servers, make_repo):
    """The worker answers INIT and exits 50 ms later, while the server's loop is busy:
    the reply and the death are read in the same turn. The instance must not end up
    READY over a dead worker (every request would fail and nothing would restart it)."""
    repo = make_repo("faulty")
    (repo / "faulty" / "EXIT_AFTER_INITIALIZE").write_text("")
    initializing = repo / "faulty" / "INITIALIZING"
    options = dlserve.Options(model_repository=str(repo), exit_timeout=5, exit_on_error=False)
    server = dlserve.Server(options)
    servers.servers.append(server)  # stopped and checked for leaks by the harness

    def busy_loop_while_the_worker_answers_and_dies() -> None:
        deadline = time.monotonic() + 30
        while not initializing.exists():
            if time.monotonic() > deadline:
                return
            time.sleep(0.005)
        time.sleep(0.1)
        server.loop.call_soon_threadsafe(time.sleep, 0.6)

    blocker = threading.Thread(target=busy_loop_while_the_worker_answers_and_dies)
    blocker.start()
    server.start(wait_until_ready=False)
    blocker.join()
    time.sleep(1)  # the worker is long dead
    (entry,) = [m for (name, _), m in server.models().items() if name == "faulty"]
    if entry.state == "READY":  # the death came after READY: the instance restarted
        instance = server.engine.model("faulty").instances[0]
        assert instance.worker is not None and instance.worker.alive, instance.state
        assert instance.restarts == 1
    else:  # both came together: the load failed with the worker's exit
        assert entry.state == "UNAVAILABLE" and "exited with code 7" in entry.reason, entry


CRASHING_MODEL = '''
import ctypes
import sys


class TritonPythonModel:
    def initialize(self, args):
        print("loading weights from w.bin", file=sys.stderr, flush=True)
        ctypes.string_at(0)  # a native crash, as in a broken extension

    def execute(self, requests):
        return []
'''


def test_a_worker_that_crashes_in_initialize_fails_the_load_with_its_last_words(servers, make_repo):
    """Not only "killed by SIGSEGV": what the worker printed last, and the Python stack
    faulthandler writes, so the reason can be found without the server's log."""
    config = 'backend: "python"\ninput [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]\n' \
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
    repo = make_repo(extra={"crasher": {"config.pbtxt": config, "1/model.py": CRASHING_MODEL}})
    server = servers.start(repo, model_control_mode=dlserve.ModelControlMode.EXPLICIT)
    with pytest.raises(dlserve.TritonError) as caught:
        server.load("crasher")
    message = caught.value.message
    assert "Stub process 'crasher_0' is not healthy: its worker process was killed by SIGSEGV; its last output:" in message
    assert "loading weights from w.bin" in message
    assert "Fatal Python error: Segmentation fault" in message
    assert "line 9 in initialize" in message
    # ...and the model's state says the same.
    (entry,) = [m for (name, _), m in server.models().items() if name == "crasher"]
    assert entry.state == "UNAVAILABLE" and "loading weights from w.bin" in entry.reason


HELPER_MODEL = '''
import subprocess
import sys


class TritonPythonModel:
    def initialize(self, args):
        # A helper process that outlives the worker, holding its stderr.
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
        print("started a helper", file=sys.stderr, flush=True)
        sys.exit(3)
'''


def test_a_helper_holding_the_workers_stderr_leaves_no_thread_or_descriptor(servers, make_repo):
    """The worker's output is copied until the worker is gone, not until every process
    sharing its stderr is: a model's helper that lives on holds nothing of the server."""
    import psutil

    config = 'backend: "python"\ninput [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]\n' \
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
    repo = make_repo(extra={"helper": {"config.pbtxt": config, "1/model.py": HELPER_MODEL}})
    server = servers.start(repo, model_control_mode=dlserve.ModelControlMode.EXPLICIT)
    helpers = []
    try:
        for _ in range(3):
            with pytest.raises(dlserve.TritonError, match="exited with code 3; its last output:\nstarted a helper"):
                server.load("helper")
        helpers = [
            p for p in psutil.process_iter(["cmdline"]) if "time.sleep(30)" in " ".join(p.info["cmdline"] or [])
        ]
        assert len(helpers) == 3  # still running, holding the pipes' write ends
        wait_until(lambda: not [t for t in threading.enumerate() if t.name == "worker-stderr"], 5)
    finally:
        for helper in helpers:
            helper.kill()


TERMINATING_MODEL = '''
import json
import multiprocessing
import subprocess
import sys
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        ended = {}
        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
        child.start()
        child.terminate()
        child.join(10)
        ended["forked"] = child.exitcode
        program = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        time.sleep(0.5)  # (past the interpreter's start)
        program.terminate()
        ended["program"] = program.wait(10)
        pool = multiprocessing.get_context("fork").Pool(2)
        pool.terminate()  # SIGTERM to its workers, then joins them
        ended["pool"] = "ended"
        out = np.array([json.dumps(ended).encode()], dtype=np.object_)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", out)]) for _ in requests]
'''


def test_what_a_model_starts_can_be_terminated(servers, make_repo):
    """A worker disregards SIGTERM and SIGINT (the server ends it in order), but what its
    model forks or runs does not inherit that: SIGTERM ends it, as anywhere. (Inherited,
    a fork Pool's exit waited forever for workers its terminate() could not end.)"""
    config = 'backend: "python"\noutput [ { name: "Y" data_type: TYPE_STRING dims: [ 1 ] } ]\n'
    server = servers.start(make_repo(extra={"terminator": {"config.pbtxt": config, "1/model.py": TERMINATING_MODEL}}))
    (response,) = server.model("terminator").infer(inputs={})
    ended = json.loads(response.outputs["Y"].to_bytes_array()[0])
    assert ended == {"forked": -signal.SIGTERM, "program": -signal.SIGTERM, "pool": "ended"}


def test_a_server_killed_outright_leaves_segments_the_next_one_removes(servers, make_repo):
    """A server SIGKILLed (or OOM-killed) cannot unlink its segments; the next server to
    start does, whatever pid they name (a restarted container's server often has its
    predecessor's): nobody holds their lock any more. A live server's stay, though its
    pid is gone here or is this very one: another container's, sharing /dev/shm
    (``--ipc=host``, a pod's memory volume) from a PID namespace of its own."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    left: dict[str, int | None] = {}  # segment -> the descriptor holding its lock (None: killed)
    for pid, tag, alive in [
        (gone.pid, "0badc0de", False), (os.getpid(), "0badc0d1", False),
        (gone.pid, "0a11fe00", True), (os.getpid(), "0a11fe01", True),
    ]:
        prefix = f"dlserve_{pid}_{tag}"
        lock = hold_prefix(prefix)
        assert lock is not None
        with open(f"/dev/shm/{prefix}_s_0", "wb") as segment:
            segment.write(b"left behind")
        if not alive:  # as a SIGKILL leaves them: the lock file, no holder
            os.close(lock)
        left[f"/dev/shm/{prefix}_s_0"] = lock if alive else None
    try:
        running = servers.start(make_repo("faulty"))
        fresh = servers.start(make_repo("faulty"))
        assert sorted(path for path in left if os.path.exists(path)) == sorted(
            path for path, lock in left.items() if lock is not None
        )
        assert not [p for p in glob.glob("/dev/shm/dlserve_*_0badc0d*")]  # their locks too
        for server in (running, fresh):  # the running engines' own segments stay
            assert glob.glob(f"/dev/shm/{server.engine.segment_prefix}_s*")
            assert list(server.model("faulty").infer(inputs={"INPUT0": X}))[0].error is None
    finally:
        for path, lock in left.items():
            if lock is not None:
                os.close(lock)
            for leftover in glob.glob(path[: -len("_s_0")] + "*"):
                os.unlink(leftover)


BASE_EXCEPTION_MODEL = '''
import asyncio
import sys

import numpy as np
import triton_python_backend_utils as pb_utils


async def cancelled():  # awaiting a task something else cancelled
    task = asyncio.ensure_future(asyncio.sleep(10))
    asyncio.get_running_loop().call_soon(task.cancel)
    await task


class TritonPythonModel:
    async def execute(self, requests):
        how = int(pb_utils.get_input_tensor_by_name(requests[0], "X").as_numpy()[0])
        if how == 1:
            await cancelled()
        if how == 2:
            sys.exit("fatal")
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([how], np.float32))])
            for _ in requests
        ]
'''
BASE_EXCEPTION_CONFIG = (
    'backend: "python"\nmax_batch_size: 0\n'
    'input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
    'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
)


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_cancelled_error_or_sys_exit_in_execute_is_an_error_response(servers, make_repo, sync):
    """As Triton 2.51 (side by side): the request fails with the exception's name and the
    instance serves on. dlserve left the execute unanswered (its instance stopped taking
    requests once its concurrency was used up) or, for SystemExit in an async execute,
    ended the model's event loop, so that every later request hung."""
    code = BASE_EXCEPTION_MODEL
    if sync:
        code = code.replace("async def execute", "def execute").replace(
            "await cancelled()", "raise asyncio.CancelledError()"
        )
    repo = make_repo(extra={"base": {"config.pbtxt": BASE_EXCEPTION_CONFIG, "1/model.py": code}})
    server = servers.start(repo)
    model = server.model("base")
    for _ in range(3):  # (more than ASYNC_EXECUTE_CONCURRENCY would allow, were they held)
        for how, name in ((1, "CancelledError: "), (2, "SystemExit: fatal")):
            with pytest.raises(dlserve.InternalError) as failed:
                list(model.infer(inputs={"X": np.array([how], np.float32)}))
            assert "Failed to process the request(s) for model 'base_0'" in str(failed.value)
            assert name in str(failed.value)
    (answer,) = model.infer(inputs={"X": np.array([0], np.float32)}, timeout=10)
    assert answer.outputs["Y"].as_numpy().tolist() == [0.0]
    assert server.engine.model("base").instances[0].restarts == 0
    stats = model.statistics()["model_stats"][0]["inference_stats"]
    assert (stats["success"]["count"], stats["fail"]["count"]) == (1, 6)


LINGERING_MODEL = '''
import contextlib
import os
import socket
import stat
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        if pb_utils.get_input_tensor_by_name(requests[0], "X").as_numpy()[0] == 1:
            # A thread that is not a daemon: it holds the process after the worker's loop ends.
            threading.Thread(target=time.sleep, args=(60,)).start()
            # The worker's channel ends (as when its loop failed), its process lives on.
            for fd in map(int, os.listdir("/proc/self/fd")):
                with contextlib.suppress(OSError):
                    if stat.S_ISSOCK(os.fstat(fd).st_mode):
                        channel = socket.socket(fileno=fd)
                        channel.shutdown(socket.SHUT_RDWR)
                        channel.detach()
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([1], np.float32))])
            for _ in requests
        ]
'''


def test_a_worker_that_closes_its_channel_but_lives_on_is_ended_and_restarted(servers, make_repo):
    """Not left READY over a worker that can answer nothing (every request failed with
    "worker process is not running", and it was never restarted)."""
    config = BASE_EXCEPTION_CONFIG
    repo = make_repo(extra={"linger": {"config.pbtxt": config, "1/model.py": LINGERING_MODEL}})
    server = servers.start(repo)
    model = server.model("linger")
    instance = server.engine.model("linger").instances[0]
    old_pid = instance.worker.process.pid
    with pytest.raises(dlserve.TritonError):
        list(model.infer(inputs={"X": np.array([1], np.float32)}))
    wait_until(lambda: instance.restarts == 1 and model.ready(), timeout=20)
    assert not pid_alive(old_pid)
    (answer,) = model.infer(inputs={"X": np.array([0], np.float32)})
    assert answer.outputs["Y"].as_numpy().tolist() == [1.0]


DYING_STREAMER = '''
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        sender = requests[0].get_response_sender()
        for i in range(3):  # 400 KB each: they travel by reference, in its shared memory
            out = pb_utils.Tensor("OUT", np.full(100000, i, np.float32))
            sender.send(pb_utils.InferenceResponse([out]))
        time.sleep(0.1)
        os._exit(1)  # before its caller reads them
'''
LATE_READER = '''
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        said = []
        if pb_utils.get_input_tensor_by_name(requests[0], "IN").as_numpy()[0] == 1:
            call = pb_utils.InferenceRequest(
                model_name="streamer", requested_output_names=["OUT"],
                inputs=[pb_utils.Tensor("IN", np.array([1], np.int32))],
            )
            responses = call.exec(decoupled=True)
            time.sleep(1.5)  # the callee streams, dies, and its shared memory is removed
            said.append(f"cancelled: {requests[0].is_cancelled()}")
            said += [r.error().message() if r.has_error() else "ok" for r in responses]
        said.append("answered")
        out = pb_utils.Tensor("LOG", np.array(said, dtype=np.object_))
        return [pb_utils.InferenceResponse([out])]
'''


def test_bls_responses_whose_callee_died_before_they_were_read_are_errors(servers, make_repo):
    """The caller gets each lost response as an error naming the gone segment, and it
    serves on; the reader used to fail inside the worker's channel (FileNotFoundError),
    leaving a worker waiting forever for a reader (is_cancelled()) or dying."""
    streamer = (
        'backend: "python"\ninput [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        "model_transaction_policy { decoupled: true }\n"
    )
    reader = (
        'backend: "python"\ninput [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'output [ { name: "LOG" data_type: TYPE_STRING dims: [ -1 ] } ]\n'
    )
    repo = make_repo(extra={
        "streamer": {"config.pbtxt": streamer, "1/model.py": DYING_STREAMER},
        "reader": {"config.pbtxt": reader, "1/model.py": LATE_READER},
    })
    server = servers.start(repo)
    model = server.model("reader")

    def ask(value: int) -> list[str]:
        (answer,) = model.infer(inputs={"IN": np.array([value], np.int32)}, timeout=30)
        return [line.decode() for line in answer.outputs["LOG"].to_bytes_array()]

    said = ask(1)
    assert said[0] == "cancelled: False" and said[-1] == "answered", said
    lost = said[1:-1]
    assert any("is gone" in line for line in lost), said  # (those read before it died are ok)
    assert "exited with code 1" in lost[-1], said
    assert ask(0) == ["answered"]
    assert server.engine.model("reader").instances[0].restarts == 0
