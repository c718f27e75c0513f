"""A model-based audit of the ledger, in the style of TigerBeetle's auditor.

Hypothesis drives random envelopes and claims through random, duplicated, reordered and
stale events (dispatch and cancel facts, cumulative usage, overruns, final reports,
heartbeats, lease expiry, deletion, the mirror of settled claims into their own status and
the ledger's compaction, crashes that drop a computed ledger before it is written). An
independent auditor, which shares no code with the core's arithmetic, checks after every
step that:

- committed + reserved + reconciling + available == capacity, per dimension, none negative;
- no claim settles twice, and a terminal state never changes;
- settlement never returns more than was reserved (consumed + released == reserved);
- capacity of a committed claim returns only on a final report or a deadline decision;
- a claim settles on the usage the operator saw: min(usage, R) per resource for a final
  report (an overrun is charged R, never more), the running maximum of that for a Release
  at the deadline, R for Quarantine, nothing for a claim that never committed;
- total committed == the sum of those charges, counted by the auditor itself as
  settlements appear, also after settled entries are compacted out of the ledger.
The coalescing invariance (same settlement whatever the operator missed) is audited in
test_coalescing.py.
"""

from __future__ import annotations

import os
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from reservoir.core.claimstatus import claim_status, settled_record
from reservoir.core.lifecycle import ClaimFacts
from reservoir.core.model import (
    BranchClaimSpec,
    EnvelopePolicy,
    ReservationEnvelopeSpec,
    ReservationEnvelopeStatus,
    Settlement,
)
from reservoir.core.reconcile import EnvelopeFacts, reconcile

RESOURCES = ("tokens", "gpu")
T0 = datetime(2026, 1, 1, tzinfo=UTC)


