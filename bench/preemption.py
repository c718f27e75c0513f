"""Preemption of tentative holds: how long an urgent envelope waits for a pool kept full by
a batch tenant, with its class allowed to preempt and without.

The batch namespace keeps the pool full of envelopes of one slot each, and more waiting:
half hold one Tentative claim (exploring: nothing dispatched), half one claim dispatched at
creation (Committed: past its commit point). Each batch envelope lets go `hold_seconds`
after its admission (its committed claim reports its final usage, then the envelope is
deleted). The urgent namespace creates one envelope every `every` seconds and deletes it a
moment after its admission. The figure is each urgent envelope's wait, creation to
admission (both read from the API server); the baseline is the same load with the urgent
class's `preemptionPolicy: Never`. Checked at the end: no claim past its commit point was
released for preemption.

Used by `bench/run.py --only preemption`. Talks to the API server like any client
(lightkube); it knows nothing of the operator's arithmetic.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from bench.fairshare import delete
from lightkube import ApiError, Client
from lightkube.codecs import from_dict
from lightkube.types import PatchType

from reservoir.k8s.resources import BranchClaim, ReservationEnvelope
from reservoir.sdk.patches import lease_fence

RESOURCE = "slots"
API_VERSION = "reservoir.dev/v1alpha1"
LABEL = "bench.reservoir.dev/preemption"
MERGE = PatchType.MERGE
LONG = 6 * 3600  # leases, lifetimes, queue ages: nothing lapses during a run


@dataclass(frozen=True)
class Shape:
    batch: str  # namespace
    urgent: str  # namespace
    preempt: bool  # the urgent class's preemptionPolicy: PreemptLowerPriority, else Never
    capacity: int = 8
    hold_seconds: float = 40.0  # a batch envelope lets go this long after its admission
    waiting: int = 3  # batch envelopes kept waiting
    every: float = 8.0  # an urgent envelope this often
    seconds: float = 120.0


@dataclass
class Outcome:
    waits: list[tuple[float, float]] = field(default_factory=list)  # (created at, waited) s
    unadmitted: int = 0  # urgent envelopes still waiting at the end
    batch_admitted: int = 0
    preempted_envelopes: int = 0
    preempted_claims: int = 0
    committed_preempted: int = 0  # claims past their commit point released for preemption

    def figures(self) -> dict[str, Any]:
        waited = [w for _, w in self.waits]
        return {
            "urgent_admitted": len(waited),
            "urgent_unadmitted": self.unadmitted,
            "wait_p50_seconds": round(statistics.median(waited), 2) if waited else None,
            "wait_mean_seconds": round(statistics.fmean(waited), 2) if waited else None,
            "wait_max_seconds": round(max(waited), 2) if waited else None,
            "batch_admitted": self.batch_admitted,
            "preempted_envelopes": self.preempted_envelopes,
            "preempted_claims": self.preempted_claims,
            "committed_claims_preempted": self.committed_preempted,
            "waits": [(round(t, 1), round(w, 2)) for t, w in self.waits],
        }


def create_pool(client: Client, name: str, shape: Shape) -> None:
    policy = "PreemptLowerPriority" if shape.preempt else "Never"
    client.create(
        from_dict(
            {
                "apiVersion": API_VERSION,
                "kind": "ReservationPool",
                "metadata": {"name": name},
                "spec": {
                    "capacity": {RESOURCE: str(shape.capacity)},
                    "contracts": {RESOURCE: {"type": "Reusable"}},
                    "namespaces": sorted({shape.batch, shape.urgent}),
                    "priorityClasses": {
                        "batch": {"value": 0},
                        "urgent": {"value": 100, "preemptionPolicy": policy},
                    },
                },
            }
        )
    )


def envelope_object(namespace: str, name: str, klass: str) -> Any:
    return from_dict(
        {
            "apiVersion": API_VERSION,
            "kind": "ReservationEnvelope",
            "metadata": {"name": name, "namespace": namespace, "labels": {LABEL: "true"}},
            "spec": {
                "capacity": {RESOURCE: "1"},
                "contracts": {RESOURCE: {"type": "Reusable"}},
                "priorityClassName": klass,
                "policy": {
                    "defaultLeaseSeconds": LONG,
                    "maxClaimLifetimeSeconds": LONG,
                    "maxQueueSeconds": LONG,
                },
            },
        }
    )


def claim_object(namespace: str, envelope: str, dispatched: bool) -> Any:
    return from_dict(
        {
            "apiVersion": API_VERSION,
            "kind": "BranchClaim",
            "metadata": {"name": envelope, "namespace": namespace, "labels": {LABEL: "true"}},
            "spec": {
                "envelope": envelope,
                "branch": "work" if dispatched else "explore",
                "requests": {RESOURCE: "1"},
                "dispatch": dispatched,
            },
        }
    )


def _admitted_at(body: dict[str, Any]) -> datetime | None:
    record = ((body.get("status") or {}).get("parent")) or {}
    stamp = record.get("admittedAt")
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")) if stamp else None


def run(client: Client, shape: Shape) -> Outcome:
    """Keep the pool (created, its namespaces served by an operator) full for
    `shape.seconds`; returns the urgent envelopes' waits. Everything it made is deleted."""
    outcome = Outcome()
    admitted_seen: dict[str, float] = {}  # batch envelope -> when first seen admitted
    gone: set[str] = set()
    urgent_done: set[str] = set()
    made = {"batch": 0, "urgent": 0}
    # When each urgent envelope was sent, on the machine's clock (the operator's too: it
    # runs here). Not creationTimestamp, which the API server keeps to the second (review:
    # that added up to 1 s to every wait).
    sent: dict[str, datetime] = {}
    run_id = "p" if shape.preempt else "n"  # the two runs' names never meet
    started = time.monotonic()
    next_urgent = started + shape.every
    while (now := time.monotonic()) - started < shape.seconds:
        waiting = 0
        for item in client.list(ReservationEnvelope, namespace=shape.batch, labels={LABEL: "true"}):
            body = item.to_dict()
            name = body["metadata"]["name"]
            if name in gone or body["metadata"].get("deletionTimestamp"):
                continue
            status = body.get("status") or {}
            if status.get("closedAt"):
                # Preempted (or closed): it returned its slot; the workflow would queue
                # again with a new envelope, as the waiting ones here do.
                if (status.get("preemption") or {}).get("outcome") == "Preempted":
                    outcome.preempted_envelopes += 1
                    _count_claim(client, shape.batch, name, outcome)
                _let_go(client, shape.batch, name, made_dispatched(name))
                gone.add(name)
            elif _admitted_at(body) is not None:
                if name not in admitted_seen:
                    admitted_seen[name] = now
                    outcome.batch_admitted += 1
                elif now - admitted_seen[name] >= shape.hold_seconds:
                    _let_go(client, shape.batch, name, made_dispatched(name))
                    gone.add(name)
            else:
                waiting += 1
        for _ in range(shape.waiting - waiting):
            name = f"{run_id}-batch-{made['batch']:05d}"
            made["batch"] += 1
            client.create(envelope_object(shape.batch, name, "batch"))
            client.create(claim_object(shape.batch, name, dispatched=made_dispatched(name)))
        if now >= next_urgent:
            name = f"{run_id}-urgent-{made['urgent']:04d}"
            made["urgent"] += 1
            sent[name] = datetime.now(UTC)
            client.create(envelope_object(shape.urgent, name, "urgent"))
            next_urgent += shape.every
        for item in client.list(
            ReservationEnvelope, namespace=shape.urgent, labels={LABEL: "true"}
        ):
            body = item.to_dict()
            name = body["metadata"]["name"]
            admitted = _admitted_at(body)
            if name in urgent_done or name not in sent or admitted is None:
                continue
            waited = max((admitted - sent[name]).total_seconds(), 0.0)
            outcome.waits.append((now - started - waited, waited))  # by when it was created
            urgent_done.add(name)
            delete(client, shape.urgent, name, ReservationEnvelope)
        time.sleep(0.25)
    outcome.unadmitted = made["urgent"] - len(urgent_done)
    for namespace in (shape.batch, shape.urgent):
        for item in client.list(ReservationEnvelope, namespace=namespace, labels={LABEL: "true"}):
            name = item.metadata.name
            if item.metadata.deletionTimestamp:
                continue  # let go already
            _let_go(client, namespace, name, namespace == shape.batch and made_dispatched(name))
    for item in client.list(BranchClaim, namespace=shape.batch, labels={LABEL: "true"}):
        delete(client, shape.batch, item.metadata.name, BranchClaim)
    return outcome


