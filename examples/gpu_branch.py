"""A GPU branch: its devices are held on a real node, handed to its workload pod without a
window, and counted free only once the pod is gone (DESIGN.md §7).

    python examples/gpu_branch.py --namespace reservoir-demo
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

from reservoir.sdk import Reservoir, workload_pod


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--namespace", default="reservoir-demo")
    parser.add_argument("--kubectl", default="kubectl")
    args = parser.parse_args()

    envelope = {
        "apiVersion": "reservoir.dev/v1alpha1",
        "kind": "ReservationEnvelope",
        "metadata": {"name": "fine-tune", "namespace": args.namespace},
        "spec": {
            "capacity": {"nvidia.com/gpu": "8", "tokens": "50k"},
            "policy": {"defaultLeaseSeconds": 300},
        },
    }
    kubectl(args, "apply", "-f", "-", input=json.dumps(envelope))
    with Reservoir(namespace=args.namespace) as reservoir:
        say("a training branch asks for 4 GPUs: the scheduler allocates real devices")
        claim = reservoir.hold("fine-tune", "train", {"nvidia.com/gpu": "4"}, name="gpu-train")
        claim = reservoir.wait(claim, phase="Tentative")
        placement = claim.status.placement
        assert placement is not None
        devices = ", ".join(placement.devices)
        say(f"held on {placement.node}: {devices} (a placeholder pod holds them)")

        say("the branch is chosen: its workload pod references the claim's devices behind a gate")
        pod = workload_pod(
            claim,
            {
                "metadata": {"name": "trainer"},
                "spec": {"containers": [{"name": "train", "image": "registry.k8s.io/pause:3.10"}]},
            },
        )
        kubectl(args, "apply", "-f", "-", input=json.dumps(pod))
        claim = reservoir.wait(claim, condition="Committed")
        node = ""
        for _ in range(100):
            node = kubectl(args, "get", "pod", "trainer", "-o", "jsonpath={.spec.nodeName}")
            if node:
                break
            time.sleep(0.2)
        say(f"hand-off recorded, gate lifted: trainer runs on {node}, on the same devices")

        claim = reservoir.finish(reservoir.get(claim), {"nvidia.com/gpu": "4"})
        claim = reservoir.wait(claim, phase="Consumed")
        occupied = claim.status.placement and not claim.status.placement.devices_released
        say(f"settled Consumed; devices still occupied by the running pod: {bool(occupied)}")
        kubectl(args, "delete", "pod", "trainer", "--wait=false")
        claim = reservoir.wait(claim, condition="DevicesReleased")
        say("the pod is gone, the allocation with it: the devices are free again")


if __name__ == "__main__":
    main()
