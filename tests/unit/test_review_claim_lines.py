"""Review of the claim-lines protocol (issue 23): defects, each shown by a failing test.

Each test drives the pure core as the writer drives it (tests.unit.sim): a pass, then
the claims' status writes (`write_lines`), some lost, late or never seen."""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal

from reservoir.core.budgets import ChildFacts
from reservoir.core.inflight import LOST_PREFIX, MOVES_PER_PASS
from reservoir.core.model import MAX_LEDGER_ENTRIES, LedgerEntry
from tests.unit.sim import T0, Sim


def settled_in(sim: Sim, passes: int = 40) -> Sim:
    """Passes, each followed by the claims' status writes, until nothing is in flight."""
    for _ in range(passes):
        sim.reconcile().write_lines()
        assert sim.last is not None
        if not sim.status.entries and not sim.last.pending:
            return sim
    raise AssertionError("moves still in flight after many passes")


def test_retiring_a_line_its_claim_now_shows_needs_no_fresh_list_of_the_claims() -> None:
    # An ordinary admission: the envelope write puts the line in flight, the claim's status
    # write lands, and the watch shows it. Nothing is behind and nothing is lost, yet the
    # claims "do not add up": claimRecords was written without the line (in flight), and
    # the view now counts it as held. Every pass after any move re-lists every claim.
    sim = Sim(capacity={"tokens": "100"}, default_lease_seconds=600)
    sim.create("a", {"tokens": "10"})
    sim.reconcile(fresh=False).write_lines()
    assert "a" in sim.status.entries
    # The watch is up to date: the claim shows exactly the line the envelope has in flight.
    sim.reconcile(fresh=False)  # raises ClaimViewBehindError on the current code
    assert sim.status.entries == {}, "the line its claim shows is retired"


def test_a_child_envelopes_reservation_is_never_taken_for_what_lost_claims_held() -> None:
    # The parent's totals.reserved include what its open children hold (compute_totals);
    # lost_amounts compares them with claim lines only, so the child's reservation is kept
    # as a lost-claims line too: held twice (and announced as held by claims removed by
    # hand). Combined with the test above (every retirement pass is a mismatch, and a
    # fresh mismatch looks for lost lines) each ordinary move adds another such line until
    # available would go negative and every pass fails validating the totals.
    sim = Sim(capacity={"tokens": "100"}, default_lease_seconds=600)
    sim.envelope = replace(sim.envelope, uid="parent", name="env")
    for name in ("a", "b"):
        sim.create(name, {"tokens": "10"})
    settled_in(sim)
    child = ChildFacts(uid="child", name="child", created_at=T0, capacity={"tokens": Decimal(30)})
    sim.envelope = replace(sim.envelope, children=[child])
    sim.reconcile()
    assert "child" in sim.status.children and sim.status.entries == {}
    assert sim.total("reserved") == "50"  # the child's 30 and the two claims' 10 each
    sim.remove("b")  # gone with its line (its finalizer removed by hand)
    sim.reconcile(fresh=True)
    lost = [line for uid, line in sim.status.entries.items() if uid.startswith(LOST_PREFIX)]
    assert len(lost) == 1
    assert lost[0].reserved == {"tokens": Decimal(10)}, "only what the lost claim held"
    assert sim.available() == "50", "nothing is held twice"


def test_a_child_envelope_and_ordinary_moves_do_not_wedge_the_parent() -> None:
    # The two defects above together, with nothing lost at all: the first retirement pass
    # keeps the child's 30 as a lost-claims line, the next one again, then the totals no
    # longer validate (available < 0) and every pass raises.
    sim = Sim(capacity={"tokens": "100"}, default_lease_seconds=600)
    child = ChildFacts(uid="child", name="child", created_at=T0, capacity={"tokens": Decimal(30)})
    sim.envelope = replace(sim.envelope, uid="parent", name="env", children=[child])
    for name in ("a", "b"):
        sim.create(name, {"tokens": "10"})
        for _ in range(3):
            sim.reconcile().write_lines()
    assert not any(u.startswith(LOST_PREFIX) for u in sim.status.entries), "nothing was lost"
    assert sim.available() == "50"


def test_claims_seen_deleted_en_masse_go_in_flight_a_bounded_batch_a_pass() -> None:
    # Lines of claims seen deleted always go in flight (place(): no claim can hold them),
    # past MOVES_PER_PASS, the byte budget and the CRD's maxProperties on entries: the API
    # server refuses that envelope write, and the writer keeps the departed lines to hand
    # to the next pass, which is the same write refused again: the envelope is wedged.
    n = MAX_LEDGER_ENTRIES + 8
    sim = Sim(capacity={"tokens": "10M"}, default_lease_seconds=600)
    for i in range(n):
        sim.create(f"c{i:05d}", {"tokens": "10"})
    settled_in(sim)
    departed: dict[str, LedgerEntry] = {}
    for uid in list(sim.claims):
        line = sim.claims[uid].line
        assert line is not None
        departed[uid] = line
        sim.remove(uid)
    sim.reconcile(departed=departed, fresh=False)
    in_flight = len(sim.status.entries)
    assert in_flight <= MOVES_PER_PASS, f"{in_flight} lines in flight in one write"
    assert in_flight <= MAX_LEDGER_ENTRIES


def test_a_lost_claims_line_past_its_ambiguity_deadline_does_not_ask_for_a_pass_at_once() -> None:
    # A lost-claims line is Detached with detachedAt set and no deadline action (only a
    # person settles it), so next_deadline offers its ambiguity deadline forever: once it
    # has passed, every pass asks to be woken at a moment already gone and the envelope's
    # writer runs back to back (handlers/envelopes.py waits 0.05 s) until someone settles it.
    sim = Sim(capacity={"tokens": "100"}, default_lease_seconds=600)
    for name in ("a", "b"):
        sim.create(name, {"tokens": "10"})
    settled_in(sim)
    sim.remove("b")
    sim.reconcile()
    assert sim.last is not None and sim.last.lost is not None
    deadline = sim.envelope.spec.policy.ambiguity_deadline_seconds
    sim.tick(deadline + 60).reconcile().write_lines()
    sim.tick(1).reconcile()
    assert sim.last.lost is None
    wake = sim.last.wake_at
    assert wake is None or wake > sim.now, f"asks for a pass at {wake}, now is {sim.now}"
