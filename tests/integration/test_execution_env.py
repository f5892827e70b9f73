"""Custom execution environments (EXECUTION_ENV_PATH): a model's workers run in the Python of
an environment directory or of an archive unpacked once, with the environment's packages
first, in the server's Python or any other from 3.10 on; archives that would write outside
their folder, and environments whose Python is too old, cannot run or lacks the numpy it
needs, are refused with a clear error, and nothing unpacked outlives the server."""

from __future__ import annotations

import glob
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import psutil
import pytest

import dlserve
from dlserve import ModelControlMode

PY = f"python{sys.version_info.major}.{sys.version_info.minor}"

MODEL = '''
import json
import sys

import numpy as np
import only_in_env  # the server's own Python does not have it
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        info = {
            "prefix": sys.prefix,
            "where": only_in_env.WHERE,
            "executable": sys.executable,
            "python": "%d.%d" % sys.version_info[:2],
        }
        text = np.array([json.dumps(info).encode()], np.object_)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("INFO", text)]) for _ in requests]
'''


def config(env_path: str, key: str = "EXECUTION_ENV_PATH") -> str:
    return f"""
backend: "python"
max_batch_size: 0
input [ {{ name: "IN" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "INFO" data_type: TYPE_STRING dims: [ 1 ] }} ]
parameters: {{ key: "{key}" value: {{ string_value: "{env_path}" }} }}
"""


