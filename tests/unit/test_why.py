"""`kubectl reservoir why`: what it says from recorded objects (reservoir.cli.why)."""

from __future__ import annotations

from typing import Any

from reservoir.cli.why import explain_claim, explain_envelope, replay
from reservoir.core.fairshare import SharingRules
from reservoir.sdk.views import ClaimView, EnvelopeView, PoolView

POOL_SPEC: dict[str, Any] = {
    "capacity": {"slots": "4"},
    "namespaces": ["a", "b", "c"],
    "shares": {"c": {"weight": 2}},
    "priorityClasses": {"interactive": {"value": 100}},
}


def envelope(ns: str, name: str, at: str, cls: str | None = None, **status: Any) -> EnvelopeView:
    return EnvelopeView.from_api(
        {
            "metadata": {
                "name": name,
                "namespace": ns,
                "uid": f"{ns}-{name}",
                "creationTimestamp": f"2026-12-05T10:00:{at}Z",
            },
            "spec": {"capacity": {"slots": "1"}, "priorityClassName": cls},
            "status": status,
        }
    )


def pool(shares: dict[str, Any], envelopes: list[EnvelopeView]) -> PoolView:
    view = PoolView.from_api(
        {
            "metadata": {"name": "gpus", "uid": "pool-uid"},
            "spec": POOL_SPEC,
            "status": {"shares": shares},
        }
    )
    return view.with_envelopes(envelopes, complete=True)


def claim(name: str, at: str, phase: str = "Pending", priority: int = 0) -> ClaimView:
    return ClaimView.from_api(
        {
            "metadata": {
                "name": name,
                "namespace": "a",
                "uid": name,
                "resourceVersion": "1",
                "creationTimestamp": f"2026-12-05T10:00:{at}Z",
            },
            "spec": {
                "envelope": "e",
                "branch": name,
                "requests": {"slots": "1"},
                "priority": priority,
            },
            "status": {"phase": phase, "queueReason": "not enough available slots"},
        }
    )


SHARES = {
    "a": {"held": {"slots": "2"}, "share": "0.5000", "weight": 1, "open": 2, "waiting": 1},
    "c": {"held": {"slots": "2"}, "share": "0.2500", "weight": 2, "open": 2, "waiting": 1},
    "b": {"share": "0", "weight": 1, "waiting": 2},
}


def test_the_pool_queue_is_replayed_in_fair_share_order() -> None:
    waiting = [
        envelope("a", "a-1", "01"),
        envelope("b", "b-1", "05"),
        envelope("b", "b-2", "06"),
        envelope("c", "c-1", "02"),
        envelope("a", "a-urgent", "09", cls="interactive"),
    ]
    view = pool(SHARES, waiting)
    assert view.spec is not None
    order = [f"{w.namespace}/{w.name}" for w in replay(view, SharingRules.of(view.spec)).order]
    # The class first; then b (share 0); then c and b tie at 0.25 and c's is older; a last
    # (0.5), whatever its age.
    assert order == ["a/a-urgent", "b/b-1", "c/c-1", "b/b-2", "a/a-1"]
    text = explain_envelope(waiting[2], view)
    assert text.startswith("reservationenvelope/b-2 is Pending: waiting for its parent")
    assert "pool gpus (Open): class (none) = 0; namespace b: weight 1\n" in text
    assert "the pool's queue: 4 of 5 it can see" in text
    assert text.endswith(
        "  ahead: a/a-urgent (class interactive, asks slots=1)\n"
        "  ahead: b/b-1 (class (none), asks slots=1)\n"
        "  ahead: c/c-1 (class (none), asks slots=1)"
    )
    # The namespaces by share, lowest (first in line) first.
    rows = [line.split()[0] for line in text.splitlines() if line.startswith(("a ", "b ", "c "))]
    assert rows == ["b", "c", "a"]


def test_a_claim_shows_its_place_in_its_envelope_and_its_envelope_in_the_pool() -> None:
    mine = claim("mine", "05")
    claims = [claim("old", "01"), claim("urgent", "09", priority=5), mine, claim("new", "07")]
    waiting = envelope("a", "e", "00")
    text = explain_claim(mine, waiting, claims, pool(SHARES, [waiting]))
    assert text.startswith("branchclaim/mine is Pending: not enough available slots")
    assert "its envelope's queue (priority, then age): 3 of 4" in text
    assert text.index("ahead: urgent") < text.index("ahead: old")
    assert "ahead: new" not in text
    assert "reservationenvelope/e is Pending" in text and "pool gpus (Open)" in text


def test_an_admitted_envelope_or_a_running_claim_is_not_waiting() -> None:
    admitted = envelope(
        "a", "e", "00", parent={"kind": "ReservationPool", "name": "gpus", "uid": "p"}
    )
    assert "is admitted (draws from ReservationPool gpus)" in explain_envelope(admitted, None)
    running = claim("run", "01", phase="Committed")
    assert explain_claim(running, None, [], None) == (
        "branchclaim/run is Committed: it is not waiting."
    )


def test_why_says_whom_the_pool_asked_and_what_a_victim_decided() -> None:
    request = {
        "envelope": "a-1",
        "namespace": "a",
        "preemptor": "b/b-1",
        "preemptorUid": "b-b-1",
        "priorityClass": "interactive",
        "requestedAt": "2026-12-05T10:01:00Z",
    }
    waiting = envelope("b", "b-1", "05", cls="interactive", queueReason="waiting for room")
    view = PoolView.from_api(
        {
            "metadata": {"name": "gpus", "uid": "pool-uid"},
            "spec": POOL_SPEC,
            "status": {"shares": SHARES, "preemptions": {"a-a-1": request}},
        }
    ).with_envelopes([waiting], complete=True)
    said = explain_envelope(waiting, view)
    assert "the pool asked 1 envelopes of lower classes to give their room for it" in said
    assert said.endswith("a/a-1")
    other = envelope("c", "c-1", "02", queueReason="waiting for room")
    assert "asked" not in explain_envelope(other, view)
    victim = envelope(
        "a",
        "a-1",
        "01",
        parent={"kind": "ReservationPool", "name": "gpus", "uid": "pool-uid"},
        preemption={
            "outcome": "Refused",
            "preemptor": "b/b-1",
            "preemptorUid": "b-b-1",
            "priorityClass": "interactive",
            "decidedAt": "2026-12-05T10:01:01Z",
            "message": "refused to give its room to b/b-1: claim train is past its commit point",
        },
    )
    said = explain_envelope(victim, None)
    assert said.splitlines()[1] == (
        "preemption (Refused): refused to give its room to b/b-1: claim train is past its "
        "commit point"
    )
