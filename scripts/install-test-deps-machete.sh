#!/usr/bin/env bash
# Installs cargo-machete (crates.io) into the tools cache outside the clone, for the
# unused-dependency check scripts/test.sh runs after clippy: a dependency listed in a
# Cargo.toml that no source file uses fails the suite. Keyed by its version and the rustc
# version; nothing is built when the binary is present (cold: about 2 min 20 s on 2 cores).
# `--print-path` prints where it lives (installed or not) and does nothing else.
set -euo pipefail
VERSION=0.9.2
CACHE=${TAINTGATE_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/taintgate-tools}
RUSTC=$(rustc --version | awk '{print $2}')
DIR=$CACHE/cargo-machete/$VERSION-rustc$RUSTC
if [ "${1:-}" = "--print-path" ]; then
    echo "$DIR/bin/cargo-machete"
    exit 0
fi
if [ -x "$DIR/bin/cargo-machete" ]; then
    echo "install-test-deps-machete: cargo-machete $VERSION present" >&2
    exit 0
fi
echo "install-test-deps-machete: building cargo-machete $VERSION from crates.io" >&2
rm -rf "$DIR.tmp"
cargo install --quiet --locked --version "$VERSION" --root "$DIR.tmp" cargo-machete
mv "$DIR.tmp" "$DIR"
"$DIR/bin/cargo-machete" --version >&2
