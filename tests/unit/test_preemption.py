"""Preemption of tentative holds in a pool (reservoir.core.preemption): a class whose
policy is PreemptLowerPriority takes room from lower classes' envelopes that hold nothing
past a commit point, never from work past it; each preempted claim is released once.
Driven through the pure core alone: the pool's pass and its envelopes' passes
(tests/unit/tree_sim.py, whose auditor checks every ledger after every step), including
histories where the operator sees a dispatch in the same pass as the pool's request."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reservoir.core.budgets import ChildFacts
from reservoir.core.fairshare import SharingRules, Waiting
from reservoir.core.lifecycle import PodFacts
from reservoir.core.model import (
    ChildEntry,
    ChildPhase,
    ClaimPhase,
    EnvelopePhase,
    EnvelopePolicy,
    PreemptionOutcome,
    PreemptionPolicy,
    PreemptionRequest,
    ReservationPoolSpec,
)
from reservoir.core.preemption import Blocked, Holder, holders, still_asked, victims
from tests.unit.tree_sim import LONG_LIVED, POOL, Run, World

GPU = "concurrency"  # Reusable by default; devices would need the scheduler
T0 = datetime(2026, 1, 1, tzinfo=UTC)
URGENT: dict[str, Any] = {"value": 100, "preemptionPolicy": "PreemptLowerPriority"}
CLASSES: dict[str, Any] = {
    "batch": {"value": 0},
    "agentic": {"value": 10},
    "urgent": {"value": 100, "preemptionPolicy": "PreemptLowerPriority"},
}


def pool_world(gpus: int = 4, namespaces: tuple[str, ...] = ("a", "b"), **sharing: Any) -> World:
    return World.with_pool({GPU: gpus}, namespaces=namespaces, priorityClasses=CLASSES, **sharing)


def held_by_claims(world: World, run: Run) -> None:
    """a-idle holds one Tentative claim, a-busy one Committed claim; 2 GPUs each."""
    world.create_envelope("a-idle", {GPU: 2}, namespace="a", priority_class="batch")
    world.tick()
    world.create_envelope("a-busy", {GPU: 2}, namespace="a", priority_class="batch")
    run.settle()
    world.create_claim("t1", "a-idle", {GPU: 1})
    world.create_claim("c1", "a-busy", {GPU: 1})
    run.settle()
    world.update_claim("c1", dispatch=True)
    run.settle()
    assert phase(run, "t1") is ClaimPhase.TENTATIVE
    assert phase(run, "c1") is ClaimPhase.COMMITTED


def admitted_in_turn(world: World, run: Run, *envelopes: tuple[str, int, str]) -> None:
    """Namespace a's envelopes (name, slots, class), each admitted in a pass of its own a
    second after the one before: "the most recently admitted" is well defined."""
    for name, slots, klass in envelopes:
        world.create_envelope(name, {GPU: slots}, namespace="a", priority_class=klass)
        run.settle()
        world.tick()


def holding_one_tentative_claim(
    world: World, run: Run, slots: int = 4, policy: EnvelopePolicy = LONG_LIVED
) -> None:
    """a-idle (class batch, namespace a) holds claim t1, Tentative."""
    world.create_envelope(
        "a-idle", {GPU: slots}, namespace="a", priority_class="batch", policy=policy
    )
    run.settle()
    world.create_claim("t1", "a-idle", {GPU: 1})
    run.settle()
    assert phase(run, "t1") is ClaimPhase.TENTATIVE


def phase(run: Run, claim: str) -> ClaimPhase:
    entry = run.claim(claim)
    assert entry is not None
    return entry.phase


def reason(run: Run, claim: str) -> str | None:
    entry = run.claim(claim)
    assert entry is not None
    return entry.settlement.reason if entry.settlement is not None else None


def test_a_high_class_preempts_a_tentative_hold_and_no_committed_one() -> None:
    world = pool_world()
    run = Run(world)
    held_by_claims(world, run)
    world.create_envelope("b-urgent", {GPU: 2}, namespace="b", priority_class="urgent")
    run.settle()
    # The tentative hold gave its room: its claim released once, reason Preempted.
    assert phase(run, "t1") is ClaimPhase.RELEASED
    assert reason(run, "t1") == "Preempted"
    idle = run.of("a-idle")
    assert idle.preemption is not None
    assert idle.preemption.outcome is PreemptionOutcome.PREEMPTED
    assert idle.preemption.preemptor == "b/b-urgent"
    assert idle.phase is EnvelopePhase.CLOSED
    # The committed one was never asked, and goes on.
    assert phase(run, "c1") is ClaimPhase.COMMITTED
    assert run.of("a-busy").preemption is None
    assert run.of("a-busy").phase is EnvelopePhase.OPEN
    # The preemptor holds the room; the request is retired.
    assert run.of("b-urgent").phase is EnvelopePhase.OPEN
    assert run.pool.preemptions == {}
    assert run.pool.totals.reserved[GPU] == 4
    # A claim that arrives late in the preempted envelope is not admitted.
    world.create_claim("t2", "a-idle", {GPU: 1})
    run.settle()
    assert phase(run, "t1") is ClaimPhase.RELEASED
    assert run.claim("t2") is None or phase(run, "t2") is not ClaimPhase.TENTATIVE


def test_no_one_is_preempted_in_vain() -> None:
    """b-urgent needs all 4 GPUs: only a-idle's 2 could be had (a-busy's claim is past its
    commit point), so no one is asked and both go on."""
    world = pool_world()
    run = Run(world)
    held_by_claims(world, run)
    world.create_envelope("b-urgent", {GPU: 4}, namespace="b", priority_class="urgent")
    run.settle()
    assert run.pool.preemptions == {}
    assert phase(run, "t1") is ClaimPhase.TENTATIVE
    assert run.of("a-idle").preemption is None
    assert run.of("b-urgent").phase is EnvelopePhase.PENDING


def test_a_dispatch_seen_with_the_request_refuses_it_and_the_claim_commits() -> None:
    """The pool asks while the claim is Tentative; the worker dispatches before the
    envelope's pass reads the request: the envelope sees both at once, refuses, and the
    claim commits. Nothing is released, and the pool does not ask it again."""
    world = pool_world()
    run = Run(world)
    held_by_claims(world, run)
    world.create_envelope("b-urgent", {GPU: 2}, namespace="b", priority_class="urgent")
    run.reconcile(world.uid("b-urgent"))
    run.reconcile(POOL)
    assert set(run.pool.preemptions) == {world.uid("a-idle")}
    run.reconcile(world.uid("b-urgent"))  # it says why it waits
    assert "which asked 1 envelopes of lower priority classes" in (
        run.of("b-urgent").queue_reason or ""
    )
    world.update_claim("t1", dispatch=True)
    run.reconcile(world.uid("a-idle"))
    idle = run.of("a-idle")
    assert idle.preemption is not None
    assert idle.preemption.outcome is PreemptionOutcome.REFUSED
    assert "t1 is past its commit point" in idle.preemption.message
    assert phase(run, "t1") is ClaimPhase.COMMITTED
    run.settle()
    assert phase(run, "t1") is ClaimPhase.COMMITTED
    assert run.pool.preemptions == {}
    assert run.of("b-urgent").phase is EnvelopePhase.PENDING
    assert run.of("a-idle").phase is EnvelopePhase.OPEN


def test_an_idle_envelope_is_a_tentative_hold_and_the_newest_goes_first() -> None:
    """Envelopes holding no claim at all are the plainest tentative holds: the lowest class
    first, then the most recently admitted; as few as free the room."""
    world = pool_world(gpus=6)
    run = Run(world)
    admitted_in_turn(world, run, ("a-old", 2, "batch"), ("a-new", 2, "batch"))
    admitted_in_turn(world, run, ("a-agentic", 2, "agentic"))
    world.create_envelope("b-urgent", {GPU: 2}, namespace="b", priority_class="urgent")
    run.settle()
    preempted = {
        name for name in ("a-old", "a-new", "a-agentic") if run.of(name).preemption is not None
    }
    assert preempted == {"a-new"}
    assert run.of("a-new").phase is EnvelopePhase.CLOSED
    assert run.of("a-old").phase is EnvelopePhase.OPEN
    assert run.of("b-urgent").phase is EnvelopePhase.OPEN


def test_a_class_that_may_not_preempt_waits_and_so_does_an_equal_one() -> None:
    world = World.with_pool(
        {GPU: 2},
        namespaces=["a", "b"],
        priorityClasses={
            **CLASSES,
            "interactive": {"value": 100},  # higher, but preemptionPolicy Never
        },
    )
    run = Run(world)
    world.create_envelope("a-urgent", {GPU: 2}, namespace="a", priority_class="urgent")
    run.settle()
    world.create_envelope("b-interactive", {GPU: 1}, namespace="b", priority_class="interactive")
    world.create_envelope("b-urgent", {GPU: 1}, namespace="b", priority_class="urgent")
    run.settle()
    assert run.of("a-urgent").preemption is None
    assert run.pool.preemptions == {}
    assert run.of("b-urgent").phase is EnvelopePhase.PENDING


def test_preemption_never_takes_a_namespace_below_its_guarantee() -> None:
    world = pool_world(shares={"a": {"guaranteed": {GPU: 2}}})
    run = Run(world)
    admitted_in_turn(world, run, ("a-0", 2, "batch"), ("a-1", 2, "batch"))
    world.create_envelope("b-urgent", {GPU: 4}, namespace="b", priority_class="urgent")
    run.settle()
    # Only 2 of a's 4 GPUs are beyond its guarantee: 4 cannot be had, no one is asked.
    assert run.pool.preemptions == {}
    assert all(run.of(n).preemption is None for n in ("a-0", "a-1"))
    world.create_envelope("b-small", {GPU: 2}, namespace="b", priority_class="urgent")
    world.close("b-urgent")
    run.settle()
    asked = [n for n in ("a-0", "a-1") if run.of(n).preemption is not None]
    assert asked == ["a-1"]  # the newest; a keeps its guaranteed 2
    assert run.of("b-small").phase is EnvelopePhase.OPEN


def test_the_class_recorded_at_admission_ranks_it_not_one_named_since() -> None:
    world = pool_world()
    run = Run(world)
    world.create_envelope("a-0", {GPU: 4}, namespace="a", priority_class="batch")
    run.settle()
    line = run.line(POOL, "a-0")
    assert line is not None and line.priority_class == "batch"
    assert run.of("a-0").parent is not None and run.of("a-0").parent.priority_class == "batch"
    # The tenant renames its class to the top one after admission: still batch here.
    env = world.envelope("a-0")
    spec = env.spec.model_copy(update={"priority_class_name": "urgent"})
    world.envelopes[env.uid] = type(env)(**{**env.__dict__, "spec": spec})
    world.create_envelope("b-urgent", {GPU: 4}, namespace="b", priority_class="urgent")
    run.settle()
    assert run.of("a-0").preemption is not None
    assert run.of("b-urgent").phase is EnvelopePhase.OPEN


def test_a_closed_pool_asks_no_one() -> None:
    world = pool_world()
    run = Run(world)
    world.create_envelope("a-0", {GPU: 4}, namespace="a", priority_class="batch")
    run.settle()
    world.create_envelope("b-urgent", {GPU: 4}, namespace="b", priority_class="urgent")
    run.reconcile(world.uid("b-urgent"))
    world.update_pool(state="Closed")
    run.settle()
    assert run.pool.preemptions == {}
    assert run.of("a-0").preemption is None


# --- the victims' choice, alone ------------------------------------------------------------


def holder(uid: str, value: int, at: int, gpus: int, namespace: str = "a") -> Holder:
    return Holder(
        uid=uid,
        namespace=namespace,
        name=uid,
        value=value,
        admitted_at=T0 + timedelta(seconds=at),
        returns={GPU: Decimal(gpus)},
        preemptible=True,
        decision=None,
    )


def head(gpus: int) -> Blocked:
    entry = Waiting("u", "b", "u", T0, {GPU: Decimal(gpus)}, "urgent")
    return Blocked(entry, {GPU: Decimal(gpus)})


SPEC = ReservationPoolSpec.model_validate(
    {"capacity": {GPU: 16}, "namespaces": ["a", "b"], "priorityClasses": CLASSES}
)
RULES = SharingRules.of(SPEC)


def test_victims_are_the_lowest_class_then_the_newest_and_no_more_than_needed() -> None:
    found = [
        holder("old-batch", 0, 0, 2),
        holder("new-batch", 0, 5, 2),
        holder("agentic", 10, 9, 4),
        holder("equal", 100, 9, 8),
    ]
    assert [h.uid for h in victims(RULES, head(2), found, {}, set(), T0)] == ["new-batch"]
    assert [h.uid for h in victims(RULES, head(4), found, {}, set(), T0)] == [
        "new-batch",
        "old-batch",
    ]
    # 5 GPUs: both batch ones (4) fall short, the agentic one is needed; then a batch one
    # is dropped again if the rest cover it.
    chosen = {h.uid for h in victims(RULES, head(5), found, {}, set(), T0)}
    assert "agentic" in chosen and "equal" not in chosen
    assert sum(h.returns[GPU] for h in found if h.uid in chosen) >= 5
    assert victims(RULES, head(9), found, {}, set(), T0) == []  # never an equal class


def test_those_asked_already_stay_chosen_before_others_of_the_same_standing() -> None:
    found = [holder("x", 0, 0, 2), holder("y", 0, 5, 2)]
    assert [h.uid for h in victims(RULES, head(2), found, {}, set(), T0)] == ["y"]
    assert [h.uid for h in victims(RULES, head(2), found, {}, {"x"}, T0)] == ["x"]
    assert {h.uid for h in victims(RULES, head(4), found, {}, {"x"}, T0)} == {"x", "y"}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    holders_=st.lists(
        st.tuples(st.integers(0, 120), st.integers(0, 50), st.integers(0, 6), st.booleans()),
        max_size=8,
    ),
    need=st.integers(1, 12),
)
def test_victims_cover_the_need_or_are_none(
    holders_: list[tuple[int, int, int, bool]], need: int
) -> None:
    found = [
        Holder(
            uid=f"h{i}",
            namespace="a",
            name=f"h{i}",
            value=value,
            admitted_at=T0 + timedelta(seconds=at),
            returns={GPU: Decimal(gpus)},
            preemptible=ok,
            decision=None,
        )
        for i, (value, at, gpus, ok) in enumerate(holders_)
    ]
    chosen = victims(RULES, head(need), found, {}, set(), T0)
    assert all(h.preemptible and h.value < 100 for h in chosen)
    if chosen:
        assert sum(h.returns[GPU] for h in chosen) >= need
        # Minimal: without any one of them the need would not be covered.
        for h in chosen:
            assert sum(o.returns[GPU] for o in chosen if o is not h) < need
    else:
        possible = sum(h.returns[GPU] for h in found if h.preemptible and h.value < 100)
        assert possible < need


# --- histories: every claim settled once, none past its commit point preempted -------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    claims=st.lists(st.sampled_from(["hold", "dispatch", "cancel"]), min_size=0, max_size=4),
    dispatch_at=st.integers(0, 6),
    order=st.permutations(range(6)),
)
def test_any_history_settles_each_claim_once_and_preempts_only_tentative_holds(
    claims: list[str], dispatch_at: int, order: list[int]
) -> None:
    """Low-class envelopes with claims in random states; an urgent envelope arrives; the
    objects are reconciled in a random order, and one tentative claim is dispatched at a
    random point of it. The auditor checks every ledger at every step; here: a claim
    released for preemption was never past its commit point, and a claim once committed
    stays committed whatever the preemption."""
    world = pool_world(gpus=4)
    run = Run(world)
    world.create_envelope("a-0", {GPU: 2}, namespace="a", priority_class="batch")
    world.tick()
    world.create_envelope("a-1", {GPU: 2}, namespace="a", priority_class="agentic")
    run.settle()
    for i in range(len(claims)):
        world.create_claim(f"c{i}", f"a-{i % 2}", {GPU: 1})
    run.settle()
    for i, kind in enumerate(claims):
        if kind == "dispatch":
            world.update_claim(f"c{i}", dispatch=True)
        elif kind == "cancel":
            world.update_claim(f"c{i}", cancel=True)
    run.settle()
    committed_before = {
        f"c{i}" for i in range(len(claims)) if phase(run, f"c{i}") is ClaimPhase.COMMITTED
    }
    world.create_envelope("b-urgent", {GPU: 2}, namespace="b", priority_class="urgent")
    targets = [POOL, world.uid("b-urgent"), world.uid("a-0"), world.uid("a-1")]
    late = next(
        (f"c{i}" for i in range(len(claims)) if claims[i] == "hold"), None
    )  # a worker dispatches this one mid-way
    for step, index in enumerate(list(order) * 2):
        if step == dispatch_at and late is not None:
            world.update_claim(late, dispatch=True)
        run.reconcile(targets[index % len(targets)])
    run.settle()
    for i in range(len(claims)):
        name = f"c{i}"
        entry = run.claim(name)
        if entry is None:
            continue
        if name in committed_before or (name == late and entry.committed_at is not None):
            assert entry.phase is not ClaimPhase.RELEASED or reason(run, name) != "Preempted"
        if reason(run, name) == "Preempted":
            assert entry.committed_at is None
    for name in ("a-0", "a-1"):
        decision = run.of(name).preemption
        if decision is not None and decision.outcome is PreemptionOutcome.PREEMPTED:
            assert run.of(name).phase is EnvelopePhase.CLOSED


def test_the_class_policy_reaches_the_rules() -> None:
    assert RULES.classes["urgent"].preemption is PreemptionPolicy.PREEMPT_LOWER_PRIORITY
    assert RULES.classes["batch"].preemption is PreemptionPolicy.NEVER


# --- review regressions (scripts in /work/review48/) ---------------------------------------


def requested(run: Run) -> list[str]:
    return sorted(r.envelope for r in run.pool.preemptions.values())


def asked_for(world: World, run: Run, name: str, slots: int) -> None:
    """`name` (class urgent, namespace b) arrives; the pool's pass asks for room."""
    world.create_envelope(name, {GPU: slots}, namespace="b", priority_class="urgent")
    run.reconcile(world.uid(name))
    run.reconcile(POOL)


