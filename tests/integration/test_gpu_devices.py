"""GPUs as Dynamic Resource Allocation devices, on the real control plane, with raw objects.

No operator is involved: these tests prove the mechanism the operator relies on (DESIGN.md
§7). The local cluster publishes each KWOK GPU node's GPUs as a ResourceSlice of the driver
`gpu.reservoir.dev`, and a DeviceClass of the same name serves `nvidia.com/gpu` (KEP-5004).
A ResourceClaim plus a placeholder pod holds devices; a gated workload pod referencing the
same claim takes them over with no moment at which they are free.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.clusters import ClusterHandle
from tests.integration.helpers import eventually

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "hack"))

from localcluster import (  # noqa: E402
    GPU_DEVICE_CLASS,
    GPU_DRIVER,
    LocalCluster,
    NodeShape,
    gpu_node,
    gpu_resource_slice,
)

GATE = "reservoir.dev/hand-off"
GPUS_PER_NODE = NodeShape().gpus
OTHER_PRODUCT = "NVIDIA-A100-SXM4-80GB"


# --- objects ---------------------------------------------------------------------------


def resource_claim(name: str, count: int, cel: str | None = None) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": GPU_DEVICE_CLASS, "count": count}
    if cel:
        exactly["selectors"] = [{"cel": {"expression": cel}}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }


def claim_pod(
    name: str,
    claim: str,
    gated: bool = False,
    node_selector: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A pod that uses ResourceClaim `claim`: a placeholder, or (gated) a workload pod."""
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": 0,
        "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
        "containers": [
            {
                "name": "main",
                "image": "registry.k8s.io/pause:3.10",
                "resources": {"requests": {"cpu": "1m"}, "claims": [{"name": "gpu"}]},
            }
        ],
    }
    if gated:
        spec["schedulingGates"] = [{"name": GATE}]
    if node_selector:
        spec["nodeSelector"] = node_selector
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def gpu_pod(name: str, gpus: int) -> dict[str, Any]:
    """An ordinary pod asking for `nvidia.com/gpu`, as with a device plugin."""
    limits = {"nvidia.com/gpu": gpus}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "main", "image": "pause", "resources": {"limits": limits}}],
        },
    }


def product_is(product: str) -> str:
    return f'device.attributes["{GPU_DRIVER}"].productName == "{product}"'


# --- access ----------------------------------------------------------------------------


def create(cluster: ClusterHandle, ns: str, *objects: dict[str, Any]) -> None:
    body = {"apiVersion": "v1", "kind": "List", "items": list(objects)}
    cluster.kubectl("create", "-n", ns, "-f", "-", input=json.dumps(body))


def get(cluster: ClusterHandle, kind: str, name: str, ns: str | None = None) -> dict[str, Any]:
    scope = ["-n", ns] if ns else []
    return json.loads(cluster.kubectl("get", kind, name, *scope, "-o", "json"))  # type: ignore[no-any-return]


def items(cluster: ClusterHandle, kind: str, *args: str) -> list[dict[str, Any]]:
    return json.loads(cluster.kubectl("get", kind, *args, "-o", "json"))["items"]  # type: ignore[no-any-return]


def exists(cluster: ClusterHandle, kind: str, name: str, ns: str) -> bool:
    return bool(cluster.kubectl("get", kind, name, "-n", ns, "--ignore-not-found", "-o", "name"))


def delete(cluster: ClusterHandle, ns: str, *names: str) -> None:
    cluster.kubectl("delete", "-n", ns, "--wait=false", *names)


def node_of(cluster: ClusterHandle, ns: str, pod: str) -> str | None:
    return get(cluster, "pod", pod, ns)["spec"].get("nodeName")  # type: ignore[no-any-return]


def scheduled(cluster: ClusterHandle, ns: str, pod: str) -> dict[str, Any]:
    """The pod's PodScheduled condition ({} before the scheduler has looked at it)."""
    conditions = get(cluster, "pod", pod, ns)["status"].get("conditions", [])
    return next((c for c in conditions if c["type"] == "PodScheduled"), {})


