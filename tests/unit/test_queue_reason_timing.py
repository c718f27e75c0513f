"""When a waiting claim's status says why it waits (reservoir.core.claimstatus)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from reservoir.core.claimstatus import WAITS_ITS_TURN, wait_told_at
from reservoir.core.model import BranchClaimStatus, ClaimPhase
from reservoir.core.policy import Admission
from reservoir.core.reconcile import MOVES_IN_FLIGHT, QUEUED

BORN = datetime(2026, 1, 1, tzinfo=UTC)
AFTER = timedelta(seconds=10)
UNTOLD = BranchClaimStatus.model_validate({"phase": "Pending"})  # the CRD's default


@pytest.mark.parametrize("reason", sorted(WAITS_ITS_TURN))
def test_a_claim_that_only_waits_its_turn_is_told_after_a_while(reason: str) -> None:
    assert wait_told_at(Admission(False, reason, "..."), UNTOLD, BORN, AFTER) == BORN + AFTER


def test_the_core_s_own_waits_are_waits_of_turn() -> None:
    assert {QUEUED.reason, MOVES_IN_FLIGHT.reason} <= WAITS_ITS_TURN


@pytest.mark.parametrize("reason", ["InvalidSpec", "EnvelopeNotFound", "AwaitingDevices"])
def test_a_problem_is_told_at_once(reason: str) -> None:
    assert wait_told_at(Admission(False, reason, "..."), UNTOLD, BORN, AFTER) is None


def test_a_claim_told_something_already_is_told_at_once() -> None:
    told = BranchClaimStatus(phase=ClaimPhase.PENDING, queue_reason="Queued: ...")
    assert wait_told_at(QUEUED, told, BORN, AFTER) is None
    assert wait_told_at(QUEUED, None, BORN, AFTER) is None  # an unreadable status


def test_zero_tells_every_wait_at_once() -> None:
    assert wait_told_at(QUEUED, UNTOLD, BORN, timedelta(0)) is None
