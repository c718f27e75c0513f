"""Reconciling with the provider, in the pure core: lookups, terminal answers, submission
races, late completions, retry windows, duplicate request ids and the durable history."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from datetime import timedelta
from decimal import Decimal
from typing import Any

from reservoir.core.claimstatus import claim_status, expanded, settled_record
from reservoir.core.ledgersize import projected_bytes
from reservoir.core.model import ClaimPhase as P
from reservoir.core.model import ProviderState as S
from reservoir.core.model import Trigger, UpstreamCancel
from reservoir.core.provider import ForwardedCancel, ProviderAnswer, needs_lookup, next_lookup
from reservoir.k8s.ledger_writer import LedgerWriter
from reservoir.k8s.providers import USAGE_ANNOTATION, job_answer
from tests.unit.sim import T0, Sim
from tests.unit.test_provider_adapters import FakeKube

SUSPEND = UpstreamCancel.SUSPEND

JOB = {"ref": {"name": "train-7"}, "operationId": "train-7", "supportsStatus": True}
HTTP_POLICY = {
    "provider": {"statusURL": "https://provider.example/ops/{operationId}"},
    "default_lease_seconds": 5,
    "ambiguity_deadline_seconds": 60,
}


def detached(sim: Sim, name: str = "a", **spec: object) -> Sim:
    """A dispatched claim whose worker went away: its lease lapsed, it is Detached."""
    sim.create(name, upstream=JOB, **spec).reconcile().dispatch(name).reconcile()
    sim.tick(6).reconcile()
    assert sim.phase(name) is P.DETACHED
    return sim


def answer(state: S, tokens: str | None = None, **kw: object) -> ProviderAnswer:
    usage = {"tokens": Decimal(tokens)} if tokens is not None else {}
    return ProviderAnswer(state=state, usage=usage, **kw)  # type: ignore[arg-type]


def test_only_claims_that_need_it_are_looked_up() -> None:
    sim = Sim(default_lease_seconds=5)
    sim.create("a", upstream=JOB).reconcile()
    policy = sim.envelope.spec.policy
    assert not needs_lookup(sim.entry("a"), sim.claims["a"].spec, policy), "tentative"
    sim.dispatch("a").reconcile()
    assert not needs_lookup(sim.entry("a"), sim.claims["a"].spec, policy), "worker attached"
    sim.tick(6).reconcile()
    assert needs_lookup(sim.entry("a"), sim.claims["a"].spec, policy), "detached"
    sim.create("b").reconcile().dispatch("b").reconcile().tick(6).reconcile()
    assert not needs_lookup(sim.entry("b"), sim.claims["b"].spec, policy), "no adapter"


def test_a_terminal_answer_settles_a_detached_claim_like_a_final_report() -> None:
    sim = detached(Sim(default_lease_seconds=5))
    sim.provider("a", answer(S.RUNNING)).reconcile()
    assert sim.phase("a") is P.DETACHED, "running upstream: still no worker"
    assert sim.entry("a").provider is not None
    assert sim.entry("a").provider.state is S.RUNNING  # type: ignore[union-attr]
    sim.provider("a", answer(S.SUCCEEDED, "7", result="s3://out/7")).reconcile()
    entry = sim.entry("a")
    assert entry.phase is P.CONSUMED
    assert entry.settlement is not None and entry.settlement.reason == "ProviderSucceeded"
    assert entry.consumed == {"tokens": Decimal(7)}
    assert entry.released == {"tokens": Decimal(13)}
    assert entry.result == "s3://out/7"
    assert sim.available() == "93"
    # The same answer again changes nothing: settled once.
    before = sim.status.model_copy(deep=True)
    sim.tick(30).reconcile()
    assert sim.status.totals == before.totals


def test_a_failed_lookup_is_counted_and_changes_nothing_else() -> None:
    sim = detached(Sim(default_lease_seconds=5))
    sim.provider("a", answer(S.UNKNOWN, error="HTTP 500")).reconcile()
    record = sim.entry("a").provider
    assert record is not None and record.failures == 1 and record.last_error == "HTTP 500"
    assert sim.phase("a") is P.DETACHED
    assert "ProviderLookupFailed" in sim.reasons("a")
    # The same failure before the next lookup is due is not recorded again (no write loop).
    sim.reconcile()
    assert sim.entry("a").provider == record
    assert record.next_lookup_at is not None
    sim.now = record.next_lookup_at
    sim.reconcile()
    again = sim.entry("a").provider
    assert again is not None and again.failures == 2 and again.lookups == 2
    sim.provider("a", answer(S.FAILED)).reconcile()
    assert sim.phase("a") is P.CONSUMED and sim.available() == "100", "it used nothing"
    settled = sim.entry("a")
    assert settled.settlement is not None and settled.settlement.outcome is not None
    assert settled.settlement.outcome.value == "Failed"
    assert settled.provider is not None and settled.provider.failures == 0


def test_the_writer_wakes_when_the_next_lookup_is_due() -> None:
    """A held line's next lookup sets the pass's wake-up (found by the integration suite:
    with the line on its claim, the pass looked for it among lines not yet placed and
    slept its 30 s idle wait instead)."""
    sim = detached(Sim(default_lease_seconds=5))
    sim.provider("a", answer(S.UNKNOWN, error="HTTP 500")).reconcile().write_lines()
    sim.reconcile().write_lines()  # the line is the claim's, not in flight
    assert sim.last is not None and "a" not in sim.status.entries
    record = sim.entry("a").provider
    assert record is not None and record.next_lookup_at is not None
    assert sim.last.wake_at is not None and sim.last.wake_at <= record.next_lookup_at


def test_lookups_back_off_with_jitter_up_to_the_policy_bound() -> None:
    sim = Sim(provider_lookup_max_seconds=60)
    policy = sim.envelope.spec.policy
    waits = [(next_lookup("uid", n, T0, policy) - T0).total_seconds() for n in range(12)]
    assert waits[0] >= 1 and waits[-1] <= 60
    assert waits[5] > waits[0], "the wait grows"
    assert next_lookup("uid", 3, T0, policy) == next_lookup("uid", 3, T0, policy)
    assert next_lookup("uid", 3, T0, policy) != next_lookup("other", 3, T0, policy)


def test_unknown_keeps_the_claim_detached_until_the_deadline() -> None:
    sim = detached(Sim(default_lease_seconds=5, ambiguity_deadline_seconds=20))
    sim.provider("a", answer(S.UNKNOWN, error="Job train-7 not found")).reconcile()
    assert sim.phase("a") is P.DETACHED
    sim.tick(25).reconcile()
    entry = sim.entry("a")
    assert entry.settlement is not None
    assert entry.settlement.reason == "AmbiguityDeadlineQuarantine"


def test_submitted_is_maybe_running_a_cancel_never_returns_r() -> None:
    sim = Sim(**HTTP_POLICY)  # type: ignore[arg-type]
    upstream = {"operationId": "op-1", "supportsStatus": True, "state": "Submitted"}
    sim.create("a", upstream=upstream).reconcile()
    assert sim.phase("a") is P.COMMITTED
    assert sim.entry("a").history[-1].reason == "Submitted"
    sim.cancel("a").reconcile()
    assert sim.phase("a") is P.COMMITTED and sim.available() == "80", "R stays held"
    sim.tick(6).reconcile()
    assert sim.phase("a") is P.DETACHED and sim.available() == "80", "a lapse returns nothing"
    sim.provider("a", answer(S.NEVER_STARTED)).reconcile()
    assert sim.phase("a") is P.RELEASED and sim.available() == "100"
    settlement = sim.entry("a").settlement
    assert settlement is not None and settlement.reason == "ProviderNeverStarted"


def test_never_started_is_not_believed_against_evidence_that_it_ran() -> None:
    sim = detached(Sim(default_lease_seconds=5))
    sim.usage("a", "3").reconcile()
    sim.provider("a", answer(S.NEVER_STARTED)).reconcile()
    assert sim.phase("a") is not P.RELEASED and not sim.entry("a").phase.terminal
    assert "ProviderContradicted" in sim.reasons("a")
    sim.provider("a", None).tick(1).reconcile().tick(1).reconcile()
    assert sim.reasons("a").count("ProviderContradicted") == 1, "once per answer"


def test_a_cancel_is_forwarded_once_and_recorded_as_requested_not_confirmed() -> None:
    sim = Sim(default_lease_seconds=30)
    spec = {**JOB, "supportsCancel": True}
    sim.create("a", upstream=spec).reconcile().dispatch("a").reconcile()
    sim.cancel("a").reconcile()
    entry = sim.entry("a")
    assert entry.cancel_requested and entry.phase is P.COMMITTED
    sim.claims["a"] = replace(
        sim.claims["a"], cancel_forwarded=ForwardedCancel(SUSPEND, True, "suspended the Job")
    )
    sim.provider("a", answer(S.RUNNING)).reconcile()
    record = sim.entry("a").provider
    assert record is not None and record.cancel == "suspended the Job"
    assert record.cancel_forwarded_at == sim.now
    assert record.cancel_forwarded_as is SUSPEND, "how it went is recorded"
    assert not sim.entry("a").phase.terminal, "a forwarded cancel is not a confirmation"
    sim.provider("a", answer(S.CANCELLED)).reconcile()
    settled = sim.entry("a")
    assert settled.settlement is not None and settled.settlement.reason == "ProviderCancelled"
    assert sim.available() == "100"


def test_a_late_final_report_after_quarantine_returns_what_was_not_used_once() -> None:
    sim = detached(Sim(default_lease_seconds=5, ambiguity_deadline_seconds=10))
    sim.tick(11).reconcile()
    assert sim.total("committed") == "20"
    sim.usage("a", "8", final=True).reconcile()
    entry = sim.entry("a")
    assert entry.adjustment is not None and entry.adjustment.applied
    assert entry.adjustment.returned == {"tokens": Decimal(12)}
    assert entry.consumed == {"tokens": Decimal(20)}, "the settlement never changes"
    assert sim.total("committed") == "8" and sim.available() == "92"
    sim.mirror().tick(1).reconcile().reconcile()
    assert sim.total("committed") == "8", "applied once, also after compaction"
    assert entry.history[-1].reason == "LateCompletionAdjusted"


def test_an_adjustment_after_compaction_is_written_with_the_totals_it_changes() -> None:
    sim = detached(Sim(default_lease_seconds=5, ambiguity_deadline_seconds=10))
    sim.tick(11).reconcile().mirror().reconcile()
    assert "a" not in sim.status.entries, "compacted: the record lives in the claim's status"
    sim.usage("a", "5", final=True).reconcile()
    assert "a" in sim.status.entries, "back in the ledger with its adjustment"
    assert sim.total("committed") == "5"
    sim.reconcile()
    assert sim.total("committed") == "5"
    sim.mirror().reconcile()
    assert "a" not in sim.status.entries and sim.total("committed") == "5"


def test_a_late_completion_is_only_recorded_once_the_envelope_is_closed() -> None:
    sim = detached(Sim(default_lease_seconds=5, ambiguity_deadline_seconds=10))
    sim.tick(11).reconcile().close().reconcile()
    sim.usage("a", "8", final=True).reconcile()
    adjustment = sim.entry("a").adjustment
    assert adjustment is not None and not adjustment.applied
    assert sim.total("committed") == "20"


def test_a_force_settled_claim_is_never_adjusted() -> None:
    sim = detached(Sim(default_lease_seconds=5))
    sim.force("a", "worker lost; ticket 42").reconcile()
    sim.usage("a", "9", final=True).reconcile()
    entry = sim.entry("a")
    assert entry.adjustment is None and entry.late is not None and entry.late.count == 1
    assert sim.total("committed") == "0"


def test_a_failed_attempt_keeps_its_balance_for_the_next_attempt() -> None:
    sim = Sim(capacity={"tokens": "30"})
    sim.create("a1", {"tokens": "20"}, branch="b", retry_window_seconds=60).reconcile()
    sim.dispatch("a1").reconcile().usage("a1", "5", final=True, outcome="Failed").reconcile()
    hold = sim.entry("a1").retry
    assert hold is not None and hold.resources == {"tokens": Decimal(15)}
    assert sim.total("reserved") == "15" and sim.available() == "10"
    sim.create("other", {"tokens": "12"}).reconcile()
    assert sim.phase("other") is P.PENDING
    sim.create("a2", {"tokens": "20"}, branch="b", attempt=2).reconcile()
    assert sim.phase("a2") is P.TENTATIVE
    assert sim.entry("a1").retry is not None and sim.entry("a1").retry.taken_by == "a2"  # type: ignore[union-attr]
    assert sim.total("reserved") == "20" and sim.available() == "5"


def test_a_retry_window_that_closes_returns_the_balance() -> None:
    sim = Sim(capacity={"tokens": "30"})
    sim.create("a1", {"tokens": "20"}, branch="b", retry_window_seconds=5).reconcile()
    sim.dispatch("a1").reconcile().usage("a1", "5", final=True, outcome="Failed").reconcile()
    assert sim.available() == "10"
    sim.mirror().tick(6).reconcile()
    hold = sim.entry("a1").retry
    assert hold is not None and hold.returned and sim.available() == "25"
    sim.mirror().reconcile()
    assert sim.available() == "25"


def test_a_duplicate_request_id_is_rejected_with_the_claim_it_repeats() -> None:
    sim = Sim()
    sim.create("second", upstream={"requestId": "req-1"})
    sim.claims["second"] = replace(sim.claims["second"], duplicate_of="first")
    sim.reconcile()
    entry = sim.entry("second")
    assert entry.phase is P.REJECTED
    assert entry.settlement is not None and entry.settlement.reason == "DuplicateRequestId"
    assert sim.available() == "100"


def test_the_history_lists_every_transition_with_its_trigger() -> None:
    sim = detached(Sim(default_lease_seconds=5))
    sim.provider("a", answer(S.SUCCEEDED, "4")).reconcile()
    moves = [(t.from_phase, t.to, t.reason, t.trigger) for t in sim.entry("a").history]
    assert moves == [
        (P.PENDING, P.TENTATIVE, "Reserved", Trigger.ADMISSION),
        (P.TENTATIVE, P.COMMITTED, "CommitPointReached", Trigger.WORKER),
        (P.COMMITTED, P.DETACHED, "LeaseLapsed", Trigger.CLOCK),
        (P.DETACHED, P.CONSUMED, "ProviderSucceeded", Trigger.PROVIDER),
    ]
    times = [t.at for t in sim.entry("a").history]
    assert times == sorted(times)


def test_the_history_survives_compaction_into_the_claims_status() -> None:
    sim = detached(Sim(default_lease_seconds=5))
    sim.provider("a", answer(S.SUCCEEDED, "4")).reconcile()
    history = list(sim.entry("a").history)
    status = claim_status(sim.entry("a"), None, None, 1, sim.now)
    assert status.ledger is not None and status.ledger.history == history
    assert expanded(status).history == history
    record = settled_record(status, "a", "a", 1)
    assert record is not None and record.history == history
    sim.mirror().reconcile()
    assert "a" not in sim.status.entries and sim.entry("a").history == history


def test_an_entrys_projection_covers_everything_it_can_gain() -> None:
    sim = detached(Sim(default_lease_seconds=5, ambiguity_deadline_seconds=10))
    dimensions = frozenset(sim.envelope.spec.capacity)
    admitted = Sim()
    admitted.create("a", upstream=JOB).reconcile()
    bound = projected_bytes(admitted.entry("a"), dimensions)
    long_error = "x" * 200
    sim.provider("a", answer(S.UNKNOWN, error=long_error)).reconcile()
    sim.tick(11).reconcile()
    sim.update("a", result="s3://" + "r" * 250)
    sim.usage("a", "8", final=True).reconcile()
    from reservoir.core.ledgersize import entry_bytes

    assert entry_bytes(sim.entry("a")) <= bound
    assert sim.now - T0 > timedelta(0)


def test_a_cancel_is_forwarded_without_status_lookup_and_only_where_it_can_be() -> None:
    from reservoir.core.model import UpstreamCancel
    from reservoir.core.provider import cancel_to_forward

    endpoint = {
        "statusURL": "https://p.example/ops/{operationId}",
        "cancelURL": "https://p.example/ops/{operationId}/cancel",
    }
    sim = Sim(provider=endpoint, default_lease_seconds=30)
    upstream = {"operationId": "op-1", "supportsCancel": True}  # no status lookup
    sim.create("a", upstream=upstream).reconcile().dispatch("a").reconcile()
    sim.cancel("a").reconcile()
    policy, spec = sim.envelope.spec.policy, sim.claims["a"].spec
    assert not needs_lookup(sim.entry("a"), spec, policy)
    assert cancel_to_forward(sim.entry("a"), spec, policy) is UpstreamCancel.SUSPEND
    never = policy.model_copy(update={"upstream_cancel": UpstreamCancel.NEVER})
    assert cancel_to_forward(sim.entry("a"), spec, never) is None
    no_call = policy.model_copy(
        update={"provider": policy.provider.model_copy(update={"cancel_url": None})}  # type: ignore[union-attr]
    )
    assert cancel_to_forward(sim.entry("a"), spec, no_call) is None
    unsupported = spec.model_copy(
        update={"upstream": spec.upstream.model_copy(update={"supports_cancel": False})}
    )
    assert cancel_to_forward(sim.entry("a"), unsupported, policy) is None
    sim.claims["a"] = replace(
        sim.claims["a"], cancel_forwarded=ForwardedCancel(SUSPEND, True, "requested (HTTP 202)")
    )
    sim.reconcile()
    record = sim.entry("a").provider
    assert record is not None and record.cancel == "requested (HTTP 202)"
    assert cancel_to_forward(sim.entry("a"), spec, policy) is None, "forwarded once"
    assert sim.phase("a") is P.COMMITTED


# --- found by review ---------------------------------------------------------------------


def test_a_late_answer_never_gives_back_usage_already_recorded() -> None:
    for action, committed in (("Quarantine", "15"), ("Release", "15")):
        sim = Sim(
            default_lease_seconds=5, ambiguity_deadline_seconds=20, at_ambiguity_deadline=action
        )
        sim.create("a", upstream=JOB).reconcile().dispatch("a").reconcile()
        sim.usage("a", "15").reconcile().tick(6).reconcile().tick(25).reconcile()
        sim.provider("a", answer(S.SUCCEEDED)).tick(1).reconcile()
        assert sim.total("committed") == committed, action


def test_a_failed_lookup_after_an_old_answer_adjusts_nothing() -> None:
    sim = Sim(default_lease_seconds=5, ambiguity_deadline_seconds=20)
    sim.create("a", upstream=JOB).reconcile().dispatch("a").reconcile()
    sim.usage("a", "15").reconcile().tick(6).reconcile()
    sim.provider("a", answer(S.NEVER_STARTED)).reconcile()
    assert sim.phase("a") is P.DETACHED, "contradicted by the recorded usage"
    sim.provider("a", None).tick(25).reconcile()
    assert sim.total("committed") == "20"
    sim.provider("a", answer(S.UNKNOWN, error="HTTP 503")).tick(300).reconcile()
    assert sim.entry("a").adjustment is None and sim.total("committed") == "20"


def test_a_start_seen_while_detached_is_recorded_and_outweighs_never_started() -> None:
    sim = detached(Sim(default_lease_seconds=5))
    sim.provider("a", answer(S.RUNNING)).reconcile()
    assert sim.entry("a").started_at is not None
    sim.provider("a", answer(S.NEVER_STARTED)).tick(300).reconcile()
    assert sim.phase("a") is P.DETACHED and sim.available() == "80"


def test_lookups_of_a_compacted_record_are_recorded_and_back_off() -> None:
    sim = Sim(**HTTP_POLICY)  # type: ignore[arg-type]
    sim.create("a", upstream={"operationId": "op-1", "supportsStatus": True}).reconcile()
    sim.dispatch("a").reconcile().tick(6).reconcile()
    sim.provider("a", answer(S.RUNNING)).tick(1).reconcile()
    sim.provider("a", None).tick(70).reconcile().mirror().tick(1).reconcile()
    assert "a" not in sim.status.entries
    policy, spec = sim.envelope.spec.policy, sim.claims["a"].spec
    lookups = 0
    for _ in range(20):
        record = sim.entry("a")
        due = needs_lookup(record, spec, policy) and (
            record.provider is None
            or record.provider.next_lookup_at is None
            or sim.now >= record.provider.next_lookup_at
        )
        lookups += due
        sim.provider("a", answer(S.RUNNING) if due else None).tick(0.05).reconcile().mirror()
    assert lookups == 1, "one lookup, then the recorded backoff"
    assert sim.last is not None and sim.last.wake_at is not None and sim.last.wake_at > sim.now


def test_a_retry_waiting_for_devices_keeps_its_hold_from_other_branches() -> None:
    sim = Sim({"tokens": "100", "nvidia.com/gpu": "4"}, default_lease_seconds=50)
    gpu = {"tokens": "60", "nvidia.com/gpu": "1"}
    sim.create("a1", gpu, branch="b", retry_window_seconds=300).reconcile()
    sim.allocate("a1", devices=("gpu-0",)).reconcile().dispatch("a1").reconcile()
    sim.usage("a1", "10", final=True, outcome="Failed").reconcile()
    sim.tick(1).create("a2", gpu, branch="b", attempt=2).reconcile()
    assert sim.phase("a2") is P.PENDING
    hold = sim.entry("a1").retry
    assert hold is not None and hold.active, "kept until the retry holds its devices"
    sim.tick(1).create("x", {"tokens": "45"}, branch="other", priority=10).reconcile()
    assert sim.phase("x") is P.PENDING
    sim.allocate("a2", devices=("gpu-1",)).tick(1).reconcile()
    assert sim.phase("a2") is P.TENTATIVE
    assert sim.entry("a1").retry is not None and sim.entry("a1").retry.taken_by == "a2"  # type: ignore[union-attr]


def test_a_retry_its_hold_covers_is_not_queued_behind_another_branch() -> None:
    sim = Sim({"tokens": "100"}, default_lease_seconds=50)
    sim.create("a1", {"tokens": "60"}, branch="b", retry_window_seconds=120).reconcile()
    sim.dispatch("a1").reconcile().usage("a1", "10", final=True, outcome="Failed").reconcile()
    sim.tick(1).create("x", {"tokens": "45"}, branch="other").reconcile()
    assert sim.phase("x") is P.PENDING
    sim.tick(1).create("a2", {"tokens": "60"}, branch="b", attempt=2).reconcile()
    assert sim.phase("a2") is P.TENTATIVE


def test_a_cancel_that_was_not_forwarded_is_tried_again() -> None:
    from reservoir.core.provider import cancel_to_forward

    sim = Sim(default_lease_seconds=30)
    sim.create("a", upstream={**JOB, "supportsCancel": True}).reconcile()
    sim.dispatch("a").reconcile().cancel("a").reconcile()
    policy, spec = sim.envelope.spec.policy, sim.claims["a"].spec
    failed = ForwardedCancel(SUSPEND, False, "not forwarded: provider unreachable")
    sim.claims["a"] = replace(sim.claims["a"], cancel_forwarded=failed)
    sim.reconcile()
    record = sim.entry("a").provider
    assert record is not None and record.cancel_forwarded_at is None
    assert "CancelNotForwarded" in sim.reasons("a") and "CancelForwarded" not in sim.reasons("a")
    assert cancel_to_forward(sim.entry("a"), spec, policy) is not None, "tried again"
    sim.reconcile()
    assert sim.reasons("a").count("CancelNotForwarded") == 1, "one Event per new failure"


def test_a_deferred_adjustment_is_the_same_whether_or_not_the_record_was_compacted() -> None:
    import reservoir.core.reconcile as core

    results = []
    for compacted in (False, True):
        sim = detached(Sim(default_lease_seconds=5, ambiguity_deadline_seconds=10))
        sim.tick(11).reconcile()
        if compacted:
            sim.mirror().reconcile()
        sim.usage("a", "5", final=True)
        budget = core.LEDGER_BYTES_BUDGET
        core.LEDGER_BYTES_BUDGET = 0  # no room to bring the record back this pass
        try:
            sim.reconcile()
        finally:
            core.LEDGER_BYTES_BUDGET = budget
        sim.reconcile()
        adjustment = sim.entry("a").adjustment
        assert adjustment is not None
        results.append((adjustment.applied, sim.available()))
    assert results == [(True, "95"), (True, "95")]


def test_free_texts_are_bounded_in_bytes() -> None:
    sim = detached(Sim(default_lease_seconds=5))
    sim.provider("a", answer(S.UNKNOWN, error="é" * 200)).reconcile()
    record = sim.entry("a").provider
    assert record is not None and record.last_error is not None
    assert len(record.last_error.encode()) <= 96


def test_a_retry_waiting_for_devices_needs_from_the_balance_only_what_its_hold_lacks() -> None:
    sim = Sim({"tokens": "100", "nvidia.com/gpu": "4"}, default_lease_seconds=50)
    sim.create("a1", {"tokens": "60", "nvidia.com/gpu": "1"}, branch="b", retry_window_seconds=300)
    sim.reconcile().allocate("a1", devices=("gpu-0",)).reconcile().dispatch("a1").reconcile()
    sim.usage("a1", "10", final=True, outcome="Failed").reconcile()
    assert sim.available() == "40"
    # A retry waiting for its devices, and two other branches, in one pass.
    sim.tick(1).create("a2", {"tokens": "20", "nvidia.com/gpu": "1"}, branch="b", attempt=2)
    sim.tick(1).create("x", {"tokens": "40"}, branch="x").create("y", {"tokens": "30"}, branch="y")
    sim.reconcile()  # never overdraws: compute_totals would raise
    assert sim.phase("a2") is P.PENDING
    assert sim.phase("x") is P.TENTATIVE and sim.phase("y") is P.PENDING
    assert sim.total("available") == "0" and sim.total("reserved") == "90"
    # A second retry in the same pass cannot count on the same hold.
    sim.tick(1).create("a3", {"tokens": "20", "nvidia.com/gpu": "1"}, branch="b", attempt=3)
    sim.reconcile()
    assert sim.phase("a3") is P.PENDING and sim.total("reserved") == "90"


# --- issue 21 §3: provider-answer histories (each failed before its fix) -----------------


def job(
    conditions: tuple[str, ...] = (),
    active: int = 0,
    suspend: bool = False,
    usage: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A batch/v1 Job as the API server returns it (what the Job adapter reads)."""
    annotations = {USAGE_ANNOTATION: json.dumps(usage)} if usage is not None else {}
    status: dict[str, Any] = {"conditions": [{"type": c, "status": "True"} for c in conditions]}
    if active:
        status |= {"active": active, "startTime": "2026-01-01T00:00:00Z"}
    return {
        "kind": "Job",
        "metadata": {"name": "train-7", "namespace": "ns", "annotations": annotations},
        "spec": {"suspend": suspend},
        "status": status,
    }


