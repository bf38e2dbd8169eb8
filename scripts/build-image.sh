#!/usr/bin/env bash
# Build the taintgate OCI image without a Docker engine: buildah (Debian) as root, its own
# vfs storage under target/image/, chroot isolation, `from scratch`. Contents: the stripped
# release binary, the shared libraries `ldd` lists for it (and the dynamic loader), the
# glibc libraries NVIDIA's driver libraries need besides those (below), the CA
# certificates, a passwd/group naming root. ENTRYPOINT ["taintgate"], user 0:0 (the
# DaemonSet's user: root owns the kubelet and containerd sockets the agent reads; every
# capability is dropped there), OCI labels source, version, revision.
#
# The NVIDIA libraries (libnvidia-ml.so.1, libcuda.so.1) are not in the image: the agent
# dlopens them, and the NVIDIA container runtime or CDI injects them on a GPU node. It
# injects the driver's libraries only, not glibc's, and those need libpthread.so.0,
# libdl.so.2 and librt.so.1 besides libc/libm (`readelf -d` on the 535 libraries; glibc
# 2.34+ keeps them as stubs, so the agent itself never links them): the image carries
# them, from the same glibc as the libc ldd found. tests/tests/image_containerd.rs loads
# NVIDIA's real 535 libraries in the image to prove it.
#
# Usage: scripts/build-image.sh [OUT.tar]   (default target/image/taintgate-oci.tar)
# Prints the image digest, the archive's size and the tag. linux/amd64 only (the host's).
# Environment: TAINTGATE_BIN=path uses that binary instead of `cargo build --release`.
set -euo pipefail
cd "$(dirname "$0")/.."

out=${1:-target/image/taintgate-oci.tar}
command -v buildah >/dev/null 2>&1 || {
    echo "build-image: buildah not found (scripts/install-test-deps-image.sh installs it)" >&2
    exit 2
}
[ "$(id -u)" = 0 ] || { echo "build-image: run as root (buildah with vfs storage, chroot isolation)" >&2; exit 2; }

version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' Cargo.toml)
source_url=$(sed -n '/^\[workspace.package\]/,/^\[/s/^repository *= *"\(.*\)"/\1/p' Cargo.toml)
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
if [ -n "$(git status --porcelain 2>/dev/null)" ]; then revision="$revision-dirty"; fi

bin=${TAINTGATE_BIN:-}
if [ -z "$bin" ]; then
    cargo build --release --locked -p taintgate --bin taintgate
    bin=${CARGO_TARGET_DIR:-target}/release/taintgate
fi

work=$(mktemp -d)
storage=$PWD/target/image/storage
mkdir -p "$storage" "$(dirname "$out")"
export BUILDAH_ISOLATION=chroot
b() { buildah --storage-driver vfs --root "$storage/root" --runroot "$storage/run" "$@"; }
ctr=""
cleanup() {
    if [ -n "$ctr" ]; then b rm "$ctr" >/dev/null 2>&1 || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

# Symbols and debug info go; .eh_frame stays (strip keeps it), so panics still unwind.
strip --strip-unneeded -o "$work/taintgate" "$bin"

ctr=$(b from --quiet scratch)
mnt=$(b mount "$ctr")
install -D -m 0755 "$work/taintgate" "$mnt/usr/local/bin/taintgate"
# Exactly what the loader needs: every `=> /path` ldd lists, and the interpreter, each at
# the path ldd printed (the file behind any symlink).
ldd "$work/taintgate" | awk '/=> \//{print $3} /^[[:space:]]*\/[^ ]+ \(/{print $1}' | sort -u | while read -r lib; do
    install -D -m 0755 "$(readlink -f "$lib")" "$mnt$lib"
    echo "build-image: + $lib"
done
# glibc's libraries that NVIDIA's libnvidia-ml.so.1 and libcuda.so.1 declare as needed and
# the agent does not: beside the libc ldd resolved, so they are the same glibc release.
libc_path=$(ldd "$work/taintgate" | awk '$1 == "libc.so.6" && $3 ~ /^\// {print $3}')
[ -n "$libc_path" ] || { echo "build-image: ldd names no libc.so.6 for the agent" >&2; exit 1; }
for soname in libpthread.so.0 libdl.so.2 librt.so.1 libm.so.6; do
    lib=$(dirname "$libc_path")/$soname
    [ -e "$lib" ] || { echo "build-image: $lib not found (needed by NVIDIA's driver libraries)" >&2; exit 1; }
    if [ ! -e "$mnt$lib" ]; then
        install -D -m 0755 "$(readlink -f "$lib")" "$mnt$lib"
        echo "build-image: + $lib (for NVIDIA's libraries)"
    fi
done
install -D -m 0644 /etc/ssl/certs/ca-certificates.crt "$mnt/etc/ssl/certs/ca-certificates.crt"
install -d -m 1777 "$mnt/tmp"
printf 'root:x:0:0:root:/:/usr/sbin/nologin\n' >"$work/passwd"
printf 'root:x:0:\n' >"$work/group"
install -D -m 0644 "$work/passwd" "$mnt/etc/passwd"
install -D -m 0644 "$work/group" "$mnt/etc/group"
b umount "$ctr" >/dev/null

b config \
    --os linux --arch amd64 \
    --entrypoint '["taintgate"]' --cmd '' \
    --user 0:0 --workingdir / \
    --env PATH=/usr/local/bin:/usr/bin:/bin \
    --env SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    --label org.opencontainers.image.title=taintgate \
    --label org.opencontainers.image.source="$source_url" \
    --label org.opencontainers.image.version="$version" \
    --label org.opencontainers.image.revision="$revision" \
    --label org.opencontainers.image.licenses=Apache-2.0 \
    "$ctr"
tag="localhost/taintgate:$version"
b commit --quiet --format oci --rm "$ctr" "$tag" >/dev/null
ctr=""
rm -f "$out"
b push --quiet --digestfile "$work/digest" "$tag" "oci-archive:$out:$tag"
echo "build-image: tag $tag"
echo "build-image: digest $(cat "$work/digest")"
echo "build-image: archive $out $(stat -c %s "$out") bytes (compressed layers)"
