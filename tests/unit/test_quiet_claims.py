"""Settled claims a pass passes by (reservoir.core.quiet).

Every Sim-driven test and both hypothesis audits also check, on every pass, that passing
quiet claims by decides exactly what walking every claim decides (tests/unit/quiet_check.py).
These tests show that the pass does pass them by, and when it must not."""

from __future__ import annotations

from dataclasses import replace

from reservoir.core.model import ClaimPhase
from reservoir.core.quiet import QuietClaims
from reservoir.core.reconcile import reconcile
from tests.unit.sim import Sim


def settled_and_mirrored(*names: str) -> Sim:
    sim = Sim(capacity={"tokens": "100"})
    for name in names:
        sim.create(name).reconcile().dispatch(name).reconcile()
        sim.usage(name, "5", final=True).reconcile()
    return sim.mirror().reconcile().reconcile()


def test_settled_claims_whose_records_say_all_are_found_quiet() -> None:
    sim = settled_and_mirrored("a", "b")
    assert sim.last is not None
    assert set(sim.last.quiet.facts) == {"a", "b"}
    assert sim.last.off_ledger == {}, "nothing new to write for either"


def test_a_quiet_claim_is_passed_by_while_its_facts_are_equal() -> None:
    """Shown with a claim declared quiet on facts that do carry news (a late report): the
    pass leaves it alone. The writer declares only what a pass found quiet."""
    sim = settled_and_mirrored("a")
    assert sim.last is not None
    sim.usage("a", "9", final=True)  # a late report: news for the record
    news = sim.claims["a"]
    declared = QuietClaims(sim.last.quiet.terms, {"a": news})
    passed = reconcile(sim.envelope, sim.status, [news], sim.now, quiet=declared)
    walked = reconcile(sim.envelope, sim.status, [news], sim.now, quiet=None)
    assert "a" not in passed.off_ledger and "a" in passed.quiet.facts
    late = walked.off_ledger["a"].late
    assert late is not None and late.count == 1, "walked, the late report is recorded"


def test_news_in_its_facts_makes_a_quiet_claim_walked_again() -> None:
    sim = settled_and_mirrored("a")
    sim.usage("a", "9", final=True).reconcile()
    assert sim.last is not None and "a" not in sim.last.quiet.facts
    late = sim.last.off_ledger["a"].late
    assert late is not None and late.count == 1
    assert sim.entry("a").phase is ClaimPhase.CONSUMED, "the settlement never reopens"


def test_a_change_of_the_envelope_terms_makes_every_claim_walked_again() -> None:
    sim = settled_and_mirrored("a")
    assert sim.last is not None
    quiet = sim.last.quiet
    assert quiet.terms is not None
    other = replace(quiet.terms, dimensions=frozenset({"tokens", "cost"}))
    assert not QuietClaims(other, quiet.facts).passes_by(sim.claims["a"], quiet.terms)


def test_a_claim_with_a_compensation_waiting_for_room_is_never_quiet() -> None:
    """A charge asked of a settled claim waits while the balance lacks room: room comes
    back with no new fact on the claim, so it must be walked on every pass."""
    sim = settled_and_mirrored("a")
    sim.create("hog", {"tokens": "95"}).reconcile()  # 0 available
    asked = [{"key": "invoice", "reason": "a late invoice", "charge": {"tokens": "3"}}]
    sim.update("a", compensations=asked).reconcile().reconcile()
    assert sim.last is not None and "a" not in sim.last.quiet.facts
    sim.cancel("hog").reconcile().reconcile()  # room comes back: the charge applies
    record = sim.entry("a").compensations
    assert [c.applied for c in record] == [True]