@pytest.fixture(scope="module")
def environment(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual environment (of the server's Python, without pip) holding one module of
    its own."""
    root = tmp_path_factory.mktemp("envs") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    (root / "lib" / PY / "site-packages" / "only_in_env.py").write_text('WHERE = "env"\n')
    return root


def other_python(newer: bool) -> tuple[str, str] | None:
    """An interpreter on this machine (PATH or pyenv) of another minor version than the
    server's, 3.10 or newer (``newer``) or older than 3.10, and its "X.Y"."""
    pyenv = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates = sorted(glob.glob(f"{pyenv}/versions/3.*/bin/python3"))
    candidates += [p for m in range(6, 15) if (p := shutil.which(f"python3.{m}"))]
    for python in candidates:
        try:
            out = subprocess.run(
                [python, "-c", "import sys; print(*sys.version_info[:2])"],
                capture_output=True, text=True, timeout=30, check=True,
            ).stdout.split()
        except (OSError, subprocess.SubprocessError):
            continue
        version = (int(out[0]), int(out[1]))
        if version != sys.version_info[:2] and (version >= (3, 10)) == newer:
            return python, f"{version[0]}.{version[1]}"
    return None


def venv_of(python: str, root: Path, with_pip: bool = False) -> Path:
    args = [python, "-m", "venv", str(root)] + ([] if with_pip else ["--without-pip"])
    subprocess.run(args, check=True, capture_output=True)
    (site_packages,) = root.glob("lib/python3.*/site-packages")
    (site_packages / "only_in_env.py").write_text('WHERE = "env"\n')
    return root


@pytest.fixture(scope="module")
def other_environment(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A virtual environment of another Python (3.10+) than the server's, with numpy 2."""
    found = other_python(newer=True)
    if found is None:
        pytest.skip("no Python 3.10+ of another minor version than the server's here")
    python, version = found
    root = venv_of(python, tmp_path_factory.mktemp("envs") / f"env{version}", with_pip=True)
    install = subprocess.run(
        [str(root / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
         "numpy>=2"],
        capture_output=True, text=True, timeout=600, check=False,
    )
    if install.returncode:
        pytest.skip(f"cannot install numpy into a Python {version} environment: {install.stderr}")
    return root, version


def packed(environment: Path, archive: Path) -> Path:
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(environment, arcname=".")
    return archive


def unpacked_dirs() -> set[str]:
    return set(glob.glob(str(Path(tempfile.gettempdir()) / "dlserve_env_*")))


def info_of(server: dlserve.Server, model: str = "probe") -> dict[str, str]:
    (response,) = server.model(model).infer(inputs={"IN": np.zeros(1, np.float32)})
    return json.loads(response.outputs["INFO"].to_bytes_array()[0])


def test_workers_run_in_an_environment_directory(make_repo, servers, environment):
    repo = make_repo(extra={"probe": {"config.pbtxt": config(str(environment)), "1/model.py": MODEL}})
    server = servers.start(repo)
    info = info_of(server)
    assert info["prefix"] == str(environment)
    assert info["where"] == "env"  # the environment's own package
    assert info["executable"].startswith(str(environment))


def test_an_archive_is_unpacked_once_and_removed_with_the_server(make_repo, servers, environment):
    before = unpacked_dirs()
    files = {"config.pbtxt": config("$$TRITON_MODEL_DIRECTORY/env.tar.gz"), "1/model.py": MODEL}
    repo = make_repo(extra={"probe": files, "probe2": files})
    for name in ("probe", "probe2"):
        packed(environment, repo / name / "env.tar.gz")
    server = servers.start(repo)
    first, second = info_of(server, "probe"), info_of(server, "probe2")
    new = unpacked_dirs() - before
    assert len(new) == 2  # one per archive (the two models name different files)
    assert {first["prefix"], second["prefix"]} == new
    assert first["where"] == second["where"] == "env"
    servers.stop(server)
    assert unpacked_dirs() - before == set()


def test_a_model_needing_its_environment_fails_to_load_without_it(make_repo, servers):
    files = {"config.pbtxt": config("").replace("parameters", "# parameters"), "1/model.py": MODEL}
    server = servers.start(make_repo(extra={"probe": files}), model_control_mode=ModelControlMode.EXPLICIT)
    with pytest.raises(dlserve.InvalidArgumentError, match="only_in_env"):
        server.load("probe")


def evil_archive(path: Path, name: str, link: str | None = None) -> None:
    with tarfile.open(path, "w:gz") as tar:
        if link is not None:
            entry = tarfile.TarInfo("escape")
            entry.type, entry.linkname = tarfile.SYMTYPE, link
            tar.addfile(entry)
        data = b"pwned\n"
        entry = tarfile.TarInfo(name)
        entry.size = len(data)
        tar.addfile(entry, io.BytesIO(data))


@pytest.mark.parametrize(
    ("entry", "link"),
    [("../outside.txt", None), ("/tmp/dlserve_zip_slip.txt", None), ("escape/outside.txt", "..")],
    ids=["dot-dot", "absolute", "through-a-link"],
)
def test_an_archive_writing_outside_its_folder_is_refused(make_repo, servers, tmp_path, entry, link):
    before = unpacked_dirs()
    repo = make_repo(extra={"probe": {"config.pbtxt": config("$$TRITON_MODEL_DIRECTORY/env.tar.gz"), "1/model.py": MODEL}})
    evil_archive(repo / "probe" / "env.tar.gz", entry, link)
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    with pytest.raises(dlserve.InvalidArgumentError, match="would be written outside the environment"):
        server.load("probe")
    assert not Path("/tmp/dlserve_zip_slip.txt").exists()
    assert not list(Path(tempfile.gettempdir()).glob("outside.txt"))
    assert unpacked_dirs() - before == set()  # the half-unpacked folder went too
    assert not server.model("probe").ready()


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_damaged_archive_fails_the_load_with_a_clear_reason(make_repo, servers, environment, damage):
    """As Triton, a load error naming the archive (dlserve raised the decompressor's
    EOFError / zlib.error out of the load: a 500 and no reason in the index)."""
    before = unpacked_dirs()
    files = {"config.pbtxt": config("$$TRITON_MODEL_DIRECTORY/env.tar.gz"), "1/model.py": MODEL}
    repo = make_repo(extra={"probe": files})
    archive = packed(environment, repo / "probe" / "env.tar.gz")
    data = bytearray(archive.read_bytes())
    if damage == "truncated":
        del data[len(data) // 2:]
    else:
        middle = len(data) // 2
        data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    archive.write_bytes(bytes(data))
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    with pytest.raises(dlserve.InvalidArgumentError, match="cannot unpack '.*env.tar.gz'"):
        server.load("probe")
    (row,) = [row for row in server.engine.manager.index() if row["name"] == "probe"]
    assert row["state"] == "UNAVAILABLE" and "cannot unpack" in row["reason"]
    assert unpacked_dirs() - before == set()  # the half-unpacked folder went too


def test_an_environment_of_another_python_runs_the_model(make_repo, servers, other_environment):
    """Triton needs a stub compiled for another Python; a dlserve worker just runs in it."""
    root, version = other_environment
    repo = make_repo(extra={"probe": {"config.pbtxt": config(str(root)), "1/model.py": MODEL}})
    server = servers.start(repo)
    info = info_of(server)
    assert info["python"] == version != f"{sys.version_info.major}.{sys.version_info.minor}"
    assert info["prefix"] == str(root) and info["where"] == "env"


@pytest.mark.parametrize(
    ("newer", "message"),
    [
        (
            True,
            (
                "has Python {version} and no numpy \\(.*No module named 'numpy'\\); .* must bring "
                "its own numpy 2.x"
            ),
        ),
        (False, "has Python {version}; .*3.10 or newer"),
    ],
    ids=["another-python-without-numpy", "python-before-3.10"],
)
def test_an_environment_whose_python_cannot_serve_is_refused(make_repo, servers, tmp_path, newer, message):
    found = other_python(newer)
    if found is None:
        pytest.skip(f"no such Python here ({'3.10+ of another minor version' if newer else 'before 3.10'})")
    python, version = found
    root = venv_of(python, tmp_path / "env")
    repo = make_repo(extra={"probe": {"config.pbtxt": config(str(root)), "1/model.py": MODEL}})
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    with pytest.raises(dlserve.InvalidArgumentError, match=message.format(version=version)):
        server.load("probe")


def test_an_environment_whose_python_cannot_run_is_refused_with_its_reason(make_repo, servers, tmp_path):
    """As an environment built for another OS or machine would fail."""
    fake = tmp_path / "foreign-env"
    (fake / "bin").mkdir(parents=True)
    python = fake / "bin" / "python"
    python.write_text("#!/bin/sh\necho 'cannot execute binary file: Exec format error' >&2\nexit 126\n")
    python.chmod(0o755)
    repo = make_repo(extra={"probe": {"config.pbtxt": config(str(fake)), "1/model.py": MODEL}})
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    with pytest.raises(dlserve.InvalidArgumentError, match="cannot run .*Exec format error"):
        server.load("probe")


@pytest.mark.parametrize(
    ("value", "message"),
    [("/no/such/env", "does not exist"), ("$$TRITON_MODEL_DIRECTORY/1/model.py", "neither an environment directory nor an archive")],
)
def test_a_path_that_is_no_environment_is_refused(make_repo, servers, value, message):
    repo = make_repo(extra={"probe": {"config.pbtxt": config(value), "1/model.py": MODEL}})
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    with pytest.raises(dlserve.InvalidArgumentError, match=f"model 'probe': parameter EXECUTION_ENV_PATH: .*{message}"):
        server.load("probe")


# -- EXECUTION_ENV_REQUIREMENTS ---------------------------------------------------------------
def write_wheel(folder: Path, where: str = "requirements") -> str:
    """A wheel of the module only_in_env, as a model might ship beside its requirements."""
    name = "only_in_env-1.0-py3-none-any.whl"
    with zipfile.ZipFile(folder / name, "w") as wheel:
        wheel.writestr("only_in_env.py", f'WHERE = "{where}"\n')
        info = "only_in_env-1.0.dist-info"
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: only_in_env\nVersion: 1.0\n")
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")
    return name


def requirements_model(
    make_repo, requirements: str, wheel: bool = True, path: str = "$$TRITON_MODEL_DIRECTORY/requirements.txt"
) -> Path:
    files = {
        "config.pbtxt": config(path, "EXECUTION_ENV_REQUIREMENTS"),
        "1/model.py": MODEL,
        "requirements.txt": requirements,
    }
    repo = make_repo(extra={"probe": files})
    if wheel:
        write_wheel(repo / "probe")
    return repo


def test_a_requirements_file_builds_an_environment_once(make_repo, servers, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("DLSERVE_ENV_CACHE", str(cache))
    # numpy is the server's already: pip installs only the wheel (relative to the file).
    repo = requirements_model(make_repo, "./only_in_env-1.0-py3-none-any.whl\nnumpy>=2\n")
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    server.load("probe")
    info = info_of(server)
    (root,) = [p for p in cache.iterdir() if p.is_dir()]
    assert info["where"] == "requirements" and info["prefix"] == str(root)
    assert not list(root.glob("lib/python3*/site-packages/numpy"))  # the server's numpy serves
    built = (root / "dlserve-ready").stat().st_mtime_ns

    # Another server with the same requirements finds the environment built.
    servers.stop(server)
    second = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    second.load("probe")
    assert info_of(second)["prefix"] == str(root)
    assert (root / "dlserve-ready").stat().st_mtime_ns == built


def test_a_requirements_file_pip_cannot_install_fails_the_load_with_pips_words(
    make_repo, servers, tmp_path, monkeypatch
):
    cache = tmp_path / "cache"
    monkeypatch.setenv("DLSERVE_ENV_CACHE", str(cache))
    repo = requirements_model(make_repo, "./missing-2.0-py3-none-any.whl\n", wheel=False)
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    message = "(?s)parameter EXECUTION_ENV_REQUIREMENTS: pip install failed .*missing-2.0-py3-none-any.whl"
    with pytest.raises(dlserve.InvalidArgumentError, match=message):
        server.load("probe")
    # Nothing half-built is left to be taken for an environment.
    assert [p.name for p in cache.iterdir() if p.is_dir()] == []


def test_an_environment_path_and_requirements_together_are_refused(make_repo, servers):
    text = config("/some/env") + \
        'parameters: { key: "EXECUTION_ENV_REQUIREMENTS" value: { string_value: "r.txt" } }\n'
    repo = make_repo(extra={"probe": {"config.pbtxt": text, "1/model.py": MODEL}})
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    with pytest.raises(dlserve.InvalidArgumentError, match="set one of EXECUTION_ENV_PATH and EXECUTION_ENV_REQUIREMENTS"):
        server.load("probe")


def test_the_same_requirements_with_another_wheel_get_their_own_environment(
    make_repo, servers, tmp_path, monkeypatch
):
    """The cache key covers the files the requirements name, not only their text."""
    monkeypatch.setenv("DLSERVE_ENV_CACHE", str(tmp_path / "cache"))
    text = "./only_in_env-1.0-py3-none-any.whl\n"
    first = requirements_model(make_repo, text)
    second = requirements_model(make_repo, text, wheel=False)
    write_wheel(second / "probe", where="the second wheel")
    one = servers.start(first)
    two = servers.start(second)
    assert info_of(one)["where"] == "requirements"
    assert info_of(two)["where"] == "the second wheel"
    assert info_of(one)["prefix"] != info_of(two)["prefix"]


def test_requirements_outside_the_models_folder_are_refused_unread(
    make_repo, servers, tmp_path, monkeypatch
):
    """pip quotes what it reads in its errors: the server's own environment must never be
    read as requirements (it holds the cloud credentials)."""
    monkeypatch.setenv("DLSERVE_ENV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("DLSERVE_TEST_SECRET", "do-not-show-me")
    repo = requirements_model(make_repo, "numpy\n", path="/proc/self/environ")
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    with pytest.raises(dlserve.InvalidArgumentError, match="is not a file in the model's folder") as caught:
        server.load("probe")
    assert "do-not-show-me" not in caught.value.message
    assert not (tmp_path / "cache").exists()


def test_a_cache_others_may_write_is_refused(make_repo, servers, tmp_path, monkeypatch):
    """An environment found in the cache is run as the server: nobody else may plant one."""
    cache = tmp_path / "shared"
    cache.mkdir(mode=0o777)
    cache.chmod(0o777)
    monkeypatch.setenv("DLSERVE_ENV_CACHE", str(cache))
    repo = requirements_model(make_repo, "./only_in_env-1.0-py3-none-any.whl\n")
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    with pytest.raises(dlserve.InvalidArgumentError, match="others cannot write\\); set DLSERVE_ENV_CACHE"):
        server.load("probe")


def test_stopping_the_server_kills_a_build_in_progress(make_repo, servers, tmp_path, monkeypatch):
    """A pip run that would take long (here: reading a pipe nobody writes) does not hold
    up the stop, and leaves no process behind."""
    monkeypatch.setenv("DLSERVE_ENV_CACHE", str(tmp_path / "cache"))
    repo = requirements_model(make_repo, "-r ./never.txt\n", wheel=False)
    os.mkfifo(repo / "probe" / "never.txt")
    server = servers.start(repo, model_control_mode=ModelControlMode.EXPLICIT)
    errors: list[BaseException] = []

    def load() -> None:
        try:
            server.load("probe")
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    loading = threading.Thread(target=load)
    loading.start()
    me = psutil.Process()
    deadline = time.monotonic() + 60
    while not [p for p in me.children(recursive=True) if "pip" in " ".join(p.cmdline())]:
        assert time.monotonic() < deadline, "pip never started"
        time.sleep(0.1)
    started = time.monotonic()
    servers.stop(server)
    loading.join(30)
    assert time.monotonic() - started < 15
    assert errors and isinstance(errors[0], dlserve.TritonError)
    assert not [p for p in me.children(recursive=True) if "pip" in " ".join(p.cmdline())]


CWD_MODEL = """
import helper_in_cwd
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
                                                          + helper_in_cwd.VALUE)])
            for r in requests
        ]
"""
CWD_CONFIG = (
    'backend: "python"\ninput [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
    'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
)


def test_the_working_directory_cannot_shadow_what_a_worker_imports(make_repo, servers, tmp_path, monkeypatch):
    """A file named like a module the worker imports (here ssl.py) in the directory the
    server runs in killed every worker as it started; models still import from there."""
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    (workdir / "ssl.py").write_text('raise SystemExit("the working directory\'s ssl.py was imported")\n')
    (workdir / "helper_in_cwd.py").write_text("VALUE = 41\n")
    repo = make_repo(extra={"uses_cwd": {"config.pbtxt": CWD_CONFIG, "1/model.py": CWD_MODEL}})
    monkeypatch.chdir(workdir)
    server = servers.start(repo)
    (response,) = server.model("uses_cwd").infer(inputs={"X": np.ones(1, np.float32)})
    assert response.outputs["Y"].as_numpy().tolist() == [42.0]

