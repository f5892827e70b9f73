#!/usr/bin/env bash
# Install NVIDIA's perf_analyzer into .venv/perf_analyzer for tests/integration/test_perf_analyzer.py.
#
#   scripts/setup_perf_analyzer.sh            (VENV=path overrides .venv)
#
# - perf_analyzer: the binary inside the tritonclient==2.50.0 manylinux wheel (the PyPI
#   "perf-analyzer" package is an empty placeholder) -> .venv/perf_analyzer/bin/
# - libcudart.so.12: from the PyPI package nvidia-cuda-runtime-cu12 (no GPU needed)
#   -> .venv/perf_analyzer/lib/
# - libb64.so.0d: Debian's libb64-0d; apt-get install when root, otherwise
#   apt-get download + dpkg -x -> .venv/perf_analyzer/lib/
# - .venv/perf_analyzer/perf_analyzer: a wrapper that sets LD_LIBRARY_PATH.
#
# Idempotent (each step is skipped when its result is there). Always exits 0: when a
# piece cannot be had, it says so, and the tests that need perf_analyzer skip.
set -u

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
PY=$VENV/bin/python
DEST=$VENV/perf_analyzer
BIN=$DEST/bin
LIB=$DEST/lib
WRAPPER=$DEST/perf_analyzer
TRITONCLIENT=tritonclient==2.50.0
CUDART=nvidia-cuda-runtime-cu12==12.6.77

say() { echo "setup_perf_analyzer: $*"; }

works() {
    [ -x "$WRAPPER" ] && "$WRAPPER" --version >/dev/null 2>&1
}

if works; then
    say "already installed: $WRAPPER"
    exit 0
fi
if [ ! -x "$PY" ]; then
    say "no $PY (run 'make test' or create the venv first); perf_analyzer tests will skip"
    exit 0
fi
case "$(uname -s)-$(uname -m)" in
    Linux-x86_64) ;;
    *) say "perf_analyzer wheels exist for Linux x86_64 only; perf_analyzer tests will skip"; exit 0 ;;
esac

mkdir -p "$BIN" "$LIB"
TMP=$(mktemp -d "${TMPDIR:-/tmp}/setup_perf_analyzer.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

# extract MEMBER-SUFFIX from WHEEL into DIR (python's zipfile: no unzip needed)
extract() {
    "$PY" - "$1" "$2" "$3" <<'EOF'
import os, shutil, sys, zipfile
wheel, suffix, target = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.endswith(suffix)]
    if not names:
        sys.exit(f"{suffix} not found in {wheel}")
    out = os.path.join(target, os.path.basename(names[0]))
    with z.open(names[0]) as src, open(out + ".part", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.chmod(out + ".part", 0o755)
    os.replace(out + ".part", out)
    print(out)
EOF
}

# 1. perf_analyzer
if [ -x "$BIN/perf_analyzer" ]; then
    say "perf_analyzer binary already in $BIN"
elif "$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux1_x86_64 \
        -d "$TMP/tc" "$TRITONCLIENT" >"$TMP/pip.log" 2>&1; then
    if extract "$TMP"/tc/tritonclient-*.whl "data/bin/perf_analyzer" "$BIN" >/dev/null; then
        say "installed perf_analyzer from $TRITONCLIENT into $BIN"
    else
        say "could not extract perf_analyzer from the $TRITONCLIENT wheel"
    fi
else
    say "pip could not download $TRITONCLIENT:"; tail -3 "$TMP/pip.log"
fi

# 2. libcudart.so.12
if [ -e "$LIB/libcudart.so.12" ]; then
    say "libcudart.so.12 already in $LIB"
elif "$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
        --platform manylinux_2_17_x86_64 -d "$TMP/cu" "$CUDART" >"$TMP/pip.log" 2>&1; then
    if extract "$TMP"/cu/nvidia_cuda_runtime_cu12-*.whl "lib/libcudart.so.12" "$LIB" >/dev/null; then
        say "installed libcudart.so.12 from $CUDART into $LIB"
    else
        say "could not extract libcudart.so.12 from the $CUDART wheel"
    fi
else
    say "pip could not download $CUDART:"; tail -3 "$TMP/pip.log"
fi

# 3. libb64.so.0d
have_b64() {
    [ -e "$LIB/libb64.so.0d" ] && return 0
    { command -v ldconfig >/dev/null && ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null; } \
        | grep -q 'libb64\.so\.0d'
}
if have_b64; then
    say "libb64.so.0d already available"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    if apt-get install -y -q libb64-0d >"$TMP/apt.log" 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libb64-0d >"$TMP/apt.log" 2>&1; }; then
        say "installed Debian package libb64-0d (apt-get)"
    else
        say "apt-get install libb64-0d failed:"; tail -3 "$TMP/apt.log"
    fi
elif command -v apt-get >/dev/null && command -v dpkg >/dev/null; then
    mkdir -p "$TMP/deb"
    if (cd "$TMP/deb" && apt-get download libb64-0d >"$TMP/apt.log" 2>&1) \
        && dpkg -x "$TMP"/deb/libb64-0d_*.deb "$TMP/deb/root" \
        && cp -a "$TMP"/deb/root/usr/lib/*/libb64.so.0d* "$LIB/"; then
        say "extracted libb64.so.0d from Debian's libb64-0d into $LIB (apt-get download + dpkg -x)"
    else
        say "could not fetch libb64-0d with apt-get download:"; tail -3 "$TMP/apt.log" 2>/dev/null
    fi
else
    say "no libb64.so.0d and no apt-get/dpkg to fetch Debian's libb64-0d"
fi

# 4. the wrapper
cat >"$WRAPPER.part" <<'EOF'
#!/bin/sh
# perf_analyzer with its libraries (written by scripts/setup_perf_analyzer.sh)
HERE=$(cd "$(dirname "$0")" && pwd)
LD_LIBRARY_PATH="$HERE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
exec "$HERE/bin/perf_analyzer" "$@"
EOF
chmod +x "$WRAPPER.part" && mv "$WRAPPER.part" "$WRAPPER"

if works; then
    say "ready: $WRAPPER ($("$WRAPPER" --version 2>&1 | head -1))"
else
    say "perf_analyzer does not start; tests that need it will skip:"
    "$WRAPPER" --version 2>&1 | tail -2
fi
exit 0
