"""A claim's status, derived from its ledger entry: the mirror of the envelope's decision.
It can always be recomputed, so writing it late or twice is harmless.

The status carries the claim's line once, in `status.ledger` (`expanded` lays its fields
over the status for readers). Once a claim has settled, its line is the record when the
ledger compacts the entry away: `settled_record` reads it back (from the status fields of
a claim settled before `status.ledger` existed), and `settled_view` names the part of an
entry that record carries exactly (the API server keeps a settlement from ever changing
once written)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from reservoir.core.conditions import Desired, merge_conditions
from reservoir.core.model import (
    BranchClaimStatus,
    ClaimPhase,
    DeviceHold,
    LeaseStatus,
    LedgerEntry,
    PlacementStatus,
)
from reservoir.core.policy import Admission
from reservoir.core.text import MESSAGE_LENGTH, bounded


def claim_status(
    entry: LedgerEntry | None,
    pending: Admission | None,
    previous: BranchClaimStatus | None,
    generation: int | None,
    now: datetime,
    placement: PlacementStatus | None = None,
    deleting: bool = False,
    problem: str | None = None,
    awaiting_devices: str | None = None,
    envelope_uid: str | None = None,
) -> BranchClaimStatus:
    """`awaiting_devices`: an admitted claim that asked for its devices (policy Commit) and
    has none yet, with the scheduler's reason; shown as condition DevicesHeld=False."""
    previous = previous or BranchClaimStatus()
    unreadable = [Desired("InvalidSpec", True, "UnreadableSpec", problem)] if problem else []
    if awaiting_devices is not None and entry is not None:
        unreadable.append(Desired("DevicesHeld", False, "AwaitingDevices", awaiting_devices))
    elif entry is not None and entry.devices is not None:
        unreadable.append(Desired("DevicesHeld", True, "Allocated"))
    if entry is None:
        reason = pending.reason if pending else "Queued"
        message = pending.message if pending else "waiting for the operator"
        return BranchClaimStatus(
            phase=ClaimPhase.PENDING,
            queue_reason=bounded(f"{reason}: {message}", MESSAGE_LENGTH),
            conditions=merge_conditions(
                previous.conditions,
                [
                    Desired("Reserved", False, reason, message),
                    Desired("Settled", False, "Pending"),
                    *unreadable,
                ],
                now,
                generation,
            ),
            observed_generation=generation,
        )
    return BranchClaimStatus(
        phase=entry.phase,
        placement=placement or _placement(entry),
        # Only a claim settled before status.ledger existed carries a settlement of its own
        # in its status: the API server keeps it there for good (SETTLEMENT_IS_PERMANENT).
        settlement=previous.settlement,
        ledger=entry,
        lease=current_lease(entry),
        # Bound once to the envelope that decided on it (issue 21 #3).
        envelope_uid=previous.envelope_uid or envelope_uid or None,
        conditions=merge_conditions(
            previous.conditions, [*_conditions(entry, deleting), *unreadable], now, generation
        ),
        observed_generation=generation,
    )


def expanded(status: BranchClaimStatus) -> BranchClaimStatus:
    """A claim's status as its readers see it: the fields of its line (`status.ledger`)
    laid over the status. The operator writes each line once, in `status.ledger` (a claim
    status write costs the API server about a quarter less than with every field twice); a
    claim settled before `status.ledger` existed carries these fields in its status."""
    entry = status.ledger
    if entry is None:
        return status
    placement = status.placement or _placement(entry)
    return status.model_copy(update={**line_fields(entry, status), "placement": placement})


def line_fields(entry: LedgerEntry, status: BranchClaimStatus) -> dict[str, Any]:
    """Each of `LINE_FIELDS` as a reader finds it for `entry` on `status`."""
    return {
        "reserved": entry.reserved if entry.phase.holds_capacity or entry.settlement else {},
        "consumed": entry.consumed,
        "released": entry.released,
        "usage": entry.usage,
        "lease": _lease(entry),
        "settlement": entry.settlement or status.settlement,
        "late": entry.late if entry.settlement else None,
        "overrun": entry.overrun,
        "provider": entry.provider,
        "result": entry.result,
        "history": entry.history,
        "adjustment": entry.adjustment,
        "retry": entry.retry,
        "occupancy": entry.occupancy,
        "work_ended_at": entry.work_ended_at,
        "reusable_returned": entry.reusable_returned,
        "compensations": entry.compensations,
    }


# The reasons a claim waits its turn: behind others, at a cap, for room. Each passes on its
# own as claims ahead of it settle; nothing is asked of the claim's author.
WAITS_ITS_TURN = frozenset(
    {"Queued", "MaxActiveClaims", "MaxTentativeClaims", "InsufficientCapacity", "MovesInFlight"}
)
# A claim's status before the operator wrote any: the CRD's default, phase Pending alone.
UNTOLD = BranchClaimStatus()


def wait_told_at(
    pending: Admission, previous: BranchClaimStatus | None, created_at: datetime, after: timedelta
) -> datetime | None:
    """When a waiting claim's status is to say why it waits: None for at once. A claim that
    only waits its turn and was told nothing yet keeps its default status (Pending) for
    `after` from its creation: one admitted sooner costs no status write for its wait
    (a queue of hundreds, most admitted in seconds, wrote each one's reason). A problem,
    or a claim already told something, is told at once."""
    if pending.reason not in WAITS_ITS_TURN or previous != UNTOLD or after <= timedelta(0):
        return None
    return created_at + after


