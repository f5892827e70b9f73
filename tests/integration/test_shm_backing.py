"""Serving where /dev/shm is small or unwanted: a segment /dev/shm cannot hold is a
memfd (dlserve.memory.shm), so Docker's default 64 MiB /dev/shm is no limit, and
``DLSERVE_SHM=memfd`` keeps dlserve out of /dev/shm altogether."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

import dlserve
from dlserve.memory.shm import BACKING_VARIABLE

from ..conftest import pid_alive, wait_until
from .test_cli import Serve

MIB = 1 << 20


def bls_via_identity(infer, data: np.ndarray) -> tuple[np.ndarray, dict]:
    """The bls model calling identity with ``data``: its output and what it noted."""
    outputs = infer("bls", data, {"route": "identity"})
    info = json.loads(outputs["INFO"][0])
    return outputs["OUTPUT0"], info


def test_with_every_segment_a_memfd_nothing_is_in_dev_shm(servers, make_repo, monkeypatch):
    monkeypatch.setenv("DLSERVE_SHM", "memfd")  # read by the server and its workers
    server = servers.start(make_repo("identity", "bls", "add_sub"))
    assert server.model("bls").ready() and server.model("identity").ready()
    big = np.random.default_rng(0).random(MIB, dtype=np.float32)  # 4 MiB: by reference

    (response,) = server.model("identity").infer(inputs={"INPUT0": big})
    np.testing.assert_array_equal(response.outputs["OUTPUT0"].to_host().as_numpy(), big)

    def infer(model: str, data: np.ndarray, parameters: dict) -> dict:
        (answer,) = server.model(model).infer(inputs={"INPUT0": data}, parameters=parameters)
        outputs = {name: tensor.to_host() for name, tensor in answer.outputs.items()}
        return {
            name: tensor.to_bytes_array() if name == "INFO" else tensor.as_numpy()
            for name, tensor in outputs.items()
        }

    output, info = bls_via_identity(infer, big)
    np.testing.assert_array_equal(output, big)
    # worker to worker through the server, by reference, in memfds of three processes
    assert info == {"same_memory": True, "via": "identity"}
    assert glob.glob(f"/dev/shm/{server.engine.segment_prefix}*") == []


def private_dev_shm_works() -> bool:
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
        capture_output=True,
        check=False,
    )
    return probe.returncode == 0


@pytest.mark.skipif(
    not private_dev_shm_works(), reason="needs unshare and mount (root) for a private /dev/shm"
)
def test_serves_with_a_64_mib_dev_shm_as_docker_gives(tmp_path: Path, make_repo, monkeypatch):
    """Docker's default --shm-size is 64 MiB: the server's own arena takes it all,
    and every worker, every BLS call and a 16 MiB request still go through."""
    monkeypatch.delenv(BACKING_VARIABLE, raising=False)  # (/dev/shm first: what this is about)
    repo = make_repo("identity", "bls", "add_sub")
    mount = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$0" "$@"'
    server = Serve(
        tmp_path, ["--model-repository", str(repo)], wrapper=("unshare", "-m", "sh", "-c", mount)
    )
    try:
        server.wait_started()
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.ports['http']}")
        assert client.is_server_ready()

        def infer(model: str, data: np.ndarray, parameters: dict) -> dict:
            tensor = httpclient.InferInput("INPUT0", list(data.shape), "FP32")
            tensor.set_data_from_numpy(data)
            result = client.infer(model, [tensor], parameters=parameters)
            names = [output["name"] for output in result.get_response()["outputs"]]
            return {name: result.as_numpy(name) for name in names}

        big = np.random.default_rng(1).random(4 * MIB, dtype=np.float32)  # 16 MiB
        np.testing.assert_array_equal(infer("identity", big, {})["OUTPUT0"], big)
        output, info = bls_via_identity(infer, big[:MIB])
        np.testing.assert_array_equal(output, big[:MIB])
        assert info["via"] == "identity"
        # /dev/shm full with the server's arena, the workers' arenas are memfds
        workers = server.workers()
        assert len(workers) == 3
        for worker in workers:
            maps = Path(f"/proc/{worker.pid}/maps").read_text()
            assert "/memfd:dlserve_" in maps, worker.cmdline()
        client.close()
        code, _ = server.stop()
        assert code == 0, server.output()
        output = server.output()
        assert "failed to allocate" not in output
        # the operator is told why, once per process
        assert "does not fit in /dev/shm: No space left on device; using memfd" in output
        server.assert_clean()
    finally:
        server.kill()


def test_a_killed_worker_with_memfd_segments_is_replaced_and_leaves_nothing(
    servers, make_repo, monkeypatch
):
    """Nothing to unlink after a SIGKILL: the kernel frees a dead worker's memfds once
    the server lets go of its mappings, and the restarted worker makes new ones."""
    monkeypatch.setenv("DLSERVE_SHM", "memfd")
    server = servers.start(make_repo("identity"))
    assert server.model("identity").ready()
    big = np.arange(MIB, dtype=np.float32)
    instance = server.engine.model("identity").instances[0]
    for _ in range(2):
        (response,) = server.model("identity").infer(inputs={"INPUT0": big})
        np.testing.assert_array_equal(response.outputs["OUTPUT0"].to_host().as_numpy(), big)
        del response
        pid = instance.pid
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not pid_alive(pid))
        wait_until(lambda: server.model("identity").ready() and instance.pid != pid)
    assert instance.restarts == 2
    assert glob.glob(f"/dev/shm/{server.engine.segment_prefix}*") == []


SCALE_CONFIG = """
backend: "python"
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""

