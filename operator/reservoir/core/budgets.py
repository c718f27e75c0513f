"""Budgets inside budgets: a child envelope is admitted by its parent (an envelope, or the
tenant's pool) like a claim, holds its whole capacity there as one reserved line, and when
it closes its committed total stays committed there and its balance returns: R − C,
upward, once.

Two sides, each deciding only on recorded facts:

- The parent's ledger (`settle_children`, `admit_child`): it reserves R for a waiting
  child, settles the line once the child's own status records that it closed (its
  `balanceReleased`, written once, never changed), and records a withdrawal for a child
  deleted or closed before it was admitted, so that the child may go knowing no parent
  will ever reserve for it again.
- The child's status (`admission`): it records where its capacity comes from once it sees
  its parent's ledger hold its line (then, and only then, it admits claims), and mirrors
  its settled line once the parent recorded it. That record is the arbiter: a parent
  whose child recorded another parent returns its line untouched.

Each line lives on its child once the child recorded it; the parent holds it only while a
move of it is in flight (reservoir.core.childlines), so the rules here run on the pass's
view of every line and a parent has no cap on its children.

Nothing here knows Kubernetes: a parent is a kind, a name and a UID.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal

from reservoir.core.contracts import mismatch, resolve, reusable
from reservoir.core.ledger import ZERO, add, fits, nonzero, render, subtract, within
from reservoir.core.lifecycle import LedgerEvent
from reservoir.core.model import (
    MAX_DEPTH,
    MAX_ENVELOPE_CHILDREN,
    ChildEntry,
    ChildPhase,
    Contract,
    ParentKind,
    ParentRecord,
    Preemption,
    PreemptionRequest,
)
from reservoir.core.policy import Admission, QueueKey
from reservoir.core.text import names

# Behind the head of the queue, which says why it waits (a message naming the head would
# rewrite every queued child's status at each admission).
QUEUED = Admission(False, "Queued", "queued behind envelopes ahead of it (priority, then age)")


@dataclass(frozen=True)
class ChildFacts:
    """What a parent reads of one child envelope: its spec and its own recorded status."""

    uid: str
    name: str
    created_at: datetime
    capacity: Mapping[str, Decimal]
    namespace: str = ""
    priority: int = 0
    priority_class: str | None = None  # the pool's class it names (a root envelope)
    max_tentative_claims: int | None = None  # its own policy's cap on tentative claims
    accepting: bool = True  # not closed, expired or being deleted: it may still be admitted
    record: ParentRecord | None = None  # the child's own record of where it draws from
    balance_released: Mapping[str, Decimal] | None = None  # set once the child has closed
    contracts: Mapping[str, Contract] = field(default_factory=dict)  # as the child declares
    readable: bool = True  # its spec could be read (else it is never admitted meanwhile)
    # For a pool's preemption (reservoir.core.preemption), from the child's own status:
    committed: Mapping[str, Decimal] = field(default_factory=dict)  # what its claims used
    preemptible: bool = False  # it shows nothing past a commit point
    preemption: Preemption | None = None  # its decision on the last request

    @property
    def queue_key(self) -> QueueKey:
        return QueueKey(self.priority, self.created_at, self.name, self.uid)

    @property
    def waiting(self) -> bool:
        """Not admitted anywhere, and not withdrawn: it waits for a parent's room."""
        return self.record is None


@dataclass(frozen=True)
class ParentIdentity:
    kind: ParentKind
    name: str
    uid: str


