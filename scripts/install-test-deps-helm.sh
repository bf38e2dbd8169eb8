#!/usr/bin/env bash
# Builds helm v3 (helm.sh/helm/v3, cmd/helm) from its Go module, pinned in
# tools/go/helm/, for the chart tests (tests/tests/helm_chart.rs): `helm lint`,
# `helm template`, and install/upgrade against the real kube-apiserver the kube installer
# builds. Cached like the other Go-built tools (tools/go/lib.sh): a present binary is never
# rebuilt. Exits non-zero, naming what is wrong, when Go is missing or the build fails.
set -euo pipefail
# shellcheck source=tools/go/lib.sh
. "$(dirname "$0")/../tools/go/lib.sh"

tg_go_check
start=$(date +%s)
tg_build helm
echo "install-test-deps-helm: $("$(tg_tool_path helm)" version --short) ok in $(($(date +%s) - start))s"
