"""KIND_GPU instances on a CUDA machine: each instance's worker runs on its own
device, selected before ``initialize``. Skipped without CUDA (cupy and a device)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dlserve.memory.cuda import device_count

from ..conftest import ServerHarness

DEVICES = device_count()
pytestmark = pytest.mark.skipif(DEVICES == 0, reason="needs CUDA (cupy and a GPU)")

MODEL = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        import cupy
        self.seen = {
            "current": int(cupy.cuda.runtime.getDevice()),
            "device_id": int(args["model_instance_device_id"]),
            "kind": args["model_instance_kind"],
            "name": args["model_instance_name"],
        }

    def execute(self, requests):
        out = np.array([json.dumps(self.seen).encode()], dtype=np.object_)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("INFO", out)]) for _ in requests]
"""


def config(gpus: list[int]) -> str:
    return (
        'backend: "python"\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "INFO" data_type: TYPE_STRING dims: [ 1 ] } ]\n'
        f"instance_group [ {{ kind: KIND_GPU gpus: {gpus} }} ]\n"
    )


def test_each_gpu_instance_runs_on_its_device(make_repo):
    gpus = list(range(min(DEVICES, 2)))
    repo = make_repo(extra={"where": {"config.pbtxt": config(gpus), "1/model.py": MODEL}})
    harness = ServerHarness()
    try:
        server = harness.start(repo)
        model = server.model("where")
        seen = set()
        for _ in range(8 * len(gpus)):
            (response,) = model.infer(inputs={"X": np.zeros(1, np.float32)})
            info = json.loads(response.outputs["INFO"].to_bytes_array()[0])
            assert info["kind"] == "GPU" and info["current"] == info["device_id"]
            seen.add(info["device_id"])
        assert seen == set(gpus)  # requests reached an instance on every listed device
        assert "cuda_shared_memory" in server.metadata()["extensions"]  # (as Triton lists it)
    finally:
        harness.close()


def test_gpu_metrics_describe_every_device(make_repo):
    """nv_gpu_* gauges through NVML (nvidia-ml-py), one sample per device, labelled by UUID."""
    pytest.importorskip("pynvml", reason="GPU metrics need nvidia-ml-py")
    from prometheus_client.parser import text_string_to_metric_families

    from dlserve.engine import prometheus

    # NVML keeps descriptors open for the process (an eventfd, the device files) from its
    # first queries on: make them before the harness counts the process's descriptors.
    assert prometheus._gpu_lines(), "NVML gave no GPU metrics"
    harness = ServerHarness()
    try:
        server = harness.start(make_repo())
        families = {f.name: f for f in text_string_to_metric_families(server.metrics())}
        for name in ("nv_gpu_utilization", "nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes",
                     "nv_gpu_power_usage", "nv_gpu_power_limit"):
            samples = families[name].samples
            assert len(samples) == DEVICES, (name, samples)
            assert all(s.labels["gpu_uuid"].startswith("GPU-") for s in samples), samples
        assert all(s.value > 0 for s in families["nv_gpu_memory_total_bytes"].samples)
        assert all(0 <= s.value <= 1 for s in families["nv_gpu_utilization"].samples)
    finally:
        harness.close()
