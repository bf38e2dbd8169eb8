#!/usr/bin/env bash
# Installs NVIDIA's real driver user-space libraries, libnvidia-ml.so.1 (NVML) and
# libcuda.so.1 (the CUDA driver API), branch 535, from Debian 12's non-free component
# (packages libnvidia-ml1 and libcuda1), for the tests that load the real thing instead of
# the fakes: tests/tests/nvidia_real_libs.rs and tests/tests/image_containerd.rs.
#
# The system's apt is untouched: a private apt configuration (its own sources, lists and
# archive cache, Dir::Etc::SourceParts / Dir::State::Lists / Dir::Cache::Archives) runs
# `apt-get download` and `dpkg-deb -x` unpacks the packages. Nothing is installed into the
# system. The libraries land in a cache outside the clone, never in git:
#   ${TAINTGATE_NVIDIA_DRIVER_CACHE:-~/.cache/taintgate-nvidia-driver}/<version>/lib/
#     libnvidia-ml.so.535.309.01  libnvidia-ml.so.1 -> libnvidia-ml.so.535.309.01
#     libcuda.so.535.309.01       libcuda.so.1      -> libcuda.so.535.309.01
# (the layout the NVIDIA container runtime gives a container: the versioned file and its
# soname link).
#
# Usage: install-test-deps-nvidia-driver.sh              install (idempotent), print lib dir
#        install-test-deps-nvidia-driver.sh --print-dir  print lib dir, exit 1 if absent
# Environment: TAINTGATE_NVIDIA_DRIVER_VERSION (Debian version, default below),
#   TAINTGATE_DEBIAN_MIRROR / TAINTGATE_DEBIAN_SECURITY_MIRROR (default deb.debian.org).
# Needs apt-get and dpkg-deb (Debian) and Debian's archive keyring.
set -euo pipefail

# 535.309.01 is the bookworm-security update; bookworm itself carries 535.261.03-1.
version=${TAINTGATE_NVIDIA_DRIVER_VERSION:-535.309.01-0+deb12u1}
cache=${TAINTGATE_NVIDIA_DRIVER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/taintgate-nvidia-driver}
dir=$cache/$version
upstream=${version%%-*}

installed() {
    [ -f "$dir/lib/libnvidia-ml.so.$upstream" ] && [ -f "$dir/lib/libcuda.so.$upstream" ] &&
        [ -L "$dir/lib/libnvidia-ml.so.1" ] && [ -L "$dir/lib/libcuda.so.1" ]
}

if [ "${1:-}" = --print-dir ]; then
    if ! installed; then
        echo "error: NVIDIA's $version driver libraries are not in $dir; run scripts/install-test-deps-nvidia-driver.sh" >&2
        exit 1
    fi
    printf '%s\n' "$dir/lib"
    exit 0
fi

if installed; then
    echo "install-test-deps-nvidia-driver: libnvidia-ml1/libcuda1 $version present" >&2
    printf '%s\n' "$dir/lib"
    exit 0
fi

for tool in apt-get dpkg-deb; do
    command -v "$tool" >/dev/null 2>&1 || { echo "error: $tool not found (Debian's apt and dpkg are needed)" >&2; exit 2; }
done
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
[ -f "$keyring" ] || { echo "error: $keyring missing (package debian-archive-keyring)" >&2; exit 2; }

mkdir -p "$cache"
tmp=$(mktemp -d "$cache/.download.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/sources" "$tmp/lists/partial" "$tmp/archives/partial" "$tmp/debs" "$tmp/tree"
cat >"$tmp/sources/debian-non-free.sources" <<EOF
Types: deb
URIs: ${TAINTGATE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
Suites: bookworm bookworm-updates
Components: non-free
Signed-By: $keyring

Types: deb
URIs: ${TAINTGATE_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
Suites: bookworm-security
Components: non-free
Signed-By: $keyring
EOF
apt_opts=(
    -o "Dir::Etc::SourceList=/dev/null"
    -o "Dir::Etc::SourceParts=$tmp/sources"
    -o "Dir::State::Lists=$tmp/lists"
    -o "Dir::Cache=$tmp"
    -o "Dir::Cache::Archives=$tmp/archives"
    -o "Debug::NoLocking=1"
    -o "APT::Architecture=amd64"
    -o "APT::Architectures=amd64"
)
# apt drops to the _apt user for downloads, which cannot write a root-owned private dir.
if [ "$(id -u)" = 0 ]; then apt_opts+=(-o "APT::Sandbox::User=root"); fi

echo "install-test-deps-nvidia-driver: fetching libnvidia-ml1 and libcuda1 $version (Debian non-free)" >&2
apt-get "${apt_opts[@]}" -qq update >&2
if ! (cd "$tmp/debs" && apt-get "${apt_opts[@]}" -qq download "libnvidia-ml1=$version" "libcuda1=$version" >&2); then
    echo "error: Debian no longer serves libnvidia-ml1/libcuda1 $version; available:" >&2
    apt-cache "${apt_opts[@]}" madison libnvidia-ml1 >&2 || true
    echo "set TAINTGATE_NVIDIA_DRIVER_VERSION to a 535 version above (or update the pin here)" >&2
    exit 1
fi
for deb in "$tmp"/debs/*.deb; do dpkg-deb -x "$deb" "$tmp/tree"; done

src=$tmp/tree/usr/lib/x86_64-linux-gnu/nvidia/current
mkdir -p "$tmp/out/lib"
for lib in libnvidia-ml libcuda; do
    [ -f "$src/$lib.so.$upstream" ] || { echo "error: the package has no $lib.so.$upstream under $src" >&2; exit 1; }
    cp "$src/$lib.so.$upstream" "$tmp/out/lib/"
    ln -s "$lib.so.$upstream" "$tmp/out/lib/$lib.so.1"
done
cp "$tmp"/debs/*.deb "$tmp/out/"
# Into place in one rename, so a half-unpacked tree is never seen as installed.
rm -rf "$dir"
mv "$tmp/out" "$dir"
echo "install-test-deps-nvidia-driver: installed $(cd "$dir" && ls ./*.deb | tr '\n' ' ')" >&2
printf '%s\n' "$dir/lib"
