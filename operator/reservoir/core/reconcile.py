"""One envelope's reconcile: from its spec, its current ledger and the facts of its claims,
compute the next ledger. Level-triggered and idempotent: the result depends only on the
inputs, and feeding it back with the same facts changes nothing.

The operator calls this once per batch of claim events (group commit) and writes the
result with one compare-and-swap; on a conflict it re-reads and calls it again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from reservoir.core.conditions import Desired, merge_conditions
from reservoir.core.ledger import add, compute_totals, render, subtract
from reservoir.core.lifecycle import (
    ClaimFacts,
    LedgerEvent,
    Step,
    advance,
    record_after_settlement,
    settle,
)
from reservoir.core.model import (
    BranchClaimSpec,
    ClaimPhase,
    EnvelopePhase,
    EnvelopeState,
    EnvelopeSummary,
    Fallback,
    Intent,
    LedgerEntry,
    Overrun,
    ReservationEnvelopeSpec,
    ReservationEnvelopeStatus,
)
from reservoir.core.policy import (
    Admission,
    QueueKey,
    admission,
    ambiguity_deadline,
    first_expiry,
    queue_expired,
    request_problem,
)


@dataclass(frozen=True)
class EnvelopeFacts:
    spec: ReservationEnvelopeSpec
    created_at: datetime
    generation: int = 1
    deleting: bool = False

    def expired(self, now: datetime) -> bool:
        lifetime = self.spec.lifetime_seconds
        return lifetime is not None and now >= self.created_at + timedelta(seconds=lifetime)

    def accepting(self, now: datetime) -> bool:
        return not (self.deleting or self.spec.state is EnvelopeState.CLOSED or self.expired(now))


@dataclass
class Reconciliation:
    status: ReservationEnvelopeStatus
    now: datetime
    events: list[LedgerEvent] = field(default_factory=list)
    pending: dict[str, Admission] = field(default_factory=dict)  # claim uid -> why waiting
    wake_at: datetime | None = None  # when to reconcile again even without new facts

    def entry(self, uid: str) -> LedgerEntry | None:
        return self.status.entries.get(uid)


def reconcile(
    envelope: EnvelopeFacts,
    status: ReservationEnvelopeStatus,
    claims: Sequence[ClaimFacts],
    now: datetime,
    untouched: frozenset[str] = frozenset(),
) -> Reconciliation:
    """`untouched` names claims whose facts cannot be read right now (say, a spec the
    operator cannot parse): their entries are left exactly as they are."""
    result = Reconciliation(status=status.model_copy(deep=True), now=now)
    ledger = result.status
    policy = envelope.spec.policy
    facts_by_uid = {c.uid: _effective(c, envelope) for c in claims}
    committed = dict(ledger.totals.committed)

    # 1. Advance every admitted claim by its facts; claims gone without settling are
    #    treated as deleted (a claim's finalizer normally prevents that).
    for uid, entry in list(ledger.entries.items()):
        if uid in untouched:
            continue
        facts = facts_by_uid.get(uid)
        if facts is None:
            if entry.phase.terminal:
                continue  # settled and gone: pruned below
            facts = _gone(uid, entry)
        was_settled = entry.settlement is not None
        result.events += advance(entry, facts, policy, now)
        if not was_settled and entry.settlement is not None:
            committed = add(committed, entry.consumed)

    # 2. Admit waiting claims in queue order.
    waiting = [
        c for c in facts_by_uid.values() if c.uid not in ledger.entries and not c.settled_key
    ]
    waiting.sort(key=lambda c: QueueKey(c.spec.priority, c.created_at, c.name, c.uid).sort_key())
    blocked_by: str | None = None
    balance = compute_totals(envelope.spec.capacity, committed, ledger.entries.values()).available
    for facts in waiting:
        blocked_by = _admit_one(result, envelope, facts, balance, blocked_by, now)

    # 3. Forget settled entries whose claims are gone.
    for uid in [u for u, e in ledger.entries.items() if e.phase.terminal]:
        if uid not in facts_by_uid and uid not in untouched:
            del ledger.entries[uid]

    ledger.totals = compute_totals(envelope.spec.capacity, committed, ledger.entries.values())
    _envelope_lifecycle(result, envelope, now)
    result.wake_at = next_deadline(result, envelope, waiting)
    return result


def next_deadline(
    result: Reconciliation, envelope: EnvelopeFacts, waiting: Sequence[ClaimFacts]
) -> datetime | None:
    """The next moment the ledger changes with no new facts: a lease end, an ambiguity
    deadline, a queue-age limit or the envelope's own lifetime."""
    policy = envelope.spec.policy
    moments: list[datetime] = []
    for entry in result.status.entries.values():
        if entry.phase.holds_capacity and entry.phase is not ClaimPhase.DETACHED:
            moments += [entry.expires_at] if entry.expires_at else []
        deadline = ambiguity_deadline(entry, policy)
        if entry.phase is ClaimPhase.DETACHED and deadline and entry.deadline_action is None:
            moments.append(deadline)
    for facts in waiting:
        if facts.uid in result.pending:
            moments.append(facts.created_at + timedelta(seconds=policy.max_queue_seconds))
    if envelope.spec.lifetime_seconds is not None and result.status.closed_at is None:
        moments.append(envelope.created_at + timedelta(seconds=envelope.spec.lifetime_seconds))
    return min(moments, default=None)


