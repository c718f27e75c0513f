"""A tenant's pool: the root envelopes of its namespaces are admitted from it like claims,
each holding its whole capacity as one reserved line, and return R − C here when they
close. The same child-line rules as an envelope's child envelopes (reservoir.core.budgets);
a pool has no claims, no lifetime and no parent of its own (it is depth 0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from reservoir.core.budgets import (
    ChildFacts,
    ChildLedger,
    ParentIdentity,
    admit_child,
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
from reservoir.core.inflight import NEXT_MOVES
from reservoir.core.ledger import compute_totals, one_line
from reservoir.core.ledgersize import pool_lines
from reservoir.core.lifecycle import LedgerEvent
from reservoir.core.model import (
    SUMMARY_LENGTH,
    ChildEntry,
    ChildPhase,
    EnvelopeSummary,
    ParentKind,
    ReservationPoolSpec,
    ReservationPoolStatus,
)
from reservoir.core.policy import Admission
from reservoir.core.text import bounded
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
    settle_children(children, {e.uid: e for e in envelopes}, pool.force_settle_gone)
    lines = view.lines
    balance = compute_totals(pool.spec.capacity, children.committed, (), lines.values()).available
    queue = sorted(waiting_children(envelopes, lines), key=lambda c: c.queue_key.sort_key())
    blocked_by: str | None = None
    for child in queue:
        blocked_by = admit_child(
            children,
            child,
            balance,
            pool.spec.capacity,
            POOL_DEPTH,
            not pool.deleting,
            blocked_by,
        )
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
            Desired(
                "Ready",
                not pool.deleting,
                "Deleting" if pool.deleting else "AdmitsEnvelopes",
                "waiting for its envelopes to settle" if pool.deleting else "",
            ),
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
    if children.postponed:
        wake_at = min(wake_at or now + NEXT_MOVES, now + NEXT_MOVES)
    return PoolReconciliation(ledger, children.events, children.pending, wake_at, after)
