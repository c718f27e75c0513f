"""What the ledger writer keeps about names a tenant chose (envelopes its claims name, its
claims' versions) goes once it cannot matter: a tenant that creates and deletes objects
for ever must not grow the operator's memory for ever (DESIGN.md §1.7)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import UTC, datetime
from typing import Any

import pytest

from reservoir import metrics
from reservoir.core.model import ClaimPhase, LedgerEntry
from reservoir.k8s.ledger_writer import (
    DEPARTED_KEPT,
    LET_GO_SECONDS,
    REFUSALS_KEPT,
    LedgerStuckError,
    LedgerWriter,
    drop_departed,
)


def writer() -> LedgerWriter:
    return LedgerWriter(object(), lambda *_: None)  # type: ignore[arg-type]


def deleted_claim(uid: str, envelope: str, bound: str | None) -> dict[str, Any]:
    line = LedgerEntry(
        claim=uid,
        phase=ClaimPhase.TENTATIVE,
        reserved={"tokens": 10},
        first_reserved_at=datetime(2026, 12, 4, tzinfo=UTC),
    ).to_api()
    status: dict[str, Any] = {"ledger": line}
    if bound:
        status["envelopeUid"] = bound
    return {
        "metadata": {"name": uid, "namespace": "team-a", "uid": uid},
        "spec": {"envelope": envelope},
        "status": status,
    }


def test_an_envelopes_trigger_goes_with_it() -> None:
    w = writer()
    w.poke("team-a", "wf")
    w.forget("team-a", "wf")
    assert len(w._triggers) == 0


def test_an_unreadable_claim_keeps_one_reported_version_until_it_goes() -> None:
    w = writer()
    reported: list[Any] = []
    w.record = lambda *args: reported.append(args)

    class Unreadable:
        uid = "claim-uid"
        problem = "spec.requests: not a quantity"

    for version in ("1", "2", "2", "3"):
        claim = {"metadata": {"resourceVersion": version}}
        w._announce_invalid([(claim, Unreadable())])  # type: ignore[list-item]
    assert len(reported) == 3  # once a version
    assert w._reported_invalid == {"claim-uid": "3"}  # one entry a claim
    w.saw_deleted("claim-uid")
    assert w._reported_invalid == {}


def test_a_deleted_claims_line_is_kept_only_for_an_envelope_whose_pass_runs() -> None:
    w = writer()
    for i in range(100):  # claims naming envelopes no daemon keeps (none exist)
        w.saw_deleted(f"c{i}", deleted_claim(f"c{i}", f"nowhere-{i}", "forged"))
    assert w._departed == {}
    with w.keeping("team-a", "wf"):
        w.saw_deleted("kept", deleted_claim("kept", "wf", "wf-uid"))
    assert set(w.departed("team-a", "wf", "wf-uid")) == {"kept"}


def test_a_pass_drops_what_it_recorded_and_lines_bound_to_another_envelope() -> None:
    line = LedgerEntry(claim="x", phase=ClaimPhase.TENTATIVE)
    departed: dict[str, tuple[str | None, LedgerEntry]] = {
        "recorded": ("wf-uid", line),
        "postponed": ("wf-uid", line),  # left for the next pass
        "earlier-envelope": ("old-uid", line),
        "unbound": (None, line),
    }
    drop_departed(departed, {"recorded"}, "wf-uid")
    assert set(departed) == {"postponed"}


class Monotonic:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_envelope_no_daemon_keeps_is_forgotten_after_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An envelope removed with its finalizer taken off by hand: kopf stops its daemon and
    runs no deletion handler, and no pass finds it gone. What the writer kept of it, and
    its gauges, go LET_GO_SECONDS after its daemon stopped; an envelope kept all along
    keeps everything."""
    clock = Monotonic()
    monkeypatch.setattr(time, "monotonic", clock)
    w = writer()
    gauges = metrics.EnvelopeGauges()
    monkeypatch.setattr(metrics, "envelopes", gauges)
    gone, live = ("team-a", "removed-by-hand"), ("team-b", "live")
    with w.keeping(*live):
        for key in (gone, live):
            with w.keeping(*key) if key == gone else contextlib.nullcontext():
                w._parsed[key] = {}
                w._told[key] = {}
                w._reported_refusals[key] = {("uid", 1, "Refused", "no")}
                gauges.unhealthy(*key)
        clock.now += LET_GO_SECONDS / 2
        with w.keeping("team-c", "new"):  # a daemon starts: the sweep runs, too early
            pass
        assert gone in w._parsed
        clock.now += LET_GO_SECONDS
        with w.keeping("team-c", "newer"):
            pass
        assert gone not in w._parsed and gone not in w._told
        assert gone not in w._reported_refusals and gone not in gauges._healthy
        assert live in w._parsed and live in w._told and live in gauges._healthy


def test_refusals_reported_and_departed_lines_are_bounded_an_envelope() -> None:
    w = writer()
    with w.keeping("team-a", "wf"):
        for i in range(DEPARTED_KEPT + 50):
            w.saw_deleted(f"c{i}", deleted_claim(f"c{i}", "wf", "wf-uid"))
    assert len(w._departed[("team-a", "wf")]) == DEPARTED_KEPT
    w.forget("team-a", "wf")
    assert ("team-a", "wf") not in w._departed


def test_a_stuck_envelope_reports_each_refusal_once_and_keeps_few(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    w = writer()
    events: list[str] = []
    w.record = lambda _obj, _type, _reason, message: events.append(message)
    patched: list[Any] = []

    class Client:
        async def patch(self, *args: Any, **kwargs: Any) -> None:
            patched.append(args)

    w.client = Client()  # type: ignore[assignment]
    envelope = {"metadata": {"name": "wf", "namespace": "team-a", "uid": "u", "generation": 1}}

    async def refuse(message: str) -> None:
        with contextlib.suppress(LedgerStuckError):
            await w._refused(envelope, "InvariantViolation", message)

    async def scenario() -> None:
        for i in range(REFUSALS_KEPT * 3):
            await refuse(f"refusal {i}")
        await refuse(f"refusal {REFUSALS_KEPT * 3 - 1}")  # the same again: not reported

    asyncio.run(scenario())
    assert len(events) == REFUSALS_KEPT * 3
    assert len(w._reported_refusals[("team-a", "wf")]) <= REFUSALS_KEPT


def test_a_line_is_kept_for_an_envelope_whose_deletion_handler_is_between_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kopf calls a deletion handler again a second (or 30 s) after it hands back: a claim
    deleted in between keeps its line for the next call's pass, until the envelope has
    gone unkept for LET_GO_SECONDS."""
    clock = Monotonic()
    monkeypatch.setattr(time, "monotonic", clock)
    w = writer()
    with w.keeping("team-a", "going"):
        pass  # one call of the deletion handler, handed back to kopf
    w.saw_deleted("c1", deleted_claim("c1", "going", "going-uid"))
    assert set(w.departed("team-a", "going", "going-uid")) == {"c1"}
    clock.now += LET_GO_SECONDS + 1
    with w.keeping("team-b", "other"):  # a daemon starts: the sweep runs
        pass
    assert w.departed("team-a", "going", "going-uid") == {}
    w.saw_deleted("c2", deleted_claim("c2", "going", "going-uid"))
    assert w.departed("team-a", "going", "going-uid") == {}
