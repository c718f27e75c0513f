"""Stranded capacity: what an envelope holds for claims that nobody is driving any more.

lease-renewal.txt: an abandoned reservation must not hold capacity forever. The ledger
already moves a lapsed lease on (a Tentative claim expires, a committed one is Detached),
so what can still sit idle is (a) Detached claims, whose capacity waits as reconciling for a
final report or the ambiguity deadline, and (b) every claim still holding once its envelope
stops admitting work (closed, expired or being deleted). Operators alert on this figure.
"""

from __future__ import annotations

from collections.abc import Iterable
from decimal import Decimal

from reservoir.core.ledger import clean, total
from reservoir.core.model import ClaimPhase, LedgerEntry


def stranded(
    entries: Iterable[LedgerEntry], dimensions: Iterable[str], accepting: bool
) -> dict[str, Decimal]:
    """Per resource, the R of holding entries that are Detached or whose envelope no longer
    accepts work; zero-filled over the envelope's resources."""
    idle = (
        e.reserved
        for e in entries
        if e.phase.holds_capacity and (e.phase is ClaimPhase.DETACHED or not accepting)
    )
    return clean(total(idle), dimensions)
