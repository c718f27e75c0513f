"""Compensations: a business reversal or a follow-up charge after a claim settled
(client-disconnect.txt's `compensated` outcome; the void of an external authorization is a
refund with its reference). The settlement itself is never changed: each compensation the
claim's spec asks (`spec.compensations`, append-only, at most MAX_COMPENSATIONS) is applied
once, by its key, and recorded beside the settlement (`LedgerEntry.compensations`).

Only Consumable resources move: a Reusable one (devices, permits) was never charged, and a
Replenishing one comes back with its window; what is asked of them is recorded, not
applied. A refund gives back at most what the claim was charged net (its consumption, an
applied late adjustment and the compensations applied before it), so a claim's charge
never goes below zero. A charge the envelope has not the room for waits, unrecorded, with
first call on what comes back (the admission of new claims leaves it aside: a tenant cannot
dodge an invoice by holding its budget, found by review); at the last call (the envelope
closing, nothing held any more) it takes what there is and records the rest as not
charged. Once the envelope has closed (`room` is None) a compensation is recorded only.
Compensations apply in the order sent (the API server keeps the list's order): one that
waits holds back those after it. One asked of a claim that has not settled waits for its
settlement: nothing is recorded before.

Exactly once across crashes: a record that moves capacity is written in the envelope's
ledger together with the committed total it changes (one status write), and its key then
says it was applied, whatever pass sees it next.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal

from reservoir.core.contracts import default_contract
from reservoir.core.ledger import ZERO, add, positive, render_each, subtract
from reservoir.core.lifecycle import ClaimFacts, LedgerEvent, charged_now
from reservoir.core.model import (
    Compensation,
    CompensationRecord,
    Contract,
    ContractType,
    LedgerEntry,
)
from reservoir.core.quantity import format_quantity
from reservoir.core.text import MESSAGE_LENGTH, bounded

APPLIED = "Compensated"
RECORDED = "CompensationRecorded"


@dataclass
class Moved:
    """What this pass's compensations of one claim moved in the envelope's committed total."""

    charged: dict[str, Decimal] = field(default_factory=dict)
    refunded: dict[str, Decimal] = field(default_factory=dict)
    events: list[LedgerEvent] = field(default_factory=list)
    # A charge waiting for room: new claims are admitted only past it.
    waiting: dict[str, Decimal] = field(default_factory=dict)

    @property
    def moves(self) -> bool:
        return bool(positive(self.charged) or positive(self.refunded))

    def committed(self, committed: Mapping[str, Decimal]) -> dict[str, Decimal]:
        """The committed total once these moves are applied."""
        return subtract(add(committed, self.charged), self.refunded)


def waiting(entry: LedgerEntry, asked: Sequence[Compensation]) -> list[Compensation]:
    """The compensations asked that this settled entry has not recorded yet."""
    if entry.settlement is None:
        return []  # it waits for the settlement: nothing is recorded before
    done = {record.key for record in entry.compensations}
    return [c for c in asked if c.key not in done]


def compensate(
    entry: LedgerEntry,
    facts: ClaimFacts,
    declared: Mapping[str, Contract],
    fits: Callable[[LedgerEntry, LedgerEntry], bool],
    dimensions: frozenset[str],
    room: dict[str, Decimal] | None,
    now: datetime,
    last_call: bool = False,
) -> Moved:
    """Record (and apply, while `room` is not None) the compensations `facts` asks that
    `entry` has not recorded, in place. `declared`: the envelope's spec.contracts;
    `dimensions`: the envelope's resources. `room` is drawn down by charges and grows with
    refunds.

    A line with its new records must stay within the byte budget of the envelope's record
    in flight (`fits(line as it was, line with them)`, reservoir.core.reconcile): if it
    would not, nothing is recorded and they wait for a later pass (never recorded as "not
    applied" for a momentary lack of room)."""
    todo = waiting(entry, facts.spec.compensations)
    if not todo:
        return Moved()
    balance = dict(room) if room is not None else None
    net = charged_now(entry)
    records: list[CompensationRecord] = []
    moved = Moved()
    for asked in todo:
        record = _one(asked, net, balance, declared, dimensions, now, last_call)
        if record is None:
            # It waits for room, and so do those sent after it (in order, always).
            moved.waiting = {k: v for k, v in asked.charge.items() if k in dimensions and v > ZERO}
            break
        records.append(record)
        if record.applied:
            net = subtract(add(net, record.charged), record.refunded)
            moved.charged = add(moved.charged, record.charged)
            moved.refunded = add(moved.refunded, record.refunded)
        moved.events.append(_event(facts, record))
    if not records:
        return moved
    candidate = entry.model_copy(update={"compensations": [*entry.compensations, *records]})
    if not fits(entry, candidate):
        return Moved()
    entry.compensations = candidate.compensations
    if room is not None and balance is not None:
        room.update(balance)
    return moved


def _one(
    asked: Compensation,
    net: Mapping[str, Decimal],
    balance: dict[str, Decimal] | None,
    declared: Mapping[str, Contract],
    dimensions: frozenset[str],
    now: datetime,
    last_call: bool = False,
) -> CompensationRecord | None:
    """One compensation against the claim's net charge and the envelope's balance (None:
    closed, recorded only). `balance` is drawn down (or grown) when it applies. None: a
    charge the balance has not the room for, before the last call: it waits."""
    notes: list[str] = []
    refunded: dict[str, Decimal] = {}
    charged: dict[str, Decimal] = {}
    for resource, amount in sorted(asked.refund.items()):
        if not _consumable(resource, amount, declared, dimensions, notes):
            continue
        given = min(amount, max(net.get(resource, ZERO), ZERO))
        if given < amount:
            notes.append(
                f"{resource}: refunded {_q(given)} of {_q(amount)} asked "
                f"(the claim was charged {_q(max(net.get(resource, ZERO), ZERO))} net)"
            )
        refunded[resource] = given
    for resource, amount in sorted(asked.charge.items()):
        if not _consumable(resource, amount, declared, dimensions, notes):
            continue
        taken = amount
        if balance is not None:
            available = max(balance.get(resource, ZERO) + refunded.get(resource, ZERO), ZERO)
            if available < amount and not last_call:
                return None
            taken = min(amount, available)
            if taken < amount:
                notes.append(
                    f"{resource}: charged {_q(taken)} of {_q(amount)} asked "
                    f"(the envelope had {_q(available)} available)"
                )
        charged[resource] = taken
    refunded, charged = positive(refunded), positive(charged)
    applied = balance is not None and bool(refunded or charged)
    if balance is None:
        notes.insert(0, "recorded only: the envelope is not open")
    elif not applied:
        notes.append("nothing it asked could move")
    if applied and balance is not None:
        balance.update(subtract(add(balance, refunded), charged))
    return CompensationRecord(
        key=asked.key,
        charged=charged,
        refunded=refunded,
        applied=applied,
        reason=asked.reason,
        reference=asked.reference,
        note=bounded("; ".join(notes), MESSAGE_LENGTH) if notes else None,
        at=now,
    )


def _consumable(
    resource: str,
    amount: Decimal,
    declared: Mapping[str, Contract],
    dimensions: frozenset[str],
    notes: list[str],
) -> bool:
    """Whether this resource of a compensation can move; if not, why, in `notes`."""
    if amount <= ZERO:
        return False
    if resource not in dimensions:
        notes.append(f"{resource}: not a resource of the envelope, not applied")
        return False
    contract = (declared.get(resource) or default_contract(resource)).type
    if contract is not ContractType.CONSUMABLE:
        notes.append(f"{resource}: {contract.value}, never charged or refunded, not applied")
        return False
    return True


def _q(amount: Decimal) -> str:
    return format_quantity(amount)


def _event(facts: ClaimFacts, record: CompensationRecord) -> LedgerEvent:
    moved = render_each(("charged", record.charged), ("refunded", record.refunded))
    text = f"compensation {record.key} ({record.reason}): {moved or 'nothing moved'}"
    if record.reference:
        text += f", reference {record.reference}"
    if record.note:
        text += f"; {record.note}"
    if record.applied:
        return LedgerEvent(facts.uid, facts.name, APPLIED, text)
    return LedgerEvent(facts.uid, facts.name, RECORDED, text, warning=True)