def _effective(facts: ClaimFacts, envelope: EnvelopeFacts) -> ClaimFacts:
    """Deleting an envelope cancels its children first."""
    if envelope.deleting and not facts.deleting:
        return ClaimFacts(**{**facts.__dict__, "deleting": True})
    return facts


def _gone(uid: str, entry: LedgerEntry) -> ClaimFacts:
    spec = BranchClaimSpec(
        envelope="-", attempt=entry.attempt, requests=entry.reserved, intent=Intent.CANCEL
    )
    return ClaimFacts(
        uid=uid,
        name=entry.claim,
        created_at=entry.first_reserved_at or datetime.min.replace(tzinfo=UTC),
        spec=spec,
        deleting=True,
    )


def _new_entry(facts: ClaimFacts, reserved: dict[str, Decimal]) -> LedgerEntry:
    return LedgerEntry(
        claim=facts.name,
        branch=facts.spec.branch,
        attempt=facts.spec.attempt,
        phase=ClaimPhase.PENDING,
        reserved=reserved,
    )


def _close_unadmitted(
    result: Reconciliation, facts: ClaimFacts, phase: ClaimPhase, reason: str, message: str
) -> None:
    """Settle a claim that never held anything (rejected, or cancelled while waiting)."""
    entry = _new_entry(facts, {})
    step = Step(entry, facts, result.now)
    settle(step, phase, reason, message=message, outcome=facts.spec.outcome)
    # What the claim already declares (a Dispatch, a usage report) is recorded now, so a
    # replay of the same facts finds nothing left to do.
    record_after_settlement(step)
    result.status.entries[facts.uid] = entry
    result.events += step.events


