#!/usr/bin/env bash
# Install every test dependency (Debian packages, a Python venv for moto) and run the whole
# test suite: format check, clippy with -D warnings, and every test in the workspace.
# Idempotent; run as root (or with sudo available) on Debian 12+.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null 2>&1; then
  echo "error: cargo not found; install the Rust toolchain (rustup, Rust >= 1.88) first" >&2
  exit 2
fi

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# Build tools used by the tests themselves (cc builds the fake libnvidia-ml.so.1, and
# cc + make build jemalloc; bsdutils' `script` gives the progress-bar test a terminal;
# GNU `time` reports the memory-bound test's peak RSS).
$SUDO apt-get install -y -qq --no-install-recommends build-essential pkg-config ca-certificates curl bsdutils time >/dev/null

# Each area's own installer (services the end-to-end tests start for real).
for s in scripts/install-test-deps-*.sh; do
  [ -f "$s" ] || continue
  echo "==> $s"
  bash "$s"
done

echo "==> cargo fmt --check"
cargo fmt --all -- --check
echo "==> cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "==> unused dependencies (cargo-machete)"
"$(bash scripts/install-test-deps-machete.sh --print-path)"
echo "==> scripts/build-image.sh (the image tests/tests/image_containerd.rs pushes and runs)"
bash scripts/build-image.sh target/image/taintgate-oci.tar
export TAINTGATE_IMAGE_ARCHIVE="$PWD/target/image/taintgate-oci.tar"
echo "==> cargo test"
cargo test --workspace --locked --no-fail-fast
