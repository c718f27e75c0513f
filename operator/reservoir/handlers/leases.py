"""Lease heartbeats (coordination.k8s.io) are renewal requests for their claim."""

from __future__ import annotations

from typing import Any

import kopf

from reservoir.k8s.resources import ENVELOPE_LABEL
from reservoir.services import Services


@kopf.on.event("coordination.k8s.io", "v1", "leases", labels={ENVELOPE_LABEL: kopf.PRESENT})
async def renewal_requested(
    labels: kopf.Labels, namespace: str | None, memo: kopf.Memo, **_: Any
) -> None:
    services: Services = memo.services
    if namespace:
        services.writer.poke(namespace, labels[ENVELOPE_LABEL])
