#!/usr/bin/env bash
# Prints the cached binary of a Go-built test component for this checkout, e.g.
#   tools/go/tool-path.sh kube-apiserver
# Exits 1 (with a message naming the installer) when it has not been built yet.
set -euo pipefail
# shellcheck source=tools/go/lib.sh
. "$(dirname "$0")/lib.sh"
tool=${1:?usage: tool-path.sh TOOL}
tg_go_check
p=$(tg_tool_path "$tool")
if [ ! -x "$p" ]; then
    echo "error: $tool is not built ($p missing); run scripts/install-test-deps-kube.sh" >&2
    exit 1
fi
echo "$p"
