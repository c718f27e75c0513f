"""child-settlement.txt's worked example, exactly, in the pure core."""

from __future__ import annotations

from reservoir.core.model import ClaimPhase
from tests.unit.sim import Sim


def test_parent_100_four_children_of_20_settle_to_committed_37_available_63() -> None:
    sim = Sim(capacity={"tokens": "100"}, default_lease_seconds=30)
    for branch in "ABCD":
        sim.create(branch)
    sim.reconcile()
    assert (sim.total("reserved"), sim.available()) == ("80", "20")

    sim.dispatch("A").dispatch("B").dispatch("D").cancel("C").tick().reconcile()
    assert sim.phase("C") is ClaimPhase.RELEASED  # C skipped: all 20 back

    sim.usage("A", "20", final=True).usage("B", "12", final=True).usage("D", "1").tick()
    sim.reconcile()
    assert (sim.phase("A"), sim.phase("B"), sim.phase("D")) == (
        ClaimPhase.CONSUMED,
        ClaimPhase.CONSUMED,
        ClaimPhase.RUNNING,
    )

    sim.tick(30).reconcile()  # D times out after activation: its 20 enter reconciliation
    assert sim.phase("D") is ClaimPhase.DETACHED
    assert (sim.total("reconciling"), sim.available()) == ("20", "48")

    sim.usage("D", "5", final=True, outcome="Failed").tick().reconcile()  # the late report
    totals = sim.status.totals
    assert sim.phase("D") is ClaimPhase.CONSUMED
    assert totals.committed["tokens"] == 37
    assert totals.reserved["tokens"] + totals.reconciling["tokens"] == 0
    assert totals.available["tokens"] == 63
    assert (
        sum((totals.committed["tokens"], totals.reserved["tokens"], totals.available["tokens"]))
        == 100
    )
    assert [sim.entry(b).released["tokens"] for b in "ABCD"] == [0, 8, 20, 15]
