"""Coalescing invariance: the operator settles the same whether it saw every intermediate
state of the facts or only some of them (down to only the last).

Kopf coalesces events, the writer backs off on conflicts, the operator restarts: between
two readings of its clock it may miss any number of intermediate states. Hypothesis
builds random histories of instants; in each, the clock moves, the writer's timer fires
(both runs reconcile at every instant: lease ends and deadlines are seen on time), and then
clients write facts: claims are created, dispatched, cancelled, deleted, report cumulative
usage (overruns too) and final reports (a failed attempt may keep what it did not use for
a next attempt: retryWindowSeconds), heartbeat their Leases, their workload pods bind and
run, the envelope closes (once closed, it holds nothing and releases capacity − committed).
Only writes the API server accepts are generated (the CRD's CEL rules and the admission
policy in crds/), and the operator's own status writes (the mirror of settled claims, which
lets the ledger compact) happen in both runs.

Run A reconciles after every write; run B only after a random subset of them, always
including the last write of each instant. For every claim that both runs admitted at the
same moment with the same reservation, the ledger must agree at the end of every instant:
same phase, the same charge C and return R − C, the same recorded usage and overrun, the
same commit and cancel-request facts. Admission itself may differ (which waiting claim
fits first depends on what the operator saw), and so may a claim's event history. Within
each run, no recorded fact is ever lost (usage only grows, a commit stays, a settlement
never changes, also across compaction).

Pod commit points (issue 21 §3.9): a workload pod that exists when the branch is pruned
(cancelled or deleted) may still bind and run after the prune, and its worker report
usage: the API server cannot stop it, so these histories are generated. One exception
remains that the API server cannot order: a pod first created after the prune (the late
dispatch child-settlement.txt leaves to the orchestrator's fence), which is a late fact in
one view and a commit in the other until the operator gates the pods of every pod commit
point (today it gates only device claims' pods). Such histories are not generated; the
stateful audit covers their safety.

Against the world's own truth, each run also checks that a branch that never ran is never
charged: never dispatched, no usage reported, no workload pod ever past its gate (a pod
that vanished counts as maybe run: the operator cannot tell). Issue 21 §3.5 broke this: a
recorded hand-off whose gate lift failed was Quarantined at the deadline.

Device claims (DESIGN.md §7): the envelope has `nvidia.com/gpu` capacity, claims may ask
for whole GPUs, and the policy holds them from admission (physicalHold Tentative) or once
the branch is chosen (Commit). The cluster's ResourceClaims and workload pods are facts both
runs see, but the operator creates, deletes and un-gates them, and the two runs are two
operators: a fact that follows from an operator's action is generated only when it would
follow in both runs' worlds.
- The scheduler allocates (or reports it cannot place) a claim's ResourceClaim only while
  both runs' latest reconciliation asks to hold its devices (`device_holds`): the
  ResourceClaim exists only then in both worlds. It may mark an allocation held by a pod of
  ours later, and an allocation that is there does not move to other devices.
- A preemption or node loss takes an allocation away at any time (the ResourceClaim stays,
  unallocated; a workload pod bound on it goes too). The operator's deletion of a
  ResourceClaim lands only once neither run asks to hold it and no bound pod uses it.
- A client may create a claim's workload pod at any time; for a device claim it is gated
  (the SDK adds the hand-off gate). Only the operator lifts the gate, after recording the
  hand-off: the pod binds and runs only once both runs recorded the hand-off for this very
  pod, and only on an allocated ResourceClaim. It may vanish at any time. The writer's
  lift may fail for a while (a refused patch, or a restart between the ledger write and
  the lift: `lift_fails` until `lift_works`); until both runs lifted it the pod shows gated.
The hand-off itself is an operator decision like admission, taken on a fact (a gated pod)
that need not last and changing the world (the gate lifts): claims handed off differently
(one run saw the gated pod before a cancel or its disappearance, the other did not) are
not compared. Nor are claims whose devices one run recorded and the other did not: under
Commit a chosen claim records its allocation when it sees it held, and a preemption may
take it before the other run looked (under Tentative the same makes admission differ).
For the rest, the device record must agree too: devices released or not, and whether the
operator still asks to hold them and hands them off.

Provider answers (issue 21): a claim with the Dispatch commit point names its upstream
Job (`upstream.ref`, supportsCancel; the envelope forwards cancels by suspension). Before
each pass each run does what the operator's writer does, with the writer's own code
(LedgerWriter._consult_provider) on an API that holds the world's Jobs: it forwards a
cancel once and looks the Job up. The Job starts once the branch is dispatched; the Job
controller suspends it once both runs forwarded the cancel (a fact that follows from an
operator's action); anyone may resume it; it finishes Complete or Failed with the usage
annotation or without it (above R too), and the annotation may come later. What the work
used is one truth: fixed by the Job's finish or the worker's final report, whichever comes
first, and the other says the same. Each instant ends with the writer's follow-up pass in
both runs (a lookup or a cancel to forward that the last pass asked for, made at once).
For claims with a Job, Committed and Running compare as one phase (a Job seen running,
then suspended or finished, moves a Committed claim to Running in the run that saw it: no
capacity moves), and amounts compare without zero entries ({} and {"tokens": 0} are the
same charge). A second test draws histories around the Jobs (few claims, no devices);
both would have found defects 1 and 2 of issue 21, as the two explicit histories show.

RESERVOIR_AUDIT_EXAMPLES raises the number of histories (default 200).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import httpx2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightkube import ApiError
from lightkube.models.meta_v1 import Status

from reservoir.core.claimstatus import claim_status, settled_record
from reservoir.core.devices import DeviceFacts, device_counts
from reservoir.core.lifecycle import ClaimFacts, PodFacts
from reservoir.core.model import (
    BranchClaimSpec,
    ClaimPhase,
    ContractType,
    EnvelopePolicy,
    EnvelopeState,
    LedgerEntry,
    ReservationEnvelopeSpec,
    ReservationEnvelopeStatus,
)
from reservoir.core.quiet import QuietClaims
from reservoir.core.reconcile import EnvelopeFacts, Reconciliation, reconcile
from reservoir.k8s.ledger_writer import LedgerWriter
from reservoir.k8s.providers import USAGE_ANNOTATION, ProviderClient
from tests.unit.quiet_check import passing_quiet_by

T0 = datetime(2026, 1, 1, tzinfo=UTC)
MAX_CLAIMS = 5
NO_HTTP = httpx2.AsyncClient()  # the audit's providers are Jobs: no HTTP call is made
GPU = "nvidia.com/gpu"


@dataclass(frozen=True)
class Write:
    kind: str
    claim: int
    arg: Any = None


@dataclass(frozen=True)
class History:
    envelope: EnvelopeFacts
    instants: list[tuple[int, list[Write]]]
    # Then, now and then: every claim's final report (each its outcome) and the envelope's
    # close, in one instant, the close first or last (a failed attempt that keeps its hold
    # for a next attempt as its envelope closes: issue 21 #6).
    ending: tuple[bool, tuple[str, ...]] | None = None


# --- one operator's run ----------------------------------------------------------------


@dataclass
class Run:
    status: ReservationEnvelopeStatus = field(default_factory=ReservationEnvelopeStatus)
    records: dict[str, LedgerEntry] = field(default_factory=dict)  # mirrored to claim status
    last: dict[str, LedgerEntry] = field(default_factory=dict)
    result: Reconciliation | None = None
    handed: dict[str, datetime] = field(default_factory=dict)  # uid -> recorded hand-off
    # uid -> the pod its first hand-off went to: a pod re-created within the same second is
    # another hand-off, which the time alone does not tell apart
    handed_to: dict[str, str | None] = field(default_factory=dict)
    lifted: set[tuple[str, int]] = field(default_factory=set)  # (uid, pod) gates it lifted
    suspended: set[str] = field(default_factory=set)  # uids whose Job it suspended (a cancel)
    runner: asyncio.Runner | None = None  # runs its writer's provider calls
    writer: LedgerWriter | None = None
    quiet: QuietClaims | None = None  # settled claims its last pass found quiet

    def reconcile(self, world: World, now: datetime) -> None:
        claims = world.claims
        facts = [replace(f, settled_record=self.records.get(uid)) for uid, f in claims.items()]
        facts = self.consult_providers(world, facts, now)
        result = passing_quiet_by(
            lambda quiet: reconcile(
                world.envelope, self.status, facts, now, dict(world.devices), quiet=quiet
            ),
            self.quiet,
        )
        self.status, self.result, self.quiet = result.status, result, result.quiet
        # The mirror lands: settled claims carry their record in their own status.
        for uid, fact in claims.items():
            entry = result.entry(uid)
            if entry is not None and entry.settlement is not None:
                status = claim_status(entry, None, None, None, now)
                record = settled_record(status, uid, uid, fact.spec.attempt)
                assert record is not None
                self.records[uid] = record
        # The hand-off is durable now: the writer lifts the gate of the claim's gated
        # workload pod, unless the lift fails (or the operator restarts before it).
        for uid in result.handed_off:
            if world.pods.get(uid) == 0 and uid not in world.lift_failing:
                self.lifted.add((uid, world.pod_made[uid]))
        self.check_nothing_recorded_is_lost()
        self.check_what_never_ran_is_never_charged(world)
        self.check_nothing_held_once_closed()
        self.check_each_contract(world)

    def check_each_contract(self, world: World) -> None:
        """Issue 22: a Reusable resource is never committed and a settled claim never
        charges one; a Replenishing resource's committed total is exactly its window."""
        totals, contracts = self.status.totals, self.status.contracts
        for name, contract in contracts.items():
            committed = totals.committed.get(name, Decimal(0))
            if contract is ContractType.REUSABLE:
                assert committed == 0, f"{name} committed {committed}"
                for uid in {*self.status.entries, *self.records}:
                    entry = self.entry(uid)
                    assert entry is not None and not entry.consumed.get(name), f"{uid} {name}"
            if contract is ContractType.REPLENISHING:
                slices = self.status.windows.get(name, [])
                assert committed == sum((s.amount for s in slices), Decimal(0)), slices

    def check_what_never_ran_is_never_charged(self, world: World) -> None:
        """Against the world's own truth: a branch that was never dispatched, reported no
        usage and whose workload pods never left their gate (never bound) did not run, so
        its settlement charges nothing (a deadline decision included: the operator, as
        gatekeeper, knows the pod never started)."""
        for uid in {*self.status.entries, *self.records}:
            entry = self.entry(uid)
            if entry is None or entry.settlement is None or uid in world.may_have_run:
                continue
            charged = {k: v for k, v in entry.consumed.items() if v > 0}
            assert not charged, f"{uid} never ran but was charged {charged}"

    def consult_providers(
        self, world: World, facts: list[ClaimFacts], now: datetime
    ) -> list[ClaimFacts]:
        """What the operator's writer does for each claim before a pass, with its own code
        (LedgerWriter._consult_provider) on an API that holds the world's Jobs: forward a
        cancel once (a suspension, recorded for this run), and look the Job up."""
        if self.runner is None:
            return facts
        if self.writer is None:
            api: Any = JobsApi(world, self)
            self.writer = LedgerWriter(api, lambda *_: None, providers=ProviderClient(api, NO_HTTP))
        writer = self.writer
        writer.clock = lambda: now
        policy = world.envelope.spec.policy

        async def ask(f: ClaimFacts) -> ClaimFacts:
            call = writer._provider_call(f, self.status, policy)
            return f if call is None else await writer._consult_provider("ns", f, policy, call)

        async def consult() -> list[ClaimFacts]:
            return [await ask(f) if f.spec.upstream.ref is not None else f for f in facts]

        return self.runner.run(consult())

    def holds(self, uid: str) -> bool:
        return self.result is not None and uid in self.result.device_holds

    def entry(self, uid: str) -> LedgerEntry | None:
        return self.status.entries.get(uid) or self.records.get(uid)

    def check_nothing_held_once_closed(self) -> None:
        """An envelope that recorded its close holds nothing any more, a failed attempt's
        hold for a next attempt included (none can come): its balance is the capacity less
        what was committed (issue 21 #6: a hold made as it closed was released as used)."""
        status = self.status
        if status.closed_at is None:
            return
        totals = status.totals
        for part in (totals.reserved, totals.reconciling):
            held = {k: v for k, v in part.items() if v}
            assert not held, f"closed holding {held}"
        expected = {k: v - totals.committed.get(k, Decimal(0)) for k, v in totals.capacity.items()}
        released = {k: status.balance_released.get(k, Decimal(0)) for k in expected}
        assert released == expected, f"closed releasing {released}, not {expected}"

    def check_nothing_recorded_is_lost(self) -> None:
        for uid in {*self.status.entries, *self.records}:
            now = self.entry(uid)
            before = self.last.get(uid)
            assert now is not None
            handed = self.status.entries[uid].handed_off_at if uid in self.status.entries else None
            if before is not None:
                for resource, amount in before.usage.items():
                    assert now.usage.get(resource, Decimal(0)) >= amount, f"{uid} usage went back"
                assert before.committed_at is None or now.committed_at is not None, uid
                assert not before.cancel_requested or now.cancel_requested, uid
                assert before.overrun is None or now.overrun is not None, uid
                if before.settlement is not None:
                    assert now.settlement == before.settlement, f"{uid} settled twice"
                    assert (now.consumed, now.released) == (before.consumed, before.released)
                if before.devices is not None:
                    assert now.devices is not None, f"{uid} forgot its devices"
                    assert not before.devices.released or now.devices.released, uid
                if uid in self.handed and uid in self.status.entries:
                    assert handed == self.handed[uid], f"{uid} forgot its hand-off"
            if handed is not None:
                self.handed.setdefault(uid, handed)
                self.handed_to.setdefault(uid, self.status.entries[uid].handed_off_to)
            self.last[uid] = now.model_copy(deep=True)


