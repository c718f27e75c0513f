"""Fair sharing of a pool between its namespaces (reservoir.core.fairshare): weighted
dominant resource fairness, administrator-defined priority classes, guarantees, caps and a
Closed pool; driven through the pure core alone, the pool's pass and its envelopes' passes
(tests/unit/tree_sim.py, whose auditor checks the ledgers after every step)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reservoir.core.fairshare import (
    FairQueue,
    Share,
    SharingRules,
    Waiting,
    dominant_share,
    standing,
)
from tests.unit.tree_sim import LONG_LIVED, POOL, Run, World

T0 = datetime(2026, 1, 1, tzinfo=UTC)
GPU = "nvidia.com/gpu"


def waiting(namespace: str, n: int, wanted: Mapping[str, Any], at: int = 0) -> Waiting:
    return Waiting(
        uid=f"{namespace}-{n}",
        namespace=namespace,
        name=f"{namespace}-{n}",
        created_at=T0 + timedelta(seconds=at),
        wanted={k: Decimal(v) for k, v in wanted.items()},
    )


def handed_out(queue: FairQueue, available: dict[str, Decimal]) -> list[str]:
    """Admit in the queue's order while each fits (no head-of-line block: the tests here
    are about the order), as the pool's pass does."""
    admitted = []
    while (entry := queue.next()) is not None:
        room = queue.room(entry, available)
        if all(room.get(k, Decimal(0)) >= v for k, v in entry.wanted.items()):
            queue.admitted(entry)
            for k, v in entry.wanted.items():
                available[k] -= v
            admitted.append(entry.namespace)
    return admitted


def test_equal_weights_take_turns_whoever_came_first() -> None:
    # All of a's envelopes are older than b's: age alone would give a everything.
    rules = SharingRules(capacity={GPU: Decimal(6)})
    queue = FairQueue(
        rules,
        {},
        {},
        [waiting("a", i, {GPU: 1}, at=i) for i in range(6)]
        + [waiting("b", i, {GPU: 1}, at=100 + i) for i in range(6)],
    )
    assert handed_out(queue, {GPU: Decimal(6)}) == ["a", "b", "a", "b", "a", "b"]


def test_dominant_resource_fairness_equalises_each_tenants_largest_fraction() -> None:
    """a asks for GPU-heavy bundles (1 GPU, 1k tokens: 1/4 of the GPUs), b for token-heavy
    ones (20k tokens: 1/5 of the tokens). DRF hands out so that the dominant shares stay
    level: at every admission the namespace with the lower one goes."""
    capacity = {GPU: Decimal(4), "tokens": Decimal(100_000)}
    rules = SharingRules(capacity=capacity)
    a = [waiting("a", i, {GPU: 1, "tokens": 1000}, at=i) for i in range(8)]
    b = [waiting("b", i, {"tokens": 20_000}, at=i) for i in range(8)]
    queue = FairQueue(rules, {}, {}, a + b)
    held: dict[str, dict[str, Decimal]] = {"a": {}, "b": {}}
    available = dict(capacity)
    while (entry := queue.next()) is not None:
        if any(available[k] < v for k, v in entry.wanted.items()):
            break
        # The one handed out had the lowest dominant share (ties: the older).
        mine = dominant_share(held[entry.namespace], capacity)
        other = dominant_share(held["b" if entry.namespace == "a" else "a"], capacity)
        assert mine <= other
        queue.admitted(entry)
        for k, v in entry.wanted.items():
            available[k] -= v
            held[entry.namespace][k] = held[entry.namespace].get(k, Decimal(0)) + v
    # a: 4 GPUs = 100 % of GPUs; b: 4 × 20k = 80 % of tokens, when the GPUs ran out.
    assert dominant_share(held["a"], capacity) == 1
    assert dominant_share(held["b"], capacity) == Decimal("0.8")


