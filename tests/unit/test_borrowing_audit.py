"""Borrowing between sibling envelopes, audited in the pure core (core/borrowing.py;
child-settlement.txt: borrowing is "an explicit policy rather than the default", with
sibling protection, revocation and priority; DESIGN.md §1.6: decide only on recorded facts,
coalescing invariance).

The tree model of tests/unit/tree_sim.py passes every envelope with a parent envelope its
siblings as the Kubernetes adapter reads them (k8s/budgets.py siblings_of), from the
(possibly stale) snapshot of the other children of the same parent. Its auditor (Books)
checks after every step, for every envelope: committed + reserved + reconciling + lent +
available == capacity + borrowed, with `lent` and `borrowed` the loans outstanding; a loan
is made only under policy.lending, while the lender's own queue wants nothing, and leaves
the lender at or above its floor; each loan is in the lender's ledger and, once received,
in the borrower's with the same amount; repaid only grows, never beyond the amount, and the
lender never takes back more than the borrower recorded; a loan settles once, on what the
borrower recorded. At the end of a history where everything closes: every loan settled,
the lender committed exactly what the borrower's claims consumed of it (amount − repaid),
and every envelope committed exactly Σ C of the claims in its subtree (plus what its
borrowers consumed of its loans): R − C upward, once, loans included. The two runs (every
reconcile; some, with stale looks) agree on every loan, claim and envelope they admitted
alike.

The histories here are shaped for loans: a planner with two to four children, most of them
lending above a floor, claims sized to make siblings short, and MAX_LOANS lowered to two so
that the cap is reached. Lending stays live (Books.check_lending): a lender that could lend
never leaves an asking sibling without a loan unless MAX_LOANS loans hold a place, and a
settled loan of a closed borrower holds none. test_budget_tree.py's own
histories give envelopes policy.lending now and then too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from reservoir.core import borrowing
from reservoir.core.borrowing import SiblingFacts
from reservoir.core.model import Borrowing, ClaimPhase, EnvelopePhase, Lending, Loan, LoanPhase
from tests.unit.test_budget_tree import (
    CLAIMS,
    EXAMPLES,
    Act,
    History,
    apply,
    check_everything_settled,
    compare_runs,
    play,
    reconciles,
    usage,
)
from tests.unit.tree_sim import LONG_LIVED, ZERO, Run, World, lending

# --- random histories ------------------------------------------------------------------------

SIBLINGS = 4  # children of the planner (e0): e1 .. e4
SMALL_MAX_LOANS = 2  # MAX_LOANS in the random histories
LOAN_CLAIMS = CLAIMS + 2


def apply_with_priority(world: World, runs: tuple[Run, Run], act: Act) -> None:
    """test_budget_tree's client writes, and claims sized as a share of their envelope's
    capacity (so that queues run short), created with a priority (the head of a short
    queue asks its siblings with its priority)."""
    if act.kind != "share":
        apply(world, runs, act)
        return
    claim, (envelope, tenths, cost, dispatched, priority) = f"c{act.index}", act.arg
    name, uid = f"e{envelope}", world.uid(f"e{envelope}")  # mostly one of the children
    there = uid in world.envelopes and not any(uid in run.gone for run in runs)
    if claim in world.claims or not there or world.envelopes[uid].deleting:
        return
    capacity = world.envelopes[uid].spec.capacity
    requests = {"tokens": max(1, int(capacity["tokens"] * tenths / 10))}
    if cost is not None and "cost" in capacity:
        requests["cost"] = cost
    world.create_claim(claim, name, requests, dispatch=dispatched, priority=priority)


@st.composite
def families(draw: st.DrawFn) -> list[Act]:
    """A planner and its children, most of them lending above a floor, half of them with a
    lifetime; now and then a child of a child (a second family)."""
    cost = draw(st.one_of(st.none(), st.integers(4, 12)))
    acts = [Act("envelope", 0, (None, draw(st.integers(40, 150)), cost, 0, None, None))]
    for index in range(1, draw(st.integers(2, SIBLINGS)) + 1):
        parent = 0 if index <= 2 else draw(st.sampled_from([0, 0, 1]))
        child_cost = draw(st.one_of(st.none(), st.integers(0, 4))) if cost else None
        floor = draw(st.sampled_from([None, 0, 2, 5, 10]))
        acts.append(
            Act(
                "envelope",
                index,
                (
                    parent,
                    draw(st.integers(10, 40)),
                    child_cost,
                    draw(st.integers(0, 2)),
                    draw(st.one_of(st.none(), st.integers(3, 20))),
                    floor,
                ),
            )
        )
    return acts


claim_ids = st.integers(0, LOAN_CLAIMS - 1)
loan_claims = st.builds(
    Act,
    st.just("share"),
    claim_ids,
    st.tuples(
        st.sampled_from([1, 2, 1, 2, 1, 2, 3, 4, 0]),  # the envelope: mostly e1 or e2
        st.integers(3, 9),  # tenths of its capacity
        st.one_of(st.none(), st.integers(0, 2)),
        st.booleans(),
        st.integers(0, 2),
    ),
)
loan_acts = st.one_of(
    loan_claims,
    st.builds(Act, st.sampled_from(["dispatch", "dispatch", "cancel"]), claim_ids),
    usage,
    st.builds(Act, st.just("finish"), claim_ids, st.sampled_from(["Succeeded", "Failed"])),
    reconciles,
)
endings = st.builds(
    Act, st.sampled_from(["close", "delete", "delete", "forget"]), st.integers(0, 7)
)


def a_late_sibling_asks(world: World, runs: tuple[Run, Run]) -> None:
    """Once every claim has settled (and the envelopes closed early have closed), a new
    child of the planner runs short by one token: every sibling that can lend it one still
    does (Books.check_lending), whatever loans it made and settled before (issue 21 #7)."""
    if not any(run.books.loans for run in runs):
        return  # nothing was ever lent: nothing can block lending
    planner = world.uid("e0")
    if planner not in world.envelopes or any(planner in run.gone for run in runs):
        return
    if not world.envelopes[planner].accepting:
        return
    world.create_envelope("late", {"tokens": 1}, parent="e0")
    for run in runs:
        run.settle()
    world.create_claim("late-1", "late", {"tokens": 1}, dispatch=True)
    world.tick()
    world.create_claim("late-2", "late", {"tokens": 1}, dispatch=True)  # short 1
    for run in runs:
        run.settle()
    for claim in ("late-1", "late-2"):
        world.update_claim(claim, final=True, outcome="Succeeded")
    for run in runs:
        run.settle()


@st.composite
def loan_histories(draw: st.DrawFn) -> History:
    pool = draw(st.one_of(st.none(), st.tuples(st.integers(50, 300), st.integers(0, 20))))
    first = draw(families()) + draw(st.lists(loan_claims, min_size=4, max_size=LOAN_CLAIMS))
    instants = draw(
        st.lists(
            st.tuples(st.integers(0, 5), st.lists(loan_acts, min_size=1, max_size=8)),
            min_size=2,
            max_size=7,
        )
    )
    for ending in draw(st.lists(endings, max_size=3)):  # an envelope closed or deleted early
        at = draw(st.integers(0, len(instants) - 1))
        tick, writes = instants[at]
        instants[at] = (tick, [*writes, ending])
    last = draw(st.lists(st.integers(0, 15), min_size=LOAN_CLAIMS, max_size=LOAN_CLAIMS))
    return History(pool, [(0, first), *instants], tuple(last))


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(history=loan_histories(), data=st.data())
def test_loans_between_siblings_settle_exactly_once_whatever_the_operator_saw(
    history: History, data: st.DataObject
) -> None:
    def runs_b(label: str) -> bool:
        return data.draw(st.booleans(), label=f"run B reconciles at {label}")

    # A lender of these small families has at most three borrowers: a cap of two loans is
    # reached, so lending stays live at the cap too (Books.check_lending; issue 21 #7).
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(borrowing, "MAX_LOANS", SMALL_MAX_LOANS)
        _, every, some = play(history, runs_b, apply_with_priority, a_late_sibling_asks)
    for run in (every, some):
        loans = len(run.books.loans)
        label = "every reconcile" if run is every else "some reconciles"
        event(f"loans made ({label}): {min(loans, 3)}{'+' if loans >= 3 else ''}")


# --- the protocol, step by step ------------------------------------------------------------
# Each scenario runs under the auditor (Books checks every status after every step).

PLANNER = {"tokens": 100}


def family(*children: tuple[str, int, int | None]) -> tuple[World, Run]:
    """A planner of 100 tokens and its children (name, tokens, lending floor or None),
    all open."""
    world = World()
    run = Run(world)
    world.create_envelope("planner", PLANNER)
    for name, tokens, floor in children:
        policy = LONG_LIVED if floor is None else lending({"tokens": floor})
        world.create_envelope(name, {"tokens": tokens}, parent="planner", policy=policy)
    run.settle()
    for name, *_ in children:
        assert run.of(name).phase is EnvelopePhase.OPEN, name
    return world, run


def tokens(resources: Mapping[str, Decimal]) -> Decimal:
    return resources.get("tokens", ZERO)


def loan(run: Run, lender: str, borrower: str) -> Loan | None:
    return run.of(lender).loans.get(run.world.uid(borrower))


def record(run: Run, borrower: str, lender: str) -> Borrowing | None:
    return run.of(borrower).borrowed.get(run.world.uid(lender))


def finish(world: World, claim: str, used: int) -> None:
    world.update_claim(claim, usage={"tokens": used}, final=True, outcome="Succeeded")


def close_all(world: World, run: Run) -> None:
    """Every worker finishes, every envelope closes: everything must settle, loans too."""
    world.tick()
    for claim, facts in world.claims.items():
        if not facts.spec.final:
            world.update_claim(claim, final=True, outcome="Succeeded")
    run.settle()
    world.tick()
    for name in sorted({e.name for e in world.envelopes.values()}):
        if world.envelope(name).accepting:
            world.close(name)
    run.settle()
    check_everything_settled(world, run)


def test_a_loan_is_in_both_ledgers_and_repaid_as_the_borrowers_claims_settle() -> None:
    """child-settlement.txt's sibling protection and revocation: the lender lends what the
    borrower is short of, never below its floor; the borrower repays as its claims settle,
    nothing running is preempted; what its claims consumed of the loan is committed in the
    lender when it closes, and the planner commits exactly what the claims used."""
    world, run = family(("lender", 50, 30), ("borrower", 30, None), ("other", 20, None))
    world.create_claim("b1", "borrower", {"tokens": 20}, dispatch=True)
    world.tick()
    world.create_claim("b2", "borrower", {"tokens": 25}, dispatch=True)  # short 15
    run.settle()
    lent, got = loan(run, "lender", "borrower"), record(run, "borrower", "lender")
    assert lent is not None and (lent.phase, lent.amount) == (LoanPhase.LENT, {"tokens": 15})
    assert got is not None and (got.lender, got.amount) == ("lender", {"tokens": 15})
    b2 = run.claim("b2")
    assert b2 is not None and b2.phase is ClaimPhase.COMMITTED
    lender, borrower = run.totals("lender"), run.totals("borrower")
    assert (tokens(lender.lent), tokens(lender.available)) == (15, 35)
    assert (tokens(borrower.borrowed), tokens(borrower.reserved)) == (15, 45)
    assert tokens(borrower.available) == 0

    # The floor: the other sibling is short 10, the lender has only 5 above its 30.
    world.create_claim("o1", "other", {"tokens": 20}, dispatch=True)
    world.tick()
    world.create_claim("o2", "other", {"tokens": 10})
    run.settle()
    wants = run.of("other").wants
    assert wants is not None and wants.resources == {"tokens": 10}
    assert loan(run, "lender", "other") is None
    assert tokens(run.totals("lender").available) == 35
    world.tick()
    world.update_claim("o2", cancel=True)
    finish(world, "o1", 20)
    finish(world, "b1", 20)
    finish(world, "b2", 12)  # 13 spare: repaid
    run.settle()
    got = record(run, "borrower", "lender")
    lent = loan(run, "lender", "borrower")
    assert got is not None and got.repaid == {"tokens": 13} and got.closed_at is None
    assert lent is not None and lent.phase is LoanPhase.LENT and lent.repaid == {"tokens": 13}
    assert tokens(run.totals("lender").lent) == 2 and tokens(run.totals("lender").available) == 48
    assert tokens(run.totals("borrower").borrowed) == 2
    assert tokens(run.totals("borrower").committed) == 32

    # The borrower closes owing 2: its claims consumed them, the lender commits them.
    world.tick()
    world.close("borrower")
    run.settle()
    borrower_uid = world.uid("borrower")  # (its line went: the borrower's record is closed)
    lent = next(seen.settled for seen in run.books.loans if seen.borrower == borrower_uid)
    assert lent is not None and lent.phase is LoanPhase.SETTLED
    assert (lent.repaid, lent.consumed) == ({"tokens": 13}, {"tokens": 2})
    assert loan(run, "lender", "borrower") is None
    assert run.of("borrower").balance_released == {"tokens": 0}
    mirrored = run.of("borrower").parent  # its line in the planner: 30 charged, 0 back
    assert mirrored is not None and mirrored.settled is not None
    assert (mirrored.settled.consumed, mirrored.settled.released) == ({"tokens": 30}, {"tokens": 0})
    assert tokens(run.totals("lender").committed) == 2
    close_all(world, run)
    assert run.totals("planner").committed == {"tokens": 52}  # 20 + 12 + 20, once


def test_a_lender_lends_only_while_its_own_queue_wants_nothing() -> None:
    world, run = family(("lender", 30, 0), ("borrower", 10, None))
    world.create_claim("l1", "lender", {"tokens": 20}, dispatch=True)
    world.create_claim("b1", "borrower", {"tokens": 10}, dispatch=True)
    world.tick()
    world.create_claim("l2", "lender", {"tokens": 15})  # the lender is short 5 itself
    world.create_claim("b2", "borrower", {"tokens": 5})  # the borrower too
    run.settle()
    assert run.of("lender").wants is not None and run.of("borrower").wants is not None
    assert tokens(run.totals("lender").available) == 10  # enough, but its own queue waits
    assert not run.of("lender").loans
    world.tick()
    world.update_claim("l2", cancel=True)
    run.settle()
    lent = loan(run, "lender", "borrower")
    assert lent is not None and lent.amount == {"tokens": 5}
    b2 = run.claim("b2")
    assert b2 is not None and b2.phase is ClaimPhase.TENTATIVE
    close_all(world, run)


@pytest.mark.parametrize(
    ("priorities", "served"), [((0, 2), "second"), ((2, 0), "first"), ((1, 1), "first")]
)
def test_the_higher_priority_borrower_is_served_first(
    priorities: tuple[int, int], served: str
) -> None:
    """Two siblings short 10 each, 10 above the lender's floor: the one whose waiting claim
    has the higher priority borrows; at equal priority, the one waiting longer."""
    world, run = family(("lender", 30, 20), ("first", 10, None), ("second", 10, None))
    lender = world.uid("lender")
    for name, priority in zip(("first", "second"), priorities, strict=True):
        world.create_claim(f"{name}-1", name, {"tokens": 10}, dispatch=True)
        run.reconcile(world.uid(name))
        world.tick()
        world.create_claim(f"{name}-2", name, {"tokens": 10}, priority=priority)
        run.reconcile(world.uid(name))
        wants = run.of(name).wants
        assert wants is not None and wants.priority == priority
    run.reconcile(lender)
    assert [run.world.envelopes[u].name for u in run.of("lender").loans] == [served]
    run.settle()
    close_all(world, run)


@pytest.mark.parametrize("how", ["closed", "deleted", "its parent deleted", "expired"])
def test_a_borrower_that_closes_without_recording_a_loan_gets_it_back_in_full(
    how: str,
) -> None:
    """The lender settles the loan as never drawn on once the borrower's own recorded facts
    say it can never record it (closed or being deleted, closed by its parent's deletion,
    or closed in its ledger), never on the clock (an expired borrower may still be
    recording it): nothing is committed, everything comes back."""
    world = World()
    run = Run(world)
    world.create_envelope("planner", PLANNER)
    world.create_envelope("lender", {"tokens": 30}, parent="planner", policy=lending({}))
    lifetime = 10 if how == "expired" else None
    world.create_envelope("borrower", {"tokens": 10}, parent="planner", lifetime=lifetime)
    run.settle()
    world.create_claim("b1", "borrower", {"tokens": 10}, dispatch=True)
    world.tick()
    world.create_claim("b2", "borrower", {"tokens": 5})
    borrower, lender = world.uid("borrower"), world.uid("lender")
    run.reconcile(borrower)  # short 5: it asks
    run.reconcile(lender)  # lent
    lent = loan(run, "lender", "borrower")
    assert lent is not None and lent.phase is LoanPhase.LENT
    assert tokens(run.totals("lender").available) == 25
    world.tick(10)
    if how == "closed":
        world.close("borrower")
    elif how == "deleted":
        world.delete("borrower")
    elif how == "its parent deleted":
        world.delete("planner")
    run.reconcile(lender)
    # In its spec or metadata it can never record the loan any more; otherwise nothing it
    # recorded says so yet: it may be recording the loan right now, so the loan is held.
    sealed = how in ("closed", "deleted")
    assert (loan(run, "lender", "borrower") == lent) is not sealed
    run.reconcile(borrower)  # records nothing: it admits nothing any more
    assert record(run, "borrower", "lender") is None
    if how == "expired":  # expired, but b1 still runs: not closed in its ledger yet
        assert run.of("borrower").closed_at is None
        run.reconcile(lender)
        assert loan(run, "lender", "borrower") == lent
        finish(world, "b1", 10)
        run.reconcile(borrower)
        assert run.of("borrower").closed_at is not None
    run.reconcile(lender)
    settled = run.books.loans[-1].settled  # (its line goes once the borrower has no record)
    assert settled is not None and settled.phase is LoanPhase.SETTLED
    assert (settled.repaid, settled.consumed) == ({"tokens": 5}, {})
    totals = run.totals("lender")
    assert (tokens(totals.lent), tokens(totals.available), tokens(totals.committed)) == (0, 30, 0)
    world.tick()
    if not world.claims["b1"].spec.final:
        finish(world, "b1", 10)
    run.settle()
    close_all(world, run)
    assert run.totals("planner").committed == {"tokens": 10}


def borrowing_family(lender_floor: int = 0) -> tuple[World, Run]:
    """A lender (30) and a borrower (10) whose claims b1 (10) and b2 (10) run, b2 on a loan
    of 10."""
    world, run = family(("lender", 30, lender_floor), ("borrower", 10, None))
    world.create_claim("b1", "borrower", {"tokens": 10}, dispatch=True)
    run.settle()
    world.tick()
    world.create_claim("b2", "borrower", {"tokens": 10}, dispatch=True)
    run.settle()
    got = record(run, "borrower", "lender")
    assert got is not None and got.amount == {"tokens": 10}
    return world, run


def test_a_borrower_gone_with_a_loan_outstanding_holds_it_until_a_person_names_it() -> None:
    """Gone before its lender read its closed record (its finalizer removed by hand): what
    its claims used of the loan is unknown to the lender, so the loan is held, and the
    lender cannot close, until a person names the borrower on the lender. Then what was not
    repaid is charged there; what was repaid, taken back and used since by the lender's own
    claims is not charged again."""
    world, run = borrowing_family()
    world.tick()
    finish(world, "b1", 4)  # 6 spare: repaid
    run.settle()
    lent = loan(run, "lender", "borrower")
    assert lent is not None and lent.phase is LoanPhase.LENT and lent.repaid == {"tokens": 6}
    world.create_claim("l1", "lender", {"tokens": 26}, dispatch=True)  # all it has now
    run.settle()
    assert tokens(run.totals("lender").available) == 0
    world.tick()
    finish(world, "b2", 10)  # 4 of the loan consumed
    world.close("borrower")
    borrower, planner = world.uid("borrower"), world.uid("planner")
    for uid in (borrower, planner, borrower):  # closes, its line settles and is mirrored
        run.reconcile(uid)
    got = record(run, "borrower", "lender")
    assert got is not None and (got.repaid, got.consumed) == ({"tokens": 6}, {"tokens": 4})
    run.remove_finalizer_by_hand("borrower")
    world.tick()
    finish(world, "l1", 26)
    world.close("lender")
    run.settle()
    assert loan(run, "lender", "borrower") == lent  # held
    assert run.of("lender").phase is EnvelopePhase.CLOSING
    world.force_settle_gone("lender", "borrower", "checked: the sub-agent used it all")
    run.settle()
    settled = run.books.loans[-1].settled
    assert settled is not None and settled.phase is LoanPhase.SETTLED
    assert (settled.repaid, settled.consumed) == ({"tokens": 6}, {"tokens": 4})
    lender = run.of("lender")
    assert lender.phase is EnvelopePhase.CLOSED
    assert (tokens(lender.totals.committed), lender.balance_released) == (30, {"tokens": 0})
    close_all(world, run)
    assert run.totals("planner").committed == {"tokens": 40}  # 4 + 10 + 26


def test_a_deleted_borrower_goes_only_once_its_lender_settled_the_loan() -> None:
    """What the borrower's claims used of a loan is read from its record: it goes only
    once every lender settled (found by review; otherwise the loan is held for a person)."""
    world, run = borrowing_family()
    world.tick()
    finish(world, "b1", 10)
    finish(world, "b2", 10)  # owes the whole loan: consumed
    world.delete("borrower")
    borrower, planner, lender = (world.uid(n) for n in ("borrower", "planner", "lender"))
    run.reconcile(borrower)  # closes: what it owes was consumed
    got = record(run, "borrower", "lender")
    assert got is not None and got.closed_at is not None and got.consumed == {"tokens": 10}
    run.reconcile(planner)  # settles its line: R = 10, C = 10 − 10 borrowed = ... 0 back
    run.reconcile(borrower)  # mirrors its line; its lender has not settled the loan yet
    assert borrower not in run.gone
    run.reconcile(lender)
    lent = loan(run, "lender", "borrower")
    assert lent is not None and lent.phase is LoanPhase.SETTLED
    assert (lent.repaid, lent.consumed) == ({}, {"tokens": 10})
    run.reconcile(borrower)
    assert borrower in run.gone
    close_all(world, run)
    assert run.totals("planner").committed == {"tokens": 20}


def lifetime_race(run: Run, world: World) -> None:
    """The borrower's lifetime ends right after it recorded a loan and admitted a claim on
    it; its lender then reads it from before that write (the write in flight, or a cache):
    expired, asking, no record."""
    world.create_envelope("planner", PLANNER)
    world.create_envelope("lender", {"tokens": 30}, parent="planner", policy=lending({}))
    world.create_envelope("borrower", {"tokens": 10}, parent="planner", lifetime=10)
    run.settle()
    world.create_claim("b1", "borrower", {"tokens": 10}, dispatch=True)
    run.settle()
    world.tick(9)
    world.create_claim("b2", "borrower", {"tokens": 5}, dispatch=True)
    borrower, lender = world.uid("borrower"), world.uid("lender")
    run.reconcile(borrower)  # short 5: it asks
    run.reconcile(lender)  # lent
    run.reconcile(borrower)  # records it, b2 runs on it
    b2 = run.claim("b2")
    assert b2 is not None and b2.phase is ClaimPhase.COMMITTED
    world.tick(1)  # its lifetime ends
    run.reconcile(lender, lag=10)  # reads the borrower as it was before it recorded


def test_a_lifetime_ending_never_passes_for_a_loan_never_drawn_on() -> None:
    """DESIGN.md §1.6: "never drawn on" is decided on what the borrower recorded (closed in
    its ledger, spec or metadata), never on the clock: an expired borrower may have
    recorded the loan and run claims on it in a write the lender has not seen yet."""
    world = World()
    run = Run(world)
    lifetime_race(run, world)
    lent = loan(run, "lender", "borrower")
    assert lent is not None and lent.phase is LoanPhase.LENT  # held: nothing says otherwise
    world.tick()
    finish(world, "b1", 10)
    finish(world, "b2", 5)
    run.settle()
    settled = run.books.loans[-1].settled
    assert settled is not None and (settled.repaid, settled.consumed) == ({}, {"tokens": 5})
    close_all(world, run)
    assert run.totals("planner").committed == {"tokens": 15}


def test_a_record_repaid_in_full_goes_even_when_its_lender_went_first() -> None:
    world, run = borrowing_family()
    world.tick()
    finish(world, "b1", 0)  # 10 spare: the loan is repaid in full
    run.reconcile(world.uid("borrower"))
    got = record(run, "borrower", "lender")
    assert got is not None and got.repaid == {"tokens": 10}
    world.delete("lender")  # it settles the loan, closes and goes before the borrower looks
    for _ in range(3):
        run.reconcile(world.uid("lender"))
        run.reconcile(world.uid("planner"))
    assert world.uid("lender") in run.gone
    run.settle()
    assert record(run, "borrower", "lender") is None, run.of("borrower").borrowed


def test_two_siblings_that_lend_to_each_other_still_close() -> None:
    world, run = family(("a", 10, 0), ("b", 10, 0))
    for name in ("a", "b"):
        world.create_claim(f"{name}1", name, {"tokens": 8}, dispatch=True)
    run.settle()
    world.tick()
    for name in ("a", "b"):
        world.create_claim(f"{name}2", name, {"tokens": 5}, dispatch=True)  # short 3
    run.settle()
    world.tick()
    for name in ("a", "b"):
        finish(world, f"{name}1", 0)  # neither is short any more: both may lend
    run.reconcile(world.uid("a"))  # reads b asking for 3: lends 3
    run.reconcile(world.uid("b"), lag=5)  # at the same time, reads a asking: lends 3
    assert loan(run, "a", "b") is not None and loan(run, "b", "a") is not None
    for name in ("a", "b"):
        world.create_claim(f"{name}3", name, {"tokens": 5}, dispatch=True)  # on the loan
    run.settle()
    # Each has a loan out, so neither records the other's: no cycle of loans can form,
    # and the unrecorded loans go back once their borrower closes.
    for name, other in (("a", "b"), ("b", "a")):
        assert record(run, name, other) is None
    world.tick()
    for name in ("a", "b"):
        finish(world, f"{name}2", 5)
        finish(world, f"{name}3", 5)
        world.close(name)
    run.settle()
    assert [run.of(name).phase for name in ("a", "b")] == [EnvelopePhase.CLOSED] * 2


# --- the audit itself can fail -----------------------------------------------------------


def test_the_audit_catches_a_loan_below_the_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    lend = borrowing.lend

    def careless(status: Any, policy: Lending, *rest: Any) -> Any:
        return lend(status, Lending(), *rest)  # the floor forgotten

    monkeypatch.setattr("reservoir.core.reconcile.lend", careless)
    world, run = family(("lender", 50, 30), ("other", 20, None))
    world.create_claim("l1", "lender", {"tokens": 15}, dispatch=True)  # 5 above the floor
    world.create_claim("o1", "other", {"tokens": 20}, dispatch=True)
    run.settle()
    world.tick()
    world.create_claim("o2", "other", {"tokens": 10})
    with pytest.raises(AssertionError, match="lent below 30"):
        run.settle()


def test_the_audit_catches_a_lender_that_forgets_what_was_consumed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settle_loans = borrowing.settle_loans

    def forgetful(*args: Any) -> Any:
        _, events = settle_loans(*args)
        return {}, events  # the loan settles, what its borrower consumed is not committed

    monkeypatch.setattr("reservoir.core.reconcile.settle_loans", forgetful)
    world, run = borrowing_family()
    world.tick()
    finish(world, "b1", 10)
    finish(world, "b2", 10)
    world.close("borrower")
    with pytest.raises(AssertionError, match="lender-uid: committed"):
        run.settle()


def test_the_audit_catches_a_record_of_another_amount(monkeypatch: pytest.MonkeyPatch) -> None:
    receive_loans = borrowing.receive_loans

    def generous(status: Any, *rest: Any) -> Any:
        events = receive_loans(status, *rest)
        for got in status.borrowed.values():
            got.amount = {k: v * 2 for k, v in got.amount.items()}
        return events

    monkeypatch.setattr("reservoir.core.reconcile.receive_loans", generous)
    with pytest.raises(AssertionError, match="!= borrower='borrower'"):
        borrowing_family()


def test_the_audit_catches_a_loan_settled_on_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule before review: "never drawn on" once the borrower is not accepting (its
    lifetime over), while its record of the loan may be in flight."""
    settle_loans = borrowing.settle_loans

    def on_the_clock(status: Any, siblings: Mapping[str, SiblingFacts], *rest: Any) -> Any:
        read = {u: replace(s, sealed=not s.accepting) for u, s in siblings.items()}
        return settle_loans(status, read, *rest)

    monkeypatch.setattr("reservoir.core.reconcile.settle_loans", on_the_clock)
    world = World()
    run = Run(world)
    with pytest.raises(AssertionError, match="settled while owed"):
        lifetime_race(run, world)


def test_the_runs_comparison_catches_a_loan_settled_differently() -> None:
    runs = []
    for _ in range(2):
        world, run = borrowing_family()
        world.tick()
        finish(world, "b1", 10)
        finish(world, "b2", 7)
        close_all(world, run)
        runs.append(run)
    assert compare_runs(runs[0], runs[1]) > 0
    seen = runs[1].books.loans[-1]
    assert seen.settled is not None and seen.settled.consumed == {"tokens": 7}
    seen.settled = seen.settled.model_copy(update={"consumed": {"tokens": Decimal(6)}})
    with pytest.raises(AssertionError, match=r"^loan"):
        compare_runs(runs[0], runs[1])
