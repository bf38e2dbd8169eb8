#!/usr/bin/env bash
# Installs NVIDIA's libnccl.so.2 from the PyPI wheel nvidia-nccl-cu12 into the tools cache
# outside the clone, for validators/tests/nccl_wheel.rs: the agent's own NCCL loader
# (validators/src/gpu/real/nccl.rs) loads it and every symbol it uses must resolve, with the
# wheel's version. Only the library is kept (the wheel is ~200 MB; the library about as
# large). Idempotent: nothing is downloaded when it is present. `--print-path` prints where
# the library lives (installed or not) and does nothing else.
set -euo pipefail
WHEEL=nvidia-nccl-cu12
VERSION=2.27.7
CACHE=${TAINTGATE_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/taintgate-tools}
DIR=$CACHE/nvidia/$WHEEL-$VERSION
if [ "${1:-}" = "--print-path" ]; then
    echo "$DIR/libnccl.so.2"
    exit 0
fi
if [ -f "$DIR/libnccl.so.2" ]; then
    echo "install-test-deps-nccl: $WHEEL $VERSION present" >&2
    exit 0
fi
command -v pip3 >/dev/null 2>&1 || command -v pip >/dev/null 2>&1 || {
    echo "install-test-deps-nccl: pip not found (needed for $WHEEL)" >&2; exit 2; }
PIP=$(command -v pip3 || command -v pip)
mkdir -p "$(dirname "$DIR")"
tmp=$(mktemp -d "$(dirname "$DIR")/.nccl.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
echo "install-test-deps-nccl: downloading $WHEEL $VERSION" >&2
"$PIP" download --no-deps -q --only-binary=:all: "$WHEEL==$VERSION" -d "$tmp"
whl=$(ls "$tmp"/*.whl)
mkdir -p "$tmp/x"
python3 - "$whl" "$tmp/x" <<'PY'
import sys, zipfile
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    names = [n for n in z.namelist() if n.endswith("lib/libnccl.so.2")]
    if not names:
        sys.exit(f"{whl} has no lib/libnccl.so.2")
    with z.open(names[0]) as src, open(f"{out}/libnccl.so.2", "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
PY
echo "$VERSION" >"$tmp/x/VERSION"
rm -rf "$DIR.tmp" && mv "$tmp/x" "$DIR.tmp" && mv "$DIR.tmp" "$DIR"
echo "install-test-deps-nccl: installed $DIR/libnccl.so.2" >&2
