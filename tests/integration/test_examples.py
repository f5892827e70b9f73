"""The example repository (examples/models) served in-process, model by model, and
examples/run_examples.py run the way `make examples` runs it.

One server serves every example for the whole module; the framework models
(torch, jax, tensorflow) are checked when their framework is installed and must
then prove, through their ZERO_COPY output, that they used the request's memory.
"""

from __future__ import annotations

import ast
import asyncio
import glob
import importlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import dlserve
from dlserve import DataType

from ..conftest import EXAMPLES, ServerHarness

ROOT = EXAMPLES.parent.parent
RUN_EXAMPLES = ROOT / "examples" / "run_examples.py"
CLIENTS = ROOT / "examples" / "clients"

PLAIN_MODELS = [
    "add_sub",
    "identity",
    "string_upper",
    "auto_complete",
    "repeat",
    "square",
    "bls_sync",
    "bls_async",
    "bls_decoupled",
    "pipeline",
]
ENSEMBLES = ["pipeline"]  # no model.py: the server runs their steps
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
        if name in ENSEMBLES:
            assert 'platform: "ensemble"' in (EXAMPLES / name / "config.pbtxt").read_text(), name
            continue
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


# -- repeat (decoupled) -------------------------------------------------------------------
def scalar(response, name: str) -> int | None:
    """The one value of output ``name``; None when the response does not have it."""
    tensor = response.outputs.get(name)
    return None if tensor is None else int(np.from_dlpack(tensor)[0])


def repeat(server: dlserve.Server, values, delays=None, **kwargs):
    inputs = {"IN": np.array(values, np.int32)}
    if delays is not None:
        inputs["DELAY"] = np.array(delays, np.uint32)
    return server.model("repeat").infer(inputs=inputs, **kwargs)


def test_repeat_streams_each_value_with_its_index_then_a_flag_only_final(server):
    responses = list(repeat(server, [5, -1, 7]))
    assert [(scalar(r, "OUT"), scalar(r, "IDX")) for r in responses] == [
        (5, 0), (-1, 1), (7, 2), (None, None)
    ]
    assert [r.final for r in responses] == [False, False, False, True]
    assert responses[-1].outputs == {} and all(r.error is None for r in responses)
    out, idx = responses[0].outputs["OUT"], responses[0].outputs["IDX"]
    assert (out.data_type, out.shape) == (DataType.INT32, (1,))
    assert (idx.data_type, idx.shape) == (DataType.UINT32, (1,))


def test_repeat_of_no_values_is_only_the_final(server):
    (response,) = repeat(server, [])
    assert response.final and response.outputs == {} and response.error is None


def test_repeat_waits_delay_milliseconds_before_each_response(server):
    started = time.monotonic()
    responses = list(repeat(server, [1, 2], delays=[60, 60]))
    assert [scalar(r, "OUT") for r in responses] == [1, 2, None]
    assert time.monotonic() - started >= 0.12


def test_repeat_refuses_delays_that_do_not_match_the_values(server):
    with pytest.raises(dlserve.TritonError, match="DELAY has 1 elements, IN has 2: they must"):
        list(repeat(server, [1, 2], delays=[0]))


def test_repeat_cancelled_ends_with_a_cancelled_response(server):
    iterator = repeat(server, range(50), delays=[20] * 50, raise_on_error=False)
    first, second = next(iterator), next(iterator)
    assert [scalar(first, "IDX"), scalar(second, "IDX")] == [0, 1]
    iterator.cancel()
    rest = list(iterator)
    last = rest[-1]
    assert last.final and isinstance(last.error, dlserve.CancelledError) and last.outputs == {}
    # At most what was already on its way before the cancel, in order; never all 50.
    assert [scalar(r, "IDX") for r in rest[:-1]] == list(range(2, len(rest) + 1))
    assert len(rest) < 10
    # The server is unharmed: the next request streams in full.
    assert [scalar(r, "OUT") for r in repeat(server, [3, 4])] == [3, 4, None]


# -- square (decoupled, async def execute) ------------------------------------------------
def square(server: dlserve.Server, n: int, **kwargs):
    return server.model("square").infer(inputs={"IN": np.array([n], np.int32)}, **kwargs)


@pytest.mark.parametrize("n", [1, 3])
def test_square_streams_n_responses_of_n_the_last_one_final(server, n):
    responses = list(square(server, n))
    assert [(scalar(r, "OUT"), r.final) for r in responses] == [(n, i == n - 1) for i in range(n)]
    assert all(r.error is None for r in responses)


def test_square_of_zero_is_a_single_flag_only_final(server):
    (response,) = square(server, 0)
    assert response.final and response.outputs == {} and response.error is None


def test_square_of_a_negative_number_is_an_invalid_argument(server):
    with pytest.raises(dlserve.InvalidArgumentError, match=r"IN must be >= 0, got -1"):
        list(square(server, -1))
    (response,) = square(server, -1, raise_on_error=False)
    assert response.final and isinstance(response.error, dlserve.InvalidArgumentError)