def test_requests_are_worked_out_again_for_what_the_preemptor_still_lacks() -> None:
    """b-urgent asks for 8, all four batch envelopes are asked; its tenant lowers it to 2
    before they decide: the pool's next pass keeps only the one it still needs."""
    world = pool_world(gpus=8)
    run = Run(world)
    admitted_in_turn(world, run, *((f"a-{i}", 2, "batch") for i in range(4)))
    asked_for(world, run, "b-urgent", 8)
    assert requested(run) == ["a-0", "a-1", "a-2", "a-3"]
    env = world.envelope("b-urgent")  # a root's capacity may change (the API allows it)
    spec = env.spec.model_copy(update={"capacity": {GPU: Decimal(2)}})
    world.envelopes[env.uid] = type(env)(**{**env.__dict__, "spec": spec})
    world.changes += 1
    run.reconcile(world.uid("b-urgent"))
    run.reconcile(POOL)
    assert len(requested(run)) == 1
    run.settle()
    preempted = [n for n in ("a-0", "a-1", "a-2", "a-3") if run.of(n).preemption is not None]
    assert len(preempted) == 1
    assert run.pool.totals.available.get(GPU, Decimal(0)) == 0


@pytest.mark.parametrize(
    "edit",
    [
        {"state": "Closed"},
        {"priorityClasses": {**CLASSES, "urgent": {"value": 100}}},  # policy back to Never
        {
            "priorityClasses": {
                **CLASSES,
                "urgent": {"value": 0, "preemptionPolicy": "PreemptLowerPriority"},
            }
        },
        {
            "priorityClasses": {
                **CLASSES,
                "urgent": {
                    "value": 100,
                    "namespaces": ["a"],
                    "preemptionPolicy": "PreemptLowerPriority",
                },
            }
        },
    ],
    ids=["pool-closed", "policy-never", "value-lowered", "namespace-not-allowed"],
)
def test_an_envelope_asked_reads_the_request_against_the_pools_rules_as_they_are_now(
    edit: dict[str, Any],
) -> None:
    """The administrator edits the pool after the request; the envelope asked, poked by the
    pool's write, decides before the pool's next pass: it gives nothing away."""
    world = pool_world()
    run = Run(world)
    holding_one_tentative_claim(world, run)
    asked_for(world, run, "b-urgent", 2)
    assert requested(run) == ["a-idle"]
    world.update_pool(**edit)
    run.reconcile(world.uid("a-idle"))
    assert run.of("a-idle").preemption is None
    run.settle()
    assert phase(run, "t1") is ClaimPhase.TENTATIVE
    assert run.of("a-idle").preemption is None
    assert run.pool.preemptions == {}


