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
point with no workload pod that may still start, lease lapse before it or while the pod
handed the devices still waits behind its gate), a final usage report, or a recorded
deadline decision.
Cancel after the commit point is a request, not a release. Terminal states are final: a
later report is recorded as late and never reopens the settlement.

Decide only on recorded facts. Every fact read here is durable and monotonic: recorded in
the ledger entry by an earlier pass, or held in a field the API server forbids to go back
(`dispatch` and `cancel` are separate sticky flags, usage only grows, a final report stays
final, a pod's binding and start never un-happen, a deletion is never withdrawn). So the
settlement is the same whether the operator saw every intermediate state or only the last
one: usage is recorded as a running maximum, an overrun is proof of execution, and
whatever shows that the branch may have run is read before anything that returns capacity.
Only the operator's clock (lease ends, deadlines) and its own admissions depend on when it
looked, and where it cannot tell which came first it holds the capacity.

Every function here is deterministic in its inputs (including `now`), so replaying the
same facts changes nothing twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal

from reservoir.core.contracts import occupancy
from reservoir.core.devices import DeviceFacts, device_counts
from reservoir.core.ledger import ZERO, add, positive, render, subtract
from reservoir.core.ledgersize import cut_bytes
from reservoir.core.model import (
    DEVICE_CLASSES,
    MAX_ERROR_LENGTH,
    MAX_NAME_LENGTH,
    MAX_RESULT_LENGTH,
    MAX_TRANSITIONS,
    Adjustment,
    BranchClaimSpec,
    ClaimPhase,
    CommitPoint,
    DeadlineAction,
    DeviceHold,
    EnvelopePolicy,
    LateCompletion,
    LateReport,
    LedgerEntry,
    Outcome,
    Overrun,
    ProviderRecord,
    ProviderState,
    QueueBoundAction,
    RetryHold,
    Settlement,
    Transition,
    Trigger,
    UpstreamState,
)
from reservoir.core.policy import ambiguity_deadline, renewal
from reservoir.core.provider import (
    DEADLINE_REASONS,
    TERMINAL_OUTCOMES,
    ForwardedCancel,
    ProviderAnswer,
    lookup_due,
    needs_lookup,
    next_lookup,
)
from reservoir.core.text import EVENT_MESSAGE_LENGTH, bounded

SETTLEMENT_VERSION = 1


@dataclass(frozen=True)
class PodFacts:
    """What the claim's workload pods show (PodScheduled/PodRunning commit points). Both
    are facts that never un-happen while the pod exists: a pod that was bound keeps its
    nodeName, and one that ran stays Running, Succeeded or Failed."""

    scheduled: bool = False  # bound to a node (or ran)
    running: bool = False  # started: phase Running, Succeeded or Failed
    gated: bool = False  # one still waits behind the hand-off gate for the claim's devices
    gated_pod: str | None = None  # the UID of that pod (the oldest, if several wait)
    uids: frozenset[str] = frozenset()  # the UIDs of the claim's workload pods that exist
    # The UIDs of those still behind the gate. A gate is never added back once removed, so
    # a pod seen gated has never been bound: it has not run, whenever the operator looks.
    gated_uids: frozenset[str] = frozenset()

    @property
    def may_still_start(self) -> bool:
        """A pod exists that has not run and nothing holds back: the scheduler may bind it
        and the kubelet start it between any two looks of the operator."""
        return not self.running and bool(self.uids - self.gated_uids)


@dataclass(frozen=True)
class ClaimFacts:
    """Everything the operator knows about one claim: its declared spec plus observations."""

    uid: str
    name: str
    created_at: datetime  # set by the API server: the claim's queue age
    spec: BranchClaimSpec
    deleting: bool = False
    heartbeat: str | None = None  # opaque token of the lease holder's latest heartbeat
    heartbeat_holder: str | None = None  # who sent it (the Lease's holderIdentity)
    pod: PodFacts | None = None
    # The settlement record the claim's own status carries (see claimstatus.settled_record):
    # once it does, the ledger may drop the entry and the claim is never admitted again.
    settled_record: LedgerEntry | None = None
    # The ledger line the claim's status holds (`status.ledger`), if it holds one.
    line: LedgerEntry | None = None
    force_settle: str | None = None  # an operator's audited decision (the annotation's text)
    devices: DeviceFacts | None = None  # what its ResourceClaim shows now, if it has one
    problem: str | None = None  # parts of the spec the operator could not read, and why
    provider: ProviderAnswer | None = None  # a provider lookup made for this pass, if any
    cancel_forwarded: ForwardedCancel | None = None  # forwarding its cancel, this pass
    # An older claim of the namespace with the same upstream.requestId (its name), if any.
    duplicate_of: str | None = None
    # The UID of the envelope its status says decided on it (None: none did yet). A claim
    # bound to another envelope of the same name never moves this one's capacity.
    envelope_uid: str | None = None
    # Another copy of its speculation group won (its name): this one reads as cancelled.
    superseded_by: str | None = None
    # Its envelope gave its room to this higher class's envelope (namespace/name), in this
    # pass, on the claim's facts as read (reservoir.core.preemption): it reads as cancelled.
    preempted_by: str | None = None

    @property
    def cancelling(self) -> bool:
        return (
            self.deleting
            or self.spec.cancel
            or self.superseded_by is not None
            or self.preempted_by is not None
        )

    @property
    def cancel_trigger(self) -> Trigger:
        """Where the cancel it reads as came from."""
        if self.deleting:
            return Trigger.DELETION
        if self.spec.cancel:
            return Trigger.WORKER
        return Trigger.SPECULATION if self.superseded_by is not None else Trigger.PREEMPTION

    @property
    def cancel_reason(self) -> str:
        """Why it was pruned, in one word: Deleted, Cancelled, Superseded or Preempted."""
        if self.deleting:
            return "Deleted"
        if self.spec.cancel:
            return "Cancelled"
        return "Superseded" if self.superseded_by is not None else "Preempted"

    @property
    def cancel_message(self) -> str:
        if self.preempted_by is not None and not (self.deleting or self.spec.cancel):
            return (
                f"preempted before dispatch: its envelope gave its room to {self.preempted_by} "
                "(a higher priority class): R returned"
            )
        return "pruned before dispatch: R returned"


@dataclass(frozen=True)
class LedgerEvent:
    """Something worth a Kubernetes Event and a metric: a transition or a refusal."""

    uid: str
    claim: str
    reason: str
    message: str
    warning: bool = False
    phase: ClaimPhase | None = None  # set when the event is a phase transition

    def __post_init__(self) -> None:
        # Messages carry names, resource maps and a person's annotation text: bounded here,
        # where every ledger event is made.
        object.__setattr__(self, "message", bounded(self.message, EVENT_MESSAGE_LENGTH))


@dataclass
class Step:
    """The entry being advanced and what happened to it."""

    entry: LedgerEntry
    facts: ClaimFacts
    now: datetime
    # The envelope's resources: reports are recorded over these only, so an entry's size
    # is bounded by its envelope (see reservoir.core.ledgersize), whatever a worker sends.
    dimensions: frozenset[str] | None = None
    # The envelope's Reusable resources (reservoir.core.contracts): all of R returns when
    # the claim ends, and usage reported for them is occupancy, never a charge.
    reusable: frozenset[str] = frozenset()
    # Its Replenishing resources: what they commit returns with its window, so a late
    # completion never adjusts them (the window may have returned the charge already).
    windowed: frozenset[str] = frozenset()
    events: list[LedgerEvent] = field(default_factory=list)
    # This pass recorded a terminal answer that says what was used: the claim settles on it.
    answer_settles: bool = False

    def kept(self, usage: Mapping[str, Decimal]) -> dict[str, Decimal]:
        return {k: v for k, v in usage.items() if self.dimensions is None or k in self.dimensions}

    def note(self, reason: str, message: str, warning: bool = False) -> None:
        self.events.append(LedgerEvent(self.facts.uid, self.facts.name, reason, message, warning))

    def move(self, phase: ClaimPhase, reason: str, message: str, trigger: Trigger) -> None:
        record_transition(self.entry, phase, reason, trigger, self.now)
        self.entry.phase = phase
        self.events.append(
            LedgerEvent(self.facts.uid, self.facts.name, reason, message, False, phase)
        )


def record_transition(
    entry: LedgerEntry, phase: ClaimPhase, reason: str, trigger: Trigger, now: datetime
) -> None:
    """The claim's durable history, written by the pass that decides the move. The phase
    graph is acyclic, so it is short; the newest moves are kept if it ever were not."""
    generation = entry.lease_generation
    entry.history.append(
        Transition.model_validate(
            {
                "from": entry.phase,
                "to": phase,
                "reason": reason[:48],
                "trigger": trigger,
                "at": now,
                "leaseGeneration": generation,
            }
        )
    )
    del entry.history[:-MAX_TRANSITIONS]


def settlement_key(facts: ClaimFacts) -> str:
    return f"{facts.uid}/{facts.spec.attempt}/{SETTLEMENT_VERSION}"


def settle(
    step: Step,
    phase: ClaimPhase,
    reason: str,
    consumed: Mapping[str, Decimal] | None = None,
    outcome: Outcome | None = None,
    message: str = "",
    trigger: Trigger = Trigger.WORKER,
) -> None:
    """The one settlement: commit C, return R − C, per resource by its contract: a Reusable
    resource commits nothing (all of R returns, devices once the scheduler frees them) and
    records its occupancy instead. Never applied twice."""
    entry = step.entry
    assert entry.settlement is None and not entry.phase.terminal, "settles at most once"
    entry.consumed = {
        k: v for k, v in (consumed or {}).items() if k in entry.reserved and k not in step.reusable
    }
    entry.released = subtract(entry.reserved, entry.consumed)
    entry.occupancy = occupancy(entry.reserved, step.reusable, entry.first_reserved_at, step.now)
    entry.settlement = Settlement(
        key=settlement_key(step.facts), phase=phase, reason=reason, outcome=outcome, at=step.now
    )
    # The report as it stands at settlement is the baseline: only a different one is late.
    spec = step.facts.spec
    entry.late = LateReport(usage=step.kept(spec.usage), final=spec.final, outcome=spec.outcome)
    if entry.result is None and spec.result is not None:
        entry.result = spec.result
    window = spec.retry_window_seconds
    # Devices are held by their allocation, not by the ledger: they stay counted until the
    # scheduler confirms the release (ledger.devices_in_use), and a next attempt gets its
    # own allocation; kept for a retry too, they were counted twice (found by review).
    # Only what it did not consume: a Reusable resource (a permit, a slot) is not spent, so
    # a next attempt queues for one like any claim. Kept, it differed with what the operator
    # saw: a permit returned when the provider said the work was over was kept again when
    # the final report came in the same look (found by review: reconcile raised).
    returned = {
        k: v
        for k, v in positive(entry.released).items()
        if k not in DEVICE_CLASSES and k not in step.reusable
    }
    if outcome is Outcome.FAILED and window is not None and returned:
        # A failed attempt keeps what it did not use for the branch's next attempt.
        entry.retry = RetryHold(resources=returned, until=step.now + timedelta(seconds=window))
    step.move(phase, reason, message or f"settled: {reason}", trigger)


def charge(
    step: Step,
    reason: str,
    message: str,
    trigger: Trigger,
    outcome: Outcome | None = None,
) -> None:
    """Settle a committed claim on what is known to be used: C = the recorded usage,
    R − C returned. Consumed if anything is charged, Released if nothing is."""
    used = positive(step.entry.usage)
    phase = ClaimPhase.CONSUMED if used else ClaimPhase.RELEASED
    settle(step, phase, reason, used, outcome, message, trigger)


# --- reading the facts -----------------------------------------------------------------


def crossed_commit_point(facts: ClaimFacts) -> bool:
    spec, pod = facts.spec, facts.pod
    if spec.commit_point is CommitPoint.DISPATCH:
        return spec.dispatch
    if pod is None:
        return False
    if spec.commit_point is CommitPoint.POD_SCHEDULED:
        return pod.scheduled or pod.running
    return pod.running


def shows_execution(facts: ClaimFacts) -> bool:
    """Evidence that work started: any usage (an overrun too), a provider's start, a pod
    that ran."""
    spec = facts.spec
    used = any(v > ZERO for v in spec.usage.values())
    pod_ran = facts.pod is not None and facts.pod.running
    return used or pod_ran or spec.upstream.state is UpstreamState.RUNNING


def shows_submission(facts: ClaimFacts) -> bool:
    """Submitted to the provider (accepted or not): maybe running. Past the commit point for
    release purposes: only the provider saying it never started returns R."""
    return facts.spec.upstream.state is not None


def may_have_run(facts: ClaimFacts) -> bool:
    return crossed_commit_point(facts) or shows_execution(facts) or shows_submission(facts)


def provider_says(entry: LedgerEntry) -> ProviderState | None:
    """The provider's last recorded answer (a fact: recorded by an earlier or this pass)."""
    return entry.provider.state if entry.provider is not None else None


# --- the step --------------------------------------------------------------------------


def advance(
    entry: LedgerEntry,
    facts: ClaimFacts,
    policy: EnvelopePolicy,
    now: datetime,
    renewals_open: bool = True,
    dimensions: frozenset[str] | None = None,
    room: dict[str, Decimal] | None = None,
    adjust: bool = True,
    reusable: frozenset[str] = frozenset(),
    windowed: frozenset[str] = frozenset(),
) -> list[LedgerEvent]:
    """Advance one admitted claim's entry by its facts, in place. Returns what happened.
    `renewals_open` is False when the envelope no longer admits work (closed, expired,
    deleting): its claims' leases are not extended (see `record_renewals_stop`).
    `dimensions` are the envelope's resources, the only ones reports are recorded over.
    `room` is what the envelope has available for a late completion's charge (drawn down
    here); None: it cannot adjust, only record. `adjust` False defers a late completion
    to a later pass altogether. `reusable` and `windowed` are the envelope's Reusable and
    Replenishing resources."""
    step = Step(entry, facts, now, dimensions, reusable, windowed)
    if entry.phase.terminal:
        record_answer(step, policy)
        record_after_settlement(step)
        if adjust:
            adjust_late(step, policy, room)
        close_retry_window(step, renewals_open)
        return step.events

    record_usage(step)
    record_superseded(step)
    hand_off(step)
    if entry.phase is ClaimPhase.TENTATIVE:
        advance_tentative(step)
    # After the commit-point check: a commit seen only after the lease lapsed may have
    # happened before it, so the claim is Detached (held), never Expired (returned).
    expire_lease(step)
    if entry.phase.committed:
        advance_committed(step, policy)
    # A person's decision settles only what the facts above could not.
    if facts.force_settle is not None and not entry.phase.terminal:
        force_settle(step, facts.force_settle)
    if not entry.phase.terminal:
        record_renewals_stop(step, renewals_open)
        record_handover(step)
        renew_lease(step, policy)
    else:
        # Settled in this pass: a failed attempt's hold made while the envelope no longer
        # admits goes back at once, before the envelope records its balance (issue 21 #6:
        # it went upward as if consumed when the claim failed as its envelope closed).
        close_retry_window(step, renewals_open)
    return step.events


def record_usage(step: Step) -> None:
    """Record the worker's cumulative usage report (see record_report)."""
    spec = step.facts.spec
    record_report(step, spec.usage, spec.final)


def record_report(step: Step, usage: Mapping[str, Decimal], final: bool) -> None:
    """Record cumulative usage, the worker's or the provider's, as a running maximum of
    min(usage, R) per resource, so the record never goes back whatever the operator saw or
    missed. A report above R is proof that the branch ran: it is charged at most R and the
    excess is kept as an overrun, whoever reported it (found by review: the provider's
    overrun was capped and dropped)."""
    entry = step.entry
    record_running_max(entry, usage)
    reported = step.kept(usage)
    # A Reusable resource's usage is occupancy: more than was held is not a charge.
    excess = {
        k: v - entry.reserved.get(k, ZERO) for k, v in reported.items() if k not in step.reusable
    }
    excess = {k: v for k, v in excess.items() if v > ZERO}
    if not excess:
        return
    seen = entry.overrun
    if seen is not None and (seen.usage, seen.final) == (reported, final):
        return
    entry.overrun = Overrun(usage=reported, excess=excess, final=final, at=step.now)
    step.note(
        "Overrun",
        f"usage above the reservation for {', '.join(sorted(excess))}: the branch ran; it is "
        "charged at most its reservation and the excess is kept in status.overrun",
        warning=True,
    )


def record_running_max(entry: LedgerEntry, usage: Mapping[str, Decimal]) -> None:
    charged = {k: min(v, entry.reserved.get(k, ZERO)) for k, v in usage.items()}
    recorded = {
        k: max(entry.usage.get(k, ZERO), charged.get(k, ZERO))
        for k in {*entry.usage, *charged}
        if k in entry.reserved
    }
    if recorded != entry.usage:
        entry.usage = recorded


def record_answer(step: Step, policy: EnvelopePolicy) -> None:
    """Record what a provider lookup of this pass said: its state (or the failure), when it
    was asked, when to ask next, and a cancel forwarded. A repeat of the recorded answer
    before the next lookup is due changes nothing (no write, no wake-up loop); an answer
    the claim settles on is recorded whenever it comes (not only when due: the same answer
    settles the same whether or not the operator saw an earlier one)."""
    answer, entry = step.facts.provider, step.entry
    if answer is None or not needs_lookup(entry, step.facts.spec, policy):
        return
    record = (entry.provider or ProviderRecord()).copied()
    error = cut_bytes(answer.error, MAX_ERROR_LENGTH) if answer.error else None
    # ("Never started" settles on the recorded state, so it is recorded as news only.)
    settles = (
        answer.settles
        and answer.state is not ProviderState.NEVER_STARTED
        and not entry.phase.terminal
    )
    changed = error != record.last_error or (error is None and answer.state != record.state)
    if changed or settles or lookup_due(entry, step.now):
        if error is not None:
            record.failures += 1
            if error != record.last_error:
                step.note("ProviderLookupFailed", f"provider lookup failed: {error}", True)
            record.last_error = error
        else:
            news = answer.state != record.state
            if news:
                step.note("ProviderAnswered", f"the provider says {answer.state.value}")
            record.failures, record.last_error, record.state = 0, None, answer.state
            if answer.state.terminal and entry.result is None and answer.result:
                entry.result = cut_bytes(answer.result, MAX_RESULT_LENGTH)
            if settles:
                record_report(step, answer.usage or {}, final=True)
                step.answer_settles = True
            elif news and answer.state.terminal and not entry.phase.terminal:
                step.note(
                    "ProviderUsageUnknown",
                    f"the provider says {answer.state.value} but not what the work used: "
                    "not proof of zero usage, so nothing settles on it; the capacity waits "
                    "for the final report, an answer with the usage or the ambiguity deadline",
                    warning=True,
                )
        record.lookups += 1
        record.checked_at = step.now
        record.next_lookup_at = next_lookup(step.facts.uid, record.lookups, step.now, policy)
    if record != entry.provider:
        entry.provider = record


def record_cancel_forwarded(step: Step) -> None:
    """A cancel forwarded upstream is recorded as requested, never as confirmed: the
    capacity waits for a terminal answer, a final report or the deadline."""
    forwarded, entry = step.facts.cancel_forwarded, step.entry
    if forwarded is None or not entry.cancel_requested:
        return
    if entry.provider is not None and entry.provider.cancel_forwarded_at is not None:
        return
    done, text = forwarded.done, cut_bytes(forwarded.text, MAX_ERROR_LENGTH)
    record = (entry.provider or ProviderRecord()).copied()
    if done:
        record.cancel_forwarded_at = step.now
        record.cancel_forwarded_as = forwarded.how
        step.note(
            "CancelForwarded",
            f"cancel forwarded upstream: {text} (requested, not confirmed: the capacity "
            "waits for a terminal answer, a final report or the deadline)",
        )
    elif text != record.cancel:
        step.note("CancelNotForwarded", f"cancel not forwarded (tried again): {text}", True)
    record.cancel = text
    if record != entry.provider:
        entry.provider = record


def expire_lease(step: Step) -> None:
    """The operator's clock decides: a lapsed lease before the commit point expires the
    claim (R returned, nothing ran); after it, the claim is Detached (R held)."""
    entry = step.entry
    if entry.expires_at is None or step.now < entry.expires_at:
        return
    if entry.phase.committed and gate_never_lifted(entry, step.facts):
        settle(
            step,
            ClaimPhase.EXPIRED,
            GATE_NEVER_LIFTED,
            message="lease lapsed while the workload pod still waited behind the hand-off "
            "gate: it never ran; R returned, and its gate is not lifted any more",
            trigger=Trigger.CLOCK,
        )
    elif entry.phase is ClaimPhase.TENTATIVE:
        pod = step.facts.pod
        if pod is not None and pod.may_still_start:
            # A workload pod that may still bind and start: the lapse cannot confirm that
            # the branch never runs, as a cancel cannot (advance_tentative); R stays held
            # until the pod runs (a commit) or goes (found by review: the lapse returned R,
            # and the pod then ran on it).
            return
        settle(
            step,
            ClaimPhase.EXPIRED,
            "LeaseExpired",
            message="lease lapsed before dispatch",
            trigger=Trigger.CLOCK,
        )
    elif entry.phase in (ClaimPhase.COMMITTED, ClaimPhase.RUNNING):
        entry.detached_at = step.now
        step.move(
            ClaimPhase.DETACHED,
            "LeaseLapsed",
            "lease lapsed after the commit point: capacity held as reconciling until a "
            "final report, the provider's answer or the ambiguity deadline",
            Trigger.CLOCK,
        )


GATE_NEVER_LIFTED = "GateNeverLifted"


def gate_never_lifted(entry: LedgerEntry, facts: ClaimFacts) -> bool:
    """The claim is committed only by its hand-off, and the pod it was handed to is still
    behind the gate: that pod has never been bound (a gate is never added back), and
    nothing else shows that the branch ran. Read when the lease lapses: the operator lifts
    no gate after that, so the pod never runs on this claim (issue 21 §3.5: a failed lift,
    or a restart between the ledger write and the lift, left it gated for good)."""
    pod = facts.pod
    if entry.handed_off_at is None or entry.handed_off_to is None or pod is None:
        return False
    if entry.handed_off_to not in pod.gated_uids or pod.scheduled or pod.running:
        return False
    ran = entry.started_at is not None or bool(positive(entry.usage))
    # A provider that says the work started or ended (this pass's answer or a recorded
    # one) says it ran, whatever the pod shows (found by review: an answer in the pass of
    # the lapse was read after the lapse had settled the claim as never run).
    answer = facts.provider
    said = {entry.provider.state} if entry.provider is not None else set()
    if answer is not None and answer.error is None:
        said.add(answer.state)
    return not ran and not may_have_run(facts) and not said & PROVIDER_SAYS_IT_STARTED


PROVIDER_SAYS_IT_STARTED = frozenset(
    {ProviderState.RUNNING, ProviderState.SUCCEEDED, ProviderState.FAILED, ProviderState.CANCELLED}
)


def never_ran(entry: LedgerEntry) -> bool:
    """Settled without ever passing its commit point, or committed only by a hand-off
    whose pod never left the gate."""
    settled = entry.settlement
    withdrawn = settled is not None and settled.reason == GATE_NEVER_LIFTED
    return entry.committed_at is None or withdrawn


def record_superseded(step: Step) -> None:
    """Another copy of its speculation group won: recorded on its line once, with the
    winner's name; from here on it reads as cancelled (reservoir.core.speculation)."""
    winner = step.facts.superseded_by
    if winner is None or step.entry.superseded_by is not None:
        return
    step.entry.superseded_by = winner
    step.note(
        "SpeculationLost", f"copy {winner} of its speculation group won: this one is cancelled"
    )


def hand_off(step: Step) -> None:
    """A claim's workload pod waits behind the hand-off gate: hand it what the claim holds
    (its devices, with them). The hand-off is recorded, and commits the claim, before the
    gate is lifted: from then on the pod may bind and run between any two looks of the
    operator, so the claim is past its commit point on a recorded fact, never on a pod that
    may have come and gone (branch-claims.txt: commit only at the execution boundary).
    Creating the workload pod is sending the branch: its hand-off commits the claim
    whatever its commitPoint (a GPU claim's always did). A Pending, settled, Detached or
    cancelled claim hands nothing to anyone."""
    entry, facts = step.entry, step.facts
    if entry.handed_off_at is not None or facts.cancelling:
        return
    if entry.phase not in (ClaimPhase.TENTATIVE, ClaimPhase.COMMITTED, ClaimPhase.RUNNING):
        return  # Detached or settled: nothing is handed to anyone any more
    if facts.pod is None or not facts.pod.gated:
        return
    if entry.expires_at is not None and step.now >= entry.expires_at:
        return  # the lease lapsed first: nothing is handed over after it (found by review)
    if device_counts(entry.reserved):
        if entry.devices is None or not _devices_still_held(entry.devices, facts.devices):
            return  # only devices held now, and the ones recorded, are handed over (review)
        held = f"devices {', '.join(entry.devices.devices)} on {entry.devices.node}"
    else:
        held = "its capacity"
    entry.handed_off_at = step.now
    entry.handed_off_to = facts.pod.gated_pod
    message = f"{held} handed to"
    if entry.phase is ClaimPhase.TENTATIVE:
        entry.committed_at = step.now
        step.move(
            ClaimPhase.COMMITTED,
            "HandedOff",
            f"{message} the workload pod: committed",
            Trigger.POD,
        )
    else:
        step.note("HandedOff", f"{message} the workload pod")


def _devices_still_held(recorded: DeviceHold, seen: DeviceFacts | None) -> bool:
    return (
        seen is not None
        and seen.held
        and (seen.node, list(seen.devices)) == (recorded.node, recorded.devices)
    )


def commit_trigger(facts: ClaimFacts) -> Trigger:
    """Where the commit came from: the claim's own facts, or its workload pod."""
    spec = facts.spec
    if spec.dispatch or spec.upstream.state is not None or any(spec.usage.values()):
        return Trigger.WORKER
    return Trigger.POD if facts.pod is not None else Trigger.WORKER


def advance_tentative(step: Step) -> None:
    entry, facts, spec = step.entry, step.facts, step.facts.spec
    if may_have_run(facts):
        entry.committed_at = step.now
        reason = (
            "Submitted"
            if shows_submission(facts) and not crossed_commit_point(facts)
            else "CommitPointReached"
        )
        step.move(ClaimPhase.COMMITTED, reason, "claim committed", commit_trigger(facts))
    elif spec.final:
        # A final report without any usage on a claim never dispatched: it did not run.
        if facts.cancelling and facts.pod is not None and facts.pod.may_still_start:
            # The cancel asked while its pod could still start is recorded as the operator
            # that saw the cancel first records it (found by the coalescing audit).
            entry.cancel_requested_at = step.now
        settle(step, ClaimPhase.RELEASED, "FinishedBeforeCommit", outcome=spec.outcome)
    elif facts.cancelling and facts.pod is not None and facts.pod.may_still_start:
        # A workload pod that may still bind and start: the cancel cannot confirm that the
        # branch never runs (child-settlement.txt), so R stays held until the pod runs (a
        # commit) or goes without running. Returning R here made the settlement depend on
        # whether the operator saw the pod before it ran (issue 21 §3.9).
        if not entry.cancel_requested:
            entry.cancel_requested_at = step.now
            step.note(
                "CancelRequested",
                "cancel requested while a workload pod of the claim may still start: "
                "capacity held until the pod runs (then its usage settles it) or is gone",
            )
    elif facts.cancelling:
        settle(
            step,
            ClaimPhase.RELEASED,
            facts.cancel_reason,
            message=facts.cancel_message,
            trigger=facts.cancel_trigger,
        )


def advance_committed(step: Step, policy: EnvelopePolicy) -> None:
    entry, facts, spec = step.entry, step.facts, step.facts.spec
    # Recorded first: a cancel seen together with the final report is still a cancel asked
    # (found by the coalescing audit: one look or two must record the same).
    if facts.cancelling and not entry.cancel_requested:
        entry.cancel_requested_at = step.now
        step.note(
            "CancelRequested",
            "cancel requested after the commit point: capacity waits for the final usage "
            "report, the provider's answer or the ambiguity deadline",
        )
    record_cancel_forwarded(step)
    record_answer(step, policy)
    said = provider_says(entry)
    started = shows_execution(facts) or said is ProviderState.RUNNING
    record_acceptance(step, said)
    if started and entry.started_at is None:
        # Recorded in any committed phase: evidence that it ran is never lost because it
        # came while the claim was Detached (found by review).
        entry.started_at = step.now
        trigger = Trigger.PROVIDER if not shows_execution(facts) else commit_trigger(facts)
        if entry.phase is ClaimPhase.COMMITTED:
            step.move(
                ClaimPhase.RUNNING, "ExecutionStarted", "execution confirmed started", trigger
            )
        else:
            step.note("ExecutionStarted", "execution confirmed started (while Detached)")
    apply_queue_bound(step, policy)
    if spec.final:
        reason = "SettledAfterDetach" if entry.phase is ClaimPhase.DETACHED else "Completed"
        settle(step, ClaimPhase.CONSUMED, reason, dict(entry.usage), spec.outcome)
        return
    if said is not None and said.terminal and settle_on_answer(step, said):
        return
    if said in WORK_ENDED:
        return_reusable(step)
    if workload_gone(entry, facts):
        entry.detached_at = step.now
        step.move(
            ClaimPhase.DETACHED,
            "WorkloadGone",
            "the workload pod holding the claim's devices is gone (node lost, evicted or "
            "deleted) before a final report: capacity held as reconciling until a final "
            "report or the ambiguity deadline",
            Trigger.POD,
        )
    if entry.phase is ClaimPhase.DETACHED:
        apply_deadline(step, policy)


# What shows the provider accepted the operation: the worker's report, or its answer.
ACCEPTED_STATES = (UpstreamState.ACCEPTED, UpstreamState.RUNNING)
ACCEPTED_ANSWERS = (ProviderState.PENDING, ProviderState.RUNNING)


def record_acceptance(step: Step, said: ProviderState | None) -> None:
    """The provider's acceptance, recorded apart from the commit and the start
    (lease-renewal.txt: "Keep provider acceptance time and compute start time separate"),
    in any committed phase: a dispatch recorded first keeps its own time."""
    entry, upstream = step.entry, step.facts.spec.upstream
    if entry.accepted_at is not None:
        return
    if upstream.state in ACCEPTED_STATES or said in ACCEPTED_ANSWERS:
        entry.accepted_at = step.now
        step.note("ProviderAccepted", "the provider accepted the operation")


def queue_bound(
    entry: LedgerEntry, spec: BranchClaimSpec, policy: EnvelopePolicy
) -> datetime | None:
    """When an operation the provider accepted and has not started stops being waited for:
    the envelope's queue bound from its acceptance, or the provider's own deadline for the
    request, whichever comes first. None: no bound, not accepted, started, or done."""
    if entry.accepted_at is None or entry.started_at is not None or entry.phase.terminal:
        return None
    if entry.queue_bound_at is not None:
        return None
    moments = [spec.upstream.deadline] if spec.upstream.deadline is not None else []
    if policy.queue_bound_seconds is not None:
        moments.append(entry.accepted_at + timedelta(seconds=policy.queue_bound_seconds))
    return min(moments, default=None)


def apply_queue_bound(step: Step, policy: EnvelopePolicy) -> None:
    """An accepted operation still not started at its bound: the policy's action, once. A
    cancel is asked (forwarded to a provider that can cancel; its answer, a final report or
    the ambiguity deadline settles the claim), never a release on the clock alone: the
    operation may have started unseen between two lookups."""
    entry, facts = step.entry, step.facts
    bound = queue_bound(entry, facts.spec, policy)
    if bound is None or step.now < bound:
        return
    entry.queue_bound_at = step.now
    waited = f"accepted at {entry.accepted_at:%H:%M:%SZ}, not started by {bound:%H:%M:%SZ}"
    if policy.at_queue_bound is QueueBoundAction.CANCEL and not entry.cancel_requested:
        entry.cancel_requested_at = step.now
        step.note(
            "QueueBoundReached",
            f"{waited}: cancel requested (policy atQueueBound Cancel); capacity waits for "
            "the provider's answer, a final report or the ambiguity deadline",
            warning=True,
        )
    elif entry.cancel_requested:
        step.note("QueueBoundReached", f"{waited}: a cancel was already requested")
    else:
        step.note("QueueBoundReached", f"{waited}: capacity held (policy atQueueBound Hold)")


# The provider's answers that say the work is over, whatever it used.
WORK_ENDED = (ProviderState.SUCCEEDED, ProviderState.FAILED, ProviderState.CANCELLED)


def return_reusable(step: Step) -> None:
    """The work is over but what it used is not known yet: its Reusable resources come
    back now (a permit is free once the work ends), its Consumable ones wait for the usage
    (lease-renewal.txt: "separate identifiers, authorities, and lifecycle rules"). Devices
    follow the scheduler: they come back once their allocation is gone (reservoir.core.
    reconcile lets the hold go and records it)."""
    entry = step.entry
    if entry.work_ended_at is not None:
        return
    entry.work_ended_at = step.now
    entry.reusable_returned = {
        name: amount
        for name, amount in entry.reserved.items()
        if name in step.reusable and name not in DEVICE_CLASSES and amount > ZERO
    }
    step.note(
        "ReusableReturned",
        "the provider says the work is over: its reusable resources "
        f"{render(entry.reusable_returned) or '(devices, once freed)'} return now; the rest "
        "waits for the usage",
    )


def settle_on_answer(step: Step, said: ProviderState) -> bool:
    """A terminal answer from the provider that says what was used settles the claim like a
    final report: C is the usage recorded (the worker's reports and the provider's), R − C
    returns. One without the usage settles nothing: "completed" is not proof of zero usage
    (child-settlement.txt), and the worker's final report may follow it; read as zero, the
    outcome would depend on whether the operator saw the answer before that report or with
    it (found by review). "Never started" returns R, unless something shows the branch ran.
    Returns whether it settled."""
    entry, facts = step.entry, step.facts
    if said is ProviderState.NEVER_STARTED:
        # Recorded before this is read, in this pass or an earlier one: any usage, a
        # provider's start or a pod that ran set started_at; a hand-off commits the devices.
        ran = entry.started_at is not None or entry.handed_off_at is not None
        if ran:
            fresh = facts.provider is not None and facts.provider.state is said
            if fresh:  # said once per answer, not on every pass that reads the record
                step.note(
                    "ProviderContradicted",
                    "the provider says the operation never started, but the branch shows "
                    "it ran: the capacity stays held",
                    warning=True,
                )
            return False
        settle(
            step,
            ClaimPhase.RELEASED,
            "ProviderNeverStarted",
            message="the provider says the operation never started: R returned",
            trigger=Trigger.PROVIDER,
        )
        return True
    if not step.answer_settles:
        return False  # recorded without the usage (ProviderUsageUnknown): it waits
    # Consumed, as a final report makes it (even of nothing): the same answer seen before
    # or together with the worker's final report settles alike (found by the audit).
    settle(
        step,
        ClaimPhase.CONSUMED,
        f"Provider{said.value}",
        dict(entry.usage),
        TERMINAL_OUTCOMES[said],
        f"the provider says {said.value}: the recorded usage is charged, the rest returned",
        Trigger.PROVIDER,
    )
    return True


def workload_gone(entry: LedgerEntry, facts: ClaimFacts) -> bool:
    """A device claim whose devices were handed to a workload pod that is gone: whatever
    it did is unknown, so the claim is Detached (held), never released as if it had not
    run. Gone is a lasting fact because it is about that pod's UID (found by the
    coalescing audit: "no pod right now" is not, a replacement pod may already exist)."""
    live = entry.phase in (ClaimPhase.COMMITTED, ClaimPhase.RUNNING)
    if not live or entry.handed_off_at is None:
        return False
    present = facts.pod.uids if facts.pod is not None else frozenset()
    if entry.handed_off_to is None:
        return not present
    return entry.handed_off_to not in present


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
            trigger=Trigger.CLOCK,
        )
    else:
        charge(
            step,
            "AmbiguityDeadlineRelease",
            "outcome unknown at the deadline: the usage already reported is charged and the "
            "rest released (policy Release)",
            Trigger.CLOCK,
        )


