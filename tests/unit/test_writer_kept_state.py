"""What the ledger writer keeps about names a tenant chose (envelopes its claims name, its
claims' versions) goes once it cannot matter: a tenant that creates and deletes objects
for ever must not grow the operator's memory for ever (DESIGN.md §1.7)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from reservoir.core.model import ClaimPhase, LedgerEntry
from reservoir.k8s.ledger_writer import LedgerWriter, drop_departed


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
