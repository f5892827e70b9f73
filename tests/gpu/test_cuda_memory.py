"""CUDA memory end to end: CUDA shared-memory regions registered through tritonclient
(HTTP and gRPC) with a ``dlserve serve`` process, models that return GPU tensors
(cupy and torch through DLPack), a KIND_GPU model answering into a CUDA region, and
the in-process API's GPU tensors. Skipped without CUDA (cupy and a device).

The CUDA regions live in this (the client's) process and reach the server through
cudaIpcMemHandle, which a process cannot open on its own allocations: so the
tritonclient tests talk to a separate ``dlserve serve`` process, not to an
in-process server.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dlserve
from dlserve.memory.cuda import device_count

from ..conftest import EXAMPLES, ServerHarness, describe_fds, open_fds, worker_processes

DEVICES = device_count()
pytestmark = pytest.mark.skipif(DEVICES == 0, reason="needs CUDA (cupy and a GPU)")

PROTOCOLS = ["http", "grpc"]
F32 = np.dtype(np.float32).itemsize
# the example add_sub: INPUT0, INPUT1 -> OUTPUT0 = sum, OUTPUT1 = difference, FP32 [4]
A = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)
B = np.array([10.0, 20.0, 30.0, 40.0], dtype=np.float32)
TENSOR_BYTES = A.nbytes  # 16

# Returns Y = X * 2 made with cupy and, where torch imports, Z = X + 1 made with torch on
# CUDA, both as GPU tensors through DLPack. INFO (JSON) says what the model saw; each
# expectation that did not hold is listed under "problems", so one failed check does not
# hide the others (the test asserts the list is empty).
GPU_MODEL = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils

try:
    import torch
    import torch.utils.dlpack
except ImportError:
    torch = None


class TritonPythonModel:
    def initialize(self, args):
        self.device = int(args["model_instance_device_id"])
        self.kind = args["model_instance_kind"]

    def execute(self, requests):
        import cupy

        responses = []
        for request in requests:
            seen = {"torch": torch is not None, "kind": self.kind, "problems": []}

            def check(holds, what):
                if not holds:
                    seen["problems"].append(what)

            x_in = pb_utils.get_input_tensor_by_name(request, "X")
            seen["input_is_cpu"] = x_in.is_cpu()
            check(seen["input_is_cpu"] is True, "the request input's is_cpu() is not True")
            x = np.array(x_in.as_numpy(), dtype=np.float32)
            with cupy.cuda.Device(self.device):
                y_array = cupy.asarray(x) * 2
                y = pb_utils.Tensor.from_dlpack("Y", y_array)
                seen["y_is_cpu"] = y.is_cpu()
                check(seen["y_is_cpu"] is False, "the cupy output's is_cpu() is not False")
                seen["y_dlpack_device"] = list(y.__dlpack_device__())
                check(seen["y_dlpack_device"] == [2, self.device], "Y's DLPack device")
                try:
                    y.as_numpy()
                    seen["y_as_numpy"] = "returned an array"
                except pb_utils.TritonModelException as exc:
                    seen["y_as_numpy"] = "TritonModelException: " + str(exc)
                except Exception as exc:
                    seen["y_as_numpy"] = type(exc).__name__ + ": " + str(exc)
                check(seen["y_as_numpy"].startswith("TritonModelException"),
                      "as_numpy() of a GPU tensor did not raise TritonModelException")
                outputs = [y]
                if torch is not None:
                    back = torch.utils.dlpack.from_dlpack(y.to_dlpack())
                    seen["y_back_is_cuda"] = bool(back.is_cuda)
                    seen["y_back_same_pointer"] = back.data_ptr() == y_array.data.ptr
                    check(seen["y_back_is_cuda"], "torch's view of Y is not a CUDA tensor")
                    check(seen["y_back_same_pointer"], "torch's view of Y is a copy")
                    z_tensor = torch.tensor(x, device=f"cuda:{self.device}") + 1
                    z = pb_utils.Tensor.from_dlpack("Z", torch.utils.dlpack.to_dlpack(z_tensor))
                    seen["z_is_cpu"] = z.is_cpu()
                    check(seen["z_is_cpu"] is False, "the torch output's is_cpu() is not False")
                    outputs.append(z)
            info = np.array([json.dumps(seen).encode()], dtype=np.object_)
            outputs.append(pb_utils.Tensor("INFO", info))
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses
"""


