"""Settle only on recorded facts: one regression test per hole an independent review found.

Each builds the history the review used (often: two facts the operator never saw apart)
and checks that the settlement is the one the facts support, the same as when the
operator sees every step.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from decimal import Decimal

import pytest

from reservoir.core.inflight import MOVES_PER_PASS
from reservoir.core.model import MAX_LEDGER_ENTRIES, ReservationEnvelopeSpec
from reservoir.core.model import ClaimPhase as P
from reservoir.core.reconcile import reconcile
from reservoir.k8s.facts import (
    InvalidClaim,
    UnreadableEnvelopeError,
    claim_facts,
    envelope_facts,
    force_settle_gone,
    pod_facts,
)
from tests.unit.sim import Sim

# --- 1. dispatch and cancel are separate sticky facts ---------------------------------


def test_dispatch_then_cancel_unobserved_settles_like_step_by_step() -> None:
    seen = Sim().create("a").reconcile().dispatch("a").reconcile().cancel("a").reconcile()
    missed = Sim().create("a").reconcile().dispatch("a").cancel("a").reconcile()
    for sim in (seen, missed):
        assert sim.phase("a") is P.COMMITTED, "a dispatched branch may be running"
        assert sim.entry("a").cancel_requested
        assert (sim.total("reserved"), sim.available()) == ("20", "80")


# --- 2. an overrun is proof of execution ---------------------------------------------


def test_an_overrun_on_a_tentative_claim_commits_it_so_cancel_does_not_release() -> None:
    sim = Sim().create("a").reconcile().usage("a", "25").cancel("a").reconcile()
    assert sim.phase("a") is P.RUNNING
    assert sim.entry("a").cancel_requested and sim.entry("a").usage == {"tokens": 20}
    assert sim.available() == "80"


def test_an_overrun_on_a_tentative_claim_detaches_at_lease_end_never_expires() -> None:
    sim = Sim(default_lease_seconds=5).create("a").reconcile().usage("a", "25").tick(6)
    sim.reconcile()
    assert sim.phase("a") is P.DETACHED
    assert (sim.total("reconciling"), sim.available()) == ("20", "80")


def test_a_final_overrun_after_detach_is_charged_r_under_any_deadline_policy() -> None:
    for policy in ("Hold", "Quarantine", "Release"):
        sim = Sim(default_lease_seconds=5, at_ambiguity_deadline=policy)
        sim.create("a").reconcile().dispatch("a").reconcile().tick(6).reconcile()
        assert sim.phase("a") is P.DETACHED
        sim.usage("a", "25", final=True).tick(1000).reconcile()
        assert sim.phase("a") is P.CONSUMED, policy
        assert sim.entry("a").consumed == {"tokens": 20}, policy
        assert sim.entry("a").overrun is not None


def test_the_release_deadline_charges_the_usage_already_reported() -> None:
    sim = Sim(
        default_lease_seconds=5, ambiguity_deadline_seconds=10, at_ambiguity_deadline="Release"
    )
    sim.create("a").reconcile().dispatch("a").usage("a", "15").reconcile()
    sim.tick(6).reconcile().tick(11).reconcile()
    assert sim.phase("a") is P.CONSUMED
    assert (sim.entry("a").consumed, sim.entry("a").released) == (
        {"tokens": 15},
        {"tokens": 5},
    )


# --- 3. the core keeps its own monotonic record of usage ------------------------------


def test_usage_removed_behind_the_rules_back_cannot_lower_the_charge() -> None:
    sim = Sim().create("a").reconcile().dispatch("a").usage("a", "15").reconcile()
    sim.update("a", usage={}).reconcile()  # what a skipped CEL rule would let through
    sim.usage("a", "3", final=True).reconcile()
    assert sim.phase("a") is P.CONSUMED
    assert sim.entry("a").consumed == {"tokens": 15}, "charged what was recorded, not 3"


# --- 4. what the operator cannot read never freezes a claim --------------------------


def raw_claim(uid: str = "u-1", **spec: object) -> dict[str, object]:
    return {
        "metadata": {"name": "a", "uid": uid, "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"envelope": "env", "requests": {"tokens": "20"}, **spec},
    }


def test_an_unreadable_final_report_is_not_final_and_the_claim_still_settles() -> None:
    facts = claim_facts(
        raw_claim(dispatch=True, usage={"tokens": "3.0000000001"}, final=True, outcome="Succeeded"),
        None,
    )
    assert not isinstance(facts, InvalidClaim)
    assert facts.problem is not None and "usage.tokens" in facts.problem
    assert facts.spec.dispatch and not facts.spec.final and facts.spec.usage == {}

    sim = Sim(default_lease_seconds=5, ambiguity_deadline_seconds=10)
    sim.create("a").reconcile().dispatch("a").reconcile()
    sim.claims["a"] = facts.__class__(**{**facts.__dict__, "uid": "a", "created_at": sim.now})
    sim.reconcile()
    assert sim.phase("a") is P.COMMITTED, "not settled on a report it cannot read"
    sim.tick(6).reconcile().tick(11).reconcile()
    assert sim.phase("a") is P.CONSUMED, "the deadline still applies (Quarantine)"


def test_a_claim_whose_dispatch_fact_cannot_be_read_is_held_as_if_dispatched() -> None:
    facts = claim_facts(raw_claim(dispatch="perhaps"), None)
    assert isinstance(facts, InvalidClaim) and "dispatch" in facts.problem
    sim = Sim(default_lease_seconds=5).create("a").reconcile()
    sim.remove("a").tick(6).reconcile()  # what the writer does with an unreadable claim
    assert sim.phase("a") is P.DETACHED, "held, never released on a guess"


def test_an_unreadable_claim_can_still_be_force_settled_and_deleted() -> None:
    facts = claim_facts(raw_claim(usage={"tokens": "1e-3"}), None)
    assert not isinstance(facts, InvalidClaim)
    sim = Sim()
    sim.claims["a"] = facts.__class__(**{**facts.__dict__, "uid": "a", "created_at": sim.now})
    sim.reconcile()
    assert sim.last is not None
    assert sim.last.pending["a"].reason == "InvalidSpec", "not admitted, and says why"
    sim.delete("a").reconcile()
    assert sim.phase("a") is P.RELEASED

    sim = Sim().create("b").reconcile()
    facts = claim_facts(raw_claim(uid="b", dispatch=True, usage={"tokens": "0.0000000001"}), None)
    assert not isinstance(facts, InvalidClaim)
    sim.claims["b"] = facts.__class__(
        **{**facts.__dict__, "uid": "b", "created_at": sim.claims["b"].created_at}
    )
    sim.force("b", "OPS-4: report unreadable").reconcile()
    assert sim.phase("b") is P.RELEASED and sim.entry("b").settlement.reason == "ForceSettled"  # type: ignore[union-attr]


# --- 5. the ledger stays bounded and never wedges -------------------------------------


def test_rejections_never_push_the_ledger_past_its_cap_and_a_valid_claim_still_fits() -> None:
    sim = Sim()
    for i in range(MAX_LEDGER_ENTRIES + 100):
        sim.create(f"bad-{i:04}", {"gpu": "1"})  # UnknownResource: never admissible
    sim.reconcile()
    assert len(sim.status.entries) <= MAX_LEDGER_ENTRIES // 2
    assert sim.last is not None and len(sim.last.off_ledger) > MAX_LEDGER_ENTRIES // 2
    verdicts = [sim.last.entry(f"bad-{i:04}") for i in range(MAX_LEDGER_ENTRIES + 100)]
    assert all(v is not None and v.phase is P.REJECTED for v in verdicts)
    sim.mirror().reconcile()
    assert sim.status.entries == {}, "settled entries compact once their claims carry them"
    sim.create("good").reconcile()
    assert sim.phase("good") is P.TENTATIVE


def test_an_envelope_whose_claims_are_kept_never_fills_up() -> None:
    sim = Sim(capacity={"tokens": "100k"})
    names = [f"c{i:04}" for i in range(MAX_LEDGER_ENTRIES + 50)]
    for start in range(0, len(names), 50):  # in batches the in-flight record admits at once
        batch = names[start : start + 50]
        for name in batch:
            sim.create(name, {"tokens": "10"}, dispatch=True)
        sim.reconcile().write_lines()
        for name in batch:
            sim.usage(name, "1", final=True)
        sim.reconcile().write_lines().mirror()
        for name in batch:
            assert sim.phase(name) is P.CONSUMED, name
    sim.reconcile()
    assert len(sim.status.entries) <= 1
    assert sim.total("committed") == str(MAX_LEDGER_ENTRIES + 50)


def test_a_late_report_after_compaction_is_still_recorded() -> None:
    sim = Sim().create("a").reconcile().cancel("a").reconcile().mirror().reconcile()
    assert "a" not in sim.status.entries
    sim.dispatch("a")  # the API server forbids this after cancel; the core still records it
    sim.reconcile()
    assert sim.last is not None and sim.last.off_ledger["a"].dispatch_fenced
    assert "DispatchRefused" in sim.reasons("a")
    assert "a" not in sim.status.entries, "never re-admitted"


def test_settled_claims_past_their_ttl_are_named_for_deletion() -> None:
    sim = Sim(settledClaimTTLSeconds=30)
    sim.create("a").create("b").reconcile().cancel("a").reconcile().mirror().reconcile()
    assert sim.last is not None and sim.last.expired_claims == []
    assert sim.last.wake_at is not None and sim.last.wake_at <= sim.now + timedelta(seconds=30)
    sim.tick(30).reconcile()
    assert sim.last.expired_claims == ["a"]


# --- 6. an envelope without capacity is refused, not looped on ------------------------


def test_an_envelope_without_capacity_is_unreadable_not_a_crash() -> None:
    body = {
        "metadata": {"name": "e", "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"capacity": None},
    }
    with pytest.raises(UnreadableEnvelopeError, match="capacity"):
        envelope_facts(body)


# --- 7. force-settle decides only what the facts cannot -------------------------------


def test_force_settle_never_overrides_facts_seen_in_the_same_batch() -> None:
    sim = Sim().create("a").reconcile()
    sim.dispatch("a").usage("a", "12").force("a", "OPS-7").reconcile()
    assert sim.phase("a") is P.CONSUMED
    assert sim.entry("a").consumed == {"tokens": 12}, "charged its usage, not released"


# --- 8. a committed claim that vanished keeps its usage and can be settled ------------


def test_a_vanished_committed_claim_keeps_its_usage_and_the_envelope_can_settle_it() -> None:
    sim = Sim(default_lease_seconds=5, at_ambiguity_deadline="Hold", ambiguity_deadline_seconds=5)
    sim.create("a").reconcile().dispatch("a").usage("a", "7").reconcile()
    sim.remove("a").tick(20).reconcile().tick(20).reconcile()
    assert sim.phase("a") is P.DETACHED and sim.entry("a").usage == {"tokens": 7}
    sim.close().reconcile()
    assert sim.status.phase.value == "Closing"
    sim.force_gone("a", "OPS-8: node lost").reconcile()
    assert sim.status.totals.committed == {"tokens": Decimal(7)}
    assert sim.status.phase.value == "Closed"


def test_the_force_settle_gone_annotation_names_claims_one_per_line() -> None:
    text = "claim-a: OPS-1 node lost\n  uid-123 : provider billed 6k\n\nnoreason"
    assert force_settle_gone({"reservoir.dev/force-settle-gone": text}) == {
        "claim-a": "OPS-1 node lost",
        "uid-123": "provider billed 6k",
        "noreason": "settled by envelope annotation",
    }


# --- 10. leases: capped by the envelope, and renewal stops -----------------------------


def test_a_claim_cannot_ask_for_a_longer_lease_than_the_envelope_default() -> None:
    sim = Sim(default_lease_seconds=60).create("a", lease={"duration_seconds": 3600})
    sim.reconcile()
    assert sim.entry("a").expires_at == sim.now + timedelta(seconds=60)
    sim = Sim(default_lease_seconds=60).create("b", lease={"duration_seconds": 10}).reconcile()
    assert sim.entry("b").expires_at == sim.now + timedelta(seconds=10), "shorter is fine"


@pytest.mark.parametrize("why", ["cancel", "close", "holder"])
def test_renewal_stops_for_cancelled_claims_closed_envelopes_and_foreign_holders(
    why: str,
) -> None:
    sim = Sim(default_lease_seconds=30)
    sim.create("a", lease={"holder": "w1"}).reconcile().dispatch("a").reconcile()
    expires = sim.entry("a").expires_at
    # The cancel or close is recorded in a pass before the heartbeat's (one seen with it
    # renews: no record orders the two; test_coalescing's test_a_heartbeat_seen_with_...).
    if why == "cancel":
        sim.cancel("a")
        sim.reconcile()
    elif why == "close":
        sim.close()
        sim.reconcile()
    holder = "w2" if why == "holder" else "w1"
    sim.claims["a"] = sim.claims["a"].__class__(
        **{**sim.claims["a"].__dict__, "heartbeat": "t1", "heartbeat_holder": holder}
    )
    sim.tick(10).reconcile()
    assert sim.entry("a").expires_at == expires and sim.entry("a").renewals == 0
    assert "RenewalRefused" in sim.reasons("a")


def test_the_named_holder_renews() -> None:
    sim = Sim(default_lease_seconds=30).create("a", lease={"holder": "w1"}).reconcile()
    sim.claims["a"] = sim.claims["a"].__class__(
        **{**sim.claims["a"].__dict__, "heartbeat": "t1", "heartbeat_holder": "w1"}
    )
    sim.tick(10).reconcile()
    assert sim.entry("a").renewals == 1


def heartbeat(sim: Sim, name: str, token: str, holder: str) -> None:
    claim = sim.claims[name]
    sim.claims[name] = claim.__class__(
        **{**claim.__dict__, "heartbeat": token, "heartbeat_holder": holder}
    )


def test_the_lease_records_whom_each_generation_was_granted_to() -> None:
    """The fence the API server compares (status.lease): the named holder from the
    reservation, then the holder of each heartbeat granted, a generation a grant."""
    sim = Sim(default_lease_seconds=30).create("named", lease={"holder": "w1"})
    sim.create("unnamed").reconcile()
    assert (sim.entry("named").holder, sim.entry("named").lease_generation) == ("w1", 1)
    assert (sim.entry("unnamed").holder, sim.entry("unnamed").lease_generation) == (None, 1)
    heartbeat(sim, "unnamed", "t1", "w7")
    heartbeat(sim, "named", "t1", "w9")  # not the named holder: refused, nothing moves
    sim.tick(10).reconcile()
    assert (sim.entry("unnamed").holder, sim.entry("unnamed").lease_generation) == ("w7", 2)
    assert (sim.entry("named").holder, sim.entry("named").lease_generation) == ("w1", 1)
    heartbeat(sim, "unnamed", "t2", "w8")  # another worker's heartbeat takes the lease on
    sim.tick(10).reconcile()
    assert (sim.entry("unnamed").holder, sim.entry("unnamed").lease_generation) == ("w8", 3)


def test_a_handover_is_a_new_generation_granted_at_once_even_to_a_detached_claim() -> None:
    """spec.lease.holder names another worker: the lease is handed over on the record (the
    old holder fenced), without waiting for a renewal, which a Detached claim never gets
    (found by review: the new holder could never report)."""
    sim = Sim(default_lease_seconds=5).create("a", lease={"holder": "w1"}).reconcile()
    sim.dispatch("a").reconcile().tick(6).reconcile()
    assert sim.entry("a").phase is P.DETACHED
    sim.update("a", lease={"holder": "w2"}).reconcile()
    entry = sim.entry("a")
    assert (entry.holder, entry.handovers, entry.lease_generation) == ("w2", 1, 2)
    assert "LeaseHandedOver" in sim.reasons("a")
    sim.reconcile()
    assert sim.entry("a").handovers == 1, "once"
    heartbeat(sim, "a", "t1", "w2")
    sim.tick(1).reconcile()
    assert sim.entry("a").renewals == 0, "a Detached claim is not renewed, handed over or not"


def test_a_holder_too_long_to_name_in_a_fence_is_refused_its_renewal() -> None:
    sim = Sim(default_lease_seconds=30).create("a").reconcile()
    heartbeat(sim, "a", "t1", "w" * 254)
    sim.tick(10).reconcile()
    assert sim.entry("a").renewals == 0 and sim.entry("a").holder is None
    assert "RenewalRefused" in sim.reasons("a")


# --- 11. pods that ran count, even when they finished unseen --------------------------


def test_a_pod_that_ran_and_finished_unseen_still_commits_the_claim() -> None:
    finished = pod_facts([{"spec": {"nodeName": "n1"}, "status": {"phase": "Succeeded"}}])
    assert finished is not None and finished.running and finished.scheduled
    failed = pod_facts([{"spec": {}, "status": {"phase": "Failed"}}])
    assert failed is not None and failed.running
    sim = Sim(default_lease_seconds=5).create("a", commit_point="PodRunning").reconcile()
    sim.claims["a"] = sim.claims["a"].__class__(**{**sim.claims["a"].__dict__, "pod": finished})
    sim.tick(6).reconcile()
    assert sim.phase("a") is P.DETACHED, "held: it ran, so never Expired"


def test_a_bound_pod_then_cancel_is_a_cancel_request_not_a_release() -> None:
    sim = Sim().create("a", commit_point="PodScheduled").reconcile()
    sim.pod("a", scheduled=True).cancel("a").reconcile()
    assert sim.phase("a") is P.COMMITTED and sim.entry("a").cancel_requested


def test_a_pod_that_starts_after_settlement_is_recorded_as_a_late_fact() -> None:
    sim = Sim().create("a", commit_point="PodRunning").reconcile().cancel("a").reconcile()
    assert sim.phase("a") is P.RELEASED
    sim.pod("a", scheduled=True, running=True).reconcile()
    assert sim.phase("a") is P.RELEASED
    assert sim.entry("a").pod_started_late
    assert sim.reasons("a").count("PodStartedAfterSettlement") == 1
    sim.reconcile()
    assert sim.reasons("a").count("PodStartedAfterSettlement") == 1, "recorded once"


def test_replaying_a_reconcile_on_its_own_output_changes_nothing() -> None:
    sim = Sim().create("a").create("b").reconcile().dispatch("a").usage("a", "30").reconcile()
    first = sim.status
    again = reconcile(sim.envelope, first, list(sim.claims.values()), sim.now)
    assert again.status == first


def test_a_dispatch_missed_before_the_claim_vanished_settles_like_one_seen() -> None:
    seen = Sim(default_lease_seconds=5).create("a").reconcile().dispatch("a").reconcile()
    missed = Sim(default_lease_seconds=5).create("a").reconcile().dispatch("a")
    for sim in (seen, missed):
        sim.remove("a").reconcile().tick(6).reconcile()
        assert sim.phase("a") is P.DETACHED
        assert (sim.total("reconciling"), sim.available()) == ("20", "80")


def test_the_widest_capacity_the_crd_accepts_still_reconciles() -> None:
    capacity = {f"example.com/{'r' * 50}{i:02}": "1E" for i in range(16)}
    sim = Sim(capacity=capacity).create("a", {next(iter(capacity)): "1"}).reconcile()
    assert sim.phase("a") is P.TENTATIVE
    assert len(sim.status.summary.capacity) <= 1024


def test_a_bound_pod_that_runs_after_the_cancel_settles_as_when_seen_only_at_the_end() -> None:
    """Issue 21 §3.9: a PodRunning claim, its pod bound, the branch cancelled, then the pod
    runs. Seen step by step R was returned at the cancel (available 100) while seen only at
    the end R stayed held (80). A bound pod may still start, so the cancel cannot confirm
    non-execution (child-settlement.txt): it is recorded and R stays held, in both views."""
    step = Sim().create("a", commit_point="PodRunning").reconcile()
    step.pod("a", scheduled=True).reconcile().cancel("a").reconcile()
    assert step.phase("a") is P.TENTATIVE and step.entry("a").cancel_requested
    assert step.available() == "80", "a pod that may still start holds R"
    step.pod("a", scheduled=True, running=True).reconcile()
    last = Sim().create("a", commit_point="PodRunning").reconcile()
    last.pod("a", scheduled=True).cancel("a").pod("a", scheduled=True, running=True).reconcile()
    for sim in (step, last):
        entry = sim.entry("a")
        assert (entry.phase, entry.cancel_requested, sim.available()) == (P.RUNNING, True, "80")
        sim.usage("a", "7", final=True).reconcile()
        assert (sim.phase("a"), sim.available()) == (P.CONSUMED, "93")


def test_a_cancel_waiting_on_a_pod_releases_once_the_pod_is_gone_without_running() -> None:
    sim = Sim().create("a", commit_point="PodScheduled").reconcile()
    sim.pod("a").cancel("a").reconcile()  # created, not bound yet: it may still bind and run
    assert sim.phase("a") is P.TENTATIVE and sim.available() == "80"
    assert sim.reasons("a").count("CancelRequested") == 1
    sim.reconcile()
    assert sim.reasons("a").count("CancelRequested") == 1, "recorded once"
    sim.no_pod("a").reconcile()
    assert (sim.phase("a"), sim.available()) == (P.RELEASED, "100")


def dispatched_and_held_by_its_claim(sim: Sim) -> None:
    """Claim "a" admitted, dispatched, and its line retired from the envelope's record in
    flight: from here, a move of it that changes no totals is its own status write alone."""
    sim.create("a").reconcile().write_lines().tick()
    sim.dispatch("a").reconcile().write_lines().tick()
    sim.reconcile().write_lines().tick()


@pytest.mark.parametrize("ender", ["cancel", "close"])
def test_a_heartbeat_seen_with_the_stop_renews_though_the_claim_write_was_lost(
    ender: str,
) -> None:
    """Found by review: the close was read from the envelope's status, so a crash after the
    envelope's write and before the claim's lost the renewal granted with it, and the next
    pass refused the same heartbeat. The stop is recorded on the claim's own line, in the
    same write as the renewal: lost together, decided again alike."""
    outcomes = []
    for crash in (False, True):
        sim = Sim(default_lease_seconds=30)
        dispatched_and_held_by_its_claim(sim)
        assert "a" not in sim.status.entries  # its line is the claim's alone
        sim.close() if ender == "close" else sim.cancel("a")
        sim.heartbeat("a", "t1").reconcile()  # records the stop, grants the heartbeat
        if not crash:
            sim.write_lines()  # the claim's status write lands
        sim.tick().reconcile().write_lines()
        entry = sim.entry("a")
        assert entry.renewals_stopped_at is not None
        outcomes.append((entry.renewals, "RenewalRefused" in sim.reasons("a")))
    assert outcomes == [(1, False), (1, False)]


def test_a_heartbeat_seen_with_the_close_renews_when_its_line_waits_a_pass() -> None:
    """Found by review: a line left for the next pass (MOVES_PER_PASS moves already in
    this one) was judged against the close recorded a pass earlier, and its heartbeat,
    seen with the close, was refused where an uncrowded pass granted it."""
    sim = Sim(capacity={"tokens": "100000"}, default_lease_seconds=30)
    names = [f"b{i:03d}" for i in range(MOVES_PER_PASS + 44)] + ["z"]
    for name in names:
        sim.create(name, requests={"tokens": "1"})
    for _ in range(12):
        sim.reconcile().write_lines().tick()
    for name in names:
        sim.dispatch(name)
    for _ in range(12):
        sim.reconcile().write_lines().tick()
    for name in names[:-1]:
        sim.usage(name, tokens="1", final=True)
    sim.close().heartbeat("z", "t1").reconcile().write_lines()
    assert "z" in sim.last.postponed  # the crowded pass left z's line for the next
    sim.tick().reconcile().write_lines()
    assert sim.entry("z").renewals == 1 and "RenewalRefused" not in sim.reasons("z")
    sim.tick().heartbeat("z", "t2").reconcile()  # a later heartbeat is refused
    assert sim.entry("z").renewals == 1 and "RenewalRefused" in sim.reasons("z")


def set_state(sim: Sim, state: str) -> None:
    spec = {**sim.envelope.spec.model_dump(), "state": state}
    sim.envelope = replace(sim.envelope, spec=ReservationEnvelopeSpec.model_validate(spec))


def test_a_brief_close_seen_or_not_changes_renewals_by_one_at_most() -> None:
    """Found by review: renewals stopped for good by a close, the envelope opened again a
    second later, lapsed the lease of a holder that kept renewing (Detached) where an
    operator that missed the close renewed it all along. The stop is forgotten once the
    envelope admits work again."""
    outcomes = []
    for saw_close in (True, False):
        sim = Sim(default_lease_seconds=10)
        dispatched_and_held_by_its_claim(sim)
        set_state(sim, "Closed")
        if saw_close:
            sim.reconcile().write_lines()
        sim.tick()
        set_state(sim, "Open")
        for index in range(30):
            sim.heartbeat("a", f"h{index}").reconcile().write_lines().tick()
        entry = sim.entry("a")
        assert entry.renewals_stopped_at is None
        outcomes.append((entry.phase, entry.renewals, sim.total("reserved")))
    assert outcomes[0] == outcomes[1] == (P.COMMITTED, 30, "20")


def test_an_operator_whose_clock_is_behind_grants_no_renewal_after_the_stop() -> None:
    """Found by review: a new leader whose clock was behind the recorded stop granted every
    heartbeat until its clock passed it. Only the pass that recorded the stop grants."""
    sim = Sim(default_lease_seconds=30)
    dispatched_and_held_by_its_claim(sim)
    sim.cancel("a").reconcile().write_lines()
    sim.tick(-3)  # the new leader's clock
    for index in range(3):
        sim.heartbeat("a", f"h{index}").reconcile().write_lines().tick()
    assert sim.entry("a").renewals == 0
    assert sim.reasons("a").count("RenewalRefused") == 3
