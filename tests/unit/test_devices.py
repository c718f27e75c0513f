"""Device resources (DESIGN.md §7), in the pure core: a GPU claim is held only on a recorded
allocation, waits with the scheduler's reason until then, and after settlement its devices
count as free only once the allocation is gone. Attacked with skipped intermediate states."""

from __future__ import annotations

from reservoir.core.claimstatus import claim_status
from reservoir.core.devices import device_occupancy
from reservoir.core.model import ClaimPhase
from tests.unit.sim import Sim

GPU = "nvidia.com/gpu"


def gpu_sim() -> Sim:
    return Sim({"tokens": "100", GPU: "8"})


def test_a_gpu_claim_waits_for_its_allocation_with_the_schedulers_reason() -> None:
    sim = gpu_sim().create("a", {GPU: "2"}).reconcile()
    assert sim.phase("a") is ClaimPhase.PENDING
    assert sim.last is not None and sim.last.device_holds == {"a": {GPU: 2}}
    assert sim.last.pending["a"].reason == "AwaitingDevices"
    assert sim.total("reserved", GPU) == "0"  # never reported as held before the allocation

    sim.unschedulable("a", "0/4 nodes are available: 4 cannot allocate all claims").reconcile()
    assert sim.last is not None and "cannot allocate" in sim.last.pending["a"].message

    sim.allocate("a", held=False).reconcile()  # allocated, but no pod of ours holds it yet
    assert sim.phase("a") is ClaimPhase.PENDING

    sim.allocate("a", "gpu-node-2", ("gpu-3", "gpu-4")).reconcile()
    entry = sim.entry("a")
    assert entry.phase is ClaimPhase.TENTATIVE
    assert entry.devices is not None and entry.devices.node == "gpu-node-2"
    assert entry.devices.devices == ["gpu-3", "gpu-4"]
    assert sim.total("reserved", GPU) == "2"
    assert sim.last is not None and sim.last.device_holds == {"a": {GPU: 2}}


def test_a_claim_waiting_for_devices_keeps_its_logical_room() -> None:
    sim = gpu_sim().create("a", {GPU: "6"}).tick().create("b", {GPU: "4"}).reconcile()
    assert sim.last is not None
    assert sim.last.pending["a"].reason == "AwaitingDevices"
    assert sim.last.pending["b"].reason == "InsufficientCapacity"
    assert set(sim.last.device_holds) == {"a"}  # b asks the scheduler for nothing yet


def test_settled_devices_are_free_only_once_the_allocation_is_gone() -> None:
    sim = gpu_sim().create("a", {GPU: "2"}).allocate("a").reconcile()
    sim.cancel("a").reconcile()
    entry = sim.entry("a")
    assert entry.phase is ClaimPhase.RELEASED
    assert sim.total("available", "tokens") == "100"  # the rest of the budget is back ...
    assert entry.devices is not None and not entry.devices.released  # ... the devices not yet
    # Issue 21: they count against the envelope until the scheduler confirms the release (a
    # pod may still run on them); they used to be available at once.
    assert sim.total("available", GPU) == "6" and sim.total("reserved", GPU) == "2"
    assert sim.last is not None and "a" not in sim.last.device_holds  # let them go
    sim.mirror().reconcile()
    assert "a" in sim.status.entries  # not compacted while the devices are occupied
    assert sim.total("available", GPU) == "6"

    sim.deallocate("a").reconcile()
    assert sim.entry("a").devices.released  # type: ignore[union-attr]
    assert sim.total("available", GPU) == "8"
    assert sim.reasons("a").count("DevicesReleased") == 1
    sim.reconcile().mirror().reconcile()
    assert "a" not in sim.status.entries
    assert sim.reasons("a").count("DevicesReleased") == 1


def test_allocated_and_cancelled_before_the_operator_looked_never_holds() -> None:
    sim = gpu_sim().create("a", {GPU: "2"}).allocate("a").cancel("a").reconcile()
    assert sim.entry("a").phase is ClaimPhase.RELEASED
    assert sim.entry("a").devices is None
    assert sim.last is not None and sim.last.device_holds == {}  # its ResourceClaim goes


