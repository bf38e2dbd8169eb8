#!/usr/bin/env bash
# Installs what the image pre-pull tests (tests/tests/images_*.rs, prefetch/tests/images*.rs)
# start for real: containerd (with its CRI plugin), a docker-registry, skopeo to push the
# images the harness builds, and htpasswd (apache2-utils) for the registry's auth case.
# Idempotent: packages already present are not reinstalled, and apt's lists are refreshed
# only when something is missing. Run as root (CI runs as root).
set -euo pipefail

need=()
command -v containerd >/dev/null 2>&1 || need+=(containerd)
command -v runc >/dev/null 2>&1 || need+=(runc)
# Debian's docker-registry package installs /usr/bin/docker-registry.
command -v docker-registry >/dev/null 2>&1 || need+=(docker-registry)
command -v skopeo >/dev/null 2>&1 || need+=(skopeo)
command -v htpasswd >/dev/null 2>&1 || need+=(apache2-utils)

if ((${#need[@]} == 0)); then
    echo "install-test-deps-images: all present"
else
    echo "install-test-deps-images: installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # --no-install-recommends keeps docker.io and friends out; the packages' own services
    # are not needed (the harness runs private instances), so they are stopped below.
    apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

# docker-registry's postinst may start a system-wide registry on port 5000; the tests run
# private instances on free ports, so one this script just installed is stopped again. A
# registry or containerd that was already there before is left alone.
if [[ " ${need[*]:-} " == *" docker-registry "* ]] && command -v systemctl >/dev/null 2>&1 \
    && [ -d /run/systemd/system ]; then
    systemctl disable --now docker-registry.service >/dev/null 2>&1 || true
fi

for bin in containerd docker-registry skopeo htpasswd; do
    command -v "$bin" >/dev/null 2>&1 || { echo "install-test-deps-images: $bin still missing" >&2; exit 1; }
done
echo "install-test-deps-images: containerd $(containerd --version | awk '{print $3}'), skopeo $(skopeo --version | awk '{print $3}')"