def force_settle(step: Step, why: str) -> None:
    """A person's recorded decision for a claim whose facts will never arrive: a committed
    claim is charged its recorded usage, an uncommitted one released."""
    if step.entry.phase.committed:
        charge(step, "ForceSettled", why, Trigger.PERSON)
    else:
        settle(step, ClaimPhase.RELEASED, "ForceSettled", message=why, trigger=Trigger.PERSON)
    step.note("ForceSettled", f"settled by annotation: {why}", warning=True)


def record_renewals_stop(step: Step, renewals_open: bool) -> None:
    """Renewal stops when the branch is cancelled or its envelope stops admitting work: the
    line records when the operator first saw it stop, in the pass that first advances the
    line after it (a line left for a later pass records it then), and forgets it once the
    envelope admits work again. Recorded on the line, not read from the envelope, so the
    claim's one status write carries the stop and any renewal granted with it (found by
    review: a close read from the envelope's status decided otherwise after a crash between
    the envelope's write and the claim's). Forgotten on reopening, so a brief close the
    operator saw, or did not, differs by one heartbeat at most (review: kept for good, it
    lapsed the lease of a holder that renewed all along, where an operator that missed the
    close kept renewing it)."""
    entry = step.entry
    stopped = step.facts.cancelling or not renewals_open
    if stopped and entry.renewals_stopped_at is None:
        entry.renewals_stopped_at = step.now
    elif not stopped:
        entry.renewals_stopped_at = None


