"""Workload pods (labelled reservoir.dev/claim=NAME) commit claims whose commit point is
the pod's binding (PodScheduled) or start (PodRunning)."""

from __future__ import annotations

from typing import Any

import kopf

from reservoir.core.model import API_GROUP, API_VERSION
from reservoir.k8s.devices import PLACEHOLDER_LABEL
from reservoir.k8s.resources import CLAIM_LABEL
from reservoir.services import Services


@kopf.index(API_GROUP, API_VERSION, "branchclaims")
async def envelope_of_claim(
    name: str, namespace: str | None, spec: kopf.Spec, **_: Any
) -> dict[tuple[str | None, str], str]:
    """claim (namespace, name) → its envelope, so a pod event finds the ledger to wake.
    (A coroutine: kopf runs plain functions in a thread pool, a hand-off per claim event.)"""
    return {(namespace, name): spec.get("envelope", "")}


WORKLOAD = {CLAIM_LABEL: kopf.PRESENT, PLACEHOLDER_LABEL: kopf.ABSENT}


# Placeholders carry the claim label too (one server-side selector for both: see startup).
@kopf.on.event("", "v1", "pods", labels=WORKLOAD)
async def workload_pod_changed(
    labels: kopf.Labels, namespace: str | None, memo: kopf.Memo, **kwargs: Any
) -> None:
    services: Services = memo.services
    index: kopf.Index[tuple[str | None, str], str] = kwargs["envelope_of_claim"]
    for envelope in index.get((namespace, labels[CLAIM_LABEL]), []):
        if namespace and envelope:
            services.writer.poke(namespace, envelope)
