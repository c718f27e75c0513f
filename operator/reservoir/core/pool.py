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
from reservoir.core.conditions import Desired, merge_conditions
from reservoir.core.contracts import (
    raise_peak,
    resolve,
    reusable,
    summary,
    types,
    uncommit_reusable,
)
from reservoir.core.ledger import compute_totals, one_line
from reservoir.core.ledgersize import pool_lines
from reservoir.core.lifecycle import LedgerEvent
from reservoir.core.model import (
    SUMMARY_LENGTH,
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
    ledger = status.model_copy(deep=True)
    contracts = resolve(pool.spec.capacity, pool.spec.contracts)
    # What closed envelopes committed of a Replenishing resource returns a window later.
    committed, ledger.windows = expire_windows(
        ledger.totals.committed, ledger.windows, contracts, now
    )
    committed = uncommit_reusable(committed, reusable(contracts))  # as in reconcile
    children = ChildLedger(
        ParentIdentity(ParentKind.POOL, pool.name, pool.uid),
        ledger.children,
        now,
        committed,
        max_lines=pool_lines(frozenset(pool.spec.capacity)),
        contracts=pool.spec.contracts,
    )
    settle_children(children, {e.uid: e for e in envelopes}, pool.force_settle_gone)
    balance = compute_totals(
        pool.spec.capacity, children.committed, (), ledger.children.values()
    ).available
    queue = sorted(
        waiting_children(envelopes, ledger.children), key=lambda c: c.queue_key.sort_key()
    )
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
    ledger.totals = compute_totals(
        pool.spec.capacity, children.committed, (), ledger.children.values()
    )
    ledger.contracts = types(contracts)
    ledger.peak = raise_peak(ledger.peak, ledger.totals, contracts)
    counts: dict[str, int] = {}
    for entry in ledger.children.values():
        counts[entry.phase.value] = counts.get(entry.phase.value, 0) + 1
    if children.pending:
        counts["Pending"] = len(children.pending)
    ledger.counts = dict(sorted(counts.items()))
    ledger.summary = EnvelopeSummary(
        capacity=one_line(ledger.totals.capacity),
        available=one_line(ledger.totals.available),
        committed=one_line(ledger.totals.committed),
        live=sum(1 for e in ledger.children.values() if e.phase is ChildPhase.RESERVED),
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
    return PoolReconciliation(
        ledger, children.events, children.pending, next_return(ledger.windows)
    )
