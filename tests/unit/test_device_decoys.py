"""A tenant may label anything in its namespace: a decoy ResourceClaim or pod carrying the
operator's labels must not stand in for the claim's own (found by review: the decoy hid the
real, still-allocated ResourceClaim, so the devices read as released while a pod used them,
and the operator then tried to delete the decoy instead)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from reservoir.k8s.devices import (
    CLAIM_UID_LABEL,
    PLACEHOLDER_LABEL,
    DeviceHolder,
    Pod,
    ResourceClaim,
)
from reservoir.k8s.resources import ENVELOPE_LABEL

UID = "11111111-2222-4333-8444-555555555555"
LABELS = {CLAIM_UID_LABEL: UID, ENVELOPE_LABEL: "env"}


def resource_claim(name: str, allocated: bool) -> ResourceClaim:
    status: dict[str, Any] = {}
    if allocated:
        result = {"device": "gpu-0", "pool": "node-1", "driver": "d", "request": "dev-0"}
        term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-1"]}]}
        status = {
            "allocation": {
                "devices": {"results": [result]},
                "nodeSelector": {"nodeSelectorTerms": [term]},
            },
            "reservedFor": [{"resource": "pods", "name": "workload", "uid": "pod-uid"}],
        }
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "team-a", "labels": LABELS},
        "spec": {"devices": {"requests": []}},
        "status": status,
    }
    return ResourceClaim.from_dict(body)


def pod(name: str) -> Pod:
    labels = {**LABELS, PLACEHOLDER_LABEL: UID}
    body = {
        "metadata": {"name": name, "namespace": "team-a", "labels": labels},
        "spec": {"containers": []},
    }
    return Pod.from_dict({"apiVersion": "v1", "kind": "Pod", **body})


class Namespace:
    """Lists what a label selector finds (by name, as the API server orders them)."""

    def __init__(self) -> None:
        self.deleted: list[str] = []

    def list(self, kind: Any, namespace: str, labels: Any) -> AsyncIterator[Any]:
        async def listing() -> AsyncIterator[Any]:
            if kind is ResourceClaim:
                yield resource_claim(f"reservoir-{UID}", allocated=True)
                yield resource_claim("zz-decoy", allocated=False)
            else:
                yield pod(f"reservoir-hold-{UID}")
                yield pod("zz-decoy-pod")

        return listing()

    async def delete(self, kind: Any, name: str, namespace: str) -> None:
        self.deleted.append(name)


def test_only_the_operators_own_names_are_its_devices() -> None:
    async def scenario() -> None:
        cluster = Namespace()
        holder = DeviceHolder(cluster, "reservoir-placeholder")  # type: ignore[arg-type]
        claims, pods = await holder.observe("team-a", "env")
        assert claims[UID]["metadata"]["name"] == f"reservoir-{UID}"
        assert pods[UID]["metadata"]["name"] == f"reservoir-hold-{UID}"
        facts = holder.facts(claims, pods)[UID]
        assert facts.allocated, "the real ResourceClaim is still allocated"
        await holder.sync({}, {}, claims, pods)  # settled: nothing to hold any more
        assert set(cluster.deleted) == {f"reservoir-hold-{UID}", f"reservoir-{UID}"}

    asyncio.run(scenario())
