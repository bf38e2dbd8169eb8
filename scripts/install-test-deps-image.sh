#!/usr/bin/env bash
# Installs what the shipping tests need beyond the image pre-pull tests' containerd,
# runc, docker-registry and skopeo (scripts/install-test-deps-images.sh): buildah, which
# builds the taintgate image without a Docker engine (scripts/build-image.sh,
# tests/tests/image_containerd.rs), binutils' strip, and e2fsprogs' mkfs.ext4 for the
# bundle test on a real ext4 filesystem (tests/tests/view_link_limit.rs).
# Idempotent: nothing is installed when all are present. Run as root (CI runs as root).
set -euo pipefail

need=()
command -v buildah >/dev/null 2>&1 || need+=(buildah)
command -v strip >/dev/null 2>&1 || need+=(binutils)
command -v mkfs.ext4 >/dev/null 2>&1 || need+=(e2fsprogs)

if ((${#need[@]} == 0)); then
    echo "install-test-deps-image: all present"
else
    echo "install-test-deps-image: installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
for bin in buildah strip mkfs.ext4; do
    command -v "$bin" >/dev/null 2>&1 || { echo "install-test-deps-image: $bin still missing" >&2; exit 1; }
done
echo "install-test-deps-image: $(buildah --version)"