def test_a_completion_without_usage_settles_the_same_before_or_with_the_final_report() -> None:
    """Defect 1: a detached claim's Job completes without the usage annotation; the
    worker's final report (12 of R 20) arrives a moment later. Seen in that order or
    together, 12 is charged (available 88): a completion that does not say what was used
    is not proof of zero usage (child-settlement.txt), so it settles nothing on its own."""
    silent = job_answer(job(conditions=("Complete",)))
    outcomes = []
    for together in (False, True):
        sim = detached(Sim(default_lease_seconds=5))
        sim.provider("a", silent)
        if not together:
            sim.reconcile()
            assert sim.phase("a") is P.DETACHED and sim.available() == "80", "R stays held"
            assert "ProviderUsageUnknown" in sim.reasons("a")
            sim.provider("a", None).tick(1)
        sim.usage("a", "12", final=True).reconcile()
        entry = sim.entry("a")
        late = entry.late.count if entry.late is not None else 0
        outcomes.append((entry.phase, entry.consumed, sim.available(), late))
    assert outcomes == [(P.CONSUMED, {"tokens": Decimal(12)}, "88", 0)] * 2


def test_a_completion_without_usage_leaves_the_claim_to_the_deadline_and_adjusts_nothing() -> None:
    """Defect 1, with no final report at all: the ambiguity deadline decides (Quarantine
    charges R), a later silent answer returns nothing, and an answer with the usage is
    the one late completion applied."""
    sim = detached(Sim(default_lease_seconds=5, ambiguity_deadline_seconds=20))
    silent = job_answer(job(conditions=("Complete",)))
    for _ in range(3):
        sim.provider("a", silent).tick(5).reconcile()
        assert sim.phase("a") is P.DETACHED and sim.available() == "80"
    assert sim.reasons("a").count("ProviderUsageUnknown") == 1, "said once per answer"
    sim.provider("a", None).tick(20).reconcile()
    settlement = sim.entry("a").settlement
    assert settlement is not None and settlement.reason == "AmbiguityDeadlineQuarantine"
    sim.provider("a", silent).tick(300).reconcile()
    assert sim.entry("a").adjustment is None and sim.total("committed") == "20"
    sim.provider("a", job_answer(job(conditions=("Complete",), usage={"tokens": "6"})))
    sim.tick(300).reconcile()
    adjustment = sim.entry("a").adjustment
    assert adjustment is not None and adjustment.returned == {"tokens": Decimal(14)}
    assert sim.total("committed") == "6"


