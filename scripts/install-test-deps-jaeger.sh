#!/usr/bin/env bash
# Builds Jaeger v2.12.0 (github.com/jaegertracing/jaeger v1.75.0, package cmd/jaeger,
# pinned in tools/go/jaeger/) for the trace tests (tests/tests/jaeger_traces.rs: the agent
# exports over OTLP gRPC and HTTP to a real Jaeger on loopback, in-memory storage, and the
# test reads the traces back through Jaeger's query API). Cached like the other Go-built
# tools (tools/go/lib.sh): a present binary is never rebuilt. Exits non-zero, naming what
# is wrong, when Go is missing or the build fails.
set -euo pipefail
# shellcheck source=tools/go/lib.sh
. "$(dirname "$0")/../tools/go/lib.sh"

tg_go_check
start=$(date +%s)
tg_build jaeger
echo "install-test-deps-jaeger: $("$(tg_tool_path jaeger)" version 2>/dev/null | head -c 200 | tr '\n' ' ') ok in $(($(date +%s) - start))s"
