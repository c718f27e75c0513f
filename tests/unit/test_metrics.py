"""Pure parts of the metrics: stranded capacity, and observing each moment of a claim once,
by the write that first records it (never again on a rewrite or a re-read)."""

from __future__ import annotations

import itertools
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from prometheus_client import REGISTRY

from reservoir import metrics
from reservoir.core.model import (
    ClaimPhase,
    ContractType,
    LedgerEntry,
    NamespaceUsage,
    ProviderRecord,
    ProviderState,
    ResourceTotals,
    Settlement,
    WindowSlice,
)
from reservoir.core.stranded import stranded

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def entry(phase: ClaimPhase, reserved: str = "20", **fields: object) -> LedgerEntry:
    return LedgerEntry.model_validate(
        {"claim": "x", "phase": phase, "reserved": {"tokens": Decimal(reserved)}, **fields}
    )


def test_stranded_is_detached_capacity_and_everything_held_once_the_envelope_closes() -> None:
    entries = [
        entry(ClaimPhase.TENTATIVE, "10"),
        entry(ClaimPhase.RUNNING, "5"),
        entry(ClaimPhase.DETACHED, "20"),
        entry(ClaimPhase.CONSUMED, "40"),
    ]
    assert stranded(entries, ["tokens", "gpu"], accepting=True) == {
        "gpu": Decimal(0),
        "tokens": Decimal(20),
    }
    assert stranded(entries, ["tokens"], accepting=False) == {"tokens": Decimal(35)}


def sample(name: str, klass: str, **labels: str) -> float:
    value = REGISTRY.get_sample_value(name, {"namespace": "ns", "class": klass, **labels})
    return value or 0.0


def test_each_moment_is_observed_by_the_write_that_first_records_it() -> None:
    klass = "unit-moments"
    created = {"u": T0}
    reserved = entry(ClaimPhase.TENTATIVE, first_reserved_at=T0 + timedelta(seconds=2))
    committed = reserved.model_copy(
        update={
            "phase": ClaimPhase.COMMITTED,
            "committed_at": T0 + timedelta(seconds=5),
            "renewals": 2,
        }
    )
    settled = committed.model_copy(
        update={
            "phase": ClaimPhase.CONSUMED,
            "consumed": {"tokens": Decimal(5)},
            "settlement": Settlement(
                key="k",
                phase=ClaimPhase.CONSUMED,
                reason="Completed",
                at=T0 + timedelta(seconds=12),
            ),
        }
    )
    history = [{}, {"u": reserved}, {"u": committed}, {"u": settled}]
    for before, after in itertools.pairwise(history):
        metrics.observe_written("ns", klass, before, after, created)
        metrics.observe_written("ns", klass, after, after, created)  # a rewrite: nothing new
    assert sample("reservoir_claim_admission_wait_seconds_count", klass) == 1
    assert sample("reservoir_claim_admission_wait_seconds_sum", klass) == 2
    assert sample("reservoir_claim_commit_wait_seconds_sum", klass) == 3
    assert sample("reservoir_claim_hold_seconds_sum", klass) == 10
    assert sample("reservoir_lease_renewals_total", klass, result="granted") == 2
    assert sample("reservoir_claim_consumed_ratio_count", klass, resource="tokens") == 1
    assert sample("reservoir_claim_consumed_ratio_sum", klass, resource="tokens") == 0.25


def test_a_moment_skipped_by_coalescing_is_still_observed_once() -> None:
    """The operator may see a claim only when it is already settled (every intermediate state
    coalesced): its admission, commit and hold are observed by that one write."""
    klass = "unit-coalesced"
    settled = entry(
        ClaimPhase.RELEASED,
        first_reserved_at=T0 + timedelta(seconds=1),
        settlement=Settlement(
            key="k", phase=ClaimPhase.RELEASED, reason="Cancelled", at=T0 + timedelta(seconds=4)
        ),
    )
    metrics.observe_written("ns", klass, {}, {"u": settled}, {"u": T0})
    assert sample("reservoir_claim_admission_wait_seconds_count", klass) == 1
    # Nor how long such a branch holds: a quick cancel is not a short run (review: cancels
    # pulled a class's p99 down and its long reservations set the age alert off).
    assert sample("reservoir_claim_hold_seconds_count", klass) == 0
    # Released claims never ran: they say nothing about how much a branch needs.
    assert sample("reservoir_claim_consumed_ratio_count", klass, resource="tokens") == 0


