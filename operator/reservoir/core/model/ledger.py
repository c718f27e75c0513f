"""The pieces of a ledger: a claim's line in its envelope's ledger (`LedgerEntry`, with its
`Transition`s, `Settlement`, `Overrun`, `LateReport`, `ProviderRecord`, `Adjustment`,
`RetryHold`, `DeviceHold` and `CompensationRecord`s), a child envelope's line in its
parent's or pool's ledger (`ChildEntry`), and the totals (`ResourceTotals`,
`EnvelopeSummary`). A claim's status mirrors its line with the same parts."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import (
    Field,
)

from reservoir.core.model.common import (
    MAX_ERROR_LENGTH,
    MAX_NAME_LENGTH,
    MAX_RESULT_LENGTH,
    MAX_TRANSITIONS,
    MESSAGE_LENGTH,
    SUMMARY_LENGTH,
    ChildPhase,
    ClaimPhase,
    DeadlineAction,
    DeviceNames,
    Model,
    Outcome,
    ProviderState,
    ResourceMap,
    Trigger,
    UpstreamCancel,
    device_names,
    recorded_map,
)


class Settlement(Model):
    """The one settlement of a claim. Written once; never reopened."""

    key: str = Field(
        max_length=128,
        description="Idempotency key: claim UID, attempt and settlement version.",
    )
    phase: ClaimPhase = Field(description="The terminal phase the claim settled in.")
    reason: str = Field(max_length=64, description="Why it settled.")
    outcome: Outcome | None = Field(default=None, description="The reported outcome.")
    at: datetime = Field(description="When the operator recorded it (operator clock, UTC).")


class LateReport(Model):
    """Reports that arrived after settlement: kept for audit, never applied. With count 0
    it holds the report as it stood at settlement, the baseline a late report differs from."""

    count: int = Field(default=0, ge=0, description="Distinct reports after settlement.")
    usage: ResourceMap = recorded_map("The last late report's cumulative usage.")
    final: bool = Field(default=False, description="Whether the last late report was final.")
    outcome: Outcome | None = Field(default=None, description="Its outcome, if any.")
    at: datetime | None = Field(default=None, description="When it was noticed.")


class Overrun(Model):
    """A usage report above the reservation. It proves the branch ran, so the claim is
    charged at most R (min(usage, R) per resource) and the excess is recorded here, never
    taken from the envelope."""

    usage: ResourceMap = recorded_map("The cumulative usage as reported.")
    excess: ResourceMap = recorded_map("What the report exceeds the reservation by.")
    final: bool = Field(default=False, description="Whether the report was final.")
    at: datetime = Field(description="When the operator first saw it.")


class Transition(Model):
    """One move of a claim, recorded by the ledger pass that decided it."""

    from_phase: ClaimPhase = Field(alias="from", description="The phase it left.")
    to: ClaimPhase = Field(description="The phase it entered.")
    reason: str = Field(max_length=48, description="Why, in one CamelCase word.")
    trigger: Trigger = Field(description="The source of the fact it was decided on.")
    at: datetime = Field(description="When (operator clock, UTC).")
    lease_generation: int = Field(
        default=0, ge=0, description="The claim's lease generation at the time."
    )


class ProviderRecord(Model):
    """The last thing the provider said about the upstream operation, and the lookups."""

    state: ProviderState | None = Field(default=None, description="Its last answer.")
    checked_at: datetime | None = Field(default=None, description="When it was last asked.")
    lookups: int = Field(default=0, ge=0, description="Lookups recorded so far.")
    failures: int = Field(default=0, ge=0, description="Lookups in a row that failed.")
    last_error: str | None = Field(
        default=None, max_length=MAX_ERROR_LENGTH, description="Why the last lookup failed."
    )
    next_lookup_at: datetime | None = Field(
        default=None, description="When it is asked next (bounded, jittered backoff)."
    )
    cancel_forwarded_at: datetime | None = Field(
        default=None,
        description="When a cancel was forwarded upstream: requested, never confirmed.",
    )
    cancel: str | None = Field(
        default=None, max_length=MAX_ERROR_LENGTH, description="What forwarding the cancel did."
    )
    cancel_forwarded_as: UpstreamCancel | None = Field(
        default=None,
        description="How the cancel was forwarded (Suspend or Delete, per upstreamCancel then): "
        "a suspended Job confirms nothing (it can be resumed).",
    )


class Adjustment(Model):
    """A late completion after a deadline decision, applied once while the envelope was
    open (or only recorded). The settlement it follows is never changed."""

    returned: ResourceMap = recorded_map("Returned to the envelope: charged, but not used.")
    charged: ResourceMap = recorded_map("Charged to the envelope: used, but not charged.")
    applied: bool = Field(description="False: recorded only (policy Record, envelope closed).")
    outcome: Outcome | None = Field(default=None, description="The late report's outcome.")
    at: datetime = Field(description="When (operator clock, UTC).")


class RetryHold(Model):
    """What a failed attempt did not consume, kept for the branch's next attempt."""

    resources: ResourceMap = recorded_map("Held for the next attempt.")
    until: datetime = Field(description="When the window closes and it returns.")
    taken_by: str | None = Field(
        default=None, max_length=MAX_NAME_LENGTH, description="The attempt that took it."
    )
    returned: bool = Field(default=False, description="The window closed: it went back.")

    @property
    def active(self) -> bool:
        """Still held for the next attempt (counted as reserved in the envelope)."""
        return self.taken_by is None and not self.returned


