"""Two 8-GPU branches, one after the other, in an 8-GPU envelope: GPUs are Reusable, so
all 8 come back when a branch ends, while the tokens it used stay spent (README "Resource
contracts").

Each branch's devices are held on a real node, handed to its workload pod without a
window, and counted free only once the pod is gone (DESIGN.md §7). The second branch is
asked for while the first still runs: it waits for the first one's GPUs, not forever.

    python examples/gpu_branch.py --namespace reservoir-demo
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from typing import Any

from reservoir.core.ledger import render
from reservoir.sdk import ClaimView, Reservoir, workload_pod

GPU = "nvidia.com/gpu"
# Both branches ask for every GPU of the envelope, and 20k of its 50k tokens.
REQUESTS = {GPU: "8", "tokens": "20k"}
# What each reports at the end: its 8 GPUs (recorded as occupancy: a Reusable resource is
# never charged) and the 12k tokens it used (committed: a Consumable resource).
USAGE = {GPU: "8", "tokens": "12k"}


def say(message: str) -> None:
    print(f"-- {message}", flush=True)


def kubectl(args: argparse.Namespace, *words: str, input: str | None = None) -> str:
    return subprocess.run(
        [args.kubectl, "-n", args.namespace, *words],
        input=input,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def available(reservoir: Reservoir) -> str:
    return render(reservoir.ledger("fine-tune").status.totals.available)


def queue_reason(reservoir: Reservoir, claim: ClaimView, within: float = 30) -> str:
    """Why the claim waits, once the operator has said so."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        reason = reservoir.get(claim).status.queue_reason
        if reason:
            return reason
        time.sleep(0.2)
    return "no reason recorded yet"


def run_branch(args: argparse.Namespace, reservoir: Reservoir, claim: ClaimView) -> None:
    """Hand the claim's devices to a workload pod, report, settle, and let the pod go."""
    branch = claim.spec.branch
    placement = claim.status.placement
    assert placement is not None
    say(f"{branch}: held on {placement.node}: {', '.join(placement.devices)}")
    pod = workload_pod(
        claim,
        {
            "metadata": {"name": f"trainer-{branch}"},
            "spec": {"containers": [{"name": "train", "image": "registry.k8s.io/pause:3.10"}]},
        },
    )
    kubectl(args, "apply", "-f", "-", input=json.dumps(pod))
    claim = reservoir.wait(claim, condition="Committed")
    node = ""
    for _ in range(100):
        node = kubectl(args, "get", "pod", f"trainer-{branch}", "-o", "jsonpath={.spec.nodeName}")
        if node:
            break
        time.sleep(0.2)
    say(f"{branch}: hand-off recorded, gate lifted: trainer-{branch} runs on {node}")

    claim = reservoir.finish(reservoir.get(claim), USAGE)
    claim = reservoir.wait(claim, phase="Consumed")
    occupied = claim.status.placement and not claim.status.placement.devices_released
    say(
        f"{branch}: settled Consumed: tokens consumed {render(claim.status.consumed)}; "
        f"GPUs returned {claim.status.released.get(GPU)} (occupancy "
        f"{render(claim.occupancy) or 'recorded at settlement'}), still occupied by the "
        f"running pod: {bool(occupied)}; envelope available {available(reservoir)}"
    )
    kubectl(args, "delete", "pod", f"trainer-{branch}", "--wait=false")
    reservoir.wait(claim, condition="DevicesReleased")
    say(f"{branch}: the pod is gone, the allocation with it; available {available(reservoir)}")


def envelope(namespace: str) -> dict[str, Any]:
    """8 GPUs and 50k tokens: nvidia.com/gpu is Reusable and tokens Consumable by default
    (by name), so nothing is declared."""
    return {
        "apiVersion": "reservoir.dev/v1alpha1",
        "kind": "ReservationEnvelope",
        "metadata": {"name": "fine-tune", "namespace": namespace},
        "spec": {
            "capacity": {GPU: "8", "tokens": "50k"},
            "policy": {"defaultLeaseSeconds": 300},
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--namespace", default="reservoir-demo")
    parser.add_argument("--kubectl", default="kubectl")
    args = parser.parse_args()

    kubectl(args, "apply", "-f", "-", input=json.dumps(envelope(args.namespace)))
    with Reservoir(namespace=args.namespace) as reservoir:
        say("sweep-a asks for all 8 GPUs: the scheduler allocates real devices")
        first = reservoir.hold("fine-tune", "sweep-a", REQUESTS, name="gpu-sweep-a")
        first = reservoir.wait(first, phase="Tentative")

        say("sweep-b asks for 8 GPUs too, while sweep-a holds them: it waits")
        second = reservoir.hold("fine-tune", "sweep-b", REQUESTS, name="gpu-sweep-b")
        say(f"sweep-b: Pending ({queue_reason(reservoir, second)})")

        run_branch(args, reservoir, first)
        second = reservoir.wait(second, phase="Tentative", within=120)
        say("sweep-b: admitted on the 8 GPUs sweep-a gave back")
        run_branch(args, reservoir, second)
        say(
            f"two 8-GPU branches ran in an 8-GPU envelope; available {available(reservoir)} "
            "(tokens: 50k − 2 × 12k)"
        )


if __name__ == "__main__":
    main()
