#!/usr/bin/env bash
# Builds the real Kubernetes control plane the tests run against, from the Go modules
# pinned under tools/go/ (one tools module per program):
#   - kube-apiserver and kubectl from k8s.io/kubernetes (the staging replaces in their
#     go.mod come from tools/go/k8s-replaces.sh);
#   - etcd from go.etcd.io/etcd/server/v3;
#   - Karpenter with its KWOK cloud provider from sigs.k8s.io/karpenter (kwok/), whose
#     module also provides the CRDs the tests install (tools/go/module-dir.sh karpenter).
# Binaries go to the cache outside the clone ($TAINTGATE_TOOLS_CACHE, default
# ~/.cache/taintgate-tools), keyed by version, go.sum hash and Go version: a present binary
# is never rebuilt. Go module and build caches stay in Go's own (outside the clone too).
# Later installers add their tools to TOOLS below, or call tg_build themselves.
# Exits non-zero, naming what is wrong, when Go is missing or too old or a build fails.
set -euo pipefail
# shellcheck source=tools/go/lib.sh
. "$(dirname "$0")/../tools/go/lib.sh"

TOOLS=(${TAINTGATE_KUBE_TOOLS:-etcd kube-apiserver kubectl karpenter kubelet kube-scheduler kube-controller-manager})

tg_go_check
echo "install-test-deps-kube: $(go env GOVERSION), cache $TAINTGATE_TOOLS_CACHE"
start=$(date +%s)
for t in "${TOOLS[@]}"; do
    tg_build "$t"
done
echo "install-test-deps-kube: ok in $(($(date +%s) - start))s"
