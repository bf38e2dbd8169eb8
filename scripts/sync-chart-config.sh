#!/usr/bin/env bash
# Rewrite the `config:` block at the end of charts/taintgate/values.yaml from
# daemonset/config.yaml (indented under `config:`, comments kept), so the chart's default
# config is the kustomize base's. tests/tests/helm_chart.rs fails when they differ.
set -euo pipefail
cd "$(dirname "$0")/.."
values=charts/taintgate/values.yaml
tmp=$(mktemp)
sed '/^config:$/q' "$values" >"$tmp"
grep -q '^config:$' "$tmp" || { echo "sync-chart-config: no 'config:' line in $values" >&2; exit 1; }
sed 's/^\(.\)/  \1/' daemonset/config.yaml >>"$tmp"
mv "$tmp" "$values"
