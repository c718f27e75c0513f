"""Read what the API says about an envelope and its claims into the core's facts.

Every fact is read so that it can only move forward: a pod counts as bound or started if
it ever was (nodeName set; phase Running, Succeeded or Failed), and a spec part the
operator cannot read is left out (the ledger keeps what it recorded) rather than freezing
the claim: deadlines, force-settle and deletion go on working.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from reservoir.core.claimstatus import settled_record
from reservoir.core.ledgersize import cut_bytes
from reservoir.core.lifecycle import ClaimFacts, PodFacts
from reservoir.core.model import (
    BranchClaimSpec,
    BranchClaimStatus,
    LedgerEntry,
    Placement,
    ReservationEnvelopeSpec,
    ReservationEnvelopeStatus,
)
from reservoir.core.model.common import share_field_sets
from reservoir.core.reconcile import EnvelopeFacts
from reservoir.core.serving_classes import UnknownServingClassError
from reservoir.core.text import bounded
from reservoir.k8s import serving
from reservoir.k8s.resources import (
    FORCE_SETTLE_ANNOTATION,
    FORCE_SETTLE_GONE_ANNOTATION,
    HAND_OFF_GATE,
)

MAX_UNREADABLE_PARTS = 32
# Fields without which the claim cannot be read at all: its identity, and the facts that
# say whether it may have run (dropped, they would read as "not dispatched"). A claim
# that lacks one is read as gone, and a gone claim's capacity is held, never released.
VITAL_FIELDS = ("envelope", "requests", "attempt", "dispatch", "cancel", "commitPoint", "upstream")
# A claim's record (k8s/claim_source.py) keeps no placement hints; when they cannot be
# read, it says why under this key, and the claim's facts count them as an unreadable part
# of its spec, as when the whole spec is read.
PLACEMENT_PROBLEM = "placementProblem"


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
    """A claim the operator cannot read at all (no spec it can make sense of)."""

    uid: str
    name: str
    problem: str


class UnreadableEnvelopeError(ValueError):
    """An envelope whose spec or ledger the operator cannot read: reported, never guessed."""


def envelope_facts(envelope: Mapping[str, Any]) -> tuple[EnvelopeFacts, ReservationEnvelopeStatus]:
    meta = envelope["metadata"]
    try:
        spec = ReservationEnvelopeSpec.model_validate(envelope.get("spec") or {})
        status = ReservationEnvelopeStatus.model_validate(envelope.get("status") or {})
        spec = serving.effective(spec)
    except ValidationError as error:
        raise UnreadableEnvelopeError(_describe(error)) from None
    except UnknownServingClassError as error:
        raise UnreadableEnvelopeError(str(error)) from None
    facts = EnvelopeFacts(
        spec=spec,
        created_at=parse_time(meta["creationTimestamp"]),
        generation=int(meta.get("generation", 1)),
        deleting=bool(meta.get("deletionTimestamp")),
        force_settle_gone=force_settle_gone(meta.get("annotations") or {}),
    )
    return facts, status


def force_settle_gone(annotations: Mapping[str, str]) -> dict[str, str]:
    """`reservoir.dev/force-settle-gone`: one `CLAIM: reason` per line, CLAIM a claim's
    name or UID, for ledger entries whose claim object is gone."""
    named: dict[str, str] = {}
    for line in (annotations.get(FORCE_SETTLE_GONE_ANNOTATION) or "").splitlines():
        claim, _, reason = line.partition(":")
        if claim.strip():
            named[claim.strip()] = reason.strip() or "settled by envelope annotation"
    return named


def _describe(error: ValidationError, *within: str) -> str:
    problem = "; ".join(
        f"{'.'.join([*within, *(str(p) for p in e['loc'])])}: {e['msg']}" for e in error.errors()
    )
    return problem[:900]


def placement_problem(placement: Any) -> str | None:
    """Why a claim's placement hints cannot be read (None: they can, or there are none)."""
    if placement is None:
        return None
    try:
        Placement.model_validate(placement)
    except ValidationError as error:
        return _describe(error, "placement")
    return None


def readable_spec(raw: Mapping[str, Any]) -> tuple[BranchClaimSpec, str | None]:
    """The claim's spec, minus the parts that cannot be read. A usage report with an
    unreadable quantity is not a final report: what cannot be read cannot be settled on.
    Raises ValidationError if nothing sensible is left (say, no envelope)."""
    spec = dict(raw)
    problems: list[str] = []
    for _ in range(MAX_UNREADABLE_PARTS):
        try:
            parsed = BranchClaimSpec.model_validate(spec)
        except ValidationError as error:
            problems.append(_describe(error))
            if not _drop_unreadable(spec, error):
                raise
            continue
        return parsed, ("; ".join(problems)[:900] if problems else None)
    return BranchClaimSpec.model_validate(spec), "; ".join(problems)[:900]


def _drop_unreadable(spec: dict[str, Any], error: ValidationError) -> bool:
    """Remove what the error points at from `spec` (copying the dicts on the way, so the
    caller's object is untouched). False if nothing more can go."""
    dropped = False
    for problem in error.errors():
        loc = [str(p) for p in problem["loc"]]
        if not loc or loc[0] in VITAL_FIELDS:
            continue
        if loc[0] == "usage":
            spec.pop("final", None)
            spec.pop("outcome", None)
        parent = spec
        for key in loc[:-1]:
            child = parent.get(key)
            if not isinstance(child, dict):
                break
            parent[key] = dict(child)
            parent = parent[key]
        else:
            if loc[-1] in parent:
                del parent[loc[-1]]
                dropped = True
    return dropped