def set_aside(
    previous: BranchClaimStatus, message: str, generation: int | None, now: datetime
) -> BranchClaimStatus:
    """A claim bound to an envelope that was deleted and re-created under its name: its
    status stays as its own envelope left it, with a condition saying why nothing moves."""
    conditions = merge_conditions(
        previous.conditions,
        [Desired("EnvelopeReplaced", True, "EnvelopeReplaced", message)],
        now,
        generation,
    )
    return previous.model_copy(update={"conditions": conditions})


def _placement(entry: LedgerEntry) -> PlacementStatus | None:
    """Its devices, and the hand-off: a record that comes back into the ledger (a late
    adjustment) keeps both (found by the coalescing audit: the hand-off was lost)."""
    held = entry.devices
    if held is None:
        return None
    return PlacementStatus(
        node=held.node,
        devices=held.devices,
        devices_released=held.released,
        handed_off_at=entry.handed_off_at,
        handed_off_to=entry.handed_off_to,
    )


def current_lease(entry: LedgerEntry) -> LeaseStatus | None:
    """The lease a worker's writes must be fenced with (`spec.lease.fence`), as the claim's
    status carries it for the API server's admission rule to compare."""
    if entry.first_reserved_at is None:
        return None
    return LeaseStatus(
        holder=entry.holder, generation=entry.lease_generation, renewals=entry.renewals
    )


def _lease(entry: LedgerEntry) -> LeaseStatus | None:
    if entry.first_reserved_at is None:
        return None
    return LeaseStatus(
        holder=entry.holder,
        generation=entry.lease_generation,
        first_reserved_at=entry.first_reserved_at,
        renewed_at=entry.renewed_at,
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
    if entry.provider is not None and entry.provider.checked_at is not None:
        failing = entry.provider.failures > 0
        said = entry.provider.state.value if entry.provider.state else "nothing yet"
        message = entry.provider.last_error or "" if failing else f"the provider says {said}"
        wanted.append(
            Desired(
                "ProviderReachable", not failing, "LookupFailed" if failing else "Answered", message
            )
        )
    if entry.late is not None and entry.late.count > 0:
        wanted.append(Desired("LateReport", True, "ReportAfterSettlement"))
    if entry.dispatch_fenced:
        wanted.append(Desired("DispatchRefused", True, "ClaimAlreadySettled"))
    if entry.pod_started_late:
        wanted.append(Desired("PodStartedAfterSettlement", True, "LateFact"))
    if entry.devices is not None and settlement is not None:
        free = entry.devices.released
        wanted.append(
            Desired(
                "DevicesReleased",
                free,
                "AllocationRemoved" if free else "AwaitingDeallocation",
                ""
                if free
                else "settled; its devices count as free once their allocation is "
                "gone (once no pod uses them)",
            )
        )
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


def settled_view(entry: LedgerEntry) -> tuple[Any, ...]:
    """The part of a settled entry that the claim's status carries exactly."""
    return (
        entry.phase,
        entry.reserved,
        entry.consumed,
        entry.released,
        entry.usage,
        entry.settlement,
        entry.late,
        entry.overrun,
        entry.dispatch_fenced,
        entry.pod_started_late,
        entry.committed_at is not None,
        entry.cancel_requested_at,
        entry.devices,
        entry.provider,
        entry.result,
        entry.history,
        entry.adjustment,
        entry.retry,
        entry.occupancy,
        entry.work_ended_at,
        entry.reusable_returned,
        entry.handed_off_at if entry.devices is not None else None,
        entry.handed_off_to if entry.devices is not None else None,
        entry.compensations,
    )


def settled_record(
    status: BranchClaimStatus | None, uid: str, name: str, attempt: int
) -> LedgerEntry | None:
    """The settled entry a claim's status carries, or None if it carries none of its own
    (not settled, or a settlement whose key names another claim)."""
    if status is None or not status.phase.terminal:
        return None
    line = status.ledger
    if line is not None and line.settlement is not None and line.phase.terminal:
        # The claim's own line (written there, and only there, since status.ledger exists).
        return line if line.settlement.key.startswith(f"{uid}/") else None
    if status.settlement is None or not status.settlement.key.startswith(f"{uid}/"):
        return None
    # A claim settled before status.ledger existed: its status carries the record.
    true = {c.type: c for c in status.conditions if c.status == "True"}
    committed, cancel = true.get("Committed"), true.get("CancelRequested")
    lease = status.lease
    return LedgerEntry(
        claim=name,
        attempt=attempt,
        phase=status.phase,
        reserved=status.reserved,
        usage=status.usage,
        consumed=status.consumed,
        released=status.released,
        first_reserved_at=lease.first_reserved_at if lease else None,
        expires_at=lease.expires_at if lease else None,
        renewals=lease.renewals if lease else 0,
        committed_at=committed.last_transition_time if committed else None,
        cancel_requested_at=cancel.last_transition_time if cancel else None,
        dispatch_fenced="DispatchRefused" in true,
        pod_started_late="PodStartedAfterSettlement" in true,
        overrun=status.overrun,
        late=status.late,
        devices=_device_hold(status.placement),
        handed_off_at=status.placement.handed_off_at if status.placement else None,
        handed_off_to=status.placement.handed_off_to if status.placement else None,
        settlement=status.settlement,
        provider=status.provider,
        result=status.result,
        history=status.history,
        adjustment=status.adjustment,
        retry=status.retry,
        occupancy=status.occupancy,
        work_ended_at=status.work_ended_at,
        reusable_returned=status.reusable_returned,
        compensations=status.compensations,
    )


def _device_hold(placement: PlacementStatus | None) -> DeviceHold | None:
    if placement is None or placement.node is None or not placement.devices:
        return None
    return DeviceHold(
        node=placement.node, devices=placement.devices, released=placement.devices_released
    )
