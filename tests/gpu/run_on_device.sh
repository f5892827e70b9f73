#!/usr/bin/env bash
# dlserve's GPU checks on the device machine (an H200 with python3 = /opt/torch/.venv's
# Python 3.12, cupy, torch and cuda-bindings preinstalled, no package index), run from the
# repository root with the wheel bundle .whl carried:
#
#     bash tests/gpu/run_on_device.sh
#
# It installs the wheels into /tmp/site (dlserve itself runs from the source tree through
# PYTHONPATH), runs tests/gpu, a few short CPU suites as a smoke check of the server on
# that Python, and benchmarks/gpu_bench.py where it exists. Logs go to $OUT (the device
# tool's folder that comes back; /tmp/dlserve_gpu_out elsewhere). Whatever fails, it goes
# on to the end and prints one SUMMARY line; it stays under about 6 minutes (timeouts
# below; GPU_TESTS_TIMEOUT, SMOKE_TIMEOUT and BENCH_TIMEOUT override them).
set -u

cd "$(dirname "$0")/../.." || exit 1
START=$SECONDS
shm_count() { find /dev/shm -maxdepth 1 -name 'dlserve_*' 2>/dev/null | wc -l; }
SHM_BEFORE=$(shm_count)
OUT=${OUT:-/tmp/dlserve_gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}

echo "== machine"
nvidia-smi -L || echo "nvidia-smi failed"
"$PY" --version
"$PY" -c 'import sys; print(sys.executable)'
"$PY" -c 'import cupy; print("cupy", cupy.__version__, "devices", cupy.cuda.runtime.getDeviceCount())' \
    || echo "cupy: not usable"

echo "== wheels (.whl -> $SITE)"
ls .whl/*.whl >/dev/null 2>&1 || { echo "SUMMARY no wheels in .whl: carry .whl"; exit 1; }
if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl; then
    echo "SUMMARY wheel install failed"
    exit 1
fi
export PYTHONPATH="$PWD:$SITE"
export PYTHONUNBUFFERED=1
# dlserve runs from the source tree: a `dlserve` console script on PATH for anything that
# looks for one (the tests start `dlserve serve` through this same Python without it).
BIN=/tmp/dlserve_bin
mkdir -p "$BIN"
printf '#!/bin/sh\nexec "%s" -c "import sys; from dlserve.cli import main; sys.exit(main())" "$@"\n' \
    "$(command -v "$PY")" >"$BIN/dlserve"
chmod +x "$BIN/dlserve"
export PATH="$BIN:$PATH"
"$PY" - <<'EOF' 2>&1 | tee "$OUT/versions.log"
import importlib

import dlserve

print("dlserve", dlserve.__version__, "from", dlserve.__file__)
for name in ("numpy", "grpc", "google.protobuf", "tritonclient", "gevent", "orjson",
             "httptools", "uvloop", "ml_dtypes", "cupy", "torch", "cuda.bindings", "pytest"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '?')} ({module.__file__})")
    except Exception as exc:  # noqa: BLE001 - report, go on
        print(f"{name}: {type(exc).__name__}: {exc}")
try:
    import tritonclient.utils.cuda_shared_memory  # noqa: F401 - needs cuda.bindings
    print("tritonclient.utils.cuda_shared_memory imports")
except Exception as exc:  # noqa: BLE001
    print(f"tritonclient.utils.cuda_shared_memory: {type(exc).__name__}: {exc}")
EOF
dlserve serve --help >/dev/null && echo "dlserve console script works" \
    || echo "dlserve console script FAILED"

# the last pytest line ("3 passed, 1 failed in 9.1s") of a log
outcome() { grep -E '(passed|failed|error|skipped|no tests ran)' "$1" | tail -n 1 | tr -d '='; }

echo "== tests/gpu"
timeout "${GPU_TESTS_TIMEOUT:-240}" "$PY" -m pytest tests/gpu -v -rfEs -p no:cacheprovider \
    --timeout 120 --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log"
GPU_RC=${PIPESTATUS[0]}

echo "== CPU smoke suites"
timeout "${SMOKE_TIMEOUT:-75}" "$PY" -m pytest -q -rfE -p no:cacheprovider --timeout 60 \
    tests/unit/test_ipc.py tests/unit/test_pb_utils.py tests/unit/test_tensor.py \
    tests/integration/test_client_shm_hazards.py 2>&1 | tee "$OUT/cpu_smoke.log"
SMOKE_RC=${PIPESTATUS[0]}

BENCH="absent"
if [ -f benchmarks/gpu_bench.py ]; then
    echo "== benchmarks/gpu_bench.py"
    timeout "${BENCH_TIMEOUT:-90}" "$PY" benchmarks/gpu_bench.py 2>&1 | tee "$OUT/gpu_bench.log"
    BENCH="rc=${PIPESTATUS[0]}"
fi

echo "SUMMARY gpu_tests rc=$GPU_RC ($(outcome "$OUT/gpu_tests.log")) |" \
    "cpu_smoke rc=$SMOKE_RC ($(outcome "$OUT/cpu_smoke.log")) | gpu_bench $BENCH |" \
    "/dev/shm dlserve_*: $(shm_count) after, $SHM_BEFORE before | $((SECONDS - START)) s"