def test_weights_1_1_2_split_a_saturated_pool_1_1_2() -> None:
    world = World.with_pool(
        {GPU: 8},
        namespaces=["a", "b", "c"],
        shares={"c": {"weight": 2}},
    )
    run = Run(world)
    for i in range(10):
        for namespace in ("c", "a", "b"):  # c's arrive first each round: age alone favours it
            world.create_envelope(f"{namespace}-{i}", {GPU: 1}, namespace=namespace)
        world.tick()
    run.settle()
    shares = run.pool.shares
    assert {ns: shares[ns].held.get(GPU) for ns in "abc"} == {"a": 2, "b": 2, "c": 4}
    assert {ns: shares[ns].share for ns in "abc"} == {"a": "0.2500", "b": "0.2500", "c": "0.2500"}
    assert {ns: (shares[ns].open, shares[ns].waiting) for ns in "abc"} == {
        "a": (2, 8),
        "b": (2, 8),
        "c": (4, 6),
    }
    # The next one to close frees a GPU for the namespace furthest below its share.
    world.close("c-0")
    run.settle()
    world.close("a-0")
    run.settle()
    assert {ns: run.pool.shares[ns].held.get(GPU) for ns in "abc"} == {"a": 2, "b": 2, "c": 4}
    assert run.pool_result is not None
    assert run.pool_result.pending[world.uid("a-9")].reason == "Queued"


def test_a_tenant_cannot_jump_the_pool_with_its_own_priority_number() -> None:
    """`spec.priority` orders only what waits inside an envelope: across a pool's tenants
    only the administrator's classes rank (branch-claims.txt: "priority ordering for
    interactive, batch, and agentic work")."""
    world = World.with_pool(
        {GPU: 1},
        namespaces=["a", "b"],
        priorityClasses={"interactive": {"value": 100, "namespaces": ["b"]}},
    )
    run = Run(world)
    world.create_envelope("holder", {GPU: 1}, namespace="a")
    run.settle()
    world.create_envelope("b-batch", {GPU: 1}, namespace="b")
    world.tick()
    world.create_envelope("a-greedy", {GPU: 1}, namespace="a", priority=1_000_000)
    world.tick()
    world.create_envelope("b-interactive", {GPU: 1}, namespace="b", priority_class="interactive")
    world.tick()
    world.create_envelope("a-sneaky", {GPU: 1}, namespace="a", priority_class="interactive")
    world.create_envelope("a-typo", {GPU: 1}, namespace="a", priority_class="interactve")
    run.settle()
    assert run.pool_result is not None
    order = [world.envelopes[uid].name for uid in run.pool_result.order]
    # The class first; then b (holding nothing) before a (holding the GPU), whatever a's number.
    assert order == ["b-interactive", "b-batch", "a-greedy"]
    pending = run.pool_result.pending
    assert pending[world.uid("a-sneaky")].reason == "PriorityClassNotAllowed"
    assert pending[world.uid("a-typo")].reason == "UnknownPriorityClass"
    assert "may not use priority class 'interactive'" in (run.of("a-sneaky").queue_reason or "")
    assert "defines no priority class 'interactve'" in (run.of("a-typo").queue_reason or "")
    world.close("holder")
    run.settle()
    assert run.of("b-interactive").parent is not None
    assert run.of("b-batch").parent is None