def heartbeat_holder(lease: Mapping[str, Any] | None) -> str | None:
    return ((lease or {}).get("spec") or {}).get("holderIdentity")


def heartbeat_token(lease: Mapping[str, Any] | None) -> str | None:
    """An opaque token that changes with every renewal of the claim's Lease. The operator
    never reads the holder's clock: a changed token is a renewal request at its own time."""
    if not lease:
        return None
    spec = lease.get("spec") or {}
    renew = spec.get("renewTime")
    if not renew:
        return None
    token = f"{renew}/{spec.get('holderIdentity', '')}/{spec.get('leaseTransitions', 0)}"
    return cut_bytes(token, 128)


STARTED_PHASES = ("Running", "Succeeded", "Failed")


def still_gated(pod: Mapping[str, Any]) -> bool:
    """Whether the pod still waits behind the hand-off gate."""
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    return any(gate.get("name") == HAND_OFF_GATE for gate in gates)


def pod_facts(pods: list[Mapping[str, Any]]) -> PodFacts | None:
    """What a claim's workload pods show: ever bound to a node, ever started (a pod that
    ran and finished before the operator looked still ran). None if there are none."""
    if not pods:
        return None
    started = any((p.get("status") or {}).get("phase") in STARTED_PHASES for p in pods)
    bound = any((p.get("spec") or {}).get("nodeName") for p in pods)
    meta = [p.get("metadata") or {} for p in pods]
    waiting = sorted(
        (m.get("creationTimestamp") or "", m.get("uid") or "")
        for p, m in zip(pods, meta, strict=True)
        if still_gated(p)
    )
    return PodFacts(
        scheduled=bound or started,
        running=started,
        gated=bool(waiting),
        gated_pod=waiting[0][1] if waiting else None,
        uids=frozenset(m.get("uid") or "" for m in meta),
        gated_uids=frozenset(uid for _, uid in waiting),
    )


# A ResourceClaim Reservoir made: reservoir-<claim uid> (reservoir.k8s.devices).
_RESERVOIR_RESOURCE_CLAIM = re.compile(r"^reservoir-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}$")


def mounts_others_devices(pod: Mapping[str, Any], uid: str) -> bool:
    """A pod labelled for one claim that references another claim's ResourceClaim is not
    that claim's workload pod: nothing is handed to it and its gate is never lifted (else
    a tenant could run on devices held for another branch, found by review)."""
    for ref in (pod.get("spec") or {}).get("resourceClaims") or []:
        name = ref.get("resourceClaimName") or ""
        if _RESERVOIR_RESOURCE_CLAIM.match(name) and name != f"reservoir-{uid}":
            return True
    return False


def claim_facts(
    claim: Mapping[str, Any],
    lease: Mapping[str, Any] | None,
    pods: list[Mapping[str, Any]] | None = None,
) -> ClaimFacts | InvalidClaim:
    meta = claim["metadata"]
    try:
        spec, problem = readable_spec(claim.get("spec") or {})
    except ValidationError as error:
        return InvalidClaim(uid=meta["uid"], name=meta["name"], problem=_describe(error))
    annotations = meta.get("annotations") or {}
    hints = claim.get(PLACEMENT_PROBLEM)
    if hints:
        problem = bounded(f"{problem}; {hints}", 900) if problem else hints
    status = claim_status(claim)
    line = status.ledger if status is not None else claim_line(claim)
    record = settled_record(status, meta["uid"], meta["name"], spec.attempt)
    if record is None and line is not None and line.phase.terminal and line.settlement:
        record = line  # its line says it settled, whatever the rest of its status says
    for kept in (spec, line, record):  # kept from pass to pass: see share_field_sets
        share_field_sets(kept)
    return ClaimFacts(
        uid=meta["uid"],
        name=meta["name"],
        created_at=parse_time(meta["creationTimestamp"]),
        spec=spec,
        deleting=bool(meta.get("deletionTimestamp")),
        heartbeat=heartbeat_token(lease),
        heartbeat_holder=heartbeat_holder(lease),
        settled_record=record,
        line=line,
        envelope_uid=status.envelope_uid if status is not None else None,
        force_settle=annotations.get(FORCE_SETTLE_ANNOTATION),
        pod=pod_facts([p for p in pods or [] if not mounts_others_devices(p, meta["uid"])]),
        problem=problem,
    )


def claim_status(claim: Mapping[str, Any]) -> BranchClaimStatus | None:
    try:
        return BranchClaimStatus.model_validate(claim.get("status") or {})
    except ValidationError:
        return None  # rewritten from the claim's line on the next mirror


def claim_line(claim: Mapping[str, Any]) -> LedgerEntry | None:
    """The claim's ledger line alone, when the rest of its status cannot be read: the line
    is the record of what the claim holds, and is never dropped for a neighbour's sake."""
    status = claim.get("status")
    raw = status.get("ledger") if isinstance(status, Mapping) else None
    if raw is None:
        return None
    try:
        return LedgerEntry.model_validate(raw)
    except ValidationError:
        return None