# FORCE_CPU_ONLY_INPUT_TENSORS "no": an input in a client's CUDA region reaches the model on
# the GPU, over the client's memory. Y is the input itself (sent back by reference), Z = X * 3
# made with cupy; INFO says what the model saw, as GPU_MODEL's does.
GPU_INPUTS_MODEL = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        import cupy

        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X")
            seen = {"input_is_cpu": x.is_cpu(), "device": list(x.__dlpack_device__()), "problems": []}
            outputs = [pb_utils.Tensor.from_dlpack("Y", x)]
            if x.is_cpu():
                values = x.as_numpy()
            else:
                on_gpu = cupy.from_dlpack(x)
                values = cupy.asnumpy(on_gpu)
                outputs.append(pb_utils.Tensor.from_dlpack("Z", on_gpu * 3))
            seen["values"] = values.tolist()
            info = np.array([json.dumps(seen).encode()], dtype=np.object_)
            outputs.append(pb_utils.Tensor("INFO", info))
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses
"""
GPU_INPUTS_CONFIG = """
backend: "python"
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [
  { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "Z" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "INFO" data_type: TYPE_STRING dims: [ 1 ] }
]
parameters { key: "FORCE_CPU_ONLY_INPUT_TENSORS" value: { string_value: "no" } }
"""


# A BLS caller on the GPU: X (moved to the GPU if it came in host memory) goes to gpu_inputs
# by BLS; INFO reports where the callee's Z came back (it is made on the GPU there).
GPU_BLS_MODEL = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        import cupy

        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X")
            on_gpu = cupy.from_dlpack(x) if not x.is_cpu() else cupy.asarray(x.as_numpy())
            call = pb_utils.InferenceRequest(
                model_name="gpu_inputs",
                inputs=[pb_utils.Tensor.from_dlpack("X", on_gpu)],
                requested_output_names=["Z"],
            )
            answer = call.exec()
            if answer.has_error():
                raise pb_utils.TritonModelException(answer.error().message())
            z = pb_utils.get_output_tensor_by_name(answer, "Z")
            seen = {"z_is_cpu": z.is_cpu(), "z": cupy.asnumpy(cupy.from_dlpack(z)).tolist()}
            info = np.array([json.dumps(seen).encode()], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor.from_dlpack("Z", z), pb_utils.Tensor("INFO", info)]
            ))
        return responses
"""
GPU_BLS_CONFIG = """
backend: "python"
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [
  { name: "Z" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "INFO" data_type: TYPE_STRING dims: [ 1 ] }
]
parameters { key: "FORCE_CPU_ONLY_INPUT_TENSORS" value: { string_value: "no" } }
"""


