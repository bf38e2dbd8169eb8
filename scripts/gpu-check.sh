#!/usr/bin/env bash
# gpu-check.sh: run taintgate's real GPU checks on a machine's GPUs and print the figures.
#
# Modes:
#   gpu-check.sh bundle DIR [GPUS [PRODUCT]]
#       here, with cargo: build the release agent and the GPU test binary
#       (validators/tests/gpu_hw.rs), strip both, and put them with this script and a
#       config for the GPU host's shape (GPUS x PRODUCT, default 1 x H200) in DIR. Prints
#       the bundle's size and fails above 60 MiB. The GPU host needs only DIR: no Rust, no
#       registry, no network (the NVIDIA driver provides libnvidia-ml/libcuda; NCCL is
#       optional: TAINTGATE_NCCL_LIBRARY or libnccl.so.2 on the loader path).
#   gpu-check.sh run [CONFIG]
#       on the GPU host, from the bundle (any working directory): finds the driver's
#       library directory, records nvidia-smi's view (`-q`, NVLink status, topology),
#       runs `taintgate check --stages driver,smoke,peer-bw` (CONFIG, else the bundle's
#       gpu-check.yaml), then every `#[ignore = "needs NVIDIA GPU"]` test, then prints
#       every figure and the agent's reading next to nvidia-smi's. Everything lands in
#       DIR/results-<time>/.
#   gpu-check.sh local [CONFIG]  bundle into a temporary directory and run there.
#   gpu-check.sh table FILE      print the figure table from a saved log.
#   gpu-check.sh compare LOG CSV print the agent's GPU lines next to nvidia-smi's CSV
#                                (`--query-gpu=$SMI_FIELDS --format=csv,noheader`).
#
# The table: per GPU the NVLink version NVML reports (raw enum and decoded generation);
# per GPU the smoke time; per domain the all-reduce busbw next to its threshold; per peer
# pair the copy GB/s next to what the link gives and the fraction reached. A copy far below
# the link (a few percent) means host-staged copies; a busbw well below the copies means
# the all-reduce is timed or sized wrong. docs/gpu.md says what one GPU can and cannot show.
#
# Environment: TAINTGATE_SMOKE_BYTES (default 1 GiB per GPU), TAINTGATE_PEER_BYTES
# (default 1 GiB), TAINTGATE_DRIVER_LIB_DIR (skip the search for the driver's libraries).
# Exit status: non-zero when a build, the check or a hardware test fails.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
mode="${1:-local}"
[ $# -gt 0 ] && shift

# The most a bundle may weigh (a GPU host may be reached by a slow copy).
MAX_BUNDLE_BYTES=$((60 << 20))
# nvidia-smi fields compared with the agent's GPUCHECK gpu line, in this order.
SMI_FIELDS=index,uuid,pci.bus_id,name,memory.total,driver_version,mig.mode.current,pcie.link.gen.current,pcie.link.width.current

# The GPUCHECK lines of a log. libtest prints `test NAME ... ` and, with --nocapture, the
# test's first output on the same line, so the tag may start mid-line: keep from it on.
figures() {
  sed -n 's/.*\(GPUCHECK .*\)/\1/p' "$1"
}

table() {
  local n
  n=$(figures "$1" | wc -l)
  if [ "$n" = 0 ]; then
    echo "(no figures: the hardware tests did not run)"
    return 0
  fi
  figures "$1" | awk '
    function kv(    i, a) { delete f; for (i = 3; i <= NF; i++) { split($i, a, "="); f[a[1]] = a[2] } }
    $2 == "gpu"    { kv(); printf "gpu    %-3s %-42s pci=%s numa=%s nvlinks=%s nvlink_raw=%s nvlink_gen=%s %s\n", f["index"], f["uuid"], f["pci"], f["numa"], f["nvlinks_active"], f["nvlink_raw"], f["nvlink_gen"], f["pcie"] }
    $2 == "smoke"  { kv(); printf "smoke  gpu=%-3s %10.1f ms  (%s bytes)\n", f["index"], f["ms"], f["bytes"] }
    $2 == "domain" { print "domain " substr($0, index($0, $3)) }
    $2 == "busbw"  { kv(); printf "busbw  domain=%-3s gpus=%-3s %8s GB/s  threshold %s GB/s  (%s)\n", f["domain"], f["gpus"], f["gbps"], f["threshold"], f["skipped"] }
    $2 == "pair"   { kv(); printf "copy   domain=%-3s %2s -> %-2s %8s GB/s  link %8s GB/s  %6s of link  direct=%s %s\n", f["domain"], f["src"], f["dst"], f["gbps"], f["link_gbps"], f["of_link"], f["direct"], f["path"] }
    $2 == "verdict" || $2 == "warning" { print }
  '
}

# The agent's reading of each GPU (GPUCHECK gpu lines in LOG) next to nvidia-smi's (CSV of
# SMI_FIELDS), field by field, `same` or `DIFFERS`. Bus ids are compared in one form
# (nvidia-smi's 8-digit domain, the agent's 4), memory in MiB.
compare() {
  local log="$1" csv="$2"
  figures "$log" | awk -v csv="$csv" '
    function trim(s) { gsub(/^ +| +$/, "", s); return s }
    function bdf(s) { s = tolower(s); return substr(s, length(s) - 11) }
    function row(name, smi, ours) {
      printf "gpu %-3s %-14s nvidia-smi %-42s taintgate %-42s %s\n", idx, name, smi, ours, (smi == ours ? "same" : "DIFFERS")
    }
    BEGIN {
      while ((getline line < csv) > 0) {
        n = split(line, c, ",")
        i = trim(c[1])
        for (k = 1; k <= n; k++) smi[i, k] = trim(c[k])
        seen[i] = 1
      }
    }
    $2 == "gpu" {
      delete f
      for (k = 3; k <= NF; k++) { split($k, a, "="); f[a[1]] = a[2] }
      product = ""
      if (match($0, /product="[^"]*"/)) product = substr($0, RSTART + 9, RLENGTH - 10)
      idx = f["index"]
      if (!(idx in seen)) { printf "gpu %-3s not in nvidia-smi output\n", idx; next }
      pcie = f["pcie"]; sub(/^gen/, "", pcie); split(pcie, p, "x")
      mig = (f["mig"] == "true") ? "Enabled" : "Disabled"
      smimig = smi[idx, 7]; if (smimig == "[N/A]") smimig = "Disabled"
      mem = smi[idx, 5]; sub(/ MiB/, "", mem)
      row("uuid", smi[idx, 2], f["uuid"])
      row("pci", bdf(smi[idx, 3]), bdf(f["pci"]))
      row("product", smi[idx, 4], product)
      row("memory_mib", mem, int(f["mem"] / 1048576))
      row("driver", smi[idx, 6], f["driver"])
      row("mig", smimig, mig)
      row("pcie_gen_now", smi[idx, 8], p[1])
      row("pcie_width_now", smi[idx, 9], p[2])
    }
  '
}

bundle() {
  local dir="$1" gpus="${2:-1}" product="${3:-H200}"
  case "$gpus" in '' | *[!0-9]*) echo "gpu-check bundle: GPUS must be a number, got '$gpus'" >&2; exit 2 ;; esac
  mkdir -p "$dir"
  dir="$(cd "$dir" && pwd)"
  cd "$here/.."
  echo "== build (release): taintgate and the GPU test binary"
  cargo build --release --locked -p taintgate
  local test_bin
  test_bin=$(cargo test --release --locked -p taintgate-validators --test gpu_hw --no-run --message-format=json 2>/dev/null |
    sed -n 's/.*"executable":"\([^"]*gpu_hw[^"]*\)".*/\1/p' | tail -n 1)
  [ -n "$test_bin" ] || { echo "gpu-check: the gpu_hw test binary was not built" >&2; exit 1; }
  # Symbols and debug info go; .eh_frame stays, so panics still unwind and tests report.
  strip --strip-unneeded -o "$dir/taintgate" "${CARGO_TARGET_DIR:-target}/release/taintgate"
  strip --strip-unneeded -o "$dir/gpu_hw" "$test_bin"
  cp "$here/gpu-check.sh" "$dir/gpu-check.sh"
  cat >"$dir/gpu-check.yaml" <<EOF
# Written by gpu-check.sh bundle for a host with $gpus x $product GPU(s). Edit for another
# shape (docs/config-reference.md, gpu.*). No cluster: \`taintgate check\` is a dry run.
gpu:
  expect:
    gpu_count: $gpus
    product: "$product"
EOF
  local size
  size=$(du -sb "$dir" | cut -f1)
  echo "gpu-check: bundle $dir: $size bytes ($((size >> 20)) MiB; limit $((MAX_BUNDLE_BYTES >> 20)) MiB)"
  ls -l "$dir"
  if [ "$size" -gt "$MAX_BUNDLE_BYTES" ]; then
    echo "gpu-check: the bundle is over $((MAX_BUNDLE_BYTES >> 20)) MiB" >&2
    exit 1
  fi
  echo "gpu-check: on the GPU host: $dir/gpu-check.sh run"
}

# The directory holding the driver's libnvidia-ml.so.1 (and libcuda.so.1): the loader's
# cache first, then where distributions, NVIDIA's .run installer and the GPU operator's
# driver container put it.
driver_lib_dir() {
  if [ -n "${TAINTGATE_DRIVER_LIB_DIR:-}" ]; then
    printf '%s\n' "$TAINTGATE_DRIVER_LIB_DIR"
    return 0
  fi
  local p d
  p=$( (ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null || true) | awk '$1 == "libnvidia-ml.so.1" && /x86-64/ {print $NF; exit}')
  if [ -n "$p" ] && [ -e "$p" ]; then
    dirname "$p"
    return 0
  fi
  for d in /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib /usr/lib/x86_64-linux-gnu/nvidia/current \
    /usr/local/nvidia/lib64 /run/nvidia/driver/usr/lib/x86_64-linux-gnu /run/nvidia/driver/usr/lib64; do
    if [ -e "$d/libnvidia-ml.so.1" ]; then
      printf '%s\n' "$d"
      return 0
    fi
  done
  return 1
}

run() {
  local dir status=0
  dir="$here"
  [ -x "$dir/taintgate" ] && [ -x "$dir/gpu_hw" ] || { echo "gpu-check run: no taintgate/gpu_hw beside this script; make a bundle first" >&2; exit 2; }
  local out
  out="$dir/results-$(date -u +%Y%m%dT%H%M%SZ)"
  mkdir -p "$out"
  local config="${1:-${TAINTGATE_CHECK_CONFIG:-}}"
  [ -z "$config" ] && [ -f "$dir/gpu-check.yaml" ] && config="$dir/gpu-check.yaml"

  local libdir
  if ! libdir=$(driver_lib_dir); then
    echo "gpu-check run: no libnvidia-ml.so.1 found (ldconfig -p, the usual directories); set TAINTGATE_DRIVER_LIB_DIR" >&2
    exit 2
  fi
  echo "== driver libraries: $libdir"
  ls -l "$libdir"/libnvidia-ml.so* "$libdir"/libcuda.so* 2>/dev/null | tee "$out/driver-libs.txt" || true
  export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export TAINTGATE_NVML_LIBRARY="$libdir/libnvidia-ml.so.1"
  export TAINTGATE_CUDA_WORKER="$dir/taintgate"

  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "== nvidia-smi (saved in $out)"
    nvidia-smi -q >"$out/nvidia-smi-q.txt" 2>&1 || true
    nvidia-smi nvlink -s >"$out/nvlink-status.txt" 2>&1 || true
    nvidia-smi topo -m >"$out/topology.txt" 2>&1 || true
    nvidia-smi --query-gpu="$SMI_FIELDS" --format=csv,noheader >"$out/nvidia-smi-gpus.csv" 2>&1 || true
    cat "$out/topology.txt"
    echo "-- NVLink status"
    cat "$out/nvlink-status.txt"
  else
    echo "== nvidia-smi not found: nothing to compare the agent's reading with"
  fi

  # Each step is bounded so `run` ends within 5 minutes even on a wedged driver.
  if [ -n "$config" ]; then
    echo "== taintgate check ($config)"
    timeout --signal=KILL 150 "$dir/taintgate" check --config "$config" --stages driver,smoke,peer-bw 2>&1 |
      tee "$out/check.txt" || status=1
  else
    echo "== taintgate check skipped: no config (pass one, or TAINTGATE_CHECK_CONFIG)"
  fi
  echo "== hardware tests"
  timeout --signal=KILL 120 "$dir/gpu_hw" --ignored --nocapture --test-threads=1 2>&1 | tee "$out/hw.txt" || status=1
  echo
  echo "== figures"
  table "$out/hw.txt" | tee "$out/figures.txt"
  if [ -s "$out/nvidia-smi-gpus.csv" ]; then
    echo
    echo "== the agent's reading next to nvidia-smi's"
    compare "$out/hw.txt" "$out/nvidia-smi-gpus.csv" | tee "$out/compare.txt"
  fi
  echo
  echo "gpu-check: results in $out"
  return "$status"
}

case "$mode" in
  bundle) bundle "${1:?usage: gpu-check.sh bundle DIR [GPUS [PRODUCT]]}" "${2:-}" "${3:-}" ;;
  run) run "$@" ;;
  table) table "${1:?usage: gpu-check.sh table FILE}" ;;
  compare) compare "${1:?usage: gpu-check.sh compare LOG CSV}" "${2:?usage: gpu-check.sh compare LOG CSV}" ;;
  local)
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    bundle "$tmp"
    "$tmp/gpu-check.sh" run "$@"
    ;;
  *) echo "usage: gpu-check.sh [bundle DIR [GPUS [PRODUCT]] | run [CONFIG] | local [CONFIG] | table FILE | compare LOG CSV]" >&2; exit 2 ;;
esac