def unschedulable(cluster: ClusterHandle, ns: str, pod: str) -> dict[str, Any] | None:
    condition = scheduled(cluster, ns, pod)
    if condition.get("status") == "False" and condition.get("reason") == "Unschedulable":
        return condition
    return None


def allocation(cluster: ClusterHandle, ns: str, claim: str) -> dict[str, Any] | None:
    return get(cluster, "resourceclaim", claim, ns).get("status", {}).get("allocation")  # type: ignore[no-any-return]


def reserved_for(cluster: ClusterHandle, ns: str, claim: str) -> list[str]:
    status = get(cluster, "resourceclaim", claim, ns).get("status", {})
    return sorted(ref["name"] for ref in status.get("reservedFor", []))


def allocated_node(alloc: dict[str, Any]) -> str:
    """The one node an allocation of node-local devices pins its pods to."""
    (term,) = alloc["nodeSelector"]["nodeSelectorTerms"]
    (field,) = term["matchFields"]
    assert (field["key"], field["operator"]) == ("metadata.name", "In"), field
    (node,) = field["values"]
    return node  # type: ignore[no-any-return]


def devices(alloc: dict[str, Any]) -> list[tuple[str, str, str]]:
    return sorted((r["driver"], r["pool"], r["device"]) for r in alloc["devices"]["results"])


def held(cluster: ClusterHandle, ns: str, claim: str, pod: str) -> dict[str, Any]:
    """Wait until `claim` is allocated and `pod` is bound to its node and reserves it."""

    def ready() -> dict[str, Any] | None:
        alloc = allocation(cluster, ns, claim)
        if alloc and pod in reserved_for(cluster, ns, claim) and node_of(cluster, ns, pod):
            return alloc
        return None

    alloc = eventually(f"{claim} allocated and reserved for a bound {pod}", ready)
    assert node_of(cluster, ns, pod) == allocated_node(alloc)
    return alloc


def gpu_nodes(cluster: ClusterHandle) -> list[dict[str, Any]]:
    return items(cluster, "nodes", "-l", "nvidia.com/gpu.present=true")


def gpu_slices(cluster: ClusterHandle) -> list[dict[str, Any]]:
    return [s for s in items(cluster, "resourceslices") if s["spec"]["driver"] == GPU_DRIVER]


