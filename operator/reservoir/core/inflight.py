"""Where a claim's ledger line lives: on the claim, or on the envelope while it moves.

Each claim's status carries its own ledger line (`status.ledger`), the authoritative
record of that claim. The envelope's status holds only totals and the lines **in flight**:
a move that changes the envelope's totals is a compare-and-swap on the envelope (the new
totals and the moved line, stamped with the envelope's new `stamp`), then a
compare-and-swap on the claim's status carrying the line with that stamp. The in-flight
copy is retired once the claim's status shows a stamp at least as new; until then it
wins over the claim's copy, so a kill -9 between the two writes loses nothing, and a
claim write whose answer was lost is recognised by its stamp.

A move that leaves the totals as they were (a commit, a renewal, usage so far) is one
write to the claim's status, never to the envelope, and never of a line still in flight.

What the envelope cannot list, it can check: `claimRecords` is the count and a digest of
the (claim UID, stamp) of every line held by claims that still counts toward the totals.
A pass whose view of the claims does not match it has seen the claims too early (it reads
them again, fresh) or lost one (its object went without its line being settled: the
difference is kept, never returned, as one Detached line a person settles by name).

Nothing here knows Kubernetes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal

from reservoir.core.ledger import ZERO, devices_in_use, positive, still_held, subtract, total
from reservoir.core.model import ClaimPhase, ClaimRecords, LedgerEntry

# Lines a pass may add to the envelope's record in flight for claims that held nothing
# before (admissions, and verdicts on claims never admitted): the record stays a few
# dozen lines however many claims arrive at once; the rest wait for the next pass.
IN_FLIGHT_LIMIT = 64
# Moves of lines claims already hold, in one pass (a mass cancel on deletion, leases
# lapsing together): past this, the rest move on the next pass, a second later.
MOVES_PER_PASS = 256
# How soon a pass comes back for the moves it left (past a cap above, or a full record).
NEXT_MOVES = timedelta(seconds=1)
# The name of the line that keeps what lost claims held (see lost_line).
LOST_PREFIX = "lost-claims-"


class ClaimViewBehindError(Exception):
    """The claims as seen do not add up to the envelope's record: read them again."""


class EnvelopeBehindError(Exception):
    """A claim shows a move newer than the envelope as read: read the envelope again."""


def newest(in_flight: LedgerEntry | None, held: LedgerEntry | None) -> LedgerEntry | None:
    """A claim's current line: the envelope's copy in flight while the claim shows an older
    stamp, else the claim's own."""
    if in_flight is not None and (held is None or held.stamp < in_flight.stamp):
        return in_flight
    return held


def counts(line: LedgerEntry) -> bool:
    """Whether a line still counts toward the envelope's totals or admissions: it holds
    capacity, its devices are still allocated, or it keeps capacity for a retry."""
    return (
        line.phase.holds_capacity
        or bool(devices_in_use(line))
        or (line.retry is not None and line.retry.active)
    )


def footprint(line: LedgerEntry | None) -> tuple[object, ...]:
    """What of a line the envelope's totals and admissions depend on. A move that leaves
    it as it was is written to the claim alone. (Tentative → Committed leaves it: a stale
    view reads that only as more cautious, a tentative claim counted too long.)"""
    if line is None:
        return ()
    return (
        counts(line),
        line.phase.holds_capacity,
        line.phase is ClaimPhase.DETACHED,
        _sorted(still_held(line)) if line.phase.holds_capacity else (),
        _sorted(devices_in_use(line)),
        _sorted(line.retry.resources) if line.retry is not None and line.retry.active else (),
        # A settlement, a late adjustment and compensations move the committed total.
        line.settlement,
        line.adjustment,
        line.compensations,
        # A device hand-off lifts the workload pod's gate: recorded on the envelope first,
        # like every move that lets work start on held devices.
        line.devices,
        line.handed_off_at,
        line.handed_off_to,
    )


def _sorted(resources: Mapping[str, Decimal]) -> tuple[tuple[str, Decimal], ...]:
    return tuple(sorted((k, v) for k, v in resources.items() if v != ZERO))


def digest(lines: Iterable[tuple[str, int]]) -> str:
    """An order-free digest of (claim UID, stamp) pairs: the XOR of their hashes."""
    value = 0
    for uid, stamp in lines:
        value ^= int.from_bytes(hashlib.sha256(f"{uid}/{stamp}".encode()).digest()[:16], "big")
    return f"{value:032x}"


def records(held: Mapping[str, LedgerEntry]) -> ClaimRecords:
    """The envelope's check of the lines its claims hold (those that count)."""
    counting = [(uid, line.stamp) for uid, line in held.items() if counts(line)]
    return ClaimRecords(count=len(counting), digest=digest(counting))