def record_handover(step: Step) -> None:
    """The claim names another holder than the one its lease was granted to: the lease is
    handed over, a new generation, so the worker it was taken from is fenced at once and
    the new one may report (a Detached claim too, whose lease no renewal extends). The
    lease's end does not move: the new holder renews it."""
    entry, named = step.entry, step.facts.spec.lease.holder
    if named is None or named == entry.holder or entry.first_reserved_at is None:
        return
    before = entry.holder
    entry.holder = named
    entry.handovers += 1
    step.note(
        "LeaseHandedOver",
        f"the lease is handed from {before or 'nobody'} to {named} (generation "
        f"{entry.lease_generation}): the earlier holder's writes are refused from now on",
    )


def renew_lease(step: Step, policy: EnvelopePolicy) -> None:
    """A new heartbeat token from the holder asks for a renewal; the operator decides.
    Renewal stops when the branch is cancelled, its envelope stops admitting work, or the
    heartbeat comes from someone other than the claim's named holder.

    A heartbeat seen in the pass that first records the stop is granted: nothing orders a
    heartbeat and a cancel (or close) written between two passes, and refusing it would
    lapse a lease its holder renewed in good faith; granting errs toward holding. What
    stays observation-dependent, by one renewal at most, is inherent (see the README's
    Heartbeats): a heartbeat written after a stop the operator did not record on its own
    line before it (never seen alone, or its line left for a later pass) is granted once."""
    entry, facts = step.entry, step.facts
    if facts.heartbeat is None or facts.heartbeat == entry.heartbeat:
        return
    entry.heartbeat = facts.heartbeat
    holder = facts.spec.lease.holder
    # Stopped in an earlier pass. Compared by equality: an operator whose clock is behind
    # the recorded time (a new leader) grants nothing more (found by review).
    stopped = entry.renewals_stopped_at is not None and entry.renewals_stopped_at != step.now
    if entry.phase is ClaimPhase.DETACHED:
        refusal = "LeaseLapsed", "a Detached claim is not re-attached by a heartbeat"
    elif stopped and facts.cancelling:
        refusal = "Cancelled", "the branch is cancelled: its lease is not extended"
    elif stopped:
        refusal = "EnvelopeNotOpen", "the envelope admits no more work: leases are not extended"
    elif holder is not None and facts.heartbeat_holder != holder:
        refusal = "NotHolder", f"the Lease is held by {facts.heartbeat_holder!r}, not {holder!r}"
    elif not fits_holder(facts.heartbeat_holder):
        refusal = (
            "InvalidHolder",
            (
                f"the Lease's holderIdentity is longer than {MAX_NAME_LENGTH} characters: no fence "
                "could name it"
            ),
        )
    else:
        decision = renewal(entry, step.now, facts.spec.lease.duration_seconds, policy)
        if decision.granted:
            if decision.expires_at != entry.expires_at:
                entry.expires_at = decision.expires_at
                entry.renewals += 1
                entry.renewed_at = step.now
                entry.holder = facts.heartbeat_holder  # a new generation, granted to it
            return
        refusal = decision.reason, decision.message
    step.note("RenewalRefused", f"{refusal[0]}: {refusal[1]}", warning=True)


