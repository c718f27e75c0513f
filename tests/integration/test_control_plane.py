"""Smoke tests of the local control plane itself: the parts every other test relies on."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from lightkube import ApiError, Client, KubeConfig
from lightkube.generic_resource import create_namespaced_resource

from tests.clusters import ClusterHandle, schemaless_crd


def wait_for(what: str, check: Callable[[], Any], timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def get_json(cluster: ClusterHandle, *args: str) -> dict[str, Any]:
    return json.loads(cluster.kubectl("get", *args, "-o", "json"))  # type: ignore[no-any-return]


def gpu_pod(name: str, gpus: int, node: str | None = None) -> str:
    spec: dict[str, Any] = {
        "containers": [
            {"name": "main", "image": "pause", "resources": {"limits": {"nvidia.com/gpu": gpus}}}
        ]
    }
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec})


@pytest.fixture
def namespace(cluster: ClusterHandle, request: pytest.FixtureRequest) -> Iterator[str]:
    name = f"smoke-{request.node.name.replace('_', '-')[:30]}-{uuid.uuid4().hex[:6]}".lower()
    cluster.kubectl("create", "namespace", name)
    wait_for(
        "the namespace's default ServiceAccount",
        lambda: "default" in cluster.kubectl("get", "serviceaccounts", "-n", name, "-o", "name"),
    )
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false")


def test_every_gpu_node_is_ready_and_publishes_its_gpus_as_devices(cluster: ClusterHandle) -> None:
    nodes = get_json(cluster, "nodes")["items"]
    assert len(nodes) >= 4
    slices = {s["spec"]["nodeName"]: s for s in get_json(cluster, "resourceslices")["items"]}
    for node in nodes:
        conditions = {c["type"]: c["status"] for c in node["status"]["conditions"]}
        assert conditions.get("Ready") == "True", node["metadata"]["name"]
        # GPUs come from DRA devices only, so nothing can book them twice.
        assert "nvidia.com/gpu" not in node["status"]["allocatable"]
        assert len(slices[node["metadata"]["name"]]["spec"]["devices"]) == 8
        assert node["metadata"]["labels"]["nvidia.com/gpu.product"]


def test_a_full_node_leaves_the_next_gpu_pod_unschedulable_until_it_frees(
    cluster: ClusterHandle, namespace: str
) -> None:
    ns = ["-n", namespace]
    cluster.kubectl("apply", *ns, "-f", "-", input=gpu_pod("eight", 8, "gpu-node-1"))
    wait_for(
        "the 8-GPU pod to run",
        lambda: get_json(cluster, "pod", "eight", *ns)["status"].get("phase") == "Running",
    )
    cluster.kubectl("apply", *ns, "-f", "-", input=gpu_pod("one", 1, "gpu-node-1"))

    def unschedulable() -> bool:
        status = get_json(cluster, "pod", "one", *ns)["status"]
        scheduled = [c for c in status.get("conditions", []) if c["type"] == "PodScheduled"]
        return bool(scheduled) and scheduled[0].get("reason") == "Unschedulable"

    wait_for("the 1-GPU pod to be Unschedulable", unschedulable)
    assert get_json(cluster, "pod", "one", *ns)["status"]["phase"] == "Pending"
    assert "cannot allocate all claims" in json.dumps(
        get_json(cluster, "pod", "one", *ns)["status"]
    )

    cluster.kubectl("delete", "pod", "eight", *ns, "--wait=false")
    wait_for(
        "the 1-GPU pod to run once the node frees",
        lambda: get_json(cluster, "pod", "one", *ns)["status"].get("phase") == "Running",
        timeout=90,
    )
    assert get_json(cluster, "pod", "one", *ns)["spec"]["nodeName"] == "gpu-node-1"


def test_controller_manager_runs_deployments_and_collects_garbage(
    cluster: ClusterHandle, namespace: str
) -> None:
    ns = ["-n", namespace]
    cluster.kubectl("create", "deployment", "web", "--image=pause", "--replicas=2", *ns)
    wait_for(
        "two pods from the Deployment",
        lambda: len(get_json(cluster, "pods", "-l", "app=web", *ns)["items"]) == 2,
    )
    cluster.kubectl("delete", "deployment", "web", *ns, "--cascade=background", "--wait=false")
    wait_for(
        "the ReplicaSet and pods to be garbage-collected",
        lambda: (
            not get_json(cluster, "replicasets", *ns)["items"]
            and not get_json(cluster, "pods", "-l", "app=web", *ns)["items"]
        ),
        timeout=90,
    )


WIDGET_CRD = schemaless_crd("smoke.reservoir.dev", "Widget", "widgets")


def test_status_writes_with_a_stale_resource_version_get_409(
    cluster: ClusterHandle, namespace: str
) -> None:
    cluster.kubectl("apply", "-f", "-", input=json.dumps(WIDGET_CRD))
    cluster.kubectl(
        "wait", "--for=condition=Established", "crd/widgets.smoke.reservoir.dev", "--timeout=30s"
    )
    widget = create_namespaced_resource("smoke.reservoir.dev", "v1", "Widget", "widgets")
    client = Client(KubeConfig.from_file(str(cluster.kubeconfig_path)), field_manager="smoke")
    created = client.create(
        widget(metadata={"name": "w", "namespace": namespace}, spec={"size": 1})
    )

    def status_write(count: int, resource_version: str) -> Any:
        body = widget.Status(
            metadata={"name": "w", "namespace": namespace, "resourceVersion": resource_version},
            status={"count": count},
        )
        return client.replace(body, "w", namespace=namespace)

    read_version = created.metadata.resourceVersion
    first = status_write(1, read_version)  # carries the resourceVersion it read: accepted
    assert first["status"] == {"count": 1}
    assert first.metadata.resourceVersion != read_version

    with pytest.raises(ApiError) as conflict:
        status_write(2, read_version)  # the same, now stale, resourceVersion
    assert conflict.value.status.code == 409
    current = client.get(widget, "w", namespace=namespace)
    assert current["status"] == {"count": 1}, "the stale write changed nothing"