def test_an_envelopes_gauges_go_with_it() -> None:
    gauges = metrics.EnvelopeGauges()
    snapshot = metrics.EnvelopeSnapshot(
        workflow_class="c",
        totals=ResourceTotals(
            capacity={"tokens": Decimal(100)}, available={"tokens": Decimal(100)}
        ),
        counts={"Tentative": 1},
        stranded={"tokens": Decimal(0)},
        ambiguity_deadline_seconds=600,
    )
    gauges.record("ns", "e", snapshot)
    names = {s.name for family in gauges.collect() for s in family.samples}
    assert "reservoir_envelope_capacity" in names and "reservoir_envelope_ledger_healthy" in names
    gauges.unhealthy("ns", "e")
    health = [s for f in gauges.collect() for s in f.samples if s.name.endswith("ledger_healthy")]
    assert [s.value for s in health] == [0]
    gauges.forget("ns", "e")
    assert all(not family.samples for family in gauges.collect())


# --- bounded cardinality (issue 21) ---------------------------------------------------------


def test_a_counter_stops_growing_label_sets_and_counts_the_rest_as_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tenants choose namespaces: past the cap, a new namespace counts under `_other`
    (the fixed-vocabulary labels, such as the result, are kept)."""
    monkeypatch.setattr(metrics, "MAX_SERIES_PER_METRIC", 3)
    counter = metrics.BoundedCounter("unit_bounded_total", "test", ["namespace", "result"])
    for n in range(10):
        counter.labels(f"tenant-{n}", "written").inc()
    counter.labels("tenant-0", "written").inc()  # a known one stays itself
    counter.labels(namespace="tenant-9", result="refused").inc()
    found = {
        (s.labels["namespace"], s.labels["result"]): s.value
        for family in counter.collect()
        for s in family.samples
        if s.name == "unit_bounded_total"
    }
    assert found == {
        ("tenant-0", "written"): 2,
        ("tenant-1", "written"): 1,
        ("tenant-2", "written"): 1,
        ("_other", "written"): 7,
        ("_other", "refused"): 1,
    }


def snapshot(resources: int = 1, amount: str = "10") -> metrics.EnvelopeSnapshot:
    capacity = {f"r{i:02}": Decimal(amount) for i in range(resources)}
    return metrics.EnvelopeSnapshot(
        workflow_class="c",
        totals=ResourceTotals(capacity=capacity, available=capacity),
        counts={"Tentative": 1},
        stranded={},
        ambiguity_deadline_seconds=60,
    )


def gauge_samples(gauges: metrics.EnvelopeGauges, name: str) -> dict[tuple[str, ...], float]:
    return {
        tuple(s.labels.values()): s.value
        for family in gauges.collect()
        for s in family.samples
        if s.name == name
    }


def test_envelope_gauges_show_the_first_envelopes_and_sum_the_rest_as_other() -> None:
    gauges = metrics.EnvelopeGauges(max_envelopes=2)
    for n in range(5):
        gauges.record("ns", f"e{n}", snapshot())
    capacity = gauge_samples(gauges, "reservoir_envelope_capacity")
    assert {(ns, env) for ns, env, *_ in capacity} == {("ns", "e0"), ("ns", "e1"), ("_other",) * 2}
    assert capacity[("_other", "_other", "r00", "capacity", "Consumable")] == 30  # e2 + e3 + e4
    claims = gauge_samples(gauges, "reservoir_envelope_claims")
    assert claims[("_other", "_other", "Tentative")] == 3
    assert {k[:2] for k in gauge_samples(gauges, "reservoir_envelope_info")} == {
        ("ns", "e0"),
        ("ns", "e1"),
    }
    gauges.forget("ns", "e0")  # its place goes to the next envelope recorded
    gauges.record("ns", "e3", snapshot())
    shown = {k[:2] for k in gauge_samples(gauges, "reservoir_envelope_capacity")}
    assert shown == {("ns", "e1"), ("ns", "e3"), ("_other", "_other")}


def test_an_envelope_with_many_resource_names_shows_the_first_and_sums_the_rest() -> None:
    gauges = metrics.EnvelopeGauges()
    gauges.record("ns", "wide", snapshot(resources=40, amount="1"))
    capacity = {
        k[2]: v
        for k, v in gauge_samples(gauges, "reservoir_envelope_capacity").items()
        if k[3] == "capacity"
    }
    assert len(capacity) == metrics.MAX_RESOURCES_PER_ENVELOPE
    assert capacity["_other"] == 40 - (metrics.MAX_RESOURCES_PER_ENVELOPE - 1)
    assert sum(capacity.values()) == 40


def test_one_namespace_cannot_crowd_the_others_out_of_a_metric(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: the cap was first come, first served, so one tenant with many
    workflow classes pushed every other namespace's new series into `_other`."""
    monkeypatch.setattr(metrics, "MAX_SERIES_PER_METRIC", 10)
    monkeypatch.setattr(metrics, "MAX_SERIES_PER_NAMESPACE", 3)
    counter = metrics.BoundedCounter("unit_shared_total", "test", ["namespace", "class"])
    for n in range(50):
        counter.labels("evil", f"c{n}").inc()
    counter.labels("team-b", "batch").inc()
    found = {
        (s.labels["namespace"], s.labels["class"]): s.value
        for family in counter.collect()
        for s in family.samples
        if s.name == "unit_shared_total"
    }
    assert found[("team-b", "batch")] == 1
    assert found[("evil", "_other")] == 47  # its own share spent, its name kept
    assert sum(1 for ns, _ in found if ns == "evil") == 4


