"""``dlserve`` on the command line: help, flag errors, and real ``dlserve serve``
processes on free ports — inference with curl, metrics, draining on SIGTERM, SIGINT,
explicit model control, ``--exit-on-error``, HTTP-only serving with a restricted API
and a log file, and the bundled examples when no repository is given.

Every server process is checked when it ends: exit status, no /dev/shm/dlserve_<pid>_*
segment and no worker process (workers carry ``--segment-prefix dlserve_<pid>_...``).
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from dlserve.cli import _COMPRESSION_LEVELS, build_parser

from ..conftest import MODELS, worker_processes
from .test_model_control import HANGS_IN_INITIALIZE
from .test_repositories import FLAKY, FLAKY_CONFIG, TWO_INSTANCES

BIN = Path(sys.executable).parent
DLSERVE = str(BIN / "dlserve")
A = np.arange(16, dtype=np.float32)
B = np.full(16, 2.0, dtype=np.float32)


# -- helpers -----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def request(
    port: int, path: str, method: str = "GET", body: object = None, headers: dict | None = None,
    timeout: float = 30,
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body) if body is not None else None
        conn.request(method, path, body=data, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def refused(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def add_sub_body() -> dict:
    return {
        "inputs": [
            {"name": "INPUT0", "datatype": "FP32", "shape": [16], "data": A.tolist()},
            {"name": "INPUT1", "datatype": "FP32", "shape": [16], "data": B.tolist()},
        ]
    }


def signal_thread(pid: int, thread: int, sig: int) -> None:
    """``sig`` to one thread of process ``pid`` (tgkill), which must not block it."""
    blocked = Path(f"/proc/{pid}/task/{thread}/status").read_text().split("SigBlk:")[1].split()[0]
    assert not int(blocked, 16) >> (sig - 1) & 1, f"thread {thread} blocks signal {sig}"
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.tgkill(pid, thread, sig) == 0, os.strerror(ctypes.get_errno())


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [DLSERVE, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


class Serve:
    """A ``dlserve serve`` process on free 127.0.0.1 ports; output goes to files."""

    def __init__(
        self,
        workdir: Path,
        args: list[str],
        env: dict | None = None,
        ports: dict | None = None,
        wrapper: tuple[str, ...] = (),
    ) -> None:
        """``wrapper``: a command that runs ``dlserve serve ...`` (given as its
        arguments) in place of itself, such as ``unshare``."""
        self.ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
        self.ports.update(ports or {})
        self.out = workdir / f"serve_{id(self)}.out"
        self.err = workdir / f"serve_{id(self)}.err"
        command = [*wrapper, DLSERVE, "serve", *args]
        for service, port in self.ports.items():
            command += [f"--{service}-address", "127.0.0.1", f"--{service}-port", str(port)]
        with self.out.open("w") as out, self.err.open("w") as err:
            # In a session of its own, as a server started from a shell is in its own process
            # group: a test can send a terminal's Ctrl-C to that group.
            self.proc = subprocess.Popen(
                command, stdout=out, stderr=err, cwd=workdir, env=env, start_new_session=True
            )
        self.pid = self.proc.pid

    @property
    def stdout(self) -> str:
        return self.out.read_text()

    @property
    def stderr(self) -> str:
        return self.err.read_text()

    def output(self) -> str:
        return f"--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"

    def wait_started(self, timeout: float = 60) -> Serve:
        """Until it printed that its services are up (so the ports are its own)."""
        deadline = time.monotonic() + timeout
        while "dlserve: ready" not in self.stdout and "dlserve: started" not in self.stdout:
            assert self.proc.poll() is None, f"exited with {self.proc.returncode}:\n{self.output()}"
            assert time.monotonic() < deadline, f"not started after {timeout} s:\n{self.output()}"
            time.sleep(0.05)
        return self

    def stop(
        self, sig: int = signal.SIGTERM, timeout: float = 30, other_thread: bool = False
    ) -> tuple[int, float]:
        """Send ``sig``; return (exit status, seconds it took to exit). A server still
        running after ``timeout`` fails the test with every thread's stack (SIGUSR1).
        ``other_thread``: to a thread other than the main one, as the kernel may hand a
        process's signal to any thread that does not block it."""
        start = time.monotonic()
        if other_thread:
            thread = next(t.id for t in psutil.Process(self.pid).threads() if t.id != self.pid)
            signal_thread(self.pid, thread, sig)
        else:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            pytest.fail(f"still running {timeout} s after signal {sig}:\n{self.output()}")
        return code, time.monotonic() - start

    def workers(self) -> list[psutil.Process]:
        """Live worker processes of this server (found by their segment prefix)."""
        found = []
        for pid in worker_processes(f"dlserve_{self.pid}"):
            with contextlib.suppress(psutil.NoSuchProcess):
                found.append(psutil.Process(pid))
        return found

    def assert_clean(self) -> None:
        leaked = glob.glob(f"/dev/shm/dlserve_{self.pid}_*")
        assert not leaked, f"shared memory left behind: {leaked}"
        deadline = time.monotonic() + 2
        while self.workers() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not self.workers(), f"worker processes left behind: {self.workers()}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for worker in self.workers():
            worker.kill()


@pytest.fixture
def serve(tmp_path: Path):
    """Start ``dlserve serve`` processes; any still running at the end are killed."""
    started: list[Serve] = []

    def start(*args: str, env: dict | None = None, ports: dict | None = None) -> Serve:
        process = Serve(tmp_path, list(args), env, ports)
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()


# -- help and flag errors ------------------------------------------------------------------
MAIN_FLAGS = [
    "--model-repository", "--model-control-mode", "--load-model", "--exit-on-error",
    "--exit-timeout-secs", "--strict-readiness", "--allow-http", "--http-port", "--allow-grpc",
    "--grpc-port", "--allow-metrics", "--metrics-port", "--allow-client-shm",
    "--http-restricted-api", "--grpc-restricted-protocol", "--log-file", "--log-verbose",
    "--backend-config",
]


def test_help():
    top = run_cli("--help")
    assert top.returncode == 0, top.stderr
    assert "serve" in top.stdout and "usage: dlserve" in top.stdout
    serve_help = run_cli("serve", "--help")
    assert serve_help.returncode == 0, serve_help.stderr
    missing = [flag for flag in MAIN_FLAGS if flag not in serve_help.stdout]
    assert not missing, missing
    bare = run_cli()  # no command: the help, and a usage error status
    assert bare.returncode == 2 and "serve" in bare.stdout


def test_help_gives_the_default_addresses_and_ports():
    # The first flags a new user looks up; their help said nothing of the defaults.
    serve_help = " ".join(run_cli("serve", "--help").stdout.split())
    for flag, default in [
        ("--http-address HTTP_ADDRESS", "0.0.0.0, every interface"),
        ("--http-port HTTP_PORT", "8000"),
        ("--grpc-address GRPC_ADDRESS", "0.0.0.0, every interface"),
        ("--grpc-port GRPC_PORT", "8001"),
        ("--metrics-address METRICS_ADDRESS", "--http-address"),
        ("--metrics-port METRICS_PORT", "8002"),
        ("--sagemaker-address SAGEMAKER_ADDRESS", "0.0.0.0, every interface"),
        ("--vertex-ai-address VERTEX_AI_ADDRESS", "0.0.0.0, every interface"),
    ]:
        assert f"{flag} (default: {default})" in serve_help, flag


