"""Borrowing between sibling envelopes (same parent envelope): an explicit policy, off by
default (child-settlement.txt: "an explicit policy rather than the default", with sibling
protection, revocation and priority).

A loan is recorded in both ledgers, each side deciding only on its own record and the
other's recorded facts:

- The lender (its `policy.lending`) lends what a sibling's queue is short of (the
  sibling's `wants`), in priority order, only while its own queue wants nothing, and never
  below its floor: a `Loan` line, counted as `lent`.
- The borrower records the loan as received (a `Borrowing`, counted as `borrowed`) while
  it is open, and repays it as its claims settle: whenever its own queue wants nothing,
  its available balance goes first to what it owes (`repaid` only grows). Nothing running
  is ever preempted. When it closes, whatever is still owed was consumed by its claims
  (`consumed`).
- The lender takes back what the borrower recorded as repaid, and settles the loan once it
  is repaid in full, or once the borrower closed (the unrepaid part stays committed in the
  lender: its claims consumed it), or once the borrower is closed or being deleted without
  ever having recorded it (then nothing was drawn on it). A settled line goes once the
  borrower's record is gone or closed: only outstanding loans count towards MAX_LOANS.

Totals on both sides: committed + reserved + reconciling + lent + available == capacity +
borrowed. Across the parent: the borrower's line settles R − (what it returns), the
lender's includes what the borrower consumed of the loan, so the parent commits exactly
what the claims consumed, once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from reservoir.core.ledger import (
    ZERO,
    add,
    fits,
    nonzero,
    positive,
    render,
    subtract,
    total,
    within,
)
from reservoir.core.lifecycle import LedgerEvent
from reservoir.core.model import (
    MAX_LOANS,
    Borrowing,
    BorrowRequest,
    Lending,
    Loan,
    LoanPhase,
    ReservationEnvelopeStatus,
)

# Events about this envelope's own loans (their uid names the sibling on the other side).
LOAN_EVENTS = frozenset({"Borrowed", "Repaid", "Lent", "LoanSettled", "UnreadableLoan"})


@dataclass(frozen=True)
class SiblingFacts:
    """What an envelope reads of a sibling (another child of its parent envelope)."""

    uid: str
    name: str
    accepting: bool  # open: not closed, expired or being deleted
    # It can never record a loan any more, on recorded facts only (closed or being deleted,
    # closed by its ledger or by its parent's deletion), never on the clock: a lender reads
    # "never drawn on" from it (found by review: a lifetime's end raced a loan's receipt).
    sealed: bool = False
    wants: BorrowRequest | None = None  # what its queue is short of
    loan_to_me: Loan | None = None  # its status.loans line for this envelope
    borrowing_from_me: Borrowing | None = None  # its status.borrowed record of my loan


def owed(record: Borrowing | Loan) -> dict[str, Decimal]:
    """What is still owed on a loan (after closing: what the claims consumed of it)."""
    return positive(subtract(record.amount, record.repaid))


def borrowed_total(status: ReservationEnvelopeStatus) -> dict[str, Decimal]:
    return total(owed(record) for record in status.borrowed.values())


def lent_total(status: ReservationEnvelopeStatus) -> dict[str, Decimal]:
    return total(owed(loan) for loan in status.loans.values() if loan.phase is LoanPhase.LENT)


# --- the borrower's side -----------------------------------------------------------------


def receive_loans(
    status: ReservationEnvelopeStatus,
    siblings: Sequence[SiblingFacts],
    open_: bool,
    now: datetime,
) -> list[LedgerEvent]:
    """Record each loan a sibling's ledger holds for this envelope, while it is open and
    has no loan out itself (a closed envelope never draws on a loan, and its lender reads
    that from it; two siblings never borrow from each other at once, so loans never form a
    cycle that neither could close: found by the borrowing audit). A record repaid in full
    is dropped once its lender settled the loan, or went (only settled lenders go)."""
    events: list[LedgerEvent] = []
    lending = any(loan.phase is LoanPhase.LENT for loan in status.loans.values())
    for sibling in siblings:
        loan, mine = sibling.loan_to_me, status.borrowed.get(sibling.uid)
        if mine is None and loan is not None and loan.phase is LoanPhase.LENT and open_:
            if len(status.borrowed) < MAX_LOANS and status.closed_at is None and not lending:
                status.borrowed[sibling.uid] = Borrowing(
                    lender=sibling.name, amount=dict(loan.amount), received_at=now
                )
                events.append(
                    LedgerEvent(
                        sibling.uid,
                        sibling.name,
                        "Borrowed",
                        f"borrowed {render(loan.amount)} from {sibling.name}",
                    )
                )
        elif (
            mine is not None
            and not owed(mine)
            and (loan is None or loan.phase is LoanPhase.SETTLED)
        ):
            del status.borrowed[sibling.uid]  # repaid, and its lender knows it
    present = {sibling.uid for sibling in siblings}
    for uid in [u for u, record in status.borrowed.items() if not owed(record)]:
        if uid not in present:
            del status.borrowed[uid]
    return events


def repay(status: ReservationEnvelopeStatus, available: dict[str, Decimal]) -> list[LedgerEvent]:
    """Put the available balance towards what is owed, lender by lender (by name), and
    draw `available` down by what was repaid."""
    events: list[LedgerEvent] = []
    for uid, record in sorted(status.borrowed.items(), key=lambda item: item[1].lender):
        if record.closed_at is not None:
            continue
        paid = {
            k: min(v, available.get(k, ZERO))
            for k, v in owed(record).items()
            if available.get(k, ZERO) > ZERO
        }
        if not paid:
            continue
        record.repaid = add(record.repaid, paid)
        available.update(subtract(available, paid))
        events.append(
            LedgerEvent(uid, record.lender, "Repaid", f"repaid {render(paid)} to {record.lender}")
        )
    return events


def close_borrowings(status: ReservationEnvelopeStatus, now: datetime) -> None:
    """At closing: what is still owed was consumed by this envelope's claims."""
    for record in status.borrowed.values():
        if record.closed_at is None:
            record.consumed = owed(record)
            record.closed_at = now