def test_never_below_a_guarantee_counting_what_a_victim_returns_whole() -> None:
    """a is guaranteed 4 and holds 5 (2 + 3): preempting either would take it below 4 (an
    envelope returns all it holds, not the part above the guarantee)."""
    world = pool_world(gpus=8, namespaces=("a", "b", "c"), shares={"a": {"guaranteed": {GPU: 4}}})
    run = Run(world)
    world.create_envelope("a-0", {GPU: 2}, namespace="a", priority_class="batch")
    world.create_envelope("a-1", {GPU: 3}, namespace="a", priority_class="batch")
    world.create_envelope("c-0", {GPU: 3}, namespace="c", priority_class="batch")
    run.settle()
    asked_for(world, run, "b-urgent", 4)
    assert requested(run) == []
    run.settle()
    assert run.pool.shares["a"].held[GPU] == 5


def test_an_envelope_that_stops_accepting_is_not_waited_for() -> None:
    """Asked, its tenant closes it instead (it keeps its Tentative claim until it settles):
    the pool drops the request and asks another."""
    world = pool_world(gpus=4)
    run = Run(world)
    admitted_in_turn(world, run, ("a-old", 2, "batch"))
    holding_one_tentative_claim(world, run, slots=2)
    asked_for(world, run, "b-urgent", 2)
    assert requested(run) == ["a-idle"]
    world.close("a-idle")
    run.settle()
    assert run.of("a-idle").preemption is None
    assert run.of("a-old").preemption is not None
    assert run.of("b-urgent").phase is EnvelopePhase.OPEN


