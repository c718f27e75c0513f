"""Each resource keeps its own contract (issue 22; lease-renewal.txt: "Capacity
reservations, concurrency permits, and financial holds are different contracts";
branch-claims.txt: "Concurrency slots are typically reusable after a request finishes,
fails, or times out", "Rate-limit capacity depends on the provider's window").

Reusable resources come back in full when a claim ends, whatever its outcome; Consumable
ones settle R − C; Replenishing ones commit C and get it back a window later. Driven
through the pure core, every settlement path, with intermediate states skipped."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from decimal import Decimal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from reservoir.core.childlines import LOST_CHILDREN_PREFIX
from reservoir.core.contracts import resolve, summary
from reservoir.core.model import (
    WINDOW_SLICES,
    ClaimPhase,
    Contract,
    ContractType,
    EnvelopePhase,
    ProviderState,
    WindowSlice,
)
from reservoir.core.provider import ProviderAnswer
from reservoir.core.windows import record_windows, slice_of
from tests.unit.sim import T0, Sim
from tests.unit.tree_sim import POOL, Run, World, lending

GPU = "nvidia.com/gpu"
REPLENISHING = {"requests": {"type": "Replenishing", "windowSeconds": 60}}


def test_undeclared_resources_take_their_default_contract_and_the_status_shows_all() -> None:
    sim = Sim({"tokens": "100", GPU: "8", "concurrency": "2", "cost": "5"}).reconcile()
    assert sim.status.contracts == {
        GPU: ContractType.REUSABLE,
        "concurrency": ContractType.REUSABLE,
        "tokens": ContractType.CONSUMABLE,
        "cost": ContractType.CONSUMABLE,
    }
    assert sim.status.summary.contracts == (
        "concurrency=Reusable cost=Consumable nvidia.com/gpu=Reusable tokens=Consumable"
    )


def test_a_declared_contract_wins_over_the_default() -> None:
    declared = {"memory": Contract(type=ContractType.REUSABLE)}
    contracts = resolve(["memory", "tokens"], declared)
    assert summary(contracts) == "memory=Reusable tokens=Consumable"


def gpu_branch(sim: Sim, name: str) -> Sim:
    """One 8-GPU branch as examples/gpu_branch.py runs it: held, handed off, run, usage
    reported for its GPUs, its pod gone and its allocation freed."""
    sim.create(name, {GPU: "8", "tokens": "10"}).allocate(name).reconcile()
    assert sim.phase(name) is ClaimPhase.TENTATIVE, sim.last and sim.last.pending
    sim.dispatch(name).reconcile()
    sim.usage(name, "4", final=True, gpu="8").tick(30).reconcile()
    assert sim.phase(name) is ClaimPhase.CONSUMED
    sim.deallocate(name).reconcile().mirror().reconcile()
    return sim


def test_an_8_gpu_envelope_runs_8_gpu_branches_one_after_the_other() -> None:
    """Issue 22: after one branch the envelope showed 4 GPUs available for good."""
    sim = Sim({GPU: "8", "tokens": "100"})
    for n in range(3):
        gpu_branch(sim, f"b{n}")
        assert sim.total("available", GPU) == "8"
        assert sim.total("committed", GPU) == "0"
        entry = sim.entry(f"b{n}")
        assert entry.consumed == {"tokens": Decimal(4)}  # tokens settle R − C ...
        assert entry.released[GPU] == 8  # ... the GPUs come back whole
        assert entry.overrun is None
        assert entry.occupancy[GPU] == 8 * 30  # device-seconds, for right-sizing
    assert sim.total("committed") == "12" and sim.available() == "88"
    assert sim.status.peak[GPU] == 8


def test_devices_come_back_only_once_the_scheduler_frees_them() -> None:
    sim = Sim({GPU: "8"}).create("a", {GPU: "8"}).allocate("a").reconcile()
    sim.dispatch("a").reconcile().usage("a", final=True, gpu="8").reconcile()
    assert sim.phase("a") is ClaimPhase.CONSUMED
    assert sim.total("available", GPU) == "0"  # a pod may still run on them
    sim.deallocate("a").reconcile()
    assert sim.total("available", GPU) == "8"


Path = Callable[[Sim, str], None]


def _commit_and_report(sim: Sim, name: str) -> None:
    sim.dispatch(name).usage(name, "7", final=True, concurrency="1").reconcile()


def _cancel_before_commit(sim: Sim, name: str) -> None:
    sim.cancel(name).reconcile()


def _lease_lapses_tentative(sim: Sim, name: str) -> None:
    sim.tick(120).reconcile()


def _detached_then_quarantined(sim: Sim, name: str) -> None:
    sim.dispatch(name).reconcile().tick(120).reconcile().tick(700).reconcile()


def _detached_then_released(sim: Sim, name: str) -> None:
    sim.dispatch(name).usage(name, "3").reconcile().tick(120).reconcile().tick(700).reconcile()


def _detached_held_then_reported(sim: Sim, name: str) -> None:
    sim.dispatch(name).reconcile().tick(120).reconcile().tick(700).reconcile()
    assert sim.entry(name).phase is ClaimPhase.DETACHED  # policy Hold: still reconciling
    sim.usage(name, "9", final=True, concurrency="1").reconcile()


def _force_settled(sim: Sim, name: str) -> None:
    sim.dispatch(name).usage(name, "5").reconcile().force(name, "checked").reconcile()


def _failed_with_retry_window(sim: Sim, name: str) -> None:
    sim.update(name, retry_window_seconds=30)
    sim.dispatch(name).usage(name, "2", final=True, outcome="Failed").reconcile()
    sim.tick(31).reconcile()


def _provider_said_never_started(sim: Sim, name: str) -> None:
    sim.update(name, upstream={"ref": {"name": "job-1"}, "supportsStatus": True})
    sim.dispatch(name).reconcile().tick(120).reconcile()  # lapsed: Detached, outcome unknown
    sim.provider(name, ProviderAnswer(state=ProviderState.NEVER_STARTED)).reconcile()


PATHS: dict[str, Path] = {
    "commit": _commit_and_report,
    "cancel": _cancel_before_commit,
    "expiry": _lease_lapses_tentative,
    "quarantine": _detached_then_quarantined,
    "release": _detached_then_released,
    "hold": _detached_held_then_reported,
    "force-settle": _force_settled,
    "retry-window": _failed_with_retry_window,
    "never-started": _provider_said_never_started,
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_permit_comes_back_in_full_on_every_settlement_path(path: str) -> None:
    """Whatever the outcome, all of a Reusable resource returns; the tokens beside it
    settle by their own contract."""
    action = {"quarantine": "Quarantine", "hold": "Hold"}.get(path, "Release")
    sim = Sim({"concurrency": "2", "tokens": "100"}, at_ambiguity_deadline=action)
    sim.create("a", {"concurrency": "1", "tokens": "20"}).reconcile()
    assert sim.total("available", "concurrency") == "1"
    PATHS[path](sim, "a")
    entry = sim.entry("a")
    assert entry.phase.terminal, entry.phase
    assert entry.consumed.get("concurrency", 0) == 0
    assert entry.released["concurrency"] == 1
    assert sim.total("available", "concurrency") == "2"
    assert sim.total("committed", "concurrency") == "0"
    charged = {
        "quarantine": 20,
        "release": 3,
        "force-settle": 5,
        "commit": 7,
        "retry-window": 2,
        "hold": 9,
    }
    assert entry.consumed.get("tokens", 0) == charged.get(path, 0)


def test_a_concurrency_2_envelope_runs_ten_branches_two_at_a_time() -> None:
    sim = Sim({"concurrency": "2", "tokens": "1000"})
    for n in range(10):
        sim.tick().create(f"b{n}", {"concurrency": "1", "tokens": "10"})
    finished = 0
    while finished < 10:
        sim.reconcile()
        holding = [n for n, e in sim.status.entries.items() if e.phase.holds_capacity]
        assert 1 <= len(holding) <= 2
        for name in holding:
            sim.dispatch(name).usage(name, "3", final=True, concurrency="1")
            finished += 1
        sim.tick().reconcile().mirror()
    sim.reconcile()
    assert all(sim.phase(f"b{n}") is ClaimPhase.CONSUMED for n in range(10))
    assert sim.total("available", "concurrency") == "2"
    assert sim.total("committed") == "30"
    assert sim.status.peak["concurrency"] == 2


def test_usage_above_a_reusable_reservation_is_no_overrun_and_no_charge() -> None:
    sim = Sim({"concurrency": "4", "tokens": "100"}).create("a", {"concurrency": "1"})
    sim.reconcile().dispatch("a").usage("a", final=True, concurrency="3").reconcile()
    entry = sim.entry("a")
    assert entry.overrun is None and entry.consumed == {}
    assert sim.total("available", "concurrency") == "4"


def test_a_late_report_after_quarantine_adjusts_tokens_only() -> None:
    sim = Sim({"concurrency": "2", "tokens": "100"}, at_ambiguity_deadline="Quarantine")
    sim.create("a", {"concurrency": "1", "tokens": "20"}).reconcile()
    sim.dispatch("a").reconcile().tick(120).reconcile().tick(700).reconcile()
    assert sim.total("committed") == "20"
    sim.usage("a", "5", final=True, concurrency="1").reconcile()
    adjustment = sim.entry("a").adjustment
    assert adjustment is not None and adjustment.returned == {"tokens": Decimal(15)}
    assert adjustment.charged == {}
    assert sim.total("committed") == "5" and sim.total("committed", "concurrency") == "0"


# --- Replenishing ------------------------------------------------------------------------


def rate_limited(**policy: object) -> Sim:
    return Sim({"requests": "3", "tokens": "100"}, contracts=REPLENISHING, **policy)


def one_request(sim: Sim, name: str) -> Sim:
    sim.create(name, {"requests": "1", "tokens": "1"}).reconcile()
    if sim.phase(name) is ClaimPhase.PENDING:
        return sim
    return sim.dispatch(name).usage(name, "1", final=True, requests="1").reconcile()


def test_a_replenishing_budget_refuses_past_its_window_and_admits_after_it() -> None:
    sim = rate_limited()
    for n in range(3):
        one_request(sim.tick(), f"r{n}")
        assert sim.phase(f"r{n}") is ClaimPhase.CONSUMED
    assert sim.total("available", "requests") == "0"
    assert sim.total("committed", "requests") == "3"
    slices = sim.status.windows["requests"]
    assert sum(s.amount for s in slices) == 3
    first_return = min(s.returns_at for s in slices)
    one_request(sim.tick(), "r3")
    assert sim.phase("r3") is ClaimPhase.PENDING
    assert sim.last is not None and sim.last.pending["r3"].reason == "InsufficientCapacity"
    when = first_return.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert f"requests is a rate limit: 3 comes back at {when}" in sim.last.pending["r3"].message
    assert sim.last.wake_at is not None and sim.last.wake_at <= first_return
    # Never early: a whole window after the settlements nothing has come back yet ...
    sim.now = first_return - timedelta(microseconds=1)
    sim.reconcile()
    assert sim.phase("r3") is ClaimPhase.PENDING
    # ... and once the slice's window has passed, what it committed is available again.
    sim.now = first_return
    sim.reconcile()
    assert sim.phase("r3") is ClaimPhase.TENTATIVE
    assert sim.total("committed", "tokens") == "3"  # tokens beside it never come back


def test_a_replenishing_consumption_returns_between_one_window_and_one_slice_later() -> None:
    sim = rate_limited()
    one_request(sim, "r0")
    settled = sim.entry("r0").settlement
    assert settled is not None
    (one,) = sim.status.windows["requests"]
    window = timedelta(seconds=60)
    assert settled.at + window <= one.returns_at <= settled.at + window + window / WINDOW_SLICES


@given(st.lists(st.integers(min_value=0, max_value=90), min_size=1, max_size=20))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_committed_is_always_the_sum_of_the_window_and_never_exceeds_the_limit(
    gaps: list[int],
) -> None:
    """Whatever the arrival times, a Replenishing resource's committed total is exactly its
    slices, and no 60-second span ever admits more than the limit."""
    sim = rate_limited()
    admitted_at = []
    for n, gap in enumerate(gaps):
        sim.tick(gap)
        one_request(sim, f"r{n}")
        for m in range(n + 1):  # any that waited may have been admitted now
            name = f"r{m}"
            if sim.phase(name) is ClaimPhase.TENTATIVE:
                sim.dispatch(name).usage(name, "1", final=True, requests="1").reconcile()
        in_window = sum((s.amount for s in sim.status.windows.get("requests", [])), Decimal(0))
        assert sim.status.totals.committed["requests"] == in_window
        admitted_at = [
            e.first_reserved_at for e in sim.status.entries.values() if e.first_reserved_at
        ]
        for start in admitted_at:
            span = [t for t in admitted_at if start <= t < start + timedelta(seconds=60)]
            assert len(span) <= 3


@pytest.mark.parametrize(
    "bad", [{"type": "Replenishing"}, {"type": "Consumable", "windowSeconds": 5}]
)
def test_a_window_belongs_to_a_replenishing_resource_only(bad: dict[str, object]) -> None:
    """The CRD's rule refuses these; the models agree (the SDK builds specs with them).
    (It asserted only what its own inputs were; it now checks that the model refuses.)"""
    has_window = "windowSeconds" in bad
    assert has_window != (bad["type"] == ContractType.REPLENISHING.value)
    with pytest.raises(ValidationError, match="windowSeconds is set for a Replenishing"):
        Contract.model_validate(bad)
    good = {"type": "Replenishing", "windowSeconds": 5}
    assert Contract.model_validate(good).window_seconds == 5


def test_slices_align_on_the_clock_so_every_pass_agrees() -> None:
    sim = Sim()
    start, returns_at = slice_of(sim.now + timedelta(seconds=7), 60)
    assert start == sim.now + timedelta(seconds=5)
    assert returns_at == start + timedelta(seconds=65)


# --- budgets inside budgets ----------------------------------------------------------------


def test_a_child_returns_its_reusable_capacity_in_full_and_settles_tokens_upward() -> None:
    world = World()
    run = Run(world)
    world.create_envelope("planner", {"concurrency": 4, "tokens": 100, "cost": 10})
    world.create_envelope("sub", {"concurrency": 2, "tokens": 60, "cost": 4}, parent="planner")
    run.settle()
    for n in range(2):
        world.create_claim(f"c{n}", "sub", {"concurrency": 1, "tokens": 20, "cost": 1})
    run.settle()
    world.tick()
    for n in range(2):
        world.update_claim(
            f"c{n}",
            dispatch=True,
            usage={"concurrency": 1, "tokens": 15, "cost": 1},
            final=True,
            outcome="Succeeded",
        )
    run.settle()
    world.close("sub")
    run.settle()
    settled = run.of("sub").parent
    assert settled is not None and settled.settled is not None
    assert settled.settled.consumed == {"tokens": 30, "cost": 2}  # nothing of the permits
    planner = run.totals("planner")
    assert planner.available == {"concurrency": 4, "tokens": 70, "cost": 8}
    assert planner.committed["concurrency"] == 0


def test_a_child_keeping_a_resource_under_another_contract_is_never_admitted() -> None:
    world = World()
    run = Run(world)
    world.create_envelope("planner", {"memory": 8, "tokens": 100})  # memory: Consumable
    world.create_envelope(
        "sub",
        {"memory": 2, "tokens": 10},
        parent="planner",
        contracts={"memory": {"type": "Reusable"}},
    )
    run.settle()
    sub = run.of("sub")
    assert sub.phase is EnvelopePhase.PENDING
    assert sub.queue_reason is not None and "ContractMismatch" in sub.queue_reason
    assert run.totals("planner").available == {"memory": 8, "tokens": 100}


def test_a_pool_takes_back_a_closed_envelopes_gpus_and_keeps_its_rate_window() -> None:
    world = World.with_pool(
        {GPU: 8, "requests": 10},
        contracts={"requests": {"type": "Replenishing", "windowSeconds": 60}},
    )
    run = Run(world)
    world.create_envelope(
        "team",
        {GPU: 8, "requests": 10},
        contracts={"requests": {"type": "Replenishing", "windowSeconds": 60}},
    )
    run.settle()
    world.create_claim("c", "team", {"requests": 4})
    run.settle()
    world.update_claim("c", dispatch=True, usage={"requests": 3}, final=True, outcome="Succeeded")
    run.settle()
    assert run.totals("team").committed["requests"] == 3
    world.close("team")
    run.settle()
    pool = run.totals(POOL)
    assert pool.available[GPU] == 8
    # What the envelope still had in its window stays committed in the pool's, a window on.
    assert pool.committed["requests"] == 3 and pool.available["requests"] == 7
    assert sum(s.amount for s in run.pool.windows["requests"]) == 3
    world.tick(60 + 60 // WINDOW_SLICES + 1)
    run.settle()
    assert run.totals(POOL).available["requests"] == 10


# --- one record per contract within a claim ------------------------------------------------

JOB = {"ref": {"name": "job-1"}, "supportsStatus": True}


def detached_job(capacity: dict[str, str], requests: dict[str, str]) -> Sim:
    sim = Sim(capacity, default_lease_seconds=5, ambiguity_deadline_seconds=600)
    sim.create("a", requests, upstream=JOB)
    if any(k == GPU for k in requests):
        sim.allocate("a")
    sim.reconcile().dispatch("a").reconcile().tick(6).reconcile()
    assert sim.phase("a") is ClaimPhase.DETACHED
    return sim


def test_the_permit_returns_when_the_work_ends_while_the_tokens_wait_for_the_usage() -> None:
    sim = detached_job({"concurrency": "2", "tokens": "100"}, {"concurrency": "1", "tokens": "20"})
    assert sim.total("reconciling", "concurrency") == "1"
    sim.provider("a", ProviderAnswer(state=ProviderState.SUCCEEDED)).reconcile()
    entry = sim.entry("a")
    assert entry.phase is ClaimPhase.DETACHED  # no usage: not proof of zero, nothing settles
    assert entry.reusable_returned == {"concurrency": 1}
    assert sim.total("available", "concurrency") == "2"  # the permit is back ...
    assert sim.total("reconciling", "tokens") == "20"  # ... the tokens still wait
    assert sim.reasons("a").count("ReusableReturned") == 1
    sim.provider("a", None).tick().reconcile()
    sim.usage("a", "12", final=True).reconcile()  # the usage, later
    assert sim.phase("a") is ClaimPhase.CONSUMED
    assert sim.total("available", "concurrency") == "2"  # returned once, not twice
    assert sim.total("committed") == "12" and sim.available() == "88"
    assert sim.reasons("a").count("ReusableReturned") == 1


def test_a_detached_claims_gpus_follow_the_scheduler_and_its_tokens_the_provider() -> None:
    sim = detached_job({GPU: "8", "tokens": "100"}, {GPU: "8", "tokens": "20"})
    sim.provider("a", ProviderAnswer(state=ProviderState.FAILED)).reconcile()
    assert sim.last is not None and "a" not in sim.last.device_holds  # let them go
    assert sim.total("available", GPU) == "0"  # not before the scheduler frees them
    sim.deallocate("a").provider("a", None).reconcile()
    assert sim.total("available", GPU) == "8"
    assert sim.entry("a").phase is ClaimPhase.DETACHED
    assert sim.total("reconciling") == "20"
    sim.tick(700).reconcile()  # the ambiguity deadline: the tokens by policy (Quarantine)
    assert sim.phase("a") is ClaimPhase.CONSUMED
    assert sim.total("available", GPU) == "8" and sim.total("committed") == "20"
    assert sim.reasons("a").count("DevicesReleased") == 1


def test_an_answer_contradicted_by_evidence_returns_nothing_early() -> None:
    sim = detached_job({"concurrency": "2", "tokens": "100"}, {"concurrency": "1", "tokens": "20"})
    sim.provider("a", ProviderAnswer(state=ProviderState.RUNNING)).reconcile()
    assert sim.entry("a").reusable_returned == {}
    assert sim.total("available", "concurrency") == "1"


def test_a_loan_of_a_reusable_resource_ends_with_the_borrowers_claim() -> None:
    """Borrowing a Reusable resource is a loan of occupancy: repaid in full once the
    borrower's claim ends, never committed in the lender."""
    world = World()
    run = Run(world)
    world.create_envelope("planner", {"concurrency": 4, "tokens": 100})
    world.create_envelope(
        "lender", {"concurrency": 2, "tokens": 10}, parent="planner", policy=lending({"tokens": 0})
    )
    world.create_envelope("borrower", {"concurrency": 1, "tokens": 10}, parent="planner")
    run.settle()
    world.create_claim("b1", "borrower", {"concurrency": 1, "tokens": 1}, dispatch=True)
    world.tick()
    world.create_claim("b2", "borrower", {"concurrency": 1, "tokens": 1}, dispatch=True)
    run.settle()
    lent = run.of("lender").loans.get(world.uid("borrower"))
    assert lent is not None and lent.amount == {"concurrency": 1}
    b2 = run.claim("b2")
    assert b2 is not None and b2.phase is ClaimPhase.COMMITTED
    world.tick()
    for name in ("b1", "b2"):
        world.update_claim(
            name, usage={"concurrency": 1, "tokens": 1}, final=True, outcome="Succeeded"
        )
    run.settle()
    # Repaid in full (the settled loan's lines are let go once both sides know it).
    assert run.totals("lender").lent.get("concurrency", 0) == 0
    assert run.totals("lender").available["concurrency"] == 2
    assert run.totals("borrower").borrowed.get("concurrency", 0) == 0
    world.close("borrower")
    world.close("lender")
    run.settle()
    assert run.totals("lender").committed["concurrency"] == 0
    assert run.totals("planner").committed == {"concurrency": 0, "tokens": 2}
    assert run.totals("planner").available["concurrency"] == 4


