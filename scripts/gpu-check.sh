#!/usr/bin/env bash
# gpu-check.sh: run taintgate's real GPU checks on a machine's GPUs and print the figures.
#
# Modes:
#   gpu-check.sh bundle DIR   here, with cargo: build the release agent and the GPU test
#                             binary (validators/tests/gpu_hw.rs) and put them, with this
#                             script, in DIR. A GPU machine that reaches no registry needs
#                             only DIR (the NVIDIA driver provides libnvidia-ml/libcuda;
#                             NCCL is optional: TAINTGATE_NCCL_LIBRARY or libnccl.so.2).
#   gpu-check.sh run [CONFIG] on the GPU machine, from inside DIR: run `taintgate check
#                             --stages driver,smoke,peer-bw` (with CONFIG when given), then
#                             every `#[ignore = "needs NVIDIA GPU"]` test, then the table.
#   gpu-check.sh local [CONFIG]  bundle into a temporary directory and run there (default).
#   gpu-check.sh table FILE   print the table from a saved log of GPUCHECK lines.
#
# The table: per GPU the NVLink version NVML reports (raw enum and decoded generation) and
# the smoke time; per domain the all-reduce busbw next to its threshold; per peer pair the
# copy GB/s next to what the link gives (links x per-link rate, or the PCIe rate) and the
# fraction reached. A copy far below the link (a few percent) means host-staged copies;
# a busbw well below the copies means the all-reduce is timed or sized wrong. See
# docs/gpu.md for how these figures compare with nccl-tests and nvbandwidth.
#
# Environment: TAINTGATE_SMOKE_BYTES (default 1 GiB per GPU), TAINTGATE_PEER_BYTES
# (default 1 GiB). Exit status: non-zero when a build, the check or a hardware test fails.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
mode="${1:-local}"
[ $# -gt 0 ] && shift

table() {
  grep '^GPUCHECK' "$1" | awk '
    function kv(    i, a) { delete f; for (i = 3; i <= NF; i++) { split($i, a, "="); f[a[1]] = a[2] } }
    $2 == "gpu"    { kv(); printf "gpu    %-3s %-42s pci=%s numa=%s nvlinks=%s nvlink_raw=%s nvlink_gen=%s %s\n", f["index"], f["uuid"], f["pci"], f["numa"], f["nvlinks_active"], f["nvlink_raw"], f["nvlink_gen"], f["pcie"] }
    $2 == "smoke"  { kv(); printf "smoke  gpu=%-3s %10.1f ms  (%s bytes)\n", f["index"], f["ms"], f["bytes"] }
    $2 == "domain" { print "domain " substr($0, index($0, $3)) }
    $2 == "busbw"  { kv(); printf "busbw  domain=%-3s gpus=%-3s %8s GB/s  threshold %s GB/s  (%s)\n", f["domain"], f["gpus"], f["gbps"], f["threshold"], f["skipped"] }
    $2 == "pair"   { kv(); printf "copy   domain=%-3s %2s -> %-2s %8s GB/s  link %8s GB/s  %6s of link\n", f["domain"], f["src"], f["dst"], f["gbps"], f["link_gbps"], f["of_link"] }
    $2 == "verdict" || $2 == "warning" { print }
  ' || echo "(no figures: the hardware tests did not run)"
}

bundle() {
  local dir="$1"
  mkdir -p "$dir"
  cd "$here/.."
  echo "== build (release): taintgate and the GPU test binary"
  cargo build --release -p taintgate
  local test_bin
  test_bin=$(cargo test --release -p taintgate-validators --test gpu_hw --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu_hw":
        print(m["executable"])')
  [ -n "$test_bin" ] || { echo "gpu-check: the gpu_hw test binary was not built" >&2; exit 1; }
  cp target/release/taintgate "$dir/taintgate"
  cp "$test_bin" "$dir/gpu_hw"
  cp "$here/gpu-check.sh" "$dir/gpu-check.sh"
  [ -f examples/gpu-check.yaml ] && cp examples/gpu-check.yaml "$dir/"
  echo "gpu-check: bundle in $dir ($(du -sh "$dir" | cut -f1)); on the GPU machine: cd DIR && ./gpu-check.sh run"
}

run() {
  local dir status=0
  dir="$(pwd)"
  [ -x "$dir/taintgate" ] && [ -x "$dir/gpu_hw" ] || { echo "gpu-check run: no taintgate/gpu_hw here; make a bundle first" >&2; exit 2; }
  local out
  out="$(mktemp -d)"
  local config="${1:-${TAINTGATE_CHECK_CONFIG:-}}"
  [ -z "$config" ] && [ -f "$dir/gpu-check.yaml" ] && config="$dir/gpu-check.yaml"
  export TAINTGATE_CUDA_WORKER="$dir/taintgate"
  if [ -n "$config" ]; then
    echo "== taintgate check ($config)"
    "$dir/taintgate" check --config "$config" --stages driver,smoke,peer-bw | tee "$out/check.txt" || status=1
  else
    echo "== taintgate check skipped: no config (pass one, or TAINTGATE_CHECK_CONFIG)"
  fi
  echo "== hardware tests"
  "$dir/gpu_hw" --ignored --nocapture --test-threads=1 2>&1 | tee "$out/hw.txt" || status=1
  echo
  echo "== figures"
  table "$out/hw.txt"
  cp "$out/hw.txt" "$dir/gpucheck.log" 2>/dev/null || true
  return "$status"
}

case "$mode" in
  bundle) bundle "${1:?usage: gpu-check.sh bundle DIR}" ;;
  run) run "$@" ;;
  table) table "${1:?usage: gpu-check.sh table FILE}" ;;
  local)
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    bundle "$tmp"
    (cd "$tmp" && ./gpu-check.sh run "$@")
    ;;
  *) echo "usage: gpu-check.sh [bundle DIR | run [CONFIG] | local [CONFIG] | table FILE]" >&2; exit 2 ;;
esac