def test_caps_make_a_namespace_wait_without_blocking_the_others() -> None:
    world = World.with_pool(
        {GPU: 8},
        namespaces=["a", "b", "c"],
        maxOpenEnvelopesPerNamespace=3,
        shares={"b": {"maxOpenEnvelopes": 1}},
        maxOpenEnvelopes=6,
    )
    run = Run(world)
    for i in range(4):
        world.create_envelope(f"a-{i}", {GPU: 1}, namespace="a")
        world.create_envelope(f"b-{i}", {GPU: 1}, namespace="b")
        world.tick()
    run.settle()
    assert run.pool.shares["a"].open == 3 and run.pool.shares["b"].open == 1
    assert run.pool_result is not None
    assert run.pool_result.pending[world.uid("a-3")].reason == "NamespaceEnvelopeLimit"
    assert run.pool_result.pending[world.uid("b-1")].reason == "NamespaceEnvelopeLimit"
    world.create_envelope("c-0", {GPU: 1}, namespace="c")
    world.create_envelope("c-1", {GPU: 1}, namespace="c")
    world.create_envelope("c-2", {GPU: 1}, namespace="c")
    run.settle()
    # The pool's cap: six open, though two GPUs are free.
    assert sum(s.open for s in run.pool.shares.values()) == 6
    assert run.pool_result.pending[world.uid("c-2")].reason == "PoolEnvelopeLimit"
    assert run.pool.totals.available == {GPU: 2}


def test_a_namespaces_tentative_claims_are_capped_across_its_envelopes() -> None:
    """branch-claims.txt: "maximum tentative claims per tenant". The pool grants each
    envelope part of its namespace's cap when it admits it (its own maxTentativeClaims,
    else what is left); an envelope finding none left waits without blocking others, and
    what a closed envelope was granted is granted again."""
    world = World.with_pool(
        {"tokens": 100},
        namespaces=["a", "b"],
        maxTentativeClaimsPerNamespace=3,
    )
    run = Run(world)
    two = LONG_LIVED.model_copy(update={"max_tentative_claims": 2})
    world.create_envelope("e1", {"tokens": 10}, namespace="a", policy=two)
    world.tick()
    world.create_envelope("e2", {"tokens": 10}, namespace="a")
    world.tick()
    world.create_envelope("e3", {"tokens": 10}, namespace="a")
    world.create_envelope("other", {"tokens": 10}, namespace="b")
    run.settle()
    granted = {n: (run.of(n).parent.tentative_claims if run.of(n).parent else None) for n in
               ("e1", "e2", "e3", "other")}  # fmt: skip
    assert granted == {"e1": 2, "e2": 1, "e3": None, "other": 3}
    assert run.pool_result is not None
    assert run.pool_result.pending[world.uid("e3")].reason == "TentativeClaimLimit"
    # e2 holds one tentative claim; a second waits; a claim dispatched at once is no hold.
    world.create_claim("t1", "e2", {"tokens": 1})
    world.tick()
    world.create_claim("t2", "e2", {"tokens": 1})
    world.create_claim("d1", "e2", {"tokens": 1}, dispatch=True)
    run.settle()
    assert run.of("e2").totals.reserved == {"tokens": 2}
    pending = run.results[world.uid("e2")].pending
    assert pending["t2"].reason == "MaxTentativeClaims"
    # e1 closes: its grant of 2 goes to e3.
    world.close("e1")
    run.settle()
    record = run.of("e3").parent
    assert record is not None and record.tentative_claims == 2


def test_a_guarantee_is_kept_and_not_blocked_by_a_large_head() -> None:
    world = World.with_pool(
        {GPU: 8},
        namespaces=["a", "b"],
        shares={"a": {"guaranteed": {GPU: 3}}},
    )
    run = Run(world)
    for i in range(8):
        world.create_envelope(f"b-{i}", {GPU: 1}, namespace="b")
    run.settle()
    # b takes all but a's unused guarantee.
    assert run.pool.totals.reserved == {GPU: 5}
    assert run.pool_result is not None
    assert run.pool_result.pending[world.uid("b-5")].reason == "InsufficientCapacity"
    # A large envelope of b blocks the head of the queue; a's guaranteed part is its own.
    world.close("b-0")
    world.create_envelope("b-large", {GPU: 4}, namespace="b")
    world.tick()
    world.create_envelope("a-0", {GPU: 2}, namespace="a")
    world.create_envelope("a-1", {GPU: 1}, namespace="a")
    run.settle()
    assert run.of("a-0").parent is not None and run.of("a-1").parent is not None
    assert run.pool.shares["a"].held == {GPU: 3}
    # Beyond its guarantee a queues like everyone else.
    world.create_envelope("a-2", {GPU: 1}, namespace="a")
    run.settle()
    assert run.of("a-2").parent is None
    fit = next(c for c in run.pool.conditions if c.type == "GuaranteesFit")
    assert (fit.status, fit.reason) == ("True", "Fit")


