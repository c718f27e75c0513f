"""Preemption of tentative holds (issue 25; branch-claims.txt: "priority ordering for
interactive, batch, and agentic work"). An envelope of a pool's priority class whose
`preemptionPolicy` is PreemptLowerPriority, waiting at the head of the pool's queue for
room, takes it from admitted envelopes of lower classes that hold nothing past a commit
point. Work past its commit point is never preempted.

Two objects, each deciding on what it recorded itself (DESIGN.md §1.6):

1. The pool's pass (`requests`) works out the victims again at every pass, for what the
   head of its queue still lacks once the pass is done and under the rules as they are
   then: each ranked by the class recorded on its line at admission (a class named since
   does not count; a line admitted before classes were recorded is never picked), the
   lowest first, then the most recently admitted (Kueue's order); only open envelopes whose
   own status shows no claim past a commit point and no child envelope; never taking a
   namespace below its guarantee; as few as free the room, and none unless they free all
   of it. It records a request naming each (`status.preemptions`, MAX_PREEMPTIONS at a
   time), drops those no longer needed, and asks one that refused again REASK_AFTER later
   at the earliest. The pool itself releases nothing.
2. The victim's pass (`verdict`) reads the request from its pool, only while the pool's
   spec read with it still allows it (`still_asked`), and decides once per request on its
   own lines and on its claims' facts as read in that pass, before anything else moves. If
   every claim holding capacity is Tentative and shows nothing past its commit point (no
   dispatch, usage or submission, no workload pod at all: creating one is sending the
   branch), and no child envelope, loan or lost line holds part of it, it records
   Preempted: each of those claims is released once (reason Preempted, the path of a
   cancel before dispatch, so its settlement key keeps it once; one whose lease has lapsed
   by then ends by the clock), and the envelope closes and returns its balance to the
   pool, which admits the preemptor in its turn. Otherwise it records Refused, and nothing
   moves.

A dispatch written after the victim read its claims lands on a released claim and is
refused, as after a lease's end: the SDK dispatches only a claim whose record still shows
Tentative, and a worker starts work once its claim shows Committed. A preempted envelope
stays closed (its admission is recorded once); the workflow queues again with a new
envelope, which waits in the pool's queue like any other.

Pure: no Kubernetes, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal

from reservoir.core.budgets import ChildFacts
from reservoir.core.fairshare import EPOCH, SharingRules, Waiting, class_refusal, class_value
from reservoir.core.ledger import ZERO, positive, subtract
from reservoir.core.lifecycle import ClaimFacts, LedgerEvent, may_have_run
from reservoir.core.model import (
    MAX_PREEMPTIONS,
    ChildEntry,
    ChildPhase,
    ClaimPhase,
    EnvelopePhase,
    EnvelopeState,
    LedgerEntry,
    Preemption,
    PreemptionOutcome,
    PreemptionPolicy,
    PreemptionRequest,
    ReservationEnvelopeStatus,
    ReservationPoolSpec,
)
from reservoir.core.model.lending import LoanPhase
from reservoir.core.text import MESSAGE_LENGTH, bounded, names

PAST_COMMIT = frozenset({ClaimPhase.COMMITTED, ClaimPhase.RUNNING, ClaimPhase.DETACHED})
# An envelope that refused is asked again for the same preemptor no sooner than this.
REASK_AFTER = timedelta(seconds=30)


# --- the pool's side ---------------------------------------------------------------------


@dataclass(frozen=True)
class Blocked:
    """The waiting envelope at the head of the pool's queue, and what it lacks."""

    entry: Waiting
    short: Mapping[str, Decimal]  # what it asks for beyond the room it may draw on


@dataclass(frozen=True)
class Holder:
    """An admitted envelope, as preemption sees it."""

    uid: str
    namespace: str
    name: str
    value: int | None  # the value now of the class recorded on its line (None: unrecorded)
    admitted_at: datetime
    returns: Mapping[str, Decimal]  # what closing would give back: R less what it committed
    preemptible: bool  # its status shows nothing past a commit point
    decision: Preemption | None  # its own record of its last decision