class ClaimWatch:
    """Every version of one ResourceClaim, as a watch delivers them (no polling gaps)."""

    def __init__(self, cluster: ClusterHandle, ns: str, claim: str) -> None:
        built = Path.home() / ".cache" / "reservoir" / "bin" / "current" / "kubectl"
        kubectl = str(built) if built.exists() else shutil.which("kubectl") or "kubectl"
        self.states: list[dict[str, Any]] = []  # status of each version, in watch order
        self._process = subprocess.Popen(
            [
                kubectl, "--kubeconfig", str(cluster.kubeconfig_path), "get", "resourceclaim",
                claim, "-n", ns, "--watch", "--output-watch-events", "-o", "json",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        decoder, buffer = json.JSONDecoder(), ""
        for line in self._process.stdout:
            buffer += line
            try:
                event, end = decoder.raw_decode(buffer.lstrip())
            except json.JSONDecodeError:
                continue
            buffer = buffer.lstrip()[end:]
            self.states.append(event["object"].get("status", {}))

    def seen(self, reserved: list[str]) -> int | None:
        """Index of the first version whose reservedFor is exactly `reserved`."""
        for index, status in enumerate(list(self.states)):
            if sorted(r["name"] for r in status.get("reservedFor", [])) == reserved:
                return index
        return None

    def stop(self) -> None:
        self._process.terminate()
        self._process.wait(timeout=10)
        self._reader.join(timeout=10)


@pytest.fixture
def pods_ns(cluster: ClusterHandle, ns: str) -> Iterator[str]:
    """`ns`, once pods can be created in it (the controller manager made `default`)."""
    eventually(
        "the namespace's default ServiceAccount",
        lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", ns, "--ignore-not-found"),
    )
    yield ns
    # Free the devices now, not whenever the namespace is finally gone: the next test may
    # count on every GPU being free.
    cluster.kubectl("delete", "pods,resourceclaims", "--all", "-n", ns, "--wait=true")


# --- the devices -----------------------------------------------------------------------


def test_every_gpu_node_publishes_its_gpus_as_dra_devices(cluster: ClusterHandle) -> None:
    nodes = gpu_nodes(cluster)
    assert len(nodes) >= 4
    slices = gpu_slices(cluster)
    for node in nodes:
        name, labels = node["metadata"]["name"], node["metadata"]["labels"]
        for part in ("capacity", "allocatable"):
            assert "nvidia.com/gpu" not in node["status"][part], (name, part)
        (mine,) = [s["spec"] for s in slices if s["spec"].get("nodeName") == name]
        assert mine["pool"] == {"name": name, "generation": 1, "resourceSliceCount": 1}
        assert [d["name"] for d in mine["devices"]] == [f"gpu-{i}" for i in range(8)]
        for index, device in enumerate(mine["devices"]):
            assert device["attributes"] == {
                "productName": {"string": labels["nvidia.com/gpu.product"]},
                "index": {"int": index},
            }
            assert device["capacity"] == {
                "memory": {"value": f"{labels['nvidia.com/gpu.memory']}Mi"}
            }
    assert len(slices) == len(nodes)

    device_class = get(cluster, "deviceclass", GPU_DEVICE_CLASS)["spec"]
    assert device_class["extendedResourceName"] == "nvidia.com/gpu"
    assert device_class["selectors"] == [
        {"cel": {"expression": f'device.driver == "{GPU_DRIVER}"'}}
    ]


def test_an_ordinary_gpu_pod_draws_from_the_dra_devices(
    cluster: ClusterHandle, pods_ns: str
) -> None:
    ns = pods_ns
    create(cluster, ns, gpu_pod("plain", 2))
    node = eventually("the nvidia.com/gpu pod to be bound", lambda: node_of(cluster, ns, "plain"))

    # The scheduler made a claim for the pod's extended resource and allocated it.
    status = eventually(
        "the pod's extendedResourceClaimStatus",
        lambda: get(cluster, "pod", "plain", ns)["status"].get("extendedResourceClaimStatus"),
    )
    assert status["requestMappings"] == [
        {
            "containerName": "main",
            "requestName": "container-0-request-0",
            "resourceName": "nvidia.com/gpu",
        }
    ]
    name = status["resourceClaimName"]
    assert name.startswith("plain-extended-resources-")
    claim = get(cluster, "resourceclaim", name, ns)
    assert claim["metadata"]["annotations"] == {
        "resource.kubernetes.io/extended-resource-claim": "true"
    }
    (owner,) = claim["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner.get("controller")) == ("Pod", "plain", True)
    assert claim["spec"]["devices"]["requests"] == [
        {
            "name": "container-0-request-0",
            "exactly": {
                "deviceClassName": GPU_DEVICE_CLASS,
                "allocationMode": "ExactCount",
                "count": 2,
            },
        }
    ]
    alloc = claim["status"]["allocation"]
    assert allocated_node(alloc) == node
    assert [(d, p) for d, p, _ in devices(alloc)] == [(GPU_DRIVER, node)] * 2
    assert [r["name"] for r in claim["status"]["reservedFor"]] == ["plain"]

    # Owned by the pod: it goes with it.
    delete(cluster, ns, "pod/plain")
    eventually(
        "the generated claim to go with its pod",
        lambda: not exists(cluster, "resourceclaim", name, ns),
    )


# --- hold and hand-off -----------------------------------------------------------------


def test_a_claim_is_handed_from_placeholder_to_workload_without_a_window(
    cluster: ClusterHandle, pods_ns: str
) -> None:
    ns = pods_ns
    h100 = product_is(NodeShape().gpu_product)
    create(cluster, ns, resource_claim("hold", 2, cel=h100))
    watch = ClaimWatch(cluster, ns, "hold")
    eventually("the claim's first version on the watch", lambda: watch.states)
    create(cluster, ns, claim_pod("placeholder", "hold"))
    alloc = held(cluster, ns, "hold", "placeholder")
    node = allocated_node(alloc)
    assert reserved_for(cluster, ns, "hold") == ["placeholder"]
    assert [(d, p) for d, p, _ in devices(alloc)] == [(GPU_DRIVER, node)] * 2

    # The workload pod references the same claim, gated: it waits and reserves nothing.
    create(cluster, ns, claim_pod("workload", "hold", gated=True))
    eventually(
        "the workload pod to be SchedulingGated",
        lambda: scheduled(cluster, ns, "workload").get("reason") == "SchedulingGated",
    )
    time.sleep(1)  # give a (wrong) scheduler time to act
    assert node_of(cluster, ns, "workload") is None
    assert reserved_for(cluster, ns, "hold") == ["placeholder"]

    # Lifting the gate: the workload lands on the allocation's node, next to the placeholder.
    cluster.kubectl(
        "patch", "pod", "workload", "-n", ns, "--type=json",
        "-p", json.dumps([{"op": "replace", "path": "/spec/schedulingGates", "value": []}]),
    )  # fmt: skip
    eventually("the workload pod bound", lambda: node_of(cluster, ns, "workload"))
    assert node_of(cluster, ns, "workload") == node
    eventually(
        "both pods in reservedFor",
        lambda: reserved_for(cluster, ns, "hold") == ["placeholder", "workload"],
    )
    assert allocation(cluster, ns, "hold") == alloc

    # The placeholder goes; the allocation stays, reserved for the workload alone.
    delete(cluster, ns, "pod/placeholder")
    eventually(
        "reservedFor to be the workload alone",
        lambda: reserved_for(cluster, ns, "hold") == ["workload"],
    )
    assert not exists(cluster, "pod", "placeholder", ns)
    assert allocation(cluster, ns, "hold") == alloc
    handed_over = eventually(
        "the watch to see the workload alone", lambda: watch.seen(["workload"])
    )

    # The workload goes: kube-controller-manager clears reservedFor and deallocates.
    delete(cluster, ns, "pod/workload")
    started = time.monotonic()
    eventually(
        "the claim to be deallocated",
        lambda: allocation(cluster, ns, "hold") is None,
        every=0.05,
    )
    took = time.monotonic() - started
    assert reserved_for(cluster, ns, "hold") == []
    print(f"deallocated {took:.2f}s after the workload pod's delete request")

    # Every version the API server had, from the first allocation to the hand-over: the same
    # allocation, never reserved for nobody; then it stays until it is gone, for good.
    eventually(
        "the watch to see the deallocation", lambda: watch.states[-1].get("allocation") is None
    )
    watch.stop()
    states = watch.states
    first = next(i for i, s in enumerate(states) if s.get("allocation"))
    for status in states[first : handed_over + 1]:
        assert status["allocation"] == alloc
        assert status.get("reservedFor"), states
    last = max(i for i, s in enumerate(states) if s.get("allocation"))
    assert all(s["allocation"] == alloc for s in states[first : last + 1])
    assert not any(s.get("allocation") for s in states[last + 1 :])
    print("claim versions: " + " -> ".join(
        f"{'allocated' if s.get('allocation') else 'free'}"
        f"{sorted(r['name'] for r in s.get('reservedFor', []))}"
        for s in states
    ))  # fmt: skip


def test_held_devices_are_not_given_to_gpu_pods(cluster: ClusterHandle, pods_ns: str) -> None:
    ns = pods_ns
    nodes = sorted(n["metadata"]["name"] for n in gpu_nodes(cluster))
    holds = [f"hold-{i}" for i in range(len(nodes))]
    for hold in holds:
        create(cluster, ns, resource_claim(hold, GPUS_PER_NODE), claim_pod(hold, hold))
    placed = {
        allocated_node(held(cluster, ns, hold, hold)): hold for hold in holds
    }  # one whole node per hold
    assert sorted(placed) == nodes

    create(cluster, ns, gpu_pod("greedy", 1))
    condition = eventually(
        "the nvidia.com/gpu pod to be Unschedulable", lambda: unschedulable(cluster, ns, "greedy")
    )
    print(f"scheduler: {condition['message']!r}")
    assert f"{len(nodes)} cannot allocate all claims" in condition["message"]
    time.sleep(1)
    assert node_of(cluster, ns, "greedy") is None

    # Settling one hold frees its node, and only then does the GPU pod get a device.
    freed = nodes[1]
    delete(cluster, ns, f"pod/{placed[freed]}", f"resourceclaim/{placed[freed]}")
    eventually("the GPU pod to be bound", lambda: node_of(cluster, ns, "greedy"), timeout=60)
    assert node_of(cluster, ns, "greedy") == freed


def test_an_unsatisfiable_claim_leaves_its_placeholder_pending_with_the_reason(
    cluster: ClusterHandle, pods_ns: str
) -> None:
    ns = pods_ns
    create(cluster, ns, resource_claim("too-many", 9), claim_pod("placeholder", "too-many"))
    condition = eventually(
        "the placeholder to be Unschedulable", lambda: unschedulable(cluster, ns, "placeholder")
    )
    print(f"scheduler: {condition['message']!r}")
    nodes = len(gpu_nodes(cluster))
    assert condition["message"].startswith(f"0/{nodes} nodes are available:")
    assert f"{nodes} cannot allocate all claims" in condition["message"]
    assert get(cluster, "pod", "placeholder", ns)["status"]["phase"] == "Pending"
    assert node_of(cluster, ns, "placeholder") is None
    assert allocation(cluster, ns, "too-many") is None


# --- placement -------------------------------------------------------------------------


@pytest.fixture
def other_product_node(cluster: ClusterHandle, pods_ns: str) -> Iterator[str]:
    """One more KWOK GPU node, of another product, with its ResourceSlice, for this test."""
    name = f"gpu-node-a100-{uuid.uuid4().hex[:6]}"
    shape = NodeShape(gpu_product=OTHER_PRODUCT, gpu_memory_mib=81920)
    body = {"apiVersion": "v1", "kind": "List"}
    body["items"] = [gpu_node(name, shape), gpu_resource_slice(name, shape)]  # type: ignore[assignment]
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    eventually(
        f"{name} Ready",
        lambda: any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in get(cluster, "node", name)["status"].get("conditions", [])
        ),
    )
    yield name
    # Its pods first, while KWOK still finishes them, then the node and its devices.
    cluster.kubectl("delete", "pods,resourceclaims", "--all", "-n", pods_ns, "--wait=true")
    cluster.kubectl("delete", "resourceslice", f"{name}.{GPU_DRIVER}", "--ignore-not-found")
    cluster.kubectl("delete", "node", name, "--ignore-not-found")


def test_node_selectors_and_device_attributes_are_respected(
    cluster: ClusterHandle, pods_ns: str, other_product_node: str
) -> None:
    ns = pods_ns
    a100 = other_product_node
    create(
        cluster, ns,
        # the product, through a CEL selector on the device attribute
        resource_claim("a100", 2, cel=product_is(OTHER_PRODUCT)),
        claim_pod("a100", "a100"),
        # the node, through the placeholder's nodeSelector
        resource_claim("on-node-2", 2),
        claim_pod("on-node-2", "on-node-2", node_selector={"kubernetes.io/hostname": "gpu-node-2"}),
        # both, contradicting each other
        resource_claim("a100-on-node-1", 1, cel=product_is(OTHER_PRODUCT)),
        claim_pod(
            "a100-on-node-1", "a100-on-node-1",
            node_selector={"kubernetes.io/hostname": "gpu-node-1"},
        ),
        # a product no node has
        resource_claim("b200", 1, cel=product_is("NVIDIA-B200")),
        claim_pod("b200", "b200"),
        # device capacity, through CEL on the memory quantity
        resource_claim(
            "big-memory", 1,
            cel=f'device.capacity["{GPU_DRIVER}"].memory.compareTo(quantity("80Gi")) >= 0',
        ),
        claim_pod("big-memory", "big-memory"),
    )  # fmt: skip
    alloc = held(cluster, ns, "a100", "a100")
    assert allocated_node(alloc) == a100
    assert {p for _, p, _ in devices(alloc)} == {a100}
    assert allocated_node(held(cluster, ns, "on-node-2", "on-node-2")) == "gpu-node-2"
    # 81920Mi = 80Gi: only the A100 node's devices have that much (the H100s have 81559Mi).
    assert allocated_node(held(cluster, ns, "big-memory", "big-memory")) == a100

    for pending in ("a100-on-node-1", "b200"):
        condition = eventually(
            f"{pending} to be Unschedulable", lambda p=pending: unschedulable(cluster, ns, p)
        )
        print(f"scheduler ({pending}): {condition['message']!r}")
        assert node_of(cluster, ns, pending) is None
        assert allocation(cluster, ns, pending) is None


# --- the audit log ---------------------------------------------------------------------


def test_the_audit_log_records_bindings_and_claim_allocations(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """`up --audit`: the API server's own record of who bound what and allocated which."""
    if request.config.getoption("--cluster") != "local":
        pytest.skip("starts a local control plane of its own")
    audited = LocalCluster(tmp_path / "audited", NodeShape(count=1), audit=True)
    audited.up()
    try:
        eventually(
            "the default ServiceAccount",
            lambda: audited.kubectl("get", "serviceaccount", "default", "--ignore-not-found"),
        )
        body = {"apiVersion": "v1", "kind": "List"}
        body["items"] = [resource_claim("hold", 2), claim_pod("placeholder", "hold")]  # type: ignore[assignment]
        audited.kubectl("create", "-f", "-", input=json.dumps(body))

        def events() -> list[dict[str, Any]]:
            lines = audited.audit_log.read_text().splitlines()
            return [json.loads(line) for line in lines]

        def binding() -> dict[str, Any] | None:
            return next(
                (
                    e
                    for e in events()
                    if e["objectRef"].get("subresource") == "binding"
                    and e["objectRef"].get("name") == "placeholder"
                ),
                None,
            )

        bound = eventually("the placeholder's binding in the audit log", binding)
        assert bound["level"] == "RequestResponse"
        assert bound["stage"] == "ResponseComplete"
        assert bound["requestObject"]["target"] == {"kind": "Node", "name": "gpu-node-0"}
        allocated = [
            e
            for e in events()
            if e["objectRef"]["resource"] == "resourceclaims"
            and e["objectRef"].get("subresource") == "status"
            and e["responseObject"].get("status", {}).get("allocation")
        ]
        assert allocated, "no resourceclaims/status write with an allocation"
        assert allocated[0]["stageTimestamp"] <= bound["stageTimestamp"]
        assert "placeholder" in {
            r["name"] for r in allocated[-1]["responseObject"]["status"]["reservedFor"]
        }
        # Reads are not recorded: the log stays the record of writes.
        assert {e["verb"] for e in events()} <= {"create", "update", "patch", "delete"}
    finally:
        audited.down(quiet=True)
