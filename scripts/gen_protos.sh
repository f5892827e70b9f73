#!/usr/bin/env bash
# Regenerate dlserve's committed protobuf / gRPC Python modules.
#
#   scripts/gen_protos.sh           regenerate in place
#   scripts/gen_protos.sh --check   regenerate into a temp dir and fail if the
#                                   committed modules differ (for CI)
#
# Sources and outputs (outputs are committed, so users never need
# grpcio-tools; only protobuf, plus grpcio for the *_grpc modules):
#
#   dlserve/engine/proto/model_config.proto
#       -> model_config_pb2.py, model_config_pb2.pyi
#          (no service in this file, so no _grpc module: the engine side
#           does not depend on grpcio)
#   dlserve/frontends/proto/grpc_service.proto
#       -> grpc_service_pb2.py, grpc_service_pb2.pyi, grpc_service_pb2_grpc.py
#   dlserve/frontends/proto/health.proto
#       -> health_pb2.py, health_pb2.pyi, health_pb2_grpc.py
#
# Import strategy: the .proto files are compiled with their own folders as
# include roots (-I dlserve/engine/proto -I dlserve/frontends/proto), so the
# descriptors carry exactly Triton's file names ("model_config.proto",
# "grpc_service.proto", "health.proto") and grpc_service.proto says
# import "model_config.proto" just like Triton's. protoc then emits bare
# imports (import model_config_pb2 as model__config__pb2); the
# post-processing step rewrites every one of them into a package import
# (from dlserve.engine.proto import model_config_pb2 as model__config__pb2)
# in the .py, .pyi and _grpc.py outputs, and fails if any bare import of a
# generated module remains.
#
# Descriptor pool: the message full names must be Triton's ("inference.*",
# "grpc.health.v1.*") for wire/service-path compatibility. Registering them
# in protobuf's process-wide default pool would collide with tritonclient
# (and grpcio-health-checking), which register the same symbols: importing
# both in one process fails with "duplicate symbol 'inference.DataType'".
# The post-processing step therefore loads our descriptors into private
# pools instead:
#   - model_config_pb2 creates a new DescriptorPool,
#   - grpc_service_pb2 adds itself to that same pool
#     (model_config_pb2.DESCRIPTOR.pool), since it depends on it,
#   - health_pb2 gets its own DescriptorPool.
# Messages, text_format and json_format work as usual; code that needs the
# pool (e.g. gRPC reflection) can use <module>.DESCRIPTOR.pool.
# The pure-Python protobuf backend (PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=
# python) also records every message class in the default symbol database
# and tolerates a repeated full name only when it comes from the same file
# name; that is the second reason our file names equal Triton's.
#
# Generated code pins its runtime: protobuf >= the gencode version printed
# in the *_pb2.py header (and < next major), grpcio >= GRPC_GENERATED_VERSION
# in the *_grpc.py modules.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
cd "$ROOT"

MODE=write
case "${1:-}" in
  "") ;;
  --check) MODE=check ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

ENGINE=dlserve/engine/proto
FRONT=dlserve/frontends/proto
mkdir -p "$TMP/$ENGINE" "$TMP/$FRONT"

"$PY" -m grpc_tools.protoc -I "$ENGINE" \
  --python_out="$TMP/$ENGINE" --pyi_out="$TMP/$ENGINE" \
  "$ENGINE/model_config.proto"

"$PY" -m grpc_tools.protoc -I "$ENGINE" -I "$FRONT" \
  --python_out="$TMP/$FRONT" --pyi_out="$TMP/$FRONT" \
  --grpc_python_out="$TMP/$FRONT" \
  "$FRONT/grpc_service.proto" "$FRONT/health.proto"

"$PY" - "$TMP" <<'PYEOF'
import pathlib
import re
import sys

out = pathlib.Path(sys.argv[1])

# generated module name -> package it lives in
PACKAGES = {
    "model_config_pb2": "dlserve.engine.proto",
    "grpc_service_pb2": "dlserve.frontends.proto",
    "grpc_service_pb2_grpc": "dlserve.frontends.proto",
    "health_pb2": "dlserve.frontends.proto",
    "health_pb2_grpc": "dlserve.frontends.proto",
}
BARE = re.compile(r"^import (\w+_pb2(?:_grpc)?)( as \w+)?$", re.M)


def to_package_import(m):
    mod = m.group(1)
    if mod not in PACKAGES:
        sys.exit(f"gen_protos: import of unknown generated module {mod}")
    return f"from {PACKAGES[mod]} import {mod}{m.group(2) or ''}"


files = sorted(p for p in out.rglob("*") if p.suffix in (".py", ".pyi"))
for path in files:
    text = BARE.sub(to_package_import, path.read_text())
    for line in text.splitlines():
        if re.match(r"\s*(import|from) \w+_pb2", line):
            sys.exit(f"gen_protos: bare import left in "
                     f"{path.relative_to(out)}: {line}")
    path.write_text(text)

# Private descriptor pools (see the header of this script).
DEFAULT = "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile("
NOTE = ("# Post-processed by scripts/gen_protos.sh: package imports, and "
        "descriptors in a private pool instead of the default one.\n")
alias = re.search(
    r"^from dlserve\.engine\.proto import model_config_pb2 as (\w+)$",
    (out / "dlserve/frontends/proto/grpc_service_pb2.py").read_text(), re.M)
if not alias:
    sys.exit("gen_protos: grpc_service_pb2.py does not import model_config_pb2")
pools = {
    "dlserve/engine/proto/model_config_pb2.py":
        "_descriptor_pool.DescriptorPool()",
    "dlserve/frontends/proto/grpc_service_pb2.py":
        f"{alias.group(1)}.DESCRIPTOR.pool",
    "dlserve/frontends/proto/health_pb2.py":
        "_descriptor_pool.DescriptorPool()",
}
for rel, pool in pools.items():
    path = out / rel
    text = path.read_text()
    if text.count(DEFAULT) != 1:
        sys.exit(f"gen_protos: unexpected protoc output in {rel}: "
                 f"expected exactly one '{DEFAULT}'")
    text = text.replace(DEFAULT, f"DESCRIPTOR = {pool}.AddSerializedFile(")
    text = re.sub(r"^(# source: .*\n)", lambda m: m.group(1) + NOTE, text,
                  count=1, flags=re.M)
    path.write_text(text)
PYEOF

GENERATED=(
  dlserve/engine/proto/model_config_pb2.py
  dlserve/engine/proto/model_config_pb2.pyi
  dlserve/frontends/proto/grpc_service_pb2.py
  dlserve/frontends/proto/grpc_service_pb2.pyi
  dlserve/frontends/proto/grpc_service_pb2_grpc.py
  dlserve/frontends/proto/health_pb2.py
  dlserve/frontends/proto/health_pb2.pyi
  dlserve/frontends/proto/health_pb2_grpc.py
)

if [[ "$MODE" == check ]]; then
  stale=0
  for f in "${GENERATED[@]}"; do
    if ! cmp -s "$TMP/$f" "$f"; then
      echo "out of date: $f" >&2
      stale=1
    fi
  done
  if [[ $stale -ne 0 ]]; then
    echo "run scripts/gen_protos.sh and commit the result" >&2
    exit 1
  fi
  echo "generated protobuf modules are up to date"
  exit 0
fi

for f in "${GENERATED[@]}"; do
  cp "$TMP/$f" "$f"
done
for d in dlserve/engine/proto dlserve/frontends/proto; do
  [[ -e "$d/__init__.py" ]] || : > "$d/__init__.py"
done
echo "regenerated ${#GENERATED[@]} files"