# --- contracts (issue 22) -------------------------------------------------------------------

GPU = "nvidia.com/gpu"


def contracted_snapshot() -> metrics.EnvelopeSnapshot:
    """8 GPUs all held (and a claim waiting for 4 more), 1 of 2 permits held, tokens
    partly spent, and a rate limit of 60 per window with 40 committed in it and 5 held."""
    d = Decimal
    return metrics.EnvelopeSnapshot(
        workflow_class="c",
        totals=ResourceTotals(
            capacity={GPU: d(8), "concurrency": d(2), "tokens": d(1000), "rpm": d(60)},
            reserved={GPU: d(8), "concurrency": d(1), "tokens": d(200), "rpm": d(5)},
            committed={"tokens": d(300), "rpm": d(40)},
            available={GPU: d(0), "concurrency": d(1), "tokens": d(500), "rpm": d(15)},
        ),
        counts={"Running": 2, "Pending": 1},
        stranded={},
        ambiguity_deadline_seconds=60,
        contracts={"rpm": ContractType.REPLENISHING},  # the rest by default
        peak={GPU: d(8), "concurrency": d(2), "rpm": d(58)},
        windows={
            "rpm": [
                WindowSlice(start=T0, returns_at=T0 + timedelta(minutes=1), amount=d(30)),
                WindowSlice(
                    start=T0, returns_at=T0 + timedelta(minutes=1, seconds=5), amount=d(10)
                ),
            ]
        },
        shortfall={GPU: d(4)},
    )


