#!/usr/bin/env bash
# Regenerate the generated parts of docs/ from the code, so they cannot drift:
#   docs/reasons.md, between its marker comments: `taintgate reasons` (the catalogue in
#   agent/src/reasons.rs). tests/tests/docs_sync.rs fails when the file differs.
# Usage: scripts/gen-docs.sh [PATH-TO-taintgate]   (default: builds and uses target/debug)
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${1:-}"
if [[ -z "$bin" ]]; then
  cargo build -q -p taintgate --bin taintgate
  bin=target/debug/taintgate
fi
table="$("$bin" reasons)"
begin='<!-- BEGIN GENERATED: taintgate reasons -->'
end='<!-- END GENERATED: taintgate reasons -->'
out=docs/reasons.md
tmp="$(mktemp)"
trap 'rm -f "$tmp"' EXIT
{
  echo '# Reason codes'
  echo
  echo 'Every failure carries one of these stable codes: the log, the `TaintgateVerified`'
  echo 'condition, the Event, `taintgate_failures_total{reason}` and the timeline all use it.'
  echo 'The exit code is 1 (held) or 2 (bad input). Codes that need more than a line have a'
  echo 'section in [operations.md](operations.md#troubleshooting-reason-codes).'
  echo
  echo 'Generated from the catalogue (`agent/src/reasons.rs`) by `scripts/gen-docs.sh`;'
  echo 'do not edit between the markers. `taintgate reasons` prints the same table.'
  echo
  echo "$begin"
  printf '%s\n' "$table"
  echo "$end"
} >"$tmp"
mv "$tmp" "$out"
trap - EXIT
echo "wrote $out"