# --- the claims' Jobs (provider answers) -------------------------------------------------


@dataclass(frozen=True)
class Job:
    """A claim's upstream Job as the Job controller keeps it: running, suspended (no pod
    left) or finished (Complete or Failed), with the usage annotation or without it."""

    phase: str  # "running", "suspended", "finished"
    condition: str | None = None  # "Complete" or "Failed" once finished
    usage: Decimal | None = None  # the reservoir.dev/usage annotation's tokens, if set

    def read(self, name: str) -> dict[str, Any]:
        """The Job as the API server returns it (what the provider adapter reads)."""
        annotations = {}
        if self.usage is not None:
            annotations[USAGE_ANNOTATION] = json.dumps({"tokens": str(self.usage)})
        status: dict[str, Any] = {}
        if self.phase == "running":
            status = {"active": 1, "startTime": "2026-01-01T00:00:00Z"}
        elif self.phase == "suspended":
            status = {"conditions": [{"type": "Suspended", "status": "True"}]}
        elif self.condition is not None:
            status = {"conditions": [{"type": self.condition, "status": "True"}]}
        return {
            "kind": "Job",
            "metadata": {"name": name, "namespace": "ns", "annotations": annotations},
            "spec": {"suspend": self.phase == "suspended"},
            "status": status,
        }