def test_envelope_gauges_say_each_resources_contract_and_its_use() -> None:
    gauges = metrics.EnvelopeGauges()
    gauges.record("ns", "e", contracted_snapshot())
    capacity = gauge_samples(gauges, "reservoir_envelope_capacity")
    assert {(k[2], k[4]) for k in capacity} == {
        (GPU, "Reusable"),
        ("concurrency", "Reusable"),
        ("tokens", "Consumable"),
        ("rpm", "Replenishing"),
    }
    assert capacity[("ns", "e", GPU, "available", "Reusable")] == 0
    # In use: held, plus (Replenishing) committed in the window; nothing for tokens.
    assert gauge_samples(gauges, "reservoir_envelope_in_use") == {
        ("ns", "e", GPU, "Reusable"): 8,
        ("ns", "e", "concurrency", "Reusable"): 1,
        ("ns", "e", "rpm", "Replenishing"): 45,
    }
    assert gauge_samples(gauges, "reservoir_envelope_peak_in_use") == {
        ("ns", "e", GPU, "Reusable"): 8,
        ("ns", "e", "concurrency", "Reusable"): 2,
        ("ns", "e", "rpm", "Replenishing"): 58,
    }
    assert gauge_samples(gauges, "reservoir_envelope_window_committed") == {("ns", "e", "rpm"): 40}
    assert gauge_samples(gauges, "reservoir_envelope_shortfall") == {
        ("ns", "e", GPU, "Reusable"): 4
    }
    gauges.forget("ns", "e")
    assert all(not family.samples for family in gauges.collect())


def test_contract_gauges_of_envelopes_past_the_cap_are_summed_as_other() -> None:
    gauges = metrics.EnvelopeGauges(max_envelopes=1)
    for n in range(3):
        gauges.record("ns", f"e{n}", contracted_snapshot())
    in_use = gauge_samples(gauges, "reservoir_envelope_in_use")
    assert in_use[("ns", "e0", GPU, "Reusable")] == 8
    assert in_use[("_other", "_other", GPU, "Reusable")] == 16
    shortfall = gauge_samples(gauges, "reservoir_envelope_shortfall")
    assert shortfall == {("ns", "e0", GPU, "Reusable"): 4, ("_other", "_other", GPU, "Reusable"): 8}
    # Many resources: the rest is summed as resource _other, contract _other.
    wide = metrics.EnvelopeGauges()
    wide.record("ns", "wide", snapshot(resources=40, amount="1"))
    contracts = {k[2]: k[4] for k in gauge_samples(wide, "reservoir_envelope_capacity")}
    assert contracts["_other"] == "_other" and contracts["r00"] == "Consumable"


def test_occupancy_is_counted_once_and_a_reusable_resource_has_no_consumed_ratio() -> None:
    """Found by issue 22: a Reusable resource's C is 0 whatever the claim did (all of R
    comes back), so its C/R said every GPU claim used nothing."""
    klass = "unit-occupancy"
    assert isinstance(metrics.occupancy, metrics.BoundedCounter)  # the label caps hold
    at = T0 + timedelta(seconds=100)
    running = LedgerEntry.model_validate(
        {
            "claim": "x",
            "phase": ClaimPhase.RUNNING,
            "reserved": {GPU: Decimal(4), "tokens": Decimal(20)},
            "first_reserved_at": T0,
        }
    )
    settled = running.model_copy(
        update={
            "phase": ClaimPhase.CONSUMED,
            "consumed": {GPU: Decimal(0), "tokens": Decimal(5)},
            "settlement": Settlement(key="k", phase=ClaimPhase.CONSUMED, reason="Done", at=at),
        }
    )
    # Its devices confirmed free a write later: occupancy recorded then.
    freed = settled.model_copy(update={"occupancy": {GPU: Decimal(400)}})
    contracts = {GPU: ContractType.REUSABLE, "tokens": ContractType.CONSUMABLE}
    for before, after in itertools.pairwise([{}, {"u": running}, {"u": settled}, {"u": freed}]):
        metrics.observe_written("ns", klass, before, after, {"u": T0}, contracts)
        metrics.observe_written("ns", klass, after, after, {"u": T0}, contracts)
    assert sample("reservoir_claim_occupancy_seconds_total", klass, resource=GPU) == 400
    assert sample("reservoir_claim_occupancy_seconds_total", klass, resource="tokens") == 0
    assert sample("reservoir_claim_consumed_ratio_count", klass, resource="tokens") == 1
    assert sample("reservoir_claim_consumed_ratio_count", klass, resource=GPU) == 0
    # Coalesced: seen only once settled with its occupancy, it is counted once all the same.
    metrics.observe_written("ns", f"{klass}-c", {}, {"u": freed}, {"u": T0}, contracts)
    assert sample("reservoir_claim_occupancy_seconds_total", f"{klass}-c", resource=GPU) == 400