MAX_COMPENSATIONS = 8


class CompensationRecord(Model):
    """A compensation as the ledger applied it (or only recorded it): written once."""

    key: str = Field(max_length=63, description="The compensation's key.")
    charged: ResourceMap = recorded_map("What it charged to the envelope.")
    refunded: ResourceMap = recorded_map("What it gave back to the envelope.")
    applied: bool = Field(
        description="False: recorded only (the envelope had closed, or nothing it asked "
        "could move)."
    )
    reason: str = Field(max_length=256, description="Why, as asked.")
    reference: str | None = Field(
        default=None, max_length=MAX_RESULT_LENGTH, description="Its business reference."
    )
    note: str | None = Field(
        default=None,
        max_length=MESSAGE_LENGTH,
        description="What was not applied of what it asked, and why.",
    )
    at: datetime = Field(description="When (operator clock, UTC).")


def compensations_field() -> Any:
    return Field(
        default_factory=list,
        description="Compensations applied (or recorded) after settlement, oldest first.",
        json_schema_extra={"maxItems": MAX_COMPENSATIONS},
    )


class DeviceHold(Model):
    """Devices the scheduler allocated to a claim (through its ResourceClaim), recorded
    when the claim was admitted on them."""

    node: str = Field(max_length=MAX_NAME_LENGTH, description="The node the devices are on.")
    devices: DeviceNames = device_names("The allocated devices.")
    released: bool = Field(
        default=False,
        description="The allocation is gone (the devices are free): recorded after settlement.",
    )


class ClaimRecords(Model):
    """What a ledger knows of the lines its claims (or child envelopes) hold, without
    listing them."""

    count: int = Field(default=0, ge=0, description="How many held lines count.")
    digest: str = Field(
        default="",
        max_length=64,
        description="XOR of sha256(UID/stamp)[:16] over those lines, in hex.",
    )


class ChildRecords(ClaimRecords):
    """What a parent knows of the reserved lines its child envelopes hold, without listing
    them: their count, digest and what they hold together (so that what a child gone with
    its line held is known exactly, whatever else went in the same pass)."""

    reserved: ResourceMap = recorded_map("What those lines reserve here, together.")