@pytest.mark.parametrize(
    "args,message",
    [
        (["--http-port", "70000"], "argument --http-port: port must be an integer in [0, 65535], got '70000'"),
        (["--grpc-port", "-1"], "argument --grpc-port: port must be an integer in [0, 65535], got '-1'"),
        # (argparse named the checking function: "invalid _port value")
        (["--metrics-port", "eighty"], "argument --metrics-port: port must be an integer in [0, 65535], got 'eighty'"),
        # tritonserver takes medium, not med (dlserve took only med)
        (["--grpc-infer-response-compression-level", "max"], "invalid choice: 'max' (choose from 'none', 'low', 'medium', 'med', 'high')"),
        (["--model-control-mode", "bogus"], "--model-control-mode: invalid choice: 'bogus'"),
        (["--rate-limit", "sometimes"], "--rate-limit: invalid choice: 'sometimes'"),
        (["--allow-http", "maybe"], "argument --allow-http: expected true or false, got 'maybe'"),
        (["--exit-timeout-secs", "soon"], "--exit-timeout-secs: invalid int value: 'soon'"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_bad_flags_exit_2_with_a_message(args, message):
    result = run_cli("serve", *args)
    assert result.returncode == 2, result
    assert "usage: dlserve" in result.stderr
    assert message in result.stderr, result.stderr
    assert result.stdout == ""


def test_boolean_flags_take_tritonservers_forms():
    def parse(*args: str):
        return build_parser().parse_args(["serve", *args])

    assert parse().allow_http is True and parse().allow_client_shm is False
    assert parse("--allow-http=false").allow_http is False
    assert parse("--allow-http", "0").allow_http is False
    assert parse("--allow-http", "OFF").allow_http is False
    assert parse("--allow-client-shm").allow_client_shm is True
    assert parse("--allow-client-shm=Yes").allow_client_shm is True
    assert parse("--exit-on-error").exit_on_error is True and parse().exit_on_error is None
    args = parse("--model-store", "a", "--model-repository", "b", "--load-model", "x",
                 "--load-model=y")
    assert args.model_repository == ["a", "b"] and args.load_model == ["x", "y"]


def test_tritonservers_other_flags_are_accepted_and_cased_as_it_takes_them():
    """A tritonserver command line starts dlserve: its C++ core's settings are accepted
    (warned about), gRPC tuning goes to the gRPC service, enum values take any case."""
    args = build_parser().parse_args([
        "serve", "--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0",
        "--backend-directory", "/srv/backends", "--metrics-interval-ms=500",
        "--model-control-mode=EXPLICIT", "--rate-limit=Execution_Count", "--log-format=ISO8601",
        "--grpc-keepalive-time=10000", "--grpc-keepalive-permit-without-calls=true",
        "--grpc-infer-response-compression-level=HIGH",
    ])
    for words in ("Medium", "med"):  # (tritonserver's word, and dlserve's older one)
        level = build_parser().parse_args(["serve", f"--grpc-infer-response-compression-level={words}"])
        assert _COMPRESSION_LEVELS[level.grpc_infer_response_compression_level] == 2
    assert (args.model_control_mode, args.rate_limit, args.log_format) == ("explicit", "execution_count", "iso8601")
    assert args.grpc_keepalive_time_ms == 10000 and args.grpc_keepalive_permit_without_calls is True
    assert args.ignored_pinned_memory_pool_byte_size == ["0"] and args.backend_directory == "/srv/backends"


def test_load_model_needs_explicit_mode_as_in_triton():
    result = run_cli("serve", "--load-model", "add_sub")
    assert result.returncode == 1
    assert "Use of '--load-model' requires setting '--model-control-mode=explicit' as well." in result.stderr


def test_bad_rate_limit_resource_exits_even_with_rate_limiting_off():
    result = run_cli("serve", "--rate-limit-resource", "R1")
    assert result.returncode == 1 and "must look like NAME:COUNT[:DEVICE]" in result.stderr, result.stderr


@pytest.mark.parametrize(
    "entry",
    ["shm-default-byte-size", ",default-max-batch-size=3", "default-max-batch-size=", "python,"],
)
def test_bad_backend_config_exits_with_a_message(entry):
    """The line upstream L0_backend_config looks for in tritonserver's output."""
    result = run_cli("serve", "--backend-config", entry)
    assert result.returncode != 0
    expected = f"--backend-config option format is '<backend name>,<setting>=<value>'. Got {entry}"
    assert expected in result.stderr, result.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["--grpc-keepalive-time", "-1"], "keepalive_time_ms must be a non-negative integer, got -1"),
        (["--http-max-connections", "-1"], "max_connections must be a non-negative integer, got -1"),
        (["--http-request-timeout", "-5"], "request_timeout must be a non-negative integer, got -5"),
        (["--grpc-max-connections", "-2"], "max_connections must be a non-negative integer, got -2"),
        (["--grpc-message-timeout", "-1"], "message_timeout must be a non-negative integer, got -1"),
        (["--grpc-use-ssl", "true"], "use_ssl needs server_cert and server_key"),
        (["--http-restricted-api", "inference"], "restriction 'inference' must look like"),
        (["--http-restricted-api", "health:a=1", "--http-restricted-api", "health,metadata:b=2"],
         "restricted api 'health' can not be specified in multiple config groups"),
        (["--grpc-restricted-protocol", "model-reposit:a=1"], "unknown restricted protocol 'model-reposit'"),
        (["--cache-config", "local,size=abc"], "size must be a positive number of bytes, got 'abc'"),
        (["--cache-config", "local"],
         "--cache-config option format is '<cache name>,<setting>=<value>'. Got local"),
        (["--cache-config", "local,size=8192", "--cache-config", "redis,host=x"],  # (Triton's words)
         "found multiple cache configurations, but only a single cache is currently supported"),
        (["--cache-config", "local,size=8192", "--response-cache-byte-size", "8192"],
         "Error: Incompatible flags --response-cache-byte-size and --cache-config both provided. "
         "Please provide one or the other."),
        (["--rate-limit", "execution_count", "--rate-limit-resource", "R1:x"],
         "rate limit resource 'R1:x' must look like NAME:COUNT[:DEVICE]"),
    ],
)
def test_bad_service_options_exit_1_and_leave_nothing(serve, tmp_path, args, message):
    empty = tmp_path / "empty_repo"
    empty.mkdir()
    process = serve("--model-repository", str(empty), *args)
    code = process.proc.wait(timeout=30)
    assert code == 1, process.output()
    assert message in process.stderr, process.output()
    process.assert_clean()