# --- found by review (issue 22), each a history the schema accepts -----------------------


def test_a_failed_attempts_retry_hold_never_keeps_a_permit_returned_early() -> None:
    sim = Sim({"concurrency": "1", "tokens": "100"}, default_lease_seconds=5)
    sim.create("a", {"concurrency": "1", "tokens": "20"}, upstream=JOB, retryWindowSeconds=300)
    sim.reconcile().dispatch("a").reconcile().tick(6).reconcile()
    sim.provider("a", ProviderAnswer(state=ProviderState.FAILED)).reconcile()
    sim.provider("a", None).tick().create("b", {"concurrency": "1", "tokens": "10"}).reconcile()
    assert sim.phase("b") is ClaimPhase.TENTATIVE  # on the permit a's work gave back
    sim.usage("a", "5", final=True, outcome="Failed").tick().reconcile()  # raised before
    retry = sim.entry("a").retry
    assert retry is not None and retry.resources == {"tokens": Decimal(15)}
    assert sim.total("reserved", "concurrency") == "1"  # b's, once


def test_a_late_completion_leaves_a_replenishing_charge_to_its_window() -> None:
    sim = Sim(
        {"requests": "10", "tokens": "100"},
        contracts={"requests": {"type": "Replenishing", "windowSeconds": 60}},
        at_ambiguity_deadline="Quarantine",
    )
    sim.create("a", {"requests": "10", "tokens": "20"}).reconcile()
    sim.dispatch("a").reconcile().tick(120).reconcile().tick(700).reconcile()
    assert sim.total("committed", "requests") == "10"
    sim.tick(200).reconcile()  # the window passes: the 10 requests are back
    sim.usage("a", "5", final=True, requests="2").reconcile()  # the late report (raised)
    adjustment = sim.entry("a").adjustment
    assert adjustment is not None and adjustment.returned == {"tokens": Decimal(15)}
    assert sim.total("committed", "requests") == "0"
    assert sim.total("available", "requests") == "10"