class LedgerAudit(RuleBasedStateMachine):
    claims = Bundle("claims")

    def __init__(self) -> None:
        super().__init__()
        self.facts: dict[str, ClaimFacts] = {}
        self.history: list[dict[str, ClaimFacts]] = []  # past views, for stale reconciles
        self.status = ReservationEnvelopeStatus()  # what is "persisted"
        self.now = T0
        self.counter = 0
        # the auditor's own books
        self.settled: dict[str, Settlement] = {}
        self.settled_amounts: dict[str, tuple[dict[str, Decimal], dict[str, Decimal]]] = {}
        self.expected_committed: dict[str, Decimal] = {r: Decimal(0) for r in RESOURCES}
        self.seen_committed: set[str] = set()
        self.seen_usage: dict[str, dict[str, Decimal]] = {}  # auditor's max(min(usage, R))

    @initialize(
        tokens=st.integers(0, 200),
        gpu=st.integers(0, 16),
        lease=st.integers(1, 60),
        deadline_action=st.sampled_from(["Hold", "Quarantine", "Release"]),
        max_active=st.one_of(st.none(), st.integers(1, 6)),
        fallback=st.sampled_from(["Wait", "Fail"]),
    )
    def envelope(
        self,
        tokens: int,
        gpu: int,
        lease: int,
        deadline_action: str,
        max_active: int | None,
        fallback: str,
    ) -> None:
        policy = EnvelopePolicy(
            default_lease_seconds=lease,
            max_claim_lifetime_seconds=lease * 3,
            ambiguity_deadline_seconds=lease * 2,
            at_ambiguity_deadline=deadline_action,  # type: ignore[arg-type]
            max_active_claims=max_active,
            fallback=fallback,  # type: ignore[arg-type]
            max_queue_seconds=200,
        )
        spec = ReservationEnvelopeSpec(capacity={"tokens": tokens, "gpu": gpu}, policy=policy)
        self.envelope_facts = EnvelopeFacts(spec=spec, created_at=T0)

    # --- declared facts (always valid per the CRD's CEL rules) ---------------------------

    @rule(
        target=claims,
        tokens=st.integers(0, 80),
        gpu=st.integers(0, 4),
        dispatched=st.booleans(),
        priority=st.integers(0, 3),
    )
    def create(self, tokens: int, gpu: int, dispatched: bool, priority: int) -> str:
        self.counter += 1
        uid = f"c{self.counter}"
        spec = BranchClaimSpec(
            envelope="env",
            requests={"tokens": tokens, "gpu": gpu},
            dispatch=dispatched,
            priority=priority,
        )
        self.facts[uid] = ClaimFacts(uid=uid, name=uid, created_at=self.now, spec=spec)
        return uid

    def _update(self, uid: str, **changes: object) -> None:
        if uid not in self.facts:
            return
        facts = self.facts[uid]
        spec = BranchClaimSpec.model_validate({**facts.spec.model_dump(), **changes})
        self.facts[uid] = replace(facts, spec=spec)

    @rule(uid=claims)
    def dispatch(self, uid: str) -> None:
        facts = self.facts.get(uid)
        if facts is not None and not facts.spec.cancel:  # CEL: no dispatch after cancel
            self._update(uid, dispatch=True)

    @rule(uid=claims)
    def cancel(self, uid: str) -> None:
        self._update(uid, cancel=True)

    @rule(uid=claims, extra=st.integers(0, 30))
    def report_usage(self, uid: str, extra: int) -> None:
        facts = self.facts.get(uid)
        if facts is None or facts.spec.final:
            return
        if (facts.spec.cancel or facts.deleting) and not facts.spec.dispatch:
            return  # API server: a branch pruned before dispatch never ran
        usage = dict(facts.spec.usage)
        usage["tokens"] = usage.get("tokens", Decimal(0)) + extra  # cumulative, never less
        self._update(uid, usage=usage)

    @rule(uid=claims, outcome=st.sampled_from(["Succeeded", "Failed", "Cancelled"]))
    def finish(self, uid: str, outcome: str) -> None:
        facts = self.facts.get(uid)
        if facts is None or facts.spec.final:
            return
        self._update(uid, final=True, outcome=outcome)

    @rule(uid=claims, token=st.integers(0, 5))
    def heartbeat(self, uid: str, token: int) -> None:
        if uid in self.facts:
            self.facts[uid] = replace(self.facts[uid], heartbeat=f"hb-{token}")

    @rule(uid=claims)
    def delete(self, uid: str) -> None:
        if uid in self.facts:
            self.facts[uid] = replace(self.facts[uid], deleting=True)

    @rule(uid=consumes(claims), force=st.booleans())
    def remove(self, uid: str, force: bool) -> None:
        """The claim object disappears: normally only once its entry settled (finalizer);
        `force` models a finalizer removed by hand."""
        entry = self.status.entries.get(uid)
        settled = entry is None or entry.phase.terminal
        if uid in self.facts and (settled or force) and self.facts[uid].deleting:
            del self.facts[uid]

    @rule(seconds=st.integers(0, 90))
    def tick(self, seconds: int) -> None:
        self.now += timedelta(seconds=seconds)

    # --- the operator --------------------------------------------------------------------

    def _reconcile(self, facts: dict[str, ClaimFacts]) -> ReservationEnvelopeStatus:
        # What the operator sees is what it may charge: the auditor keeps its own running
        # maximum of min(usage, R) for every claim that holds a reservation.
        for uid, fact in facts.items():
            entry = self.status.entries.get(uid)
            if entry is None or not entry.phase.holds_capacity:
                continue
            seen = self.seen_usage.setdefault(uid, {})
            for resource, amount in fact.spec.usage.items():
                capped = min(amount, entry.reserved.get(resource, Decimal(0)))
                seen[resource] = max(seen.get(resource, Decimal(0)), capped)
        result = reconcile(self.envelope_facts, self.status, list(facts.values()), self.now)
        # A claim whose object vanished unsettled may settle and leave the ledger in one
        # pass: the auditor reads that settlement from the pass's events instead.
        for uid, before in self.status.entries.items():
            if uid in result.status.entries or before.phase.terminal or uid in facts:
                continue
            settled = [e for e in result.events if e.uid == uid and e.phase and e.phase.terminal]
            assert len(settled) == 1, f"{uid} left the ledger without one settlement"
            reason = settled[0].reason
            if reason == "AmbiguityDeadlineQuarantine":
                charged = dict(before.reserved)
            elif reason in ("AmbiguityDeadlineRelease", "ForceSettled"):
                charged = dict(self.seen_usage.get(uid, {}))
            else:
                assert before.committed_at is None or reason in (
                    "Completed",
                    "SettledAfterDetach",
                ), f"{uid} committed, then returned capacity by {reason}"
                charged = {}
            self.settled[uid] = Settlement(
                key=uid, phase=settled[0].phase, reason=reason, at=self.now
            )
            for resource, amount in charged.items():
                self.expected_committed[resource] += amount
        for uid, entry in result.status.entries.items():
            if uid not in self.status.entries and entry.phase.holds_capacity:
                fact = facts[uid]
                self.seen_usage[uid] = {
                    r: min(a, entry.reserved.get(r, Decimal(0))) for r, a in fact.spec.usage.items()
                }
        return result.status

    @rule()
    def reconcile_and_write(self) -> None:
        self.history.append(dict(self.facts))
        self.status = self._reconcile(self.facts)
        self._audit_new_settlements()

    @rule()
    def replay(self) -> None:
        """The same facts at the same moment again (a duplicated event) change nothing."""
        first = self._reconcile(self.facts)
        self.status = first
        self._audit_new_settlements()
        again = self._reconcile(self.facts)
        assert again == first, "a replayed reconcile changed the ledger"

    @rule(back=st.integers(1, 5))
    def stale_view(self, back: int) -> None:
        """A reconcile from an older cache of the claims (stale, reordered events)."""
        if len(self.history) < back:
            return
        old = self.history[-back]
        # Old facts for every claim that still exists. A claim missing from the cache is
        # confirmed by a direct read before it counts as gone (the adapter's contract), so
        # a stale view never hides a live claim.
        # The claims are listed after the envelope is read, so the settled records that a
        # compaction in this ledger relied on are always in the view (the adapter's other
        # contract); the declared facts may be as old as you like.
        stale = {
            uid: replace(old.get(uid, facts), settled_record=facts.settled_record)
            for uid, facts in self.facts.items()
        }
        self.status = self._reconcile(stale)
        self._audit_new_settlements()

    @rule()
    def mirror(self) -> None:
        """The claim statuses catch up with the ledger: settled claims carry their record,
        and the next reconcile compacts their entries away."""
        for uid, entry in self.status.entries.items():
            facts = self.facts.get(uid)
            if facts is None or entry.settlement is None:
                continue
            status = claim_status(entry, None, None, None, self.now)
            record = settled_record(status, uid, facts.name, facts.spec.attempt)
            assert record is not None, "a settled claim's status must carry its record"
            self.facts[uid] = replace(facts, settled_record=record)

    @rule()
    def crash_before_write(self) -> None:
        """The operator computes a ledger and dies before its CAS write: nothing changes,
        and nothing it computed is booked by the auditor either (found when a vanished
        claim's settlement, computed in a pass never written, was booked as if it had been)."""
        before = self.status.model_copy(deep=True)
        reconcile(self.envelope_facts, self.status, list(self.facts.values()), self.now)
        assert self.status == before, "a reconcile changed the ledger it was given"

    # --- the auditor ---------------------------------------------------------------------

    def _audit_new_settlements(self) -> None:
        for uid, entry in self.status.entries.items():
            if entry.phase.committed:
                self.seen_committed.add(uid)
            if entry.settlement is None:
                continue
            if uid in self.settled:
                continue
            self.settled[uid] = entry.settlement
            self.settled_amounts[uid] = (dict(entry.consumed), dict(entry.released))
            reason = entry.settlement.reason
            facts = self.facts.get(uid)
            seen = self.seen_usage.get(uid, {})
            if reason in ("Completed", "SettledAfterDetach"):
                assert facts is not None and facts.spec.final
                expected = {
                    r: min(a, entry.reserved.get(r, Decimal(0)))
                    for r, a in facts.spec.usage.items()
                }
            elif reason == "AmbiguityDeadlineQuarantine":
                expected = dict(entry.reserved)
            elif reason == "AmbiguityDeadlineRelease":
                expected = dict(seen)
            else:
                expected = {}
            assert {k: v for k, v in entry.consumed.items() if v} == {
                k: v for k, v in expected.items() if v
            }, f"{uid} settled {reason} with consumed {entry.consumed}, expected {expected}"
            for resource, amount in expected.items():
                self.expected_committed[resource] += amount
            if uid in self.seen_committed and reason not in (
                "Completed",
                "SettledAfterDetach",
                "AmbiguityDeadlineQuarantine",
                "AmbiguityDeadlineRelease",
            ):
                raise AssertionError(f"{uid} committed, then returned capacity by {reason}")

    @invariant()
    def capacity_is_conserved_in_every_dimension(self) -> None:
        totals = self.status.totals
        if not totals.capacity:
            return
        held = {r: Decimal(0) for r in RESOURCES}
        reconciling = {r: Decimal(0) for r in RESOURCES}
        for entry in self.status.entries.values():
            bucket = {
                "Tentative": held,
                "Committed": held,
                "Running": held,
                "Detached": reconciling,
            }.get(entry.phase.value)
            if bucket is not None:
                for r, v in entry.reserved.items():
                    bucket[r] += v
        for r in RESOURCES:
            parts = (
                totals.committed[r],
                totals.reserved[r],
                totals.reconciling[r],
                totals.available[r],
            )
            assert all(p >= 0 for p in parts), (r, parts)
            assert sum(parts) == totals.capacity[r], (r, parts)
            assert totals.reserved[r] == held[r]
            assert totals.reconciling[r] == reconciling[r]

    @invariant()
    def committed_is_exactly_the_accepted_final_usage(self) -> None:
        if self.status.totals.committed:
            for r in RESOURCES:
                assert self.status.totals.committed[r] == self.expected_committed[r]

    @invariant()
    def settlements_never_change_and_never_return_more_than_reserved(self) -> None:
        for uid, entry in self.status.entries.items():
            if uid in self.settled:
                assert entry.settlement == self.settled[uid], f"{uid} settled twice"
                assert (dict(entry.consumed), dict(entry.released)) == self.settled_amounts[uid]
                assert entry.phase.terminal
            if entry.settlement is not None:
                for r, reserved in entry.reserved.items():
                    consumed = entry.consumed.get(r, Decimal(0))
                    released = entry.released.get(r, Decimal(0))
                    assert consumed >= 0 and released >= 0
                    assert consumed + released == reserved


LedgerAudit.TestCase.settings = settings(
    max_examples=int(os.environ.get("RESERVOIR_AUDIT_EXAMPLES", "200")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_ledger_audit = LedgerAudit.TestCase
