"""The claim state machine: one claim's ledger entry, advanced by the facts declared about it.

    Pending ─admit─▶ Tentative ─commit point─▶ Committed ─started─▶ Running
                        │  │                       │  └──────lease lapses──────┐
            cancel/prune│  │lease lapses           │final report              ▼
                        ▼  ▼                       ▼                      Detached
                  Released Expired             Consumed (C; R − C returned)   │
                                                   ▲───── final report ───────┤
                                                   └── deadline: Quarantine ──┤
                                          Released ◀── deadline: Release ─────┘

Capacity returns only on confirmed facts: durable non-execution (cancel before the commit
point, lease lapse before it), a final usage report, or a recorded deadline decision.
Cancel after the commit point is a request, not a release. Terminal states are final: a
later report is recorded as late and never reopens the settlement.

Every function here is deterministic in its inputs (including `now`), so replaying the
same facts changes nothing twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal

from reservoir.core.ledger import ZERO, exceeds, subtract
from reservoir.core.model import (
    BranchClaimSpec,
    ClaimPhase,
    CommitPoint,
    DeadlineAction,
    EnvelopePolicy,
    Intent,
    LateReport,
    LedgerEntry,
    Outcome,
    Overrun,
    Settlement,
    UpstreamState,
)
from reservoir.core.policy import ambiguity_deadline, renewal

SETTLEMENT_VERSION = 1


@dataclass(frozen=True)
class PodFacts:
    """What the claim's workload pod shows (for PodScheduled/PodRunning commit points)."""

    scheduled: bool = False
    running: bool = False
    gone: bool = False


@dataclass(frozen=True)
class ClaimFacts:
    """Everything the operator knows about one claim: its declared spec plus observations."""

    uid: str
    name: str
    created_at: datetime  # set by the API server: the claim's queue age
    spec: BranchClaimSpec
    deleting: bool = False
    heartbeat: str | None = None  # opaque token of the lease holder's latest heartbeat
    pod: PodFacts | None = None
    settled_key: str | None = None  # from claim status, once mirrored
    force_settle: str | None = None  # an operator's audited decision (the annotation's text)

    @property
    def cancelling(self) -> bool:
        return self.deleting or self.spec.intent is Intent.CANCEL


@dataclass(frozen=True)
class LedgerEvent:
    """Something worth a Kubernetes Event and a metric: a transition or a refusal."""

    uid: str
    claim: str
    reason: str
    message: str
    warning: bool = False
    phase: ClaimPhase | None = None  # set when the event is a phase transition


@dataclass
class Step:
    """The entry being advanced and what happened to it."""

    entry: LedgerEntry
    facts: ClaimFacts
    now: datetime
    events: list[LedgerEvent] = field(default_factory=list)

    def note(self, reason: str, message: str, warning: bool = False) -> None:
        self.events.append(LedgerEvent(self.facts.uid, self.facts.name, reason, message, warning))

    def move(self, phase: ClaimPhase, reason: str, message: str) -> None:
        self.entry.phase = phase
        self.events.append(
            LedgerEvent(self.facts.uid, self.facts.name, reason, message, False, phase)
        )


def settlement_key(facts: ClaimFacts) -> str:
    return f"{facts.uid}/{facts.spec.attempt}/{SETTLEMENT_VERSION}"


def settle(
    step: Step,
    phase: ClaimPhase,
    reason: str,
    consumed: Mapping[str, Decimal] | None = None,
    outcome: Outcome | None = None,
    message: str = "",
) -> None:
    """The one settlement: commit C, return R − C. Never applied twice."""
    entry = step.entry
    assert entry.settlement is None and not entry.phase.terminal, "settles at most once"
    entry.consumed = dict(consumed or {})
    entry.released = subtract(entry.reserved, entry.consumed)
    entry.settlement = Settlement(
        key=settlement_key(step.facts), phase=phase, reason=reason, outcome=outcome, at=step.now
    )
    # The report as it stands at settlement is the baseline: only a different one is late.
    spec = step.facts.spec
    entry.late = LateReport(usage=dict(spec.usage), final=spec.final, outcome=spec.outcome)
    step.move(phase, reason, message or f"settled: {reason}")


# --- reading the facts -----------------------------------------------------------------


def crossed_commit_point(facts: ClaimFacts) -> bool:
    spec, pod = facts.spec, facts.pod
    if spec.commit_point is CommitPoint.DISPATCH:
        return spec.intent is Intent.DISPATCH
    if pod is None:
        return False
    if spec.commit_point is CommitPoint.POD_SCHEDULED:
        return pod.scheduled or pod.running
    return pod.running