@dataclass
class Asked:
    """The pool's requests after a pass, the Events for new ones, and when to look again
    (an envelope that refused may be asked again then)."""

    requests: dict[str, PreemptionRequest] = field(default_factory=dict)
    events: list[LedgerEvent] = field(default_factory=list)
    wake_at: datetime | None = None


def preemptible(status: ReservationEnvelopeStatus) -> bool:
    """What an envelope's own status shows (the pool's guess, checked by the envelope on its
    claims): open, no claim past a commit point, no child envelope drawing on it, no loan."""
    if status.phase is not EnvelopePhase.OPEN or status.closed_at is not None:
        return False
    if any(status.counts.get(phase.value, 0) for phase in PAST_COMMIT):
        return False
    if status.child_records is not None and status.child_records.count:
        return False
    if any(line.phase is ChildPhase.RESERVED for line in status.children.values()):
        return False
    return not any(loan.phase is LoanPhase.LENT for loan in status.loans.values())


def holders(
    rules: SharingRules, lines: Mapping[str, ChildEntry], envelopes: Mapping[str, ChildFacts]
) -> list[Holder]:
    """Every envelope holding a line here, listed (a line whose envelope is not listed is
    not asked: it may be gone)."""
    found = []
    for uid, line in lines.items():
        envelope = envelopes.get(uid)
        if line.phase is not ChildPhase.RESERVED or envelope is None:
            continue
        found.append(
            Holder(
                uid=uid,
                namespace=line.namespace,
                name=line.envelope,
                # A line admitted before classes were recorded on lines ranks as no class:
                # it is never preempted on a guess.
                value=None
                if line.priority_class is None
                else class_value(rules, line.priority_class or None),
                admitted_at=line.reserved_at or EPOCH,
                returns=positive(subtract(line.reserved, envelope.committed)),
                preemptible=envelope.preemptible,
                decision=envelope.preemption,
            )
        )
    return found


def may_preempt(rules: SharingRules, priority_class: str | None) -> bool:
    rule = rules.classes.get(priority_class) if priority_class else None
    return rule is not None and rule.preemption is PreemptionPolicy.PREEMPT_LOWER_PRIORITY


def closing(holder: Holder) -> bool:
    """It decided Preempted: what it returns is on its way here."""
    return holder.decision is not None and holder.decision.outcome is PreemptionOutcome.PREEMPTED


def decided_on(decision: Preemption | None, request: PreemptionRequest) -> bool:
    """An envelope's recorded decision answers this request (made at or after it): it
    decides once per request, and again on a request the pool makes later."""
    return (
        decision is not None
        and decision.preemptor_uid == request.preemptor_uid
        and decision.decided_at >= request.requested_at
    )


def refused_lately(holder: Holder, preemptor_uid: str, now: datetime) -> datetime | None:
    """When it may be asked again for this preemptor, if it refused it less than
    REASK_AFTER ago (what made it refuse may pass: a claim that settles; its status cannot
    show every reason, a pod that may still start, so the pool asks again, not at once)."""
    decision = holder.decision
    if (
        decision is None
        or decision.outcome is not PreemptionOutcome.REFUSED
        or decision.preemptor_uid != preemptor_uid
    ):
        return None
    again = decision.decided_at + REASK_AFTER
    return again if now < again else None


