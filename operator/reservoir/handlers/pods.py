"""Workload pods (labelled reservoir.dev/claim=UID, or =NAME) commit claims whose commit point is
the pod's binding (PodScheduled) or start (PodRunning)."""

from __future__ import annotations

from typing import Any

import kopf

from reservoir.k8s.devices import PLACEHOLDER_LABEL
from reservoir.k8s.resources import CLAIM_LABEL, is_uid
from reservoir.services import Services

WORKLOAD = {CLAIM_LABEL: kopf.PRESENT, PLACEHOLDER_LABEL: kopf.ABSENT}


# Placeholders carry the claim label too (one server-side selector for both: see startup).
@kopf.on.event("", "v1", "pods", labels=WORKLOAD)
async def workload_pod_changed(
    labels: kopf.Labels, namespace: str | None, memo: kopf.Memo, **_: Any
) -> None:
    """A pod's claim (its label: the claim's UID or name, in its namespace) finds the
    ledger to wake."""
    services: Services = memo.services
    value = str(labels[CLAIM_LABEL])
    # A value shaped like a UID names a claim by UID only (reservoir.k8s.resources.is_uid).
    found = services.claims.key_of_uid(namespace or "", value)
    if found is None and not is_uid(value):
        found = services.claims.key_of(namespace or "", value)
    if namespace and found is not None and found[1]:
        services.writer.poke(*found)
