"""Ledger arithmetic: per-resource totals and the capacity invariant.

For every resource dimension, at every moment any reader can observe:

    committed + reserved + reconciling + lent + available == capacity + borrowed

(`lent` and `borrowed` are loans between sibling envelopes, zero unless one lends.)
`reserved` sums R over Tentative/Committed/Running entries and open child envelopes, and
`reconciling` over Detached ones; `committed` is a running total (settled entries are
pruned once their claim is gone, their consumption stays committed). Nothing here knows
Kubernetes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from decimal import Decimal

from reservoir.core.model import (
    DEVICE_CLASSES,
    SUMMARY_LENGTH,
    ChildEntry,
    ChildPhase,
    ClaimPhase,
    LedgerEntry,
    ResourceTotals,
)
from reservoir.core.quantity import format_quantity
from reservoir.core.text import bounded

ZERO = Decimal(0)
Resources = dict[str, Decimal]


class InvariantViolationError(RuntimeError):
    """A ledger that would break the capacity invariant. It is never written."""


def add(a: Mapping[str, Decimal], b: Mapping[str, Decimal]) -> Resources:
    return {k: a.get(k, ZERO) + b.get(k, ZERO) for k in {*a, *b}}


def subtract(a: Mapping[str, Decimal], b: Mapping[str, Decimal]) -> Resources:
    return {k: a.get(k, ZERO) - b.get(k, ZERO) for k in {*a, *b}}


def total(maps: Iterable[Mapping[str, Decimal]]) -> Resources:
    result: Resources = {}
    for one in maps:
        result = add(result, one)
    return result


def positive(resources: Mapping[str, Decimal]) -> Resources:
    """The resources with something left: what is still owed, short or outstanding."""
    return {k: v for k, v in resources.items() if v > ZERO}


def nonzero(resources: Mapping[str, Decimal]) -> Resources:
    return {k: v for k, v in resources.items() if v != ZERO}


def within(part: Mapping[str, Decimal], whole: Mapping[str, Decimal]) -> bool:
    """Every amount of `part` is between zero and the same resource's amount in `whole`."""
    return set(part) <= set(whole) and all(ZERO <= v <= whole[k] for k, v in part.items())


def fits(request: Mapping[str, Decimal], available: Mapping[str, Decimal]) -> bool:
    return all(amount <= available.get(name, ZERO) for name, amount in request.items())


def exceeds(usage: Mapping[str, Decimal], reserved: Mapping[str, Decimal]) -> list[str]:
    """Resources whose usage is above what was reserved (an overrun), sorted."""
    return sorted(name for name, amount in usage.items() if amount > reserved.get(name, ZERO))


def clean(resources: Mapping[str, Decimal], dimensions: Iterable[str]) -> Resources:
    """The map over exactly `dimensions`, zero-filled: totals always list every resource."""
    return {name: resources.get(name, ZERO) for name in sorted(dimensions)}