def consult(sim: Sim, name: str, kube: FakeKube) -> Sim:
    """What the operator's writer does for the claim before its next pass: forward its
    cancel if due, and look its Job up (the very code of LedgerWriter, on a fake API)."""
    writer = LedgerWriter(kube, record=lambda *_: None, clock=lambda: sim.now)  # type: ignore[arg-type]
    fact = replace(sim.claims[name], provider=None, cancel_forwarded=None)
    policy = sim.envelope.spec.policy
    call = writer._provider_call(fact, sim.status, policy)
    if call is not None:
        fact = asyncio.run(writer._consult_provider("ns", fact, policy, call))
    sim.claims[name] = fact
    return sim


def test_a_job_suspended_by_the_forwarded_cancel_is_not_a_confirmed_cancel() -> None:
    """Defect 2: the cancel is forwarded by suspending the Job and its pod goes; then
    someone re-applies the Job (resumed), it completes with usage 15. Suspended is not
    terminal while the Job exists: R stays held, and 15 is charged in the end."""
    kube = FakeKube()
    kube.objects[("Job", "train-7")] = job(active=1)
    sim = Sim(default_lease_seconds=300)
    sim.create("a", upstream={**JOB, "supportsCancel": True}).reconcile()
    sim.dispatch("a").reconcile().cancel("a").reconcile()
    consult(sim, "a", kube).reconcile()
    assert ("patch", "Job", "train-7") in [c[:3] for c in kube.calls], "suspended"
    record = sim.entry("a").provider
    assert record is not None and record.cancel_forwarded_as is SUSPEND
    kube.objects[("Job", "train-7")] = job(conditions=("Suspended",), suspend=True)
    consult(sim, "a", kube).tick(1).reconcile()
    assert not sim.entry("a").phase.terminal and sim.available() == "80", "suspended: held"
    kube.objects[("Job", "train-7")] = job(active=1)  # resumed by a re-apply
    consult(sim, "a", kube).tick(1).reconcile()
    kube.objects[("Job", "train-7")] = job(conditions=("Complete",), usage={"tokens": "15"})
    consult(sim, "a", kube).tick(1).reconcile()
    entry = sim.entry("a")
    assert entry.settlement is not None and entry.settlement.reason == "ProviderSucceeded"
    assert entry.consumed == {"tokens": Decimal(15)} and sim.available() == "85"