def test_guarantees_beyond_the_capacity_are_said_and_the_ledger_holds() -> None:
    world = World.with_pool(
        {GPU: 4},
        namespaces=["a", "b", "c"],
        shares={"a": {"guaranteed": {GPU: 3}}, "b": {"guaranteed": {GPU: 3}}},
    )
    run = Run(world)
    for ns in "cab":
        for i in range(4):
            world.create_envelope(f"{ns}-{i}", {GPU: 1}, namespace=ns)
    run.settle()
    fit = next(c for c in run.pool.conditions if c.type == "GuaranteesFit")
    assert (fit.status, fit.reason) == ("False", "ExceedCapacity")
    assert "more than the capacity of nvidia.com/gpu" in fit.message
    # Each kept at 3 × 4/6 = 2: the pool is used whole, c (guaranteed nothing) waits while
    # a and b want what is kept for them, and nothing goes past the capacity.
    held = {ns: run.pool.shares[ns].held.get(GPU, 0) for ns in run.pool.shares}
    assert held == {"a": 2, "b": 2, "c": 0}


def test_a_closed_pool_freezes_admissions_and_keeps_everything_else() -> None:
    world = World.with_pool({"tokens": 100}, namespaces=["a"])
    run = Run(world)
    world.create_envelope("open", {"tokens": 40}, namespace="a")
    run.settle()
    world.update_pool(state="Closed")
    world.create_envelope("frozen", {"tokens": 10}, namespace="a")
    run.settle()
    assert run.of("frozen").parent is None
    assert "the pool is Closed" in (run.of("frozen").queue_reason or "")
    ready = next(c for c in run.pool.conditions if c.type == "Ready")
    assert (ready.status, ready.reason) == ("False", "Closed")
    # What it holds goes on and comes back as usual.
    world.create_claim("work", "open", {"tokens": 30}, dispatch=True)
    run.settle()
    world.update_claim("work", usage={"tokens": 30}, final=True, outcome="Succeeded")
    world.close("open")
    run.settle()
    assert run.pool.totals.committed == {"tokens": 30}
    assert run.pool.totals.available == {"tokens": 70}
    world.update_pool(state="Open")
    run.settle()
    assert run.of("frozen").parent is not None


# --- properties -------------------------------------------------------------------------

WEIGHTS = {"a": 1, "b": 1, "c": 2}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arrivals=st.lists(st.sampled_from(sorted(WEIGHTS)), min_size=1, max_size=40),
    held=st.fixed_dictionaries({ns: st.integers(0, 6) for ns in WEIGHTS}),
)
def test_each_admission_goes_to_the_lowest_weighted_share(
    arrivals: list[str], held: dict[str, int]
) -> None:
    """Whatever the arrival order and the holdings to start from, every envelope handed out
    belongs to a namespace whose weighted share was the lowest among those still waiting
    (an auditor's arithmetic, not the queue's)."""
    capacity = {GPU: Decimal(20)}
    rules = SharingRules(
        capacity=capacity, shares={ns: Share(weight=w) for ns, w in WEIGHTS.items()}
    )
    entries = [waiting(ns, i, {GPU: 1}, at=i) for i, ns in enumerate(arrivals)]
    queue = FairQueue(rules, {ns: {GPU: Decimal(n)} for ns, n in held.items()}, dict(held), entries)
    counts = {ns: Decimal(n) for ns, n in held.items()}
    left = Counter(arrivals)
    while (entry := queue.next()) is not None:
        share = {ns: counts[ns] / 20 / WEIGHTS[ns] for ns in WEIGHTS}
        assert share[entry.namespace] == min(share[ns] for ns in WEIGHTS if left[ns])
        assert share[entry.namespace] == standing(
            rules, entry.namespace, {GPU: counts[entry.namespace]}, 0, 0
        )
        queue.admitted(entry)
        counts[entry.namespace] += 1
        left[entry.namespace] -= 1
    assert queue.order and [e.uid for e in queue.order] != []
    assert Counter(e.namespace for e in queue.order) == Counter(arrivals)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), sizes=st.lists(st.integers(1, 3), min_size=3, max_size=3))
