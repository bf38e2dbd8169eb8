#!/usr/bin/env bash
# Builds NVIDIA's k8s device plugin and GPU Feature Discovery (github.com/NVIDIA/
# k8s-device-plugin, pinned in tools/go/nvidia-device-plugin and tools/go/
# gpu-feature-discovery) for tests/tests/nvidia_device_plugin.rs, with cgo on (they dlopen
# libnvidia-ml.so.1, here the fake one from tests/fake-nvml). Binaries go to the tools cache
# outside the clone and are never rebuilt when present (tools/go/lib.sh).
# Exits non-zero, naming what is wrong, when Go or a C compiler is missing or a build fails.
set -euo pipefail
# shellcheck source=tools/go/lib.sh
. "$(dirname "$0")/../tools/go/lib.sh"

tg_go_check
if ! command -v "${CC:-cc}" >/dev/null 2>&1; then
    echo "error: no C compiler (${CC:-cc}); the NVIDIA device plugin builds with cgo" >&2
    exit 2
fi
echo "install-test-deps-nvidia-plugin: $(go env GOVERSION), cache $TAINTGATE_TOOLS_CACHE"
start=$(date +%s)
for t in nvidia-device-plugin gpu-feature-discovery; do
    tg_build "$t"
done
echo "install-test-deps-nvidia-plugin: ok in $(($(date +%s) - start))s"
