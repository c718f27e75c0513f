"""A device hold's placeholder pod and ResourceClaim carry the claim's placement hints,
read fresh when they are made: the writer's records of claims keep no hints (they may be
a megabyte, k8s/claim_source.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from reservoir.k8s.claim_source import claim_record
from reservoir.k8s.devices import DeviceHolder

GPU = "nvidia.com/gpu"
HINTS = {
    "deviceAttributes": {"productName": "H100"},
    "nodeSelector": {"pool": "gpu"},
    "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
}


def claim(uid: str = "u-1") -> dict[str, Any]:
    return {
        "apiVersion": "reservoir.dev/v1alpha1",
        "kind": "BranchClaim",
        "metadata": {"name": "c", "namespace": "ns", "uid": uid, "resourceVersion": "3"},
        "spec": {"envelope": "wf", "requests": {GPU: "1"}, "placement": HINTS},
    }


class Cluster:
    """A client over one stored claim (read by a LIST by name) that records creations."""

    def __init__(self, stored: dict[str, Any] | None) -> None:
        self.stored = stored
        self.created: dict[str, dict[str, Any]] = {}

    def list(self, kind: Any, namespace: str, fields: Any) -> AsyncIterator[dict[str, Any]]:
        async def listing() -> AsyncIterator[dict[str, Any]]:
            if self.stored is not None:
                yield self.stored

        return listing()

    async def create(self, obj: Any, namespace: str) -> Any:
        body = obj.to_dict()
        self.created[body["kind"]] = body
        return obj


def sync(cluster: Cluster, record: dict[str, Any]) -> None:
    holder = DeviceHolder(cluster, "reservoir-placeholder")  # type: ignore[arg-type]
    uid = record["metadata"]["uid"]
    asyncio.run(holder.sync({uid: record}, {uid: {GPU: 1}}, {}, {}))


def test_the_placeholder_gets_the_hints_the_record_does_not_keep() -> None:
    record = claim_record(claim())
    assert "placement" not in record["spec"]
    cluster = Cluster(claim())
    sync(cluster, record)
    pod = cluster.created["Pod"]["spec"]
    assert pod["nodeSelector"] == HINTS["nodeSelector"]
    assert pod["tolerations"] == HINTS["tolerations"]
    assert pod["affinity"] == HINTS["affinity"]
    [request] = cluster.created["ResourceClaim"]["spec"]["devices"]["requests"]
    assert "productName" in request["exactly"]["selectors"][0]["cel"]["expression"]


def test_a_claim_gone_or_replaced_meanwhile_gets_no_hold() -> None:
    for stored in (None, claim(uid="u-2")):
        cluster = Cluster(stored)
        sync(cluster, claim_record(claim()))
        assert cluster.created == {}
