"""The ledger writer's two small policies about its reads and writes: which decisions are
taken again on claims read fresh (those resting on an absent fact), and which status
changes may wait for the next one (usage reported on the way)."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

from reservoir.core.model import (
    BranchClaimStatus,
    ClaimPhase,
    LedgerEntry,
    Transition,
    Trigger,
)
from reservoir.k8s.ledger_writer import decided_on_absence, only_usage_moved, reencoded_text

AT = datetime(2026, 11, 30, tzinfo=UTC)


def entry(phase: ClaimPhase, *moves: tuple[ClaimPhase, ClaimPhase, Trigger]) -> LedgerEntry:
    history = [
        Transition.model_validate(
            {"from": a, "to": b, "reason": "Why", "trigger": t, "at": AT.isoformat()}
        )
        for a, b, t in moves
    ]
    return LedgerEntry(claim="x", phase=phase, history=history)


TENTATIVE = entry(
    ClaimPhase.TENTATIVE, (ClaimPhase.PENDING, ClaimPhase.TENTATIVE, Trigger.ADMISSION)
)


def test_an_admission_is_read_again_it_rests_on_no_settlement_being_recorded() -> None:
    assert decided_on_absence(None, TENTATIVE)


def test_an_entry_that_did_not_move_is_not_read_again() -> None:
    assert not decided_on_absence(TENTATIVE, TENTATIVE)


def test_a_move_decided_on_a_fact_the_copy_shows_stands() -> None:
    committed = entry(
        ClaimPhase.COMMITTED,
        *[(t.from_phase, t.to, t.trigger) for t in TENTATIVE.history],
        (ClaimPhase.TENTATIVE, ClaimPhase.COMMITTED, Trigger.WORKER),
    )
    assert not decided_on_absence(TENTATIVE, committed)


def test_a_move_the_clock_decided_is_read_again_even_followed_by_another() -> None:
    expired = entry(
        ClaimPhase.EXPIRED,
        (ClaimPhase.PENDING, ClaimPhase.TENTATIVE, Trigger.ADMISSION),
        (ClaimPhase.TENTATIVE, ClaimPhase.EXPIRED, Trigger.CLOCK),
    )
    assert decided_on_absence(TENTATIVE, expired)
    settled = entry(
        ClaimPhase.CONSUMED,
        (ClaimPhase.PENDING, ClaimPhase.TENTATIVE, Trigger.ADMISSION),
        (ClaimPhase.TENTATIVE, ClaimPhase.DETACHED, Trigger.CLOCK),
        (ClaimPhase.DETACHED, ClaimPhase.CONSUMED, Trigger.WORKER),
    )
    assert decided_on_absence(TENTATIVE, settled)


def test_a_move_without_a_recorded_transition_is_read_again() -> None:
    assert decided_on_absence(TENTATIVE, LedgerEntry(claim="x", phase=ClaimPhase.RELEASED))


def test_only_a_change_in_usage_alone_may_wait() -> None:
    line = LedgerEntry(claim="a", phase=ClaimPhase.COMMITTED)
    before = BranchClaimStatus(phase=ClaimPhase.COMMITTED, ledger=line)
    reported = before.model_copy(
        update={"ledger": line.model_copy(update={"usage": {"tokens": Decimal(3)}})}
    )
    assert only_usage_moved(before, reported)
    moved = reported.model_copy(update={"phase": ClaimPhase.CONSUMED})
    assert not only_usage_moved(before, moved)
    assert not only_usage_moved(before, before)
    assert not only_usage_moved(BranchClaimStatus(phase=ClaimPhase.COMMITTED), reported)


def test_text_the_api_server_reencodes_is_found_anywhere_in_a_status() -> None:
    assert not reencoded_text({"phase": "Tentative", "history": [{"reason": "café"}], "n": 3})
    assert reencoded_text({"conditions": [{"message": "state '<queued>'"}]})
    assert reencoded_text({"result": "https://x.example/r?a=1&b=2"})
    assert reencoded_text({"reserved": {"a>b": "1"}})
    assert reencoded_text(["line\u2028break"])
    assert reencoded_text("tab\there")
    assert not reencoded_text(None)