def requests(
    rules: SharingRules,
    recorded: Mapping[str, PreemptionRequest],
    head: Blocked | None,
    found: Sequence[Holder],
    held: Mapping[str, Mapping[str, Decimal]],
    now: datetime,
) -> Asked:
    """The pool's preemption requests after this pass, worked out again at every pass from
    the rules as they are now: for `head` (the waiting envelope at the head of the queue,
    short of room) if its class may preempt, the victims it needs now; a request recorded
    before and still needed is kept as it was (the envelope may be deciding on it), and one
    no longer needed is dropped (an envelope that has not decided reads it no more).
    `held`: what each namespace holds here."""
    if head is None or not may_preempt(rules, head.entry.priority_class):
        return Asked()
    by_uid = {holder.uid: holder for holder in found}
    mine = {
        uid: request
        for uid, request in recorded.items()
        if request.preemptor_uid == head.entry.uid
        and uid in by_uid
        and not decided_on(by_uid[uid].decision, request)
    }
    asked = Asked()
    chosen = victims(rules, head, found, held, set(mine), now, asked)
    preemptor = f"{head.entry.namespace}/{head.entry.name}"
    for holder in chosen[:MAX_PREEMPTIONS]:  # the rest once these have decided
        if holder.uid in mine:
            asked.requests[holder.uid] = mine[holder.uid]
            continue
        asked.requests[holder.uid] = PreemptionRequest(
            envelope=holder.name,
            namespace=holder.namespace,
            preemptor=preemptor,
            preemptor_uid=head.entry.uid,
            priority_class=head.entry.priority_class or "",
            requested_at=now,
        )
        asked.events.append(
            LedgerEvent(
                holder.uid,
                holder.name,
                "PreemptionRequested",
                f"the pool asks {holder.namespace}/{holder.name} to give its room to "
                f"{preemptor} (priority class {head.entry.priority_class}): it closes if it "
                "holds nothing past a commit point",
            )
        )
    asked.requests = dict(sorted(asked.requests.items()))
    return asked


def victims(
    rules: SharingRules,
    head: Blocked,
    found: Sequence[Holder],
    held: Mapping[str, Mapping[str, Decimal]],
    asked: set[str],
    now: datetime,
    outcome: Asked | None = None,
) -> list[Holder]:
    """Whom `head` needs to ask now, those `asked` already first (their request stands):
    none if the envelopes closing after a preemption cover what it lacks, or if everyone it
    may preempt would not. Lowest class first, then the most recently admitted (it has done
    the least); an envelope of a namespace with a guarantee only if all it returns is above
    what the namespace keeps. `outcome.wake_at`: when one that refused may be asked again."""
    remaining = dict(head.short)
    kept = rules.kept()
    spare = {ns: guarantee_spare(g, held.get(ns, {})) for ns, g in kept.items()}
    for holder in found:
        if closing(holder):  # on its way here, and out of its namespace's holdings
            remaining = subtract(remaining, holder.returns)
            if holder.namespace in spare:
                spare[holder.namespace] = subtract(spare[holder.namespace], holder.returns)
    if not positive(remaining):
        return []
    value = class_value(rules, head.entry.priority_class)
    candidates = []
    for holder in found:
        if holder.value is None or holder.value >= value or not holder.preemptible:
            continue
        if closing(holder):
            continue
        again = refused_lately(holder, head.entry.uid, now)
        if again is not None:
            if outcome is not None:
                outcome.wake_at = min(outcome.wake_at or again, again)
            continue
        candidates.append(holder)
    candidates.sort(key=lambda h: h.uid)
    candidates.sort(key=lambda h: h.admitted_at, reverse=True)
    candidates.sort(key=lambda h: (h.uid not in asked, h.value))  # asked stay asked
    chosen: list[Holder] = []
    for holder in candidates:
        if not positive(remaining):
            break
        if not any(holder.returns.get(r, ZERO) > ZERO for r in positive(remaining)):
            continue  # frees nothing the head lacks
        room = spare.get(holder.namespace)
        if room is not None and any(
            holder.returns.get(r, ZERO) > amount for r, amount in room.items()
        ):
            continue  # it would take its namespace below its guarantee
        chosen.append(holder)
        remaining = subtract(remaining, holder.returns)
        if room is not None:
            spare[holder.namespace] = subtract(room, holder.returns)
    if positive(remaining):
        return []  # it would wait anyway: preempt no one in vain
    return minimal(chosen, remaining)


def guarantee_spare(
    guaranteed: Mapping[str, Decimal], held: Mapping[str, Decimal]
) -> dict[str, Decimal]:
    """What a namespace holds beyond its guarantee (as kept), per guaranteed resource:
    preemption never takes it below its guarantee."""
    return {r: max(held.get(r, ZERO) - amount, ZERO) for r, amount in guaranteed.items()}


