"""Coalescing invariance: the operator settles the same whether it saw every intermediate
state of the facts or only some of them (down to only the last).

Kopf coalesces events, the writer backs off on conflicts, the operator restarts: between
two readings of its clock it may miss any number of intermediate states. Hypothesis
builds random histories of instants; in each, the clock moves, the writer's timer fires
(both runs reconcile at every instant: lease ends and deadlines are seen on time), and then
clients write facts: claims are created, dispatched, cancelled, deleted, report cumulative
usage (overruns too) and final reports, heartbeat their Leases, their workload pods bind
and run, the envelope closes. Only writes the API server accepts are generated (the CRD's
CEL rules and the admission policy in crds/), and the operator's own status writes (the
mirror of settled claims, which lets the ledger compact) happen in both runs.

Run A reconciles after every write; run B only after a random subset of them, always
including the last write of each instant. For every claim that both runs admitted at the
same moment with the same reservation, the ledger must agree at the end of every instant:
same phase, the same charge C and return R − C, the same recorded usage and overrun, the
same commit and cancel-request facts. Admission itself may differ (which waiting claim
fits first depends on what the operator saw), and so may a claim's event history. Within
each run, no recorded fact is ever lost (usage only grows, a commit stays, a settlement
never changes, also across compaction).

The one exception the API server cannot order yet: for a claim whose commit point is its
workload pod, a pod that binds or runs after the branch was pruned is a late fact in one
view and a commit in the other, until the operator gates pod starts (the GPU placement
work). Such histories are not generated; the stateful audit covers their safety.

RESERVOIR_AUDIT_EXAMPLES raises the number of histories (default 200).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reservoir.core.claimstatus import claim_status, settled_record
from reservoir.core.lifecycle import ClaimFacts, PodFacts
from reservoir.core.model import (
    BranchClaimSpec,
    EnvelopePolicy,
    LedgerEntry,
    ReservationEnvelopeSpec,
    ReservationEnvelopeStatus,
)
from reservoir.core.reconcile import EnvelopeFacts, reconcile

T0 = datetime(2026, 1, 1, tzinfo=UTC)
MAX_CLAIMS = 5


@dataclass(frozen=True)
class Write:
    kind: str
    claim: int
    arg: Any = None


@dataclass(frozen=True)
class History:
    envelope: EnvelopeFacts
    instants: list[tuple[int, list[Write]]]


# --- the world the clients write: one shared sequence of fact snapshots ----------------


@dataclass
class World:
    envelope: EnvelopeFacts
    claims: dict[str, ClaimFacts] = field(default_factory=dict)
    pods: dict[str, int] = field(default_factory=dict)  # 1 bound, 2 ran

    def apply(self, write: Write, now: datetime) -> None:
        """Apply one write if the API server would accept it; ignore it otherwise."""
        uid = f"c{write.claim}"
        if write.kind == "close":
            spec = self.envelope.spec.model_copy(update={"state": "Closed"})
            self.envelope = replace(self.envelope, spec=spec)
            return
        if write.kind == "create":
            if uid not in self.claims:
                tokens, gpu, dispatched, priority, commit_point = write.arg
                spec = BranchClaimSpec(
                    envelope="env",
                    requests={"tokens": tokens, "gpu": gpu},
                    dispatch=dispatched and commit_point == "Dispatch",
                    priority=priority,
                    commit_point=commit_point,
                )
                self.claims[uid] = ClaimFacts(uid=uid, name=uid, created_at=now, spec=spec)
            return
        facts = self.claims.get(uid)
        if facts is None:
            return
        spec = facts.spec
        pruned = spec.cancel or facts.deleting
        by_pod = spec.commit_point != "Dispatch"
        # A branch pruned before dispatch never ran (CEL rule, admission policy); for pod
        # commit points the API server cannot tell yet (see the module docstring).
        frozen_execution = spec.final or (pruned and (by_pod or not spec.dispatch))
        if write.kind == "dispatch" and not pruned and not by_pod:
            self._spec(uid, dispatch=True)
        elif write.kind == "cancel":
            self._spec(uid, cancel=True)
        elif write.kind == "delete":
            self.claims[uid] = replace(facts, deleting=True)
        elif write.kind == "usage" and not frozen_execution:
            usage = dict(spec.usage)
            usage["tokens"] = usage.get("tokens", Decimal(0)) + write.arg
            self._spec(uid, usage=usage)
        elif write.kind == "finish" and not spec.final:
            self._spec(uid, final=True, outcome=write.arg)
        elif write.kind == "heartbeat":
            self.claims[uid] = replace(facts, heartbeat=f"hb-{write.arg}", heartbeat_holder="w")
        elif write.kind == "pod" and by_pod and not frozen_execution:
            stage = max(self.pods.get(uid, 0), write.arg)
            self.pods[uid] = stage
            pod = PodFacts(scheduled=True, running=stage >= 2)
            self.claims[uid] = replace(self.claims[uid], pod=pod)

    def _spec(self, uid: str, **changes: Any) -> None:
        facts = self.claims[uid]
        spec = BranchClaimSpec.model_validate({**facts.spec.model_dump(), **changes})
        self.claims[uid] = replace(facts, spec=spec)


def snapshots(history: History) -> list[tuple[datetime, list[tuple[EnvelopeFacts, dict]]]]:
    """Per instant: its time and the world after each of its writes (index 0: before)."""
    world = World(history.envelope)
    now = T0
    result = []
    for tick, writes in history.instants:
        now += timedelta(seconds=tick)
        states = [(world.envelope, dict(world.claims))]
        for write in writes:
            world.apply(write, now)
            states.append((world.envelope, dict(world.claims)))
        result.append((now, states))
    return result


# --- one operator's run ----------------------------------------------------------------


@dataclass
class Run:
    status: ReservationEnvelopeStatus = field(default_factory=ReservationEnvelopeStatus)
    records: dict[str, LedgerEntry] = field(default_factory=dict)  # mirrored to claim status
    last: dict[str, LedgerEntry] = field(default_factory=dict)

    def reconcile(self, envelope: EnvelopeFacts, claims: dict, now: datetime) -> None:
        facts = [replace(f, settled_record=self.records.get(uid)) for uid, f in claims.items()]
        result = reconcile(envelope, self.status, facts, now)
        self.status = result.status
        # The mirror lands: settled claims carry their record in their own status.
        for uid, fact in claims.items():
            entry = result.entry(uid)
            if entry is not None and entry.settlement is not None:
                status = claim_status(entry, None, None, None, now)
                record = settled_record(status, uid, uid, fact.spec.attempt)
                assert record is not None
                self.records[uid] = record
        self.check_nothing_recorded_is_lost()

    def entry(self, uid: str) -> LedgerEntry | None:
        return self.status.entries.get(uid) or self.records.get(uid)

    def check_nothing_recorded_is_lost(self) -> None:
        for uid in {*self.status.entries, *self.records}:
            now = self.entry(uid)
            before = self.last.get(uid)
            assert now is not None
            if before is not None:
                for resource, amount in before.usage.items():
                    assert now.usage.get(resource, Decimal(0)) >= amount, f"{uid} usage went back"
                assert before.committed_at is None or now.committed_at is not None, uid
                assert not before.cancel_requested or now.cancel_requested, uid
                assert before.overrun is None or now.overrun is not None, uid
                if before.settlement is not None:
                    assert now.settlement == before.settlement, f"{uid} settled twice"
                    assert (now.consumed, now.released) == (before.consumed, before.released)
            self.last[uid] = now.model_copy(deep=True)


def settlement_of(entry: LedgerEntry) -> tuple[Any, ...]:
    return (
        entry.phase,
        entry.consumed,
        entry.released,
        entry.usage,
        entry.committed_at is not None,
        entry.cancel_requested,
        entry.settlement.phase if entry.settlement else None,
        (entry.overrun.usage, entry.overrun.excess, entry.overrun.final) if entry.overrun else None,
    )


def compare(a: Run, b: Run) -> int:
    """The settlements of claims both runs admitted alike. Returns how many were compared."""
    compared = 0
    for uid in {*a.status.entries, *a.records}:
        left, right = a.entry(uid), b.entry(uid)
        if left is None or right is None or left.first_reserved_at is None:
            continue
        if (left.first_reserved_at, left.reserved) != (right.first_reserved_at, right.reserved):
            continue  # admitted differently: admission depends on what the operator saw
        assert settlement_of(left) == settlement_of(right), (
            f"{uid}: every step {settlement_of(left)} != coalesced {settlement_of(right)}"
        )
        compared += 1
    return compared


# --- the histories ---------------------------------------------------------------------

claim_ids = st.integers(0, MAX_CLAIMS - 1)
writes = st.one_of(
    st.builds(
        Write,
        st.just("create"),
        claim_ids,
        st.tuples(
            st.integers(0, 60),
            st.integers(0, 2),
            st.booleans(),
            st.integers(0, 2),
            st.sampled_from(["Dispatch", "Dispatch", "PodScheduled", "PodRunning"]),
        ),
    ),
    st.builds(Write, st.sampled_from(["dispatch", "cancel", "delete"]), claim_ids),
    st.builds(Write, st.just("usage"), claim_ids, st.integers(0, 40)),
    st.builds(
        Write, st.just("finish"), claim_ids, st.sampled_from(["Succeeded", "Failed", "Cancelled"])
    ),
    st.builds(Write, st.just("heartbeat"), claim_ids, st.integers(0, 3)),
    st.builds(Write, st.just("pod"), claim_ids, st.integers(1, 2)),
    st.builds(Write, st.just("close"), st.just(0)),
)


@st.composite
def histories(draw: st.DrawFn) -> History:
    lease = draw(st.integers(5, 40))
    policy = EnvelopePolicy(
        default_lease_seconds=lease,
        max_claim_lifetime_seconds=lease * draw(st.integers(1, 4)),
        ambiguity_deadline_seconds=draw(st.integers(5, 60)),
        at_ambiguity_deadline=draw(st.sampled_from(["Hold", "Quarantine", "Release"])),
        max_active_claims=draw(st.one_of(st.none(), st.integers(1, 4))),
        max_tentative_claims=draw(st.one_of(st.none(), st.integers(0, 3))),
        max_renewals=draw(st.one_of(st.none(), st.integers(0, 2))),
        fallback=draw(st.sampled_from(["Wait", "Fail"])),
        max_queue_seconds=draw(st.integers(10, 120)),
    )
    capacity = {"tokens": draw(st.integers(20, 150)), "gpu": draw(st.integers(2, 6))}
    envelope = EnvelopeFacts(
        spec=ReservationEnvelopeSpec(capacity=capacity, policy=policy), created_at=T0
    )
    instants = draw(
        st.lists(
            st.tuples(st.integers(0, 30), st.lists(writes, min_size=1, max_size=7)),
            min_size=1,
            max_size=8,
        )
    )
    return History(envelope, instants)


@settings(
    max_examples=int(os.environ.get("RESERVOIR_AUDIT_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(history=histories(), data=st.data())
def test_settlement_does_not_depend_on_which_intermediate_states_the_operator_saw(
    history: History, data: st.DataObject
) -> None:
    every_step, coalesced = Run(), Run()
    for now, states in snapshots(history):
        envelope, claims = states[0]
        every_step.reconcile(envelope, claims, now)  # the writer's timer fires on time
        coalesced.reconcile(envelope, claims, now)
        last = len(states) - 1
        seen = data.draw(st.sets(st.integers(1, last)), label="coalesced run sees")
        for index in range(1, last + 1):
            envelope, claims = states[index]
            every_step.reconcile(envelope, claims, now)
            if index in seen or index == last:
                coalesced.reconcile(envelope, claims, now)
        compare(every_step, coalesced)
    # Let both settle any follow-up at the same moment, then compare once more.
    every_step.reconcile(envelope, claims, now)
    coalesced.reconcile(envelope, claims, now)
    compare(every_step, coalesced)


def test_the_audit_compares_settlements_when_the_operator_missed_a_dispatch_and_cancel() -> None:
    """The audit itself can fail: the history of the review's first finding, compared."""
    envelope = EnvelopeFacts(
        spec=ReservationEnvelopeSpec(capacity={"tokens": 100, "gpu": 0}), created_at=T0
    )
    history = History(
        envelope,
        [
            (0, [Write("create", 0, (20, 0, False, 0, "Dispatch"))]),
            (1, [Write("dispatch", 0), Write("cancel", 0)]),
        ],
    )
    every_step, coalesced = Run(), Run()
    for now, states in snapshots(history):
        for index, (env, claims) in enumerate(states):
            every_step.reconcile(env, claims, now)
            if index in (0, len(states) - 1):
                coalesced.reconcile(env, claims, now)
    assert compare(every_step, coalesced) == 1
    entry = coalesced.entry("c0")
    assert entry is not None and entry.phase.value == "Committed" and entry.cancel_requested