class LedgerEntry(Model):
    """One claim's line in its envelope's ledger: the authoritative record of what the claim
    holds and how it settled. The claim's `status.ledger` holds it; the envelope's
    `status.entries` holds it too while a move of it is in flight (reservoir.core.inflight)."""

    claim: str = Field(max_length=MAX_NAME_LENGTH, description="The BranchClaim's name.")
    stamp: int = Field(
        default=0,
        ge=0,
        description="The envelope's `status.stamp` of the write that recorded this line's "
        "last capacity move: the claim's copy is current once its stamp is at least the "
        "envelope's in-flight copy's.",
    )
    branch: str = Field(default="", max_length=MAX_NAME_LENGTH, description="Branch name.")
    attempt: int = Field(default=1, ge=1, description="Attempt number of the claim.")
    phase: ClaimPhase = Field(description="The claim's phase as decided by the ledger.")
    reserved: ResourceMap = recorded_map("R: what the claim holds (or held) from the envelope.")
    usage: ResourceMap = recorded_map("Latest accepted cumulative usage (partial or final).")
    consumed: ResourceMap = recorded_map("C: usage committed at settlement.")
    released: ResourceMap = recorded_map("R − C: what settlement returned to the envelope.")
    first_reserved_at: datetime | None = Field(
        default=None, description="When capacity was first reserved; renewals never move it."
    )
    expires_at: datetime | None = Field(
        default=None, description="When the lease ends unless renewed (operator clock)."
    )
    renewals: int = Field(default=0, ge=0, description="How many renewals were granted.")
    renewed_at: datetime | None = Field(
        default=None,
        description="When the last renewal was granted (operator clock): expiresAt minus "
        "this is how long it granted, which a worker measures on its own monotonic clock.",
    )
    holder: str | None = Field(
        default=None,
        max_length=MAX_NAME_LENGTH,
        description="Who the lease was last granted to: the claim's spec.lease.holder at its "
        "reservation or when it names another (a handover), else the holder of each "
        "heartbeat granted.",
    )
    handovers: int = Field(
        default=0,
        ge=0,
        description="How many times spec.lease.holder handed the lease to another worker: "
        "each is a new lease generation, and fences the worker it was taken from.",
    )
    heartbeat: str | None = Field(
        default=None,
        max_length=128,
        description="The last heartbeat token seen from the lease holder.",
    )
    committed_at: datetime | None = Field(default=None, description="When it committed.")
    accepted_at: datetime | None = Field(
        default=None,
        description="When the provider's acceptance was first recorded (upstream.state "
        "Accepted or later, or its answer Pending or Running), apart from the commit and "
        "from the start: a dispatch recorded first keeps its own time.",
    )
    started_at: datetime | None = Field(default=None, description="When execution started.")
    queue_bound_at: datetime | None = Field(
        default=None,
        description="When the accepted, not started operation reached its queue bound (or "
        "the provider's deadline) and the policy's action was taken.",
    )
    detached_at: datetime | None = Field(
        default=None, description="When its lease lapsed after the commit point."
    )
    cancel_requested_at: datetime | None = Field(
        default=None,
        description=(
            "When the operator first saw a cancel (or deletion) asked after the commit point "
            "(or while a workload pod could still start)."
        ),
    )
    renewals_stopped_at: datetime | None = Field(
        default=None,
        description=(
            "When the operator first saw its lease renewals stop (the claim cancelled, or its "
            "envelope no longer admitting work): a heartbeat seen in that pass still renews."
        ),
    )
    pod_started_late: bool = Field(
        default=False,
        description="A workload pod was bound or ran after the claim settled (a late fact).",
    )
    deadline_action: DeadlineAction | None = Field(
        default=None, description="The ambiguity-deadline decision taken, once taken."
    )
    superseded_by: str | None = Field(
        default=None,
        max_length=MAX_NAME_LENGTH,
        description="The copy of its speculation group that won (its claim's name): this "
        "one lost and was cancelled for it, recorded once.",
    )
    dispatch_fenced: bool = Field(
        default=False, description="A Dispatch arrived after settlement and was refused."
    )
    overrun: Overrun | None = Field(default=None, description="A report above the reservation.")
    late: LateReport | None = Field(default=None, description="Reports after settlement.")
    devices: DeviceHold | None = Field(
        default=None, description="The devices held for a claim with a device resource."
    )
    handed_off_at: datetime | None = Field(
        default=None,
        description="When its devices were handed to its workload pod: recorded before the "
        "pod's scheduling gate is lifted, and the claim's commit point.",
    )
    handed_off_to: str | None = Field(
        default=None,
        max_length=64,
        description="The UID of the workload pod the devices were handed to: once that pod "
        "is gone (a UID never comes back), what it did is unknown.",
    )
    settlement: Settlement | None = Field(default=None, description="Set once, when settled.")
    provider: ProviderRecord | None = Field(
        default=None, description="Provider lookups for its upstream operation."
    )
    result: str | None = Field(
        default=None, max_length=MAX_RESULT_LENGTH, description="Its result reference."
    )
    history: list[Transition] = Field(
        default_factory=list,
        description="Its transitions, oldest first.",
        json_schema_extra={"maxItems": MAX_TRANSITIONS},
    )
    adjustment: Adjustment | None = Field(
        default=None, description="A late completion after a deadline decision."
    )
    retry: RetryHold | None = Field(
        default=None, description="What a failed attempt keeps for the branch's next attempt."
    )
    occupancy: ResourceMap = recorded_map(
        "Reusable resources: R times the seconds it was held (device-seconds, "
        "permit-seconds), recorded at settlement, for right-sizing. Never charged."
    )
    work_ended_at: datetime | None = Field(
        default=None,
        description="When the work was known to have ended (the provider's terminal answer) "
        "while its usage was still unknown: its Reusable resources returned then.",
    )
    reusable_returned: ResourceMap = recorded_map(
        "Reusable resources returned before settlement, once the work ended (devices once "
        "the scheduler freed them); the rest waits for the usage."
    )
    compensations: list[CompensationRecord] = compensations_field()

    @property
    def granted_seconds(self) -> float | None:
        """How long the last grant (or the first lease) was for, on the operator's clock."""
        start = self.renewed_at or self.first_reserved_at
        if start is None or self.expires_at is None:
            return None
        return (self.expires_at - start).total_seconds()

    @property
    def lease_generation(self) -> int:
        """1 at the first reservation, one more at each renewal granted and at each
        handover; 0 before."""
        if self.first_reserved_at is None:
            return 0
        return self.renewals + self.handovers + 1

    @property
    def cancel_requested(self) -> bool:
        """A cancel (or deletion) was asked after the commit point and recorded."""
        return self.cancel_requested_at is not None