class JobsApi:
    """The API server as one run's writer sees it: the world's Jobs (named job-<claim>). A
    suspension it asks for is recorded for the run; the Job controller acts on it only
    once both runs asked (a fact that follows from an operator's action)."""

    def __init__(self, world: World, run: Run) -> None:
        self.world, self.run = world, run

    def _job(self, name: str) -> dict[str, Any]:
        job = self.world.jobs.get(name.removeprefix("job-"))
        if job is None:
            raise ApiError(status=Status(code=404, reason="NotFound", message="not found"))
        return job.read(name)

    async def get(self, res: Any, name: str, *, namespace: str | None = None) -> Any:
        return self._job(name)

    async def patch(self, res: Any, name: str, patch: Any, **kwargs: Any) -> Any:
        assert patch == {"spec": {"suspend": True}}, patch
        found = self._job(name)
        self.run.suspended.add(name.removeprefix("job-"))
        return found

    async def delete(self, res: Any, name: str, **kwargs: Any) -> None:
        raise AssertionError("the audit's envelopes forward cancels by suspension")


# --- the world the clients, the scheduler and the kubelet write ------------------------


@dataclass
class World:
    envelope: EnvelopeFacts
    claims: dict[str, ClaimFacts] = field(default_factory=dict)
    pods: dict[str, int] = field(default_factory=dict)  # 0 gated (device claims), 1 bound, 2 ran
    pod_made: dict[str, int] = field(default_factory=dict)  # uid -> which pod (a counter)
    devices: dict[str, DeviceFacts] = field(default_factory=dict)  # uid -> its ResourceClaim
    gone: set[str] = field(default_factory=set)  # workload pods gone, not yet seen by run B
    lift_failing: set[str] = field(default_factory=set)  # claims whose gate lifts fail now
    ungated: set[tuple[str, int]] = field(default_factory=set)  # (uid, pod): gate lifted
    # Claims pruned while a workload pod that may still bind or start existed: that pod
    # may still run (and its worker report usage); the API server cannot stop it.
    pod_at_prune: set[str] = field(default_factory=set)
    # The truth as far as facts can ever show it: claims dispatched, with usage reported,
    # or with a workload pod past its gate; or whose pod went (lifted and run unseen, for
    # all the operator can tell).
    may_have_run: set[str] = field(default_factory=set)
    replace_unseen: bool = True  # a pod may be re-created before the operator saw it gone
    jobs: dict[str, Job] = field(default_factory=dict)  # uid -> its upstream Job
    # What a claim's work used, once known: fixed by its Job finishing or by the worker's
    # final report, whichever comes first; the other then says the same (one truth).
    used: dict[str, Decimal] = field(default_factory=dict)
    suspensions: set[str] = field(default_factory=set)  # Jobs suspended for a cancel
    # Heartbeats written so far: a Lease's renewTime never repeats, so neither does a token
    # (the audit once wrote hb-2, hb-0, hb-2: an A-B-A no Lease can show).
    beats: int = 0

    def apply(self, write: Write, now: datetime, runs: tuple[Run, Run]) -> None:
        """Apply one write if the API server would accept it and it can follow in both
        runs' worlds (the module docstring); ignore it otherwise."""
        self._suspend_jobs(runs)
        uid = f"c{write.claim}"
        if write.kind in ("allocate", "lose", "release"):
            uid = self._scheduled(write, runs) or uid
        if write.kind == "close":
            # (the enum: model_copy does not validate, and a string never reads as closed)
            spec = self.envelope.spec.model_copy(update={"state": EnvelopeState.CLOSED})
            self.envelope = replace(self.envelope, spec=spec)
            return
        if write.kind == "create":
            if uid not in self.claims:
                tokens, gpu, dispatched, priority, commit_point, devices, *more = write.arg
                window = more[0] if more else None  # retryWindowSeconds
                requests = {"tokens": tokens, "gpu": gpu}
                if devices:
                    requests[GPU] = devices
                # A dispatched branch's work is its Job (looked up, cancelled by suspension).
                job = {"ref": {"name": f"job-{uid}"}, "supportsCancel": True}
                spec = BranchClaimSpec(
                    envelope="env",
                    requests=requests,
                    dispatch=dispatched and commit_point == "Dispatch",
                    priority=priority,
                    commit_point=commit_point,
                    retry_window_seconds=window,
                    upstream=job if commit_point == "Dispatch" else {},
                )
                self.claims[uid] = ClaimFacts(uid=uid, name=uid, created_at=now, spec=spec)
                if spec.dispatch:
                    self.may_have_run.add(uid)
            return
        facts = self.claims.get(uid)
        if facts is None:
            return
        spec = facts.spec
        wanted = device_counts(spec.requests).get(GPU, 0)
        pruned = spec.cancel or facts.deleting
        by_pod = spec.commit_point != "Dispatch"
        # A branch pruned before dispatch never ran (CEL rule, admission policy). For pod
        # commit points the API server cannot tell: a workload pod there at the prune may
        # still bind and run after it; one first created after it is not generated (see
        # the module docstring).
        pod_may_run = by_pod and uid in self.pod_at_prune
        frozen_execution = spec.final or (
            pruned and not pod_may_run and (by_pod or not spec.dispatch)
        )
        # A final report fixes dispatch (CEL rule): a branch that finished is not sent.
        if write.kind == "dispatch" and not pruned and not by_pod and not spec.final:
            self._spec(uid, dispatch=True)
            self.may_have_run.add(uid)
        elif write.kind in ("cancel", "delete"):
            if not pruned and self._may_start(uid):
                self.pod_at_prune.add(uid)
            if write.kind == "cancel":
                self._spec(uid, cancel=True)
            else:
                self.claims[uid] = replace(facts, deleting=True)
        elif write.kind == "usage" and not frozen_execution:
            usage = dict(spec.usage)
            usage["tokens"] = usage.get("tokens", Decimal(0)) + write.arg
            if write.arg and by_pod and "gpu" in self.envelope.spec.contracts:
                # "gpu" under a declared contract: a branch that ran used its permits (a
                # Reusable resource's occupancy, a Replenishing one's consumption). Only
                # branches without a Job say so: a Job's usage names tokens alone.
                usage["gpu"] = max(usage.get("gpu", Decimal(0)), spec.requests.get("gpu", 0))
            if uid in self.used:  # its Job said what it used: the worker says no more
                usage["tokens"] = min(usage["tokens"], self.used[uid])
            self._spec(uid, usage=usage)
            if write.arg:
                self.may_have_run.add(uid)
        elif write.kind == "finish" and not spec.final:
            changes: dict[str, Any] = {"final": True, "outcome": write.arg}
            if uid in self.used:  # its Job said what it used: so does the final report
                changes["usage"] = {**spec.usage, "tokens": self.used[uid]}
            else:
                self.used[uid] = spec.usage.get("tokens", Decimal(0))
            self._spec(uid, **changes)
        elif write.kind.startswith("job_"):
            self._job(uid, write, spec, runs)
        elif write.kind == "heartbeat":
            self.beats += 1
            token = f"hb-{write.arg}-{self.beats}"
            self.claims[uid] = replace(facts, heartbeat=token, heartbeat_holder="w")
        elif write.kind == "pod" and not wanted and by_pod and not frozen_execution:
            self._pod(uid, max(self.pods.get(uid, 0), write.arg))
        elif write.kind == "pod" and wanted and uid in self.pods:
            # The gate is lifted in both worlds, and the scheduler binds the pod on the
            # claim's allocated ResourceClaim.
            made = (uid, self.pod_made[uid])
            ungated = self.pods[uid] >= 1 or all(made in run.lifted for run in runs)
            placed = uid in self.devices and self.devices[uid].allocated
            if ungated and placed:
                self._pod(uid, max(self.pods[uid], write.arg))
        elif (
            write.kind == "gated"
            and wanted
            and uid not in self.pods
            and (uid not in self.gone or self.replace_unseen)
        ):
            # Re-created before both runs saw it gone only in its own test below, to keep
            # that path exercised explicitly as well as at random.
            self.pod_made[uid] = self.pod_made.get(uid, 0) + 1
            self._pod(uid, 0)
        elif write.kind == "lift_fails" and wanted:
            self.lift_failing.add(uid)  # the writer's patch is refused, or it restarts
        elif write.kind == "lift_works":
            self.lift_failing.discard(uid)
        elif write.kind == "pod_gone" and wanted and uid in self.pods:
            self._no_pod(uid)
            self.gone.add(uid)
        elif write.kind == "allocate" and wanted and all(run.holds(uid) for run in runs):
            node, held = write.arg
            current = self.devices.get(uid)
            if current is not None and current.allocated:
                # An allocation does not move; a pod of ours may come to hold it.
                self.devices[uid] = replace(current, held=current.held or held)
            elif node is None:
                self.devices[uid] = DeviceFacts(waiting="0/3 nodes are available")
            else:
                names = tuple(f"gpu-{node}-{uid}-{k}" for k in range(wanted))
                self.devices[uid] = DeviceFacts(node=f"node-{node}", devices=names, held=held)
        elif write.kind == "lose" and uid in self.devices and self.devices[uid].allocated:
            # Preempted or its node lost: the ResourceClaim stays, unallocated, and a
            # workload pod bound on it goes with the node.
            self.devices[uid] = DeviceFacts(waiting="preempted")
            if self.pods.get(uid, 0) >= 1:
                self._no_pod(uid)
                self.gone.add(uid)
        elif (
            write.kind == "release"
            and uid in self.devices
            and not any(run.holds(uid) for run in runs)
            and self.pods.get(uid, 0) == 0
        ):
            del self.devices[uid]  # both let it go, and no pod of the claim uses it

    def _job(self, uid: str, write: Write, spec: BranchClaimSpec, runs: tuple[Run, Run]) -> None:
        """The claim's Job: it starts once the branch is dispatched; suspended by the
        forwarded cancel (see _suspend_jobs), anyone may resume it (re-apply it); it
        finishes, with the usage annotation or without it, and the annotation may come
        later."""
        job = self.jobs.get(uid)
        phase = job.phase if job is not None else None
        starts = write.kind == "job_run" and job is None and spec.dispatch and not spec.final
        resumed = write.kind == "job_resume" and phase == "suspended"  # re-applied
        if starts or resumed:
            self.jobs[uid] = Job("running")
        elif write.kind == "job_done" and (phase == "running" or (job is None and spec.dispatch)):
            # (Created and finished between two writes of the others, if it was not there.)
            failed, annotated, extra = write.arg
            used = self.used.setdefault(uid, spec.usage.get("tokens", Decimal(0)) + extra)
            condition = "Failed" if failed else "Complete"
            self.jobs[uid] = Job("finished", condition, used if annotated else None)
        elif write.kind == "job_annotate" and job is not None and phase == "finished":
            self.jobs[uid] = replace(job, usage=self.used[uid])

    def _suspend_jobs(self, runs: tuple[Run, Run]) -> None:
        """The Job controller suspends a running Job (its pod goes) once both runs
        forwarded the claim's cancel by suspending it: before the next write lands."""
        for uid, job in self.jobs.items():
            asked = all(uid in run.suspended for run in runs)
            if job.phase == "running" and asked and uid not in self.suspensions:
                self.jobs[uid] = Job("suspended")
                self.suspensions.add(uid)  # once: a resumed Job is not suspended again

    def _scheduled(self, write: Write, runs: tuple[Run, Run]) -> str | None:
        """The scheduler acts on the ResourceClaims there are: the write's claim number
        picks one of those it can act on (so that its writes mostly take effect)."""
        if write.kind == "allocate":
            able = [u for u in self.claims if all(run.holds(u) for run in runs)]
        elif write.kind == "lose":
            able = [u for u, f in self.devices.items() if f.allocated]
        else:
            able = [u for u in self.devices if not any(run.holds(u) for run in runs)]
        return sorted(able)[write.claim % len(able)] if able else None

    def lift_gates(self, runs: tuple[Run, Run]) -> None:
        """A gate goes once both runs lifted it: the pod is then pending, unbound."""
        for uid, stage in self.pods.items():
            made = (uid, self.pod_made.get(uid, 0))
            if stage == 0 and made not in self.ungated and all(made in r.lifted for r in runs):
                self.ungated.add(made)
                self.may_have_run.add(uid)
                self._pod(uid, 0)

    def _may_start(self, uid: str) -> bool:
        """A workload pod of the claim exists that the scheduler may bind (or did)."""
        if uid not in self.pods:
            return False
        return self.pods[uid] >= 1 or (uid, self.pod_made.get(uid, 0)) in self.ungated

    def _pod(self, uid: str, stage: int) -> None:
        self.pods[uid] = stage
        if stage >= 1:
            self.may_have_run.add(uid)
        made = self.pod_made.get(uid, 0)
        name = f"{uid}-pod{made}"  # its UID: a re-created pod is another
        gated = stage == 0 and (uid, made) not in self.ungated
        pod = PodFacts(
            scheduled=stage >= 1,
            running=stage >= 2,
            gated=gated,
            gated_pod=name if gated else None,
            uids=frozenset({name}),
            gated_uids=frozenset({name}) if gated else frozenset(),
        )
        self.claims[uid] = replace(self.claims[uid], pod=pod)

    def _no_pod(self, uid: str) -> None:
        del self.pods[uid]
        self.may_have_run.add(uid)
        self.claims[uid] = replace(self.claims[uid], pod=None)

    def _spec(self, uid: str, **changes: Any) -> None:
        facts = self.claims[uid]
        spec = BranchClaimSpec.model_validate({**facts.spec.model_dump(), **changes})
        self.claims[uid] = replace(facts, spec=spec)