def test_a_provider_reported_overrun_is_recorded_as_the_workers_is() -> None:
    """Defect 8: 35 against R 20, from the provider's answer or from the worker's final
    report: charged 20 either way, and the overrun (15) recorded with its Event."""
    overruns = []
    for who in ("provider", "worker"):
        sim = detached(Sim(default_lease_seconds=5))
        if who == "provider":
            sim.provider("a", job_answer(job(conditions=("Complete",), usage={"tokens": "35"})))
        else:
            sim.usage("a", "35", final=True)
        sim.reconcile()
        entry = sim.entry("a")
        assert entry.consumed == {"tokens": Decimal(20)} and sim.available() == "80", who
        assert "Overrun" in sim.reasons("a"), who
        overrun = entry.overrun
        assert overrun is not None, who
        overruns.append((overrun.usage, overrun.excess, overrun.final))
    assert overruns == [({"tokens": Decimal(35)}, {"tokens": Decimal(15)}, True)] * 2


def test_an_answer_of_nothing_used_settles_as_a_final_report_of_nothing_does() -> None:
    """Found by the audit: a Job that says it used nothing, seen before the worker's final
    report of nothing or together with it, settles alike (Consumed, C = 0, R returned)."""
    settled = []
    for together in (False, True):
        sim = detached(Sim(default_lease_seconds=5))
        sim.provider("a", job_answer(job(conditions=("Complete",), usage={})))
        if not together:
            sim.reconcile().provider("a", None).tick(1)
        sim.update("a", final=True, outcome="Succeeded").reconcile()
        settled.append((sim.phase("a"), sim.entry("a").consumed, sim.available()))
    assert settled == [(P.CONSUMED, {}, "100")] * 2


def test_a_provider_that_cancels_only_queued_work_gets_no_cancel_once_it_runs() -> None:
    """upstream.cancelsRunning false (issue 24: supportsCancel per phase): forwarded while
    queued, only recorded once the operation is recorded started."""
    from reservoir.core.provider import cancel_to_forward

    endpoint = {"statusURL": "https://p.example/ops/{op}", "cancelURL": "https://p.example/c"}
    upstream = {"operationId": "op-1", "supportsCancel": True, "cancelsRunning": False}
    queued = Sim(provider=endpoint, default_lease_seconds=30).create("a", upstream=upstream)
    queued.reconcile().dispatch("a").reconcile().cancel("a").reconcile()
    policy = queued.envelope.spec.policy
    assert cancel_to_forward(queued.entry("a"), queued.claims["a"].spec, policy) is not None
    running = Sim(provider=endpoint, default_lease_seconds=30).create("a", upstream=upstream)
    running.reconcile().dispatch("a").reconcile()
    running.update("a", upstream={**upstream, "state": "Running"}).reconcile()
    running.cancel("a").reconcile()
    entry = running.entry("a")
    assert entry.started_at is not None and entry.cancel_requested
    assert cancel_to_forward(entry, running.claims["a"].spec, policy) is None
