#!/usr/bin/env bash
# Where NVIDIA's nvml.h for the fake libnvidia-ml.so.1 lives: the pinned PyPI wheel
# nvidia-nvml-dev-cu12, unpacked by scripts/install-test-deps-nvidia.sh into the tools
# cache outside the clone ($TAINTGATE_TOOLS_CACHE, default ~/.cache/taintgate-tools).
#
# Run: prints the directory holding nvml.h ($NVML_INCLUDE_DIR if set), or exits 1 naming
# the installer when the header is not there.
# Sourced (by the installer): only sets the variables below, the pin's one home.
NVML_WHEEL=nvidia-nvml-dev-cu12
NVML_WHEEL_VERSION=12.9.79
NVML_CACHE=${TAINTGATE_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/taintgate-tools}
NVML_WHEEL_DIR=$NVML_CACHE/nvidia/$NVML_WHEEL-$NVML_WHEEL_VERSION
# Where the wheel puts its header.
NVML_WHEEL_INCLUDE=$NVML_WHEEL_DIR/nvidia/nvml_dev/include

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    dir=${NVML_INCLUDE_DIR:-$NVML_WHEEL_INCLUDE}
    if [ ! -f "$dir/nvml.h" ]; then
        echo "error: no nvml.h in $dir; run scripts/install-test-deps-nvidia.sh (installs $NVML_WHEEL $NVML_WHEEL_VERSION)" >&2
        exit 1
    fi
    printf '%s\n' "$dir"
fi
