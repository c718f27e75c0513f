"""Which of a claim's recorded moves also post a Kubernetes Event.

Every move is recorded in the claim's status (`status.ledger.history`) and counted by the
metrics whatever is chosen here; an Event is one more API write, about a tenth of what a
claim's whole life costs the API server. So by default a claim's ordinary life posts none:
its admission and commit (the happy path's moves) and its own ending as its worker declared
it (a final report, a cancel, a deletion before dispatch). What a person should hear of
always posts one: every warning, and every ending the worker did not declare (a lease
lapse, a provider's verdict, an ambiguity deadline, a force-settlement, a refusal).
"""

from __future__ import annotations

from enum import StrEnum

from reservoir.core.lifecycle import LedgerEvent
from reservoir.core.model import ClaimPhase


class TransitionEvents(StrEnum):
    """The operator's `--transition-events` (the chart's `transitionEvents`)."""

    EXCEPTIONS = "exceptions"  # warnings and endings the worker did not declare
    SETTLEMENTS = "settlements"  # and every settlement
    ALL = "all"  # and every move


# The happy path's moves.
ROUTINE_MOVES = frozenset({ClaimPhase.TENTATIVE, ClaimPhase.COMMITTED, ClaimPhase.RUNNING})
# A claim's own ending, declared by its worker or its owner (reservoir.core.lifecycle and
# reservoir.core.reconcile name them).
ROUTINE_ENDINGS = frozenset(
    {
        "Completed",
        "FinishedBeforeCommit",
        "FinishedBeforeAdmission",
        "Cancelled",
        "CancelledWhilePending",
        "Deleted",
        "DeletedWhilePending",
    }
)


def posts_event(event: LedgerEvent, level: TransitionEvents) -> bool:
    if level is TransitionEvents.ALL or event.warning or event.phase is None:
        return True
    if event.phase in ROUTINE_MOVES:
        return False
    if event.phase.terminal and event.reason in ROUTINE_ENDINGS:
        return level is TransitionEvents.SETTLEMENTS
    return True
