"""Read what the API says about an envelope and its claims into the core's facts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from reservoir.core.lifecycle import ClaimFacts, PodFacts
from reservoir.core.model import (
    BranchClaimSpec,
    BranchClaimStatus,
    ReservationEnvelopeSpec,
    ReservationEnvelopeStatus,
)
from reservoir.core.reconcile import EnvelopeFacts
from reservoir.k8s.resources import FORCE_SETTLE_ANNOTATION


def parse_time(value: str | datetime) -> datetime:
    if isinstance(value, datetime):
        return value
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def as_dict(obj: Any) -> dict[str, Any]:
    """A lightkube generic object or a plain dict, as a plain dict."""
    if isinstance(obj, dict):
        return obj
    result: dict[str, Any] = obj.to_dict()
    return result


@dataclass(frozen=True)
class InvalidClaim:
    """A claim whose spec the operator cannot read: recorded, never acted upon."""

    uid: str
    name: str
    problem: str


def envelope_facts(envelope: Mapping[str, Any]) -> tuple[EnvelopeFacts, ReservationEnvelopeStatus]:
    meta = envelope["metadata"]
    facts = EnvelopeFacts(
        spec=ReservationEnvelopeSpec.model_validate(envelope.get("spec") or {}),
        created_at=parse_time(meta["creationTimestamp"]),
        generation=int(meta.get("generation", 1)),
        deleting=bool(meta.get("deletionTimestamp")),
    )
    status = ReservationEnvelopeStatus.model_validate(envelope.get("status") or {})
    return facts, status


def heartbeat_token(lease: Mapping[str, Any] | None) -> str | None:
    """An opaque token that changes with every renewal of the claim's Lease. The operator
    never reads the holder's clock: a changed token is a renewal request at its own time."""
    if not lease:
        return None
    spec = lease.get("spec") or {}
    renew = spec.get("renewTime")
    if not renew:
        return None
    return f"{renew}/{spec.get('holderIdentity', '')}/{spec.get('leaseTransitions', 0)}"[:128]


def pod_facts(pods: list[Mapping[str, Any]]) -> PodFacts | None:
    """What a claim's workload pods show: bound to a node, running. None if there are none."""
    if not pods:
        return None
    return PodFacts(
        scheduled=any((p.get("spec") or {}).get("nodeName") for p in pods),
        running=any((p.get("status") or {}).get("phase") == "Running" for p in pods),
    )


def claim_facts(
    claim: Mapping[str, Any],
    lease: Mapping[str, Any] | None,
    pods: list[Mapping[str, Any]] | None = None,
) -> ClaimFacts | InvalidClaim:
    meta = claim["metadata"]
    try:
        spec = BranchClaimSpec.model_validate(claim.get("spec") or {})
    except ValidationError as error:
        problem = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()
        )
        return InvalidClaim(uid=meta["uid"], name=meta["name"], problem=problem[:900])
    settlement = (claim.get("status") or {}).get("settlement") or {}
    annotations = meta.get("annotations") or {}
    return ClaimFacts(
        uid=meta["uid"],
        name=meta["name"],
        created_at=parse_time(meta["creationTimestamp"]),
        spec=spec,
        deleting=bool(meta.get("deletionTimestamp")),
        heartbeat=heartbeat_token(lease),
        settled_key=settlement.get("key"),
        force_settle=annotations.get(FORCE_SETTLE_ANNOTATION),
        pod=pod_facts(pods or []),
    )


def claim_status(claim: Mapping[str, Any]) -> BranchClaimStatus | None:
    try:
        return BranchClaimStatus.model_validate(claim.get("status") or {})
    except ValidationError:
        return None  # rewritten from the ledger on the next mirror
