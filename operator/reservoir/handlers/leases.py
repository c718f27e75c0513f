"""Lease heartbeats (coordination.k8s.io) are renewal requests for their claim."""

from __future__ import annotations

from typing import Any

import kopf

from reservoir.k8s.claim_source import lease_record, shed
from reservoir.k8s.resources import ENVELOPE_LABEL
from reservoir.services import Services

LEASES = ("coordination.k8s.io", "v1", "leases")


@kopf.index(*LEASES, labels={ENVELOPE_LABEL: kopf.PRESENT})
async def leases_by_envelope(
    body: kopf.Body, labels: kopf.Labels, namespace: str | None, **_: Any
) -> dict[tuple[str, str], dict[str, Any]]:
    """The envelope's writer reads its claims' Leases from here, not by a LIST per pass
    (each as its compact record: `lease_record`)."""
    record = lease_record(body)
    shed(body)  # kopf's copy: it may wait with it for every other object at start-up
    return {(namespace or "", str(labels[ENVELOPE_LABEL])): record}


@kopf.on.event(*LEASES, labels={ENVELOPE_LABEL: kopf.PRESENT})
async def renewal_requested(
    labels: kopf.Labels, namespace: str | None, memo: kopf.Memo, **_: Any
) -> None:
    services: Services = memo.services
    if namespace:
        services.writer.poke(namespace, labels[ENVELOPE_LABEL])