# Holds its input for SLOW_SECONDS before answering it as Y: a request that keeps a region in use.
SLOW_SECONDS = 1.5
SLOW_MODEL = f"""
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep({SLOW_SECONDS})
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())]
            )
            for r in requests
        ]
"""
SLOW_CONFIG = """
backend: "python"
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


def gpu_model_config(kind: str) -> str:
    group = "kind: KIND_GPU gpus: [ 0 ]" if kind == "GPU" else "kind: KIND_CPU"
    return (
        'backend: "python"\n'
        "max_batch_size: 0\n"
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        "output [\n"
        '  { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] },\n'
        '  { name: "Z" data_type: TYPE_FP32 dims: [ -1 ] },\n'
        '  { name: "INFO" data_type: TYPE_STRING dims: [ 1 ] }\n'
        "]\n"
        f"instance_group [ {{ count: 1 {group} }} ]\n"
    )


def write_repo(repo: Path, kind_gpu: bool = True) -> Path:
    """add_sub (the bundled example), gpu_tensors (KIND_CPU) and, with ``kind_gpu``,
    gpu_tensors_gpu (KIND_GPU)."""
    repo.mkdir(parents=True, exist_ok=True)
    shutil.copytree(EXAMPLES / "add_sub", repo / "add_sub")
    gpu_models = [("gpu_tensors", "CPU")] + ([("gpu_tensors_gpu", "GPU")] if kind_gpu else [])
    for name, kind in gpu_models:
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(gpu_model_config(kind))
        (repo / name / "1" / "model.py").write_text(GPU_MODEL)
    (repo / "gpu_inputs" / "1").mkdir(parents=True)
    (repo / "gpu_inputs" / "config.pbtxt").write_text(GPU_INPUTS_CONFIG)
    (repo / "gpu_inputs" / "1" / "model.py").write_text(GPU_INPUTS_MODEL)
    (repo / "gpu_bls" / "1").mkdir(parents=True)
    (repo / "gpu_bls" / "config.pbtxt").write_text(GPU_BLS_CONFIG)
    (repo / "gpu_bls" / "1" / "model.py").write_text(GPU_BLS_MODEL)
    (repo / "slow" / "1").mkdir(parents=True)
    (repo / "slow" / "config.pbtxt").write_text(SLOW_CONFIG)
    (repo / "slow" / "1" / "model.py").write_text(SLOW_MODEL)
    return repo


def read_info(raw: Any) -> dict[str, Any]:
    value = raw[0] if not isinstance(raw, (bytes, str)) else raw
    return json.loads(value.decode() if isinstance(value, bytes) else value)


def assert_model_saw_no_problems(info: dict[str, Any]) -> None:
    assert info["problems"] == [], f"the model's checks failed: {info['problems']}; saw {info}"


# -- a dlserve serve process ------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def dlserve_command() -> list[str]:
    """The ``dlserve`` console script beside this Python, as tests/integration/test_cli.py
    runs it; where it is not installed (dlserve run from a source tree through PYTHONPATH,
    as on the GPU machine), the same entry point through ``-c``."""
    beside = Path(sys.executable).parent / "dlserve"
    if beside.exists():
        return [str(beside)]
    return [sys.executable, "-c", "import sys; from dlserve.cli import main; sys.exit(main())"]


class ServeProcess:
    """``dlserve serve --allow-client-shm`` on free 127.0.0.1 ports; output goes to files."""

    def __init__(self, workdir: Path, repo: Path) -> None:
        self.http_port, self.grpc_port = free_port(), free_port()
        self.out, self.err = workdir / "serve.out", workdir / "serve.err"
        command = [
            *dlserve_command(), "serve", "--model-repository", str(repo),
            "--allow-client-shm", "--allow-metrics=false",
            "--http-address", "127.0.0.1", "--http-port", str(self.http_port),
            "--grpc-address", "127.0.0.1", "--grpc-port", str(self.grpc_port),
        ]
        with self.out.open("w") as out, self.err.open("w") as err:
            # (in this process's session: a run that is cut short takes it down too)
            self.proc = subprocess.Popen(command, stdout=out, stderr=err, cwd=workdir)
        self.pid = self.proc.pid
        self.stopped = False

    def output(self) -> str:
        return f"--- stdout\n{self.out.read_text()}\n--- stderr\n{self.err.read_text()}"

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while "dlserve: ready" not in self.out.read_text():
            if self.proc.poll() is not None:
                raise AssertionError(f"exited with {self.proc.returncode}:\n{self.output()}")
            if "dlserve: started" in self.out.read_text():
                raise AssertionError(f"some models did not load:\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"not ready after {timeout} s:\n{self.output()}")
            time.sleep(0.05)

    def segments(self) -> list[str]:
        return glob.glob(f"/dev/shm/dlserve_{self.pid}_*")

    def stop_and_check(self) -> None:
        """SIGTERM; then nothing of the server may remain: no /dev/shm segment of its, no
        worker process."""
        if self.stopped:
            return
        self.stopped = True
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running 30 s after SIGTERM:\n{self.output()}") from None
        assert code == 0, f"exit status {code}:\n{self.output()}"
        deadline = time.monotonic() + 5
        while (self.segments() or worker_processes(f"dlserve_{self.pid}")) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert not self.segments(), f"shared memory left behind: {self.segments()}"
        workers = worker_processes(f"dlserve_{self.pid}")
        assert not workers, f"worker processes left behind: {workers}"

    def kill(self) -> None:
        self.stopped = True
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in worker_processes(f"dlserve_{self.pid}"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    workdir = tmp_path_factory.mktemp("cuda_serve")
    process = ServeProcess(workdir, write_repo(workdir / "models"))
    try:
        process.wait_ready()
        yield process
    finally:
        process.kill()  # (test_server_process_stops_clean stops and checks it first)


# -- clients ----------------------------------------------------------------------------------
class Client:
    """One tritonclient (HTTP or gRPC) with what differs between the two evened out."""

    def __init__(self, protocol: str, served: ServeProcess) -> None:
        import tritonclient.grpc as grpcclient
        import tritonclient.http as httpclient

        self.protocol = protocol
        self.served = served
        if protocol == "http":
            self.module: Any = httpclient
            self.client: Any = httpclient.InferenceServerClient(
                f"127.0.0.1:{served.http_port}", network_timeout=60
            )
        else:
            self.module = grpcclient
            self.client = grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc_port}")

    def close(self) -> None:
        self.client.close()

    def extensions(self) -> list[str]:
        metadata = self.client.get_server_metadata()
        return list(metadata["extensions"] if self.protocol == "http" else metadata.extensions)

    def cuda_status(self, name: str = "") -> dict[str, dict[str, int]]:
        """{name: {"device_id", "byte_size"}} from either protocol's answer."""
        found: dict[str, dict[str, int]] = {}
        reply = self.client.get_cuda_shared_memory_status(name)
        if self.protocol == "http":
            assert isinstance(reply, list), f"HTTP status is not a list: {reply!r}"
            for row in reply:
                assert set(row) == {"name", "device_id", "byte_size"}, f"status row {row}"
                found[row["name"]] = {"device_id": row["device_id"], "byte_size": row["byte_size"]}
        else:
            for key, region in reply.regions.items():
                assert region.name == key, f"gRPC status: region {region.name!r} under {key!r}"
                found[key] = {"device_id": region.device_id, "byte_size": region.byte_size}
        return found

    def invalid_argument(self) -> str:
        return "400" if self.protocol == "http" else "StatusCode.INVALID_ARGUMENT"

    def fp32_input(self, name: str, shape: list[int]) -> Any:
        return self.module.InferInput(name, shape, "FP32")

    def output(self, name: str) -> Any:
        return self.module.InferRequestedOutput(name)