def test_cancelled_and_deallocated_unseen_is_released_with_its_devices_free() -> None:
    sim = gpu_sim().create("a", {GPU: "1"}).allocate("a").reconcile()
    sim.cancel("a").deallocate("a").reconcile()
    entry = sim.entry("a")
    assert entry.phase is ClaimPhase.RELEASED
    assert entry.devices is not None and entry.devices.released


def test_a_claim_losing_its_room_while_allocated_lets_its_devices_go() -> None:
    sim = gpu_sim().create("big", {GPU: "8"}, priority=5).reconcile()
    sim.create("small", {GPU: "1"}).allocate("small").reconcile()
    assert sim.phase("small") is ClaimPhase.PENDING  # big is first in the queue
    assert sim.last is not None and "small" not in sim.last.device_holds


def test_a_fractional_device_count_is_rejected() -> None:
    sim = gpu_sim().create("a", {GPU: "1.5"}).reconcile()
    assert sim.entry("a").phase is ClaimPhase.REJECTED
    assert sim.entry("a").settlement.reason == "InvalidDeviceCount"  # type: ignore[union-attr]


def test_non_device_claims_are_untouched() -> None:
    sim = gpu_sim().create("a", {"tokens": "10"}).reconcile()
    assert sim.phase("a") is ClaimPhase.TENTATIVE
    assert sim.last is not None and sim.last.device_holds == {}


def test_the_hand_off_is_recorded_and_commits_before_the_gate_is_lifted() -> None:
    sim = gpu_sim().create("a", {GPU: "2"}).allocate("a").reconcile()
    assert sim.last is not None and sim.last.handed_off == {}
    sim.pod("a", gated=True).reconcile()  # its workload pod waits behind our gate
    entry = sim.entry("a")
    assert entry.phase is ClaimPhase.COMMITTED and entry.handed_off_at is not None
    assert entry.committed_at == entry.handed_off_at
    assert sim.last is not None and sim.last.handed_off == {"a": "a-pod"}  # the gate may go now
    assert sim.last.device_holds == {"a": {GPU: 2}}
    assert sim.reasons("a").count("HandedOff") == 1
    sim.pod("a", scheduled=True).reconcile()  # bound, gate gone: nothing more to record
    assert sim.reasons("a").count("HandedOff") == 1


def test_a_handed_off_pod_that_vanished_unseen_is_held_never_returned() -> None:
    """The pod may have been bound and run between two looks: after the hand-off the
    claim is committed on the record, so a lapsed lease detaches it (R held)."""
    sim = gpu_sim().create("a", {GPU: "2"}, lease={"duration_seconds": 5})
    sim.allocate("a").reconcile().pod("a", gated=True).reconcile()
    sim.no_pod("a").tick(10).reconcile()
    assert sim.entry("a").phase is ClaimPhase.DETACHED
    assert sim.total("reconciling", GPU) == "2"


def test_no_hand_off_before_admission_or_after_a_cancel() -> None:
    sim = gpu_sim().create("a", {GPU: "2"}).pod("a", gated=True).reconcile()
    assert sim.phase("a") is ClaimPhase.PENDING  # no devices yet: nothing to hand over
    sim.allocate("a").cancel("a").reconcile()
    assert sim.entry("a").handed_off_at is None
    assert sim.entry("a").phase is ClaimPhase.RELEASED


def test_a_gated_pod_of_a_claim_without_devices_is_handed_its_capacity() -> None:
    sim = gpu_sim().create("a", {"tokens": "5"}).pod("a", gated=True).reconcile()
    assert sim.entry("a").phase is ClaimPhase.COMMITTED
    assert sim.entry("a").handed_off_to == "a-pod" and sim.entry("a").devices is None
    assert sim.last is not None and sim.last.handed_off == {"a": "a-pod"}
    assert sim.last.device_holds == {}


def test_a_device_claims_gate_is_kept_once_a_cancel_is_recorded() -> None:
    """Its placeholder still follows the hand-off, but the gate is not lifted any more."""
    sim = gpu_sim().create("a", {GPU: "2"}).allocate("a").reconcile()
    sim.pod("a", gated=True).reconcile().cancel("a").reconcile()
    assert sim.last is not None and sim.last.handed_off == {"a": "a-pod"}
    assert sim.last.keep_gated == {"a"}