def play(
    history: History, sees: Callable[[int], set[int]], replace_unseen: bool = True
) -> tuple[Run, Run]:
    """Both runs over one history. At each instant the clock moves and both reconcile (the
    writer's timer); then the writes land, one by one. Run A reconciles after every write,
    run B after the writes `sees(count)` names (1-based) and always after the last one.
    The two runs are compared at the end of every instant."""
    with asyncio.Runner() as runner:
        every_step, coalesced = Run(runner=runner), Run(runner=runner)
        runs = (every_step, coalesced)
        world = World(history.envelope, replace_unseen=replace_unseen)
        now = T0
        for tick, writes in history.instants:
            now += timedelta(seconds=tick)
            every_step.reconcile(world, now)
            coalesced.reconcile(world, now)
            world.lift_gates(runs)
            seen = sees(len(writes))
            for index, write in enumerate(writes, start=1):
                world.apply(write, now, runs)
                every_step.reconcile(world, now)
                if index in seen or index == len(writes):
                    coalesced.reconcile(world, now)
                    world.gone.clear()
                world.lift_gates(runs)
            # The writer's follow-up pass: what the last pass recorded may ask for a lookup
            # or a cancel to forward (a cancel request recorded, a lease lapsed), which the
            # writer makes before its next pass, at once.
            every_step.reconcile(world, now)
            coalesced.reconcile(world, now)
            compare(every_step, coalesced, frozenset(world.jobs))
        # Let both settle any follow-up at the same moment, then compare once more.
        every_step.reconcile(world, now)
        coalesced.reconcile(world, now)
        compare(every_step, coalesced, frozenset(world.jobs))
        if history.ending is not None:
            close_first, outcomes = history.ending
            finals = [Write("finish", n, outcome) for n, outcome in enumerate(outcomes)]
            close = [Write("close", 0)]
            for write in [*close, *finals] if close_first else [*finals, *close]:
                world.apply(write, now, runs)
                every_step.reconcile(world, now)
            coalesced.reconcile(world, now)
            compare(every_step, coalesced, frozenset(world.jobs))
    return every_step, coalesced