def test_under_saturation_shares_converge_and_no_one_starves(seed: int, sizes: list[int]) -> None:
    """Three namespaces, weights 1, 1, 2, each keeping envelopes waiting in a random order
    (each namespace's of its own size, 1 to 3 GPUs), every envelope closing a random few
    seconds after it opens. Over the run each holds its weighted share of the pool's GPUs
    within a tenth of the pool; once arrivals stop, every envelope is admitted (no one
    starves, the large ones included); the auditor checks every ledger after every pass."""
    rng = random.Random(seed)
    size = dict(zip(sorted(WEIGHTS), sizes, strict=True))
    world = World.with_pool(
        {GPU: 12},
        namespaces=sorted(WEIGHTS),
        shares={ns: {"weight": w} for ns, w in WEIGHTS.items()},
    )
    run = Run(world)
    made = Counter[str]()
    opened_at: dict[str, datetime] = {}
    lifetime: dict[str, int] = {}
    samples = Counter[str]()
    for step in range(170):
        arriving = step < 140
        for ns in sorted(WEIGHTS, key=lambda _: rng.random()):
            waiting_now = run.pool.shares.get(ns)
            if arriving and (waiting_now is None or waiting_now.waiting < 3):
                name = f"{ns}-{made[ns]}"
                made[ns] += 1
                world.create_envelope(name, {GPU: size[ns]}, namespace=ns)
                lifetime[name] = rng.randint(2, 6)
        run.reconcile(POOL)
        for uid, envelope in list(run.live().items()):
            run.reconcile(uid)
            status = run.status(uid)
            if status.parent is not None and envelope.name not in opened_at:
                opened_at[envelope.name] = world.now
            opened = opened_at.get(envelope.name)
            if (
                opened is not None
                and not envelope.deleting
                and world.now >= opened + timedelta(seconds=lifetime[envelope.name])
            ):
                world.delete(envelope.name)  # closes it; it goes once settled
        if 20 <= step < 140:  # saturated: everyone waits, the pool is full
            for ns, usage in run.pool.shares.items():
                samples[ns] += int(usage.held.get(GPU, 0))
        world.tick()
    run.settle()
    assert set(opened_at) == {e.name for e in world.envelopes.values()}, "someone starved"
    total = sum(samples.values())
    for ns, weight in WEIGHTS.items():
        expected = Decimal(weight) / sum(WEIGHTS.values())
        assert abs(Decimal(samples[ns]) / total - expected) <= Decimal("0.1"), (ns, samples)


# --- found by review: what must not hold the queue up, or tilt it -------------------------


