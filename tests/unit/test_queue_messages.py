"""A queued claim's (or child envelope's) reason to wait stays the same while the queue
ahead of it moves: each change of it is a status write, for every claim queued."""

from __future__ import annotations

from reservoir.core.claimstatus import claim_status
from reservoir.core.model import ClaimPhase
from tests.unit.sim import Sim


def test_a_claim_deep_in_the_queue_keeps_its_status_while_the_head_is_admitted() -> None:
    sim = Sim(capacity={"tokens": "100"})
    for name in ("a", "b", "c", "d"):
        sim.create(name, {"tokens": "60"}).tick()
    sim.reconcile().write_lines()
    assert sim.phase("a") is ClaimPhase.TENTATIVE
    assert sim.last is not None
    head, behind = sim.last.pending["b"], sim.last.pending["d"]
    assert head.reason == "InsufficientCapacity" and behind.reason == "Queued"
    before = claim_status(None, behind, None, 1, sim.now)

    sim.tick().cancel("a").reconcile().write_lines()  # a goes, b is admitted, c is the head
    assert sim.phase("b") is ClaimPhase.TENTATIVE
    assert sim.last.pending["c"].reason == "InsufficientCapacity"
    assert sim.last.pending["d"] == behind
    assert claim_status(None, sim.last.pending["d"], before, 1, sim.now) == before