def test_a_workload_pod_lost_after_the_hand_off_detaches_the_claim() -> None:
    """Node loss or eviction while committed: Detached (held as reconciling), never
    Released; a final report still settles it."""
    sim = gpu_sim().create("a", {GPU: "2"}).allocate("a").reconcile()
    sim.pod("a", gated=True).reconcile().pod("a", scheduled=True, running=True).reconcile()
    assert sim.entry("a").phase is ClaimPhase.RUNNING
    sim.no_pod("a").reconcile()
    assert sim.entry("a").phase is ClaimPhase.DETACHED
    assert sim.total("reconciling", GPU) == "2"
    assert "WorkloadGone" in sim.reasons("a")
    sim.usage("a", "0", final=True).reconcile()
    assert sim.entry("a").phase is ClaimPhase.CONSUMED


def test_a_hold_placed_again_after_its_placeholder_was_lost_records_the_new_devices() -> None:
    sim = gpu_sim().create("a", {GPU: "2"}).allocate("a", "gpu-node-0", ("gpu-0", "gpu-1"))
    sim.reconcile().deallocate("a").reconcile()  # preempted: the allocation went away
    assert sim.entry("a").phase is ClaimPhase.TENTATIVE  # still held logically, placed again
    assert sim.last is not None and sim.last.device_holds == {"a": {GPU: 2}}
    sim.allocate("a", "gpu-node-3", ("gpu-5", "gpu-6")).reconcile()
    held = sim.entry("a").devices
    assert held is not None and (held.node, held.devices) == ("gpu-node-3", ["gpu-5", "gpu-6"])
    assert sim.reasons("a").count("DevicesMoved") == 1


def test_device_occupancy_separates_held_from_settled_but_still_occupied() -> None:
    sim = gpu_sim().create("a", {GPU: "2"}).allocate("a").create("b", {GPU: "3"})
    sim.allocate("b", "gpu-node-1", ("gpu-0", "gpu-1", "gpu-2")).reconcile()
    assert device_occupancy(sim.status.entries.values()) == {"held": 4, "settled_occupied": 0}
    sim.cancel("b").reconcile()
    assert device_occupancy(sim.status.entries.values()) == {"held": 1, "settled_occupied": 3}
    sim.deallocate("b").reconcile()
    assert device_occupancy(sim.status.entries.values()) == {"held": 1, "settled_occupied": 0}


def test_a_dispatched_claim_hands_its_devices_off_too() -> None:
    """Found while building the Commit policy: the hand-off ran only for Tentative claims,
    so a branch dispatched before its workload pod existed kept its pod gated forever."""
    sim = gpu_sim().create("a", {GPU: "2"}).allocate("a").reconcile().dispatch("a").reconcile()
    assert sim.entry("a").phase is ClaimPhase.COMMITTED
    sim.pod("a", gated=True).reconcile()
    assert sim.entry("a").handed_off_at is not None
    assert sim.last is not None and sim.last.handed_off == {"a": "a-pod"}
    assert sim.entry("a").phase is ClaimPhase.COMMITTED


def test_under_the_commit_policy_devices_are_asked_for_only_once_the_branch_is_chosen() -> None:
    sim = Sim({"tokens": "100", GPU: "8"}, physical_hold="Commit")
    sim.create("a", {GPU: "2"}).create("b", {GPU: "2"}).reconcile()
    assert sim.entry("a").phase is ClaimPhase.TENTATIVE  # its logical budget only
    assert sim.entry("a").devices is None
    assert sim.last is not None and sim.last.device_holds == {}  # nothing asked of devices
    assert sim.total("reserved", GPU) == "4"

    sim.dispatch("a").unschedulable("a", "0/4 nodes are available").reconcile()  # chosen
    assert sim.last is not None and set(sim.last.device_holds) == {"a"}
    # Waiting with the scheduler's reason, shown as DevicesHeld=False on the claim.
    assert sim.last.awaiting_devices == {"a": "0/4 nodes are available"}
    status = claim_status(sim.entry("a"), None, None, None, sim.now, awaiting_devices="why")
    held_condition = next(c for c in status.conditions if c.type == "DevicesHeld")
    assert held_condition.status == "False" and held_condition.reason == "AwaitingDevices"
    assert sim.entry("a").devices is None  # not held until the allocation is recorded
    sim.allocate("a", "gpu-node-1", ("gpu-2", "gpu-3")).reconcile()
    held = sim.entry("a").devices
    assert held is not None and held.node == "gpu-node-1"
    assert "DevicesHeld" in sim.reasons("a")
    sim.pod("a", gated=True).reconcile()  # then the hand-off, as under Tentative
    assert sim.entry("a").handed_off_at is not None

    sim.cancel("b").reconcile()  # pruned before it was chosen: it never touched a device
    assert sim.entry("b").phase is ClaimPhase.RELEASED and sim.entry("b").devices is None