def minimal(chosen: list[Holder], remaining: Mapping[str, Decimal]) -> list[Holder]:
    """Drop, the last chosen first (the highest class, the longest admitted), every victim
    the others cover without: preempt as little as needed."""
    slack = {r: -v for r, v in remaining.items() if v < ZERO}  # freed beyond the need
    kept = list(chosen)
    for holder in reversed(chosen):
        returns = {r: v for r, v in holder.returns.items() if v > ZERO and r in remaining}
        if all(v <= slack.get(r, ZERO) for r, v in returns.items()):
            kept.remove(holder)
            slack = subtract(slack, returns)
    return kept


def still_asked(
    spec: ReservationPoolSpec, request: PreemptionRequest | None, own_class: str | None
) -> PreemptionRequest | None:
    """The pool's request as the envelope asked reads it: only while the pool's spec, read
    with it, still allows it (the pool Open, the preemptor's class still with
    PreemptLowerPriority, allowed in its namespace, above the class the envelope was
    admitted under; `own_class`: that class, None if its line recorded none). The pool
    drops a request no longer needed at its next pass; this covers the passes between."""
    if request is None or own_class is None or spec.state is not EnvelopeState.OPEN:
        return None
    rules = SharingRules.of(spec)
    namespace = request.preemptor.split("/", 1)[0]
    if not may_preempt(rules, request.priority_class):
        return None
    if class_refusal(rules, namespace, request.priority_class) is not None:
        return None
    if class_value(rules, request.priority_class) <= class_value(rules, own_class or None):
        return None
    return request


# --- the envelope's side -----------------------------------------------------------------


def verdict(
    request: PreemptionRequest,
    lines: Mapping[str, LedgerEntry],
    facts: Mapping[str, ClaimFacts],
    others: Sequence[str],
    now: datetime,
) -> tuple[Preemption, list[str]]:
    """The envelope's decision on its pool's request, on its lines and its claims' facts as
    read in this pass, and the claims it releases. `others`: what else holds part of it
    (child envelopes, loans, lost lines), in words: any refuses."""
    held = {uid: line for uid, line in lines.items() if line.phase.holds_capacity}
    refusals = list(others)
    for uid, line in sorted(held.items()):
        claim = facts.get(uid)
        if line.phase is not ClaimPhase.TENTATIVE:
            refusals.append(f"claim {line.claim} is {line.phase.value}")
        elif claim is None:
            refusals.append(f"claim {line.claim} is gone: it may have been dispatched")
        elif may_have_run(claim):
            refusals.append(f"claim {line.claim} is past its commit point")
        elif claim.pod is not None and claim.pod.uids:
            # Creating the workload pod is sending the branch, gated or not: whether the
            # operator lifted the gate first must not decide (found by review: a pass one
            # event behind handed the pod off and committed, a fresh one preempted).
            refusals.append(f"claim {line.claim} has a workload pod: its branch was sent")
    # A lease that has lapsed by this pass ends its claim by the clock (LeaseExpired), as it
    # would for a pass that saw the lapse before the request.
    released = sorted(
        uid for uid, line in held.items() if line.expires_at is None or now < line.expires_at
    )
    record = Preemption(
        outcome=PreemptionOutcome.REFUSED if refusals else PreemptionOutcome.PREEMPTED,
        preemptor=request.preemptor,
        preemptor_uid=request.preemptor_uid,
        priority_class=request.priority_class,
        decided_at=now,
        message=bounded(
            f"refused to give its room to {request.preemptor}: {names(refusals, 3)}"
            if refusals
            else f"gave its room to {request.preemptor} (priority class "
            f"{request.priority_class}): its {len(released)} Tentative claims released with "
            "reason Preempted, and it closed; queue again with a new envelope",
            MESSAGE_LENGTH,
        ),
    )
    return record, [] if refusals else released


def preempted(status: ReservationEnvelopeStatus) -> bool:
    """Its ledger recorded that it gave its room away: closed for good."""
    decision = status.preemption
    return decision is not None and decision.outcome is PreemptionOutcome.PREEMPTED
