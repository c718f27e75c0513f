"""Which recorded moves post an Event, at each `--transition-events` level."""

from __future__ import annotations

import pytest

from reservoir.core.lifecycle import LedgerEvent
from reservoir.core.model import ClaimPhase
from reservoir.k8s.transition_events import TransitionEvents, posts_event

EXCEPTIONS, SETTLEMENTS, ALL = TransitionEvents


def move(phase: ClaimPhase | None, reason: str, warning: bool = False) -> LedgerEvent:
    return LedgerEvent("u-1", "c", reason, "", warning, phase)


@pytest.mark.parametrize(
    ("event", "posted_at"),
    [
        # The happy path's moves: only when every move is asked for.
        (move(ClaimPhase.TENTATIVE, "Reserved"), {ALL}),
        (move(ClaimPhase.COMMITTED, "CommitPointReached"), {ALL}),
        (move(ClaimPhase.RUNNING, "ExecutionStarted"), {ALL}),
        # A claim's ordinary end, as its worker declared it: from `settlements` on.
        (move(ClaimPhase.CONSUMED, "Completed"), {SETTLEMENTS, ALL}),
        (move(ClaimPhase.RELEASED, "Cancelled"), {SETTLEMENTS, ALL}),
        (move(ClaimPhase.RELEASED, "Deleted"), {SETTLEMENTS, ALL}),
        (move(ClaimPhase.RELEASED, "CancelledWhilePending"), {SETTLEMENTS, ALL}),
        (move(ClaimPhase.RELEASED, "FinishedBeforeCommit"), {SETTLEMENTS, ALL}),
        # Endings the worker did not declare, and every warning or note: always.
        (move(ClaimPhase.EXPIRED, "LeaseExpired"), {EXCEPTIONS, SETTLEMENTS, ALL}),
        (move(ClaimPhase.CONSUMED, "SettledAfterDetach"), {EXCEPTIONS, SETTLEMENTS, ALL}),
        (move(ClaimPhase.RELEASED, "ProviderNeverStarted"), {EXCEPTIONS, SETTLEMENTS, ALL}),
        (move(ClaimPhase.CONSUMED, "AmbiguityDeadlineQuarantine"), {EXCEPTIONS, SETTLEMENTS, ALL}),
        (move(ClaimPhase.RELEASED, "ForceSettled"), {EXCEPTIONS, SETTLEMENTS, ALL}),
        (move(ClaimPhase.REJECTED, "DuplicateRequestId"), {EXCEPTIONS, SETTLEMENTS, ALL}),
        (move(ClaimPhase.DETACHED, "LeaseLapsed"), {EXCEPTIONS, SETTLEMENTS, ALL}),
        (move(ClaimPhase.CONSUMED, "Completed", warning=True), {EXCEPTIONS, SETTLEMENTS, ALL}),
        (move(None, "CancelForwarded"), {EXCEPTIONS, SETTLEMENTS, ALL}),
    ],
)
def test_each_move_posts_an_event_from_its_level_on(
    event: LedgerEvent, posted_at: set[TransitionEvents]
) -> None:
    assert {level for level in TransitionEvents if posts_event(event, level)} == posted_at


def test_the_default_is_exceptions() -> None:
    from reservoir.k8s.ledger_writer import LedgerWriter

    writer = LedgerWriter(None, lambda *_: None)  # type: ignore[arg-type]
    assert writer.transition_events is TransitionEvents.EXCEPTIONS