@pytest.mark.parametrize(
    "service,name", [("http", "HTTP"), ("grpc", "GRPC"), ("metrics", "Metrics")]
)
def test_busy_port_exits_1_with_a_message(serve, make_repo, service, name):
    """In tritonserver's words, which upstream L0_lifecycle greps for."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        process = serve("--model-repository", str(make_repo("add_sub")), ports={service: port})
        code = process.proc.wait(timeout=30)
    assert code == 1, process.output()
    message = f"failed to start {name} service: Unavailable - Socket '127.0.0.1:{port}' already"
    assert message in process.stderr, process.output()
    process.assert_clean()


# -- serving --------------------------------------------------------------------------------
def test_serve_infers_with_curl_reports_metrics_and_drains_on_sigterm(serve, make_repo):
    process = serve(
        "--model-repository", str(make_repo("add_sub", "faulty")), "--exit-timeout-secs", "10",
    ).wait_started()
    http_port, grpc_port, metrics_port = (process.ports[k] for k in ("http", "grpc", "metrics"))
    services = (("KServeHttp", http_port), ("KServeGrpc", grpc_port), ("Metrics", metrics_port))
    for name, port in services:
        assert f"dlserve: {name} listening on port {port}" in process.stdout
    # tritonserver's lines, which scripts wait for, and its model table
    for name, port in (("HTTPService", http_port), ("GRPCInferenceService", grpc_port), ("Metrics Service", metrics_port)):
        assert f"Started {name} at 127.0.0.1:{port}" in process.stderr, process.output()
    assert "| Model   | Version | Status |" in process.stderr and "| add_sub | 1       | READY  |" in process.stderr
    assert "dlserve: ready" in process.stdout
    assert request(http_port, "/v2/health/ready")[0] == 200
    assert len(process.workers()) == 2

    if shutil.which("curl"):
        curl = subprocess.run(
            [
                "curl", "-s", "-S", "-X", "POST", "-H", "Content-Type: application/json",
                "-d", json.dumps(add_sub_body()), f"http://127.0.0.1:{http_port}/v2/models/add_sub/infer",
            ],
            capture_output=True, text=True, timeout=30, check=False,
        )
        assert curl.returncode == 0, curl.stderr
        reply = json.loads(curl.stdout)
    else:
        status, body = request(http_port, "/v2/models/add_sub/infer", "POST", add_sub_body())
        assert status == 200
        reply = json.loads(body)
    outputs = {o["name"]: o for o in reply["outputs"]}
    assert outputs["OUTPUT0"]["data"] == (A + B).tolist()
    assert outputs["OUTPUT1"]["data"] == (A - B).tolist()

    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}") as client:
        assert client.is_server_ready() and client.is_model_ready("add_sub")

    status, metrics = request(metrics_port, "/metrics")
    assert status == 200
    assert 'nv_inference_request_success{model="add_sub",version="1"} 1' in metrics.decode()

    # SIGTERM while a 1.5 s request runs: it is answered, then the process exits
    result: dict = {}

    def slow() -> None:
        body = {
            "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1], "data": [5.0]}],
            "parameters": {"mode": "sleep:1.5"},
        }
        try:
            result["reply"] = request(http_port, "/v2/models/faulty/infer", "POST", body)
        except Exception as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    def closed_while_draining() -> None:  # every service stops accepting at once
        time.sleep(0.4)
        result["refused"] = {port: refused(port) for port in (http_port, grpc_port)}

    thread = threading.Thread(target=slow)
    thread.start()
    time.sleep(0.5)  # the request is in the model by now
    watcher = threading.Thread(target=closed_while_draining)
    watcher.start()
    code, took = process.stop(signal.SIGTERM)
    thread.join(timeout=30)
    watcher.join(timeout=30)
    assert code == 0, process.output()
    assert result["refused"] == {http_port: True, grpc_port: True}, result["refused"]
    assert took < 10, f"exit took {took:.1f} s, over --exit-timeout-secs"
    assert "error" not in result, result
    status, body = result["reply"]
    assert status == 200, body
    assert {o["name"]: o["data"] for o in json.loads(body)["outputs"]}["OUTPUT0"] == [5.0]
    # What the shutdown waited for, in tritonserver 2.51's words and order (side by side)
    assert "Signal (15) received." in process.stdout
    log = process.stderr
    lines = [
        "Waiting for in-flight requests to complete.",
        "Timeout 10: Found 1 model versions that have in-flight inferences",
        "Model 'faulty' (version 1) has 1 in-flight inferences",
        "All models are stopped, unloading models",
        "live models and 0 in-flight non-inference requests",
        "Found 0 live models and 0 in-flight non-inference requests",
    ]
    at = [log.find(line) for line in lines]
    assert -1 not in at and at == sorted(at), process.output()
    assert "Found 0 model versions that have in-flight inferences" in log[at[2] : at[3]]
    process.assert_clean()


def test_a_grpc_stream_open_at_shutdown_gets_no_new_requests_run(serve, make_repo):
    """upstream L0_grpc_state_cleanup (*_shutdownserver): after SIGINT the request in flight
    on a stream is answered, a new one sent on it is refused in Triton 2.51's words."""
    import queue

    import tritonclient.grpc as grpcclient

    process = serve("--model-repository", str(make_repo("faulty"))).wait_started()
    answers: queue.Queue = queue.Queue()

    def tensor(value: float) -> grpcclient.InferInput:
        t = grpcclient.InferInput("INPUT0", [1], "FP32")
        t.set_data_from_numpy(np.array([value], np.float32))
        return t

    with grpcclient.InferenceServerClient(f"127.0.0.1:{process.ports['grpc']}") as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        # Long enough that "late" is sent while it runs, on a loaded machine too: a stream
        # with nothing in flight at the stop ends (UNAVAILABLE) and takes no more requests.
        client.async_stream_infer("faulty", [tensor(1.0)], request_id="in flight", parameters={"mode": "sleep:4"})
        time.sleep(0.5)  # (in the model by now)
        process.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        client.async_stream_infer("faulty", [tensor(2.0)], request_id="late")
        got = [answers.get(timeout=30) for _ in range(2)]
        client.stop_stream()
    errors = [error for _, error in got if error is not None]
    assert len(errors) == 1, got
    assert "Server is stopping, scheduler for model has stopped accepting new inference requests" in str(errors[0])
    (answered,) = [result for result, _ in got if result is not None]
    assert answered.get_response().id == "in flight"
    code, _ = process.stop(signal.SIGINT)
    assert code == 0, process.output()
    process.assert_clean()