def shortage(
    requests: Mapping[str, Decimal], available: Mapping[str, Decimal]
) -> dict[str, Decimal]:
    return positive(subtract(requests, available))


# --- the lender's side -------------------------------------------------------------------


def settle_loans(
    status: ReservationEnvelopeStatus,
    siblings: Mapping[str, SiblingFacts],
    force_settle_gone: Mapping[str, str],
    now: datetime,
    reusable: frozenset[str] = frozenset(),
) -> tuple[dict[str, Decimal], list[LedgerEvent]]:
    """Take back what borrowers recorded as repaid; settle loans repaid in full, or whose
    borrower closed (the unrepaid part is committed here), or that a closed borrower never
    drew on. Returns what is committed here by this pass, and the events. A loan of a
    `reusable` resource is a loan of occupancy: never committed, it comes back whole."""
    committed: dict[str, Decimal] = {}
    events: list[LedgerEvent] = []
    for uid, loan in list(status.loans.items()):
        sibling = siblings.get(uid)
        if loan.phase is LoanPhase.SETTLED:
            record = sibling.borrowing_from_me if sibling is not None else None
            if record is None or record.closed_at is not None:
                # Its borrower's record is gone, or closed: it never changes again and says
                # all there is. The line goes, so settled loans never fill MAX_LOANS (issue
                # 21 #7: borrowers closed owing part of a loan blocked lending for good).
                del status.loans[uid]
            continue
        record = sibling.borrowing_from_me if sibling is not None else None
        if sibling is None:
            why = force_settle_gone.get(uid, force_settle_gone.get(loan.borrower))
            if why is not None:  # gone with the rest unknown: what is owed is charged
                owing = {k: v for k, v in owed(loan).items() if k not in reusable}
                events += _settle(loan, uid, dict(loan.repaid), owing, now, why)
                committed = add(committed, owing)
            continue
        if record is None:
            if sibling.sealed:
                events += _settle(loan, uid, dict(loan.amount), {}, now, "never drawn on")
            continue
        if record.amount != loan.amount or not within(record.repaid, loan.amount):
            events.append(
                LedgerEvent(
                    uid,
                    loan.borrower,
                    "UnreadableLoan",
                    f"its record of the loan ({render(record.amount)}, repaid "
                    f"{render(record.repaid)}) does not match {render(loan.amount)}: held",
                    warning=True,
                )
            )
            continue
        loan.repaid = nonzero(record.repaid)
        if not owed(record):
            events += _settle(loan, uid, dict(loan.amount), {}, now, "repaid in full")
        elif record.closed_at is not None:
            consumed = {k: v for k, v in owed(record).items() if k not in reusable}
            events += _settle(loan, uid, dict(loan.repaid), consumed, now, "its borrower closed")
            committed = add(committed, consumed)
    return committed, events


def _settle(
    loan: Loan,
    uid: str,
    repaid: dict[str, Decimal],
    consumed: dict[str, Decimal],
    now: datetime,
    why: str,
) -> list[LedgerEvent]:
    loan.phase = LoanPhase.SETTLED
    loan.repaid = nonzero(repaid)
    loan.consumed = nonzero(consumed)
    loan.settled_at = now
    message = (
        f"loan to {loan.borrower} settled ({why}): repaid {render(loan.repaid) or 'nothing'}, "
        f"consumed {render(loan.consumed) or 'nothing'}"
    )
    return [LedgerEvent(uid, loan.borrower, "LoanSettled", message)]


def lend(
    status: ReservationEnvelopeStatus,
    lending: Lending,
    siblings: Sequence[SiblingFacts],
    available: dict[str, Decimal],
    now: datetime,
) -> list[LedgerEvent]:
    """Lend siblings what their queues are short of, highest priority first, oldest
    first, never below the floor; `available` is drawn down by what is lent."""
    events: list[LedgerEvent] = []
    lendable = positive(subtract(available, lending.floor))
    asking = [
        s for s in siblings if s.wants is not None and s.accepting and s.uid not in status.loans
    ]
    asking.sort(key=lambda s: (-s.wants.priority, s.wants.since, s.name) if s.wants else ())
    for sibling in asking:
        assert sibling.wants is not None
        need = positive(sibling.wants.resources)
        if not need or len(status.loans) >= MAX_LOANS or not fits(need, lendable):
            continue
        status.loans[sibling.uid] = Loan(
            borrower=sibling.name, phase=LoanPhase.LENT, amount=need, lent_at=now
        )
        lendable = subtract(lendable, need)
        available.update(subtract(available, need))
        events.append(
            LedgerEvent(sibling.uid, sibling.name, "Lent", f"lent {render(need)} to {sibling.name}")
        )
    return events
