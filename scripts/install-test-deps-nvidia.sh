#!/usr/bin/env bash
# Installs NVIDIA's own NVML header for the fake libnvidia-ml.so.1 (tests/fake-nvml/): the
# PyPI wheel nvidia-nvml-dev-cu12, pinned in tests/fake-nvml/nvml-include.sh, unpacked into
# the tools cache outside the clone:
#   ${TAINTGATE_TOOLS_CACHE:-~/.cache/taintgate-tools}/nvidia/nvidia-nvml-dev-cu12-<version>/
# Idempotent: a present header means nothing is downloaded. Prints the include directory.
# Needs python3 with pip (the wheel is fetched with `pip download --no-deps`, unpacked with
# python3's zipfile). Exits non-zero, naming what is wrong, when either fails.
set -euo pipefail
# shellcheck source=tests/fake-nvml/nvml-include.sh
. "$(dirname "$0")/../tests/fake-nvml/nvml-include.sh"

if [ -f "$NVML_WHEEL_INCLUDE/nvml.h" ]; then
    echo "install-test-deps-nvidia: $NVML_WHEEL $NVML_WHEEL_VERSION present" >&2
    printf '%s\n' "$NVML_WHEEL_INCLUDE"
    exit 0
fi

PY=${PYTHON:-python3}
if ! "$PY" -m pip --version >/dev/null 2>&1; then
    echo "error: $PY -m pip not available; install python3 and pip (needed to fetch $NVML_WHEEL)" >&2
    exit 2
fi

mkdir -p "$NVML_CACHE/nvidia"
tmp=$(mktemp -d "$NVML_CACHE/nvidia/.download.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
echo "install-test-deps-nvidia: downloading $NVML_WHEEL==$NVML_WHEEL_VERSION" >&2
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --dest "$tmp/wheel" "$NVML_WHEEL==$NVML_WHEEL_VERSION" >&2
wheel=$(ls "$tmp"/wheel/*.whl)
"$PY" -m zipfile -e "$wheel" "$tmp/tree"
if [ ! -f "$tmp/tree/nvidia/nvml_dev/include/nvml.h" ]; then
    echo "error: $wheel has no nvidia/nvml_dev/include/nvml.h" >&2
    exit 1
fi
cp "$wheel" "$tmp/tree/"
# Into place in one rename, so a half-unpacked tree is never seen as installed.
rm -rf "$NVML_WHEEL_DIR"
mv "$tmp/tree" "$NVML_WHEEL_DIR"
echo "install-test-deps-nvidia: installed $(basename "$wheel")" >&2
printf '%s\n' "$NVML_WHEEL_INCLUDE"