def amounts(resources: dict[str, Decimal]) -> dict[str, Decimal]:
    """A resource map's amounts: one that names a resource at zero says what one that
    does not name it says (a worker's final report of {} and a Job's usage annotation of
    {"tokens": "0"} settle alike)."""
    return {k: v for k, v in resources.items() if v}


def settlement_of(entry: LedgerEntry, fleeting_start: bool = False) -> tuple[Any, ...]:
    phase = entry.phase
    if fleeting_start and phase is ClaimPhase.RUNNING:
        phase = ClaimPhase.COMMITTED
    return (
        phase,
        amounts(entry.consumed),
        amounts(entry.released),
        amounts(entry.usage),
        entry.committed_at is not None,
        entry.cancel_requested,
        entry.settlement.phase if entry.settlement else None,
        (entry.overrun.usage, entry.overrun.excess, entry.overrun.final) if entry.overrun else None,
        entry.devices is not None and entry.devices.released,
        # What a live claim returned of its Reusable resources once its work was over
        # (issue 22); once settled, all of it is back either way.
        None if phase.terminal else amounts(entry.reusable_returned),
    )


def devices_of(run: Run, uid: str) -> tuple[Any, ...]:
    """What the operator does with a claim's devices now: hold them, hand them off."""
    assert run.result is not None
    return uid in run.result.device_holds, uid in run.result.handed_off


def compare(a: Run, b: Run, with_jobs: frozenset[str] = frozenset()) -> int:
    """The settlements of claims both runs admitted (and handed off) alike. Returns how
    many were compared. For claims with a Job (`with_jobs`), Committed and Running are one
    phase: a Job seen running (then suspended, or finished) moves a Committed claim to
    Running in the run that saw it, which changes no capacity (module docstring)."""
    compared = 0
    for uid in {*a.status.entries, *a.records}:
        left, right = a.entry(uid), b.entry(uid)
        if left is None or right is None or left.first_reserved_at is None:
            continue
        if (left.first_reserved_at, left.reserved) != (right.first_reserved_at, right.reserved):
            continue  # admitted differently: admission depends on what the operator saw
        if (a.handed.get(uid), a.handed_to.get(uid)) != (b.handed.get(uid), b.handed_to.get(uid)):
            continue  # handed off differently: so does the hand-off (module docstring)
        if (left.devices is None) != (right.devices is None):
            continue  # recorded an allocation one run saw and the other missed (docstring)
        mine = (settlement_of(left, uid in with_jobs), devices_of(a, uid))
        theirs = (settlement_of(right, uid in with_jobs), devices_of(b, uid))
        assert mine == theirs, f"{uid}: every step {mine} != coalesced {theirs}"
        compared += 1
    return compared


# --- the histories ---------------------------------------------------------------------

claim_ids = st.integers(0, MAX_CLAIMS - 1)
seconds = st.integers(0, 30)  # between two instants
allocations = st.builds(
    Write,
    st.just("allocate"),
    claim_ids,
    st.tuples(st.sampled_from([None, 0, 0, 1]), st.sampled_from([True, True, False])),
)
creates = st.builds(
    Write,
    st.just("create"),
    claim_ids,
    st.tuples(
        st.integers(0, 60),
        st.integers(0, 2),
        st.booleans(),
        st.integers(0, 2),
        st.sampled_from(["Dispatch", "Dispatch", "PodScheduled", "PodRunning"]),
        st.sampled_from([0, 0, 1, 1, 2, 3]),  # GPUs: about two claims in three ask
        st.one_of(st.none(), st.integers(1, 60)),  # retryWindowSeconds
    ),
)
writes = st.one_of(
    creates,
    st.builds(Write, st.sampled_from(["dispatch", "cancel", "delete"]), claim_ids),
    st.builds(Write, st.just("usage"), claim_ids, st.integers(0, 40)),
    st.builds(
        Write, st.just("finish"), claim_ids, st.sampled_from(["Succeeded", "Failed", "Cancelled"])
    ),
    st.builds(Write, st.just("heartbeat"), claim_ids, st.integers(0, 3)),
    st.builds(Write, st.just("pod"), claim_ids, st.integers(1, 2)),
    st.builds(Write, st.just("close"), st.just(0)),
    # devices: the scheduler, node loss, the client's gated workload pod (drawn more often:
    # they take effect only in the states described in the module docstring)
    allocations,
    allocations,
    allocations,
    st.builds(Write, st.just("gated"), claim_ids),
    st.builds(Write, st.sampled_from(["pod", "pod"]), claim_ids, st.integers(1, 2)),
    st.builds(Write, st.sampled_from(["lose", "release", "release", "pod_gone"]), claim_ids),
    # the writer's gate lift fails for a while (a refused patch, a restart after the write)
    st.builds(Write, st.sampled_from(["lift_fails", "lift_works"]), claim_ids),
    # the claims' Jobs: started, suspended by a forwarded cancel, resumed, finished with
    # the usage annotation or without it (usage above R too), annotated later
    st.builds(
        Write,
        st.sampled_from(["job_run", "job_run", "job_resume", "job_annotate"]),
        claim_ids,
    ),
    st.builds(
        Write,
        st.just("job_done"),
        claim_ids,
        st.tuples(st.booleans(), st.booleans(), st.integers(0, 30)),
    ),
)

