"""Where a child envelope's line lives: on the child, or on its parent while it moves.

The protocol of claims' lines (reservoir.core.inflight), for budgets inside budgets. A
parent (an envelope, or the tenant's pool) keeps its totals, the child lines **in flight**
(`status.children`) and `childRecords`: the count and a digest of the (child UID, stamp)
of every reserved line its children hold. A move of a line (reserved, settled, withdrawn)
is written in flight, stamped with the parent's next `stamp`; the child records the line
in its own `status.parent` on its next pass; the parent retires its copy once the child
shows it. So a parent holds a few dozen lines however many children draw on it, and its
totals are the sum of the lines in view, checked against the digest: a view that does not
add up has lost a child (its object went without its line being settled), and what that
child held stays held, as one line a person settles by name.

A line moves one way, Reserved → Settled: of two copies the settled one is newer, else the
one with the higher stamp (lines written before stamps existed are 0 and sort right too).

Nothing here knows Kubernetes.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal

from reservoir.core.budgets import ChildFacts
from reservoir.core.inflight import EnvelopeBehindError, digest
from reservoir.core.ledger import add, positive, subtract, total
from reservoir.core.model import ChildEntry, ChildPhase, ChildRecords, ParentRecord

# The name of the line that keeps what lost children held (see lost_line).
LOST_CHILDREN_PREFIX = "lost-children-"


def newer(line: ChildEntry, than: ChildEntry) -> bool:
    """Whether `line` records a later move than `than` (a settled line is later than any
    reserved one)."""
    return (line.phase is ChildPhase.SETTLED, line.stamp) > (
        than.phase is ChildPhase.SETTLED,
        than.stamp,
    )


def held_line(child: ChildFacts, parent_uid: str) -> ChildEntry | None:
    """The child's own copy of its line with this parent, from its `status.parent`: its
    settled line once mirrored, else its admission; None if it recorded none here."""
    return line_of(child.record, child.name, child.namespace, parent_uid)


def line_of(
    record: ParentRecord | None, name: str, namespace: str, parent_uid: str
) -> ChildEntry | None:
    """The line envelope `name` holds with the parent `parent_uid`, read from its record."""
    if record is None or not parent_uid or record.uid != parent_uid:
        return None
    if record.settled is not None:
        return record.settled
    if record.admitted_at is None:
        return None
    # From fields the record's own validation already checked: built, not parsed again.
    return ChildEntry.model_construct(
        envelope=name,
        namespace=namespace,
        stamp=record.stamp,
        phase=ChildPhase.RESERVED,
        reserved=dict(record.reserved),
        consumed={},
        released={},
        reserved_at=record.admitted_at,
        tentative_claims=record.tentative_claims,
        priority_class=record.priority_class,
        settled_at=None,
        reason=None,
    )


def current(in_flight: ChildEntry | None, held: ChildEntry | None) -> ChildEntry | None:
    """A line's current copy: in flight while the child shows an older move."""
    if in_flight is not None and (held is None or newer(in_flight, held)):
        return in_flight
    return held


@dataclass
class ChildView:
    """One pass's view of every child line: the parent's in-flight lines and the lines its
    children hold (in flight wins while the child shows an older move). `lines` are
    shallow copies: a pass moves a line by assigning its fields, never by changing a
    resource map in place, so the copies read as read stay as read (a pool of 10,000
    envelopes spent most of its pass deep-copying them)."""

    lines: dict[str, ChildEntry] = field(default_factory=dict)  # the pass's to move
    in_flight: dict[str, ChildEntry] = field(default_factory=dict)  # not yet retired
    held: dict[str, ChildEntry] = field(default_factory=dict)  # uid -> the child's line
    recorded: frozenset[str] = frozenset()  # the parent's in-flight lines as read

    def reserved(self) -> dict[str, Decimal]:
        """What the lines in view hold (children's capacity reserved here)."""
        return total(c.reserved for c in self.lines.values() if c.phase is ChildPhase.RESERVED)


def merge_children(
    in_flight: Mapping[str, ChildEntry],
    stamp: int,
    children: Iterable[ChildFacts],
    parent_uid: str,
) -> ChildView:
    """The view a pass starts from: the parent's lines in flight (`in_flight`, at its
    `stamp`) and the lines its children (as listed, after the parent) hold."""
    view = ChildView(recorded=frozenset(in_flight))
    for child in children:
        line = held_line(child, parent_uid)
        if line is None:
            continue
        if line.stamp > stamp:
            raise EnvelopeBehindError(
                f"child {child.name} shows stamp {line.stamp}, its parent {stamp}"
            )
        entry = in_flight.get(child.uid)
        if entry is not None and newer(entry, line):
            continue  # the child has not recorded its latest move yet
        view.held[child.uid] = line
        view.lines[child.uid] = line.model_copy()
    for uid, entry in in_flight.items():
        if uid not in view.held:
            view.in_flight[uid] = entry
            view.lines[uid] = entry.model_copy()
    return view