@pytest.fixture(params=PROTOCOLS)
def client(request: pytest.FixtureRequest, served: ServeProcess) -> Iterator[Client]:
    made = Client(request.param, served)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def cudashm() -> Any:
    import tritonclient.utils.cuda_shared_memory as module

    return module


@pytest.fixture
def cuda_regions(cudashm: Any, client: Client) -> Iterator[Callable[..., Any]]:
    """Make CUDA regions on device 0 with tritonclient's utilities (registered unless
    ``register`` is false); after the test the server lets go of them, then they are freed."""
    made: list[Any] = []

    def make(name: str, byte_size: int, register: bool = True) -> Any:
        handle = cudashm.create_shared_memory_region(name, byte_size, 0)
        made.append(handle)
        if register:
            client.client.register_cuda_shared_memory(
                name, cudashm.get_raw_handle(handle), 0, byte_size
            )
        return handle

    yield make
    with contextlib.suppress(Exception):  # (a test may have unregistered them already)
        client.client.unregister_cuda_shared_memory()
    for handle in made:
        cudashm.destroy_shared_memory_region(handle)


def system_key(name: str) -> str:
    return f"/gputest_{os.getpid()}_{name}"


@pytest.fixture
def system_regions(client: Client) -> Iterator[Callable[..., Any]]:
    """System shared-memory regions made with tritonclient's utilities (registered unless
    ``register`` is false); unregistered and destroyed after the test."""
    import tritonclient.utils.shared_memory as shm

    made: list[Any] = []

    def make(name: str, byte_size: int, register: bool = True) -> Any:
        key = system_key(name)
        handle = shm.create_shared_memory_region(name, key, byte_size)
        made.append(handle)
        if register:
            client.client.register_system_shared_memory(name, key, byte_size)
        return handle

    yield make
    with contextlib.suppress(Exception):
        client.client.unregister_system_shared_memory()
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def cuda_floats(cudashm: Any, handle: Any, count: int) -> np.ndarray:
    """The first ``count`` FP32 values of a CUDA region (tritonclient reads from its start)."""
    return cudashm.get_contents_as_numpy(handle, np.float32, [count])


def add_sub_shm_inputs(client: Client, region: str) -> list[Any]:
    """INPUT0 at offset 0 and INPUT1 at offset 16 of one region."""
    inputs = []
    for index, name in enumerate(("INPUT0", "INPUT1")):
        tensor = client.fp32_input(name, [4])
        tensor.set_shared_memory(region, TENSOR_BYTES, offset=index * TENSOR_BYTES)
        inputs.append(tensor)
    return inputs


def add_sub_shm_outputs(client: Client, region: str) -> list[Any]:
    """OUTPUT0 at offset 0 and OUTPUT1 at offset 16 of one region."""
    outputs = []
    for index, name in enumerate(("OUTPUT0", "OUTPUT1")):
        tensor = client.output(name)
        tensor.set_shared_memory(region, TENSOR_BYTES, offset=index * TENSOR_BYTES)
        outputs.append(tensor)
    return outputs


def status_rows(reply: Any) -> list[dict[str, Any]]:
    """A system shared-memory status as HTTP's list of dicts (gRPC's regions map too)."""
    if isinstance(reply, list):
        return reply
    return [{"name": key} for key in reply.regions]