SCALE_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2)]
            )
            for r in requests
        ]
"""


def test_the_python_backend_settings_size_a_workers_segments(servers, make_repo, monkeypatch):
    """shm-default-byte-size is a worker's first segment, shm-growth-byte-size each one it
    adds when an output does not fit (or the output's size, when bigger)."""
    monkeypatch.delenv(BACKING_VARIABLE, raising=False)  # (counted in /dev/shm)
    repo = make_repo(extra={"scale": {"config.pbtxt": SCALE_CONFIG, "1/model.py": SCALE_MODEL}})
    server = servers.start(repo, backend_configuration={
        "python": {"shm-default-byte-size": str(MIB), "shm-growth-byte-size": str(3 * MIB)}
    })
    worker_segments = f"/dev/shm/{server.engine.segment_prefix}_w*"
    assert [os.path.getsize(p) for p in glob.glob(worker_segments)] == [MIB]
    x = np.ones(MIB // 2, np.float32)  # a 2 MiB output: more than the first segment holds
    (response,) = server.model("scale").infer(inputs={"X": x})
    np.testing.assert_array_equal(response.outputs["Y"].to_host().as_numpy(), x * 2)
    assert sorted(os.path.getsize(p) for p in glob.glob(worker_segments)) == [MIB, 3 * MIB]


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"shm-growth-byte-size": "0"},
         "shm-growth-byte-size can't be smaller than or equal to zero."),
        ({"shm-growth-byte-size": "abc"}, "shm-growth-byte-size must be an integer"),
        ({"shm-default-byte-size": "1024"}, "shm-default-byte-size must be at least 1 MiB"),
    ],
)
def test_bad_python_backend_settings_are_refused(tmp_path, settings, message):
    options = dlserve.Options(
        model_repository=str(tmp_path), backend_configuration={"python": settings}
    )
    with pytest.raises(dlserve.InvalidArgumentError, match=re.escape(message)):
        dlserve.Server(options).start()


def test_unless_set_a_workers_added_segments_are_as_large_as_its_first(tmp_path):
    python = {"shm-default-byte-size": str(2 * MIB)}
    options = dlserve.Options(
        model_repository=str(tmp_path), backend_configuration={"python": python}
    )
    settings = options.engine_settings()
    assert (settings.worker_arena_bytes, settings.worker_arena_growth_bytes) == (2 * MIB, 2 * MIB)
