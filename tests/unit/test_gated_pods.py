"""Workload pods wait for their claim, with or without devices (issue 24; branch-claims.txt:
commit only at the execution boundary; child-settlement.txt: release "only after
non-execution is durably confirmed"). A pod created behind the hand-off gate is handed the
claim's capacity, and the claim committed, on the record before its gate may be lifted; a
Pending, cancelled or settled claim's pod never leaves the gate. Attacked with skipped
intermediate states (a pod seen only once bound, a cancel seen with the pod)."""

from __future__ import annotations

from reservoir.core.model import ClaimPhase
from tests.unit.sim import Sim


def test_a_pod_commit_claim_hands_its_capacity_to_its_gated_pod_then_commits() -> None:
    sim = Sim({"tokens": "100"}).create("a", {"tokens": "20"}, commit_point="PodScheduled")
    sim.reconcile()
    assert sim.phase("a") is ClaimPhase.TENTATIVE
    sim.pod("a", gated=True).reconcile()
    entry = sim.entry("a")
    assert entry.phase is ClaimPhase.COMMITTED and entry.handed_off_to == "a-pod"
    assert entry.committed_at == entry.handed_off_at, "committed on the recorded hand-off"
    assert sim.last is not None and sim.last.handed_off == {"a": "a-pod"}, "lift its gate"
    sim.reconcile()
    assert sim.last is not None and sim.last.handed_off == {"a": "a-pod"}, "until it is gone"
    sim.pod("a", scheduled=True, running=True).reconcile()
    assert sim.phase("a") is ClaimPhase.RUNNING and sim.reasons("a").count("HandedOff") == 1
    sim.usage("a", "12", final=True).reconcile()
    assert sim.phase("a") is ClaimPhase.CONSUMED
    assert sim.last is not None and sim.last.handed_off == {}, "nothing lifted once settled"


def test_creating_the_pod_is_sending_the_branch_whatever_the_commit_point() -> None:
    """A claim whose commit point is its dispatch: its gated pod is handed what it holds and
    commits it, as a GPU claim's always did (found by review: it waited for the dispatch
    without devices, not with them)."""
    sim = Sim({"tokens": "100"}).create("a", {"tokens": "20"}).reconcile()
    sim.pod("a", gated=True).reconcile()
    assert sim.phase("a") is ClaimPhase.COMMITTED and sim.entry("a").handed_off_to == "a-pod"
    assert sim.last is not None and sim.last.handed_off == {"a": "a-pod"}
    sim.cancel("a").reconcile()
    assert sim.entry("a").cancel_requested, "past its commit point: a cancel is a request"


def test_a_cancel_before_the_gate_is_lifted_keeps_it_and_the_lapse_returns_the_capacity() -> None:
    """The hand-off is recorded but the lift failed (or the operator restarted between the
    write and the lift), then a cancel: the gate is not lifted any more, so the pod never
    starts for the cancelled branch, and the lease's lapse settles it as never run (found
    by review: the gate was lifted after the cancel)."""
    sim = Sim({"tokens": "100"}, ambiguity_deadline_seconds=10)
    sim.create("a", {"tokens": "20"}, commit_point="PodScheduled", lease={"duration_seconds": 5})
    sim.reconcile().pod("a", gated=True).reconcile()
    assert sim.last is not None and sim.last.handed_off == {"a": "a-pod"}
    sim.cancel("a").reconcile()
    assert sim.entry("a").cancel_requested
    assert sim.last is not None and sim.last.handed_off == {}, "no lift after the cancel"
    sim.tick(6).reconcile()
    entry = sim.entry("a")
    assert entry.settlement is not None and entry.settlement.reason == "GateNeverLifted"
    assert sim.available() == "100"


def test_a_pending_or_cancelled_claims_pod_never_leaves_the_gate() -> None:
    sim = Sim({"tokens": "30"}).create("big", {"tokens": "30"}, commit_point="PodRunning")
    sim.tick().create("waiting", {"tokens": "10"}, commit_point="PodRunning")
    sim.pod("waiting", gated=True).reconcile()
    assert sim.phase("waiting") is ClaimPhase.PENDING
    assert sim.last is not None and sim.last.handed_off == {}
    # Cancelled in the same pass its pod is first seen, and later admitted: still nothing.
    sim.create("c", {"tokens": "10"}, commit_point="PodRunning").cancel("big")
    sim.pod("big", gated=True).cancel("c").pod("c", gated=True).reconcile()
    assert sim.phase("big") is ClaimPhase.RELEASED and sim.entry("big").handed_off_at is None
    assert sim.last is not None and "c" not in sim.last.handed_off
    assert sim.last.handed_off.keys() == {"waiting"}, "admitted now that big went: handed off"


def test_a_gate_never_lifted_returns_the_capacity_when_the_lease_lapses() -> None:
    """The hand-off is recorded but the pod never left the gate (the lift failed, or the
    operator died between the write and the lift): it provably never ran."""
    sim = Sim({"tokens": "100"}, ambiguity_deadline_seconds=10)
    sim.create("a", {"tokens": "20"}, commit_point="PodScheduled", lease={"duration_seconds": 5})
    sim.reconcile().pod("a", gated=True).reconcile()
    assert sim.phase("a") is ClaimPhase.COMMITTED
    sim.tick(6).reconcile()
    entry = sim.entry("a")
    assert entry.phase is ClaimPhase.EXPIRED and entry.settlement is not None
    assert entry.settlement.reason == "GateNeverLifted" and sim.available() == "100"
    assert sim.last is not None and sim.last.handed_off == {}


def test_a_pod_seen_only_once_bound_commits_as_before() -> None:
    """Without the gate (no admission policy installed) the binding is the commit point, as
    it was: the skipped gated state changes nothing that was recorded."""
    sim = Sim({"tokens": "100"}).create("a", {"tokens": "20"}, commit_point="PodScheduled")
    sim.reconcile().pod("a", scheduled=True).reconcile()
    assert sim.phase("a") is ClaimPhase.COMMITTED and sim.entry("a").handed_off_at is None
