"""A tiny driver for the pure core: one envelope, its claims' facts, and a clock."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from reservoir.core.claimstatus import claim_status, settled_record
from reservoir.core.devices import DeviceFacts
from reservoir.core.lifecycle import ClaimFacts, LedgerEvent, PodFacts
from reservoir.core.model import (
    BranchClaimSpec,
    ClaimPhase,
    EnvelopePolicy,
    LedgerEntry,
    ReservationEnvelopeSpec,
    ReservationEnvelopeStatus,
)
from reservoir.core.provider import ProviderAnswer
from reservoir.core.quiet import QuietClaims
from reservoir.core.reconcile import EnvelopeFacts, Reconciliation, reconcile
from tests.unit.quiet_check import passing_quiet_by

T0 = datetime(2026, 1, 1, tzinfo=UTC)


class Sim:
    def __init__(
        self,
        capacity: dict[str, str] | None = None,
        contracts: dict[str, Any] | None = None,
        **policy: Any,
    ) -> None:
        spec = ReservationEnvelopeSpec.model_validate(
            {
                "capacity": capacity or {"tokens": "100"},
                "contracts": contracts or {},
                "policy": EnvelopePolicy(**policy),
            }
        )
        self.envelope = EnvelopeFacts(spec=spec, created_at=T0)
        self.status = ReservationEnvelopeStatus()
        self.claims: dict[str, ClaimFacts] = {}
        self.now = T0
        self.events: list[LedgerEvent] = []
        self.last: Reconciliation | None = None
        self.quiet: QuietClaims | None = None  # settled claims the last pass found quiet
        self.devices: dict[str, DeviceFacts] = {}  # claim uid -> its ResourceClaim

    # - time -
    def tick(self, seconds: float = 1) -> Sim:
        self.now += timedelta(seconds=seconds)
        return self

    # - declared facts -
    def create(self, name: str, requests: dict[str, str] | None = None, **spec: Any) -> Sim:
        branch = spec.pop("branch", name)
        full = BranchClaimSpec(
            envelope="env", branch=branch, requests=requests or {"tokens": "20"}, **spec
        )
        self.claims[name] = ClaimFacts(uid=name, name=name, created_at=self.now, spec=full)
        return self

    def update(self, name: str, **changes: Any) -> Sim:
        facts = self.claims[name]
        spec = BranchClaimSpec.model_validate({**facts.spec.model_dump(), **changes})
        self.claims[name] = replace(facts, spec=spec)
        return self

    def dispatch(self, name: str) -> Sim:
        return self.update(name, dispatch=True)

    def cancel(self, name: str) -> Sim:
        return self.update(name, cancel=True)

    def usage(
        self,
        name: str,
        tokens: str | None = None,
        final: bool = False,
        outcome: str | None = None,
        **other: str,
    ) -> Sim:
        """Cumulative usage: `tokens`, and other resources by keyword (`gpu` is
        nvidia.com/gpu)."""
        used = {"nvidia.com/gpu" if k == "gpu" else k: v for k, v in other.items()}
        if tokens is not None:
            used["tokens"] = tokens
        changes: dict[str, Any] = {"usage": used, "final": final}
        if final:
            changes["outcome"] = outcome or "Succeeded"
        return self.update(name, **changes)

    def heartbeat(self, name: str, token: str) -> Sim:
        self.claims[name] = replace(self.claims[name], heartbeat=token)
        return self

    def pod(
        self,
        name: str,
        scheduled: bool = False,
        running: bool = False,
        gated: bool = False,
        uid: str | None = None,
    ) -> Sim:
        """The claim's workload pod (one; `uid` names it, `<claim>-pod` by default)."""
        uid = uid or f"{name}-pod"
        pod = PodFacts(
            scheduled=scheduled,
            running=running,
            gated=gated,
            gated_pod=uid if gated else None,
            uids=frozenset({uid}),
            gated_uids=frozenset({uid}) if gated else frozenset(),
        )
        self.claims[name] = replace(self.claims[name], pod=pod)
        return self

    def no_pod(self, name: str) -> Sim:
        self.claims[name] = replace(self.claims[name], pod=None)
        return self

    def allocate(
        self,
        name: str,
        node: str = "gpu-node-0",
        devices: tuple[str, ...] = ("gpu-0",),
        held: bool = True,
    ) -> Sim:
        """The scheduler allocated the claim's ResourceClaim (and bound its placeholder)."""
        self.devices[name] = DeviceFacts(node=node, devices=devices, held=held)
        return self

    def unschedulable(self, name: str, why: str) -> Sim:
        self.devices[name] = DeviceFacts(waiting=why)
        return self

    def deallocate(self, name: str) -> Sim:
        """The claim's ResourceClaim is gone (its allocation with it)."""
        self.devices.pop(name, None)
        return self

    def delete(self, name: str) -> Sim:
        self.claims[name] = replace(self.claims[name], deleting=True)
        return self

    def remove(self, name: str) -> Sim:
        del self.claims[name]
        return self

    def provider(self, name: str, answer: ProviderAnswer | None) -> Sim:
        """What a provider lookup made for the next reconcile says (None: no lookup)."""
        self.claims[name] = replace(self.claims[name], provider=answer)
        return self

    def force(self, name: str, why: str) -> Sim:
        self.claims[name] = replace(self.claims[name], force_settle=why)
        return self

    def force_gone(self, name: str, why: str) -> Sim:
        """The envelope's reservoir.dev/force-settle-gone annotation names a claim."""
        named = {**self.envelope.force_settle_gone, name: why}
        self.envelope = replace(self.envelope, force_settle_gone=named)
        return self

    def mirror(self) -> Sim:
        """Claim statuses catch up with the ledger, as the writer's mirror does."""
        assert self.last is not None
        for name, facts in self.claims.items():
            entry = self.last.entry(facts.uid)
            if entry is None or entry.settlement is None:
                continue
            status = claim_status(entry, None, None, None, self.now)
            record = settled_record(status, facts.uid, name, facts.spec.attempt)
            self.claims[name] = replace(facts, settled_record=record)
        return self

    def write_lines(self, only: set[str] | None = None) -> Sim:
        """The writer's mirror of ledger lines: each claim's status gets its line, with the
        stamp of the envelope write that recorded it (`only`: just these claims, as when
        the operator dies part way through a mirror)."""
        assert self.last is not None
        for uid, line in self.last.to_claims.items():
            facts = self.claims.get(uid)
            if facts is None or (only is not None and uid not in only):
                continue
            record = facts.settled_record
            if line.phase.terminal and line.settlement is not None:
                record = line.model_copy(deep=True)
            self.claims[uid] = replace(
                facts, line=line.model_copy(deep=True), settled_record=record
            )
        return self

    def close(self) -> Sim:
        spec = {**self.envelope.spec.model_dump(), "state": "Closed"}
        self.envelope = replace(self.envelope, spec=ReservationEnvelopeSpec.model_validate(spec))
        return self

    # - the operator -
    def reconcile(self, departed: dict[str, LedgerEntry] | None = None, fresh: bool = True) -> Sim:
        claims = list(self.claims.values())
        self.last = passing_quiet_by(
            lambda quiet: reconcile(
                self.envelope, self.status, claims, self.now, self.devices, departed, fresh, quiet
            ),
            self.quiet,
        )
        self.status, self.quiet = self.last.status, self.last.quiet
        self.events += self.last.events
        return self

    # - reading -
    def entry(self, name: str) -> LedgerEntry:
        if name in self.status.entries:
            return self.status.entries[name]
        if self.last is not None and name in self.last.lines:
            return self.last.lines[name]
        record = self.claims[name].settled_record if name in self.claims else None
        assert record is not None, f"{name} has no entry and no settled record"
        return record

    def phase(self, name: str) -> ClaimPhase:
        in_view = self.last is not None and name in self.last.lines
        if not in_view and (name not in self.claims or self.claims[name].settled_record is None):
            return ClaimPhase.PENDING
        return self.entry(name).phase

    def available(self, resource: str = "tokens") -> str:
        return str(self.status.totals.available[resource])

    def total(self, part: str, resource: str = "tokens") -> str:
        return str(getattr(self.status.totals, part)[resource])

    def reasons(self, name: str) -> list[str]:
        return [e.reason for e in self.events if e.claim == name]
