"""Histories at an envelope's close, driven through the pure core (tests/unit/tree_sim.py
runs the reconciles and its auditor checks every status after every step): issue 21's
settlement defects 6 (a retry hold created while its envelope closes) and 7 (settled loans
that blocked lending for good)."""

from __future__ import annotations

from decimal import Decimal

import pytest

from reservoir.core.model import EnvelopePhase
from tests.unit.tree_sim import LONG_LIVED, Run, World

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
