#!/usr/bin/env bash
# Installs what the deployment-artifact tests (tests/tests/deploy_*.rs) run:
#   - systemd-analyze (package systemd) for `verify` and `security` on systemd/taintgate.service;
#   - kubectl from Debian's kubernetes-client package for `kubectl kustomize daemonset/`.
# When a kubectl from another source already sits at /usr/bin/kubectl, installing
# kubernetes-client would collide with it (same path), so Debian's build is unpacked beside
# it instead, at $DEST, and the render test uses both.
# Idempotent: nothing is downloaded when everything is present. Run as root (CI runs as root).
set -euo pipefail

DEST=/opt/taintgate-test-tools/kubernetes-client
apt_updated=0
apt_update() {
    if ((apt_updated == 0)); then
        apt-get update -qq
        apt_updated=1
    fi
}
export DEBIAN_FRONTEND=noninteractive

if ! command -v systemd-analyze >/dev/null 2>&1; then
    echo "install-test-deps-deploy: installing systemd (systemd-analyze)"
    apt_update
    apt-get install -y -qq --no-install-recommends systemd
fi

kubectl_pkg=""
if command -v kubectl >/dev/null 2>&1; then
    kubectl_pkg=$(dpkg -S "$(readlink -f "$(command -v kubectl)")" 2>/dev/null | cut -d: -f1 || true)
fi
if ! command -v kubectl >/dev/null 2>&1; then
    echo "install-test-deps-deploy: installing kubernetes-client (kubectl)"
    apt_update
    apt-get install -y -qq --no-install-recommends kubernetes-client
elif [ "$kubectl_pkg" != "kubernetes-client" ] && [ ! -x "$DEST/usr/bin/kubectl" ]; then
    echo "install-test-deps-deploy: kubectl on PATH is from '${kubectl_pkg:-unknown}'; unpacking Debian's kubernetes-client to $DEST"
    apt_update
    tmp=$(mktemp -d)
    chown _apt "$tmp" 2>/dev/null || true # apt-get download writes as user _apt
    trap 'rm -rf "$tmp"' EXIT
    (cd "$tmp" && apt-get download kubernetes-client >/dev/null)
    mkdir -p "$DEST"
    dpkg-deb -x "$tmp"/kubernetes-client_*.deb "$DEST"
fi

command -v systemd-analyze >/dev/null 2>&1 || { echo "install-test-deps-deploy: systemd-analyze still missing" >&2; exit 1; }
command -v kubectl >/dev/null 2>&1 || { echo "install-test-deps-deploy: kubectl still missing" >&2; exit 1; }
echo "install-test-deps-deploy: $(systemd-analyze --version | head -1)"
echo "install-test-deps-deploy: kubectl $(kubectl version --client 2>/dev/null | head -1)"
if [ -x "$DEST/usr/bin/kubectl" ]; then
    echo "install-test-deps-deploy: Debian kubectl $("$DEST/usr/bin/kubectl" version --client 2>/dev/null | head -1)"
fi