def records(held: Mapping[str, ChildEntry]) -> ChildRecords:
    """The parent's check of the lines its children hold that count (reserved here)."""
    counting = {u: line for u, line in held.items() if line.phase is ChildPhase.RESERVED}
    return ChildRecords(
        count=len(counting),
        digest=digest((u, line.stamp) for u, line in counting.items()),
        reserved=total(line.reserved for line in counting.values()),
    )


def _counted(view: ChildView) -> dict[str, ChildEntry]:
    """The held lines the parent's last write counted: not those it had in flight then
    (retired in this pass, they are counted from its write on)."""
    return {u: line for u, line in view.held.items() if u not in view.recorded}


def adds_up(view: ChildView, recorded: ChildRecords | None) -> bool:
    """Whether the reserved lines children hold are exactly those the parent recorded."""
    if recorded is None:
        return True  # written before children held their lines: every line was in flight
    return records(_counted(view)) == recorded


def missing(view: ChildView, recorded: ChildRecords | None) -> dict[str, Decimal]:
    """What the lines the parent recorded as held, and no child in view holds, reserved."""
    if recorded is None:
        return {}
    return positive(subtract(recorded.reserved, records(_counted(view)).reserved))


def lost_line(
    view: ChildView,
    lost: Mapping[str, Decimal],
    stamp: int,
    now: datetime,
    decided: Collection[str] = (),
) -> str | None:
    """Children listed after the parent that do not add up to its record: a child went with
    its line (its finalizer removed by hand while the operator was away). What the parent
    held for it (`lost`, see `missing`) stays held, as one reserved line named
    LOST_CHILDREN_PREFIX + stamp (what is lost before a person settled it is added to it)
    that only a person settles (force-settle-gone naming it: charged in full, Reusable
    resources returned, as for a child gone without settling). Returns its name, or None
    when nothing is missing. `decided`: the names a person's force-settle-gone holds."""
    lost = positive(lost)
    if not lost:
        return None
    for name, line in view.lines.items():
        # (Not into one a person has decided on: that decision was about what it held.)
        open_line = line.phase is ChildPhase.RESERVED and name not in decided
        if name.startswith(LOST_CHILDREN_PREFIX) and open_line:
            # One such line at a time, however many passes find children gone: the record
            # in flight stays bounded (review: a tenant removing its envelopes' finalizers
            # one by one filled it, and every other tenant's envelopes waited).
            line.reserved = add(line.reserved, lost)
            return name
    name = f"{LOST_CHILDREN_PREFIX}{stamp}"
    view.lines[name] = ChildEntry(
        envelope=name, phase=ChildPhase.RESERVED, reserved=lost, reserved_at=now
    )
    return name


@dataclass
class ChildPlacement:
    """Where each child line of a pass's result goes."""

    in_flight: dict[str, ChildEntry]  # the parent's record
    records: ChildRecords  # the check of the lines children hold


def place_children(view: ChildView, lines: Mapping[str, ChildEntry], stamp: int) -> ChildPlacement:
    """Sort a pass's resulting lines (`lines`: every line still in view; a line compacted
    away is retired) by where they go. A line the pass moved, or one its child has not
    recorded yet, is in flight (moved ones with `stamp`, the parent's next); a line as its
    child holds it stays with the child."""
    in_flight: dict[str, ChildEntry] = {}
    held: dict[str, ChildEntry] = {}
    for uid, line in lines.items():
        before = view.in_flight.get(uid)
        if before is not None:
            if line != before:
                line.stamp = stamp
            in_flight[uid] = line
            continue
        copy = view.held.get(uid)
        if copy is not None and line == copy:
            held[uid] = line
            continue
        line.stamp = stamp
        in_flight[uid] = line
    return ChildPlacement(dict(sorted(in_flight.items())), records(held))


def moved_count(view: ChildView, lines: Mapping[str, ChildEntry]) -> int:
    """How many lines a pass's result puts in flight so far (see place_children)."""
    return sum(
        1 for uid, line in lines.items() if uid in view.in_flight or view.held.get(uid) != line
    )
