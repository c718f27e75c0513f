"""Replenishing resources: what was committed comes back once its window has passed.

A sliding window, kept in WINDOW_SLICES slices per window: a consumption committed at time
t is recorded in the slice holding t and returns at that slice's end plus one window, so
between one window and one window and a slice after t, never earlier. Why sliding: a fixed
window admits up to twice the limit across a boundary, which a provider counting in its own
sliding window (or token bucket) refuses. Why never early: the provider counts from its own
request time, before the claim settled, so returning a window after settlement never lets
the budget admit more than the provider's limit within any window.

For every Replenishing resource, committed == the sum of its slices: this module keeps the
two in step. Nothing here knows Kubernetes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from reservoir.core.model import WINDOW_SLICES, Contract, ContractType, WindowSlice
from reservoir.core.quantity import format_quantity

ZERO = Decimal(0)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
Windows = dict[str, list[WindowSlice]]


def replenishing(contracts: Mapping[str, Contract]) -> dict[str, int]:
    """Replenishing resources and their windows in seconds."""
    return {
        name: c.window_seconds
        for name, c in contracts.items()
        if c.type is ContractType.REPLENISHING and c.window_seconds
    }


def slice_of(now: datetime, window_seconds: int) -> tuple[datetime, datetime]:
    """The slice holding `now` (aligned on the epoch, so every pass agrees) and when what
    is committed in it returns."""
    width = timedelta(seconds=window_seconds) / WINDOW_SLICES
    start = EPOCH + width * ((now - EPOCH) // width)
    return start, start + width + timedelta(seconds=window_seconds)


def expire_windows(
    committed: Mapping[str, Decimal],
    windows: Windows,
    contracts: Mapping[str, Contract],
    now: datetime,
) -> tuple[dict[str, Decimal], Windows]:
    """Slices whose window has passed return: their amounts leave the committed total."""
    committed = dict(committed)
    kept: Windows = {}
    for name in replenishing(contracts):
        slices = windows.get(name, [])
        for one in slices:
            if one.returns_at <= now:
                committed[name] = max(committed.get(name, ZERO) - one.amount, ZERO)
        live = [s for s in slices if s.returns_at > now]
        if live:
            kept[name] = live
    return committed, kept


def record_windows(
    committed: Mapping[str, Decimal],
    windows: Windows,
    contracts: Mapping[str, Contract],
    now: datetime,
) -> Windows:
    """Bring the slices in step with the committed total: what this pass committed beyond
    the slices goes into the current slice, and what it gave back (a late adjustment, a
    refund) leaves the newest slices first."""
    result: Windows = {}
    for name, window in replenishing(contracts).items():
        slices = [s.model_copy() for s in windows.get(name, [])]
        delta = committed.get(name, ZERO) - sum((s.amount for s in slices), ZERO)
        if delta > ZERO:
            start, returns_at = slice_of(now, window)
            same = [one for one in slices if one.start == start]
            if same:
                same[0].amount += delta
            else:
                slices.append(WindowSlice(start=start, returns_at=returns_at, amount=delta))
        # Given back (nothing does today: adjustments and compensations leave Replenishing
        # resources to their window): from the slices that return last.
        slices.sort(key=lambda one: (one.returns_at, one.start))
        while delta < ZERO and slices:
            take = min(-delta, slices[-1].amount)
            slices[-1].amount -= take
            delta += take
            if slices[-1].amount == ZERO:
                slices.pop()
        # Bounded: a window has WINDOW_SLICES slices and one more partly passed. More can
        # only come from a clock that went back: the first to return merges into the next,
        # which returns later, never earlier (found by review: merged by position, a
        # consumption returned before its window had passed).
        slices.sort(key=lambda one: (one.returns_at, one.start))
        while len(slices) > WINDOW_SLICES + 1:
            first = slices.pop(0)
            slices[0].amount += first.amount
        if slices:
            result[name] = slices
    return result


def next_return(windows: Windows) -> datetime | None:
    """When the earliest slice returns: the envelope looks again then."""
    return min((s.returns_at for slices in windows.values() for s in slices), default=None)


def in_window(windows: Mapping[str, Sequence[WindowSlice]]) -> dict[str, Decimal]:
    """What each Replenishing resource has committed in its window: its slices' sum."""
    return {name: sum((s.amount for s in slices), ZERO) for name, slices in windows.items()}


def refill_note(short: Mapping[str, Decimal], windows: Windows) -> str:
    """For a claim short of Replenishing resources: when their windows give some back."""
    parts = []
    for name in sorted(short):
        slices = windows.get(name)
        if slices:
            first = min(slices, key=lambda s: s.returns_at)
            parts.append(
                f"{name} is a rate limit: {format_quantity(first.amount)} comes back at "
                f"{first.returns_at.strftime('%Y-%m-%dT%H:%M:%SZ')}"
            )
    return "; ".join(parts)