def test_a_line_without_a_recorded_class_is_never_preempted() -> None:
    """Lines admitted before classes were recorded on them: their class is not known, so
    the pool never picks them, and such an envelope reads no request."""
    line = ChildEntry(
        envelope="old",
        namespace="a",
        phase=ChildPhase.RESERVED,
        reserved={GPU: Decimal(4)},
        reserved_at=T0,
    )
    facts = ChildFacts(
        uid="old", name="old", created_at=T0, capacity={GPU: Decimal(4)}, preemptible=True
    )
    (found,) = holders(RULES, {"old": line}, {"old": facts})
    assert found.value is None
    assert victims(RULES, head(2), [found], {}, set(), T0) == []
    named_none = line.model_copy(update={"priority_class": ""})
    (found,) = holders(RULES, {"old": named_none}, {"old": facts})
    assert found.value == 0
    assert [h.uid for h in victims(RULES, head(2), [found], {}, set(), T0)] == ["old"]
    request = PreemptionRequest(
        envelope="old",
        namespace="a",
        preemptor="b/u",
        preemptor_uid="u",
        priority_class="urgent",
        requested_at=T0,
    )
    assert still_asked(SPEC, request, None) is None
    assert still_asked(SPEC, request, "") == request
    assert still_asked(SPEC, request, "urgent") is None  # not above its own class