def test_grpc_streams_open_at_shutdown_end_once_nothing_of_them_is_in_flight(serve, make_repo):
    """A tritonclient stream left open (start_stream, its requests answered) does not hold the
    exit until --exit-timeout-secs runs out: after SIGTERM it ends at once, its callback
    getting UNAVAILABLE; a stream with a request executing gets the answer, then the same."""
    import queue

    import tritonclient.grpc as grpcclient

    process = serve(
        "--model-repository", str(make_repo("faulty")), "--exit-timeout-secs", "20"
    ).wait_started()
    url = f"127.0.0.1:{process.ports['grpc']}"
    idle: queue.Queue = queue.Queue()
    busy: queue.Queue = queue.Queue()
    value = grpcclient.InferInput("INPUT0", [1], "FP32")
    value.set_data_from_numpy(np.array([1.0], np.float32))

    def into(answers: queue.Queue):
        return lambda result, error: answers.put((time.monotonic(), result, error))

    first, second = (grpcclient.InferenceServerClient(url) for _ in range(2))
    with first, second:
        first.start_stream(callback=into(idle))
        first.async_stream_infer("faulty", [value], request_id="answered")
        assert idle.get(timeout=30)[2] is None  # the stream is open, nothing of it in flight
        second.start_stream(callback=into(busy))
        sleep = {"mode": "sleep:4"}
        second.async_stream_infer("faulty", [value], request_id="in flight", parameters=sleep)
        time.sleep(0.5)  # (in the model by now)
        code, took = process.stop(signal.SIGTERM)
        idle_end, _, idle_error = idle.get(timeout=5)
        (answered_at, answer, _), (_, _, busy_error) = busy.get(timeout=5), busy.get(timeout=5)
        first.stop_stream()
        second.stop_stream()
    assert code == 0, process.output()  # (not 1: no request was dropped at the exit timeout)
    assert took < 10, f"exit took {took:.1f} s"
    assert idle_end < answered_at  # the idle stream ended without waiting for the other's request
    assert answer.get_response().id == "in flight"
    for error in (idle_error, busy_error):
        assert error.status() == "StatusCode.UNAVAILABLE"
        assert error.message() == "The server is shutting down"
    process.assert_clean()


def test_a_sequence_open_at_shutdown_may_finish(serve, make_repo):
    """As Triton 2.51 (side by side): after SIGTERM an open sequence counts as in flight: its
    next requests, on a new connection too, are answered until its END, a new sequence is
    refused in Triton's words, and the server exits once it ended."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    config = (MODELS / "accumulate" / "config.pbtxt").read_text().replace(
        "max_sequence_idle_microseconds: 500000", "max_sequence_idle_microseconds: 20000000"
    )
    files = {"config.pbtxt": config, "1/model.py": (MODELS / "accumulate" / "1" / "model.py").read_text()}
    process = serve("--model-repository", str(make_repo(extra={"acc": files}))).wait_started()
    url = f"127.0.0.1:{process.ports['grpc']}"

    def step(x: int, key: int, **flags: bool) -> int:
        with grpcclient.InferenceServerClient(url) as client:  # (a new connection each time)
            value = grpcclient.InferInput("INPUT", [1, 1], "INT32")
            value.set_data_from_numpy(np.array([[x]], np.int32))
            result = client.infer("acc", [value], sequence_id=key, **flags)
            return int(result.as_numpy("OUTPUT")[0, 0])

    assert step(5, 555, sequence_start=True) == 5
    started = time.monotonic()
    process.proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    assert process.proc.poll() is None  # waiting for the sequence
    with grpcclient.InferenceServerClient(url) as client:  # (live, not ready, as tritonserver exiting)
        assert client.is_server_live() and not client.is_server_ready()
    assert step(2, 555) == 7
    with pytest.raises(InferenceServerException) as refused:
        step(1, 556, sequence_start=True)
    assert refused.value.status() == "StatusCode.UNAVAILABLE"
    assert "Server is stopping, scheduler for model has stopped accepting new inference requests" in (
        refused.value.message()
    )
    assert step(3, 555, sequence_end=True) == 10
    assert process.proc.wait(timeout=30) == 0, process.output()
    assert time.monotonic() - started < 15, "it waited for the sequence's idle time, not its END"
    assert "Model 'acc' (version 1) has 1 open sequences" in process.stderr
    process.assert_clean()


def test_exit_timeout_bounds_shutdown_with_a_stuck_request(serve, make_repo):
    process = serve(
        "--model-repository", str(make_repo("faulty")), "--exit-timeout-secs", "1",
    ).wait_started()
    port = process.ports["http"]
    result: dict = {}

    def stuck() -> None:
        body = {
            "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1], "data": [1.0]}],
            "parameters": {"mode": "sleep:30"},
        }
        try:
            result["reply"] = request(port, "/v2/models/faulty/infer", "POST", body, timeout=40)
        except Exception as exc:  # noqa: BLE001 - the server may drop it: expected
            result["error"] = exc

    thread = threading.Thread(target=stuck)
    thread.start()
    time.sleep(0.5)
    code, took = process.stop(signal.SIGTERM, timeout=60)
    thread.join(timeout=40)
    assert code == 1, process.output()  # as tritonserver: a request was dropped
    assert "still had requests in flight" in process.stderr, process.output()
    assert "failed to stop server: Internal - Exit timeout expired. Exiting immediately." in process.stderr
    process.assert_clean()  # the stuck worker was ended
    assert took < 2.5, f"exit took {took:.1f} s with --exit-timeout-secs 1"


def test_sigint_http_only_restricted_api_and_log_file(serve, make_repo, tmp_path):
    log_file = tmp_path / "server.log"
    log_file.write_text("a line before\n")  # (appended to, as Triton does)
    process = serve(
        "--model-repository", str(make_repo("add_sub", "logger")),
        "--allow-grpc", "false", "--allow-metrics=false",
        "--http-restricted-api", "inference:x-key=secret",
        "--log-file", str(log_file),
    ).wait_started()
    http_port = process.ports["http"]
    assert "KServeHttp listening" in process.stdout
    assert "KServeGrpc" not in process.stdout and "Metrics listening" not in process.stdout
    assert refused(process.ports["grpc"]) and refused(process.ports["metrics"])
    assert request(http_port, "/v2/health/ready")[0] == 200

    status, body = request(http_port, "/v2/models/add_sub/infer", "POST", add_sub_body())
    assert status == 403, body
    assert "This API is restricted, expecting header 'x-key'" in json.loads(body)["error"]
    status, _ = request(
        http_port, "/v2/models/add_sub/infer", "POST", add_sub_body(), headers={"x-key": "wrong"}
    )
    assert status == 403
    status, body = request(
        http_port, "/v2/models/add_sub/infer", "POST", add_sub_body(), headers={"x-key": "secret"}
    )
    assert status == 200, body
    assert request(http_port, "/v2/models/add_sub")[0] == 200  # metadata is not restricted

    logger_body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1], "data": [1.0]}]}
    status, _ = request(
        http_port, "/v2/models/logger/infer", "POST", logger_body, headers={"x-key": "secret"}
    )
    assert status == 200

    code, _ = process.stop(signal.SIGINT)
    assert code == 0, process.output()
    process.assert_clean()
    log = log_file.read_text()
    assert log.startswith("a line before\n")
    assert "logger model initialized" in log  # the model's pb_utils.Logger lines
    assert "info message" in log and "error message" in log
    assert "Waiting for in-flight requests to complete." in log
    assert "successfully unloaded 'logger' version 1" in log  # its lines, till the last
    assert "info message" not in process.stderr and not LINE.search(process.stderr)  # the file's only


FINALIZER = {
    "config.pbtxt": 'name: "finalizer"\nbackend: "python"\n'
    'input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
    'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n',
    "1/model.py": "import os\n\n\nclass TritonPythonModel:\n"
    "    def execute(self, requests):\n        return []\n\n"
    "    def finalize(self):\n"
    "        with open(os.environ['FINALIZE_MARKER'], 'w') as out:\n"
    "            out.write('finalized')\n",
}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_to_the_process_group_still_finalizes_the_models(serve, make_repo, tmp_path, sig):
    """A terminal's Ctrl-C, or a supervisor stopping the whole group (supervisord's
    stopasgroup, ``kill -TERM -PGID``), reaches the server and its workers: the workers
    leave the shutdown to the server, so the model's finalize runs and nothing crashes."""
    marker = tmp_path / "finalized"
    process = serve(
        "--model-repository", str(make_repo(extra={"finalizer": FINALIZER})),
        env={**os.environ, "FINALIZE_MARKER": str(marker)},
    ).wait_started()
    os.killpg(process.pid, sig)
    assert process.proc.wait(timeout=30) == 0, process.output()
    process.assert_clean()
    assert marker.read_text() == "finalized", process.output()
    assert "KeyboardInterrupt" not in process.stderr, process.output()
    assert "killed by" not in process.stderr, process.output()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_another_thread_takes_still_stops_the_server(serve, make_repo, sig):
    """The kernel hands a process's signal to any thread not blocking it; after a SIGSTOP
    and SIGCONT, often not to the main one. Its handler runs on the main thread all the
    same (it waited for the stop without waking: the server never exited, logging nothing)."""
    process = serve("--model-repository", str(make_repo("add_sub"))).wait_started()
    code, _ = process.stop(sig, timeout=15, other_thread=True)
    assert code == 0, process.output()
    assert f"Signal ({sig}) received." in process.stdout
    assert "Waiting for in-flight requests to complete." in process.stderr, process.output()
    process.assert_clean()


