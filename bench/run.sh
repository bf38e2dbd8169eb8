#!/usr/bin/env bash
# One command from a fresh machine: install the competitors, build the engine (release),
# generate the data set under $BENCH_DIR (default /tmp/tg-bench, never in the repo), run the
# loopback benchmark and print the table.
#
#   bash bench/run.sh            # full run (4 GiB HTTP set, 256 MiB S3 set, 3 repeats)
#   REPEATS=5 bash bench/run.sh  # more repeats
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/install-test-deps-prefetch.sh"
(cd "$ROOT" && cargo build --release -p taintgate-prefetch --example fetch)
exec "$ROOT/.venv/bin/python" "$ROOT/bench/prefetch_bench.py" --engine "$ROOT/target/release/examples/fetch" "$@"
