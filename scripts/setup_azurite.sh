#!/usr/bin/env bash
# Install Azurite (Microsoft's Azure Storage emulator) into .venv/azurite for
# tests/integration/test_azure_repository.py.
#
#   scripts/setup_azurite.sh            (VENV=path overrides .venv)
#
# Azurite is an npm package; this needs node and npm (about 190 MB, ~15 s). Idempotent.
# Always exits 0: without npm it says so, and the Azure tests skip.
set -u

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
DEST=$VENV/azurite
BIN=$DEST/node_modules/.bin/azurite-blob
VERSION=3

say() { echo "setup_azurite: $*"; }

if [ -x "$BIN" ]; then
    say "already installed: $BIN"
    exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
    say "no npm on this machine; the Azure repository tests will skip"
    exit 0
fi
mkdir -p "$DEST"
if npm install --silent --no-audit --no-fund --prefix "$DEST" "azurite@$VERSION" >/dev/null 2>&1 && [ -x "$BIN" ]; then
    say "installed: $BIN"
else
    say "npm could not install azurite@$VERSION; the Azure repository tests will skip"
fi
exit 0
