"""A tenant's pool: the root envelopes of its namespaces are admitted from it like claims,
each holding its whole capacity as one reserved line, and return R − C here when they
close. The same child-line rules as an envelope's child envelopes (reservoir.core.budgets);
a pool has no claims, no lifetime and no parent of its own (it is depth 0).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal

from reservoir.core.budgets import (
    ChildFacts,
    ChildLedger,
    ParentIdentity,
    admit_child,
    drawn_part,
    settle_children,
    waiting_children,
)
from reservoir.core.childlines import (
    adds_up,
    lost_line,
    merge_children,
    missing,
    place_children,
)
from reservoir.core.conditions import Desired, merge_conditions
from reservoir.core.contracts import (
    raise_peak,
    resolve,
    reusable,
    summary,
    types,
    uncommit_reusable,
)
from reservoir.core.fairshare import (
    POOL_CLOSED,
    FairQueue,
    SharingRules,
    Waiting,
    never_fits_reason,
    over_guaranteed,
    rendered_share,
    spent_for_good,
    standing,
    tentative_limit_reason,
)
from reservoir.core.inflight import NEXT_MOVES
from reservoir.core.ledger import ZERO, add, compute_totals, nonzero, one_line, positive, subtract
from reservoir.core.ledgersize import pool_lines
from reservoir.core.lifecycle import LedgerEvent
from reservoir.core.model import (
    MAX_POOL_NAMESPACES,
    SUMMARY_LENGTH,
    ChildEntry,
    ChildPhase,
    EnvelopeState,
    EnvelopeSummary,
    NamespaceUsage,
    ParentKind,
    ReservationPoolSpec,
    ReservationPoolStatus,
)
from reservoir.core.policy import Admission
from reservoir.core.preemption import Blocked, holders, requests
from reservoir.core.text import bounded, names
from reservoir.core.windows import expire_windows, next_return, record_windows

POOL_DEPTH = 0
LOST_MESSAGE = (
    "envelopes went without settling here (their finalizers removed by hand): what they "
    "held stays held until a person settles this line (force-settle-gone naming it)"
)


@dataclass(frozen=True)
class PoolFacts:
    spec: ReservationPoolSpec
    name: str
    uid: str
    generation: int = 1
    deleting: bool = False
    force_settle_gone: Mapping[str, str] = field(default_factory=dict)


@dataclass
class PoolReconciliation:
    status: ReservationPoolStatus
    events: list[LedgerEvent]
    pending: dict[str, Admission]  # envelope uid -> why it waits
    wake_at: datetime | None = None  # when a Replenishing window returns something
    # Every line after the pass, in flight or held by its envelope (`status.children` keeps
    # only those in flight): those not yet settled and mirrored.
    lines: dict[str, ChildEntry] = field(default_factory=dict)
    # The waiting envelopes' UIDs in the order the pass considered them (fair share).
    order: list[str] = field(default_factory=list)


def reconcile_pool(
    pool: PoolFacts,
    status: ReservationPoolStatus,
    envelopes: Sequence[ChildFacts],
    now: datetime,
) -> PoolReconciliation:
    """`envelopes`: the root envelopes of the pool's namespaces (those without a parent), and
    any other envelope this pool's ledger names. A line whose envelope is missing has been
    confirmed gone by the caller. Envelopes that opened as roots before the pool covered
    their namespace are shown (condition AllEnvelopesCapped), never capped after the fact."""
    ledger = status.copied()
    contracts = resolve(pool.spec.capacity, pool.spec.contracts)
    # What closed envelopes committed of a Replenishing resource returns a window later.
    committed, ledger.windows = expire_windows(
        ledger.totals.committed, ledger.windows, contracts, now
    )
    committed = uncommit_reusable(committed, reusable(contracts))  # as in reconcile
    # Every line: those in flight here and those the envelopes (listed after the pool) hold.
    view = merge_children(status.children, status.stamp, envelopes, pool.uid)
    lost = None
    if not adds_up(view, status.child_records):
        gone = missing(view, status.child_records)
        lost = lost_line(view, gone, status.stamp + 1, now, pool.force_settle_gone)
    children = ChildLedger(
        ParentIdentity(ParentKind.POOL, pool.name, pool.uid),
        view.lines,
        now,
        committed,
        max_lines=pool_lines(frozenset(pool.spec.capacity)),
        contracts=pool.spec.contracts,
        in_flight=set(view.in_flight) | ({lost} if lost else set()),
    )
    if lost is not None:
        children.events.append(LedgerEvent(lost, lost, "ChildLinesLost", LOST_MESSAGE))
    by_uid = {e.uid: e for e in envelopes}
    settle_children(children, by_uid, pool.force_settle_gone)
    lines = view.lines
    balance = compute_totals(pool.spec.capacity, children.committed, (), lines.values()).available
    # What is spent for good (Consumable) never comes back to be admitted into.
    spent = spent_for_good(pool.spec, children.committed)
    waiting = waiting_children(envelopes, lines)
    rules = SharingRules.of(pool.spec)  # once a pass: every step below reads it
    order, head = admit_fairly(pool, rules, children, waiting, lines, balance, spent)
    # Worked out again at every pass: a pool that admits nothing (Closed, or going) has no
    # head, and asks no one.
    held = holdings(lines.values())  # after this pass's admissions
    asked = requests(rules, status.preemptions, head, holders(rules, lines, by_uid), held[0], now)
    ledger.preemptions = asked.requests
    children.events += asked.events
    ledger.windows = record_windows(children.committed, ledger.windows, contracts, now)
    ledger.totals = compute_totals(pool.spec.capacity, children.committed, (), lines.values())
    ledger.contracts = types(contracts)
    ledger.peak = raise_peak(ledger.peak, ledger.totals, contracts)
    counts: dict[str, int] = {}
    for entry in lines.values():
        counts[entry.phase.value] = counts.get(entry.phase.value, 0) + 1
    if children.pending:
        counts["Pending"] = len(children.pending)
    ledger.counts = dict(sorted(counts.items()))
    ledger.shares = namespace_usage(pool, rules, held, envelopes, children.pending)
    ledger.summary = EnvelopeSummary(
        capacity=one_line(ledger.totals.capacity),
        available=one_line(ledger.totals.available),
        committed=one_line(ledger.totals.committed),
        live=sum(1 for e in lines.values() if e.phase is ChildPhase.RESERVED),
        contracts=bounded(summary(contracts), SUMMARY_LENGTH),
    )
    uncapped = sorted(
        f"{e.namespace}/{e.name}"
        for e in envelopes
        if e.record is not None and e.record.kind is ParentKind.ROOT and e.accepting
    )
    ledger.conditions = merge_conditions(
        ledger.conditions,
        [
            ready(pool),
            guarantees_fit(rules),
            Desired(
                "AllEnvelopesCapped",
                not uncapped,
                "OpenedBeforePool" if uncapped else "Capped",
                f"{len(uncapped)} envelopes opened as roots before this pool covered their "
                f"namespace and are not capped by it: {', '.join(uncapped[:5])}"
                if uncapped
                else "",
            ),
        ],
        now,
        pool.generation,
    )
    ledger.observed_generation = pool.generation
    # The envelopes keep their lines; this pool, those in flight.
    after = dict(lines)
    placement = place_children(view, lines, status.stamp + 1)
    ledger.children, ledger.child_records = placement.in_flight, placement.records
    if any(line.stamp > status.stamp for line in ledger.children.values()):
        ledger.stamp = status.stamp + 1
    wake_at = next_return(ledger.windows)
    if asked.wake_at is not None:  # an envelope that refused may be asked again then
        wake_at = min(wake_at or asked.wake_at, asked.wake_at)
    if children.postponed:
        wake_at = min(wake_at or now + NEXT_MOVES, now + NEXT_MOVES)
    return PoolReconciliation(ledger, children.events, children.pending, wake_at, after, order)


def ready(pool: PoolFacts) -> Desired:
    if pool.deleting:
        return Desired("Ready", False, "Deleting", "waiting for its envelopes to settle")
    if pool.spec.state is EnvelopeState.CLOSED:
        return Desired("Ready", False, "Closed", POOL_CLOSED.message)
    return Desired("Ready", True, "AdmitsEnvelopes", "")


def guarantees_fit(rules: SharingRules) -> Desired:
    """Guarantees that cannot be kept as written, said (no schema rule can add them up, nor
    tell a resource's contract): beyond the capacity, or of a resource that is not
    Reusable."""
    problems = []
    over = over_guaranteed(rules)
    if over:
        problems.append(
            f"the namespaces' guarantees add up to more than the capacity of {names(over)}: "
            "each is kept scaled down in proportion"
        )
    if rules.unkept:
        problems.append(
            f"guarantees of {names(sorted(rules.unkept))} are not kept: only a Reusable "
            "resource's can be (what is spent does not come back)"
        )
    if problems:
        reason = "ExceedCapacity" if over else "NotReusable"
        return Desired("GuaranteesFit", False, reason, "; ".join(problems))
    return Desired("GuaranteesFit", True, "Fit", "")


def admit_fairly(
    pool: PoolFacts,
    rules: SharingRules,
    children: ChildLedger,
    waiting: Sequence[ChildFacts],
    lines: Mapping[str, ChildEntry],
    balance: dict[str, Decimal],
    spent: Mapping[str, Decimal],
) -> tuple[list[str], Blocked | None]:
    """Admit what waits in fair-share order (reservoir.core.fairshare), withdraw what closed
    before it was admitted. Returns the UIDs considered, in order, and the first that waits
    for room (the head of the queue, which a class may preempt for)."""
    capacity = pool.spec.capacity
    queued: list[Waiting] = []
    for child in waiting:
        if not child.accepting or pool.deleting or not child.readable:
            # Withdrawn (closed before admission, or the pool goes), or unreadable: no turn.
            admit_child(children, child, balance, capacity, POOL_DEPTH, not pool.deleting, None)
        elif pool.spec.state is EnvelopeState.CLOSED:
            children.pending[child.uid] = POOL_CLOSED
        else:
            wanted = drawn_part(ParentKind.POOL, child.capacity, capacity)
            queued.append(
                Waiting(
                    child.uid,
                    child.namespace,
                    child.name,
                    child.created_at,
                    wanted,
                    child.priority_class,
                    child.max_tentative_claims,
                )
            )
    held, open_counts, tentative = holdings(lines.values())
    queue = FairQueue(rules, held, open_counts, queued, tentative)
    facts = {child.uid: child for child in waiting}
    blocked_by: str | None = None
    head: Waiting | None = None
    while (entry := queue.next()) is not None:
        grant = queue.tentative_grant(entry)
        if grant == 0 and entry.max_tentative != 0:
            children.pending[entry.uid] = tentative_limit_reason()  # waits, blocks no one
            continue
        if queue.never_fits(entry, spent):
            children.pending[entry.uid] = never_fits_reason()  # waits, blocks no one
            continue
        own = queue.within_guarantee(entry)  # its own part: no one ahead could use it
        room = queue.room(entry, balance)
        blocked_by = (
            admit_child(
                children,
                facts[entry.uid],
                room,
                capacity,
                POOL_DEPTH,
                True,
                None if own else blocked_by,
                grant,
            )
            or blocked_by
        )
        line = children.children.get(entry.uid)
        if line is not None and line.phase is ChildPhase.RESERVED:
            queue.admitted(entry, grant)
            balance.update(subtract(balance, line.reserved))
        elif head is None and short_of_room(children.pending.get(entry.uid)):
            head = entry
    children.pending.update(queue.refused)
    return [entry.uid for entry in queue.order], shortfall(queue, head, balance)


def shortfall(
    queue: FairQueue, head: Waiting | None, balance: Mapping[str, Decimal]
) -> Blocked | None:
    """What the head of the queue lacks once the pass is done (those admitted after it,
    within their guarantees, took their part): the balance less the other namespaces'
    unused guarantees, not clamped at zero (guarantees beyond what is free are lacking
    too: found by review, victims were preempted in vain under them)."""
    if head is None:
        return None
    kept = queue.kept_for_others(head.namespace)
    free = {r: balance.get(r, ZERO) - kept.get(r, ZERO) for r in head.wanted}
    return Blocked(head, positive(subtract(head.wanted, free)))


def short_of_room(waits: Admission | None) -> bool:
    return waits is not None and waits.reason == "InsufficientCapacity"


# What each namespace's open envelopes hold, how many there are, their tentative grants.
Holdings = tuple[dict[str, dict[str, Decimal]], dict[str, int], dict[str, int]]


def holdings(lines: Iterable[ChildEntry]) -> Holdings:
    """What each namespace's open envelopes hold here, how many there are, and the
    tentative claims they were granted."""
    held: dict[str, dict[str, Decimal]] = {}
    open_counts: dict[str, int] = {}
    tentative: dict[str, int] = {}
    for line in lines:
        if line.phase is ChildPhase.RESERVED:
            ns = line.namespace
            held[ns] = add(held.get(ns, {}), line.reserved)
            open_counts[ns] = open_counts.get(ns, 0) + 1
            tentative[ns] = tentative.get(ns, 0) + (line.tentative_claims or 0)
    return held, open_counts, tentative


def namespace_usage(
    pool: PoolFacts,
    rules: SharingRules,
    holding: Holdings,
    envelopes: Sequence[ChildFacts],
    pending: Mapping[str, Admission],
) -> dict[str, NamespaceUsage]:
    """Per namespace holding or waiting here (`holding`: what `holdings` found): the pool's
    fair-share standing."""
    held, open_counts, tentative = holding
    waiting: dict[str, int] = {}
    for envelope in envelopes:
        if envelope.uid in pending:
            waiting[envelope.namespace] = waiting.get(envelope.namespace, 0) + 1
    # The pool's namespaces only: a lost line (children removed by hand) belongs to none.
    listed = set(pool.spec.namespaces)
    shown = sorted((set(held) | set(waiting)) & listed)[:MAX_POOL_NAMESPACES]
    return {
        namespace: NamespaceUsage(
            held=nonzero(held.get(namespace, {})),
            share=rendered_share(
                standing(
                    rules,
                    namespace,
                    held.get(namespace, {}),
                    open_counts.get(namespace, 0),
                    tentative.get(namespace, 0),
                )
            ),
            weight=rules.share(namespace).weight,
            open=open_counts.get(namespace, 0),
            waiting=waiting.get(namespace, 0),
            tentative_claims=tentative.get(namespace, 0),
        )
        for namespace in shown
    }
