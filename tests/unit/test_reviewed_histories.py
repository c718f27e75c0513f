"""Histories an independent review of issue 21's settlement changes found settling wrongly,
each driven through the pure core (tests/unit/sim.py) as the reviewer's script did."""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal

from reservoir.core.claimstatus import claim_status, settled_record
from reservoir.core.model import ClaimPhase, ProviderState, ReservationEnvelopeStatus
from reservoir.core.provider import ProviderAnswer
from tests.unit.sim import Sim

GPU = "nvidia.com/gpu"


def test_a_failed_gpu_attempt_with_a_retry_window_counts_its_devices_once() -> None:
    """The retry hold kept all of R − C, devices included, while the devices also counted
    until their allocation was gone: 2 GPUs counted twice, and at full capacity a negative
    total raised on every pass (the envelope froze)."""
    sim = Sim(capacity={"tokens": "100", GPU: "2"})
    sim.create("a", {"tokens": "10", GPU: "2"}, retry_window_seconds=60)
    sim.allocate("a", devices=("gpu-0", "gpu-1")).reconcile().dispatch("a").tick(1).reconcile()
    sim.usage("a", "3", final=True, outcome="Failed").tick(1).reconcile()
    assert sim.phase("a") is ClaimPhase.CONSUMED
    entry = sim.entry("a")
    assert entry.retry is not None and entry.retry.resources == {"tokens": Decimal(7)}
    assert sim.total("reserved", GPU) == "2" and sim.total("available", GPU) == "0"
    assert sim.total("reserved", "tokens") == "7" and sim.total("committed", "tokens") == "3"


def test_a_lapse_before_the_commit_point_holds_while_a_bound_pod_may_still_start() -> None:
    """Like a cancel (issue 21 §3.9): the lapse cannot confirm the branch never runs while
    its workload pod is bound; seen step by step or only at the end, R stays held."""
    step = Sim(default_lease_seconds=5).create("a", commit_point="PodRunning").reconcile()
    step.pod("a", scheduled=True).tick(1).reconcile()
    step.tick(5).reconcile()
    assert step.phase("a") is ClaimPhase.TENTATIVE and step.total("available") == "80"
    step.pod("a", scheduled=True, running=True).reconcile()
    last = Sim(default_lease_seconds=5).create("a", commit_point="PodRunning").reconcile()
    last.pod("a", scheduled=True).tick(6).pod("a", scheduled=True, running=True).reconcile()
    assert step.phase("a") is last.phase("a") is ClaimPhase.DETACHED
    assert step.total("available") == last.total("available") == "80"
    # A pod gone without running confirms it: the lapse then returns R.
    gone = Sim(default_lease_seconds=5).create("a", commit_point="PodRunning").reconcile()
    gone.pod("a", scheduled=True).tick(6).reconcile().no_pod("a").reconcile()
    assert gone.phase("a") is ClaimPhase.EXPIRED and gone.total("available") == "100"


def test_a_provider_answer_in_the_pass_of_the_lapse_is_not_a_gate_never_lifted() -> None:
    """A handed-off claim whose gate lift failed, cancelled; the provider says Succeeded
    with 7 used. Seen a pass before the lapse or in the same pass: 7 charged, not settled
    as never run."""

    def handed() -> Sim:
        sim = Sim(
            capacity={"tokens": "100", GPU: "4"},
            provider={"statusURL": "https://provider.example/ops/{operationId}"},
            default_lease_seconds=10,
            ambiguity_deadline_seconds=60,
        )
        upstream = {"operationId": "op-1", "supportsStatus": True}
        sim.create("a", {"tokens": "10", GPU: "2"}, upstream=upstream)
        sim.allocate("a", devices=("gpu-0", "gpu-1")).reconcile()
        sim.pod("a", gated=True).tick(1).reconcile()
        assert sim.phase("a") is ClaimPhase.COMMITTED
        return sim.cancel("a").tick(1).reconcile()

    answer = ProviderAnswer(state=ProviderState.SUCCEEDED, usage={"tokens": Decimal(7)})
    before = handed()
    before.provider("a", answer).tick(1).reconcile().provider("a", None).tick(10).reconcile()
    with_lapse = handed()
    with_lapse.provider("a", answer).tick(11).reconcile()
    for sim in (before, with_lapse):
        entry = sim.entry("a")
        assert entry.settlement is not None and entry.settlement.reason != "GateNeverLifted"
        assert entry.consumed == {"tokens": Decimal(7)} and sim.total("available") == "93"


def test_a_settled_claim_with_no_recorded_binding_moves_nothing_in_a_re_created_envelope() -> None:
    """Issue 21 #3 for a claim whose status was written before the binding existed (no
    envelopeUID): created before the new envelope, it was decided on by the old one. Its
    late report (5 of 20) drove the new envelope's committed to −15 on every pass."""
    sim = Sim(default_lease_seconds=10, ambiguity_deadline_seconds=5)
    sim.envelope = replace(sim.envelope, name="env", uid="old")
    sim.create("x").dispatch("x").reconcile()
    sim.tick(11).reconcile().tick(6).reconcile()  # quarantined: 20 charged
    status = claim_status(sim.last.entry("x"), None, None, None, sim.now)
    assert status.envelope_uid is None  # as such a status was written
    record = settled_record(status, "x", "x", 1)
    sim.claims["x"] = replace(sim.claims["x"], settled_record=record, envelope_uid=None)
    sim.envelope = replace(sim.envelope, uid="new", created_at=sim.now)
    sim.status = ReservationEnvelopeStatus()
    sim.tick().reconcile()
    sim.usage("x", "5", final=True).tick().reconcile()
    assert sim.total("committed") == "0" and sim.total("available") == "100"
    assert sim.last is not None and "x" in sim.last.replaced
