"""Speculative copies with one winner (reservoir.core.speculation; child-settlement.txt: "When
one attempt wins, cancel the others"), in the pure core. Each loser settles once by its own
facts; a copy that declared its dispatch is never released as unrun, whichever intermediate
states the operator saw."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from reservoir.core.model import ClaimPhase
from tests.unit.sim import Sim

COPIES = ("a", "b", "c")


def copies(rule: str = "FirstCommit", capacity: str = "100") -> Sim:
    sim = Sim({"tokens": capacity}, speculation_winner=rule)
    for name in COPIES:
        sim.create(name, {"tokens": "30"}, branch="search", speculation_group="search")
    return sim.reconcile()


def test_the_first_copy_to_commit_wins_and_the_others_are_released_at_once() -> None:
    sim = copies()
    assert all(sim.phase(n) is ClaimPhase.TENTATIVE for n in COPIES)
    sim.dispatch("b").reconcile()  # b reaches its commit point first
    assert sim.phase("b") is ClaimPhase.COMMITTED
    sim.reconcile()
    for loser in ("a", "c"):
        entry = sim.entry(loser)
        assert entry.phase is ClaimPhase.RELEASED and entry.superseded_by == "b"
        assert entry.settlement is not None and entry.settlement.reason == "Superseded"
        assert sim.reasons(loser).count("SpeculationLost") == 1
    assert sim.entry("b").superseded_by is None
    assert sim.available() == "70", "only the winner holds"
    sim.usage("b", "12", final=True).reconcile()
    assert sim.phase("b") is ClaimPhase.CONSUMED and sim.available() == "88"


def test_a_loser_already_past_its_commit_point_waits_for_its_usage() -> None:
    sim = copies()
    sim.dispatch("a").reconcile()
    sim.dispatch("c").reconcile()  # c was sent too, before it learnt it lost
    entry = sim.entry("c")
    assert entry.phase is ClaimPhase.COMMITTED and entry.superseded_by == "a"
    assert entry.cancel_requested, "a cancel request, never a release of work that may run"
    assert sim.phase("b") is ClaimPhase.RELEASED
    sim.usage("c", "5", final=True, outcome="Cancelled").reconcile()
    assert sim.phase("c") is ClaimPhase.CONSUMED and sim.entry("c").consumed["tokens"] == 5


def test_a_copy_waiting_for_room_is_released_once_another_won() -> None:
    sim = Sim({"tokens": "60"})
    for name in COPIES:
        sim.create(name, {"tokens": "30"}, speculation_group="g").tick()
    sim.reconcile()
    assert sim.phase("c") is ClaimPhase.PENDING
    sim.dispatch("a").reconcile().reconcile()
    assert sim.entry("c").settlement is not None
    assert sim.entry("c").settlement.reason == "SupersededWhilePending"  # type: ignore[union-attr]
    assert sim.entry("c").superseded_by == "a"
    assert sim.phase("b") is ClaimPhase.RELEASED and sim.available() == "30"


def test_first_success_lets_every_copy_run_until_one_succeeds() -> None:
    sim = copies("FirstSuccess")
    sim.dispatch("a").dispatch("b").reconcile()
    sim.usage("a", "10", final=True, outcome="Failed").reconcile().reconcile()
    assert sim.entry("b").superseded_by is None, "a failure wins nothing"
    sim.usage("b", "7", final=True).reconcile().reconcile()
    assert sim.phase("c") is ClaimPhase.RELEASED and sim.entry("c").superseded_by == "b"
    assert sim.entry("a").superseded_by is None, "a copy settled before the win keeps its record"


def test_the_winner_stays_the_winner() -> None:
    sim = copies()
    sim.dispatch("a").reconcile().reconcile()
    sim.usage("a", "3", final=True, outcome="Failed").reconcile()
    sim.create("d", {"tokens": "30"}, branch="search", speculation_group="search").reconcile()
    assert sim.entry("d").superseded_by == "a", "a copy made later loses to the recorded winner"


def test_claims_without_a_group_or_in_another_group_are_untouched() -> None:
    sim = copies()
    sim.create("x", {"tokens": "5"}).create("y", {"tokens": "5"}, speculation_group="other")
    sim.dispatch("a").reconcile().reconcile()
    assert sim.phase("x") is ClaimPhase.TENTATIVE and sim.phase("y") is ClaimPhase.TENTATIVE


ACTIONS = st.lists(
    st.tuples(st.sampled_from(["dispatch", "finish"]), st.sampled_from(COPIES), st.booleans()),
    min_size=1,
    max_size=8,
)


@settings(max_examples=150, deadline=None)
@given(ACTIONS)
def test_whatever_the_operator_saw_every_dispatched_copy_is_charged_and_one_wins(
    actions: list[tuple[str, str, bool]],
) -> None:
    """Every action is followed by a look or not (skipped intermediate states). At the end
    each copy that dispatched reports its usage: each settles once, none that dispatched is
    released as unrun, all losers name one winner, and the books add up."""
    sim = copies()
    dispatched: set[str] = set()
    for verb, name, look in actions:
        if verb == "dispatch":
            if sim.entry(name).settlement is not None:
                continue  # released already: the API server refuses the dispatch
            sim.dispatch(name)
            dispatched.add(name)
        elif name in dispatched:
            sim.usage(name, "10", final=True)
        if look:
            sim.reconcile()
    for _ in range(3):
        sim.reconcile()
    for name in dispatched:
        sim.usage(name, "10", final=True)
    sim.reconcile().reconcile()
    for name in COPIES:
        entry = sim.entry(name)
        if not dispatched:
            assert entry.phase is ClaimPhase.TENTATIVE, "no copy won: all still held"
            continue
        assert entry.settlement is not None, f"{name} settled"
        if name in dispatched:
            assert entry.phase is ClaimPhase.CONSUMED, f"{name} ran: charged, never released"
        else:
            assert entry.phase is ClaimPhase.RELEASED and entry.superseded_by in dispatched
    if not dispatched:
        return
    winner = sim.status.speculation.get("search")
    assert winner in dispatched, (winner, dispatched)
    named = {sim.entry(n).superseded_by for n in COPIES} - {None}
    assert named <= {winner}, "every loser names the one winner the envelope recorded"
    assert sim.total("committed") == str(10 * len(dispatched))
    assert sim.available() == str(100 - 10 * len(dispatched))


def test_the_winner_outlives_its_claim() -> None:
    """Found by review: the winner was read from its claim's line, so a copy seen only after
    the winner's claim was gone was admitted as if no copy had won. The envelope keeps each
    group's winner for its life."""
    sim = copies()
    sim.dispatch("a").reconcile().reconcile()  # committed, then decided on that record
    assert sim.status.speculation == {"search": "a"}
    sim.usage("a", "5", final=True).reconcile().mirror().reconcile()
    sim.remove("a").remove("b").remove("c").reconcile()
    sim.create("d", {"tokens": "30"}, branch="search", speculation_group="search").reconcile()
    assert sim.entry("d").superseded_by == "a" and sim.phase("d") is ClaimPhase.RELEASED
