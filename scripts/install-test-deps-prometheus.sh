#!/usr/bin/env bash
# Builds Prometheus and promtool v3.16.0 (github.com/prometheus/prometheus v0.316.0, one
# pinned module graph in tools/go/prometheus/) for the metrics tests
# (tests/tests/prometheus_metrics.rs: a real Prometheus scraping the agent, PromQL answers,
# `promtool check metrics`, `promtool test rules` on the chart's alert rules). Cached like
# the other Go-built tools (tools/go/lib.sh): a present binary is never rebuilt. Exits
# non-zero, naming what is wrong, when Go is missing or a build fails.
set -euo pipefail
# shellcheck source=tools/go/lib.sh
. "$(dirname "$0")/../tools/go/lib.sh"

tg_go_check
start=$(date +%s)
tg_build prometheus
tg_build promtool
echo "install-test-deps-prometheus: $("$(tg_tool_path prometheus)" --version 2>&1 | head -1); promtool ok in $(($(date +%s) - start))s"
