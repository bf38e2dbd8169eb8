#!/usr/bin/env bash
# Prints the module cache folder of MODULE as pinned by tools module TOOL, downloading it
# first if needed; e.g. `tools/go/module-dir.sh karpenter sigs.k8s.io/karpenter` gives the
# folder whose kwok/charts/crds/ the tests install.
set -euo pipefail
# shellcheck source=tools/go/lib.sh
. "$(dirname "$0")/lib.sh"
tool=${1:?usage: module-dir.sh TOOL MODULE}
module=${2:?usage: module-dir.sh TOOL MODULE}
tg_go_check
cd "$TAINTGATE_TOOLS_DIR/$tool"
go mod download "$module"
go list -mod=readonly -m -f '{{.Dir}}' "$module"