def _admit_one(
    result: Reconciliation,
    envelope: EnvelopeFacts,
    facts: ClaimFacts,
    available: dict[str, Decimal],
    blocked_by: str | None,
    now: datetime,
) -> str | None:
    """Admit, reject or queue one waiting claim. Returns the name blocking the queue.
    `available` is this pass's running balance: admitting a claim draws it down."""
    spec, policy = facts.spec, envelope.spec.policy
    if facts.cancelling:
        reason = "DeletedWhilePending" if facts.deleting else "CancelledWhilePending"
        _close_unadmitted(result, facts, ClaimPhase.RELEASED, reason, "pruned before it reserved")
        return blocked_by
    problem = request_problem(spec.requests, envelope.spec.capacity)
    if problem is not None:
        _close_unadmitted(result, facts, ClaimPhase.REJECTED, problem.reason, problem.message)
        return blocked_by
    if not envelope.accepting(now):
        _close_unadmitted(
            result, facts, ClaimPhase.REJECTED, "EnvelopeClosed", "the envelope admits no claims"
        )
        return blocked_by
    if spec.final:
        _close_unadmitted(
            result, facts, ClaimPhase.RELEASED, "FinishedBeforeAdmission", "finished unadmitted"
        )
        if any(spec.usage.values()):
            # Work that ran without ever holding a reservation: the envelope is not
            # overdrawn for it, and the report is kept as an overrun for people to see.
            entry = result.status.entries[facts.uid]
            entry.overrun = Overrun(usage=dict(spec.usage), final=True, at=now)
            result.events.append(
                LedgerEvent(
                    facts.uid, facts.name, "Overrun",
                    "usage reported by a claim that never held a reservation: kept in "
                    "status.overrun, not charged to the envelope", True,
                )
            )  # fmt: skip
        return blocked_by
    if queue_expired(facts.created_at, now, policy):
        _close_unadmitted(
            result,
            facts,
            ClaimPhase.REJECTED,
            "MaxQueueAge",
            f"still pending after {policy.max_queue_seconds}s",
        )
        return blocked_by
    if blocked_by is not None:
        result.pending[facts.uid] = Admission(
            False, "Queued", f"queued behind {blocked_by} (priority, then age)"
        )
        return blocked_by

    entries = result.status.entries
    live = [e for e in entries.values() if e.phase.holds_capacity]
    decision = admission(
        spec.requests,
        available,
        live,
        len(entries),
        will_be_tentative=spec.intent is Intent.HOLD,
        policy=policy,
    )
    if not decision.admitted:
        if policy.fallback is Fallback.FAIL:
            _close_unadmitted(result, facts, ClaimPhase.REJECTED, decision.reason, decision.message)
            return blocked_by
        result.pending[facts.uid] = decision
        # Only a shortage blocks the queue behind it: a tentative-claim cap does not stop a
        # dispatched claim, and the other caps stop everyone anyway.
        return facts.name if decision.reason == "InsufficientCapacity" else blocked_by

    available.update(subtract(available, spec.requests))
    entry = _new_entry(facts, dict(spec.requests))
    entry.phase = ClaimPhase.TENTATIVE
    entry.first_reserved_at = now
    entry.expires_at = first_expiry(now, spec.lease.duration_seconds, policy)
    entry.heartbeat = facts.heartbeat  # the heartbeat at admission is not a renewal
    entries[facts.uid] = entry
    result.events.append(
        LedgerEvent(facts.uid, facts.name, "Reserved", "capacity reserved", False, entry.phase)
    )
    # A claim created already dispatched (the lazy strategy) reserves and commits at once.
    result.events += advance(entry, facts, policy, now)
    return blocked_by


def _envelope_lifecycle(result: Reconciliation, envelope: EnvelopeFacts, now: datetime) -> None:
    ledger = result.status
    live = any(e.phase.holds_capacity for e in ledger.entries.values())
    if envelope.accepting(now):
        ledger.phase = EnvelopePhase.OPEN
    else:
        settled = not live and not result.pending
        if envelope.expired(now):
            ledger.phase = EnvelopePhase.EXPIRED
        else:
            ledger.phase = EnvelopePhase.CLOSED if settled else EnvelopePhase.CLOSING
        if settled and ledger.closed_at is None:
            # Every child has settled: the remaining balance goes back to the cluster.
            ledger.balance_released = dict(ledger.totals.available)
            ledger.closed_at = now
    counts: dict[str, int] = {}
    for entry in ledger.entries.values():
        counts[entry.phase.value] = counts.get(entry.phase.value, 0) + 1
    if result.pending:
        counts[ClaimPhase.PENDING.value] = len(result.pending)
    ledger.counts = dict(sorted(counts.items()))
    ledger.summary = EnvelopeSummary(
        capacity=render(ledger.totals.capacity),
        available=render(ledger.totals.available),
        committed=render(ledger.totals.committed),
        live=sum(1 for e in ledger.entries.values() if e.phase.holds_capacity),
    )
    open_ = ledger.phase is EnvelopePhase.OPEN
    ledger.conditions = merge_conditions(
        ledger.conditions,
        [
            Desired("Open", open_, ledger.phase.value, "admits claims" if open_ else ""),
            Desired(
                "Settled",
                ledger.closed_at is not None,
                "BalanceReleased" if ledger.closed_at else "ClaimsLive",
                "every claim settled and the balance was released" if ledger.closed_at else "",
            ),
        ],
        now,
        envelope.generation,
    )
    ledger.observed_generation = envelope.generation
