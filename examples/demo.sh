#!/usr/bin/env bash
# `make demo`: local cluster (already up), CRDs, the operator, the examples (a branching
# workflow with concurrency permits, two 8-GPU branches in an 8-GPU envelope, a provider's
# rate limit that refills, a planner with sub-agents) and their ledgers, which show each
# resource's contract: Reusable, Consumable or Replenishing.
set -euo pipefail
cd "$(dirname "$0")/.."
export KUBECONFIG="${RESERVOIR_CLUSTER_DIR:-$PWD/.cluster}/kubeconfig"
export PATH="$PWD/.venv/bin:$HOME/.cache/reservoir/bin/current:$PATH"
namespace=reservoir-demo
logs="${RESERVOIR_CLUSTER_DIR:-$PWD/.cluster}/logs"
mkdir -p "$logs"

echo "== GPU nodes (their GPUs are DRA devices: kubectl get resourceslices)"
kubectl get nodes -L nvidia.com/gpu.product -L nvidia.com/gpu.count
echo
echo "== CRDs"
kubectl apply -f crds/
kubectl wait --for=condition=Established crd/reservationenvelopes.reservoir.dev \
  crd/branchclaims.reservoir.dev crd/reservationpools.reservoir.dev --timeout=60s >/dev/null

echo
echo "== operator (logs: $logs/operator.log)"
reservoir-operator --all-namespaces --metrics-port 0 >"$logs/operator.log" 2>&1 &
operator=$!
trap 'kill $operator 2>/dev/null; wait $operator 2>/dev/null || true' EXIT

# Fresh namespaces each run (the running operator settles the old ones' claims first). The
# team's namespace draws from a tenant pool; the other is left uncapped.
team=reservoir-demo-team
for ns in "$namespace" "$team"; do
  kubectl delete namespace "$ns" --ignore-not-found --timeout=120s >/dev/null
  kubectl create namespace "$ns" >/dev/null
done

echo
echo "== the example workflow, with concurrency permits (examples/agent_workflow.py)"
python examples/agent_workflow.py --namespace "$namespace"

echo
echo "== two 8-GPU branches, one after the other, in an 8-GPU envelope (examples/gpu_branch.py)"
python examples/gpu_branch.py --namespace "$namespace"

echo
echo "== a provider's rate limit that refills (examples/provider_rate_limit.py)"
python examples/provider_rate_limit.py --namespace "$namespace"

echo
echo "== a Job-backed branch settled from the Job after its worker died (examples/job_branch.py)"
python examples/job_branch.py --namespace "$namespace"

echo
echo "== a planner with two sub-agents, drawn from a tenant pool (examples/planner_subagents.py)"
python examples/planner_subagents.py --namespace "$team"

echo
echo "== kubectl get reservoir -n $namespace"
kubectl get reservoir -n "$namespace"
echo
echo "== kubectl get renv -o wide -n $namespace (each resource's contract)"
kubectl get renv -o wide -n "$namespace"
echo
echo "== kubectl reservoir ledger research-agent -n $namespace (Consumable tokens and cost, Reusable permits)"
kubectl reservoir -n "$namespace" ledger research-agent
echo
echo "== kubectl reservoir ledger fine-tune -n $namespace (Reusable GPUs, Consumable tokens)"
kubectl reservoir -n "$namespace" ledger fine-tune
echo
echo "== kubectl reservoir ledger provider-calls -n $namespace (a Replenishing rate limit)"
kubectl reservoir -n "$namespace" ledger provider-calls
echo
echo "== kubectl reservoir ledger planner -n $team (the budget tree)"
kubectl reservoir -n "$team" ledger planner
echo
echo "== kubectl reservoir pool reservoir-demo-tenant"
kubectl reservoir pool reservoir-demo-tenant
