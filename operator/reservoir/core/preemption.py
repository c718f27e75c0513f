"""Preemption of tentative holds (issue 25; branch-claims.txt: "priority ordering for
interactive, batch, and agentic work"). An envelope of a pool's priority class whose
`preemptionPolicy` is PreemptLowerPriority, waiting at the head of the pool's queue for
room, takes it from admitted envelopes of lower classes that hold nothing past a commit
point. Work past its commit point is never preempted.

Two objects, each deciding on what it recorded itself (DESIGN.md §1.6):

1. The pool's pass (`requests`) picks the victims among its lines: each ranked by the class
   recorded on its line at admission (a class named since does not count), the lowest
   first, then the most recently admitted (Kueue's order); only envelopes whose own status
   shows no claim past a commit point and no child envelope; never below a namespace's
   guarantee; as few as free the room, and none unless they free all of it. It records a
   request naming each (`status.preemptions`). The pool itself releases nothing.
2. The victim's pass (`verdict`) reads the request from its pool and decides on its own
   lines and on its claims' facts as read in that pass, before anything else moves. If
   every claim holding capacity is Tentative and shows nothing past its commit point (no
   dispatch, usage or submission, no pod bound or started, no workload pod that may still
   start), and no child envelope or loan holds part of it, it records Preempted: each of
   those claims is released once (reason Preempted, the path of a cancel before dispatch,
   so its settlement key keeps it once), and the envelope closes and returns its balance to
   the pool, which admits the preemptor in its turn. Otherwise it records Refused, and
   nothing moves.

A dispatch written after the victim read its claims lands on a released claim and is
refused, as after a lease's end: the SDK dispatches only a claim whose record still shows
Tentative, and a worker starts work once its claim shows Committed. A preempted envelope
stays closed (its admission is recorded once); the workflow queues again with a new
envelope, which waits in the pool's queue like any other.

Pure: no Kubernetes, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from reservoir.core.budgets import ChildFacts
from reservoir.core.fairshare import EPOCH, SharingRules, Waiting, class_value
from reservoir.core.ledger import ZERO, positive, subtract
from reservoir.core.lifecycle import ClaimFacts, LedgerEvent, may_have_run
from reservoir.core.model import (
    MAX_PREEMPTIONS,
    ChildEntry,
    ChildPhase,
    ClaimPhase,
    EnvelopePhase,
    LedgerEntry,
    Preemption,
    PreemptionOutcome,
    PreemptionPolicy,
    PreemptionRequest,
    ReservationEnvelopeStatus,
)
from reservoir.core.model.lending import LoanPhase
from reservoir.core.text import MESSAGE_LENGTH, bounded, names

PAST_COMMIT = frozenset({ClaimPhase.COMMITTED, ClaimPhase.RUNNING, ClaimPhase.DETACHED})


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
    value: int  # the value now of the class recorded on its line
    admitted_at: datetime
    returns: Mapping[str, Decimal]  # what closing would give back: R less what it committed
    preemptible: bool  # its status shows nothing past a commit point
    decision: Preemption | None  # its own record of its last decision


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
                value=class_value(rules, line.priority_class),
                admitted_at=line.reserved_at or EPOCH,
                returns=positive(subtract(line.reserved, envelope.committed)),
                preemptible=envelope.preemptible,
                decision=envelope.preemption,
            )
        )
    return found


def may_preempt(rules: SharingRules, entry: Waiting) -> bool:
    rule = rules.classes.get(entry.priority_class) if entry.priority_class else None
    return rule is not None and rule.preemption is PreemptionPolicy.PREEMPT_LOWER_PRIORITY


def decided(holder: Holder, preemptor_uid: str) -> bool:
    return holder.decision is not None and holder.decision.preemptor_uid == preemptor_uid


def closing(holder: Holder) -> bool:
    """It decided Preempted: what it returns is on its way here."""
    return holder.decision is not None and holder.decision.outcome is PreemptionOutcome.PREEMPTED


def requests(
    rules: SharingRules,
    recorded: Mapping[str, PreemptionRequest],
    head: Blocked | None,
    found: Sequence[Holder],
    held: Mapping[str, Mapping[str, Decimal]],
    waiting: Iterable[str],
    now: datetime,
) -> tuple[dict[str, PreemptionRequest], list[LedgerEvent]]:
    """The pool's preemption requests after this pass: those recorded that still wait on an
    undecided envelope for a preemptor still waiting, and new ones for `head` (the waiting
    envelope at the head of the queue, short of room) if its class may preempt. `held`:
    what each namespace holds here; `waiting`: the UIDs of the envelopes still waiting."""
    by_uid = {holder.uid: holder for holder in found}
    still_waiting = set(waiting)
    kept = {
        uid: request
        for uid, request in recorded.items()
        if uid in by_uid
        and not decided(by_uid[uid], request.preemptor_uid)
        and request.preemptor_uid in still_waiting
    }
    if head is None or not may_preempt(rules, head.entry):
        return kept, []
    asked = {uid for uid, r in kept.items() if r.preemptor_uid == head.entry.uid}
    chosen = victims(rules, head, found, held, asked)
    if not chosen or len(kept) + len(chosen) > MAX_PREEMPTIONS:
        return kept, []
    preemptor = f"{head.entry.namespace}/{head.entry.name}"
    events = []
    for holder in chosen:
        kept[holder.uid] = PreemptionRequest(
            envelope=holder.name,
            namespace=holder.namespace,
            preemptor=preemptor,
            preemptor_uid=head.entry.uid,
            priority_class=head.entry.priority_class or "",
            requested_at=now,
        )
        events.append(
            LedgerEvent(
                holder.uid,
                holder.name,
                "PreemptionRequested",
                f"the pool asks {holder.namespace}/{holder.name} to give its room to "
                f"{preemptor} (priority class {head.entry.priority_class}): it closes if it "
                "holds nothing past a commit point",
            )
        )
    return dict(sorted(kept.items())), events


def victims(
    rules: SharingRules,
    head: Blocked,
    found: Sequence[Holder],
    held: Mapping[str, Mapping[str, Decimal]],
    asked: set[str],
) -> list[Holder]:
    """Whom to ask for `head`, besides those `asked` already: none if what is on its way
    (those asked, and envelopes closing after a preemption) covers what it lacks, or if
    everyone it may preempt would not."""
    remaining = dict(head.short)
    for holder in found:
        if holder.uid in asked or closing(holder):
            remaining = subtract(remaining, holder.returns)
    if not positive(remaining):
        return []
    value = class_value(rules, head.entry.priority_class)
    candidates = [
        h
        for h in found
        if h.value < value
        and h.preemptible
        and h.uid not in asked
        and not closing(h)
        and not decided(h, head.entry.uid)  # it refused this preemptor once
    ]
    # Lowest class first, then the most recently admitted (it has done the least).
    candidates.sort(key=lambda h: h.uid)
    candidates.sort(key=lambda h: h.admitted_at, reverse=True)
    candidates.sort(key=lambda h: h.value)
    spare = {ns: guarantee_spare(kept, held.get(ns, {})) for ns, kept in rules.kept().items()}
    chosen: list[tuple[Holder, dict[str, Decimal]]] = []
    for holder in candidates:
        if not positive(remaining):
            break
        usable = usable_return(holder, spare.get(holder.namespace))
        if not any(usable.get(r, ZERO) > ZERO for r in positive(remaining)):
            continue  # frees nothing the head lacks
        chosen.append((holder, usable))
        remaining = subtract(remaining, usable)
        if holder.namespace in spare:
            spare[holder.namespace] = subtract(spare[holder.namespace], usable)
    if positive(remaining):
        return []  # it would wait anyway: preempt no one in vain
    return minimal(chosen, remaining)


def guarantee_spare(
    guaranteed: Mapping[str, Decimal], held: Mapping[str, Decimal]
) -> dict[str, Decimal]:
    """What a namespace holds beyond its guarantee (as kept), per guaranteed resource:
    preemption never takes it below its guarantee."""
    return {r: max(held.get(r, ZERO) - amount, ZERO) for r, amount in guaranteed.items()}


def usable_return(holder: Holder, spare: Mapping[str, Decimal] | None) -> dict[str, Decimal]:
    if spare is None:
        return dict(holder.returns)
    return {r: min(v, spare[r]) if r in spare else v for r, v in holder.returns.items()}


def minimal(
    chosen: list[tuple[Holder, dict[str, Decimal]]], remaining: Mapping[str, Decimal]
) -> list[Holder]:
    """Drop, the last chosen first (the highest class, the longest admitted), every victim
    the others cover without: preempt as little as needed."""
    slack = {r: -v for r, v in remaining.items() if v < ZERO}  # freed beyond the need
    kept = list(chosen)
    for holder, usable in reversed(chosen):
        if all(usable.get(r, ZERO) <= slack.get(r, ZERO) for r in usable if usable[r] > ZERO):
            kept.remove((holder, usable))
            slack = subtract(slack, usable)
    return [holder for holder, _ in kept]


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
        elif claim.pod is not None and claim.pod.may_still_start:
            refusals.append(f"a workload pod of claim {line.claim} may still start")
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
            f"{request.priority_class}): its {len(held)} Tentative claims released with "
            "reason Preempted, and it closed; queue again with a new envelope",
            MESSAGE_LENGTH,
        ),
    )
    return record, [] if refusals else sorted(held)


def preempted(status: ReservationEnvelopeStatus) -> bool:
    """Its ledger recorded that it gave its room away: closed for good."""
    decision = status.preemption
    return decision is not None and decision.outcome is PreemptionOutcome.PREEMPTED