def test_square_streams_concurrent_requests_each_to_its_own_caller(server):
    async def one(n: int) -> list[int | None]:
        iterator = server.model("square").async_infer(inputs={"IN": np.array([n], np.int32)})
        return [scalar(r, "OUT") async for r in iterator]

    async def run():
        return await asyncio.gather(*(one(n) for n in range(8)))

    assert asyncio.run(run()) == [[n] * n if n else [None] for n in range(8)]


# -- BLS ----------------------------------------------------------------------------------
def test_bls_sync_returns_what_add_sub_computes(server):
    rng = np.random.default_rng(3)
    a = rng.standard_normal(4).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    response = infer_one(server, "bls_sync", inputs={"INPUT0": a, "INPUT1": b})
    out0, out1 = response.outputs["OUTPUT0"], response.outputs["OUTPUT1"]
    assert out0.data_type is DataType.FP32 and out0.shape == (4,)
    np.testing.assert_array_equal(np.from_dlpack(out0), a + b)
    np.testing.assert_array_equal(np.from_dlpack(out1), a - b)


def test_bls_async_makes_two_add_sub_calls(server):
    rng = np.random.default_rng(4)
    a = rng.standard_normal(4).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    response = infer_one(server, "bls_async", inputs={"INPUT0": a, "INPUT1": b})
    np.testing.assert_array_equal(np.from_dlpack(response.outputs["OUTPUT0"]), a + b)
    np.testing.assert_array_equal(np.from_dlpack(response.outputs["OUTPUT1"]), b - a)


def test_bls_async_serves_concurrent_requests(server):
    async def one(i: int) -> None:
        a = np.full(4, i, np.float32)
        b = np.arange(4, dtype=np.float32)
        iterator = server.model("bls_async").async_infer(inputs={"INPUT0": a, "INPUT1": b})
        (response,) = [r async for r in iterator]
        np.testing.assert_array_equal(np.from_dlpack(response.outputs["OUTPUT0"]), a + b)
        np.testing.assert_array_equal(np.from_dlpack(response.outputs["OUTPUT1"]), b - a)

    async def run():
        await asyncio.gather(*(one(i) for i in range(16)))

    asyncio.run(run())


@pytest.mark.parametrize("n", [4, 1, 0])
def test_bls_decoupled_adds_up_what_square_streams(server, n):
    response = infer_one(server, "bls_decoupled", inputs={"IN": np.array([n], np.int32)})
    assert (scalar(response, "SUM"), scalar(response, "COUNT")) == (n * n, n)
    assert response.outputs["SUM"].data_type is DataType.INT32


def test_bls_decoupled_passes_square_errors_on(server):
    with pytest.raises(dlserve.InvalidArgumentError, match=r"IN must be >= 0, got -2"):
        infer_one(server, "bls_decoupled", inputs={"IN": np.array([-2], np.int32)})


# -- the new clients, through their run(server) -------------------------------------------
@pytest.mark.parametrize(
    "model", ["repeat", "square", "bls_sync", "bls_async", "bls_decoupled", "pipeline"]
)
def test_client_runs(server, model, monkeypatch):
    # repeat and square stream over gRPC (KServeGrpc on a free port), bls_sync also
    # calls over HTTP (KServeHttp); every client asserts its own results.
    monkeypatch.syspath_prepend(str(CLIENTS))
    client = importlib.import_module(f"{model}_client")
    assert client.MODEL == model
    client.run(server)


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
    assert f"{len(PLAIN_MODELS)} ok, 3 skipped, 0 failed" in output


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


# -- make examples ------------------------------------------------------------------------
def third_party_imports(scripts: list[Path]) -> set[str]:
    """The top-level modules these scripts import that neither Python nor examples/ provides."""
    found = set()
    for script in scripts:
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    local = {path.stem for path in CLIENTS.glob("*.py")}
    return found - local - set(sys.stdlib_module_names) - {"dlserve"}


def distribution_name(requirement: str) -> str:
    name = re.match(r"[A-Za-z0-9._-]+", requirement).group()
    return re.sub(r"[-_.]+", "-", name).lower()


def test_make_examples_installs_what_the_clients_import(tmp_path):
    # On a fresh machine `make examples` installed dlserve alone, and every client failed
    # to import tritonclient.
    tomllib = pytest.importorskip("tomllib")
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    plan = subprocess.run(
        ["make", "-n", "examples", f"VENV={tmp_path / 'venv'}"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extras in re.findall(r"pip install .*\.\[([\w,-]+)\]", plan):
        for extra in extras.split(","):
            requirements += project["optional-dependencies"][extra]
    installed = {distribution_name(requirement) for requirement in requirements}
    providers = importlib.metadata.packages_distributions()
    missing = sorted(
        module
        for module in third_party_imports([RUN_EXAMPLES, *CLIENTS.glob("*.py")])
        if not installed & {distribution_name(d) for d in providers.get(module, [module])}
    )
    assert not missing, f"make examples does not install {missing}:\n{plan}"
