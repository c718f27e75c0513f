"""Upstream Jobs labelled reservoir.dev/envelope=ENVELOPE: any change wakes the envelope's
writer, so a Job-backed claim (upstream.ref) is looked up as soon as its Job moves rather
than at its next backed-off lookup. The Job's status is read by the writer, not here."""

from __future__ import annotations

from typing import Any

import kopf

from reservoir.k8s.resources import ENVELOPE_LABEL, labelled_envelope
from reservoir.services import Services


@kopf.on.event("batch", "v1", "jobs", labels={ENVELOPE_LABEL: kopf.PRESENT})
async def upstream_job_changed(
    labels: kopf.Labels,
    annotations: kopf.Annotations,
    namespace: str | None,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """A Job's progress is a fact for its envelope's ledger (a claim it runs may settle).
    An envelope named past 63 characters: the label `reservoir.dev/envelope` holds
    `envelope_label(name)`, the annotation `reservoir.dev/envelope-name` the name."""
    envelope = labelled_envelope(labels, annotations)
    if namespace and envelope:
        services: Services = memo.services
        services.writer.poke(namespace, envelope)