# --- live exposure (issue 25) ---------------------------------------------------------------


def live_snapshot(now: datetime, klass: str = "c") -> metrics.EnvelopeSnapshot:
    """Three open claims (Tentative 10 s old, Running 1 h old, Detached 2 h old) and one
    settled one, which the live gauges leave out."""
    lines = [
        entry(
            ClaimPhase.TENTATIVE,
            "10",
            first_reserved_at=now - timedelta(seconds=10),
            expires_at=now + timedelta(seconds=50),
        ),
        entry(
            ClaimPhase.RUNNING,
            "30",
            first_reserved_at=now - timedelta(hours=1),
            renewed_at=now - timedelta(seconds=40),
            expires_at=now + timedelta(seconds=20),
        ),
        entry(
            ClaimPhase.DETACHED,
            "5",
            first_reserved_at=now - timedelta(hours=2),
            expires_at=now - timedelta(minutes=30),
        ),
        entry(ClaimPhase.CONSUMED, "99", first_reserved_at=now - timedelta(hours=9)),
    ]
    return metrics.EnvelopeSnapshot(
        workflow_class=klass,
        totals=ResourceTotals(),
        counts={},
        stranded={},
        ambiguity_deadline_seconds=60,
        open_claims=metrics.OpenClaim.of(lines),
    )


def test_open_claims_show_what_they_hold_by_phase_their_oldest_and_their_leases() -> None:
    now = datetime.now(UTC)
    gauges = metrics.EnvelopeGauges()
    gauges.record("ns", "e", live_snapshot(now))
    held = gauge_samples(gauges, "reservoir_envelope_claims_reserved")
    assert held == {
        ("ns", "e", "tokens", "Tentative", "Consumable"): 10,
        ("ns", "e", "tokens", "Running", "Consumable"): 30,
        ("ns", "e", "tokens", "Detached", "Consumable"): 5,
    }
    oldest = gauge_samples(gauges, "reservoir_envelope_oldest_reservation_timestamp_seconds")
    assert oldest == {("ns", "e"): (now - timedelta(hours=2)).timestamp()}
    # The least time left is the Running claim's (the Detached one's lease has lapsed).
    (remaining,) = gauge_samples(gauges, "reservoir_envelope_lease_remaining_seconds").values()
    assert 18 < remaining <= 20
    # The stalest grant: the Running claim's renewal 40 s ago (the Tentative one's is 10 s).
    (age,) = gauge_samples(gauges, "reservoir_envelope_lease_age_seconds").values()
    assert 40 <= age < 42
    buckets = {
        s.labels["le"]: s.value
        for family in gauges.collect()
        for s in family.samples
        if s.name == "reservoir_claim_open_age_seconds_bucket"
    }
    assert buckets["30.0"] == 1 and buckets["3600.0"] == 1 and buckets["7200.0"] == 2
    assert buckets["+Inf"] == 3
    assert gauge_samples(gauges, "reservoir_claim_open_age_seconds_gcount") == {("ns", "c"): 3}
    gauges.forget("ns", "e")
    assert all(not family.samples for family in gauges.collect())