def test_trace_config_writes_tritons_trace_file(serve, make_repo, tmp_path):
    file = tmp_path / "trace.json"
    process = serve(
        "--model-repository", str(make_repo("add_sub")),
        "--trace-config", f"triton,file={file}", "--trace-config", "level=TIMESTAMPS",
        "--trace-config", "rate=1", "--trace-config", "count=2",
    ).wait_started()
    port = process.ports["http"]
    status, body = request(port, "/v2/trace/setting")
    assert status == 200 and json.loads(body)["trace_count"] == "2"
    for _ in range(3):
        assert request(port, "/v2/models/add_sub/infer", "POST", add_sub_body())[0] == 200
    assert process.stop()[0] == 0, process.output()
    process.assert_clean()
    # a spent count's traces go to the first numbered file, as Triton writes them
    assert not file.exists()
    entries = json.loads((tmp_path / "trace.json.0").read_text())
    heads = [e for e in entries if "model_name" in e]
    assert [(h["model_name"], h["model_version"]) for h in heads] == [("add_sub", 1)] * 2
    events = {e["timestamps"][0]["name"] for e in entries if e["id"] == heads[0]["id"] and "timestamps" in e}
    assert {"HTTP_RECV_START", "REQUEST_START", "COMPUTE_START", "HTTP_SEND_END"} <= events


def test_tritonservers_older_trace_flags_are_accepted():
    from dlserve.cli import _trace_entries, _trace_settings
    from dlserve.engine.tracing import TraceSettings

    args = build_parser().parse_args([
        "serve", "--trace-file", "/tmp/t.json", "--trace-level", "TIMESTAMPS",
        "--trace-level", "TENSORS", "--trace-rate", "5", "--trace-count", "9",
        "--trace-log-frequency", "2", "--trace-config", "rate=7",  # --trace-config wins
    ])
    assert _trace_settings(_trace_entries(args)) == TraceSettings(
        file="/tmp/t.json", level=("TIMESTAMPS", "TENSORS"), rate=7, count=9, log_frequency=2
    )


@pytest.mark.parametrize(
    "levels,expected",
    [
        (["OFF", "TIMESTAMPS"], ("TIMESTAMPS",)),  # each adds to the others; OFF adds nothing
        (["tensors", "on"], ("TENSORS", "TIMESTAMPS")),  # (tritonserver's other words)
        (["max", "false"], ("TIMESTAMPS",)),
        (["off"], ("OFF",)),
    ],
)
def test_trace_levels_add_up_as_in_tritonserver(levels, expected):
    from dlserve.cli import _trace_settings

    assert _trace_settings([f"level={level}" for level in levels]).level == expected


def test_an_empty_model_config_name_is_refused(tmp_path):
    result = run_cli("serve", "--model-repository", str(tmp_path), "--model-config-name=")
    assert result.returncode != 0  # (tritonserver's words; L0_custom_model_config expects it)
    assert "Error: empty argument for --model-config-name" in result.stderr, result.stderr


@pytest.mark.parametrize(
    "flag,message",
    [
        ("jaeger,url=http://x", "must look like [MODE,]SETTING=VALUE"),
        ("mode=jaeger", "invalid value for trace mode option: jaeger. Available options are"),
        ("opentelemetry,url", "format is '<trace mode>,<setting>=<value>'. Got opentelemetry,url"),
        ("opentelemetry,bsp_schedule_delay=soon",
         'Bad option: "--trace-config opentelemetry,bsp_schedule_delay". Invalid value for option. '
         "Got soon"),
        ("rate=often", "rate must be an integer"),
        ("level=LOUD", "unknown trace level 'LOUD'"),
    ],
)
def test_bad_trace_config_exits_with_a_message(flag, message, tmp_path):
    result = run_cli("serve", "--model-repository", str(tmp_path), "--trace-config", flag)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_opentelemetry_trace_settings_are_ignored_with_a_warning(serve, make_repo):
    """As tritonserver ignores the settings of a trace mode not in use, a command line
    that sets both modes' (as deployments do) starts; dlserve refused it."""
    process = serve(
        "--model-repository", str(make_repo("identity")),
        "--trace-config", "opentelemetry,url=http://127.0.0.1:1/v1/traces",
        "--trace-config", "rate=5",
    ).wait_started()
    assert request(process.ports["http"], "/v2/health/ready")[0] == 200
    status, body = request(process.ports["http"], "/v2/trace/setting")
    assert status == 200 and json.loads(body)["trace_rate"] == "5"
    assert "--trace-config opentelemetry,url=http://127.0.0.1:1/v1/traces has no effect" in process.stderr


def test_explicit_mode_loads_only_the_named_models(serve, make_repo):
    process = serve(
        "--model-repository", str(make_repo("add_sub", "identity")),
        "--model-control-mode", "explicit", "--load-model", "add_sub",
    ).wait_started()
    # tritonserver's table lists only the models it loaded (or tried to), not the others
    assert "| add_sub | 1       | READY  |" in process.stderr and "| identity" not in process.stderr
    port = process.ports["http"]
    assert request(port, "/v2/health/ready")[0] == 200
    assert request(port, "/v2/models/add_sub/ready")[0] == 200
    assert request(port, "/v2/models/identity/ready")[0] == 400
    status, body = request(port, "/v2/repository/index", "POST")
    assert status == 200, body
    index = {row["name"]: row for row in json.loads(body)}
    assert index["add_sub"].get("state") == "READY"
    assert index["identity"].get("state") != "READY"
    assert len(process.workers()) == 1
    # explicit mode: the repository API loads the other one
    assert request(port, "/v2/repository/models/identity/load", "POST")[0] == 200
    assert request(port, "/v2/models/identity/ready")[0] == 200
    code, _ = process.stop()
    assert code == 0, process.output()
    process.assert_clean()