def test_an_envelope_that_refused_is_asked_again_later_not_at_once() -> None:
    world = pool_world(gpus=4)
    run = Run(world)
    holding_one_tentative_claim(world, run)
    asked_for(world, run, "b-urgent", 4)
    world.update_claim("t1", dispatch=True)
    run.settle()
    decision = run.of("a-idle").preemption
    assert decision is not None and decision.outcome is PreemptionOutcome.REFUSED
    world.update_claim("t1", usage={GPU: 1}, final=True, outcome="Succeeded")
    run.settle()
    assert phase(run, "t1") is ClaimPhase.CONSUMED
    assert run.pool.preemptions == {}  # not at once
    world.tick(31)
    run.settle()
    decision = run.of("a-idle").preemption
    assert decision is not None and decision.outcome is PreemptionOutcome.PREEMPTED
    assert run.of("b-urgent").phase is EnvelopePhase.OPEN
    assert run.pool_result is not None and run.pool_result.wake_at is None


def test_more_victims_than_a_pool_records_at_once_are_asked_in_turn() -> None:
    world = pool_world(gpus=20)
    run = Run(world)
    for i in range(20):
        world.create_envelope(f"a-{i:02d}", {GPU: 1}, namespace="a", priority_class="batch")
    run.settle()
    asked_for(world, run, "b-urgent", 18)
    assert len(run.pool.preemptions) == 16
    run.settle()
    preempted = [i for i in range(20) if run.of(f"a-{i:02d}").preemption is not None]
    assert len(preempted) == 18
    assert run.of("b-urgent").phase is EnvelopePhase.OPEN