def test_live_ages_of_envelopes_past_the_cap_count_as_other() -> None:
    now = datetime.now(UTC)
    gauges = metrics.EnvelopeGauges(max_envelopes=1)
    for n in range(3):
        gauges.record(f"tenant-{n}", "e", live_snapshot(now, klass=f"run-{n}"))
    counts = gauge_samples(gauges, "reservoir_claim_open_age_seconds_gcount")
    assert counts == {("tenant-0", "run-0"): 3, ("_other", "_other"): 6}
    held = gauge_samples(gauges, "reservoir_envelope_claims_reserved")
    assert held[("_other", "_other", "tokens", "Running", "Consumable")] == 60
    oldest = gauge_samples(gauges, "reservoir_envelope_oldest_reservation_timestamp_seconds")
    assert set(oldest) == {("tenant-0", "e")}


def test_released_amounts_renewal_margins_and_cancel_timings_are_observed_once() -> None:
    klass = "unit-live"
    reserved = entry(
        ClaimPhase.COMMITTED,
        first_reserved_at=T0,
        committed_at=T0 + timedelta(seconds=5),
        expires_at=T0 + timedelta(seconds=60),
    )
    renewed = reserved.model_copy(
        update={
            "renewals": 1,
            "renewed_at": T0 + timedelta(seconds=45),
            "expires_at": T0 + timedelta(seconds=105),
        }
    )
    cancelled = renewed.model_copy(
        update={"cancel_requested_at": T0 + timedelta(seconds=65)}  # 60 s after dispatch
    )
    settled = cancelled.model_copy(
        update={
            "phase": ClaimPhase.CONSUMED,
            "consumed": {"tokens": Decimal(8)},
            "released": {"tokens": Decimal(12)},
            "provider": ProviderRecord(state=ProviderState.CANCELLED),
            "work_ended_at": T0 + timedelta(seconds=75),  # confirmed 10 s after the cancel
            "settlement": Settlement(
                key="k",
                phase=ClaimPhase.CONSUMED,
                reason="Cancelled",
                at=T0 + timedelta(seconds=90),
            ),
        }
    )
    history = [{}, {"u": reserved}, {"u": renewed}, {"u": cancelled}, {"u": settled}]
    for before, after in itertools.pairwise(history):
        metrics.observe_written("ns", klass, before, after, {})
        metrics.observe_written("ns", klass, after, after, {})  # a rewrite: nothing new
    assert sample("reservoir_lease_renewal_margin_seconds_count", klass) == 1
    assert sample("reservoir_lease_renewal_margin_seconds_sum", klass) == 15
    assert sample("reservoir_claim_cancel_after_dispatch_seconds_sum", klass) == 60
    assert sample("reservoir_claim_cancel_confirmation_seconds_count", klass) == 1
    assert sample("reservoir_claim_cancel_confirmation_seconds_sum", klass) == 10
    labels = {"resource": "tokens", "reason": "Cancelled"}
    assert sample("reservoir_claim_released_total", klass, **labels) == 12


def test_a_cancel_the_provider_did_not_confirm_has_no_confirmation_latency() -> None:
    klass = "unit-unconfirmed"
    settled = entry(
        ClaimPhase.CONSUMED,
        first_reserved_at=T0,
        committed_at=T0,
        cancel_requested_at=T0 + timedelta(seconds=1),
        released={"tokens": Decimal(3)},
        settlement=Settlement(
            key="k", phase=ClaimPhase.CONSUMED, reason="Completed", at=T0 + timedelta(seconds=9)
        ),
    )
    metrics.observe_written("ns", klass, {}, {"u": settled}, {})
    assert sample("reservoir_claim_cancel_after_dispatch_seconds_count", klass) == 1
    assert sample("reservoir_claim_cancel_confirmation_seconds_count", klass) == 0
    labels = {"resource": "tokens", "reason": "Completed"}
    assert sample("reservoir_claim_released_total", klass, **labels) == 3