def test_exit_on_error_stops_on_a_failing_model(serve, make_repo):
    repo = make_repo("add_sub", "init_fail")
    process = serve("--model-repository", str(repo), "--exit-on-error", "true")
    code = process.proc.wait(timeout=60)
    assert code != 0, process.output()
    assert "cannot initialize: weights file is missing" in process.stderr, process.output()
    assert "init_fail" in process.stderr
    assert "dlserve: ready" not in process.stdout
    process.assert_clean()


def test_a_missing_repository_with_exit_on_error_false_serves_neither_live_nor_ready(
    serve, tmp_path
):
    """As tritonserver (upstream L0_lifecycle test_parse_error_noexit): it starts, logs
    why, and its health says it is neither live nor ready; it exits cleanly when told."""
    missing = tmp_path / "no_such_repository"
    process = serve("--model-repository", str(missing), "--exit-on-error=false").wait_started()
    port = process.ports["http"]
    assert f"failed to stat file {missing}" in process.stderr, process.output()
    assert request(port, "/v2/health/live")[0] == 400
    assert request(port, "/v2/health/ready")[0] == 400
    assert request(port, "/v2")[0] == 200
    code, _ = process.stop()
    assert code == 0, process.output()
    process.assert_clean()


def test_exit_on_error_false_keeps_serving_the_other_models(serve, make_repo):
    process = serve(
        "--model-repository", str(make_repo("add_sub", "init_fail")), "--exit-on-error=false",
    ).wait_started()
    port = process.ports["http"]
    assert "dlserve: started (some models are not ready)" in process.stdout
    assert request(port, "/v2/health/live")[0] == 200
    assert request(port, "/v2/health/ready")[0] == 400  # strict readiness
    assert request(port, "/v2/models/add_sub/ready")[0] == 200
    assert request(port, "/v2/models/add_sub/infer", "POST", add_sub_body())[0] == 200
    code, _ = process.stop()
    assert code == 0, process.output()
    process.assert_clean()


def test_model_config_name_load_retry_count_and_response_cache(serve, make_repo):
    repo = make_repo(
        "add_sub", "cached",
        extra={
            "add_sub": {"configs/two.pbtxt": TWO_INSTANCES},
            "flaky": {"config.pbtxt": FLAKY_CONFIG, "1/model.py": FLAKY},
        },
    )
    process = serve(
        "--model-repository", str(repo), "--model-config-name", "two", "--model-load-retry-count", "1",
        "--response-cache-byte-size", "4096",
    ).wait_started()
    port = process.ports["http"]
    assert request(port, "/v2/health/ready")[0] == 200  # flaky started at its second try
    status, body = request(port, "/v2/models/add_sub/config")
    assert status == 200 and json.loads(body)["instance_group"][0]["count"] == 2
    assert len(process.workers()) == 4
    assert "flaky' failed to start (try 1 of 2): " in process.stderr
    body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}
    answers = [json.loads(request(port, "/v2/models/cached/infer", "POST", body)[1]) for _ in range(2)]
    assert [a["outputs"][1]["data"] for a in answers] == [[1], [1]]  # the second from the cache
    assert "--response-cache-byte-size is deprecated" in process.stderr
    code, _ = process.stop()
    assert code == 0, process.output()
    process.assert_clean()


def test_model_load_timeout_ends_a_stuck_load_and_logs_every_thread(serve, make_repo):
    stuck = "import time\n\nclass TritonPythonModel:\n    def initialize(self, args):\n        time.sleep(3600)\n"
    repo = make_repo("add_sub", extra={"stuck": {"config.pbtxt": 'backend: "python"\n', "1/model.py": stuck}})
    process = serve(
        "--model-repository", str(repo), "--exit-on-error=false", "--model-load-timeout-secs", "1.5",
    ).wait_started()
    port = process.ports["http"]
    status, body = request(port, "/v2/repository/index", "POST")
    assert status == 200
    reasons = {entry["name"]: (entry["state"], entry.get("reason", "")) for entry in json.loads(body)}
    state, reason = reasons["stuck"]
    assert state == "UNAVAILABLE" and reasons["add_sub"][0] == "READY"
    assert "loading model instance 'stuck_0' did not finish within 1.5 s (the model load timeout)" in reason
    assert re.search(r'File ".*/stuck/1/model\.py", line 5 in initialize', reason), reason
    # The server's log has the worker's whole dump: every thread, the worker's own frames too.
    assert "(most recent call first)" in process.stderr and "dlserve/ipc/stub.py" in process.stderr
    assert request(port, "/v2/models/add_sub/infer", "POST", add_sub_body())[0] == 200
    assert len(process.workers()) == 1
    code, _ = process.stop()
    assert code == 0, process.output()
    process.assert_clean()


def test_without_a_repository_it_serves_the_bundled_examples(serve, tmp_path):
    # Hide torch/jax/tensorflow (workers included) so their examples fail fast; serving
    # the examples must go on without them.
    blockers = tmp_path / "blockers"
    blockers.mkdir()
    for module in ("torch", "jax", "tensorflow"):
        (blockers / f"{module}.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{module}'\", name='{module}')\n"
        )
    paths = [str(blockers), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    process = serve(env=env).wait_started(timeout=90)
    port = process.ports["http"]
    status, body = request(port, "/v2/repository/index", "POST")
    assert status == 200
    index = {row["name"]: row for row in json.loads(body)}
    assert index["add_sub"]["state"] == "READY", index
    assert {"identity", "string_upper", "pytorch_add_sub"} <= set(index)
    assert request(port, "/v2/models/add_sub/ready")[0] == 200
    assert index["pytorch_add_sub"].get("state") != "READY"
    assert "dlserve: started (some models are not ready)" in process.stdout
    code, _ = process.stop()
    assert code == 0, process.output()
    process.assert_clean()


BREAKPOINT_MODEL = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            breakpoint()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2)]))
        return responses