def fits_holder(holder: str | None) -> bool:
    """Whether a heartbeat's holder can be recorded as the lease's (and named in a fence)."""
    return holder is None or len(holder) <= MAX_NAME_LENGTH


def record_after_settlement(step: Step) -> None:
    """After settlement only records: late reports, fenced dispatches and pods that
    started anyway. None of them reopens the settlement."""
    entry, facts = step.entry, step.facts
    spec = facts.spec
    settled = entry.settlement
    assert settled is not None
    not_run = never_ran(entry)
    if spec.dispatch and not_run and not entry.dispatch_fenced:
        entry.dispatch_fenced = True
        step.note(
            "DispatchRefused",
            f"the claim already settled as {settled.phase.value}: do not start this branch; "
            "create a new claim (new attempt) instead",
            warning=True,
        )
    if facts.cancelling and not not_run and not entry.cancel_requested:
        # A cancel asked after the commit point is recorded whenever it comes: before the
        # final report, with it, or after it (found by the tree audit: one look or two
        # must record the same). Nothing moves: the claim has settled.
        entry.cancel_requested_at = step.now
        if spec.cancel:  # deleting a settled claim is its normal end, not news
            step.note("CancelRequested", "cancel requested after settlement: recorded")
    pod = facts.pod
    if (
        facts.cancelling
        and settled.reason == "FinishedBeforeCommit"
        and pod is not None
        and pod.may_still_start
        and not entry.cancel_requested
    ):
        # The final report came first, the cancel after it, while the pod could still start:
        # recorded as by an operator that saw both in one look (advance_tentative), so the
        # record does not depend on the order it saw them in (found by the coalescing audit).
        entry.cancel_requested_at = step.now
    pod_started = pod is not None and (pod.scheduled or pod.running)
    if pod_started and not_run and not entry.pod_started_late:
        entry.pod_started_late = True
        step.note(
            "PodStartedAfterSettlement",
            f"a workload pod was bound or ran after the claim settled as "
            f"{settled.phase.value}: recorded; the settlement is not reopened",
            warning=True,
        )
    if entry.result is None and spec.result is not None:
        entry.result = spec.result  # a result reported late is still the result
    late = entry.late or LateReport()
    reported = step.kept(spec.usage)
    if (late.usage, late.final, late.outcome) == (reported, spec.final, spec.outcome):
        return  # the report the claim settled with, or a late one already recorded
    entry.late = LateReport(
        count=late.count + 1,
        usage=reported,
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


def adjust_late(step: Step, policy: EnvelopePolicy, room: dict[str, Decimal] | None) -> None:
    """client-disconnect.txt's adjusted settlement rule, once: a completion known only after
    a deadline decision. A quarantined claim (charged R) that used U < R returns R − U; a
    released one (charged its recorded usage C) that used U > C is charged U − C, at most
    what the envelope has available. Applied only while the envelope is open and the
    policy says Adjust; otherwise only recorded. The settlement itself is never changed."""
    entry, facts = step.entry, step.facts
    settled = entry.settlement
    if settled is None or entry.adjustment is not None or settled.reason not in DEADLINE_REASONS:
        return
    answer = facts.provider
    if facts.spec.final:
        usage, outcome, trigger = step.kept(facts.spec.usage), facts.spec.outcome, Trigger.WORKER
    elif answer is not None and answer.settles:
        # This pass's own answer: a failed lookup after an old one decides nothing, nor does
        # one that does not say what the work used (not proof of zero usage).
        usage, outcome, trigger = step.kept(answer.usage or {}), answer.outcome, Trigger.PROVIDER
    else:
        return
    # What it used is at least what was recorded as used: a completion that reports less
    # (or nothing, or "never started") never gives back reported usage (found by review).
    used = {
        k: min(max(usage.get(k, ZERO), entry.usage.get(k, ZERO)), r)
        for k, r in entry.reserved.items()
        # Reusable: never charged. Replenishing: returned by its window (found by review:
        # returned twice once the window had passed).
        if k not in step.reusable and k not in step.windowed
    }
    applied = policy.late_completion is LateCompletion.ADJUST and room is not None
    # Never more than the claim is charged now: a compensation may have refunded part of
    # its charge already (found by review: a refund then the late report went below zero).
    net = charged_now(entry)
    was_charged = {k: v for k, v in entry.consumed.items() if k in used}
    returned = {
        k: min(v, max(net.get(k, ZERO), ZERO))
        for k, v in positive(subtract(was_charged, used)).items()
    }
    returned = positive(returned)
    owed = positive(subtract(used, entry.consumed))
    charged = {k: min(v, (room or {}).get(k, ZERO)) if applied else v for k, v in owed.items()}
    charged = positive(charged)
    if applied and room is not None:
        room.update(subtract(add(room, returned), charged))
    entry.adjustment = Adjustment(
        returned=returned, charged=charged, applied=applied, outcome=outcome, at=step.now
    )
    reason = "LateCompletionAdjusted" if applied else "LateCompletionRecorded"
    record_transition(entry, entry.phase, reason, trigger, step.now)
    step.note(
        reason,
        f"a completion after the {settled.reason} decision: returned {render(returned) or '-'}, "
        f"charged {render(charged) or '-'}"
        + ("" if applied else " (recorded only: policy Record, or the envelope is not open)"),
        warning=True,
    )


def charged_now(entry: LedgerEntry) -> dict[str, Decimal]:
    """What a settled claim is charged now, per resource: its consumption, plus an applied
    late adjustment, plus the compensations applied so far."""
    net = dict(entry.consumed)
    adjustment = entry.adjustment
    if adjustment is not None and adjustment.applied:
        net = subtract(add(net, adjustment.charged), adjustment.returned)
    for record in entry.compensations:
        if record.applied:
            net = subtract(add(net, record.charged), record.refunded)
    return net


def close_retry_window(step: Step, open_now: bool) -> None:
    """A failed attempt's hold returns when its window closes, or when the envelope stops
    admitting (no next attempt can come)."""
    hold = step.entry.retry
    if hold is None or not hold.active:
        return
    if step.now >= hold.until or not open_now:
        hold.returned = True
        step.note(
            "RetryWindowClosed",
            f"no next attempt took what this attempt kept: {render(hold.resources)} returned",
        )
