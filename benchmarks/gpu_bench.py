"""CUDA shared memory against system shared memory, on a machine with a GPU.

The example identity model over gRPC (tritonclient), its input and output both in client
system shared memory, then both in client CUDA shared memory, at 4 KiB, 1 MiB and 64 MiB;
the median of 15 requests after 3 warm-ups. With CUDA regions the worker copies the input
from the client's device memory to host memory once (inputs reach a Python model in host
memory, as Triton's default ``FORCE_CPU_ONLY_INPUT_TENSORS`` gives them) and the output
back once. ``identity_gpu`` is the same model with ``FORCE_CPU_ONLY_INPUT_TENSORS: "no"``:
its input is the worker's view of the client's region and its output one device-to-device
copy into the output region. Run: ``python benchmarks/gpu_bench.py``; skips (exit 0)
without CUDA. No Triton runs here: the numbers are dlserve's alone.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402

# identity_gpu's model: its input as its output, wherever the input is (DLPack, no copy)
PASS_THROUGH = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor.from_dlpack("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0"))]
            )
            for r in requests
        ]
"""
SIZES = {"4 KiB": 1 << 12, "1 MiB": 1 << 20, "64 MiB": 1 << 26}
WARMUP, TIMED = 3, 15


def main() -> int:
    from dlserve.memory.cuda import cuda_problem

    problem = cuda_problem()
    if problem is not None:
        print(f"gpu_bench: skipped ({problem})")
        return 0
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.cuda_shared_memory as cudashm
    import tritonclient.utils.shared_memory as sysshm

    rows = []
    with peers.repository([peers.EXAMPLES / "identity"]) as repo:
        shutil.copytree(repo / "identity", repo / "identity_gpu")
        (repo / "identity_gpu" / "1" / "model.py").write_text(PASS_THROUGH)
        config = repo / "identity_gpu" / "config.pbtxt"
        config.write_text(
            config.read_text().replace('name: "identity"', 'name: "identity_gpu"')
            + 'parameters { key: "FORCE_CPU_ONLY_INPUT_TENSORS" value: { string_value: "no" } }\n'
        )
        with peers.dlserve(repo, ["identity", "identity_gpu"]) as server:
            client = grpcclient.InferenceServerClient(server.url("grpc"))
            for label, nbytes in SIZES.items():
                data = np.arange(nbytes // 4, dtype=np.float32)
                times = {}
                for kind in ("system", "cuda", "cuda_gpu_model"):
                    model = "identity_gpu" if kind == "cuda_gpu_model" else "identity"
                    if kind == "system":
                        key = f"/gpu_bench_{nbytes}"
                        handle = sysshm.create_shared_memory_region(f"in_{nbytes}", key, 2 * nbytes)
                        sysshm.set_shared_memory_region(handle, [data])
                        client.register_system_shared_memory(f"r_{nbytes}", key, 2 * nbytes)
                    else:
                        handle = cudashm.create_shared_memory_region(f"{kind}_{nbytes}", 2 * nbytes, 0)
                        cudashm.set_shared_memory_region(handle, [data])
                        client.register_cuda_shared_memory(
                            f"r_{nbytes}", cudashm.get_raw_handle(handle), 0, 2 * nbytes
                        )
                    try:
                        times[kind] = _time(client, grpcclient, model, f"r_{nbytes}", data.size, nbytes)
                        module = sysshm if kind == "system" else cudashm  # (the output follows the input)
                        got = module.get_contents_as_numpy(handle, np.float32, [2 * data.size])
                        assert np.array_equal(got[data.size :], data), f"{kind} {label}: wrong output"
                    finally:
                        if kind == "system":
                            client.unregister_system_shared_memory(f"r_{nbytes}")
                            sysshm.destroy_shared_memory_region(handle)
                        else:
                            client.unregister_cuda_shared_memory(f"r_{nbytes}")
                            cudashm.destroy_shared_memory_region(handle)
                rows.append((label, times["system"], times["cuda"], times["cuda_gpu_model"]))
        in_process = _in_process(repo)
    print("identity over gRPC, input and output in client shared memory (median ms of 15)")
    print(f"{'size':>8} {'system shm':>11} {'CUDA shm':>9} {'CUDA, GPU inputs':>17}")
    for label, system, cuda, gpu in rows:
        print(f"{label:>8} {system:11.3f} {cuda:9.3f} {gpu:17.3f}")
    print()
    print("in-process API, identity (median ms of 15): a numpy input (copied once into shared")
    print("memory) against a cupy input to identity_gpu (copied once device to device into the")
    print("server's device pool; the output comes back on the GPU by reference)")
    print(f"{'size':>8} {'numpy, host':>12} {'cupy, GPU':>10}")
    for label, host, device in in_process:
        print(f"{label:>8} {host:12.3f} {device:10.3f}")
    return 0


def _in_process(repo: Path) -> list[tuple[str, float, float]]:
    """The in-process rows: (size, numpy through identity, cupy through identity_gpu)."""
    import cupy

    import dlserve

    options = dlserve.Options(
        model_repository=str(repo),
        model_control_mode=dlserve.ModelControlMode.EXPLICIT,
        startup_models=["identity", "identity_gpu"],
    )
    server = dlserve.Server(options).start(wait_until_ready=True)
    rows = []
    try:
        for label, nbytes in SIZES.items():
            host = np.arange(nbytes // 4, dtype=np.float32)
            device = cupy.asarray(host)
            medians = []
            for model, given in (("identity", host), ("identity_gpu", device)):
                samples = []
                for index in range(WARMUP + TIMED):
                    started = time.perf_counter()
                    (response,) = server.model(model).infer(inputs={"INPUT0": given})
                    output = response.outputs["OUTPUT0"]
                    if index >= WARMUP:
                        samples.append((time.perf_counter() - started) * 1e3)
                    del response
                assert output.memory_type == (dlserve.MemoryType.CPU if given is host else dlserve.MemoryType.GPU)
                assert np.array_equal(output.to_host().as_numpy(), host), f"{model} {label}: wrong output"
                medians.append(statistics.median(samples))
            rows.append((label, medians[0], medians[1]))
    finally:
        server.stop()
    return rows


def _time(client, grpcclient, model: str, region: str, count: int, nbytes: int) -> float:
    """Median milliseconds of one request whose input is at 0 and output at ``nbytes``."""
    given = grpcclient.InferInput("INPUT0", [count], "FP32")
    given.set_shared_memory(region, nbytes, offset=0)
    wanted = grpcclient.InferRequestedOutput("OUTPUT0")
    wanted.set_shared_memory(region, nbytes, offset=nbytes)
    samples = []
    for index in range(WARMUP + TIMED):
        started = time.perf_counter()
        client.infer(model, [given], outputs=[wanted])
        if index >= WARMUP:
            samples.append((time.perf_counter() - started) * 1e3)
    return statistics.median(samples)


if __name__ == "__main__":
    raise SystemExit(main())