# Pod commit points and hand-offs, drawn densely (issue 21 §3.5 and §3.9 hid in the broad
# histories above): two claims whose commit point is their pod or whose devices are handed
# to one, and mostly the writes about pods, gates, prunes and leases.
pod_claim_ids = st.integers(0, 1)
pod_allocations = st.builds(
    Write, st.just("allocate"), pod_claim_ids, st.tuples(st.just(0), st.just(True))
)
pod_creates = st.builds(
    Write,
    st.just("create"),
    pod_claim_ids,
    st.tuples(
        st.integers(0, 40),
        st.just(0),
        st.booleans(),
        st.just(0),
        st.sampled_from(["Dispatch", "PodScheduled", "PodRunning", "PodRunning"]),
        st.sampled_from([0, 0, 2]),
    ),
)
# Mostly short steps (a claim lives through several instants), now and then a lease or a
# deadline's worth.
pod_ticks = st.sampled_from([0, 1, 1, 2, 3, 45, 70])
POD_KINDS = [
    *["cancel"] * 3,
    "delete",
    "usage",
    "finish",
    "heartbeat",
    *["pod"] * 4,
    *["allocate"] * 2,
    *["gated"] * 2,
    *["lift_fails"] * 2,
    "lift_works",
    "pod_gone",
    "release",
    "lose",
    "create",
]


@st.composite
def pod_write(draw: st.DrawFn) -> Write:
    kind = draw(st.sampled_from(POD_KINDS))
    if kind == "create":
        return draw(pod_creates)
    if kind == "allocate":
        return draw(pod_allocations)
    arg = {"usage": st.integers(0, 10), "pod": st.integers(1, 2), "heartbeat": st.integers(0, 3)}
    return Write(kind, draw(pod_claim_ids), draw(arg.get(kind, st.just("Succeeded"))))


pod_writes = pod_write()


@st.composite
def histories(
    draw: st.DrawFn,
    claim_writes: st.SearchStrategy[Write] = writes,
    claim_creates: st.SearchStrategy[Write] = creates,
    claims: int = MAX_CLAIMS,
    ticks: st.SearchStrategy[int] = seconds,
) -> History:
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
        physical_hold=draw(st.sampled_from(["Tentative", "Commit"])),
    )
    capacity = {
        "tokens": draw(st.integers(20, 150)),
        "gpu": draw(st.integers(2, 6)),
        GPU: draw(st.integers(2, 6)),
    }
    # "gpu" (a plain resource) under each contract (issue 22); nvidia.com/gpu is Reusable.
    gpu = draw(
        st.sampled_from(
            [
                None,
                {"type": "Reusable"},
                {"type": "Replenishing", "windowSeconds": draw(st.integers(5, 90))},
            ]
        )
    )
    spec = ReservationEnvelopeSpec.model_validate(
        {"capacity": capacity, "policy": policy, "contracts": {"gpu": gpu} if gpu else {}}
    )
    envelope = EnvelopeFacts(spec=spec, created_at=T0)
    instants = draw(
        st.lists(
            st.tuples(ticks, st.lists(claim_writes, min_size=1, max_size=7)),
            min_size=2,
            max_size=8,
        )
    )
    # Claims to write about from the start (more are created later).
    first = draw(st.lists(claim_creates, min_size=1, max_size=claims))
    outcomes = st.sampled_from(["Succeeded", "Failed", "Failed", "Cancelled"])
    ending = st.tuples(st.booleans(), st.lists(outcomes, min_size=MAX_CLAIMS).map(tuple))
    return History(envelope, [(0, first), *instants], draw(st.one_of(st.none(), ending)))