def test_a_refund_then_a_late_completion_never_takes_a_charge_below_zero() -> None:
    sim = Sim({"tokens": "100"}, at_ambiguity_deadline="Quarantine")
    sim.create("a", {"tokens": "20"}).tick().create("b", {"tokens": "30"}).reconcile()
    sim.dispatch("a").dispatch("b").usage("b", "30", final=True).reconcile()
    sim.tick(120).reconcile().tick(700).reconcile()  # a: quarantined, 20 charged
    refund = {"key": "r", "refund": {"tokens": "20"}, "reason": "refunded"}
    sim.update("a", compensations=[refund]).reconcile().reconcile()
    assert sim.total("committed") == "30"  # b's 30 and a's 20 − 20
    sim.usage("a", "5", final=True).reconcile()
    adjustment = sim.entry("a").adjustment
    assert adjustment is not None and adjustment.returned == {}
    assert sim.total("committed") == "30"


def test_a_gone_child_force_settled_gives_its_reusable_capacity_back() -> None:
    world = World()
    run = Run(world)
    world.create_envelope("planner", {"concurrency": 4, GPU: 8, "tokens": 100})
    world.create_envelope("sub", {"concurrency": 2, GPU: 8, "tokens": 60}, parent="planner")
    run.settle()
    run.remove_finalizer_by_hand("sub")
    run.settle()
    # Its line went with it: what it held stays held, as one line a person settles by name.
    (lost,) = [uid for uid in run.of("planner").children if uid.startswith(LOST_CHILDREN_PREFIX)]
    assert run.totals("planner").reserved == {"concurrency": 2, GPU: 8, "tokens": 60}
    world.force_settle_gone("planner", lost)
    run.settle()
    totals = run.totals("planner")
    assert totals.committed == {"concurrency": 0, GPU: 0, "tokens": 60}
    assert totals.available == {"concurrency": 4, GPU: 8, "tokens": 40}