def test_pool_gauges_show_totals_and_envelopes_by_namespace_and_go_with_the_pool() -> None:
    gauges = metrics.PoolGauges(max_pools=1)
    shares = {
        "team-a": NamespaceUsage(held={"gpu": Decimal(6)}, share="0.7500", open=2),
        "team-b": NamespaceUsage(waiting=2),
    }
    totals = ResourceTotals(
        capacity={"gpu": Decimal(8)},
        reserved={"gpu": Decimal(6)},
        available={"gpu": Decimal(2)},
    )
    gauges.record("p", metrics.PoolSnapshot.of(totals, shares, preemptions=2))
    past_the_cap = {"team-c": NamespaceUsage(waiting=1, share="0.5000")}
    gauges.record("q", metrics.PoolSnapshot.of(totals, past_the_cap, preemptions=1))
    found = {(s.name, *s.labels.values()): s.value for f in gauges.collect() for s in f.samples}
    assert found[("reservoir_pool_capacity", "p", "gpu", "available")] == 2
    assert found[("reservoir_pool_capacity", "_other", "gpu", "reserved")] == 6
    assert found[("reservoir_pool_envelopes", "p", "team-a", "reserved")] == 2
    assert found[("reservoir_pool_envelopes", "p", "team-b", "pending")] == 2
    assert found[("reservoir_pool_envelopes", "_other", "team-c", "pending")] == 1
    assert ("reservoir_pool_envelopes", "p", "team-b", "reserved") not in found
    assert found[("reservoir_pool_namespace_share", "p", "team-a")] == 0.75
    assert found[("reservoir_pool_namespace_share", "p", "team-b")] == 0
    assert found[("reservoir_pool_preemption_requests", "p")] == 2
    assert found[("reservoir_pool_preemption_requests", "_other")] == 1
    assert not any(
        key[0] == "reservoir_pool_namespace_share" and key[1] == "_other" for key in found
    )
    gauges.forget("p")
    gauges.forget("q")
    assert all(not family.samples for family in gauges.collect())


def test_a_pool_not_written_for_a_while_gives_its_place_back() -> None:
    """Found by review: deleted pools kept their places among the MAX_POOLS shown, and
    every pool made after a hundred had come and gone showed as _other."""
    gauges = metrics.PoolGauges(max_pools=1)
    totals = ResourceTotals(capacity={"gpu": Decimal(8)}, available={"gpu": Decimal(8)})
    gauges.record("gone", metrics.PoolSnapshot.of(totals, {}))
    gauges.stale_after = 0.0
    list(gauges.collect())
    gauges.stale_after = metrics.STALE_AFTER_SECONDS
    gauges.record("new", metrics.PoolSnapshot.of(totals, {}))
    pools = {s.labels["pool"] for f in gauges.collect() for s in f.samples}
    assert pools == {"new"}


def test_one_namespace_takes_at_most_its_share_of_the_envelope_places() -> None:
    gauges = metrics.EnvelopeGauges(max_envelopes=4, max_per_namespace=2)
    for n in range(5):
        gauges.record("busy", f"e{n}", snapshot())
    gauges.record("quiet", "q0", snapshot())
    shown = {k[:2] for k in gauge_samples(gauges, "reservoir_envelope_info")}
    assert shown == {("busy", "e0"), ("busy", "e1"), ("quiet", "q0")}
    gauges.forget("busy", "e0")  # its place goes to the next of its namespace recorded
    gauges.record("busy", "e4", snapshot())
    shown = {k[:2] for k in gauge_samples(gauges, "reservoir_envelope_info")}
    assert shown == {("busy", "e1"), ("busy", "e4"), ("quiet", "q0")}
    gauges.forget("quiet", "q0")  # a namespace that goes leaves nothing behind
    assert all(ns != "quiet" for ns, _ in gauges._shown)