def test_no_one_is_preempted_in_vain_under_another_namespaces_unused_guarantee() -> None:
    """c's guarantee (4, unused) takes the first 4 GPUs freed: b-urgent (2) needs 6 freed,
    and only the two idle envelopes (4) could be had."""
    world = pool_world(gpus=8, namespaces=("a", "b", "c"))
    run = Run(world)
    admitted_in_turn(world, run, *((f"a-{i}", 2, "batch") for i in range(4)))
    for i in (0, 1):  # past their commit point: never preempted
        world.create_claim(f"c{i}", f"a-{i}", {GPU: 1})
        run.settle()
        world.update_claim(f"c{i}", dispatch=True)
        run.settle()
    world.update_pool(shares={"c": {"guaranteed": {GPU: 4}}})
    run.settle()
    asked_for(world, run, "b-urgent", 2)
    assert requested(run) == []
    run.settle()
    assert all(run.of(f"a-{i}").preemption is None for i in range(4))


def test_the_shortfall_is_what_is_left_once_the_pass_admitted_within_guarantees() -> None:
    """In one pass c-urgent (3) is the head, then c-small (1, within c's guarantee) takes
    the one free GPU: the shortfall is 3, not 2, and a-0 (2) alone would be in vain."""
    world = pool_world(gpus=8, namespaces=("a", "b", "c"), shares={"c": {"guaranteed": {GPU: 4}}})
    run = Run(world)
    world.create_envelope("c-0", {GPU: 3}, namespace="c", priority_class="batch")
    run.settle()
    world.create_envelope("a-1", {GPU: 2}, namespace="a", priority_class="batch")
    run.settle()
    world.create_claim("c1", "a-1", {GPU: 1})
    run.settle()
    world.update_claim("c1", dispatch=True)
    run.settle()
    world.tick()
    world.create_envelope("a-0", {GPU: 2}, namespace="a", priority_class="batch")
    run.settle()
    world.create_envelope("c-urgent", {GPU: 3}, namespace="c", priority_class="urgent")
    world.create_envelope("c-small", {GPU: 1}, namespace="c", priority_class="batch")
    run.reconcile(POOL)
    assert requested(run) == []
    run.settle()
    assert run.of("a-0").preemption is None