def shows_execution(facts: ClaimFacts, usage_accepted: bool) -> bool:
    """Evidence that work started: usage, a provider's start, a running pod."""
    spec = facts.spec
    used = usage_accepted and any(v > ZERO for v in spec.usage.values())
    pod_running = facts.pod is not None and facts.pod.running
    return used or pod_running or spec.upstream.state is UpstreamState.RUNNING


def shows_acceptance(facts: ClaimFacts) -> bool:
    """A provider that accepted the work owns it now: the claim is past its commit point."""
    return facts.spec.upstream.state in (UpstreamState.ACCEPTED, UpstreamState.RUNNING)


# --- the step --------------------------------------------------------------------------


def advance(
    entry: LedgerEntry, facts: ClaimFacts, policy: EnvelopePolicy, now: datetime
) -> list[LedgerEvent]:
    """Advance one admitted claim's entry by its facts, in place. Returns what happened."""
    step = Step(entry, facts, now)
    if entry.phase.terminal:
        record_after_settlement(step)
        return step.events

    usage_accepted = check_usage(step)
    if facts.force_settle is not None:
        force_settle(step, facts.force_settle)
        return step.events
    if entry.phase is ClaimPhase.TENTATIVE:
        advance_tentative(step, usage_accepted)
    # After the commit-point check: a commit seen only after the lease lapsed may have
    # happened before it, so the claim is Detached (held), never Expired (returned).
    expire_lease(step)
    if entry.phase in (ClaimPhase.COMMITTED, ClaimPhase.RUNNING, ClaimPhase.DETACHED):
        advance_committed(step, usage_accepted, policy)
    if not entry.phase.terminal:
        renew_lease(step, policy)
    return step.events


def check_usage(step: Step) -> bool:
    """Accept a cumulative usage report within R; reject (and preserve) one above it."""
    entry, spec = step.entry, step.facts.spec
    over = exceeds(spec.usage, entry.reserved)
    if over:
        report = Overrun(usage=dict(spec.usage), final=spec.final, at=step.now)
        if entry.overrun is None or (entry.overrun.usage, entry.overrun.final) != (
            report.usage,
            report.final,
        ):
            entry.overrun = report
            step.note(
                "Overrun",
                f"usage above the reservation rejected for {', '.join(over)}: the report is "
                "kept in status.overrun and the envelope is not overdrawn",
                warning=True,
            )
        return False
    if spec.usage != entry.usage:
        entry.usage = dict(spec.usage)
    return True


def expire_lease(step: Step) -> None:
    """The operator's clock decides: a lapsed lease before the commit point expires the
    claim (R returned, nothing ran); after it, the claim is Detached (R held)."""
    entry = step.entry
    if entry.expires_at is None or step.now < entry.expires_at:
        return
    if entry.phase is ClaimPhase.TENTATIVE and not crossed_commit_point(step.facts):
        settle(step, ClaimPhase.EXPIRED, "LeaseExpired", message="lease lapsed before dispatch")
    elif entry.phase in (ClaimPhase.COMMITTED, ClaimPhase.RUNNING):
        entry.detached_at = step.now
        step.move(
            ClaimPhase.DETACHED,
            "LeaseLapsed",
            "lease lapsed after the commit point: capacity held as reconciling until a "
            "final report or the ambiguity deadline",
        )


def advance_tentative(step: Step, usage_accepted: bool) -> None:
    entry, facts, spec = step.entry, step.facts, step.facts.spec
    executed = shows_execution(facts, usage_accepted)
    if crossed_commit_point(facts) or executed or shows_acceptance(facts):
        entry.committed_at = step.now
        step.move(ClaimPhase.COMMITTED, "CommitPointReached", "claim committed")
    elif spec.final and usage_accepted:
        # A final report without any usage on a claim never dispatched: it did not run.
        settle(step, ClaimPhase.RELEASED, "FinishedBeforeCommit", outcome=spec.outcome)
    elif facts.cancelling:
        reason = "Deleted" if facts.deleting else "Cancelled"
        settle(step, ClaimPhase.RELEASED, reason, message="pruned before dispatch: R returned")