def test_a_replacement_pod_does_not_bring_back_the_one_handed_off() -> None:
    """Found by the coalescing audit: the handed-off pod gone and a new gated one (a Job's
    retry) seen in one look or two must both detach the claim: gone is about that pod."""
    sim = gpu_sim().create("a", {GPU: "2"}).allocate("a").reconcile()
    sim.pod("a", gated=True).reconcile()
    assert sim.entry("a").handed_off_to == "a-pod"
    sim.pod("a", gated=True, uid="a-pod-2").reconcile()  # the first one went unseen
    assert sim.entry("a").phase is ClaimPhase.DETACHED
    assert sim.entry("a").handed_off_to == "a-pod"  # the new pod is not handed anything


def test_a_settled_gpu_claim_deleted_before_its_devices_freed_still_leaves_the_ledger() -> None:
    """Found by review: such an entry was never marked free nor compacted, and 512 of them
    wedged the envelope."""
    sim = gpu_sim().create("a", {GPU: "2"}).allocate("a").reconcile()
    sim.cancel("a").reconcile().remove("a").reconcile()
    assert "a" in sim.status.entries  # its devices may still be in use
    sim.deallocate("a").reconcile()
    assert "a" not in sim.status.entries


def test_nothing_is_handed_off_after_the_lease_lapsed() -> None:
    """Found by review: the hand-off ran before the lease check and committed a claim
    whose lease had lapsed, so it was Detached and charged instead of Expired."""
    sim = gpu_sim().create("a", {GPU: "2"}, lease={"duration_seconds": 5})
    sim.allocate("a").reconcile().pod("a", gated=True).tick(30).reconcile()
    assert sim.entry("a").phase is ClaimPhase.EXPIRED
    assert sim.entry("a").handed_off_at is None


def test_only_devices_held_now_are_handed_off() -> None:
    """Found by review: a hold lost (placeholder preempted) and a gated pod seen in the same
    look got the hand-off, and its gate lifted, with nothing holding the devices."""
    sim = gpu_sim().create("a", {GPU: "2"}).allocate("a").reconcile()
    sim.deallocate("a").pod("a", gated=True).reconcile()
    assert sim.entry("a").handed_off_at is None and sim.entry("a").phase is ClaimPhase.TENTATIVE
    sim.allocate("a", "gpu-node-2", ("gpu-4", "gpu-5")).reconcile()  # placed again: recorded
    sim.reconcile()
    assert sim.entry("a").handed_off_at is not None
    assert sim.entry("a").devices.node == "gpu-node-2"  # type: ignore[union-attr]


def test_claims_waiting_for_devices_count_against_the_caps() -> None:
    """Found by review: with maxActiveClaims 1, all four GPU claims got placeholders (real
    devices allocated), and whichever bound first was admitted, whatever its priority."""
    sim = Sim({"tokens": "100", GPU: "8"}, max_active_claims=1)
    sim.create("low", {GPU: "1"}, priority=-5).create("high", {GPU: "1"}, priority=100)
    sim.create("c", {GPU: "1"}).create("d", {GPU: "1"}).reconcile()
    assert sim.last is not None and set(sim.last.device_holds) == {"high"}
    sim.allocate("low").reconcile()  # a stale placement of the low one changes nothing
    assert sim.phase("low") is ClaimPhase.PENDING
    assert sim.last is not None and set(sim.last.device_holds) == {"high"}