def test_a_clock_that_goes_back_never_returns_a_consumption_early() -> None:
    contracts = {"requests": Contract(type=ContractType.REPLENISHING, window_seconds=60)}
    start = T0 + timedelta(minutes=10)
    committed: dict[str, Decimal] = {"requests": Decimal(0)}
    windows: dict[str, list[WindowSlice]] = {}
    made: list[datetime] = []
    now = start
    for _ in range(16):  # one request per pass, the clock 5 s further back each pass
        committed = {"requests": committed["requests"] + 1}
        windows = record_windows(committed, windows, contracts, now)
        made.append(now)
        now -= timedelta(seconds=5)
    assert len(windows["requests"]) <= WINDOW_SLICES + 1
    # Each request returns no earlier than a window after it was committed: the k-th
    # latest-returning unit belongs to at most the k-th latest commit.
    units = sorted(s.returns_at for s in windows["requests"] for _ in range(int(s.amount)))
    for returns_at, committed_at in zip(units, sorted(made), strict=True):
        assert returns_at >= committed_at + timedelta(seconds=60)


def test_reusable_capacity_a_ledger_committed_before_its_contract_comes_back() -> None:
    """Written before contracts, a ledger had GPUs committed for good (the issue's bug)."""
    sim = Sim({GPU: "8", "tokens": "100"}).reconcile()
    old = sim.status.totals.model_copy(
        update={
            "committed": {GPU: Decimal(4), "tokens": Decimal(3)},
            "available": {GPU: Decimal(4), "tokens": Decimal(97)},
        }
    )
    sim.status = sim.status.model_copy(update={"totals": old})
    sim.tick().reconcile()
    assert sim.total("committed", GPU) == "0" and sim.total("available", GPU) == "8"
    assert sim.total("committed") == "3"