'''


def test_a_breakpoint_in_a_model_stops_in_the_servers_terminal(tmp_path):
    """`dlserve serve` in a terminal: pdb stops at breakpoint() in execute, in that terminal
    (the worker shares it), and the request completes once the session continues."""
    import pty
    import select

    model = tmp_path / "models" / "dbg"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(
        'backend: "python"\ninput [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
    )
    (model / "1" / "model.py").write_text(BREAKPOINT_MODEL)
    ports = [free_port() for _ in range(3)]
    pid, terminal = pty.fork()
    if pid == 0:  # the child: dlserve serve with the pty as its terminal
        os.execv(DLSERVE, [
            DLSERVE, "serve", "--model-repository", str(model.parent),
            "--http-address", "127.0.0.1", "--http-port", str(ports[0]),
            "--grpc-address", "127.0.0.1", "--grpc-port", str(ports[1]),
            "--metrics-address", "127.0.0.1", "--metrics-port", str(ports[2]),
        ])
    seen = bytearray()

    def wait_for(text: bytes, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while text not in seen:
            assert time.monotonic() < deadline, f"no {text!r} in:\n{seen.decode(errors='replace')}"
            if select.select([terminal], [], [], 0.2)[0]:
                with contextlib.suppress(OSError):
                    seen.extend(os.read(terminal, 4096))

    answer: list[tuple[int, bytes]] = []
    try:
        wait_for(b"dlserve: ready")
        body = {"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [21]}]}
        path = "/v2/models/dbg/infer"
        client = threading.Thread(
            target=lambda: answer.append(request(ports[0], path, "POST", body, timeout=60))
        )
        client.start()
        wait_for(b"(Pdb)")
        os.write(terminal, b"p float(x[0]) + 0.5\n")
        wait_for(b"21.5")
        os.write(terminal, b"c\n")
        client.join(30)
        status, data = answer[0]
        assert status == 200 and json.loads(data)["outputs"][0]["data"] == [42.0]
    finally:
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
        os.close(terminal)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not glob.glob(f"/dev/shm/dlserve_{pid}_*")


# -- the server log ---------------------------------------------------------------------------
# Triton's lines: severity, MMDD time (UTC, microseconds), the server's pid, the source line that
# logged it (for a model's line, the model's), then the message JSON-quoted: one record, one line.
LINE = re.compile(r'^([IWE])\d{4} \d\d:\d\d:\d\d\.\d{6} (\d+) ([\w.]+):(\d+)\] (".*")$', re.MULTILINE)
ISO_LINE = re.compile(r'^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ([IWE]) (\d+) ([\w.]+):(\d+)\] (".*")$', re.MULTILINE)
LOGGER_BODY = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1], "data": [1.0]}]}


def logged(text: str, line: re.Pattern = LINE) -> list[tuple[str, str, str]]:
    """(severity, source, message) of each of Triton's lines in ``text``."""
    return [(severity, f"{file}:{number}", json.loads(message))
            for severity, _, file, number, message in line.findall(text)]


def infer_logger(process: Serve, last_line: str = "logger_model: python error message") -> str:
    """Run the logger model once; the server's stderr from then until its last log line."""
    before = len(process.stderr)
    assert request(process.ports["http"], "/v2/models/logger/infer", "POST", LOGGER_BODY)[0] == 200
    deadline = time.monotonic() + 10
    while last_line not in process.stderr[before:]:
        assert time.monotonic() < deadline, process.output()
        time.sleep(0.05)
    return process.stderr[before:]


def test_the_log_is_written_in_tritons_lines(serve, make_repo):
    """As Triton 2.51 (measured): its own lines and a model's pb_utils.Logger lines (under
    the model's file and line) in one format; the model table after a line of its own;
    loads and unloads in Triton's words, which scripts grep."""
    repo = make_repo("logger", "init_fail")
    process = serve("--model-repository", str(repo), "--exit-on-error=false").wait_started()
    lines = logged(infer_logger(process))
    assert ("I", "model.py:12", "info message") in lines
    assert ("W", "model.py:13", "warning message") in lines
    assert ("E", "model.py:16", "explicit level message") in lines
    assert "verbose message" not in process.stderr  # (--log-verbose 0)
    (python_error,) = [m for s, _, m in lines if s == "E" and m.startswith("logger_model: python error")]
    assert "\nTraceback" in python_error  # a model's Python logging record, traceback and all
    assert {pid for _, pid, *_ in LINE.findall(process.stderr)} == {str(process.pid)}
    assert re.search(r"cli\.py:\d+\] \n\+-+\+-+\+-+\+\n\| Model ", process.stderr), process.stderr
    code, _ = process.stop()
    assert code == 0, process.output()
    said = [(severity, message.split("\n")[0]) for severity, _, message in logged(process.stderr)]
    assert ("I", "loading: logger:1") in said and ("I", "successfully loaded 'logger'") in said
    assert ("E", "failed to load 'init_fail' version 1: Internal: RuntimeError: cannot initialize: "
                 "weights file is missing") in said
    for severity, text in (("I", "Failed to initialize Python stub"), ("E", "ERROR: Failed to create instance")):
        assert (severity, f"{text}: RuntimeError: cannot initialize: weights file is missing") in said
    assert ("I", "failed to load 'init_fail'") in said
    assert ("I", "successfully unloaded 'logger' version 1") in said
    assert ("I", "Waiting for in-flight requests to complete.") in said  # (upstream L0_logging greps it)
    assert not [m for _, m in said if m.startswith("HTTP request:")]  # (verbose only)
    process.assert_clean()


def test_each_severity_has_its_own_switch_at_start_and_at_run_time(serve, make_repo):
    """As Triton 2.51 (measured): ``--log-info false --log-verbose 1`` shows verbose lines
    (as I lines) and no info lines; an update through /v2/logging or gRPC switches the
    severities and the format (ISO8601) of the very next lines, and the endpoints say what
    is applied."""
    import tritonclient.grpc as grpcclient

    process = serve(
        "--model-repository", str(make_repo("logger")), "--log-info", "false", "--log-verbose", "1",
    ).wait_started()
    port = process.ports["http"]
    lines = logged(infer_logger(process))
    assert ("I", "model.py:15", "verbose message") in lines and ("W", "model.py:13", "warning message") in lines
    assert "HTTP request: 2 /v2/models/logger/infer" in [m for *_, m in lines]  # (Triton's verbose line)
    assert not [m for *_, m in lines if m == "info message"] and "info message" not in process.stderr
    settings = {"log_file": "", "log_info": False, "log_warning": True, "log_error": True,
                "log_verbose_level": 1, "log_format": "default"}
    assert json.loads(request(port, "/v2/logging")[1]) == settings

    update = {"log_info": True, "log_warning": False, "log_verbose_level": 0, "log_format": "ISO8601"}
    status, body = request(port, "/v2/logging", "POST", update)
    assert status == 200 and json.loads(body) == {**settings, **update}
    text = infer_logger(process)
    lines = logged(text, ISO_LINE)
    assert ("I", "model.py:12", "info message") in lines and ("E", "model.py:14", "error message") in lines
    assert "warning message" not in text and "verbose message" not in text and not LINE.search(text)
    assert "HTTP request:" not in text

    with grpcclient.InferenceServerClient(f"127.0.0.1:{process.ports['grpc']}") as client:
        client.update_log_settings({"log_format": "default", "log_error": False})
    text = infer_logger(process, last_line="info message")
    assert ("I", "model.py:12", "info message") in logged(text) and not ISO_LINE.search(text)
    assert "error message" not in text
    code, _ = process.stop()
    assert code == 0, process.output()
    process.assert_clean()


def test_a_log_file_that_cannot_be_opened_leaves_the_log_on_stderr(serve, make_repo, tmp_path):
    """As Triton 2.51 (measured): it starts and logs to stderr (and its logging endpoint
    then names no log file); dlserve also says why, in one line."""
    missing = tmp_path / "no" / "such" / "dir" / "server.log"
    process = serve("--model-repository", str(make_repo("logger")), "--log-file", str(missing)).wait_started()
    assert f"dlserve: cannot write the log to '{missing}': No such file or directory\n" in process.stderr
    assert "Traceback" not in process.stderr, process.stderr
    assert ("I", "successfully loaded 'logger'") in [(s, m) for s, _, m in logged(process.stderr)]
    assert json.loads(request(process.ports["http"], "/v2/logging")[1])["log_file"] == ""
    code, _ = process.stop()
    assert code == 0, process.output()
    process.assert_clean()


def test_a_workers_stderr_reaches_the_servers(serve, make_repo):
    """The worker's stderr passes through the server (which keeps its last lines)."""
    model = (
        "import sys\n\n\nclass TritonPythonModel:\n"
        "    def initialize(self, args):\n"
        "        print('hello from the worker', file=sys.stderr, flush=True)\n\n"
        "    def execute(self, requests):\n        return []\n"
    )
    config = 'backend: "python"\ninput [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]\n' \
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
    repo = make_repo(extra={"talker": {"config.pbtxt": config, "1/model.py": model}})
    process = serve("--model-repository", str(repo)).wait_started()
    assert "hello from the worker" in process.stderr
    code, _ = process.stop()
    assert code == 0, process.output()
    process.assert_clean()


WAITS_FOR_GO = """
import os
import time

import triton_python_backend_utils as pb_utils

HERE = os.path.dirname(__file__)


class TritonPythonModel:
    def execute(self, requests):
        open(os.path.join(HERE, "EXECUTING"), "w").close()
        while not os.path.exists(os.path.join(HERE, "GO")):
            time.sleep(0.01)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", r.inputs()[0].as_numpy())]) for r in requests]
"""


def test_sigusr1_writes_every_threads_stack_the_workers_too_and_the_server_serves_on(
    make_repo, tmp_path
):
    """``kill -USR1``: the server's threads at once, then each worker's under a line that
    names it, so that a request that never answers shows where its model's code is."""
    config = 'backend: "python"\ninput [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]\n' \
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
    repo = make_repo("identity", extra={"waits": {"config.pbtxt": config, "1/model.py": WAITS_FOR_GO}})
    process = Serve(tmp_path, ["--model-repository", str(repo)]).wait_started()
    port = process.ports["http"]
    try:
        body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1], "data": [2.0]}]}
        answer: list[tuple[int, bytes]] = []
        client = threading.Thread(
            target=lambda: answer.append(request(port, "/v2/models/waits/infer", "POST", body))
        )
        client.start()
        deadline = time.monotonic() + 20
        while not (repo / "waits" / "1" / "EXECUTING").exists():
            assert time.monotonic() < deadline, process.output()
            time.sleep(0.05)
        process.proc.send_signal(signal.SIGUSR1)
        pattern = re.compile(r"Python stacks of 'waits_0' \(pid \d+\):\n(.*?)\n\n(?!Thread|Current)", re.S)
        while not (found := pattern.search(process.stderr + "\n\n")):
            assert time.monotonic() < deadline, process.output()
            time.sleep(0.05)
        server_dump, worker_dump = process.stderr.split("Python stacks of")[0], found.group(1)
        # The server's own threads first: the main one serving, the engine loop's beside it.
        assert server_dump.count("Thread 0x") >= 2 and "dlserve/cli.py" in server_dump, server_dump
        # The stuck model's frame heads its worker's main thread, the last block.
        main_thread = worker_dump.split("\n\n")[-1].splitlines()
        assert re.fullmatch(r'  File ".*/waits/1/model\.py", line 1[34] in execute', main_thread[1]), worker_dump
        assert "Python stacks of 'identity_0'" in process.stderr  # every worker, the idle ones too
        assert request(port, "/v2/health/ready")[0] == 200
        (repo / "waits" / "1" / "GO").touch()
        client.join(20)
        assert answer and answer[0][0] == 200 and json.loads(answer[0][1])["outputs"][0]["data"] == [2.0]
        code, _ = process.stop()
        assert code == 0, process.output()
        process.assert_clean()
    finally:
        process.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_models_load_at_start_stops_the_server(make_repo, tmp_path, sig):
    config = (MODELS / "identity" / "config.pbtxt").read_text().replace('name: "identity"', 'name: "slow"')
    repo = make_repo(extra={"slow": {"config.pbtxt": config, "1/model.py": HANGS_IN_INITIALIZE}})
    process = Serve(tmp_path, ["--model-repository", str(repo), "--exit-timeout-secs", "2"])
    try:
        deadline = time.monotonic() + 60
        while not process.workers():  # the model's worker runs its initialize
            assert process.proc.poll() is None and time.monotonic() < deadline, process.output()
            time.sleep(0.05)
        code, seconds = process.stop(sig, timeout=30)
        assert code == 0 and seconds < 15, (seconds, process.output())
        assert "stopped while starting" in process.stderr
        process.assert_clean()
    finally:
        process.kill()


def test_a_signal_while_a_failed_start_shuts_down_lets_it_finish(make_repo, tmp_path):
    """A model failed to load (exit on error): the shutdown that follows is not cut
    short by Ctrl-C, the exit status says the start failed, and nothing is left."""
    slow_stop = (MODELS / "identity" / "1" / "model.py").read_text() + """

    def finalize(self):
        __import__("time").sleep(2)
"""
    identity = {"config.pbtxt": (MODELS / "identity" / "config.pbtxt").read_text(), "1/model.py": slow_stop}
    repo = make_repo("init_fail", extra={"identity": identity})
    process = Serve(tmp_path, ["--model-repository", str(repo)])
    try:
        deadline = time.monotonic() + 60
        while "weights file is missing" not in process.stderr:
            assert process.proc.poll() is None and time.monotonic() < deadline, process.output()
            time.sleep(0.05)
        time.sleep(0.5)  # identity's finalize is running
        code, _ = process.stop(signal.SIGINT, timeout=30)
        assert code == 1, process.output()
        assert "failed to load all models" in process.stderr
        process.assert_clean()
    finally:
        process.kill()


def test_serve_raises_its_open_file_limit_to_the_hard_one(tmp_path):
    """At the usual soft limit of 1024 the connection bound of each listener would be 256;
    dlserve serve raises the soft limit to the hard one first, as most servers do."""
    empty = tmp_path / "empty_repo"
    empty.mkdir()
    limited = ("sh", "-c", 'ulimit -Sn 1024 && exec "$@"', "sh")
    process = Serve(tmp_path, ["--model-repository", str(empty)], wrapper=limited)
    try:
        process.wait_started()
        with open(f"/proc/{process.pid}/limits") as limits:
            (line,) = [line for line in limits if line.startswith("Max open files")]
        soft, hard = line.split()[3:5]
        assert soft == hard != "1024", line
    finally:
        process.kill()
