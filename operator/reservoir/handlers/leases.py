"""Lease heartbeats (coordination.k8s.io) are renewal requests for their claim."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf

from reservoir.k8s.informer import Key
from reservoir.k8s.resources import ENVELOPE_LABEL, labelled_envelope
from reservoir.services import Services

LEASES = ("coordination.k8s.io", "v1", "leases")


@kopf.index(*LEASES, labels={ENVELOPE_LABEL: kopf.PRESENT})
async def leases_by_envelope(**_: Any) -> None:
    """Declares the watch of claims' Leases (only those labelled with an envelope, by a
    server-side selector), each namespace's first list held before any daemon runs. Their
    events never reach kopf's handlers: the Lease informer (`Services.leases`) keeps each
    one's compact record (`lease_record`) by envelope for the writer, and calls
    `renewal_requested`."""


def lease_key(body: Mapping[str, Any]) -> Key:
    """Where a Lease's record is kept: its namespace and its claim's envelope (its label,
    or the name in its annotation that the label is the digest of)."""
    meta = body["metadata"]
    envelope = labelled_envelope(meta.get("labels"), meta.get("annotations"))
    return str(meta.get("namespace") or ""), envelope or ""


def renewal_requested(
    services: Services,
    event: str | None,
    body: Mapping[str, Any],
    record: Mapping[str, Any],
    key: Key,
) -> None:
    """Any change to a claim's Lease (a renewal, or its end) is news for its envelope."""
    namespace, envelope = key
    if namespace and envelope:
        services.writer.poke(namespace, envelope)