def test_an_envelope_that_can_never_fit_holds_no_one_up() -> None:
    """Behind another namespace's guarantee (8 GPUs, 3 kept for b: a's 6 can never fit), or
    past what is spent for good (50 of 100 tokens consumed: 60 never fit again), the head
    of the queue waits, says why, and lets the others by."""
    world = World.with_pool(
        {GPU: 8}, namespaces=["a", "b", "c"], shares={"b": {"guaranteed": {GPU: 3}}}
    )
    run = Run(world)
    world.create_envelope("a-large", {GPU: 6}, namespace="a")
    world.tick()
    for i in range(4):
        world.create_envelope(f"c-{i}", {GPU: 1}, namespace="c")
    run.settle()
    assert run.pool_result is not None
    assert run.pool_result.pending[world.uid("a-large")].reason == "LargerThanAttainable"
    assert "more than the pool can ever have free" in (run.of("a-large").queue_reason or "")
    assert run.pool.shares["c"].open == 4

    world = World.with_pool({"tokens": 100}, namespaces=["a", "b"])
    run = Run(world)
    world.create_envelope("spender", {"tokens": 50}, namespace="b")
    run.settle()
    world.create_claim("spend", "spender", {"tokens": 50}, dispatch=True)
    run.settle()
    world.update_claim("spend", usage={"tokens": 50}, final=True, outcome="Succeeded")
    world.close("spender")
    run.settle()
    world.create_envelope("b-1", {"tokens": 20}, namespace="b")
    world.tick()
    world.create_envelope("a-huge", {"tokens": 60}, namespace="a")  # a holds nothing: first
    run.settle()
    assert run.of("b-1").parent is not None
    assert run.pool_result is not None
    assert run.pool_result.pending[world.uid("a-huge")].reason == "LargerThanAttainable"


def test_guarantees_of_consumable_resources_are_not_kept_and_said() -> None:
    """A guarantee measured by what a namespace holds let it spend the pool dry past older
    envelopes; measured by what is left it locked everyone out once spent: only a Reusable
    resource's guarantee is kept."""
    world = World.with_pool(
        {"tokens": 100},
        namespaces=["a", "b"],
        shares={"a": {"guaranteed": {"tokens": 30}}, "b": {"guaranteed": {"tokens": 50}}},
    )
    run = Run(world)
    world.create_envelope("b-big", {"tokens": 90}, namespace="b")
    world.tick()
    world.create_envelope("a-0", {"tokens": 30}, namespace="a")
    run.settle()
    fit = next(c for c in run.pool.conditions if c.type == "GuaranteesFit")
    assert (fit.status, fit.reason) == ("False", "NotReusable")
    assert "guarantees of tokens are not kept" in fit.message
    # b's older envelope is admitted first; a's waits behind it, its "guarantee" no bypass.
    assert run.of("b-big").parent is not None
    assert run.of("a-0").parent is None


def test_the_pools_cap_on_open_envelopes_counts_in_the_share() -> None:
    """Envelopes that draw none of the pool's resources still take its open slots: a
    namespace's standing counts them (else it kept share 0 and took every freed slot)."""
    world = World.with_pool({GPU: 8}, namespaces=["a", "b"], maxOpenEnvelopes=4)
    run = Run(world)
    world.create_envelope("a-0", {"cost": 1}, namespace="a")
    world.create_envelope("a-1", {"cost": 1}, namespace="a")
    world.create_envelope("b-0", {GPU: 1}, namespace="b")
    run.settle()
    assert run.pool.shares["a"].share == "0.5000" and run.pool.shares["b"].share == "0.2500"
    world.tick()
    world.create_envelope("a-2", {"cost": 1}, namespace="a")  # older
    world.tick()
    world.create_envelope("b-1", {GPU: 1}, namespace="b")
    run.settle()
    assert run.of("b-1").parent is not None
    assert run.pool_result is not None
    assert run.pool_result.pending[world.uid("a-2")].reason == "PoolEnvelopeLimit"
    assert "the pool holds its most open envelopes (4)" in (run.of("a-2").queue_reason or "")


def test_a_line_lost_with_its_children_belongs_to_no_namespace_in_the_shares() -> None:
    world = World.with_pool({GPU: 4}, namespaces=["a", "b"])
    run = Run(world)
    world.create_envelope("a-0", {GPU: 1}, namespace="a")
    world.create_envelope("b-0", {GPU: 1}, namespace="b")
    run.settle()
    world.delete("a-0")
    run.remove_finalizer_by_hand("a-0")
    run.settle()
    assert set(run.pool.shares) == {"b"}
    assert run.pool.totals.reserved == {GPU: 2}  # what a-0 held stays held, as lost
