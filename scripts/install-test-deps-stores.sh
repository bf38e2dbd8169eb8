#!/usr/bin/env bash
# Installs the object-store servers the prefetch tests (tests/tests/prefetch_stores.rs) and
# the S3 benchmark run on loopback, each into the tools cache outside the clone, keyed by
# version so a warm run installs nothing:
#   fake-gcs-server  gs://   from its Go module, pinned in tools/go/fake-gcs-server/;
#   s3s-fs           s3://   crates.io, `binary` feature (checks SigV4, serves ranges from
#                            the file without copying it);
#   azurite-blob     az://   npm `azurite`, run by node.
# `--print-path NAME` prints where NAME (s3s-fs, azurite-blob) lives and does nothing else.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE=${TAINTGATE_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/taintgate-tools}
S3S_VERSION=0.14.1
AZURITE_VERSION=3.37.0
RUSTC=$(rustc --version | awk '{print $2}')
S3S_DIR=$CACHE/s3s-fs/$S3S_VERSION-rustc$RUSTC
AZURITE_DIR=$CACHE/azurite/$AZURITE_VERSION

case "${1:-}" in
--print-path)
    case "${2:-}" in
    s3s-fs) echo "$S3S_DIR/bin/s3s-fs" ;;
    azurite-blob) echo "$AZURITE_DIR/node_modules/.bin/azurite-blob" ;;
    *) echo "usage: $0 --print-path s3s-fs|azurite-blob" >&2; exit 2 ;;
    esac
    exit 0
    ;;
esac

# shellcheck source=tools/go/lib.sh
. "$ROOT/tools/go/lib.sh"
tg_go_check
start=$(date +%s)
tg_build fake-gcs-server

if [ -x "$S3S_DIR/bin/s3s-fs" ]; then
    echo "  s3s-fs $S3S_VERSION: cached at $S3S_DIR"
else
    echo "  s3s-fs $S3S_VERSION: building from crates.io (about 2 min)"
    rm -rf "$S3S_DIR.tmp"
    cargo install --quiet --locked --version "$S3S_VERSION" --features binary --root "$S3S_DIR.tmp" s3s-fs
    mv "$S3S_DIR.tmp" "$S3S_DIR"
fi

if [ -x "$AZURITE_DIR/node_modules/.bin/azurite-blob" ]; then
    echo "  azurite $AZURITE_VERSION: cached at $AZURITE_DIR"
else
    if ! command -v npm >/dev/null 2>&1; then
        SUDO=""
        if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
        $SUDO apt-get -o DPkg::Lock::Timeout=600 update -qq
        $SUDO env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
            --no-install-recommends nodejs npm
    fi
    echo "  azurite $AZURITE_VERSION: npm install"
    rm -rf "$AZURITE_DIR.tmp"
    mkdir -p "$AZURITE_DIR.tmp"
    npm install --silent --no-audit --no-fund --prefix "$AZURITE_DIR.tmp" "azurite@$AZURITE_VERSION"
    mv "$AZURITE_DIR.tmp" "$AZURITE_DIR"
fi
echo "install-test-deps-stores: ok in $(($(date +%s) - start))s"
