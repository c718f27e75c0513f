"""Commit points PodScheduled and PodRunning: the workload pod's own state commits the claim,
through the real kube-scheduler and KWOK's simulated GPU nodes."""

from __future__ import annotations

import json

from reservoir.sdk import Reservoir
from tests.clusters import ClusterHandle
from tests.integration.conftest import OperatorProcess
from tests.integration.helpers import create_envelope, wait_phase


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