def made_dispatched(name: str) -> bool:
    """Every other batch envelope's claim is dispatched at creation."""
    return int(name.rsplit("-", 1)[1]) % 2 == 1


def _let_go(client: Client, namespace: str, name: str, dispatched: bool) -> None:
    """A batch envelope's workflow ends: its dispatched claim reports its final usage (a
    committed claim settles on it, never on the envelope's deletion), then it goes."""
    for attempt in range(3 if dispatched else 0):
        try:
            claim = client.get(BranchClaim, name, namespace=namespace).to_dict()
            final = {
                "spec": {
                    "usage": {RESOURCE: "1"},
                    "final": True,
                    "outcome": "Succeeded",
                    # Reports carry the lease they were made under (the API server's rule).
                    "lease": {"fence": lease_fence(claim)},
                }
            }
            client.patch(BranchClaim, name, final, namespace=namespace, patch_type=MERGE)
            break
        except ApiError as error:
            if error.status.code == 404:
                break
            if error.status.code != 422 or attempt == 2:
                raise  # 422: the lease moved between the read and the patch: read again
    delete(client, namespace, name, ReservationEnvelope)


def _count_claim(client: Client, namespace: str, name: str, outcome: Outcome) -> None:
    """A preempted envelope's claim, read before the envelope goes (its claims go with it):
    released for preemption, and never past its commit point."""
    try:
        body = client.get(BranchClaim, name, namespace=namespace).to_dict()
    except ApiError as error:
        if error.status.code == 404:
            return
        raise
    line = ((body.get("status") or {}).get("ledger")) or {}
    if ((line.get("settlement") or {}).get("reason")) == "Preempted":
        outcome.preempted_claims += 1
        if line.get("committedAt"):
            outcome.committed_preempted += 1
