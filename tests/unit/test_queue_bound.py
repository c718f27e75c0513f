"""Accepted is not started (lease-renewal.txt: "Keep provider acceptance time and compute
start time separate. Apply an explicit provider-queue policy rather than treating acceptance
as execution"; "A valid local lease must not revive an expired provider request"), in the
pure core: the acceptance recorded apart from the commit, and an operation still queued at
the envelope's bound (or the provider's deadline) cancelled, then settled by the provider's
answer, never released on the clock alone."""

from __future__ import annotations

from datetime import timedelta

from reservoir.core.model import ClaimPhase, ProviderState
from reservoir.core.provider import ProviderAnswer
from tests.unit.sim import Sim

QUEUED = {"operationId": "op-1", "supportsStatus": True, "supportsCancel": True}


ENDPOINT = {"statusURL": "https://provider.example/ops/{operationId}"}


def queued(bound: int | None = 30, action: str = "Cancel", **upstream: object) -> Sim:
    sim = Sim(
        {"tokens": "100"},
        queue_bound_seconds=bound,
        at_queue_bound=action,
        provider=ENDPOINT,
        default_lease_seconds=600,
    )
    sim.create("a", {"tokens": "20"}, upstream={**QUEUED, **upstream}).reconcile()
    return sim


def test_the_acceptance_is_recorded_apart_even_when_the_dispatch_came_first() -> None:
    sim = queued()
    sim.dispatch("a").reconcile()
    assert sim.phase("a") is ClaimPhase.COMMITTED and sim.entry("a").accepted_at is None
    sim.tick(5).update("a", upstream={**QUEUED, "state": "Accepted"}).reconcile()
    entry = sim.entry("a")
    assert entry.accepted_at == sim.now and entry.committed_at == sim.now - timedelta(seconds=5)
    assert entry.started_at is None, "accepted is not started"


def test_a_provider_pending_answer_is_an_acceptance_too() -> None:
    sim = queued().update("a", dispatch=True, upstream={**QUEUED, "state": "Submitted"})
    sim.reconcile()
    assert sim.entry("a").accepted_at is None, "submitted is not accepted"
    sim.tick(3).provider("a", ProviderAnswer(ProviderState.PENDING)).reconcile()
    assert sim.entry("a").accepted_at == sim.now


def test_still_queued_at_the_bound_is_cancelled_then_settled_by_the_providers_answer() -> None:
    sim = queued().update("a", dispatch=True, upstream={**QUEUED, "state": "Accepted"})
    sim.reconcile()
    accepted = sim.entry("a").accepted_at
    assert accepted is not None and sim.last is not None
    assert sim.last.wake_at is not None and sim.last.wake_at <= accepted + timedelta(seconds=30)
    sim.tick(29).reconcile()
    assert not sim.entry("a").cancel_requested
    sim.tick(2).reconcile()
    entry = sim.entry("a")
    assert entry.cancel_requested and entry.queue_bound_at == sim.now
    assert entry.phase is ClaimPhase.COMMITTED, "never released on the clock alone"
    assert sim.reasons("a").count("QueueBoundReached") == 1
    sim.tick(1).provider("a", ProviderAnswer(ProviderState.NEVER_STARTED)).reconcile()
    assert sim.phase("a") is ClaimPhase.RELEASED and sim.available() == "100"
    sim.tick(60).reconcile()
    assert sim.reasons("a").count("QueueBoundReached") == 1, "once"


def test_the_providers_own_deadline_comes_first_when_it_is_earlier() -> None:
    sim = queued(bound=None)
    deadline = (sim.now + timedelta(seconds=10)).isoformat()
    sim.update("a", dispatch=True, upstream={**QUEUED, "state": "Accepted", "deadline": deadline})
    sim.reconcile().tick(11).reconcile()
    assert sim.entry("a").cancel_requested and sim.entry("a").queue_bound_at is not None


def test_started_before_the_bound_is_left_alone_and_hold_only_records() -> None:
    sim = queued().update("a", dispatch=True, upstream={**QUEUED, "state": "Accepted"})
    sim.reconcile().tick(10).update("a", upstream={**QUEUED, "state": "Running"}).reconcile()
    sim.tick(60).reconcile()
    assert sim.phase("a") is ClaimPhase.RUNNING and not sim.entry("a").cancel_requested
    held = queued(action="Hold").update(
        "a", dispatch=True, upstream={**QUEUED, "state": "Accepted"}
    )
    held.reconcile().tick(31).reconcile()
    entry = held.entry("a")
    assert entry.queue_bound_at is not None and not entry.cancel_requested
    assert entry.phase is ClaimPhase.COMMITTED


def test_seen_once_at_the_end_or_step_by_step_the_same_is_recorded() -> None:
    """Skipped intermediate states: dispatch, acceptance and the bound seen in one look or
    in three record the same decision (a cancel asked, nothing returned)."""
    stepwise = queued().dispatch("a").reconcile()
    stepwise.tick(1).update("a", upstream={**QUEUED, "state": "Accepted"}).reconcile()
    stepwise.tick(40).reconcile()
    at_once = queued().update("a", dispatch=True, upstream={**QUEUED, "state": "Accepted"})
    at_once.tick(41).reconcile().tick(40).reconcile()
    for sim in (stepwise, at_once):
        entry = sim.entry("a")
        assert entry.cancel_requested and entry.phase is ClaimPhase.COMMITTED
        assert sim.total("reserved") == "20"
