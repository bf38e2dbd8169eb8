#!/usr/bin/env bash
# What `scripts/local-cluster.sh up DIR --node` needs beside the control plane (whose
# kubelet, kube-scheduler and kube-controller-manager scripts/install-test-deps-kube.sh
# builds):
#   - the pod sandbox image registry.k8s.io/pause:3.10, which cannot be pulled on the test
#     machines: tools/pause/pause.c built static and packed with buildah (vfs storage in a
#     private temporary root, chroot isolation, no daemon) into an OCI archive in the tools
#     cache outside the clone, keyed by the source's hash; a present archive is never rebuilt;
#   - Debian's containerd, runc, buildah, CNI plugins (containernetworking-plugins),
#     iproute2's ip and util-linux's unshare/nsenter: installed with apt when missing
#     (idempotent; run as root, as CI does), then checked.
# Prints the archive's path on its last line. Exits non-zero naming what is missing.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=tools/go/lib.sh
. "$ROOT/tools/go/lib.sh"

PAUSE_REF=registry.k8s.io/pause:3.10
need=()
command -v containerd >/dev/null 2>&1 || need+=(containerd)
command -v runc >/dev/null 2>&1 || need+=(runc)
command -v buildah >/dev/null 2>&1 || need+=(buildah)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v nsenter >/dev/null 2>&1 || need+=(util-linux)
[ -x /usr/lib/cni/bridge ] && [ -x /usr/lib/cni/host-local ] && [ -x /usr/lib/cni/loopback ] \
    || need+=(containernetworking-plugins)
if ((${#need[@]} > 0)) && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "install-test-deps-node: installing ${need[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
fi
missing=()
for b in containerd runc buildah unshare nsenter ip "${CC:-cc}"; do
    command -v "$b" >/dev/null 2>&1 || missing+=("$b")
done
for p in bridge host-local loopback; do
    [ -x "/usr/lib/cni/$p" ] || missing+=("/usr/lib/cni/$p (containernetworking-plugins)")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "error: install-test-deps-node: missing: ${missing[*]}" >&2
    exit 2
fi

sum=$(sha256sum "$ROOT/tools/pause/pause.c" | cut -c1-12)
out="$TAINTGATE_TOOLS_CACHE/pause/3.10-$sum/pause.oci.tar"
if [ -s "$out" ]; then
    echo "  pause: cached at $out" >&2
    echo "$out"
    exit 0
fi
start=$(date +%s)
mkdir -p "$(dirname "$out")"
tmp=$(mktemp -d)
trap 'buildah --root "$tmp/root" --runroot "$tmp/run" --storage-driver vfs rm --all >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
"${CC:-cc}" -static -Os -Wall -Werror -o "$tmp/pause" "$ROOT/tools/pause/pause.c" \
    || { echo "error: install-test-deps-node: building pause (static) failed" >&2; exit 1; }
strip "$tmp/pause" 2>/dev/null || true
export BUILDAH_ISOLATION=chroot
b=(buildah --root "$tmp/root" --runroot "$tmp/run" --storage-driver vfs)
ctr=$("${b[@]}" from scratch)
"${b[@]}" copy "$ctr" "$tmp/pause" /pause >/dev/null
"${b[@]}" config --entrypoint '["/pause"]' --user 65535:65535 "$ctr"
"${b[@]}" commit --quiet "$ctr" "$PAUSE_REF" >/dev/null
"${b[@]}" push --quiet "$PAUSE_REF" "oci-archive:$out.tmp.$$:$PAUSE_REF" \
    || { rm -f "$out.tmp.$$"; echo "error: install-test-deps-node: buildah push failed" >&2; exit 1; }
mv -f "$out.tmp.$$" "$out"
echo "  pause: built in $(($(date +%s) - start))s -> $out" >&2
echo "$out"
