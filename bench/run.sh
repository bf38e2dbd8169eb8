#!/usr/bin/env bash
# One command from a fresh machine (Debian 12+): install the competitors, build taintgate
# (release), generate the data set under /tmp/tg-bench (--data DIR; never in the repo),
# run the loopback benchmark and print the table.
#
# Needs, before it runs: cargo (the Rust toolchain, Rust >= 1.88; this script does not
# install it), and root or sudo when a Debian package is missing (nginx-light, rclone,
# aria2, curl, openssl, python3-venv). Arguments go to bench/prefetch_bench.py.
#
#   bash bench/run.sh            # full run (4 GiB HTTP set, 4 GiB S3 set, 3 repeats)
#   REPEATS=5 bash bench/run.sh  # more repeats
#   REPEATS=1 bash bench/run.sh --small   # smoke test of every command on a tiny set
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if ! command -v cargo >/dev/null 2>&1; then
  echo "error: cargo not found; install the Rust toolchain (rustup, Rust >= 1.88) first" >&2
  exit 2
fi

# Installs nginx, the competitors and the Python venv (apt-get through sudo when not root).
bash "$ROOT/scripts/install-test-deps-prefetch.sh"
# s3s-fs, the S3 origin (and fake-gcs-server and Azurite, which the bench does not use).
bash "$ROOT/scripts/install-test-deps-stores.sh"
(cd "$ROOT" && cargo build --release -p taintgate)
exec "$ROOT/.venv/bin/python" "$ROOT/bench/prefetch_bench.py" \
  --engine "${CARGO_TARGET_DIR:-$ROOT/target}/release/taintgate" "$@"