def test_a_cancel_recorded_before_the_commit_is_observed_once_when_the_commit_is() -> None:
    """A cancel asked while a workload pod could still start is recorded on the Tentative
    claim; the pod then runs (the commit). Observed once, at 0 s, by the commit's write;
    its provider confirmation is not a confirmation of a cancel after dispatch."""
    klass = "unit-cancel-first"
    tentative = entry(
        ClaimPhase.TENTATIVE, first_reserved_at=T0, cancel_requested_at=T0 + timedelta(seconds=2)
    )
    committed = tentative.model_copy(
        update={"phase": ClaimPhase.COMMITTED, "committed_at": T0 + timedelta(seconds=5)}
    )
    settled = committed.model_copy(
        update={
            "phase": ClaimPhase.CONSUMED,
            "provider": ProviderRecord(state=ProviderState.CANCELLED),
            "work_ended_at": T0 + timedelta(seconds=8),
            "settlement": Settlement(
                key="k", phase=ClaimPhase.CONSUMED, reason="Cancelled", at=T0 + timedelta(seconds=9)
            ),
        }
    )
    history = [{}, {"u": tentative}, {"u": committed}, {"u": settled}]
    for before, after in itertools.pairwise(history):
        metrics.observe_written("ns", klass, before, after, {})
    assert sample("reservoir_claim_cancel_after_dispatch_seconds_count", klass) == 1
    assert sample("reservoir_claim_cancel_after_dispatch_seconds_sum", klass) == 0
    assert sample("reservoir_claim_cancel_confirmation_seconds_count", klass) == 0


def test_a_tentative_claim_held_past_its_lease_on_purpose_has_no_lease_left_to_show() -> None:
    """The pass left it Tentative past its lease (its workload pod may still start): the
    gauge shows the healthy claims' least time left, not a lapse growing without bound."""
    now = datetime.now(UTC)
    held = entry(
        ClaimPhase.TENTATIVE,
        "1",
        first_reserved_at=now - timedelta(hours=1),
        expires_at=now - timedelta(minutes=50),
    )
    healthy = entry(
        ClaimPhase.TENTATIVE, "1", first_reserved_at=now, expires_at=now + timedelta(seconds=30)
    )
    gauges = metrics.EnvelopeGauges()
    snap = replace(live_snapshot(now), open_claims=metrics.OpenClaim.of([held, healthy], now))
    gauges.record("ns", "e", snap)
    (remaining,) = gauge_samples(gauges, "reservoir_envelope_lease_remaining_seconds").values()
    assert 28 < remaining <= 30
    # Seen by a pass before it lapsed: a lapse not recorded yet, shown below 0.
    snap = replace(snap, open_claims=metrics.OpenClaim.of([held], now - timedelta(hours=1)))
    gauges.record("ns", "e", snap)
    (remaining,) = gauge_samples(gauges, "reservoir_envelope_lease_remaining_seconds").values()
    assert remaining < -2900


def test_a_lapse_the_pass_postponed_is_one_not_recorded_yet() -> None:
    """Past its moves' bound, a pass leaves lapsed Tentative lines for the next one: their
    lapse is not recorded yet, and the gauge says so (below 0)."""
    now = datetime.now(UTC)
    lapsed = entry(
        ClaimPhase.TENTATIVE,
        "1",
        first_reserved_at=now - timedelta(minutes=2),
        expires_at=now - timedelta(seconds=60),
    )
    open_claims = metrics.OpenClaim.of_pass({"u": lapsed}, now, postponed={"u"})
    gauges = metrics.EnvelopeGauges()
    gauges.record("ns", "e", replace(live_snapshot(now), open_claims=open_claims))
    (remaining,) = gauge_samples(gauges, "reservoir_envelope_lease_remaining_seconds").values()
    assert remaining < -59
    decided = metrics.OpenClaim.of_pass({"u": lapsed}, now)
    gauges.record("ns", "e", replace(live_snapshot(now), open_claims=decided))
    assert not gauge_samples(gauges, "reservoir_envelope_lease_remaining_seconds")