@dataclass
class ChildLedger:
    """A parent's child lines being reconciled (every line in view: those in flight and
    those its children hold, see reservoir.core.childlines), and what the pass did."""

    parent: ParentIdentity
    children: dict[str, ChildEntry]
    now: datetime
    committed: dict[str, Decimal] = field(default_factory=dict)  # running total, updated
    # Lines it may have in flight (its status's bound); new children take at most half, so
    # that settlements and withdrawals always have room and a deletion never waits on a
    # record full of admissions.
    max_lines: int = MAX_ENVELOPE_CHILDREN
    events: list[LedgerEvent] = field(default_factory=list)
    pending: dict[str, Admission] = field(default_factory=dict)  # child uid -> why waiting
    contracts: Mapping[str, Contract] = field(default_factory=dict)  # as the parent declares
    in_flight: set[str] = field(default_factory=set)  # lines in flight after the pass, so far
    postponed: bool = False  # a move was left for the next pass (the record was full)

    def _note(self, uid: str, entry: ChildEntry, reason: str, message: str) -> None:
        self.events.append(LedgerEvent(uid, entry.envelope, reason, message))

    def has_room(self, new: bool) -> bool:
        """Whether one more line may go in flight: a new child's only while half the
        record is free."""
        return len(self.in_flight) < (self.max_lines // 2 if new else self.max_lines)


def settle_children(
    ledger: ChildLedger,
    facts: Mapping[str, ChildFacts],
    force_settle_gone: Mapping[str, str],
) -> None:
    """Settle every reserved child line whose child recorded its close (R − C returns,
    C stays committed), return lines a child never drew on, and compact settled lines
    whose child carries them or is gone."""
    for uid, entry in list(ledger.children.items()):
        child = facts.get(uid)
        if entry.phase is ChildPhase.SETTLED:
            if child is None or (child.record is not None and child.record.settled == entry):
                del ledger.children[uid]  # retired: its child carries it, or is gone
                ledger.in_flight.discard(uid)
            continue
        if child is None:
            # Gone without settling (its finalizer removed by hand): what it used is
            # unknown, so it stays held until a person decides; then it is charged in full.
            why = force_settle_gone.get(uid, force_settle_gone.get(entry.envelope))
            if why is not None:
                _settle(ledger, uid, entry, dict(entry.reserved), "ForceSettled", why)
            continue
        record = child.record
        if record is None:
            continue  # reserved here, not yet seen by the child: it will record it
        if (record.kind, record.uid) != (ledger.parent.kind, ledger.parent.uid):
            # It draws from somewhere else, or recorded a withdrawal from another parent
            # (found another parent first, opened as a root): this line was never drawn on.
            _settle(ledger, uid, entry, {}, "AdmittedElsewhere", f"it draws from {record.name}")
            del ledger.children[uid]
            ledger.in_flight.discard(uid)
            continue
        if record.admitted_at is None or child.balance_released is None:
            continue  # still open or closing: its claims are settling inside it
        if uid not in ledger.in_flight and not ledger.has_room(new=False):
            ledger.postponed = True  # the record is full: settled on the next pass
            continue
        # Its balance in the resources drawn from here (from a pool, those it names).
        balance = {k: v for k, v in child.balance_released.items() if k in entry.reserved}
        if not within(balance, entry.reserved):
            ledger.events.append(
                LedgerEvent(
                    uid,
                    entry.envelope,
                    "UnreadableBalance",
                    f"its released balance {render(balance)} is not within its reservation "
                    f"{render(entry.reserved)}: held until it is",
                    warning=True,
                )
            )
            continue
        consumed = {k: v - balance.get(k, ZERO) for k, v in entry.reserved.items()}
        _settle(ledger, uid, entry, consumed, "Closed", "closed and returned its balance")


def _settle(
    ledger: ChildLedger,
    uid: str,
    entry: ChildEntry,
    consumed: dict[str, Decimal],
    reason: str,
    message: str,
) -> None:
    entry.phase = ChildPhase.SETTLED
    # A Reusable resource is never spent: a child (even one gone and force-settled) gives
    # all of it back (found by review: a gone child's GPUs were committed for good).
    kept = reusable(resolve(entry.reserved, ledger.contracts))
    consumed = {k: v for k, v in consumed.items() if k not in kept}
    entry.consumed = nonzero(consumed)
    entry.released = {
        k: v for k, v in subtract(entry.reserved, consumed).items() if v != ZERO or k in consumed
    }
    entry.settled_at = ledger.now
    entry.reason = reason
    ledger.in_flight.add(uid)
    ledger.committed = add(ledger.committed, entry.consumed)
    ledger._note(
        uid,
        entry,
        f"Child{reason}",
        f"{message}: committed {render(entry.consumed) or 'nothing'}, "
        f"returned {render(entry.released) or 'nothing'}",
    )


def drawn_part(
    kind: ParentKind, capacity: Mapping[str, Decimal], parent_capacity: Mapping[str, Decimal]
) -> dict[str, Decimal]:
    """What a child draws from its parent: all of its capacity from a parent envelope; from
    a pool, the resources the pool names (a quota caps what it names, like ResourceQuota:
    the rest of the envelope's capacity is its own)."""
    if kind is ParentKind.POOL:
        return {k: v for k, v in capacity.items() if k in parent_capacity}
    return dict(capacity)


def child_problem(
    capacity: Mapping[str, Decimal],
    parent_capacity: Mapping[str, Decimal],
    parent_depth: int,
    contracts: Mapping[str, Contract] | None = None,
    parent_contracts: Mapping[str, Contract] | None = None,
) -> str | None:
    """Why a child can never be admitted by this parent (shown by the child, skipped by the
    parent), or None. `contracts` are each side's declared ones."""
    unknown = sorted(set(capacity) - set(parent_capacity))
    if unknown:
        return f"its parent has no budget for {names(unknown)}"
    differ = mismatch(
        resolve(capacity, contracts or {}), resolve(parent_capacity, parent_contracts or {})
    )
    if differ:
        # A resource comes back one way: a GPU its parent reuses cannot be spent here.
        return f"ContractMismatch: its parent keeps {names(differ)} under another contract"
    too_big = sorted(k for k, v in capacity.items() if v > parent_capacity[k])
    if too_big:
        return f"it asks for more than its parent's whole capacity of {names(too_big)}"
    if parent_depth + 1 > MAX_DEPTH:
        return f"budgets nest at most {MAX_DEPTH} envelopes deep"
    return None


def admit_child(
    ledger: ChildLedger,
    child: ChildFacts,
    available: dict[str, Decimal],
    parent_capacity: Mapping[str, Decimal],
    parent_depth: int,
    parent_accepting: bool,
    blocked_by: str | None,
    tentative_claims: int | None = None,
) -> str | None:
    """Admit, withdraw or queue one waiting child. Returns the name blocking the queue;
    `available` is the pass's running balance; `tentative_claims`: what a pool grants it of
    its namespace's cap on tentative claims."""
    if not child.accepting or not parent_accepting:
        if ledger.has_room(new=False):
            why = "closed or deleted" if not child.accepting else "its parent admits no more"
            entry = ChildEntry(
                envelope=child.name,
                namespace=child.namespace,
                phase=ChildPhase.SETTLED,
                settled_at=ledger.now,
                reason="Withdrawn",
            )
            ledger.children[child.uid] = entry
            ledger.in_flight.add(child.uid)
            ledger._note(child.uid, entry, "ChildWithdrawn", f"never admitted: {why}")
        else:
            ledger.postponed = True
        return blocked_by
    if not child.readable:
        ledger.pending[child.uid] = Admission(
            False, "UnreadableSpec", "its spec cannot be read: admitted once it can be"
        )
        return blocked_by
    wanted = drawn_part(ledger.parent.kind, child.capacity, parent_capacity)
    problem = child_problem(
        wanted, parent_capacity, parent_depth, child.contracts, ledger.contracts
    )
    if problem is not None:
        ledger.pending[child.uid] = Admission(False, "CannotAdmit", problem, permanent=True)
        return blocked_by
    if blocked_by is not None:
        ledger.pending[child.uid] = QUEUED
        return blocked_by
    if not ledger.has_room(new=True):
        ledger.pending[child.uid] = Admission(
            False,
            "MovesInFlight",
            f"its parent records at most {ledger.max_lines // 2} new children's lines at "
            "once: admitted once its children have recorded theirs",
        )
        ledger.postponed = True
        return blocked_by
    if not fits(wanted, available):
        short = sorted(k for k, v in wanted.items() if v > available.get(k, ZERO))
        ledger.pending[child.uid] = Admission(
            False, "InsufficientCapacity", f"not enough available {names(short)}"
        )
        return child.name
    available.update(subtract(available, wanted))
    entry = ChildEntry(
        envelope=child.name,
        namespace=child.namespace,
        phase=ChildPhase.RESERVED,
        reserved=wanted,
        reserved_at=ledger.now,
        tentative_claims=tentative_claims,
        # A pool ranks what it preempts by the class named at admission, not by one
        # named since ("": none, value 0; unset: admitted before classes were recorded).
        priority_class=(child.priority_class or "")
        if ledger.parent.kind is ParentKind.POOL
        else None,
    )
    ledger.children[child.uid] = entry
    ledger.in_flight.add(child.uid)
    ledger._note(child.uid, entry, "ChildReserved", f"reserved {render(entry.reserved)}")
    return blocked_by


# --- the child's side ---------------------------------------------------------------------


@dataclass(frozen=True)
class ParentView:
    """What a child envelope sees of the parent it names (or the pool covering it)."""

    kind: ParentKind
    name: str
    uid: str | None = None  # None: not found
    depth: int | None = None  # the parent's recorded depth; None while it is not open
    capacity: Mapping[str, Decimal] = field(default_factory=dict)
    contracts: Mapping[str, Contract] = field(default_factory=dict)  # as the parent declares
    line: ChildEntry | None = None  # its ledger's line for this child
    deleting: bool = False
    cycle: bool = False  # following the parents leads back to this envelope
    # Why the parent admits none of this child now, whatever its room (a Closed pool, a
    # priority class its namespace may not use): shown while it waits.
    refusal: str | None = None
    # The pool's request that this envelope give its room to a higher class, if any.
    preemption: PreemptionRequest | None = None
    # For a waiting envelope: the envelopes the pool asked to give their room to it.
    preempting: int = 0

    @property
    def gone(self) -> bool:
        return self.uid is None


@dataclass(frozen=True)
class Admitted:
    """The child's record after this pass, and why it still waits if it does."""

    record: ParentRecord | None
    waiting: str | None = None


def draw_record(
    record: ParentRecord | None,
    parent: ParentView | None,
    capacity: Mapping[str, Decimal],
    now: datetime,
    contracts: Mapping[str, Contract] | None = None,
) -> Admitted:
    """Where this envelope draws from, recorded once: a root when it has no parent, the
    parent's once its ledger holds the line, "withdrawn" once the parent recorded that it
    never will. A recorded admission never changes; its settlement is mirrored once."""
    if record is not None:
        if (
            record.settled is None
            and parent is not None
            and parent.uid == record.uid
            and parent.line is not None
            and parent.line.phase is ChildPhase.SETTLED
        ):
            return Admitted(record.model_copy(update={"settled": parent.line}))
        return Admitted(record)
    if parent is None:
        return Admitted(ParentRecord(kind=ParentKind.ROOT, admitted_at=now))
    line = parent.line
    if parent.uid is not None and line is not None:
        base = ParentRecord(kind=parent.kind, name=parent.name, uid=parent.uid)
        if line.phase is ChildPhase.RESERVED:
            depth = (parent.depth or 0) + 1
            return Admitted(
                base.model_copy(
                    update={
                        "depth": depth,
                        "admitted_at": now,
                        "reserved": dict(line.reserved),
                        "stamp": line.stamp,
                        "tentative_claims": line.tentative_claims,
                        "priority_class": line.priority_class,
                    }
                )
            )
        return Admitted(base.model_copy(update={"settled": line}))  # withdrawn
    return Admitted(None, _why_waiting(parent, capacity, contracts or {}))


def _why_waiting(
    parent: ParentView, capacity: Mapping[str, Decimal], contracts: Mapping[str, Contract]
) -> str:
    what = f"{parent.kind.value} {parent.name}"
    if parent.cycle:
        return f"its parents form a cycle through {parent.name}: it can never be admitted"
    if parent.gone:
        return f"waiting for {what}, which does not exist"
    if parent.depth is None:
        return f"waiting for {what} to open"
    problem = child_problem(
        drawn_part(parent.kind, capacity, parent.capacity),
        parent.capacity,
        parent.depth,
        contracts,
        parent.contracts,
    )
    if problem is not None:
        return f"{what} cannot admit it: {problem}"
    if parent.refusal is not None:
        return f"waiting for {what}: {parent.refusal}"
    if parent.preempting:
        return (
            f"waiting for room in {what}, which asked {parent.preempting} envelopes of lower "
            "priority classes to give theirs (each decides on its own claims)"
        )
    return f"waiting for room in {what}"


def waiting_children(
    children: Sequence[ChildFacts], ledger: Mapping[str, ChildEntry]
) -> list[ChildFacts]:
    return [c for c in children if c.uid not in ledger and c.waiting]
