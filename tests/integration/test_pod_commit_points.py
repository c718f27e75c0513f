"""Commit points PodScheduled and PodRunning: the workload pod's own state commits the claim,
through the real kube-scheduler and KWOK's simulated GPU nodes."""

from __future__ import annotations

import json
import time

from reservoir.sdk import Reservoir
from reservoir.sdk import workload_pod as sdk_workload_pod
from tests.clusters import ClusterHandle
from tests.integration.conftest import OperatorProcess
from tests.integration.helpers import create_envelope, ledger_line, settled_ledger, wait_phase


def workload_pod(ns: str, name: str, claim: str, node: str | None = None) -> str:
    spec: dict[str, object] = {
        "containers": [
            {"name": "main", "image": "pause", "resources": {"limits": {"nvidia.com/gpu": 1}}}
        ]
    }
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": {"reservoir.dev/claim": claim}},
            "spec": spec,
        }
    )


def test_a_pod_binding_commits_and_its_start_runs_the_claim(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "gpus", {"nvidia.com/gpu": "4"}, defaultLeaseSeconds=120)
    on_bind = sdk.hold(
        "gpus", "train", {"nvidia.com/gpu": "1"}, name="train", commit_point="PodScheduled"
    )
    on_start = sdk.hold(
        "gpus", "serve", {"nvidia.com/gpu": "1"}, name="serve", commit_point="PodRunning"
    )
    wait_phase(sdk, on_bind, "Tentative")
    wait_phase(sdk, on_start, "Tentative")

    # A pod that cannot be scheduled (no such node) does not commit a PodScheduled claim.
    cluster.kubectl("apply", "-f", "-", input=workload_pod(ns, "stuck", "train", "no-such-node"))
    cluster.kubectl(
        "wait", "-n", ns, "--for=condition=PodScheduled=false", "pod/stuck", "--timeout=30s"
    )
    assert sdk.get(on_bind).phase == "Tentative"
    cluster.kubectl("delete", "pod", "stuck", "-n", ns, "--wait=false")

    cluster.kubectl("apply", "-f", "-", input=workload_pod(ns, "train-pod", "train"))
    cluster.kubectl("apply", "-f", "-", input=workload_pod(ns, "serve-pod", "serve"))
    # KWOK binds and starts both pods: each claim commits at its own commit point.
    committed = sdk.wait(on_bind, condition="Committed", within=30)
    assert committed.phase in ("Committed", "Running")
    wait_phase(sdk, on_start, "Running")
    sdk.finish(sdk.get(on_start), {"nvidia.com/gpu": "1"})
    wait_phase(sdk, on_start, "Consumed")


def gated(cluster: ClusterHandle, ns: str, pod: str) -> bool:
    found = json.loads(cluster.kubectl("get", "pod", pod, "-n", ns, "-o", "json"))
    gates = [g["name"] for g in found["spec"].get("schedulingGates") or []]
    return gates == ["reservoir.dev/hand-off"] and not found["spec"].get("nodeName")


PAUSE = {"metadata": {}, "spec": {"containers": [{"name": "main", "image": "pause"}]}}


def test_a_pod_without_devices_waits_behind_the_gate_until_its_claim_holds_capacity(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    """Issue 24: the pod of a claim without GPUs is gated too; it runs only once its claim
    holds capacity and the hand-off is recorded, and never for a cancelled claim."""
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=120)
    big = wait_phase(sdk, sdk.hold("wf", "big", {"tokens": "100"}, name="big"), "Tentative")
    job = sdk.hold("wf", "job", {"tokens": "40"}, name="job", commit_point="PodRunning")
    pruned = sdk.hold("wf", "pruned", {"tokens": "40"}, name="pruned", commit_point="PodRunning")
    for claim, pod in ((job, "job-pod"), (pruned, "pruned-pod")):
        manifest = sdk_workload_pod(sdk.get(claim), {**PAUSE, "metadata": {"name": pod}})
        cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    time.sleep(3)  # a pass or two: the claims wait, and so do their pods
    assert sdk.get(job).phase == "Pending" and gated(cluster, ns, "job-pod")

    sdk.cancel(sdk.get(pruned))
    wait_phase(sdk, pruned, "Released")
    sdk.cancel(sdk.get(big))  # room for both: only the live claim's pod goes
    running = wait_phase(sdk, job, "Running")
    line = ledger_line(sdk, running)
    assert line is not None and line.handed_off_to, "the hand-off is on the record"
    time.sleep(3)
    assert gated(cluster, ns, "pruned-pod"), "a cancelled claim's pod never starts"
    sdk.finish(sdk.get(job), {"tokens": "30"})
    settled_ledger(sdk, "wf", committed="30", available="70", reserved="0")