@pytest.mark.parametrize("lag", [0, 3], ids=["fresh", "pool-read-late"])
def test_a_gated_workload_pod_is_a_branch_sent_whatever_the_operator_saw_first(
    lag: int,
) -> None:
    """The pool asks; the claim's worker creates its workload pod (behind the hand-off
    gate); the envelope's pass: seeing the request with the pod (fresh) or the pod first
    (the pool read one event late: it hands the pod off), the claim is never preempted."""
    world = pool_world(gpus=4)
    run = Run(world)
    holding_one_tentative_claim(world, run)
    asked_for(world, run, "b-urgent", 4)
    assert requested(run) == ["a-idle"]
    pod = PodFacts(gated=True, gated_pod="p1", uids=frozenset({"p1"}), gated_uids=frozenset({"p1"}))
    world.claims["t1"] = replace(world.claims["t1"], pod=pod)
    run.reconcile(world.uid("a-idle"), lag=lag)
    run.settle()
    assert phase(run, "t1") is ClaimPhase.COMMITTED
    assert run.of("b-urgent").phase is EnvelopePhase.PENDING


def test_a_lease_lapsed_by_the_decision_ends_by_the_clock_as_if_seen_first() -> None:
    world = pool_world(gpus=4)
    run = Run(world)
    short_leases = EnvelopePolicy(default_lease_seconds=30, max_claim_lifetime_seconds=10**6)
    holding_one_tentative_claim(world, run, policy=short_leases)
    assert phase(run, "t1") is ClaimPhase.TENTATIVE
    world.create_envelope("b-urgent", {GPU: 4}, namespace="b", priority_class="urgent")
    run.reconcile(world.uid("b-urgent"))
    run.reconcile(POOL)
    world.tick(60)  # the lease lapses before the envelope's pass reads the request
    run.reconcile(world.uid("a-idle"))
    assert reason(run, "t1") == "LeaseExpired"
    run.settle()
    assert run.of("b-urgent").phase is EnvelopePhase.OPEN
