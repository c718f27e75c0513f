"""Sibling borrowing (DESIGN.md): an envelope's policy to lend (`Lending`), a loan in the
lender's ledger (`Loan`), its record in the borrower's (`Borrowing`), and what a borrower's
queue is short of (`BorrowRequest`)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import (
    Field,
)

from reservoir.core.model.common import (
    MAX_NAME_LENGTH,
    Model,
    ResourceMap,
    recorded_map,
    resource_map,
)


class Lending(Model):
    """Sibling borrowing, off unless an envelope's policy names it."""

    floor: ResourceMap = resource_map(
        "Never lent: this much of each resource stays available for the envelope's own "
        "claims. A resource not named has a floor of zero."
    )


class LoanPhase(StrEnum):
    LENT = "Lent"
    SETTLED = "Settled"


class Loan(Model):
    """A loan to a sibling, in the lender's ledger (keyed by the borrower's UID). The
    borrower's own record of it (`Borrowing`) says what was repaid and, once it closed,
    what its claims consumed of it."""

    borrower: str = Field(max_length=MAX_NAME_LENGTH, description="The borrowing envelope.")
    phase: LoanPhase = Field(description="Lent (outstanding) or Settled.")
    amount: ResourceMap = recorded_map("What was lent.")
    repaid: ResourceMap = recorded_map("Repaid so far, as the borrower recorded it.")
    consumed: ResourceMap = recorded_map(
        "Not repaid when the borrower closed: consumed by its claims, committed here."
    )
    lent_at: datetime = Field(description="When it was lent (operator clock).")
    settled_at: datetime | None = Field(default=None, description="When it settled.")


class Borrowing(Model):
    """A loan from a sibling, in the borrower's ledger (keyed by the lender's UID)."""

    lender: str = Field(max_length=MAX_NAME_LENGTH, description="The lending envelope.")
    amount: ResourceMap = recorded_map("What was borrowed.")
    repaid: ResourceMap = recorded_map(
        "Repaid so far (only grows): returned as this envelope's claims settled."
    )
    consumed: ResourceMap = recorded_map("What its claims consumed of it, set at closing.")
    received_at: datetime = Field(description="When the loan was recorded here.")
    closed_at: datetime | None = Field(
        default=None, description="When this envelope closed: nothing more is repaid."
    )


class BorrowRequest(Model):
    """What this envelope's queue is short of: siblings that lend may cover it."""

    resources: ResourceMap = recorded_map("The shortage of the claim at the head of its queue.")
    priority: int = Field(default=0, description="That claim's priority.")
    since: datetime = Field(description="That claim's creation time.")
