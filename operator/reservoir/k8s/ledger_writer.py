"""The one serialized writer per envelope: read, reconcile, compare-and-swap, mirror.

Each call reads the envelope (with its resourceVersion), lists its claims and their
Leases straight from the API server, asks the pure core for the next ledger, and writes
the envelope status with a PUT carrying the resourceVersion it read. A 409 means someone
else wrote first (another replica, or this one on a stale read): re-read, recompute,
retry with jitter. Only after the ledger is durable are the claims' statuses mirrored and
Events posted. Many claim events between two calls are settled by one write (group commit).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from lightkube import ApiError, AsyncClient
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Pod

from reservoir import metrics
from reservoir.core.claimstatus import claim_status
from reservoir.core.lifecycle import ClaimFacts, LedgerEvent
from reservoir.core.reconcile import Reconciliation, reconcile
from reservoir.k8s import facts as read
from reservoir.k8s.clock import utcnow
from reservoir.k8s.resources import (
    CLAIM_LABEL,
    ENVELOPE_LABEL,
    BranchClaim,
    ReservationEnvelope,
)

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 8


class Recorder(Protocol):
    """Posts a Kubernetes Event about an object (kopf's poster in the operator)."""

    def __call__(self, obj: Mapping[str, Any], type_: str, reason: str, message: str) -> None: ...


@dataclass
class Trigger:
    """Wakes an envelope's writer: many pokes before it runs coalesce into one reconcile."""

    event: asyncio.Event = field(default_factory=asyncio.Event)

    def poke(self) -> None:
        self.event.set()

    async def wait(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.event.wait(), seconds)
        self.event.clear()


class Conflict:
    """The compare-and-swap lost: someone wrote the envelope since we read it."""


class LedgerWriter:
    def __init__(
        self,
        client: AsyncClient,
        record: Recorder,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.client = client
        self.record = record
        self.clock = clock
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._triggers: dict[tuple[str, str], Trigger] = {}
        self._reported_invalid: set[tuple[str, str]] = set()  # (claim uid, resourceVersion)

    def trigger(self, namespace: str, envelope: str) -> Trigger:
        return self._triggers.setdefault((namespace, envelope), Trigger())

    def poke(self, namespace: str, envelope: str) -> None:
        self.trigger(namespace, envelope).poke()

    async def reconcile_once(self, namespace: str, envelope: str) -> Reconciliation | None:
        """Converge one envelope's ledger. None if the envelope does not exist."""
        lock = self._locks.setdefault((namespace, envelope), asyncio.Lock())
        async with lock:
            started = time.monotonic()
            try:
                for attempt in range(MAX_ATTEMPTS):
                    outcome = await self._attempt(namespace, envelope)
                    if not isinstance(outcome, Conflict):
                        return outcome
                    # Someone wrote first: back off with jitter, then read again.
                    await asyncio.sleep(random.uniform(0, 0.05 * 2**attempt))
                raise RuntimeError(f"{namespace}/{envelope}: {MAX_ATTEMPTS} conflicts in a row")
            finally:
                metrics.reconcile_seconds.labels(namespace).observe(time.monotonic() - started)

    async def _attempt(self, namespace: str, name: str) -> Reconciliation | Conflict | None:
        try:
            envelope = read.as_dict(
                await self.client.get(ReservationEnvelope, name, namespace=namespace)
            )
        except ApiError as error:
            if error.status.code == 404:
                return None
            raise
        claims = [
            read.as_dict(c)
            async for c in self.client.list(
                BranchClaim, namespace=namespace, fields={"spec.envelope": name}
            )
        ]
        leases = {}
        async for lease in self.client.list(
            Lease, namespace=namespace, labels={ENVELOPE_LABEL: name}
        ):
            body = lease.to_dict()
            leases[body["metadata"]["name"]] = body
        pods = await self._workload_pods(namespace, claims)
        envelope_facts, status = read.envelope_facts(envelope)
        claim_facts: list[ClaimFacts] = []
        invalid: list[tuple[dict[str, Any], read.InvalidClaim]] = []
        for claim in claims:
            claim_name = claim["metadata"]["name"]
            fact = read.claim_facts(claim, leases.get(claim_name), pods.get(claim_name))
            if isinstance(fact, read.InvalidClaim):
                invalid.append((claim, fact))
            else:
                claim_facts.append(fact)
        untouched = frozenset(fact.uid for _, fact in invalid)

        now = self.clock()
        result = reconcile(envelope_facts, status, claim_facts, now, untouched)
        if result.status != status:
            version = envelope["metadata"]["resourceVersion"]
            body = ReservationEnvelope.Status(
                metadata=ObjectMeta(name=name, namespace=namespace, resourceVersion=version),
                status=result.status.to_api(),
            )
            try:
                # lightkube types generic status bodies as resources; the call is right
                await self.client.replace(body, name, namespace=namespace)  # type: ignore[call-overload]
            except ApiError as error:
                if error.status.code == 409:
                    metrics.ledger_writes.labels(namespace, "conflict").inc()
                    return Conflict()
                raise
            metrics.ledger_writes.labels(namespace, "written").inc()
        else:
            metrics.ledger_writes.labels(namespace, "unchanged").inc()

        # The ledger is durable: now tell the world.
        by_uid = {c["metadata"]["uid"]: c for c in claims}
        self._announce(by_uid, result.events)
        self._announce_invalid(invalid)
        metrics.observe(namespace, name, result.status)
        metrics.count_events(namespace, name, result.events)
        await self._mirror(namespace, claims, result, now)
        return result

    async def _workload_pods(
        self, namespace: str, claims: list[dict[str, Any]]
    ) -> dict[str, list[Mapping[str, Any]]]:
        """Pods labelled with a claim's name, for claims whose commit point is a pod's
        binding or start. Listed only when some claim has such a commit point."""
        if all((c.get("spec") or {}).get("commitPoint", "Dispatch") == "Dispatch" for c in claims):
            return {}
        pods: dict[str, list[Mapping[str, Any]]] = {}
        async for pod in self.client.list(Pod, namespace=namespace, labels={CLAIM_LABEL: None}):
            body = pod.to_dict()
            pods.setdefault(body["metadata"]["labels"][CLAIM_LABEL], []).append(body)
        return pods

    def _announce_invalid(self, invalid: list[tuple[dict[str, Any], read.InvalidClaim]]) -> None:
        """One Event per unreadable spec version, not one per reconcile."""
        for claim, fact in invalid:
            version = (fact.uid, claim["metadata"]["resourceVersion"])
            if version not in self._reported_invalid:
                self._reported_invalid.add(version)
                self.record(claim, "Warning", "InvalidSpec", fact.problem)

    def _announce(self, claims: Mapping[str, Mapping[str, Any]], events: list[LedgerEvent]) -> None:
        for event in events:
            claim = claims.get(event.uid)
            if claim is not None:
                self.record(
                    claim, "Warning" if event.warning else "Normal", event.reason, event.message
                )

    async def _mirror(
        self,
        namespace: str,
        claims: list[dict[str, Any]],
        result: Reconciliation,
        now: datetime,
    ) -> None:
        """Write each claim's status from its ledger entry (or queue position), if it moved.
        Conditional on the claim's resourceVersion; a conflict just waits for the next
        reconcile, since the mirror can always be recomputed."""
        for claim in claims:
            meta = claim["metadata"]
            uid = meta["uid"]
            previous = read.claim_status(claim)
            entry = result.entry(uid)
            pending = result.pending.get(uid)
            if entry is None and pending is None:
                continue  # settled and pruned, or unreadable: leave its status alone
            deleting = bool(meta.get("deletionTimestamp"))
            wanted = claim_status(
                entry, pending, previous, meta.get("generation"), now, deleting=deleting
            )
            if previous is not None and wanted == previous:
                continue
            body = BranchClaim.Status(
                metadata=ObjectMeta(
                    name=meta["name"], namespace=namespace, resourceVersion=meta["resourceVersion"]
                ),
                status=wanted.to_api(),
            )
            try:
                await self.client.replace(body, meta["name"], namespace=namespace)  # type: ignore[call-overload]
            except ApiError as error:
                if error.status.code not in (404, 409):
                    raise
                self.poke(namespace, claim["spec"].get("envelope", ""))
