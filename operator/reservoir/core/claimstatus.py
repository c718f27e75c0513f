"""A claim's status, derived from its ledger entry: the mirror of the envelope's decision.
It can always be recomputed, so writing it late or twice is harmless."""

from __future__ import annotations

from datetime import datetime

from reservoir.core.conditions import Desired, merge_conditions
from reservoir.core.model import (
    BranchClaimStatus,
    ClaimPhase,
    LeaseStatus,
    LedgerEntry,
    PlacementStatus,
)
from reservoir.core.policy import Admission


def claim_status(
    entry: LedgerEntry | None,
    pending: Admission | None,
    previous: BranchClaimStatus | None,
    generation: int | None,
    now: datetime,
    placement: PlacementStatus | None = None,
    deleting: bool = False,
) -> BranchClaimStatus:
    previous = previous or BranchClaimStatus()
    if entry is None:
        reason = pending.reason if pending else "Queued"
        message = pending.message if pending else "waiting for the operator"
        return BranchClaimStatus(
            phase=ClaimPhase.PENDING,
            queue_reason=f"{reason}: {message}",
            conditions=merge_conditions(
                previous.conditions,
                [Desired("Reserved", False, reason, message), Desired("Settled", False, "Pending")],
                now,
                generation,
            ),
            observed_generation=generation,
        )
    return BranchClaimStatus(
        phase=entry.phase,
        reserved=entry.reserved if entry.phase.holds_capacity or entry.settlement else {},
        consumed=entry.consumed,
        released=entry.released,
        usage=entry.usage,
        lease=_lease(entry),
        placement=placement,
        settlement=entry.settlement,
        late=entry.late if entry.late and entry.late.count else None,
        overrun=entry.overrun,
        conditions=merge_conditions(
            previous.conditions, _conditions(entry, deleting), now, generation
        ),
        observed_generation=generation,
    )


def _lease(entry: LedgerEntry) -> LeaseStatus | None:
    if entry.first_reserved_at is None:
        return None
    return LeaseStatus(
        generation=entry.renewals + 1,
        first_reserved_at=entry.first_reserved_at,
        expires_at=entry.expires_at,
        renewals=entry.renewals,
    )


def _conditions(entry: LedgerEntry, deleting: bool) -> list[Desired]:
    phase, settlement = entry.phase, entry.settlement
    wanted = [
        Desired("Reserved", phase.holds_capacity, phase.value),
        Desired(
            "Committed",
            entry.committed_at is not None,
            "CommitPointReached" if entry.committed_at else "NotCommitted",
        ),
        Desired(
            "Running",
            entry.started_at is not None and not phase.terminal,
            "ExecutionStarted" if entry.started_at else "NotStarted",
        ),
        Desired(
            "Detached",
            phase is ClaimPhase.DETACHED,
            "LeaseLapsed" if phase is ClaimPhase.DETACHED else "Attached",
            "outcome unknown: capacity held as reconciling" if phase is ClaimPhase.DETACHED else "",
        ),
        Desired(
            "CancelRequested",
            entry.cancel_requested,
            "CancelRequested" if entry.cancel_requested else "NotRequested",
        ),
        Desired(
            "Settled",
            settlement is not None,
            settlement.reason if settlement else "NotSettled",
            f"settled as {settlement.phase.value}" if settlement else "",
        ),
    ]
    if entry.overrun is not None:
        wanted.append(Desired("Overrun", True, "UsageAboveReservation"))
    if entry.late is not None and entry.late.count > 0:
        wanted.append(Desired("LateReport", True, "ReportAfterSettlement"))
    if entry.dispatch_fenced:
        wanted.append(Desired("DispatchRefused", True, "ClaimAlreadySettled"))
    if deleting and settlement is None:
        wanted.append(
            Desired(
                "DeletionBlocked",
                True,
                "AwaitingSettlement",
                "the claim is removed once it settles: report final usage, wait for the "
                "ambiguity deadline, or annotate reservoir.dev/force-settle",
            )
        )
    return wanted
