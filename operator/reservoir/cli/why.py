"""`kubectl reservoir why CLAIM` (or `why renv/ENVELOPE`): why it waits, who is ahead of
it, and where it stands, from what is recorded. Read-only: the envelope's queue is
replayed with the envelope's own order (priority, then age), and the pool's with the pool's
own fair-share queue (reservoir.core.fairshare) over the holdings the pool recorded
(`status.shares`), so what it shows is what the operator decides."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from decimal import Decimal

from reservoir.cli.tables import table
from reservoir.core.budgets import drawn_part
from reservoir.core.fairshare import EPOCH, FairQueue, SharingRules, Waiting, class_value
from reservoir.core.ledger import render
from reservoir.core.model import ClaimPhase, NamespaceUsage, ParentKind
from reservoir.sdk.views import ClaimView, EnvelopeView, PoolView

AHEAD_SHOWN = 5


def explain_claim(
    claim: ClaimView,
    envelope: EnvelopeView | None,
    claims: Sequence[ClaimView],
    pool: PoolView | None,
) -> str:
    head = f"branchclaim/{claim.name} is {claim.status.phase.value}"
    if claim.status.phase is not ClaimPhase.PENDING:
        reason = claim.status.settlement.reason if claim.status.settlement else None
        return f"{head}{f' ({reason})' if reason else ''}: it is not waiting."
    lines = [f"{head}: {claim.status.queue_reason or 'waiting for its envelope to admit it'}"]
    waiting = sorted(
        (c for c in claims if c.status.phase is ClaimPhase.PENDING and not c.deleting),
        key=claim_order,
    )
    names = [c.name for c in waiting]
    if claim.name in names:
        ahead = waiting[: names.index(claim.name)]
        lines.append(
            f"its envelope's queue (priority, then age): {len(ahead) + 1} of {len(waiting)}"
        )
        lines += [
            f"  ahead: {c.name} (priority {c.spec.priority}, requests {render(c.spec.requests)})"
            for c in ahead[:AHEAD_SHOWN]
        ]
        if len(ahead) > AHEAD_SHOWN:
            lines.append(f"  ... and {len(ahead) - AHEAD_SHOWN} more")
    if envelope is not None and envelope.status.parent is None:
        lines += ["", explain_envelope(envelope, pool)]
    return "\n".join(lines)


def claim_order(claim: ClaimView) -> tuple[int, datetime, str]:
    return (-claim.spec.priority, claim.created_at or EPOCH, claim.name)


def explain_envelope(envelope: EnvelopeView, pool: PoolView | None) -> str:
    head = f"reservationenvelope/{envelope.name}"
    record = envelope.status.parent
    decision = envelope.status.preemption
    if record is not None:
        where = f"{record.kind.value} {record.name}" if record.name else "no parent (a root)"
        said = f"{head} is admitted (draws from {where}): it is not waiting."
        if decision is not None:
            said += f"\npreemption ({decision.outcome.value}): {decision.message}"
        return said
    reason = envelope.status.queue_reason or "waiting for its parent to admit it"
    lines = [f"{head} is {envelope.status.phase.value}: {reason}"]
    if envelope.parent is not None or pool is None or pool.spec is None:
        return "\n".join(lines)
    spec = pool.spec
    rules = SharingRules.of(spec)
    shares = pool.status.shares
    own = rules.share(envelope.namespace)
    value = class_value(rules, envelope.priority_class)
    cap = rules.cap(envelope.namespace)
    lines.append(
        f"pool {pool.name} ({spec.state.value}): class "
        f"{envelope.priority_class or '(none)'} = {value}; namespace {envelope.namespace}: "
        f"weight {own.weight}"
        + (f", guaranteed {render(own.guaranteed)}" if own.guaranteed else "")
        + (f", at most {cap} open" if cap is not None else "")
    )
    lines += ["fair share (lowest weighted dominant share goes first):", shares_table(shares)]
    queue = replay(pool, rules)
    order = queue.order
    uids = [w.uid for w in order]
    set_aside = queue.refused.get(envelope.uid)
    if set_aside is not None:
        lines.append(f"the pool sets it aside ({set_aside.reason}): {set_aside.message}")
    if envelope.uid in uids:
        ahead = order[: uids.index(envelope.uid)]
        lines.append(f"the pool's queue: {len(ahead) + 1} of {len(order)} it can see")
        lines += [
            f"  ahead: {w.namespace}/{w.name} (class {w.priority_class or '(none)'}, "
            f"asks {render(w.wanted)})"
            for w in ahead[:AHEAD_SHOWN]
        ]
        if len(ahead) > AHEAD_SHOWN:
            lines.append(f"  ... and {len(ahead) - AHEAD_SHOWN} more")
    asked = sorted(
        f"{r.namespace}/{r.envelope}"
        for r in pool.status.preemptions.values()
        if r.preemptor_uid == envelope.uid
    )
    if asked:
        lines.append(
            f"the pool asked {len(asked)} envelopes of lower classes to give their room for "
            f"it (each decides on its own claims): {', '.join(asked[:AHEAD_SHOWN])}"
        )
    if not pool.complete:
        lines.append(
            "(some of the pool's namespaces could not be listed: their envelopes are "
            "counted in WAITING, not shown above)"
        )
    return "\n".join(lines)


def shares_table(shares: Mapping[str, NamespaceUsage]) -> str:
    """The pool's recorded standing of each namespace, the first in line first."""
    rows = [["NAMESPACE", "WEIGHT", "SHARE", "HELD", "OPEN", "WAITING"]]
    rows += [
        [ns, str(u.weight), u.share, render(u.held) or "-", str(u.open), str(u.waiting)]
        for ns, u in sorted(shares.items(), key=lambda item: (Decimal(item[1].share), item[0]))
    ]
    return table(rows)


def replay(pool: PoolView, rules: SharingRules) -> FairQueue:
    """The pool's queue over the waiting envelopes the caller can see, from what the pool
    recorded each namespace holds, taken to the end: its `order`, and what it set aside
    (`refused`: a class or a cap)."""
    held = {ns: dict(u.held) for ns, u in pool.status.shares.items()}
    open_counts = {ns: u.open for ns, u in pool.status.shares.items()}
    tentative = {ns: u.tentative_claims for ns, u in pool.status.shares.items()}
    drawing = set(pool.namespaces if pool.drawing is None else pool.drawing)
    waiting = [
        Waiting(
            e.uid,
            e.namespace,
            e.name,
            e.created_at or EPOCH,
            drawn_part(ParentKind.POOL, e.amounts, rules.capacity),
            e.priority_class,
        )
        for e in pool.envelopes
        if e.status.parent is None and e.parent is None and e.accepting and e.namespace in drawing
    ]
    queue = FairQueue(rules, held, open_counts, waiting, tentative)
    while (entry := queue.next()) is not None:
        queue.admitted(entry)  # as if each fits: the order, not the room
    return queue
