"""Histories at an envelope's close, driven through the pure core (tests/unit/tree_sim.py
runs the reconciles and its auditor checks every status after every step): issue 21's
settlement defects 6 (a retry hold created while its envelope closes) and 7 (settled loans
that blocked lending for good)."""

from __future__ import annotations

from decimal import Decimal

import pytest

from reservoir.core.model import MAX_LOANS, ClaimPhase, EnvelopePhase, LoanPhase
from tests.unit.tree_sim import LONG_LIVED, Run, World, lending

# --- 6. a retry hold created while its envelope closes -----------------------------------


@pytest.mark.parametrize("order", ["together", "close first"])
def test_a_retry_hold_made_as_its_envelope_closes_goes_back_before_the_balance(
    order: str,
) -> None:
    """Child c (40) of p (100); c's claim x (20, retryWindowSeconds) fails with usage 5 as
    c closes. No next attempt can come any more: the 15 x kept go back inside c before c
    records its balance, so c returns 35 and p commits 5 (it committed 20: the hold went
    upward as if consumed)."""
    world = World()
    run = Run(world)
    world.create_envelope("p", {"tokens": 100})
    world.create_envelope("c", {"tokens": 40}, parent="p")
    run.settle()
    world.create_claim("x", "c", {"tokens": 20}, dispatch=True, retry_window_seconds=600)
    run.settle()
    world.tick()
    if order == "close first":  # c closes while x runs: Closing until x settles
        world.close("c")
        run.settle()
        assert run.of("c").phase is EnvelopePhase.CLOSING
    else:
        world.close("c")
    world.update_claim("x", usage={"tokens": 5}, final=True, outcome="Failed")
    run.settle()
    x = run.claim("x")
    assert x is not None and x.retry is not None and x.retry.returned
    c = run.of("c")
    assert c.phase is EnvelopePhase.CLOSED
    assert c.balance_released == {"tokens": Decimal(35)}
    assert run.totals("p").committed == {"tokens": Decimal(5)}
    assert run.totals("p").available == {"tokens": Decimal(95)}


def test_a_retry_hold_made_while_its_envelope_is_open_still_waits_for_the_next_attempt() -> None:
    """The other side: while the envelope admits, the hold is kept for the window."""
    world = World()
    run = Run(world)
    world.create_envelope("p", {"tokens": 100})
    world.create_envelope("c", {"tokens": 40}, parent="p", policy=LONG_LIVED)
    run.settle()
    world.create_claim("x", "c", {"tokens": 20}, dispatch=True, retry_window_seconds=600)
    run.settle()
    world.tick()
    world.update_claim("x", usage={"tokens": 5}, final=True, outcome="Failed")
    run.settle()
    x = run.claim("x")
    assert x is not None and x.retry is not None and x.retry.active
    assert run.totals("c").reserved == {"tokens": Decimal(15)}
    world.tick()
    world.close("c")  # no next attempt can come: the hold goes back, then the balance
    run.settle()
    assert run.of("c").balance_released == {"tokens": Decimal(35)}
    assert run.totals("p").committed == {"tokens": Decimal(5)}


# --- 7. settled loans that blocked lending for good ----------------------------------------


def test_loans_settled_with_borrowers_that_closed_owing_never_block_lending() -> None:
    """A lender (500, lending above 0) lends 10 to each of MAX_LOANS borrowers (10 each);
    each closes owing 5 of it (its claims consumed them). Each loan settled: the lender's
    ledger lets the lines go (nothing more can be learned from a closed borrower's
    record), so a ninth sibling short 10 borrows again (it was refused for good: the
    settled lines filled the lender's MAX_LOANS)."""
    borrowers = [f"b{n}" for n in range(MAX_LOANS)]
    world = World()
    run = Run(world)
    world.create_envelope("planner", {"tokens": 1000})
    world.create_envelope("lender", {"tokens": 500}, parent="planner", policy=lending({}))
    for name in [*borrowers, "late"]:
        world.create_envelope(name, {"tokens": 10}, parent="planner")
    run.settle()
    for name in borrowers:
        world.create_claim(f"{name}-1", name, {"tokens": 10}, dispatch=True)
    run.settle()
    world.tick()
    for name in borrowers:
        world.create_claim(f"{name}-2", name, {"tokens": 10}, dispatch=True)  # short 10
    run.settle()
    assert len(run.of("lender").loans) == MAX_LOANS
    assert run.totals("lender").lent == {"tokens": Decimal(80)}
    world.tick()
    for name in borrowers:
        world.update_claim(f"{name}-1", usage={"tokens": 10}, final=True, outcome="Succeeded")
        world.update_claim(f"{name}-2", usage={"tokens": 5}, final=True, outcome="Succeeded")
        world.close(name)  # 5 repaid, 5 owed: consumed
    run.settle()
    for name in borrowers:
        record = run.of(name).borrowed.get(world.uid("lender"))
        assert record is not None and record.consumed == {"tokens": Decimal(5)}, name
    lender = run.of("lender")
    assert lender.totals.committed == {"tokens": Decimal(40)}
    assert lender.totals.available == {"tokens": Decimal(460)}
    assert [s.settled for s in run.books.loans].count(None) == 0
    assert all(
        s.settled is not None and s.settled.phase is LoanPhase.SETTLED for s in run.books.loans
    )

    world.tick()
    world.create_claim("late-1", "late", {"tokens": 10}, dispatch=True)
    world.tick()
    world.create_claim("late-2", "late", {"tokens": 10}, dispatch=True)  # short 10
    run.settle()
    loan = run.of("lender").loans.get(world.uid("late"))
    assert loan is not None and loan.phase is LoanPhase.LENT, run.of("lender").loans
    late = run.claim("late-2")
    assert late is not None and late.phase is ClaimPhase.COMMITTED
