#!/usr/bin/env bash
# Fleet load test, one command: builds the agent and the load driver (release), then runs
# AGENTS (default 500) real `taintgate` processes on simulated GPU nodes against one
# real kube-apiserver + etcd (scripts/install-test-deps-kube.sh builds them) and prints: API requests per bootstrap, peak concurrent watches,
# last-evidence -> taint-removed latency (p50/p99), the waiting fleet's memory, and one
# resident agent's RSS and idle CPU after release.
#
#   bash scripts/load-test.sh                       # 500 agents
#   AGENTS=1000 bash scripts/load-test.sh           # more
#   bash scripts/load-test.sh --json /tmp/load.json # extra flags go to the driver (--help)
#
# Loopback only. Takes 1-3 minutes after the build on a 2-core machine; agents are started
# paced (at most 24 not yet watching), so a small machine copes.
set -euo pipefail
cd "$(dirname "$0")/.."
# Every agent holds a watch and a request connection to the API server's proxy.
hard="$(ulimit -Hn)"
if [ "$hard" = unlimited ] || [ "$hard" -gt 65536 ]; then hard=65536; fi
ulimit -n "$hard" 2>/dev/null || true
cargo build --release -p taintgate --bin taintgate -p taintgate-load --bin taintgate-load
rel="${CARGO_TARGET_DIR:-target}/release"
exec "$rel/taintgate-load" --agents "${AGENTS:-500}" --bin "$rel/taintgate" "$@"
