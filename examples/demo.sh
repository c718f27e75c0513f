#!/usr/bin/env bash
# `make demo`: the local cluster's simulated GPU nodes (grows with the operator).
set -euo pipefail
cd "$(dirname "$0")/.."
export KUBECONFIG="${RESERVOIR_CLUSTER_DIR:-$PWD/.cluster}/kubeconfig"
kubectl="$HOME/.cache/reservoir/bin/current/kubectl"
"$kubectl" apply -f crds/ >/dev/null
echo "== GPU nodes"
"$kubectl" get nodes -L nvidia.com/gpu.product -L nvidia.com/gpu.count