def test_a_hand_off_whose_gate_was_never_lifted_returns_everything_when_the_lease_lapses() -> None:
    """Issue 21 §3.5: the hand-off is recorded (committed), but the gate is never lifted (the
    lift failed, or a restart fell between the ledger write and the lift). The lease lapses
    with the pod still gated: a gate is never added back, so the pod provably never ran.
    It used to go Detached and be Quarantined (2 GPUs and 10 tokens charged, its
    ResourceClaim deleted); now R returns at the lapse and the gate stays."""
    sim = Sim(
        {"tokens": "100", GPU: "8"},
        ambiguity_deadline_seconds=10,
        at_ambiguity_deadline="Quarantine",
    )
    sim.create("a", {GPU: "2", "tokens": "10"}, lease={"duration_seconds": 5})
    sim.allocate("a").reconcile().pod("a", gated=True).reconcile()
    assert sim.entry("a").phase is ClaimPhase.COMMITTED and sim.entry("a").handed_off_to
    sim.tick(6).reconcile().tick(30).reconcile()  # the pod is still behind the gate
    entry = sim.entry("a")
    assert entry.phase is ClaimPhase.EXPIRED and entry.settlement is not None
    assert entry.settlement.reason == "GateNeverLifted"
    assert entry.consumed == {} and sim.available() == "100"
    assert sim.last is not None and sim.last.handed_off == {}, "the gate is not lifted now"
    assert sim.last.device_holds == {}
    # Someone lifts the gate anyway and the pod runs: a late fact, the settlement stays.
    sim.pod("a", scheduled=True, running=True).reconcile()
    assert sim.entry("a").pod_started_late and sim.phase("a") is ClaimPhase.EXPIRED


def test_a_handed_off_pod_past_its_gate_when_the_lease_lapses_is_held() -> None:
    """The gate was lifted and the pod bound: it may be running, so the lapse detaches."""
    sim = gpu_sim().create("a", {GPU: "2"}, lease={"duration_seconds": 5})
    sim.allocate("a").reconcile().pod("a", gated=True).reconcile()
    sim.pod("a", scheduled=True).tick(6).reconcile()
    assert sim.phase("a") is ClaimPhase.DETACHED and sim.total("reconciling", GPU) == "2"


def test_devices_still_allocated_after_settlement_are_not_lent_to_a_new_claim() -> None:
    """Issue 21: a tenant whose pod keeps a settled claim's devices (its allocation stays
    while a pod uses it) must not get the same number of devices again from its envelope:
    with 8 GPUs, 6 in a settled but still allocated claim, a new claim for 4 waits."""
    sim = gpu_sim().create("a", {GPU: "6"}).allocate("a").reconcile()
    sim.cancel("a").reconcile().mirror().reconcile()
    assert sim.phase("a") is ClaimPhase.RELEASED
    sim.tick().create("b", {GPU: "4"}).reconcile()
    assert sim.last is not None and sim.last.pending["b"].reason == "InsufficientCapacity"
    # Seen only at the end or step by step, the same: once the allocation is gone, b fits.
    sim.deallocate("a").reconcile().reconcile()
    assert sim.last is not None and sim.last.pending["b"].reason == "AwaitingDevices"
    assert sim.last.device_holds == {"b": {GPU: 4}}  # asked of the scheduler only now


def test_an_envelope_closes_only_once_its_settled_devices_are_free() -> None:
    sim = gpu_sim().create("a", {GPU: "2"}).allocate("a").reconcile()
    sim.cancel("a").reconcile()
    sim.close().reconcile().mirror().reconcile()
    assert sim.status.closed_at is None  # the devices may still be in use
    sim.deallocate("a").reconcile().mirror().reconcile()
    assert sim.status.closed_at is not None
    assert sim.status.balance_released.get(GPU) == 8


def test_a_settled_claims_devices_are_neither_committed_nor_counted_twice() -> None:
    """Devices are Reusable (issue 22): nothing of them is committed at settlement, and all
    of R waits for the scheduler's release, then all of it is available again."""
    sim = gpu_sim().create("a", {GPU: "2"}, dispatch=True).allocate("a").reconcile()
    sim.update("a", usage={GPU: "1"}, final=True, outcome="Succeeded").reconcile()
    assert sim.phase("a") is ClaimPhase.CONSUMED
    assert sim.total("committed", GPU) == "0" and sim.total("reserved", GPU) == "2"
    assert sim.total("available", GPU) == "6"
    sim.deallocate("a").reconcile()
    assert sim.total("committed", GPU) == "0" and sim.total("available", GPU) == "8"