@settings(
    max_examples=int(os.environ.get("RESERVOIR_AUDIT_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(history=histories(), data=st.data())
def test_settlement_does_not_depend_on_which_intermediate_states_the_operator_saw(
    history: History, data: st.DataObject
) -> None:
    def sees(count: int) -> set[int]:
        return data.draw(st.sets(st.integers(1, count)), label="coalesced run sees")

    play(history, sees)


# Provider answers: most random histories above never get a claim to the point where its
# Job is asked (admitted, dispatched, then Detached or cancelled), so these histories are
# built around it: dispatched claims without devices, their workers' reports and Leases,
# cancels, and their Jobs running, suspended by the forwarded cancel, resumed, finishing
# with or without the usage annotation (above R too), annotated later.
job_claims = st.integers(0, 1)  # fewer claims: each gets more of the writes
provider_creates = st.builds(
    Write,
    st.just("create"),
    job_claims,
    st.tuples(
        st.integers(1, 30),
        st.integers(0, 1),  # a permit of "gpu" (Reusable in these histories)
        st.sampled_from([True, True, False]),
        st.just(0),
        st.just("Dispatch"),
        st.just(0),
    ),
)
job_writes = st.builds(
    Write, st.sampled_from(["job_run", "job_resume", "job_resume", "job_annotate"]), job_claims
)
job_ends = st.builds(
    Write,
    st.just("job_done"),
    job_claims,
    st.tuples(st.booleans(), st.booleans(), st.integers(0, 30)),
)
worker_reports = st.one_of(
    st.builds(Write, st.just("usage"), job_claims, st.integers(0, 25)),
    st.builds(
        Write, st.just("finish"), job_claims, st.sampled_from(["Succeeded", "Failed", "Cancelled"])
    ),
)
provider_writes = st.one_of(
    provider_creates,
    st.builds(Write, st.sampled_from(["dispatch", "cancel", "cancel", "delete"]), job_claims),
    # Heartbeats next to cancels: a renewal seen with the cancel that came with it extends
    # the lease as one seen before it does (test_a_heartbeat_seen_with_the_cancel_...).
    st.builds(Write, st.just("heartbeat"), job_claims, st.integers(0, 3)),
    worker_reports,
    worker_reports,
    job_writes,
    job_writes,
    job_ends,
    job_ends,
    job_ends,
    st.builds(Write, st.just("close"), st.just(0)),
)


@st.composite
def provider_histories(draw: st.DrawFn) -> History:
    lease = draw(st.integers(3, 30))
    policy = EnvelopePolicy(
        default_lease_seconds=lease,
        ambiguity_deadline_seconds=draw(st.integers(5, 60)),
        at_ambiguity_deadline=draw(st.sampled_from(["Hold", "Quarantine", "Release"])),
        late_completion=draw(st.sampled_from(["Adjust", "Record"])),
    )
    # "gpu" is a Reusable permit here: it comes back as soon as a Job is over, whether or
    # not its usage is known yet (issue 22).
    capacity = {"tokens": draw(st.integers(30, 150)), "gpu": draw(st.integers(1, 4))}
    spec = ReservationEnvelopeSpec.model_validate(
        {"capacity": capacity, "policy": policy, "contracts": {"gpu": {"type": "Reusable"}}}
    )
    envelope = EnvelopeFacts(spec=spec, created_at=T0)
    instants = draw(
        st.lists(
            st.tuples(st.integers(0, 20), st.lists(provider_writes, min_size=1, max_size=7)),
            min_size=2,
            max_size=10,
        )
    )
    first = draw(st.lists(provider_creates, min_size=1, max_size=MAX_CLAIMS))
    return History(envelope, [(0, first), *instants])


@settings(
    max_examples=int(os.environ.get("RESERVOIR_AUDIT_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(history=histories(pod_writes, pod_creates, 2, pod_ticks), data=st.data())
def test_pod_commit_points_and_hand_offs_settle_alike_however_seen(
    history: History, data: st.DataObject
) -> None:
    def sees(count: int) -> set[int]:
        return data.draw(st.sets(st.integers(1, count)), label="coalesced run sees")

    play(history, sees)


def only_last(count: int) -> set[int]:
    return set()


def test_a_final_report_then_a_cancel_while_the_pod_may_start_record_alike() -> None:
    """Found by the audit (a random history, the core as it was): the final report and then
    the cancel, while the claim's pod was bound but not started: seen one by one, the cancel
    came after the settlement and was not recorded; seen together it was."""
    envelope = EnvelopeFacts(
        spec=ReservationEnvelopeSpec(
            capacity={"tokens": 20, "gpu": 2, "nvidia.com/gpu": 2},
            policy=EnvelopePolicy(default_lease_seconds=5, ambiguity_deadline_seconds=5),
        ),
        created_at=T0,
    )
    history = History(
        envelope,
        [
            (0, [Write("create", 0, (1, 0, False, 0, "PodRunning", 0))]),
            (0, [Write("pod", 0, 1)]),
            (0, [Write("finish", 0, "Succeeded"), Write("cancel", 0, "Succeeded")]),
        ],
    )
    every_step, coalesced = play(history, only_last)
    assert compare(every_step, coalesced) == 1
    entry = coalesced.entry("c0")
    assert entry is not None and entry.cancel_requested and entry.phase is ClaimPhase.RELEASED


def test_a_job_that_completes_without_usage_before_the_final_report_settles_alike() -> None:
    """Issue 21, defect 1 (found by the audit on the code before its fix): c0 is
    dispatched and its lease lapses (Detached); its Job completes without the usage
    annotation, then the worker's final report says 12. Every step: R was returned on the
    Job's answer; coalesced: 12 charged. Both must charge 12."""
    envelope = EnvelopeFacts(
        spec=ReservationEnvelopeSpec(
            capacity={"tokens": 100, "gpu": 0},
            policy=EnvelopePolicy(default_lease_seconds=5, ambiguity_deadline_seconds=60),
        ),
        created_at=T0,
    )
    history = History(
        envelope,
        [
            (0, [Write("create", 0, (20, 0, True, 0, "Dispatch", 0)), Write("job_run", 0)]),
            (6, [Write("job_done", 0, (False, False, 12)), Write("finish", 0, "Succeeded")]),
        ],
    )
    every_step, coalesced = play(history, only_last)
    assert compare(every_step, coalesced, frozenset({"c0"})) == 1
    entry = coalesced.entry("c0")
    assert entry is not None and entry.consumed == {"tokens": Decimal(12)}


def test_a_job_suspended_by_the_cancel_and_resumed_between_two_looks_settles_alike() -> None:
    """Issue 21, defect 2 (found by the audit on the code before its fix): c0's cancel is
    forwarded by suspending its Job (both runs); the Job is suspended, then re-applied
    (resumed) and completes with usage 15. Every step: R returned on the suspended Job
    read as Cancelled; coalesced: 15 charged. Both must charge 15."""
    envelope = EnvelopeFacts(
        spec=ReservationEnvelopeSpec(
            capacity={"tokens": 100, "gpu": 0}, policy=EnvelopePolicy(default_lease_seconds=300)
        ),
        created_at=T0,
    )
    history = History(
        envelope,
        [
            (0, [Write("create", 0, (20, 0, True, 0, "Dispatch", 0)), Write("job_run", 0)]),
            (1, [Write("cancel", 0)]),
            (1, [Write("heartbeat", 0, 1), Write("job_resume", 0)]),
            (1, [Write("job_done", 0, (False, True, 15))]),
        ],
    )
    every_step, coalesced = play(history, only_last)
    assert compare(every_step, coalesced, frozenset({"c0"})) == 1
    entry = coalesced.entry("c0")
    assert entry is not None and entry.consumed == {"tokens": Decimal(15)}


def test_the_audit_compares_settlements_when_the_operator_missed_a_dispatch_and_cancel() -> None:
    """The audit itself can fail: the history of the review's first finding, compared."""
    envelope = EnvelopeFacts(
        spec=ReservationEnvelopeSpec(capacity={"tokens": 100, "gpu": 0}), created_at=T0
    )
    history = History(
        envelope,
        [
            (0, [Write("create", 0, (20, 0, False, 0, "Dispatch", 0))]),
            (1, [Write("dispatch", 0), Write("cancel", 0)]),
        ],
    )
    every_step, coalesced = play(history, only_last)
    assert compare(every_step, coalesced) == 1
    entry = coalesced.entry("c0")
    assert entry is not None and entry.phase.value == "Committed" and entry.cancel_requested


def test_a_workload_pod_replaced_between_two_looks_settles_alike() -> None:
    """Found by the audit (fixed: gone is about the handed-off pod's UID): c0 (2 GPUs,
    Tentative hold) is admitted on its allocation and handed to its gated workload pod in
    both runs; then the pod vanishes and a new gated pod appears in one instant. Both runs
    must Detach it (WorkloadGone)."""
    envelope = EnvelopeFacts(
        spec=ReservationEnvelopeSpec(capacity={"tokens": 100, "gpu": 2, GPU: 4}), created_at=T0
    )
    history = History(
        envelope,
        [
            (0, [Write("create", 0, (10, 0, False, 0, "Dispatch", 2))]),
            (1, [Write("allocate", 0, (0, True))]),
            (1, [Write("gated", 0)]),
            (1, [Write("pod_gone", 0), Write("gated", 0)]),
        ],
    )
    play(history, only_last, replace_unseen=True)


def test_a_pod_replaced_before_one_run_looked_is_another_hand_off() -> None:
    """Found by the audit (a gap in this comparison, not in the operator): in one instant
    c0's devices are allocated, its gated workload pod appears, vanishes, and a new gated
    pod appears; then it is cancelled. The run that looked after each write handed off to
    the first pod, which then vanished (it may have run: the claim is Detached, never
    released on a guess); the run that looked only at the end handed off to the second.
    Both at the same second: only the pod tells these hand-offs apart, and claims handed
    off differently are not compared (module docstring)."""
    envelope = EnvelopeFacts(
        spec=ReservationEnvelopeSpec(capacity={"tokens": 20, "gpu": 2, GPU: 2}), created_at=T0
    )
    history = History(
        envelope,
        [
            (0, [Write("create", 0, (0, 0, False, 0, "Dispatch", 2))]),
            (
                0,
                [
                    Write("allocate", 0, (0, True)),
                    Write("gated", 0),
                    Write("pod_gone", 0),
                    Write("gated", 0),
                ],
            ),
            (0, [Write("cancel", 0)]),
        ],
    )
    every_step, coalesced = play(history, only_last)
    left, right = every_step.entry("c0"), coalesced.entry("c0")
    assert left is not None and right is not None
    assert left.handed_off_at == right.handed_off_at
    assert left.handed_off_to != right.handed_off_to
    assert left.phase is ClaimPhase.DETACHED, left.phase


def test_a_cancel_missed_next_to_the_final_report_is_still_recorded() -> None:
    """Found by the audit (no devices needed; fixed: the cancel is recorded first): c0 is
    created dispatched (committed at admission), then cancelled and finished in one
    instant. Both runs must record the cancel request."""
    envelope = EnvelopeFacts(
        spec=ReservationEnvelopeSpec(capacity={"tokens": 20, "gpu": 2}), created_at=T0
    )
    history = History(
        envelope,
        [
            (0, [Write("create", 0, (2, 0, True, 0, "Dispatch", 0))]),
            (0, [Write("cancel", 0), Write("finish", 0, "Succeeded")]),
        ],
    )
    every_step, coalesced = play(history, only_last)
    left, right = every_step.entry("c0"), coalesced.entry("c0")
    assert left is not None and right is not None
    assert left.cancel_requested == right.cancel_requested


def test_a_cancel_while_a_pod_may_start_seen_with_the_final_report_is_recorded() -> None:
    """Found by the audit: c0 (commit point PodRunning) gets a workload pod, is cancelled
    while the pod may still start, then finishes without usage, all in one instant. The run
    that saw the cancel first recorded it; the one that saw only the end did not."""
    policy = EnvelopePolicy(default_lease_seconds=5, max_claim_lifetime_seconds=5)
    spec = ReservationEnvelopeSpec(capacity={"tokens": 20, "gpu": 2, GPU: 2}, policy=policy)
    history = History(
        EnvelopeFacts(spec=spec, created_at=T0),
        [
            (0, [Write("create", 0, (1, 0, False, 0, "PodRunning", 0))]),
            (0, [Write("pod", 0, 1), Write("cancel", 0), Write("finish", 0, "Succeeded")]),
        ],
    )
    every_step, coalesced = play(history, only_last)
    left, right = every_step.entry("c0"), coalesced.entry("c0")
    assert left is not None and right is not None
    assert left.cancel_requested and right.cancel_requested


def test_the_audit_finds_a_bound_pod_that_runs_after_the_cancel() -> None:
    """Issue 21 §3.9, found by the audit once these histories are generated: c0
    (PodRunning, no devices) is admitted, its pod binds; then the branch is cancelled and
    the pod runs in one instant. Run A saw the cancel alone, run B both: they must agree
    (R held: the pod ran, and nothing showed it would not when the cancel came)."""
    envelope = EnvelopeFacts(
        spec=ReservationEnvelopeSpec(capacity={"tokens": 100, "gpu": 2}), created_at=T0
    )
    history = History(
        envelope,
        [
            (0, [Write("create", 0, (20, 0, False, 0, "PodRunning", 0))]),
            (1, [Write("pod", 0, 1)]),
            (1, [Write("cancel", 0), Write("pod", 0, 2)]),
        ],
    )
    every_step, coalesced = play(history, only_last)
    assert compare(every_step, coalesced) == 1
    entry = coalesced.entry("c0")
    assert entry is not None and entry.phase.value == "Running" and entry.cancel_requested


def test_the_audit_finds_a_hand_off_whose_gate_lift_failed() -> None:
    """Issue 21 §3.5, found by the audit once lifts may fail: c0 (2 GPUs, 10 tokens,
    Tentative hold) is handed to its gated pod, but the lift fails; the lease (5 s) lapses
    and the deadline (Quarantine) passes with the pod still gated. It never ran: nothing is
    charged, in both runs."""
    policy = EnvelopePolicy(
        default_lease_seconds=5, ambiguity_deadline_seconds=5, at_ambiguity_deadline="Quarantine"
    )
    envelope = EnvelopeFacts(
        spec=ReservationEnvelopeSpec(capacity={"tokens": 100, "gpu": 2, GPU: 4}, policy=policy),
        created_at=T0,
    )
    history = History(
        envelope,
        [
            (0, [Write("create", 0, (10, 0, False, 0, "Dispatch", 2))]),
            (1, [Write("allocate", 0, (0, True))]),
            (1, [Write("lift_fails", 0), Write("gated", 0)]),
            (10, [Write("heartbeat", 1, 0)]),
            (10, [Write("heartbeat", 1, 1)]),
        ],
    )
    every_step, coalesced = play(history, only_last)
    assert compare(every_step, coalesced) == 1
    entry = coalesced.entry("c0")
    assert entry is not None and entry.settlement is not None
    assert entry.settlement.reason == "GateNeverLifted" and entry.consumed == {}


def test_a_failed_attempt_as_its_envelope_closes_holds_nothing_once_closed() -> None:
    """Issue 21 #6 through the audit: c0 (20, retryWindowSeconds) used 5 and fails as its
    envelope closes. The 15 it keeps for a next attempt that can no longer come go back
    before the envelope records its balance: it releases 95, seen step by step or not."""
    envelope = EnvelopeFacts(
        spec=ReservationEnvelopeSpec(capacity={"tokens": 100, "gpu": 2}), created_at=T0
    )
    history = History(
        envelope,
        [
            (0, [Write("create", 0, (20, 0, True, 0, "Dispatch", 0, 60))]),
            (1, [Write("usage", 0, 5)]),
        ],
        ending=(True, ("Failed",)),
    )
    for run in play(history, only_last):
        assert run.status.closed_at is not None
        assert run.status.balance_released == {"tokens": 95, "gpu": 2}


@settings(
    max_examples=int(os.environ.get("RESERVOIR_AUDIT_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(history=provider_histories(), data=st.data())
def test_provider_answers_settle_alike_whichever_states_of_the_job_the_operator_saw(
    history: History, data: st.DataObject
) -> None:
    def sees(count: int) -> set[int]:
        return data.draw(st.sets(st.integers(1, count)), label="coalesced run sees")

    play(history, sees)


@pytest.mark.parametrize("ender", ["cancel", "close"])
def test_a_heartbeat_seen_with_the_cancel_or_close_renews_as_if_seen_first(ender: str) -> None:
    """Found by the audit: c0 is dispatched; at t=8 its holder's heartbeat and a cancel
    (or the envelope's close) land in one instant; its lease (9 s) would end at t=9. Every
    step saw the heartbeat first (renewed: Committed at t=9); coalesced saw both and
    refused the renewal (Detached at t=9). No record orders the two, so both renew, in
    either order; a heartbeat after the pass that recorded the stop on the claim's line
    (renewalsStoppedAt) is refused, and the lease then lapses in both runs."""
    envelope = EnvelopeFacts(
        spec=ReservationEnvelopeSpec(
            capacity={"tokens": 100, "gpu": 0},
            policy=EnvelopePolicy(default_lease_seconds=9, ambiguity_deadline_seconds=5),
        ),
        created_at=T0,
    )
    for first, then in (("heartbeat", ender), (ender, "heartbeat")):
        history = History(
            envelope,
            [
                (0, [Write("create", 0, (20, 0, True, 0, "Dispatch", 0))]),
                (8, [Write(first, 0, 1), Write(then, 0, 1)]),
                (1, [Write("job_done", 0, (False, False, 12))]),
                (4, [Write("heartbeat", 0, 2)]),
                (10, [Write("usage", 0, 4)]),
            ],
        )
        every_step, coalesced = play(history, only_last)
        assert compare(every_step, coalesced, frozenset({"c0"})) == 1
        for run in (every_step, coalesced):
            entry = run.entry("c0")
            assert entry is not None and entry.renewals == 1, first  # at t=8 only
            assert entry.expires_at == T0 + timedelta(seconds=17)
            assert entry.phase is ClaimPhase.DETACHED
            assert entry.renewals_stopped_at == T0 + timedelta(seconds=8)