class ResourceTotals(Model):
    """Per-resource totals. For every resource:
    committed + reserved + reconciling + lent + available == capacity + borrowed."""

    capacity: ResourceMap = recorded_map("The envelope's budget.")
    reserved: ResourceMap = recorded_map(
        "Held by Tentative, Committed and Running claims, and by open child envelopes."
    )
    committed: ResourceMap = recorded_map("Consumed by settled claims (never reversed).")
    reconciling: ResourceMap = recorded_map("Held by Detached claims: outcome unknown.")
    lent: ResourceMap = recorded_map("Lent to sibling envelopes and not yet repaid.")
    borrowed: ResourceMap = recorded_map("Borrowed from sibling envelopes, not yet repaid.")
    available: ResourceMap = recorded_map("Free for new claims of this envelope.")


class EnvelopeSummary(Model):
    """One-line renderings of the totals, for printer columns and humans."""

    capacity: str = Field(
        default="", max_length=SUMMARY_LENGTH, description="e.g. 'tokens=100 cost=5'."
    )
    available: str = Field(
        default="", max_length=SUMMARY_LENGTH, description="Available, per resource."
    )
    committed: str = Field(
        default="", max_length=SUMMARY_LENGTH, description="Committed, per resource."
    )
    live: int = Field(default=0, ge=0, description="Claims holding capacity now.")
    contracts: str = Field(
        default="",
        max_length=SUMMARY_LENGTH,
        description="Each resource's contract, e.g. 'nvidia.com/gpu=Reusable tokens=Consumable'.",
    )


class ChildEntry(Model):
    """A child envelope's line in its parent's ledger (or a root envelope's in its pool's):
    its whole capacity is one reserved entry until it closes, then R − C returns here. The
    child's `status.parent` holds it; the parent's `status.children` holds it too while a
    move of it is in flight (reservoir.core.childlines)."""

    envelope: str = Field(max_length=MAX_NAME_LENGTH, description="The child envelope's name.")
    stamp: int = Field(
        default=0,
        ge=0,
        description="The parent's `status.stamp` of the write that recorded this line's last "
        "move: the child's copy is current once it shows this stamp.",
    )
    namespace: str = Field(
        default="", max_length=63, description="Its namespace (in a pool's ledger)."
    )
    phase: ChildPhase = Field(description="Reserved (holds R here) or Settled.")
    reserved: ResourceMap = recorded_map("R: the child's capacity, held here.")
    consumed: ResourceMap = recorded_map("C: what the child committed, committed here too.")
    released: ResourceMap = recorded_map("R − C: the child's balance, returned here.")
    reserved_at: datetime | None = Field(default=None, description="When R was reserved.")
    tentative_claims: int | None = Field(
        default=None,
        ge=0,
        description="The most claims the child may hold before their commit point, granted "
        "by its pool out of its namespace's cap (unset: no cap of the pool's).",
    )
    priority_class: str | None = Field(
        default=None,
        max_length=63,
        description="The pool's priority class the child named when admitted (a pool's "
        "line): what preemption ranks it by.",
    )
    settled_at: datetime | None = Field(default=None, description="When it settled here.")
    reason: str | None = Field(
        default=None,
        max_length=64,
        description="Why it settled: Closed (the child closed and returned its balance), "
        "Withdrawn (deleted or closed before it was admitted), AdmittedElsewhere, "
        "ForceSettled (gone, charged in full by a person's decision).",
    )
