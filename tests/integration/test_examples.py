"""The example repository (examples/models) served in-process, model by model, and
examples/run_examples.py run the way `make examples` runs it.

One server serves every example for the whole module; the framework models
(torch, jax, tensorflow) are checked when their framework is installed and must
then prove, through their ZERO_COPY output, that they used the request's memory.
"""

from __future__ import annotations

import glob
import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dlserve
from dlserve import DataType

from ..conftest import EXAMPLES, ServerHarness

ROOT = EXAMPLES.parent.parent
RUN_EXAMPLES = ROOT / "examples" / "run_examples.py"

PLAIN_MODELS = ["add_sub", "identity", "string_upper", "auto_complete"]
# model -> (module that must import, pip extra)
FRAMEWORK_MODELS = {
    "pytorch_add_sub": ("torch", "torch"),
    "jax_add_sub": ("jax", "jax"),
    "tensorflow_add_sub": ("tensorflow", "tensorflow"),
}
# More than 4 KiB per input: the inputs are placed in (64-byte aligned) shared memory.
LENGTH = 4096


def installed(module: str) -> bool:
    """Whether ``module`` imports here, and so in the workers (same interpreter)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def server():
    harness = ServerHarness()
    srv = harness.start(EXAMPLES, exit_on_error=False)
    yield srv
    harness.close()


def infer_one(server: dlserve.Server, model: str, **kwargs):
    responses = list(server.model(model).infer(**kwargs))
    assert len(responses) == 1 and responses[0].final
    assert responses[0].error is None
    return responses[0]


def test_repository_holds_every_example_and_nothing_else():
    names = sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert names == sorted(PLAIN_MODELS + list(FRAMEWORK_MODELS))
    for name in names:
        assert (EXAMPLES / name / "config.pbtxt").is_file(), name
        assert (EXAMPLES / name / "README.md").is_file(), name
        source = (EXAMPLES / name / "1" / "model.py").read_text()
        assert "import triton_python_backend_utils as pb_utils" in source, name
        assert "class TritonPythonModel" in source, name
        assert "import dlserve" not in source and "from dlserve" not in source, name


def test_models_load_or_say_which_framework_is_missing(server):
    models = server.models()
    states = {name: (model.state, model.reason) for (name, _), model in models.items()}
    for name in PLAIN_MODELS:
        assert states[name][0] == "READY", f"{name}: {states[name][1]}"
    for name, (module, extra) in FRAMEWORK_MODELS.items():
        state, reason = states[name]
        if installed(module):
            assert state == "READY", f"{name}: {reason}"
        else:
            assert state == "UNAVAILABLE"
            assert f"{module} is not installed; pip install 'dlserve[{extra}]'" in reason


# -- add_sub ------------------------------------------------------------------------------
def test_add_sub(server):
    rng = np.random.default_rng(1)
    a = rng.standard_normal(4).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    response = infer_one(server, "add_sub", inputs={"INPUT0": a, "INPUT1": b})
    out0, out1 = response.outputs["OUTPUT0"], response.outputs["OUTPUT1"]
    assert out0.data_type is DataType.FP32 and out0.shape == (4,)
    np.testing.assert_array_equal(np.from_dlpack(out0), a + b)
    np.testing.assert_array_equal(np.from_dlpack(out1), a - b)


def test_add_sub_takes_exactly_four_values(server):
    a = np.zeros(16, dtype=np.float32)
    with pytest.raises(dlserve.InvalidArgumentError, match=r"Expected \[4\], got \[16\]"):
        server.model("add_sub").infer(inputs={"INPUT0": a, "INPUT1": a})


# -- identity -----------------------------------------------------------------------------
@pytest.mark.parametrize("length", [0, 3, 1 << 18])
def test_identity_returns_its_input(server, length):
    x = np.random.default_rng(length).standard_normal(length).astype(np.float32)
    out = infer_one(server, "identity", inputs={"INPUT0": x}).outputs["OUTPUT0"]
    assert out.shape == (length,)
    np.testing.assert_array_equal(np.from_dlpack(out), x)


def test_identity_output_is_the_input_memory(server):
    tensor = server.allocate_tensor([1 << 16], np.float32)
    np.from_dlpack(tensor)[:] = np.arange(1 << 16, dtype=np.float32)
    out = infer_one(server, "identity", inputs={"INPUT0": tensor}).outputs["OUTPUT0"]
    assert out.data_ptr == tensor.data_ptr
    assert np.from_dlpack(out)[4321] == 4321.0


# -- string_upper -------------------------------------------------------------------------
def test_string_upper(server):
    words = ["hello", "", "grüße", "MiXeD 123"]
    out = infer_one(server, "string_upper", inputs={"INPUT0": np.array(words)}).outputs["OUTPUT0"]
    assert out.data_type is DataType.BYTES and out.shape == (4,)
    assert out.to_string_array().tolist() == [w.upper() for w in words]
    assert out.to_bytes_array().tolist() == [w.upper().encode() for w in words]


def test_string_upper_rejects_text_that_is_not_utf8(server):
    with pytest.raises(dlserve.InvalidArgumentError, match="INPUT0 must hold UTF-8 text"):
        values = np.array([b"ok", b"\xff"], dtype=np.object_)
        infer_one(server, "string_upper", inputs={"INPUT0": values})


# -- auto_complete ------------------------------------------------------------------------
def test_auto_complete_fills_in_the_config(server):
    config = server.model("auto_complete").config()
    assert config["max_batch_size"] == 4
    assert "dynamic_batching" in config
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [
        ("INPUT0", "TYPE_FP32", [4]),
        ("INPUT1", "TYPE_FP32", [4]),
    ]
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["output"]] == [
        ("OUTPUT0", "TYPE_FP32", [4]),
        ("OUTPUT1", "TYPE_FP32", [4]),
    ]
    assert server.model("auto_complete").batch_properties() is dlserve.ModelBatchFlag.FIRST_DIM


def test_auto_complete_serves_batches_of_up_to_four(server):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.full((3, 4), 0.5, dtype=np.float32)
    response = infer_one(server, "auto_complete", inputs={"INPUT0": a, "INPUT1": b})
    np.testing.assert_array_equal(response.outputs["OUTPUT0"].as_numpy(), a + b)
    np.testing.assert_array_equal(response.outputs["OUTPUT1"].as_numpy(), a - b)
    five = np.zeros((5, 4), np.float32)
    with pytest.raises(dlserve.InvalidArgumentError, match="batch-size must be <= 4"):
        server.model("auto_complete").infer(inputs={"INPUT0": five, "INPUT1": five})


# -- framework models ---------------------------------------------------------------------
framework_models = pytest.mark.parametrize("model", list(FRAMEWORK_MODELS))


def require_framework(model: str) -> None:
    pytest.importorskip(FRAMEWORK_MODELS[model][0])


def check_add_sub(response, a: np.ndarray, b: np.ndarray) -> bool:
    out0, out1 = response.outputs["OUTPUT0"], response.outputs["OUTPUT1"]
    assert out0.data_type is DataType.FP32 and out0.shape == a.shape
    np.testing.assert_allclose(np.from_dlpack(out0), a + b, rtol=1e-6)
    np.testing.assert_allclose(np.from_dlpack(out1), a - b, rtol=1e-6)
    flag = response.outputs["ZERO_COPY"]
    assert flag.data_type is DataType.BOOL and flag.shape == (1,)
    return bool(flag.as_numpy()[0])


@framework_models
def test_framework_model_computes_on_the_inputs_without_copying(server, model):
    require_framework(model)
    rng = np.random.default_rng(7)
    a = rng.standard_normal(LENGTH).astype(np.float32)
    b = rng.standard_normal(LENGTH).astype(np.float32)
    response = infer_one(server, model, inputs={"INPUT0": a, "INPUT1": b})
    assert check_add_sub(response, a, b), f"{model} copied its inputs"


@framework_models
def test_framework_model_reads_tensors_allocated_in_shared_memory(server, model):
    require_framework(model)
    a = server.allocate_tensor([LENGTH], np.float32)
    b = server.allocate_tensor([LENGTH], np.float32)
    np.from_dlpack(a)[:] = np.arange(LENGTH, dtype=np.float32)
    np.from_dlpack(b)[:] = 2.0
    response = infer_one(server, model, inputs={"INPUT0": a, "INPUT1": b})
    zero_copy = check_add_sub(response, np.from_dlpack(a), np.from_dlpack(b))
    assert zero_copy, f"{model} copied its inputs"


@framework_models
@pytest.mark.parametrize("length", [1, 5, 16, 100])
def test_framework_model_handles_small_inline_inputs(server, model, length):
    # At most 4 KiB: the inputs travel inline and need not be 64-byte aligned. The
    # results must still be right (TensorFlow would abort on unaligned data if the
    # model did not copy it); ZERO_COPY may be False here.
    require_framework(model)
    a = np.arange(length, dtype=np.float32)
    b = np.full(length, 3.0, dtype=np.float32)
    check_add_sub(infer_one(server, model, inputs={"INPUT0": a, "INPUT1": b}), a, b)


@framework_models
def test_framework_model_rejects_inputs_of_different_shapes(server, model):
    require_framework(model)
    with pytest.raises(dlserve.InvalidArgumentError, match="must have the same shape"):
        infer_one(
            server,
            model,
            inputs={"INPUT0": np.zeros(4, np.float32), "INPUT1": np.zeros(5, np.float32)},
        )


# -- run_examples.py ----------------------------------------------------------------------
def run_script(script: Path, env_extra: dict[str, str] | None = None) -> tuple[int, str]:
    """Run a script with this interpreter; returns (exit code, stdout + stderr).

    Also checks it left no shared-memory segment behind.
    """
    env = dict(os.environ, **(env_extra or {}))
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = proc.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"{script.name} timed out:\n{output}")
    leaked = glob.glob(f"/dev/shm/dlserve_{proc.pid}_*")
    assert not leaked, f"{script.name} left shared memory behind: {leaked}"
    return proc.returncode, output


def skipped_for_lack_of(module: str, extra: str) -> str:
    return f"skipped: {module} is not installed; pip install 'dlserve[{extra}]'"


def summary(output: str) -> dict[str, str]:
    """The per-example lines after '=== summary': {example: outcome}."""
    assert "=== summary" in output, output
    lines = output.split("=== summary", 1)[1].strip().splitlines()[:-1]
    return dict(line.split(None, 1) for line in lines)


def test_run_examples_passes():
    code, output = run_script(RUN_EXAMPLES)
    assert code == 0, output
    outcomes = summary(output)
    assert list(outcomes) == PLAIN_MODELS + list(FRAMEWORK_MODELS), output
    for name in PLAIN_MODELS:
        assert outcomes[name] == "ok", output
    for name, (module, extra) in FRAMEWORK_MODELS.items():
        if installed(module):
            assert outcomes[name] == "ok", output
        else:
            assert outcomes[name] == skipped_for_lack_of(module, extra)


@pytest.fixture
def no_frameworks(tmp_path: Path) -> dict[str, str]:
    """Environment in which torch, jax and tensorflow cannot be imported (workers included)."""
    blockers = tmp_path / "blockers"
    blockers.mkdir()
    for module in ("torch", "jax", "tensorflow"):
        (blockers / f"{module}.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{module}'\", name='{module}')\n"
        )
    paths = [str(blockers), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def test_run_examples_skips_examples_whose_framework_is_missing(no_frameworks):
    code, output = run_script(RUN_EXAMPLES, no_frameworks)
    assert code == 0, output
    outcomes = summary(output)
    for name in PLAIN_MODELS:
        assert outcomes[name] == "ok", output
    for name, (module, extra) in FRAMEWORK_MODELS.items():
        assert outcomes[name] == skipped_for_lack_of(module, extra)
    assert "4 ok, 3 skipped, 0 failed" in output


def test_run_examples_fails_when_an_example_fails(tmp_path, no_frameworks):
    examples = tmp_path / "examples"
    shutil.copytree(ROOT / "examples", examples, ignore=shutil.ignore_patterns("__pycache__"))
    model = examples / "models" / "identity" / "1" / "model.py"
    source = model.read_text()
    model.write_text(source.replace("input_tensor.as_numpy()", "input_tensor.as_numpy() * 2"))
    code, output = run_script(examples / "run_examples.py", no_frameworks)
    assert code == 1, output
    outcomes = summary(output)
    assert outcomes["identity"].startswith("FAILED: AssertionError"), output
    assert outcomes["add_sub"] == "ok" and outcomes["string_upper"] == "ok", output
    assert outcomes["pytorch_add_sub"].startswith("skipped"), output
