#!/usr/bin/env bash
# gpu-check.sh: run taintgate's real GPU checks on this machine's GPUs and print the figures.
#
# What it does (dry-run, no cluster is touched):
#   1. builds the agent in release mode;
#   2. runs `taintgate check --config FILE --stages driver,smoke,peer-bw` with the real
#      NVML/CUDA backend (FILE: $1, else $TAINTGATE_CHECK_CONFIG, else examples/gpu-check.yaml
#      when it exists; skipped with a note when none is found);
#   3. runs the hardware tests (`validators/tests/gpu_hw.rs`, ignored by default) and
#      collects their GPUCHECK lines;
#   4. prints a table: per-GPU smoke time, per-domain all-reduce busbw, per-pair copy GB/s.
#
# Needs: an NVIDIA GPU with its driver (libnvidia-ml.so.1, libcuda.so.1), optionally NCCL
# (libnccl.so.2) for the all-reduce. No CUDA toolkit: the smoke kernel is embedded PTX.
# Environment: TAINTGATE_SMOKE_BYTES (default 1 GiB per GPU).
# Exit status: non-zero when the build, the check or a hardware test fails.
set -euo pipefail

cd "$(dirname "$0")/.."
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
status=0

echo "== build (release)"
cargo build --release -p taintgate

config="${1:-${TAINTGATE_CHECK_CONFIG:-}}"
if [[ -z "$config" && -f examples/gpu-check.yaml ]]; then
  config=examples/gpu-check.yaml
fi
if [[ -n "$config" ]]; then
  echo "== taintgate check ($config)"
  if ! target/release/taintgate check --config "$config" --stages driver,smoke,peer-bw | tee "$out/check.txt"; then
    echo "taintgate check failed (see above)"
    status=1
  fi
else
  echo "== taintgate check skipped: no config (pass one as \$1 or TAINTGATE_CHECK_CONFIG)"
fi

echo "== hardware tests"
if ! cargo test --release -p taintgate-validators --test gpu_hw -- --ignored --nocapture --test-threads=1 2>&1 | tee "$out/hw.txt"; then
  status=1
fi

echo
echo "== figures"
grep '^GPUCHECK' "$out/hw.txt" | awk '
  $2 == "gpu"    { for (i = 3; i <= NF; i++) { split($i, kv, "="); g[kv[1]] = kv[2] }
                   printf "gpu   %-3s %-42s pci=%s numa=%s nvlinks=%s %s\n", g["index"], g["uuid"], g["pci"], g["numa"], g["nvlinks_active"], g["pcie"] }
  $2 == "smoke"  { for (i = 3; i <= NF; i++) { split($i, kv, "="); s[kv[1]] = kv[2] }
                   printf "smoke gpu=%-3s %10.1f ms  (%s bytes)\n", s["index"], s["ms"], s["bytes"] }
  $2 == "domain" { print "domain " substr($0, index($0, $3)) }
  $2 == "busbw"  { for (i = 3; i <= NF; i++) { split($i, kv, "="); b[kv[1]] = kv[2] }
                   printf "busbw domain=%-3s gpus=%-3s %s GB/s\n", b["domain"], b["gpus"], b["gbps"] }
  $2 == "pair"   { for (i = 3; i <= NF; i++) { split($i, kv, "="); p[kv[1]] = kv[2] }
                   printf "copy  domain=%-3s %2s -> %-2s %8s GB/s\n", p["domain"], p["src"], p["dst"], p["gbps"] }
  $2 == "verdict" || $2 == "warning" { print }
' || echo "(no figures: the hardware tests did not run)"
exit "$status"