def compute_totals(
    capacity: Mapping[str, Decimal],
    committed: Mapping[str, Decimal],
    entries: Iterable[LedgerEntry],
    children: Iterable[ChildEntry] = (),
    lent: Mapping[str, Decimal] | None = None,
    borrowed: Mapping[str, Decimal] | None = None,
) -> ResourceTotals:
    """Totals from the capacity, the running committed total, the live entries, the open
    child envelopes (each holds its whole capacity as one reserved line) and what is lent
    to and borrowed from siblings, outstanding.
    Raises InvariantViolationError rather than produce a ledger that overdraws a dimension."""
    entries = list(entries)
    lent, borrowed = lent or {}, borrowed or {}
    held = total(still_held(e) for e in entries if e.phase.holds_capacity and not _detached(e))
    # A settled claim's devices stay held until the scheduler confirms their release.
    held = add(held, total(devices_in_use(e) for e in entries))
    # What failed attempts keep for their branch's next attempt is reserved for it.
    held = add(held, total(e.retry.resources for e in entries if e.retry and e.retry.active))
    held = add(held, total(c.reserved for c in children if c.phase is ChildPhase.RESERVED))
    reconciling = total(still_held(e) for e in entries if _detached(e))
    dimensions = set(capacity)
    stray = (set(held) | set(reconciling) | set(committed) | set(lent) | set(borrowed)) - dimensions
    if stray:
        raise InvariantViolationError(f"ledger holds resources the envelope lacks: {sorted(stray)}")
    available = subtract(add(capacity, borrowed), total([committed, held, reconciling, lent]))
    parts = {"committed": committed, "reserved": held, "reconciling": reconciling}
    negative = sorted(
        f"{part} {name}"
        for part, amounts in {**parts, "available": available}.items()
        for name, value in amounts.items()
        if value < 0
    )
    if negative:  # refused as the invariant, not as a value the model cannot hold
        raise InvariantViolationError(f"the ledger would be negative: {', '.join(negative)}")
    totals = ResourceTotals(
        capacity=clean(capacity, dimensions),
        committed=clean(committed, dimensions),
        reserved=clean(held, dimensions),
        reconciling=clean(reconciling, dimensions),
        lent=clean(lent, dimensions) if lent else {},
        borrowed=clean(borrowed, dimensions) if borrowed else {},
        available=clean(available, dimensions),
    )
    check_invariant(totals)
    return totals


def still_held(entry: LedgerEntry) -> dict[str, Decimal]:
    """What a live claim holds: its R, less the Reusable part returned once its work was
    known to be over (issue 22: a permit comes back while the tokens wait for the usage)."""
    if not entry.reusable_returned:
        return dict(entry.reserved)
    return subtract(entry.reserved, entry.reusable_returned)


def devices_in_use(entry: LedgerEntry) -> dict[str, Decimal]:
    """What a settled claim returned of its device resources (R − C) while its allocation
    still exists: a pod may still run on them (its workload pod outlives the settlement),
    so they count against the envelope until the ResourceClaim's allocation is gone (issue
    21: else a tenant kept GPUs past settlement and beyond its envelope). What it consumed
    (C) is committed already."""
    held = entry.devices
    if held is None or held.released or not entry.phase.terminal:
        return {}
    return {
        name: amount
        for name, amount in entry.released.items()
        if name in DEVICE_CLASSES and amount > ZERO
    }


def _detached(entry: LedgerEntry) -> bool:
    return entry.phase is ClaimPhase.DETACHED


def check_invariant(totals: ResourceTotals) -> None:
    """committed + reserved + reconciling + lent + available == capacity + borrowed,
    nothing negative."""
    for name, capacity in totals.capacity.items():
        parts = {
            "committed": totals.committed.get(name, ZERO),
            "reserved": totals.reserved.get(name, ZERO),
            "reconciling": totals.reconciling.get(name, ZERO),
            "lent": totals.lent.get(name, ZERO),
            "available": totals.available.get(name, ZERO),
        }
        borrowed = totals.borrowed.get(name, ZERO)
        negative = [part for part, value in parts.items() if value < 0]
        if borrowed < 0:
            negative.append("borrowed")
        if negative:
            negatives = ", ".join(negative)
            raise InvariantViolationError(f"{name}: {negatives} would be negative: {parts}")
        if sum(parts.values(), ZERO) != capacity + borrowed:
            raise InvariantViolationError(
                f"{name}: {parts} do not add up to capacity {capacity} + borrowed {borrowed}"
            )


def render(resources: Mapping[str, Decimal]) -> str:
    """`tokens=63 nvidia.com/gpu=8`: a resource map on one line."""
    return " ".join(f"{name}={format_quantity(resources[name])}" for name in sorted(resources))


def render_each(*parts: tuple[str, Mapping[str, Decimal]]) -> str:
    """`refunded cost=1, charged tokens=5`: each non-empty map after its word."""
    return ", ".join(f"{word} {render(amounts)}" for word, amounts in parts if amounts)


def one_line(resources: Mapping[str, Decimal]) -> str:
    """Totals for printer columns, cut to the summary field's bound: 16 long resource names
    at 1E each do not fit in one column, and the totals hold the exact figures anyway."""
    return bounded(render(resources), SUMMARY_LENGTH)
