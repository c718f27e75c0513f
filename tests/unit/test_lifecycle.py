"""One test per claim transition and per forbidden transition (DESIGN.md §4, the seeds)."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from decimal import Decimal

import pytest

from reservoir.core.model import ClaimPhase as P
from tests.unit.sim import Sim

# --- admission ---------------------------------------------------------------------------


def test_a_claim_that_fits_reserves_tentatively_from_the_envelope() -> None:
    sim = Sim().create("a").reconcile()
    assert sim.phase("a") is P.TENTATIVE
    assert sim.available() == "80"
    assert sim.total("reserved") == "20"


def test_a_claim_that_does_not_fit_waits_pending_with_its_reason_and_holds_nothing() -> None:
    sim = Sim().create("a", {"tokens": "90"}).create("b", {"tokens": "20"}).tick()
    sim.reconcile()
    assert sim.phase("b") is P.PENDING
    assert sim.last is not None and sim.last.pending["b"].reason == "InsufficientCapacity"
    assert sim.total("reserved") == "90"


def test_a_claim_created_already_dispatched_reserves_and_commits_in_one_step() -> None:
    sim = Sim().create("lazy", dispatch=True).reconcile()
    assert sim.phase("lazy") is P.COMMITTED
    assert sim.reasons("lazy") == ["Reserved", "CommitPointReached"]


def test_a_lazily_dispatched_claim_waits_pending_when_capacity_is_short() -> None:
    sim = Sim().create("big", {"tokens": "100"}).tick().create("lazy", dispatch=True)
    sim.reconcile()
    assert sim.phase("lazy") is P.PENDING
    sim.cancel("big").reconcile()
    assert sim.phase("lazy") is P.COMMITTED


def test_pending_claims_are_admitted_by_priority_then_age() -> None:
    sim = Sim().create("hog", {"tokens": "100"}).reconcile()
    sim.tick().create("old-low", priority=0)
    sim.tick().create("new-high", priority=5)
    sim.tick().create("new-low", priority=0)
    sim.reconcile()
    sim.cancel("hog").reconcile()
    # 100 tokens free: everyone fits now, but admission order is the queue order
    order = [e.claim for e in sim.events if e.reason == "Reserved"]
    assert order == ["hog", "new-high", "old-low", "new-low"]


def test_the_queue_head_blocks_lower_priority_claims_from_jumping_it() -> None:
    sim = Sim().create("hog", {"tokens": "90"}).reconcile()
    sim.tick().create("head", {"tokens": "20"}, priority=9)
    sim.tick().create("small", {"tokens": "5"}, priority=1)
    sim.reconcile()
    assert sim.phase("head") is P.PENDING
    assert sim.phase("small") is P.PENDING
    assert sim.last is not None and sim.last.pending["small"].reason == "Queued"


def test_fallback_fail_rejects_a_claim_that_cannot_be_admitted_now() -> None:
    sim = Sim(fallback="Fail").create("a", {"tokens": "90"}).create("b").reconcile()
    assert sim.phase("b") is P.REJECTED
    assert sim.entry("b").settlement is not None
    assert sim.entry("b").settlement.reason == "InsufficientCapacity"


def test_a_request_for_a_resource_the_envelope_lacks_is_rejected() -> None:
    sim = Sim().create("a", {"gpus": "1"}).reconcile()
    assert sim.phase("a") is P.REJECTED
    assert sim.entry("a").settlement.reason == "UnknownResource"  # type: ignore[union-attr]


def test_a_request_larger_than_the_whole_envelope_is_rejected_not_queued_forever() -> None:
    sim = Sim().create("a", {"tokens": "101"}).reconcile()
    assert sim.phase("a") is P.REJECTED


def test_max_active_claims_caps_fan_out() -> None:
    sim = Sim(max_active_claims=2).create("a").create("b").create("c").reconcile()
    assert [sim.phase(n) for n in "abc"] == [P.TENTATIVE, P.TENTATIVE, P.PENDING]
    assert sim.last is not None and sim.last.pending["c"].reason == "MaxActiveClaims"


def test_max_tentative_claims_caps_holds_but_not_dispatched_claims() -> None:
    sim = Sim(max_tentative_claims=1).create("a").create("b").create("c", dispatch=True)
    sim.reconcile()
    assert [sim.phase(n) for n in "abc"] == [P.TENTATIVE, P.PENDING, P.COMMITTED]


def test_a_claim_pending_past_max_queue_age_is_rejected() -> None:
    sim = Sim(max_queue_seconds=30).create("hog", {"tokens": "100"}).create("late").reconcile()
    sim.tick(31).reconcile()
    assert sim.phase("late") is P.REJECTED
    assert sim.entry("late").settlement.reason == "MaxQueueAge"  # type: ignore[union-attr]


# --- pruning and cancellation --------------------------------------------------------------


def test_cancel_before_dispatch_releases_the_full_reservation_at_once() -> None:
    sim = Sim().create("a").reconcile().cancel("a").reconcile()
    assert sim.phase("a") is P.RELEASED
    assert sim.entry("a").released == {"tokens": 20}
    assert sim.available() == "100"


def test_deleting_a_tentative_claim_releases_it_at_once() -> None:
    sim = Sim().create("a").reconcile().delete("a").reconcile()
    assert sim.phase("a") is P.RELEASED
    assert sim.entry("a").settlement.reason == "Deleted"  # type: ignore[union-attr]


def test_cancel_while_pending_settles_without_ever_holding() -> None:
    sim = Sim().create("hog", {"tokens": "100"}).reconcile().create("a").reconcile()
    sim.cancel("a").reconcile()
    assert sim.phase("a") is P.RELEASED
    assert sim.entry("a").reserved == {}
    assert sim.available() == "0"


def test_cancel_after_commit_is_a_request_not_a_release() -> None:
    sim = Sim().create("a").reconcile().dispatch("a").reconcile().cancel("a").reconcile()
    assert sim.phase("a") is P.COMMITTED
    assert sim.entry("a").cancel_requested
    assert sim.total("reserved") == "20"
    assert "CancelRequested" in sim.reasons("a")


def test_cancel_requested_then_final_report_settles_commit_c_return_rest() -> None:
    sim = Sim().create("a").reconcile().dispatch("a").reconcile().cancel("a").reconcile()
    sim.usage("a", "3", final=True, outcome="Cancelled").reconcile()
    assert sim.phase("a") is P.CONSUMED
    assert sim.total("committed") == "3"
    assert sim.available() == "97"


def test_completion_wins_the_race_with_a_cancel_request() -> None:
    sim = Sim().create("a").reconcile().dispatch("a").reconcile()
    sim.usage("a", "20", final=True).cancel("a").reconcile()
    assert sim.phase("a") is P.CONSUMED
    assert sim.entry("a").settlement.outcome == "Succeeded"  # type: ignore[union-attr]


# --- commit points -----------------------------------------------------------------------


def test_dispatch_intent_commits_a_tentative_claim() -> None:
    sim = Sim().create("a").reconcile().dispatch("a").reconcile()
    assert sim.phase("a") is P.COMMITTED
    assert sim.entry("a").committed_at == sim.now


def test_pod_scheduled_commit_point_commits_when_the_pod_binds() -> None:
    sim = Sim().create("a", commitPoint="PodScheduled").reconcile().dispatch("a").reconcile()
    assert sim.phase("a") is P.TENTATIVE, "dispatch intent alone is not this claim's commit"
    sim.pod("a", scheduled=True).reconcile()
    assert sim.phase("a") is P.COMMITTED


def test_pod_running_commit_point_commits_and_runs_when_the_pod_starts() -> None:
    sim = Sim().create("a", commitPoint="PodRunning").reconcile().pod("a", scheduled=True)
    sim.reconcile()
    assert sim.phase("a") is P.TENTATIVE
    sim.pod("a", scheduled=True, running=True).reconcile()
    assert sim.phase("a") is P.RUNNING


def test_provider_acceptance_commits_but_is_not_running() -> None:
    sim = Sim().create("a").reconcile().update("a", upstream={"state": "Accepted"}).reconcile()
    assert sim.phase("a") is P.COMMITTED


def test_partial_usage_marks_a_committed_claim_running() -> None:
    sim = Sim().create("a").reconcile().dispatch("a").reconcile().usage("a", "4").reconcile()
    assert sim.phase("a") is P.RUNNING
    assert sim.entry("a").usage == {"tokens": 4}
    assert sim.total("reserved") == "20", "partial usage settles nothing yet"


# --- settlement ----------------------------------------------------------------------------


def test_final_usage_commits_c_and_returns_r_minus_c_atomically() -> None:
    sim = Sim().create("a").reconcile().dispatch("a").reconcile()
    sim.usage("a", "12", final=True).reconcile()
    assert sim.phase("a") is P.CONSUMED
    assert sim.entry("a").consumed == {"tokens": 12}
    assert sim.entry("a").released == {"tokens": 8}
    assert (sim.total("committed"), sim.total("reserved"), sim.available()) == ("12", "0", "88")


def test_a_final_report_without_usage_before_dispatch_releases_everything() -> None:
    sim = Sim().create("a").reconcile().update("a", final=True, outcome="Cancelled").reconcile()
    assert sim.phase("a") is P.RELEASED
    assert sim.entry("a").settlement.reason == "FinishedBeforeCommit"  # type: ignore[union-attr]


def test_a_final_report_above_the_reservation_charges_r_and_records_the_excess() -> None:
    sim = Sim().create("a").reconcile().dispatch("a").reconcile()
    sim.usage("a", "25", final=True).reconcile()
    assert sim.phase("a") is P.CONSUMED, "an overrun proves the branch ran: it settles"
    assert sim.entry("a").consumed == {"tokens": 20}, "charged at most R"
    overrun = sim.entry("a").overrun
    assert overrun is not None and overrun.usage == {"tokens": 25} and overrun.final
    assert overrun.excess == {"tokens": 5}
    assert (sim.total("committed"), sim.total("reserved"), sim.available()) == ("20", "0", "80")
    assert "Overrun" in sim.reasons("a")


def test_a_settled_claim_never_settles_again_on_replayed_facts() -> None:
    sim = Sim().create("a").reconcile().dispatch("a").reconcile()
    sim.usage("a", "12", final=True).reconcile()
    before = sim.status.model_copy(deep=True)
    for _ in range(3):
        sim.tick().reconcile()
    assert sim.status.entries == before.entries
    assert sim.status.totals == before.totals


def test_a_report_after_settlement_is_recorded_as_late_and_never_reopens() -> None:
    sim = Sim(
        ambiguity_deadline_seconds=10, at_ambiguity_deadline="Release", default_lease_seconds=5
    )
    sim.create("a").reconcile().dispatch("a").reconcile()
    sim.tick(6).reconcile().tick(11).reconcile()
    assert sim.phase("a") is P.RELEASED
    sim.usage("a", "7", final=True).reconcile()
    assert sim.phase("a") is P.RELEASED
    assert sim.entry("a").late is not None and sim.entry("a").late.count == 1  # type: ignore[union-attr]
    # policy lateCompletion Adjust (the default): the late usage is charged once, on top
    # of the settlement, which itself never changes.
    assert sim.total("committed") == "7"
    adjustment = sim.entry("a").adjustment
    assert adjustment is not None and adjustment.applied
    assert adjustment.charged == {"tokens": Decimal(7)}
    assert sim.entry("a").consumed == {}
    sim.reconcile()
    assert sim.entry("a").late.count == 1, "the same late report is counted once"  # type: ignore[union-attr]
    assert sim.total("committed") == "7", "the adjustment is applied once"


def test_a_late_report_is_only_recorded_under_policy_record() -> None:
    sim = Sim(
        ambiguity_deadline_seconds=10,
        at_ambiguity_deadline="Release",
        default_lease_seconds=5,
        late_completion="Record",
    )
    sim.create("a").reconcile().dispatch("a").reconcile()
    sim.tick(6).reconcile().tick(11).reconcile()
    sim.usage("a", "7", final=True).reconcile().reconcile()
    assert sim.total("committed") == "0"
    adjustment = sim.entry("a").adjustment
    assert adjustment is not None and not adjustment.applied
    assert adjustment.charged == {"tokens": Decimal(7)}


def test_a_dispatch_after_expiry_is_fenced_and_recorded() -> None:
    sim = Sim(default_lease_seconds=5).create("a").reconcile().tick(6).reconcile()
    assert sim.phase("a") is P.EXPIRED
    sim.dispatch("a").reconcile()
    assert sim.phase("a") is P.EXPIRED
    assert sim.entry("a").dispatch_fenced
    assert "DispatchRefused" in sim.reasons("a")


def test_a_dispatch_after_release_is_fenced_and_never_resurrects() -> None:
    sim = Sim().create("a").reconcile().delete("a").reconcile().dispatch("a").reconcile()
    assert sim.phase("a") is P.RELEASED
    assert sim.entry("a").dispatch_fenced
    assert sim.available() == "100"


# --- leases --------------------------------------------------------------------------------


def test_a_tentative_claim_whose_lease_lapses_expires_and_returns_r_once() -> None:
    sim = Sim(default_lease_seconds=5).create("a").reconcile().tick(5).reconcile()
    assert sim.phase("a") is P.EXPIRED
    assert sim.available() == "100"
    sim.tick().reconcile()
    assert sim.available() == "100"
    assert sim.reasons("a").count("LeaseExpired") == 1


def test_renewal_extends_expiry_without_resetting_first_reserved_time() -> None:
    sim = Sim(default_lease_seconds=10).create("a").reconcile()
    first = sim.entry("a").first_reserved_at
    sim.tick(8).heartbeat("a", "hb-1").reconcile()
    assert sim.entry("a").expires_at == sim.now + timedelta(seconds=10)
    assert sim.entry("a").first_reserved_at == first
    assert sim.entry("a").renewals == 1
    sim.tick(8).reconcile()
    assert sim.phase("a") is P.TENTATIVE


def test_a_repeated_heartbeat_token_renews_only_once() -> None:
    sim = Sim(default_lease_seconds=10).create("a").reconcile().heartbeat("a", "hb-1")
    sim.tick(1).reconcile().tick(1).reconcile()
    assert sim.entry("a").renewals == 1


def test_renewal_never_extends_past_the_maximum_lifetime() -> None:
    sim = Sim(default_lease_seconds=10, max_claim_lifetime_seconds=15).create("a").reconcile()
    sim.tick(9).heartbeat("a", "hb-1").reconcile()
    assert sim.entry("a").expires_at == sim.status.entries["a"].first_reserved_at + timedelta(  # type: ignore[operator]
        seconds=15
    )
    sim.tick(6).heartbeat("a", "hb-2").reconcile()
    assert sim.phase("a") is P.EXPIRED


def test_renewal_is_refused_once_the_renewal_budget_is_spent() -> None:
    sim = Sim(default_lease_seconds=10, max_renewals=1).create("a").reconcile()
    sim.tick(5).heartbeat("a", "1").reconcile().tick(5).heartbeat("a", "2").reconcile()
    assert sim.entry("a").renewals == 1
    assert "RenewalRefused" in sim.reasons("a")


def test_renewal_never_improves_queue_position() -> None:
    sim = Sim(default_lease_seconds=100).create("hog", {"tokens": "100"}).reconcile()
    sim.tick().create("first").tick().create("second").reconcile()
    sim.heartbeat("second", "hb").tick().reconcile()
    sim.cancel("hog").reconcile()
    order = [e.claim for e in sim.events if e.reason == "Reserved"]
    assert order == ["hog", "first", "second"]


def test_lease_lapse_after_commit_detaches_and_holds_capacity_as_reconciling() -> None:
    sim = Sim(default_lease_seconds=5).create("a").reconcile().dispatch("a").reconcile()
    sim.tick(5).reconcile()
    assert sim.phase("a") is P.DETACHED
    assert (sim.total("reconciling"), sim.total("reserved"), sim.available()) == ("20", "0", "80")


def test_a_heartbeat_after_detach_does_not_reattach() -> None:
    sim = Sim(default_lease_seconds=5).create("a").reconcile().dispatch("a").reconcile()
    sim.tick(5).reconcile().heartbeat("a", "back").reconcile()
    assert sim.phase("a") is P.DETACHED


def test_a_final_report_settles_a_detached_claim() -> None:
    sim = Sim(default_lease_seconds=5).create("a").reconcile().dispatch("a").reconcile()
    sim.tick(5).reconcile().usage("a", "5", final=True, outcome="Failed").reconcile()
    assert sim.phase("a") is P.CONSUMED
    assert sim.entry("a").settlement.reason == "SettledAfterDetach"  # type: ignore[union-attr]
    assert sim.available() == "95"


# --- ambiguity deadline --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("action", "phase", "committed", "available", "reconciling"),
    [
        ("Hold", P.DETACHED, "0", "80", "20"),
        ("Quarantine", P.CONSUMED, "20", "80", "0"),
        ("Release", P.RELEASED, "0", "100", "0"),
    ],
)
def test_the_ambiguity_deadline_applies_its_policy_and_records_it(
    action: str, phase: P, committed: str, available: str, reconciling: str
) -> None:
    sim = Sim(default_lease_seconds=5, ambiguity_deadline_seconds=60, at_ambiguity_deadline=action)
    sim.create("a").reconcile().dispatch("a").reconcile().tick(5).reconcile()
    sim.tick(59).reconcile()
    assert sim.phase("a") is P.DETACHED, "nothing happens before the deadline"
    sim.tick(1).reconcile()
    assert sim.phase("a") is phase
    assert sim.entry("a").deadline_action == action
    assert (sim.total("committed"), sim.available(), sim.total("reconciling")) == (
        committed,
        available,
        reconciling,
    )


def test_deleting_a_committed_claim_waits_for_its_final_report() -> None:
    sim = Sim().create("a").reconcile().dispatch("a").reconcile().delete("a").reconcile()
    assert sim.phase("a") is P.COMMITTED
    sim.usage("a", "9", final=True).reconcile()
    assert sim.phase("a") is P.CONSUMED


def test_entries_of_settled_claims_that_are_gone_are_pruned_and_committed_stays() -> None:
    sim = Sim().create("a").reconcile().dispatch("a").reconcile()
    sim.usage("a", "9", final=True).reconcile().remove("a").reconcile()
    assert "a" not in sim.status.entries
    assert sim.total("committed") == "9"
    assert sim.available() == "91"


def test_a_tentative_claim_that_vanished_is_held_until_its_deadline() -> None:
    """It may have been dispatched after the operator last looked: never released on a guess."""
    sim = Sim(
        default_lease_seconds=5, ambiguity_deadline_seconds=5, at_ambiguity_deadline="Release"
    )
    sim.create("a").reconcile().remove("a").reconcile()
    assert sim.phase("a") is P.COMMITTED and sim.entry("a").cancel_requested
    assert sim.available() == "80"
    sim.tick(6).reconcile()
    assert sim.phase("a") is P.DETACHED
    sim.tick(6).reconcile()
    assert "a" not in sim.status.entries, "settled by the deadline policy, then pruned"
    assert (sim.available(), sim.total("committed")) == ("100", "0")


# --- the envelope --------------------------------------------------------------------------


def test_a_closed_envelope_admits_no_new_claims() -> None:
    sim = Sim().create("a").reconcile().close().create("b").reconcile()
    assert sim.phase("b") is P.REJECTED
    assert sim.status.phase == "Closing"


def test_closing_releases_the_balance_once_every_claim_has_settled() -> None:
    sim = Sim().create("a").reconcile().dispatch("a").reconcile().close().reconcile()
    assert sim.status.balance_released == {}
    sim.usage("a", "15", final=True).reconcile()
    assert sim.status.phase == "Closed"
    assert sim.status.balance_released == {"tokens": 85}
    closed_at = sim.status.closed_at
    sim.tick().reconcile()
    assert sim.status.closed_at == closed_at, "released once"


def test_an_envelope_past_its_lifetime_expires_and_stops_admitting() -> None:
    sim = Sim()
    sim.envelope = sim.envelope.__class__(
        spec=sim.envelope.spec.model_copy(update={"lifetime_seconds": 10}),
        created_at=sim.envelope.created_at,
    )
    sim.tick(10).create("late").reconcile()
    assert sim.status.phase == "Expired"
    assert sim.phase("late") is P.REJECTED
    assert sim.status.balance_released == {"tokens": 100}


@pytest.mark.parametrize("lifetime", [3600, None], ids=["raised", "removed"])
def test_an_expired_envelope_still_closing_never_reopens(lifetime: int | None) -> None:
    """Issue 25: expired while a committed claim still runs (closing), its lifetime raised
    or removed since: the recorded Expired phase stands, no claim is admitted, and the
    balance is released once, when the running claim settles."""
    sim = Sim()
    sim.envelope = replace(
        sim.envelope, spec=sim.envelope.spec.model_copy(update={"lifetime_seconds": 10})
    )
    sim.create("a").reconcile().dispatch("a").reconcile()
    sim.tick(10).reconcile()
    assert sim.status.phase == "Expired" and sim.status.closed_at is None
    sim.envelope = replace(
        sim.envelope, spec=sim.envelope.spec.model_copy(update={"lifetime_seconds": lifetime})
    )
    sim.tick().create("late").reconcile()
    assert sim.status.phase == "Expired"
    assert sim.phase("late") is P.REJECTED
    sim.usage("a", "15", final=True).reconcile()
    assert sim.status.phase == "Expired" and sim.status.closed_at is not None
    assert sim.status.balance_released == {"tokens": 85}


def test_returned_capacity_stays_in_the_envelope_for_siblings() -> None:
    sim = Sim().create("a", {"tokens": "60"}).create("b", {"tokens": "60"}).reconcile()
    assert sim.phase("b") is P.PENDING
    sim.cancel("a").reconcile()
    assert sim.phase("b") is P.TENTATIVE


# --- operator decisions and scheduling ------------------------------------------------------


def test_force_settle_releases_an_uncommitted_claim_and_records_why() -> None:
    sim = Sim().create("a").reconcile()
    sim.claims["a"] = replace(sim.claims["a"], force_settle="ticket OPS-1: worker lost")
    sim.reconcile()
    assert sim.phase("a") is P.RELEASED
    assert "ForceSettled" in sim.reasons("a")


def test_force_settle_charges_a_committed_claim_its_last_accepted_usage() -> None:
    sim = Sim().create("a").reconcile().dispatch("a").reconcile().usage("a", "6").reconcile()
    sim.claims["a"] = replace(sim.claims["a"], force_settle="ticket OPS-2")
    sim.reconcile()
    assert sim.phase("a") is P.CONSUMED
    assert (sim.total("committed"), sim.available()) == ("6", "94")


def test_the_next_deadline_is_the_earliest_lease_end() -> None:
    sim = Sim(default_lease_seconds=30).create("a").tick(10).create("b").reconcile()
    assert sim.last is not None
    assert sim.last.wake_at == sim.entry("a").expires_at


def test_usage_from_a_claim_never_admitted_is_kept_as_an_overrun_not_charged() -> None:
    sim = Sim().create("hog", {"tokens": "100"}).reconcile().create("a")
    sim.usage("a", "12", final=True).reconcile()
    assert sim.phase("a") is P.RELEASED
    overrun = sim.entry("a").overrun
    assert overrun is not None and overrun.usage == {"tokens": 12}
    assert sim.total("committed") == "0"
    assert "Overrun" in sim.reasons("a")


def test_claims_created_in_the_same_second_queue_by_name() -> None:
    sim = Sim().create("hog", {"tokens": "100"}).reconcile()
    sim.tick().create("b-second", {"tokens": "60"}).create("a-first", {"tokens": "60"})
    sim.reconcile().cancel("hog").reconcile()
    assert (sim.phase("a-first"), sim.phase("b-second")) == (P.TENTATIVE, P.PENDING)


def test_a_dispatch_first_seen_after_the_lease_lapsed_detaches_never_returns_capacity() -> None:
    sim = Sim(default_lease_seconds=5).create("a").reconcile()
    sim.dispatch("a").tick(5).reconcile()  # the operator sees both facts at once
    assert sim.phase("a") is P.DETACHED
    assert (sim.total("reconciling"), sim.available()) == ("20", "80")
    before = sim.status.model_copy(deep=True)
    sim.reconcile()
    assert sim.status == before, "one pass reaches the fixed point"