@dataclass
class View:
    """One pass's view of every line: the envelope's in-flight lines and the lines its
    claims hold (in-flight wins while the claim shows an older stamp)."""

    lines: dict[str, LedgerEntry] = field(default_factory=dict)
    in_flight: dict[str, LedgerEntry] = field(default_factory=dict)  # not yet retired
    held: dict[str, LedgerEntry] = field(default_factory=dict)  # uid -> the claim's line
    recorded: frozenset[str] = frozenset()  # the envelope's entries as read (any retired)
    # uid -> the line `lines` holds a copy of, as read: the pass moves the copies and
    # compares them with these, which nothing writes to (a claim's facts may be kept for
    # the next pass; the envelope's entries are the status as read).
    read: dict[str, LedgerEntry] = field(default_factory=dict)


def merge(
    entries: Mapping[str, LedgerEntry],
    stamp: int,
    claim_lines: Mapping[str, LedgerEntry],
    departed: Mapping[str, LedgerEntry],
) -> View:
    """The view a pass starts from: the envelope's lines in flight (`entries`, its
    `stamp`), `claim_lines` (the lines claims that exist show) and `departed` (the last line
    of claims seen deleted: their objects are gone)."""
    view = View(recorded=frozenset(entries))
    newest = max((line.stamp for line in claim_lines.values()), default=0)
    if newest > stamp:
        raise EnvelopeBehindError(f"a claim shows stamp {newest}, the envelope {stamp}")
    for uid, line in {**departed, **claim_lines}.items():
        entry = entries.get(uid)
        if entry is not None and line.stamp < entry.stamp:
            continue  # the claim has not seen its latest move yet
        view.held[uid] = line
        if counts(line):
            view.lines[uid] = line.copied()
            view.read[uid] = line
    for uid, entry in entries.items():
        if uid not in view.held:
            view.in_flight[uid] = entry
            view.lines[uid] = entry.copied()
            view.read[uid] = entry
    return view


def adds_up(view: View, recorded: ClaimRecords | None) -> bool:
    """Whether the held lines that count are exactly those the envelope recorded."""
    if recorded is None:
        return True  # written before claims held their lines: every line was in flight
    return records(_counting_held(view)) == recorded


def _counting_held(view: View) -> dict[str, LedgerEntry]:
    """The held lines the envelope's last write counted in its digest: not those it had in
    flight then (a line retired in this pass is counted from this pass's write on)."""
    return {u: line for u, line in view.held.items() if counts(line) and u not in view.recorded}


def lost_amounts(
    view: View,
    reserved: Mapping[str, Decimal],
    reconciling: Mapping[str, Decimal],
    children: Mapping[str, Decimal],
) -> dict[str, Decimal]:
    """What the envelope's totals hold that no line in view accounts for, nor its open
    child envelopes (`children`: what they hold): the lines of claims gone without a
    settlement (their objects deleted with the finalizer removed by hand while the
    operator was away)."""
    lines = list(view.lines.values())
    seen = total(
        [*(still_held(e) for e in lines if e.phase.holds_capacity), *map(devices_in_use, lines)]
    )
    seen = total(
        [seen, children, *(e.retry.resources for e in lines if e.retry and e.retry.active)]
    )
    return positive(subtract(total([reserved, reconciling]), seen))


@dataclass
class Placement:
    """Where each line of a pass's result goes."""

    in_flight: dict[str, LedgerEntry] = field(default_factory=dict)  # the envelope's record
    to_claims: dict[str, LedgerEntry] = field(default_factory=dict)  # claim status writes
    held: dict[str, LedgerEntry] = field(default_factory=dict)  # on claims after the pass

    @property
    def records(self) -> ClaimRecords:
        return records(self.held)


def place(
    view: View,
    lines: Mapping[str, LedgerEntry],
    present: Iterable[str],
    stamp: int,
    postponed: Iterable[str] = (),
) -> Placement:
    """Sort a pass's resulting lines (`lines`: every line still in view) by where they go.
    `present`: the UIDs of claims whose objects exist (a line can only be held by one).
    A changed line goes in flight with `stamp` (the envelope's next stamp) unless its
    footprint is unchanged and it is not in flight: then it is written to the claim alone.
    `postponed`: lines the pass left for the next one (past its caps); the last line of a
    claim seen deleted stays with the operator until then, counted as held."""
    exists = set(present)
    later = set(postponed)
    placement = Placement()
    for uid, line in lines.items():
        if uid in later and uid not in view.in_flight and uid not in exists:
            placement.held[uid] = line
            continue
        before = view.in_flight.get(uid)
        if before is not None:
            if line != before:
                line.stamp = stamp
            placement.in_flight[uid] = line
            if uid in exists:
                placement.to_claims[uid] = line
            continue
        held = view.held.get(uid) if uid in exists else None
        if held is not None and footprint(line) == footprint(held):
            line.stamp = held.stamp
            if line != held:
                placement.to_claims[uid] = line
            placement.held[uid] = line
            continue
        line.stamp = stamp
        placement.in_flight[uid] = line
        if uid in exists:
            placement.to_claims[uid] = line
    return placement