def client_error(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as info:
        call(*args, **kwargs)
    return info.value


# ==========================================================================================
# a. CUDA shared memory through tritonclient
# ==========================================================================================
def test_server_metadata_lists_cuda_shared_memory(client: Client) -> None:
    assert "cuda_shared_memory" in client.extensions(), client.extensions()


def test_cuda_shared_memory_round_trip(client: Client, cudashm: Any, cuda_regions) -> None:
    """Both inputs in one CUDA region, both outputs in another, at offsets."""
    inputs = cuda_regions("cuda_in", 2 * TENSOR_BYTES)
    outputs = cuda_regions("cuda_out", 2 * TENSOR_BYTES)
    cudashm.set_shared_memory_region(inputs, [A, B])
    assert client.cuda_status() == {
        "cuda_in": {"device_id": 0, "byte_size": 32},
        "cuda_out": {"device_id": 0, "byte_size": 32},
    }
    assert client.cuda_status("cuda_out") == {"cuda_out": {"device_id": 0, "byte_size": 32}}

    result = client.client.infer(
        "add_sub",
        add_sub_shm_inputs(client, "cuda_in"),
        outputs=add_sub_shm_outputs(client, "cuda_out"),
    )
    assert result.get_output("OUTPUT0") is not None, "OUTPUT0 is missing from the response"
    got = cuda_floats(cudashm, outputs, 8)
    np.testing.assert_array_equal(got[:4], A + B, err_msg="OUTPUT0 in the CUDA region")
    np.testing.assert_array_equal(got[4:], A - B, err_msg="OUTPUT1 in the CUDA region")

    # The server reads the region as it is at request time.
    cudashm.set_shared_memory_region(inputs, [A * 3, B])
    client.client.infer(
        "add_sub",
        add_sub_shm_inputs(client, "cuda_in"),
        outputs=add_sub_shm_outputs(client, "cuda_out"),
    )
    got = cuda_floats(cudashm, outputs, 8)
    np.testing.assert_array_equal(got[:4], A * 3 + B, err_msg="OUTPUT0 after new inputs")
    np.testing.assert_array_equal(got[4:], A * 3 - B, err_msg="OUTPUT1 after new inputs")

    client.client.unregister_cuda_shared_memory("cuda_in")
    assert list(client.cuda_status()) == ["cuda_out"], "unregistering one region"
    client.client.unregister_cuda_shared_memory()
    assert client.cuda_status() == {}, "unregistering all regions"


@pytest.mark.parametrize("inputs_in", ["cuda", "system"])
def test_cuda_and_system_shared_memory_mixed(
    client: Client, cudashm: Any, cuda_regions, system_regions, inputs_in: str
) -> None:
    """Inputs in a CUDA region and outputs in a system one, and the reverse."""
    import tritonclient.utils.shared_memory as shm

    if inputs_in == "cuda":
        inputs = cuda_regions("mix_in", 2 * TENSOR_BYTES)
        cudashm.set_shared_memory_region(inputs, [A, B])
        outputs = system_regions("mix_out", 2 * TENSOR_BYTES)
    else:
        inputs = system_regions("mix_in", 2 * TENSOR_BYTES)
        shm.set_shared_memory_region(inputs, [A, B])
        outputs = cuda_regions("mix_out", 2 * TENSOR_BYTES)
    client.client.infer(
        "add_sub",
        add_sub_shm_inputs(client, "mix_in"),
        outputs=add_sub_shm_outputs(client, "mix_out"),
    )
    if inputs_in == "cuda":
        got = shm.get_contents_as_numpy(outputs, np.float32, [8])
    else:
        got = cuda_floats(cudashm, outputs, 8)
    np.testing.assert_array_equal(got[:4], A + B, err_msg=f"OUTPUT0 (inputs in {inputs_in})")
    np.testing.assert_array_equal(got[4:], A - B, err_msg=f"OUTPUT1 (inputs in {inputs_in})")


def test_a_region_name_is_registered_once(
    client: Client, cudashm: Any, cuda_regions, system_regions
) -> None:
    cuda_regions("twice", 64)
    second = cuda_regions("twice_other", 64, register=False)
    error = client_error(
        client.client.register_cuda_shared_memory, "twice", cudashm.get_raw_handle(second), 0, 64
    )
    assert "already in manager" in error.message(), f"same CUDA name twice: {error}"

    system_regions("named_by_system", 64)
    error = client_error(
        client.client.register_cuda_shared_memory,
        "named_by_system", cudashm.get_raw_handle(second), 0, 64,
    )
    assert "already in manager" in error.message(), f"CUDA name of a system region: {error}"
    assert list(client.cuda_status()) == ["twice"], "a refused registration left a region"

    # ... and the other way round: one name space for both kinds, as in Triton.
    system_regions("system_spare", 64, register=False)
    error = client_error(
        client.client.register_system_shared_memory, "twice", system_key("system_spare"), 64
    )
    assert "already in manager" in error.message(), f"system name of a CUDA region: {error}"
    names = [row["name"] for row in status_rows(client.client.get_system_shared_memory_status())]
    assert names == ["named_by_system"], f"system regions after the refusals: {names}"


@pytest.mark.parametrize("where", ["input", "output"])
def test_a_reference_outside_the_region_is_refused(
    client: Client, cudashm: Any, cuda_regions, where: str
) -> None:
    inputs = cuda_regions("ref_in", 2 * TENSOR_BYTES)
    outputs = cuda_regions("ref_out", 2 * TENSOR_BYTES)
    cudashm.set_shared_memory_region(inputs, [A, B])
    bad_inputs = add_sub_shm_inputs(client, "ref_in")
    bad_outputs = add_sub_shm_outputs(client, "ref_out")
    beyond = 2 * TENSOR_BYTES - 8  # [24, 40) of a 32-byte region
    if where == "input":
        bad_inputs[1].set_shared_memory("ref_in", TENSOR_BYTES, offset=beyond)
    else:
        bad_outputs[1].set_shared_memory("ref_out", TENSOR_BYTES, offset=beyond)
    error = client_error(client.client.infer, "add_sub", bad_inputs, outputs=bad_outputs)
    assert error.status() == client.invalid_argument(), f"{where} outside its region: {error}"
    assert error.message(), f"{where} outside its region: the error says nothing"

    # ... and the server goes on serving.
    client.client.infer(
        "add_sub",
        add_sub_shm_inputs(client, "ref_in"),
        outputs=add_sub_shm_outputs(client, "ref_out"),
    )
    got = cuda_floats(cudashm, outputs, 8)
    np.testing.assert_array_equal(got[:4], A + B, err_msg="OUTPUT0 after a refused request")


def test_an_output_region_too_small_is_refused(
    client: Client, cudashm: Any, cuda_regions
) -> None:
    inputs = cuda_regions("small_in", 2 * TENSOR_BYTES)
    cuda_regions("small_out", 8)
    cudashm.set_shared_memory_region(inputs, [A, B])
    output = client.output("OUTPUT0")
    output.set_shared_memory("small_out", 8)
    error = client_error(
        client.client.infer, "add_sub", add_sub_shm_inputs(client, "small_in"), outputs=[output]
    )
    assert "should be at least" in error.message(), f"8-byte region for 16 bytes: {error}"


def test_status_of_an_unknown_region_is_an_error(client: Client) -> None:
    error = client_error(client.client.get_cuda_shared_memory_status, "no_such_region")
    assert "no_such_region" in error.message(), f"unknown region's status: {error}"


# ==========================================================================================
# b. A model that returns GPU tensors; c. a KIND_GPU model answering into a CUDA region
# ==========================================================================================
X = np.arange(8, dtype=np.float32)


def test_a_model_returns_gpu_tensors(client: Client) -> None:
    x = client.fp32_input("X", [len(X)])
    x.set_data_from_numpy(X)
    result = client.client.infer("gpu_tensors", [x])
    info = read_info(result.as_numpy("INFO"))
    assert_model_saw_no_problems(info)
    assert info["kind"] == "CPU", info
    np.testing.assert_array_equal(result.as_numpy("Y"), X * 2, err_msg="Y (cupy)")
    if info["torch"]:
        np.testing.assert_array_equal(result.as_numpy("Z"), X + 1, err_msg="Z (torch)")
    else:
        assert result.get_output("Z") is None, "Z without torch in the model"


def test_a_kind_gpu_model_answers_into_a_cuda_region(
    client: Client, cudashm: Any, cuda_regions
) -> None:
    x = client.fp32_input("X", [len(X)])
    x.set_data_from_numpy(X)
    plain = client.client.infer("gpu_tensors_gpu", [x])
    info = read_info(plain.as_numpy("INFO"))
    assert_model_saw_no_problems(info)
    assert info["kind"] == "GPU", info

    names = ["Y", "Z"] if info["torch"] else ["Y"]
    region = cuda_regions("gpu_out", len(names) * X.nbytes)
    outputs = [client.output("INFO")]
    for index, name in enumerate(names):
        output = client.output(name)
        output.set_shared_memory("gpu_out", X.nbytes, offset=index * X.nbytes)
        outputs.append(output)
    result = client.client.infer("gpu_tensors_gpu", [x], outputs=outputs)
    assert_model_saw_no_problems(read_info(result.as_numpy("INFO")))
    got = cuda_floats(cudashm, region, len(names) * len(X))
    np.testing.assert_array_equal(got[: len(X)], X * 2, err_msg="Y in the CUDA region")
    if info["torch"]:
        np.testing.assert_array_equal(got[len(X):], X + 1, err_msg="Z in the CUDA region")


def test_a_model_taking_gpu_inputs_reads_and_answers_in_the_clients_regions(
    client: Client, cudashm: Any, cuda_regions
) -> None:
    """FORCE_CPU_ONLY_INPUT_TENSORS "no": the input reaches the model on the GPU (the
    worker's view of the client's region), the model returns it as it is into an output
    region, and a GPU output made from it comes back over the wire."""
    inputs = cuda_regions("gin", X.nbytes)
    outputs = cuda_regions("gout", X.nbytes)
    cudashm.set_shared_memory_region(inputs, [X])
    x = client.fp32_input("X", [len(X)])
    x.set_shared_memory("gin", X.nbytes)
    y = client.output("Y")
    y.set_shared_memory("gout", X.nbytes)
    result = client.client.infer("gpu_inputs", [x], outputs=[y, client.output("Z"), client.output("INFO")])
    info = read_info(result.as_numpy("INFO"))
    assert info["input_is_cpu"] is False and info["device"] == [2, 0], info
    assert info["values"] == X.tolist(), info
    np.testing.assert_array_equal(cuda_floats(cudashm, outputs, len(X)), X, err_msg="Y in the region")
    np.testing.assert_array_equal(result.as_numpy("Z"), X * 3, err_msg="Z over the wire")

    # The same name registered again over other memory: the worker sees the new memory.
    client.client.unregister_cuda_shared_memory("gin")
    other = cuda_regions("gin", X.nbytes)
    cudashm.set_shared_memory_region(other, [X + 100])
    result = client.client.infer("gpu_inputs", [x], outputs=[client.output("INFO")])
    assert read_info(result.as_numpy("INFO"))["values"] == (X + 100).tolist()


def test_a_host_input_of_a_model_taking_gpu_inputs_stays_on_the_host(client: Client) -> None:
    x = client.fp32_input("X", [len(X)])
    x.set_data_from_numpy(X)
    result = client.client.infer("gpu_inputs", [x], outputs=[client.output("Y"), client.output("INFO")])
    info = read_info(result.as_numpy("INFO"))
    assert info["input_is_cpu"] is True and info["values"] == X.tolist(), info
    np.testing.assert_array_equal(result.as_numpy("Y"), X)


def test_bls_passes_gpu_tensors_on_the_gpu(client: Client) -> None:
    """A GPU tensor sent by BLS reaches a callee that takes GPU inputs on the GPU, and the
    callee's GPU output comes back to the caller on the GPU (through the workers' device
    memory pools, never host memory)."""
    x = client.fp32_input("X", [len(X)])
    x.set_data_from_numpy(X)
    result = client.client.infer("gpu_bls", [x])
    info = read_info(result.as_numpy("INFO"))
    assert info == {"z_is_cpu": False, "z": (X * 3).tolist()}, info
    np.testing.assert_array_equal(result.as_numpy("Z"), X * 3)


def test_a_region_in_use_cannot_be_unregistered(client: Client, cudashm: Any, cuda_regions) -> None:
    """As Triton: while a request holds a region, unregistering it is refused (its
    workers' mappings would go from under the request); once answered, it goes."""
    import concurrent.futures

    region = cuda_regions("busy", X.nbytes)
    cudashm.set_shared_memory_region(region, [X])
    x = client.fp32_input("X", [len(X)])
    x.set_shared_memory("busy", X.nbytes)
    def infer_slowly() -> Any:  # (a client of its own: tritonclient's HTTP one is not thread-safe)
        other = Client(client.protocol, client.served)
        try:
            return other.client.infer("slow", [x])
        finally:
            other.close()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(infer_slowly)
        time.sleep(SLOW_SECONDS / 3)
        error = client_error(client.client.unregister_cuda_shared_memory, "busy")
        assert "Cannot unregister shared memory region 'busy', it is currently in use." in str(error)
        np.testing.assert_array_equal(pending.result(timeout=30).as_numpy("Y"), X)
    client.client.unregister_cuda_shared_memory("busy")
    assert client.cuda_status() == {}


def test_a_region_larger_than_its_allocation_is_refused(client: Client, cudashm: Any, cuda_regions) -> None:
    handle = cuda_regions("small_alloc", 4096, register=False)
    error = client_error(
        client.client.register_cuda_shared_memory, "small_alloc", cudashm.get_raw_handle(handle), 0, 1 << 20
    )
    assert "invalid args" in str(error) and "4096" in str(error), str(error)
    assert client.cuda_status() == {}


def test_an_input_not_aligned_to_its_elements_is_refused(client: Client, cudashm: Any, cuda_regions) -> None:
    """A GPU kernel faults on a misaligned FP32 array (a sticky error that ends the
    worker's CUDA context): such a reference is refused with a clear error instead."""
    cuda_regions("odd", X.nbytes + 4)
    x = client.fp32_input("X", [len(X)])
    x.set_shared_memory("odd", X.nbytes, offset=2)
    error = client_error(client.client.infer, "gpu_inputs", [x])
    assert client.invalid_argument() in str(error) and "not aligned" in str(error), str(error)


def test_torch_in_the_model_matches_torch_here(client: Client) -> None:
    """The model's process runs this Python: torch imports there exactly when it does here
    (else the tests above checked less than they could)."""
    x = client.fp32_input("X", [1])
    x.set_data_from_numpy(X[:1])
    info = read_info(client.client.infer("gpu_tensors", [x]).as_numpy("INFO"))
    assert info["torch"] == (importlib.util.find_spec("torch") is not None), info


# ==========================================================================================
# d. The in-process API
# ==========================================================================================
def warm_cuda() -> None:
    """Make this process's CUDA context, an allocation, a stream and an IPC handle now, so
    that the descriptors the driver opens for them lazily are there before the harness
    counts descriptors."""
    import cupy

    array = cupy.zeros(16, dtype=cupy.float32)
    cupy.cuda.runtime.ipcGetMemHandle(array.data.ptr)
    with cupy.cuda.Stream():
        (array + 1).sum()
    cupy.cuda.runtime.deviceSynchronize()


def device_files(fds: set[int]) -> set[int]:
    """Of ``fds``, those on the NVIDIA driver's device files (the driver's own)."""
    found = set()
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/nvidia"):
                found.add(fd)
    return found


@pytest.fixture(scope="module")
def inprocess(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    warm_cuda()
    repo = write_repo(tmp_path_factory.mktemp("cuda_inprocess") / "models", kind_gpu=False)
    harness = ServerHarness()
    server = harness.start(repo)
    try:
        assert server.ready(), "the in-process server is not ready"
        yield types.SimpleNamespace(server=server, harness=harness)
    finally:
        if server in harness.servers:
            harness.stop(server)  # segments and workers are checked here


def test_inprocess_infer_takes_a_cupy_input(inprocess: Any) -> None:
    import cupy

    (response,) = inprocess.server.model("gpu_tensors").infer(inputs={"X": cupy.asarray(X)})
    info = read_info(response.outputs["INFO"].to_bytes_array())
    assert_model_saw_no_problems(info)
    y = response.outputs["Y"].to_host()
    np.testing.assert_array_equal(np.from_dlpack(y), X * 2, err_msg="Y of a cupy input")


def test_inprocess_output_to_device_and_back(inprocess: Any) -> None:
    import cupy

    a, b = cupy.asarray(A), cupy.asarray(B)
    (response,) = inprocess.server.model("add_sub").infer(inputs={"INPUT0": a, "INPUT1": b})
    for name, expected in (("OUTPUT0", A + B), ("OUTPUT1", A - B)):
        on_gpu = response.outputs[name].to_device("cuda:0")
        assert isinstance(on_gpu, dlserve.Tensor), type(on_gpu)
        assert on_gpu.__dlpack_device__() == (2, 0), on_gpu.__dlpack_device__()
        assert on_gpu.memory_type == dlserve.MemoryType.GPU, on_gpu.memory_type
        np.testing.assert_array_equal(
            cupy.asnumpy(cupy.from_dlpack(on_gpu)), expected, err_msg=f"{name} on the GPU"
        )
        back = on_gpu.to_host()
        assert back.__dlpack_device__() == (1, 0), back.__dlpack_device__()
        np.testing.assert_array_equal(np.from_dlpack(back), expected, err_msg=f"{name} back")


def test_inprocess_gpu_outputs_stay_on_the_gpu_and_give_their_memory_back(inprocess: Any) -> None:
    """A model's GPU output reaches the in-process caller on the GPU (the worker's device
    memory, by reference) unless it asks for host memory; after many requests with GPU
    inputs and outputs, every lease and block of device memory is given back."""
    import gc

    import cupy

    model = inprocess.server.model("gpu_inputs")
    for round_ in range(200):
        x = cupy.asarray(X + round_)
        (response,) = model.infer(inputs={"X": x})
        z = response.outputs["Z"]
        assert z.memory_type == dlserve.MemoryType.GPU, z.memory_type
        np.testing.assert_array_equal(cupy.asnumpy(cupy.from_dlpack(z)), (X + round_) * 3)
        assert read_info(response.outputs["INFO"].to_bytes_array())["input_is_cpu"] is False
    # An empty GPU tensor travels as any empty tensor does (no device memory to share).
    (response,) = model.infer(inputs={"X": cupy.zeros(0, dtype=cupy.float32)})
    assert response.outputs["Y"].shape == (0,), response.outputs["Y"]
    (response,) = model.infer(inputs={"X": cupy.asarray(X)}, output_memory_type="cpu")
    assert response.outputs["Z"].memory_type == dlserve.MemoryType.CPU
    np.testing.assert_array_equal(response.outputs["Z"].as_numpy(), X * 3)
    del response, z, x
    gc.collect()
    model.infer(inputs={"X": X})  # (carries the last releases to the worker)
    gc.collect()
    peers = [i._worker.peer for i in inprocess.server._engine.model("gpu_inputs").instances]
    deadline = time.monotonic() + 5
    while any(p.lease_count for p in peers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p.lease_count for p in peers] == [0] * len(peers), "leases the worker never gave back"
    assert all(len(p.pool._blocks) == 0 for p in peers), "device memory still held for the worker"


def test_tensor_from_a_cupy_array_is_gpu_memory() -> None:
    import cupy

    array = cupy.arange(4, dtype=cupy.float32)
    tensor = dlserve.Tensor.from_dlpack(array)
    assert tensor.memory_type == dlserve.MemoryType.GPU, tensor.memory_type
    assert tensor.memory_type_id == 0, tensor.memory_type_id
    assert tensor.data_ptr == array.data.ptr, "from_dlpack copied the cupy array"


# ==========================================================================================
# e. Nothing left behind (run last: each stops the server its tests above shared)
# ==========================================================================================
def test_inprocess_server_stops_clean(inprocess: Any) -> None:
    """Stopping it leaves no segments and no workers (ServerHarness.stop asserts both), and
    no descriptors but the NVIDIA driver's own."""
    harness = inprocess.harness
    harness.stop(inprocess.server)

    def extra() -> set[int]:
        opened = open_fds() - harness.fds_before
        return opened - device_files(opened)

    deadline = time.monotonic() + 10  # (gRPC and friends close some asynchronously)
    while extra() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not extra(), f"file descriptors left open: {describe_fds(extra())}"


def test_server_process_stops_clean(served: ServeProcess) -> None:
    served.stop_and_check()
