"""ResourceClaims and placeholder pods of device holds: a change to either (the scheduler
allocated, bound, or could not; the allocation went away) is a fact for the claim's
envelope, so it wakes that envelope's ledger."""

from __future__ import annotations

from typing import Any

import kopf

from reservoir.k8s.devices import CLAIM_UID_LABEL, PLACEHOLDER_LABEL
from reservoir.k8s.resources import CLAIM_LABEL, ENVELOPE_LABEL, labelled_envelope
from reservoir.services import Services


def _wake(
    labels: kopf.Labels, annotations: kopf.Annotations, namespace: str | None, memo: kopf.Memo
) -> None:
    services: Services = memo.services
    envelope = labelled_envelope(labels, annotations)
    if namespace and envelope:
        services.writer.poke(namespace, envelope)


@kopf.on.event(
    "resource.k8s.io",
    "v1",
    "resourceclaims",
    labels={CLAIM_UID_LABEL: kopf.PRESENT, ENVELOPE_LABEL: kopf.PRESENT},
)
async def allocation_changed(
    labels: kopf.Labels,
    annotations: kopf.Annotations,
    namespace: str | None,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    _wake(labels, annotations, namespace, memo)


# Placeholders carry the claim label too: the pods' server-side selector (see startup).
@kopf.on.event(
    "", "v1", "pods", labels={PLACEHOLDER_LABEL: kopf.PRESENT, CLAIM_LABEL: kopf.PRESENT}
)
async def placeholder_changed(
    labels: kopf.Labels,
    annotations: kopf.Annotations,
    namespace: str | None,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    _wake(labels, annotations, namespace, memo)
