#!/usr/bin/env bash
# Installs NVIDIA's ptxas from the PyPI wheel nvidia-cuda-nvcc-cu12 into the tools cache
# outside the clone, for validators/tests/ptx_ptxas.rs (the embedded smoke PTX assembled
# for every architecture the docs claim). Only the ptxas binary is kept.
# Idempotent: nothing is downloaded when it is present. `--print-path` prints where it
# lives (installed or not) and does nothing else.
set -euo pipefail
WHEEL=nvidia-cuda-nvcc-cu12
VERSION=12.9.86
CACHE=${TAINTGATE_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/taintgate-tools}
DIR=$CACHE/nvidia/$WHEEL-$VERSION
if [ "${1:-}" = "--print-path" ]; then
    echo "$DIR/ptxas"
    exit 0
fi
if [ -x "$DIR/ptxas" ]; then
    echo "install-test-deps-ptxas: $("$DIR/ptxas" --version | tail -1)" >&2
    exit 0
fi
command -v pip3 >/dev/null 2>&1 || command -v pip >/dev/null 2>&1 || {
    echo "install-test-deps-ptxas: pip not found (needed for $WHEEL)" >&2; exit 2; }
PIP=$(command -v pip3 || command -v pip)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "install-test-deps-ptxas: downloading $WHEEL $VERSION (40 MB)" >&2
"$PIP" download --no-deps -q "$WHEEL==$VERSION" -d "$tmp"
whl=$(ls "$tmp"/*.whl)
mkdir -p "$tmp/x" "$(dirname "$DIR")"
unzip -q -j "$whl" 'nvidia/cuda_nvcc/bin/ptxas' -d "$tmp/x"
chmod +x "$tmp/x/ptxas"
"$tmp/x/ptxas" --version >/dev/null
rm -rf "$DIR.tmp" && mv "$tmp/x" "$DIR.tmp" && mv "$DIR.tmp" "$DIR"
echo "install-test-deps-ptxas: $("$DIR/ptxas" --version | tail -1)" >&2
