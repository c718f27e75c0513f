"""GPU claims hold real devices (DESIGN.md §7), on the real control plane: the operator
creates a ResourceClaim and a placeholder pod per admitted GPU claim, the real
kube-scheduler allocates the devices, and ordinary pods asking for `nvidia.com/gpu` (served
by the same devices through the DeviceClass's extended resource) cannot take them."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from reservoir.k8s.resources import envelope_label
from reservoir.sdk import ClaimView, Reservoir, workload_pod
from tests.clusters import ClusterHandle
from tests.integration.conftest import OperatorProcess
from tests.integration.helpers import (
    create_envelope,
    events_of,
    eventually,
    ledger_line,
    wait_phase,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "hack"))
from localcluster import NodeShape, gpu_node, gpu_resource_slice

GPU = "nvidia.com/gpu"
NODES = 4
PER_NODE = 8


def ordinary_gpu_pod(cluster: ClusterHandle, ns: str, name: str, gpus: int = 1) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "containers": [
                {
                    "name": "work",
                    "image": "registry.k8s.io/pause:3.10",
                    "resources": {"limits": {GPU: str(gpus)}},
                }
            ]
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))


def pod(cluster: ClusterHandle, ns: str, name: str) -> dict[str, Any]:
    return dict(json.loads(cluster.kubectl("get", "pod", name, "-n", ns, "-o", "json")))


def unschedulable(cluster: ClusterHandle, ns: str, name: str) -> str | None:
    for condition in pod(cluster, ns, name).get("status", {}).get("conditions", []):
        if condition["type"] == "PodScheduled" and condition["status"] == "False":
            return str(condition.get("message", ""))
    return None


def held(sdk: Reservoir, claim: ClaimView | str) -> ClaimView:
    view = wait_phase(sdk, claim, "Tentative")
    assert view.status.placement is not None and view.status.placement.node
    return view


def test_held_devices_are_really_held_and_come_back_once_the_allocation_is_gone(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "gpus", {GPU: str(NODES * PER_NODE)}, defaultLeaseSeconds=300)
    claims = [sdk.hold("gpus", f"b{i}", {GPU: str(PER_NODE)}, name=f"b{i}") for i in range(NODES)]
    views = [held(sdk, c) for c in claims]
    nodes = {v.status.placement.node for v in views if v.status.placement}
    assert len(nodes) == NODES  # eight devices each: one whole node per claim
    for view in views:
        assert view.status.placement is not None
        assert len(view.status.placement.devices) == PER_NODE
    assert sdk.ledger("gpus").status.totals.reserved[GPU] == NODES * PER_NODE

    # Every device is held: an ordinary pod asking for one GPU cannot schedule.
    ordinary_gpu_pod(cluster, ns, "intruder")
    message = eventually(
        "the intruder to be unschedulable", lambda: unschedulable(cluster, ns, "intruder")
    )
    assert "nodes are available" in message

    # Pruning one branch returns its budget at once and its devices once the allocation is
    # gone: then, and only then, the ordinary pod gets a GPU.
    sdk.cancel(sdk.get("b0"))
    released = wait_phase(sdk, "b0", "Released")
    freed_node = views[0].status.placement.node if views[0].status.placement else None
    eventually(
        "b0's devices confirmed free",
        lambda: (p := sdk.get("b0").status.placement) is not None and p.devices_released,
    )
    assert released.status.placement is not None
    bound = eventually(
        "the intruder to be scheduled",
        lambda: pod(cluster, ns, "intruder").get("spec", {}).get("nodeName"),
    )
    assert bound == freed_node


def test_a_claim_that_fits_no_node_waits_with_the_schedulers_reason_until_devices_free(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "gpus", {GPU: str(NODES * PER_NODE)}, defaultLeaseSeconds=300)
    blockers = [sdk.hold("gpus", f"x{i}", {GPU: "6"}, name=f"x{i}") for i in range(NODES)]
    for claim in blockers:
        held(sdk, claim)
    waiting = sdk.hold("gpus", "late", {GPU: "4"}, name="late")  # 2 free per node: no fit

    def reason() -> str | None:
        view = sdk.get(waiting)
        text = view.status.queue_reason or ""
        return text if "AwaitingDevices" in text and "nodes are available" in text else None

    text = eventually("the scheduler's reason on the waiting claim", reason)
    assert sdk.get(waiting).phase.value == "Pending"
    assert sdk.ledger("gpus").status.totals.reserved[GPU] == 24, text  # never reported as held

    sdk.cancel(sdk.get("x2"))
    view = held(sdk, waiting)
    assert view.status.placement is not None and len(view.status.placement.devices) == 4


def test_node_selector_hints_are_respected(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "gpus", {GPU: "8"}, defaultLeaseSeconds=300)
    claim = sdk.hold(
        "gpus",
        "pinned",
        {GPU: "2"},
        name="pinned",
        placement={"nodeSelector": {"kubernetes.io/hostname": "gpu-node-2"}},
    )
    view = held(sdk, claim)
    assert view.status.placement is not None and view.status.placement.node == "gpu-node-2"


def resource_claim(cluster: ClusterHandle, ns: str, uid: str) -> dict[str, Any]:
    return dict(
        json.loads(
            cluster.kubectl("get", "resourceclaim", f"reservoir-{uid}", "-n", ns, "-o", "json")
        )
    )


def test_the_devices_are_handed_to_the_workload_pod_and_freed_only_after_it_is_gone(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "gpus", {GPU: "8"}, defaultLeaseSeconds=300)
    view = held(sdk, sdk.hold("gpus", "train", {GPU: "2"}, name="train"))
    assert view.status.placement is not None
    node, devices = view.status.placement.node, view.status.placement.devices
    before = resource_claim(cluster, ns, view.uid)["status"]["allocation"]

    template = {
        "metadata": {"name": "trainer"},
        "spec": {
            "containers": [
                {
                    "name": "train",
                    "image": "registry.k8s.io/pause:3.10",
                    # asked the usual way: the helper takes the devices from the claim instead
                    "resources": {"limits": {GPU: "2"}},
                }
            ]
        },
    }
    manifest = workload_pod(view, template)
    assert manifest["spec"]["schedulingGates"] == [{"name": "reservoir.dev/hand-off"}]
    assert GPU not in manifest["spec"]["containers"][0]["resources"]["limits"]
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))

    # The hand-off is recorded (and commits the claim), then the gate goes and the pod
    # lands on the allocation's node; the placeholder goes once the pod holds the devices.
    committed = sdk.wait("train", condition="Committed", within=30)
    line = ledger_line(sdk, committed)
    assert line is not None and line.handed_off_at is not None
    bound = eventually(
        "the workload pod bound", lambda: pod(cluster, ns, "trainer")["spec"].get("nodeName")
    )
    assert bound == node
    eventually(
        "the placeholder gone",
        lambda: (
            not cluster.kubectl(
                "get", "pods", "-n", ns, "-l", "reservoir.dev/placeholder-for", "-o", "name"
            ).strip()
        ),
    )
    claim_object = resource_claim(cluster, ns, view.uid)
    assert claim_object["status"]["allocation"] == before  # the same devices, never freed
    users = [u["name"] for u in claim_object["status"]["reservedFor"]]
    assert users == ["trainer"]
    assert [r["device"] for r in before["devices"]["results"]] == devices

    # Settled: the budget comes back at once, the devices only once the pod is gone.
    sdk.finish(sdk.get("train"), {GPU: "2"})
    settled = wait_phase(sdk, "train", "Consumed")
    assert settled.status.placement is not None and not settled.status.placement.devices_released
    cluster.kubectl("delete", "pod", "trainer", "-n", ns, "--wait=false")
    eventually(
        "the devices confirmed free",
        lambda: (p := sdk.get("train").status.placement) is not None and p.devices_released,
    )


def test_a_node_lost_under_a_committed_claim_detaches_it_with_its_devices_held(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    """The node goes, the pod garbage collector removes its pods: what the branch did is
    unknown, so the claim is Detached with its GPUs held as reconciling, never Released."""
    create_envelope(cluster, ns, "gpus", {GPU: "8"}, defaultLeaseSeconds=300)
    lost = "gpu-node-3"
    view = held(
        sdk,
        sdk.hold(
            "gpus",
            "doomed",
            {GPU: "2"},
            name="doomed",
            placement={"nodeSelector": {"kubernetes.io/hostname": lost}},
        ),
    )
    # Dispatched first, its pod made after: the hand-off still happens (and runs it).
    view = sdk.dispatch(view)
    template = {
        "metadata": {"name": "worker"},
        "spec": {"containers": [{"name": "w", "image": "pause"}]},
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(workload_pod(view, template)))
    wait_phase(sdk, "doomed", "Running")
    try:
        cluster.kubectl("delete", "node", lost, "--wait=false")
        detached = wait_phase(sdk, "doomed", "Detached", within=150)
        assert ledger_line(sdk, detached) is not None
        assert sdk.ledger("gpus").status.totals.reconciling[GPU] == 2
        assert "WorkloadGone" in events_of(cluster, ns, "doomed")
    finally:
        restore_node(cluster, lost)


def restore_node(cluster: ClusterHandle, name: str) -> None:
    shape = NodeShape()
    items = [gpu_node(name, shape, zone="local-1"), gpu_resource_slice(name, shape)]
    body = {"apiVersion": "v1", "kind": "List", "items": items}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))


def test_device_attributes_pick_the_devices_and_an_absent_product_waits(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "gpus", {GPU: "8"}, defaultLeaseSeconds=300)
    product = {"deviceAttributes": {"productName": "NVIDIA-H100-80GB-HBM3"}}
    view = held(sdk, sdk.hold("gpus", "h100", {GPU: "1"}, name="h100", placement=product))
    assert view.status.placement is not None
    spec = resource_claim(cluster, ns, view.uid)["spec"]["devices"]["requests"][0]["exactly"]
    assert "NVIDIA-H100-80GB-HBM3" in spec["selectors"][0]["cel"]["expression"]

    absent = {"deviceAttributes": {"productName": "NVIDIA-B200"}}
    waiting = sdk.hold("gpus", "b200", {GPU: "1"}, name="b200", placement=absent)

    def reason() -> str | None:
        text = sdk.get(waiting).status.queue_reason or ""
        return text if "AwaitingDevices" in text and "cannot allocate" in text else None

    eventually("the scheduler's reason for a product no node has", reason)
    assert sdk.get(waiting).phase.value == "Pending"


def test_under_the_commit_policy_a_speculative_branch_holds_no_device_until_dispatched(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(
        cluster, ns, "gpus", {GPU: "16"}, defaultLeaseSeconds=300, physicalHold="Commit"
    )
    view = wait_phase(sdk, sdk.hold("gpus", "maybe", {GPU: "4"}, name="maybe"), "Tentative")
    assert view.status.placement is None  # its logical budget only
    assert not cluster.kubectl("get", "resourceclaims", "-n", ns, "-o", "name").strip()

    sdk.dispatch(view)
    placed = eventually(
        "devices held once the branch is chosen",
        lambda: (p := sdk.get("maybe").status.placement) is not None and p.node and p,
    )
    assert len(placed.devices) == 4


def test_tolerations_are_respected(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    """A tainted node takes only holds that tolerate its taint."""
    node = "gpu-node-1"
    taint = f"reservoir-test-{ns}=yes:NoSchedule"
    pinned = {"nodeSelector": {"kubernetes.io/hostname": node}}
    cluster.kubectl("taint", "node", node, taint)
    try:
        create_envelope(cluster, ns, "gpus", {GPU: "8"}, defaultLeaseSeconds=300)
        refused = sdk.hold("gpus", "plain", {GPU: "1"}, name="plain", placement=pinned)
        tolerated = {
            **pinned,
            "tolerations": [{"key": f"reservoir-test-{ns}", "operator": "Equal", "value": "yes"}],
        }
        view = held(sdk, sdk.hold("gpus", "ok", {GPU: "1"}, name="ok", placement=tolerated))
        assert view.status.placement is not None and view.status.placement.node == node

        def reason() -> str | None:
            text = sdk.get(refused).status.queue_reason or ""
            return text if "AwaitingDevices" in text and "taint" in text else None

        eventually("the untolerating hold to wait on the taint", reason)
    finally:
        cluster.kubectl("taint", "node", node, f"{taint.split(':')[0]}:NoSchedule-")


def test_under_the_commit_policy_a_chosen_branch_without_devices_says_why(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "gpus", {GPU: "8"}, defaultLeaseSeconds=300, physicalHold="Commit")
    absent = {"deviceAttributes": {"productName": "NVIDIA-B200"}}
    view = wait_phase(
        sdk, sdk.hold("gpus", "b200", {GPU: "1"}, name="b200", placement=absent), "Tentative"
    )
    sdk.dispatch(view)

    def waiting() -> str | None:
        for condition in sdk.get("b200").status.conditions:
            if condition.type == "DevicesHeld" and condition.status == "False":
                return condition.message if "cannot allocate" in condition.message else None
        return None

    eventually("DevicesHeld=False with the scheduler's reason", waiting)


# A claim name of 200 characters (a name may have 253; a label value at most 63).
LONG_NAME = ("a-claim-named-longer-than-any-label-value-" * 5)[:199] + "z"
LONG_ENVELOPE = ("an-envelope-named-longer-than-any-label-value-" * 5)[:199] + "z"


@pytest.mark.parametrize("envelope", ["gpus", LONG_ENVELOPE], ids=["envelope", "long-envelope"])
def test_a_claim_named_longer_than_a_label_value_holds_gpus_and_a_lease_end_to_end(
    cluster: ClusterHandle, ns: str, sdk: Reservoir, tmp_path: Path, envelope: str
) -> None:
    """Issue 25: the claim's placeholder, Lease and workload pod are labelled with its UID
    and carry its name in an annotation, so a claim named past 63 characters holds its
    GPUs, renews its Lease, hands its devices to its workload pod and settles; in an
    envelope named past 63 characters too (labelled by a digest of its name, the name in
    an annotation). A tenant of another namespace labelling a pod of its own with the
    claim's UID gets nothing (the operator watches every namespace here)."""
    assert len(LONG_NAME) == len(LONG_ENVELOPE) == 200
    other = f"other-{ns}"
    cluster.kubectl("create", "namespace", other)
    operator = OperatorProcess(cluster, None, tmp_path / "operator.log")
    try:
        create_envelope(cluster, ns, envelope, {GPU: "8"}, defaultLeaseSeconds=300)
        view = held(sdk, sdk.hold(envelope, "train", {GPU: "2"}, name=LONG_NAME))
        assert view.status.placement is not None
        node = view.status.placement.node
        placeholder = pod(cluster, ns, f"reservoir-hold-{view.uid}")["metadata"]
        assert placeholder["labels"]["reservoir.dev/claim"] == view.uid
        assert placeholder["annotations"]["reservoir.dev/claim-name"] == LONG_NAME
        assert placeholder["annotations"]["reservoir.dev/envelope-name"] == envelope
        assert placeholder["labels"]["reservoir.dev/envelope"] == envelope_label(envelope)

        # Its Lease: created by the first heartbeat, labelled by UID, and granted.
        renewals = view.entry.renewals if view.entry is not None else 0
        renewed = sdk.renew(view)
        assert renewed.entry is not None and renewed.entry.renewals > renewals
        lease = json.loads(cluster.kubectl("get", "lease", LONG_NAME, "-n", ns, "-o", "json"))
        assert lease["metadata"]["labels"]["reservoir.dev/claim"] == view.uid
        assert lease["metadata"]["annotations"]["reservoir.dev/claim-name"] == LONG_NAME
        assert lease["spec"]["holderIdentity"] == sdk.holder
        assert lease["metadata"]["annotations"]["reservoir.dev/envelope-name"] == envelope
        assert lease["metadata"]["labels"]["reservoir.dev/envelope"] == envelope_label(envelope)

        # A hostile tenant's pod labelled with the claim's UID, in its own namespace, behind
        # the gate (as a workload pod is made): not the claim's, never handed anything.
        template = {
            "metadata": {"name": "trainer"},
            "spec": {
                "containers": [
                    {
                        "name": "train",
                        "image": "registry.k8s.io/pause:3.10",
                        "resources": {"limits": {GPU: "2"}},
                    }
                ]
            },
        }
        decoy = workload_pod(view, {**template, "metadata": {"name": "decoy"}})
        decoy["metadata"]["namespace"] = other
        decoy["spec"].pop("resourceClaims")  # another namespace's ResourceClaim: none here
        for container in decoy["spec"]["containers"]:
            container["resources"].pop("claims")
        cluster.kubectl("apply", "-f", "-", input=json.dumps(decoy))

        manifest = workload_pod(sdk.get(LONG_NAME), template)
        assert manifest["metadata"]["labels"]["reservoir.dev/claim"] == view.uid
        cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
        committed = sdk.wait(LONG_NAME, condition="Committed", within=30)
        line = ledger_line(sdk, committed)
        assert line is not None and line.handed_off_at is not None
        bound = eventually(
            "the workload pod bound", lambda: pod(cluster, ns, "trainer")["spec"].get("nodeName")
        )
        assert bound == node
        eventually(
            "the placeholder gone",
            lambda: (
                not cluster.kubectl(
                    "get", "pods", "-n", ns, "-l", "reservoir.dev/placeholder-for", "-o", "name"
                ).strip()
            ),
        )
        users = [u["name"] for u in resource_claim(cluster, ns, view.uid)["status"]["reservedFor"]]
        assert users == ["trainer"]
        hostile = pod(cluster, other, "decoy")
        assert hostile["spec"].get("schedulingGates") == [{"name": "reservoir.dev/hand-off"}]

        sdk.finish(sdk.get(LONG_NAME), {GPU: "2"})
        settled = wait_phase(sdk, LONG_NAME, "Consumed")
        assert settled.status.placement is not None
        cluster.kubectl("delete", "pod", "trainer", "-n", ns, "--wait=false")
        eventually(
            "the devices confirmed free",
            lambda: (p := sdk.get(LONG_NAME).status.placement) is not None and p.devices_released,
        )
        assert pod(cluster, other, "decoy")["spec"].get("schedulingGates"), "still gated"
    finally:
        operator.stop()
        cluster.kubectl("delete", "namespace", other, "--wait=false")