def advance_committed(step: Step, usage_accepted: bool, policy: EnvelopePolicy) -> None:
    entry, facts, spec = step.entry, step.facts, step.facts.spec
    if entry.phase is ClaimPhase.COMMITTED and shows_execution(facts, usage_accepted):
        entry.started_at = step.now
        step.move(ClaimPhase.RUNNING, "ExecutionStarted", "execution confirmed started")
    if spec.final and usage_accepted:
        reason = "SettledAfterDetach" if entry.phase is ClaimPhase.DETACHED else "Completed"
        settle(step, ClaimPhase.CONSUMED, reason, dict(spec.usage), spec.outcome)
        return
    if facts.cancelling and not entry.cancel_requested:
        entry.cancel_requested = True
        step.note(
            "CancelRequested",
            "cancel requested after the commit point: capacity waits for the final usage "
            "report or the ambiguity deadline",
        )
    if entry.phase is ClaimPhase.DETACHED:
        apply_deadline(step, policy)


def apply_deadline(step: Step, policy: EnvelopePolicy) -> None:
    entry = step.entry
    deadline = ambiguity_deadline(entry, policy)
    if deadline is None or step.now < deadline or entry.deadline_action is not None:
        return
    action = policy.at_ambiguity_deadline
    entry.deadline_action = action
    if action is DeadlineAction.HOLD:
        step.note(
            "AmbiguityDeadlineHold",
            "outcome still unknown at the deadline: policy Hold keeps the capacity "
            "reconciling until a final report arrives",
            warning=True,
        )
    elif action is DeadlineAction.QUARANTINE:
        settle(
            step,
            ClaimPhase.CONSUMED,
            "AmbiguityDeadlineQuarantine",
            dict(entry.reserved),
            message="outcome unknown at the deadline: the whole reservation is charged "
            "as consumed (policy Quarantine)",
        )
    else:
        settle(
            step,
            ClaimPhase.RELEASED,
            "AmbiguityDeadlineRelease",
            message="outcome unknown at the deadline: released by policy Release",
        )


def force_settle(step: Step, why: str) -> None:
    """A person's recorded decision for a claim whose facts will never arrive: a committed
    claim is charged its last accepted usage, an uncommitted one is released."""
    entry = step.entry
    if entry.phase.committed:
        settle(step, ClaimPhase.CONSUMED, "ForceSettled", entry.usage, message=why)
    else:
        settle(step, ClaimPhase.RELEASED, "ForceSettled", message=why)
    step.note("ForceSettled", f"settled by annotation: {why}", warning=True)


def renew_lease(step: Step, policy: EnvelopePolicy) -> None:
    """A new heartbeat token from the holder asks for a renewal; the operator decides."""
    entry, facts = step.entry, step.facts
    if facts.heartbeat is None or facts.heartbeat == entry.heartbeat:
        return
    entry.heartbeat = facts.heartbeat
    if entry.phase is ClaimPhase.DETACHED:
        step.note(
            "RenewalRefused",
            "the lease already lapsed: a Detached claim is not re-attached by a heartbeat",
            warning=True,
        )
        return
    decision = renewal(entry, step.now, facts.spec.lease.duration_seconds, policy)
    if decision.granted:
        entry.expires_at = decision.expires_at
        entry.renewals += 1
    else:
        step.note("RenewalRefused", f"{decision.reason}: {decision.message}", warning=True)


def record_after_settlement(step: Step) -> None:
    """After settlement only records: late reports and fenced dispatches."""
    entry, spec = step.entry, step.facts.spec
    settled = entry.settlement
    assert settled is not None
    never_ran = settled.phase in (ClaimPhase.RELEASED, ClaimPhase.EXPIRED, ClaimPhase.REJECTED)
    if (
        spec.intent is Intent.DISPATCH
        and never_ran
        and entry.committed_at is None
        and not entry.dispatch_fenced
    ):
        entry.dispatch_fenced = True
        step.note(
            "DispatchRefused",
            f"the claim already settled as {settled.phase.value}: do not start this branch; "
            "create a new claim (new attempt) instead",
            warning=True,
        )
    late = entry.late or LateReport()
    if (late.usage, late.final, late.outcome) == (dict(spec.usage), spec.final, spec.outcome):
        return  # the report the claim settled with, or a late one already recorded
    entry.late = LateReport(
        count=late.count + 1,
        usage=dict(spec.usage),
        final=spec.final,
        outcome=spec.outcome,
        at=step.now,
    )
    step.note(
        "LateReport",
        f"usage reported after the claim settled as {settled.phase.value}: recorded, "
        "the settlement is not reopened",
        warning=True,
    )
