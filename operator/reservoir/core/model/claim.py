"""`BranchClaim`: one tool-call branch's draw on its envelope. Its spec (the requests and the
facts its orchestrator and worker declare, with the CEL rules that keep them facts, which
the claim's admission policy runs, and the `Compensation`s asked after settlement) and its
status (what the operator decided: the claim's ledger line, with its phase and conditions)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import Field

from reservoir.core.model.common import (
    DEVICE_CLASSES,
    DEVICE_COUNT_RULE,
    MAX_CONDITIONS,
    MAX_DEVICES_PER_CLAIM,
    MAX_LEASE_GENERATION,
    MAX_NAME_LENGTH,
    MAX_RESULT_LENGTH,
    MAX_SECONDS,
    MAX_TRANSITIONS,
    MESSAGE_LENGTH,
    OBJECT_NAME,
    SPECULATION_GROUP,
    ClaimPhase,
    CommitPoint,
    Condition,
    Model,
    Outcome,
    ResourceMap,
    UpstreamState,
    immutable,
    recorded_map,
    resource_map,
)
from reservoir.core.model.ledger import (
    MAX_COMPENSATIONS,
    Adjustment,
    CompensationRecord,
    LateReport,
    LedgerEntry,
    Overrun,
    ProviderRecord,
    RetryHold,
    Settlement,
    Transition,
    compensations_field,
)
from reservoir.core.model.placement import Placement, PlacementStatus
from reservoir.core.model.upstream import REQUEST_ID, Upstream

COMPENSATION_KEY = "^[A-Za-z0-9][-A-Za-z0-9_.:]{0,62}$"


class Compensation(Model):
    """A business reversal or follow-up charge after settlement (client-disconnect.txt: the
    `compensated` outcome), asked on the claim's spec and applied once by its key."""

    key: str = Field(
        max_length=63,
        pattern=COMPENSATION_KEY,
        description="Idempotency key: a compensation is applied once per key, however often "
        "it is sent.",
    )
    charge: ResourceMap = resource_map(
        "Charged to the envelope on top of the settlement (a follow-up charge), per "
        "Consumable resource."
    )
    refund: ResourceMap = resource_map(
        "Given back to the envelope (a reversal, or the void of an external authorization), "
        "per Consumable resource: at most what the claim was charged."
    )
    reason: str = Field(
        min_length=1, max_length=256, description="Why, for the record (a person's words)."
    )
    reference: str | None = Field(
        default=None,
        max_length=MAX_RESULT_LENGTH,
        description="The business record it follows: an invoice, a refund, an authorization.",
    )


class LeaseFence(Model):
    """The lease a write was made under, as the claim's `status.lease` showed it: the API
    server refuses a dispatch, usage or final report whose fence is not the current one
    (lease-renewal.txt: "a newer version or fencing token that must accompany subsequent
    actions"), so a worker whose lease moved on cannot act, even through `kubectl patch`."""

    holder: str | None = Field(
        default=None,
        max_length=MAX_NAME_LENGTH,
        description="status.lease.holder as read (absent while the lease names nobody).",
    )
    generation: int = Field(
        ge=0,
        le=MAX_LEASE_GENERATION,
        description="status.lease.generation as read (0 before the claim first holds capacity).",
    )


class LeaseSettings(Model):
    duration_seconds: int | None = Field(
        default=None,
        ge=1,
        le=MAX_SECONDS,
        description="Lease length asked for per reservation/renewal. It may only shorten the "
        "envelope's defaultLeaseSeconds, never lengthen it.",
    )
    holder: str | None = Field(
        default=None,
        max_length=MAX_NAME_LENGTH,
        description="The worker holding the lease. When set, only heartbeats from this "
        "holder (the Lease's holderIdentity) renew the claim, and only this holder's fence "
        "is accepted.",
    )
    fence: LeaseFence | None = Field(
        default=None,
        description="The lease this write was made under (status.lease as read): required on "
        "every write that dispatches or reports usage, an outcome, a result or a provider "
        "state, and refused by the API server unless it is the current one.",
    )


UPSTREAM_RANK = "{" + ", ".join(f"'{s.value}': {s.rank}" for s in UpstreamState) + "}"

# Rules over several fields of a claim's spec, written over `self` and `oldSelf` (the spec
# before and after a write) and checked by the claim's ValidatingAdmissionPolicy
# (reservoir.crdgen), on writes of the spec only. On the CRD's spec schema the API server
# ran them on every status write too, where the spec cannot change: measured, a seventh of
# the API server's CPU for each of the operator's claim status writes (bench/cel_costs.py).
# Every field they read has a schema default or is required, and each rule also reads
# absent fields as their default through has(): removing a field cannot skip a rule.
CLAIM_SPEC_RULES: list[dict[str, str]] = [
    {
        "rule": "!(has(oldSelf.dispatch) && oldSelf.dispatch) || "
        "(has(self.dispatch) && self.dispatch)",
        "message": "dispatch is a fact: once true it stays true",
    },
    {
        "rule": "!(has(oldSelf.cancel) && oldSelf.cancel) || (has(self.cancel) && self.cancel)",
        "message": "cancel is a fact: once true it stays true",
    },
    {
        "rule": "!(has(oldSelf.cancel) && oldSelf.cancel) || "
        "(has(self.dispatch) && self.dispatch) == (has(oldSelf.dispatch) && oldSelf.dispatch)",
        "message": "a cancelled branch cannot be dispatched: create a new claim (new attempt)",
    },
    {
        "rule": "!(has(oldSelf.upstream) && has(oldSelf.upstream.state)) || "
        "(has(self.upstream) && has(self.upstream.state) && "
        f"{UPSTREAM_RANK}[self.upstream.state] >= {UPSTREAM_RANK}[oldSelf.upstream.state])",
        "message": "upstream.state is a fact: it only moves forward (Submitted, Accepted, "
        "Running) and is never removed",
    },
    {
        "rule": "!has(self.final) || !self.final || has(self.outcome)",
        "message": "a final report needs an outcome (Succeeded, Failed or Cancelled)",
    },
    {
        "rule": "!has(oldSelf.final) || !oldSelf.final || (has(self.final) && self.final)",
        "message": "a final report cannot be un-finalized",
    },
    {
        "rule": "!(has(oldSelf.final) && oldSelf.final) || "
        "(has(self.dispatch) && self.dispatch) == (has(oldSelf.dispatch) && oldSelf.dispatch)",
        "message": "a branch that made its final report is not sent afterwards: "
        "create a new claim (new attempt)",
    },
    {
        "rule": "!has(oldSelf.final) || !oldSelf.final || "
        "(has(self.outcome) && has(oldSelf.outcome) && self.outcome == oldSelf.outcome)",
        "message": "outcome cannot change once the report is final",
    },
    {
        "rule": "!has(oldSelf.final) || !oldSelf.final || "
        "(has(self.usage) ? self.usage : {}) == (has(oldSelf.usage) ? oldSelf.usage : {})",
        "message": "usage cannot change once the report is final",
    },
    {
        "rule": "!(has(oldSelf.upstream) && has(oldSelf.upstream.deadline)) || "
        "(has(self.upstream) && has(self.upstream.deadline) && "
        "self.upstream.deadline == oldSelf.upstream.deadline)",
        "message": "upstream.deadline is set once: it cannot change or be removed",
    },
    {
        "rule": "!(has(oldSelf.upstream) && has(oldSelf.upstream.ref)) || "
        "(has(self.upstream) && has(self.upstream.ref) && "
        "self.upstream.ref == oldSelf.upstream.ref)",
        "message": "upstream.ref is set once: it cannot change or be removed",
    },
    {
        "rule": "!(has(oldSelf.upstream) && has(oldSelf.upstream.requestId)) || "
        "(has(self.upstream) && has(self.upstream.requestId) && "
        "self.upstream.requestId == oldSelf.upstream.requestId)",
        "message": "upstream.requestId is set once: it cannot change or be removed",
    },
    {
        "rule": "!(has(oldSelf.upstream) && has(oldSelf.upstream.operationId)) || "
        "(has(self.upstream) && has(self.upstream.operationId) && "
        "self.upstream.operationId == oldSelf.upstream.operationId)",
        "message": "upstream.operationId is set once: it cannot change or be removed",
    },
    {
        "rule": "!has(oldSelf.result) || (has(self.result) && self.result == oldSelf.result)",
        "message": "result is set once: it cannot change or be removed",
    },
    {
        "rule": "has(self.retryWindowSeconds) == has(oldSelf.retryWindowSeconds) && "
        "(!has(self.retryWindowSeconds) || self.retryWindowSeconds == oldSelf.retryWindowSeconds)",
        "message": "retryWindowSeconds is fixed at creation",
    },
    {
        "rule": "has(self.speculationGroup) == has(oldSelf.speculationGroup) && "
        "(!has(self.speculationGroup) || self.speculationGroup == oldSelf.speculationGroup)",
        "message": "speculationGroup is fixed at creation",
    },
]


class BranchClaimSpec(Model):
    """What one branch asks for, and the facts its orchestrator and worker declare."""

    envelope: str = Field(
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        pattern=OBJECT_NAME,
        description="The ReservationEnvelope (same namespace) this claim draws from.",
        json_schema_extra=immutable("envelope is immutable after creation"),
    )
    branch: str = Field(
        default="",
        max_length=MAX_NAME_LENGTH,
        description="The workflow branch (tool call) this claim is for.",
        json_schema_extra=immutable("branch is immutable after creation"),
    )
    attempt: int = Field(
        default=1,
        ge=1,
        le=1_000_000,
        description="Attempt number. A retry or speculative copy is a new claim.",
        json_schema_extra=immutable(
            "attempt is immutable: a retry is a new BranchClaim with a new attempt"
        ),
    )
    requests: ResourceMap = resource_map(
        "What to reserve, per resource of the envelope: {tokens: 20k}. Immutable. A device "
        f"resource ({', '.join(DEVICE_CLASSES)}) is a whole number of devices, at most "
        f"{MAX_DEVICES_PER_CLAIM}, held on one node.",
        {"rule": "self == oldSelf", "message": "requests are immutable after creation"},
        *(DEVICE_COUNT_RULE,),
        required=True,
    )
    priority: int = Field(
        default=0,
        ge=-1_000_000,
        le=1_000_000,
        description="Higher is admitted first; equal priorities queue by age.",
    )
    commit_point: CommitPoint = Field(
        default=CommitPoint.DISPATCH,
        json_schema_extra=immutable(
            "commitPoint is immutable: what makes a claim chargeable cannot change under it"
        ),
        description="Dispatch: the claim commits when spec.dispatch becomes true. "
        "PodScheduled/PodRunning: when its workload pod binds/starts (or did). Immutable.",
    )
    lease: LeaseSettings = Field(default_factory=LeaseSettings, description="Lease settings.")
    placement: Placement | None = Field(
        default=None, description="Placement hints for physical resources (GPUs)."
    )
    dispatch: bool = Field(
        default=False,
        description="True once the branch is sent: the commit point when commitPoint is "
        "Dispatch. A fact, so it never goes back to false, and a cancelled branch cannot be "
        "dispatched. Dispatch and cancel are separate facts: both true means the branch was "
        "dispatched first, so its capacity waits for the final usage report.",
    )
    cancel: bool = Field(
        default=False,
        description="True to prune the branch. Before the commit point the reservation is "
        "released at once; after it, this is only a request and the capacity waits for the "
        "final usage report or the ambiguity deadline. Never goes back to false.",
    )
    usage: ResourceMap = resource_map(
        "Cumulative usage so far, per resource (never a delta). A resource may not decrease "
        "or disappear. Usage above the reservation proves the branch ran: the claim is "
        "charged at most its reservation and the excess is recorded as an overrun.",
        {
            "rule": "oldSelf.all(k, k in self && "
            "quantity(self[k]).compareTo(quantity(oldSelf[k])) >= 0)",
            "message": "usage is cumulative: a reported resource may not decrease or disappear",
        },
    )
    final: bool = Field(
        default=False,
        description="True when usage is the final, confirmed consumption.",
    )
    outcome: Outcome | None = Field(
        default=None, description="Succeeded, Failed or Cancelled; required when final."
    )
    upstream: Upstream = Field(
        default_factory=Upstream, description="The provider operation this branch runs as."
    )
    result: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_RESULT_LENGTH,
        pattern=REQUEST_ID,
        description="A durable reference to the branch's result (a URI or an object's name, "
        "printable ASCII), "
        "reported with or before the final report. Recorded in status.ledger.result and kept "
        "after settlement, so a client that reconnects finds the outcome by the claim's "
        "name. Set once.",
    )
    compensations: list[Compensation] = Field(
        default_factory=list,
        description="Reversals and follow-up charges after settlement "
        "(`kubectl reservoir compensate`). Append-only: each is applied once, by its key, "
        "once the claim has settled and while its envelope is open; later ones are recorded "
        "only.",
        json_schema_extra={
            "maxItems": MAX_COMPENSATIONS,
            "default": [],
            "x-kubernetes-validations": [
                {
                    # Appended at the end only: they apply in the order sent, and the order
                    # decides what a capped refund gives back (found by review: reordered,
                    # the same two moved different amounts).
                    "rule": "size(self) >= size(oldSelf) && "
                    "oldSelf.all(o, self.indexOf(o) == oldSelf.indexOf(o))",
                    "message": "compensations are append-only: one sent is never changed, "
                    "moved or removed (send a new one with its own key, at the end)",
                },
                {
                    "rule": "self.all(a, self.exists_one(b, b.key == a.key))",
                    "message": "each compensation has its own key",
                },
            ],
        },
    )
    retry_window_seconds: int | None = Field(
        default=None,
        ge=1,
        le=MAX_SECONDS,
        description="If this attempt fails (outcome Failed), what it did not consume is kept "
        "for the branch's next attempt (a claim with the same branch and a higher attempt) "
        "for this long after settlement, then returned to the envelope. Fixed at creation.",
    )
    speculation_group: str | None = Field(
        default=None,
        max_length=63,
        pattern=SPECULATION_GROUP,
        description="Speculative copies of one branch in this envelope share a group: the "
        "first to win (the envelope's policy.speculationWinner: its commit point, or its "
        "success) wins, and the operator cancels the others, recording the winner in each "
        "loser's line. A loser settles by its own facts: released at once before its commit "
        "point, after it cancelled and settled by its usage. Fixed at creation.",
    )

    @property
    def declared(self) -> str:
        """The declared facts in a word: Hold, Dispatch, Cancel or Dispatch+Cancel."""
        facts = [word for word, on in (("Dispatch", self.dispatch), ("Cancel", self.cancel)) if on]
        return "+".join(facts) or "Hold"


class LeaseStatus(Model):
    holder: str | None = Field(
        default=None,
        max_length=MAX_NAME_LENGTH,
        description="Who the lease was last granted to: spec.lease.holder, or the holder of "
        "the heartbeat last granted. A write's spec.lease.fence.holder must match it.",
    )
    generation: int = Field(
        default=0,
        ge=0,
        le=MAX_LEASE_GENERATION,
        description="The lease's generation: 1 at the first reservation, one more at each "
        "renewal granted. A write's spec.lease.fence.generation must match it.",
    )
    first_reserved_at: datetime | None = Field(default=None, description="First reserved.")
    renewed_at: datetime | None = Field(default=None, description="Last renewal granted.")
    expires_at: datetime | None = Field(default=None, description="Lease end (operator clock).")
    renewals: int = Field(default=0, ge=0, description="Renewals granted.")


# Said of each field of a line that a claim's status carried beside `ledger` (LINE_FIELDS).
BEFORE_LINE = (
    "Written only for claims settled before status.ledger existed; since, in status.ledger."
)


class BranchClaimStatus(Model):
    phase: ClaimPhase = Field(default=ClaimPhase.PENDING, description="The claim's phase.")
    reserved: ResourceMap = recorded_map(f"What the claim holds (R). {BEFORE_LINE}")
    consumed: ResourceMap = recorded_map(f"What settlement committed (C). {BEFORE_LINE}")
    released: ResourceMap = recorded_map(f"What settlement returned (R − C). {BEFORE_LINE}")
    usage: ResourceMap = recorded_map(f"Latest accepted cumulative usage. {BEFORE_LINE}")
    lease: LeaseStatus | None = Field(default=None, description=f"The claim's lease. {BEFORE_LINE}")
    placement: PlacementStatus | None = Field(default=None, description="Node placement.")
    settlement: Settlement | None = Field(
        default=None, description=f"The settlement record. {BEFORE_LINE}"
    )
    late: LateReport | None = Field(
        default=None, description=f"Reports after settlement. {BEFORE_LINE}"
    )
    overrun: Overrun | None = Field(
        default=None, description=f"Usage above the reservation. {BEFORE_LINE}"
    )
    provider: ProviderRecord | None = Field(
        default=None,
        description=f"The provider's last answer about the upstream operation. {BEFORE_LINE}",
    )
    result: str | None = Field(
        default=None,
        max_length=MAX_RESULT_LENGTH,
        description="The result reference, from the final report or the provider: kept after "
        f"settlement (`kubectl reservoir result`). {BEFORE_LINE}",
    )
    history: list[Transition] = Field(
        default_factory=list,
        description=f"Every transition, oldest first. {BEFORE_LINE}",
        json_schema_extra={"maxItems": MAX_TRANSITIONS},
    )
    adjustment: Adjustment | None = Field(
        default=None, description=f"A late completion after a deadline decision. {BEFORE_LINE}"
    )
    retry: RetryHold | None = Field(
        default=None, description=f"What this failed attempt keeps for a retry. {BEFORE_LINE}"
    )
    occupancy: ResourceMap = recorded_map(
        f"Reusable resources: R times the seconds held. {BEFORE_LINE}"
    )
    work_ended_at: datetime | None = Field(
        default=None,
        description="When the work was known to have ended before its usage: its Reusable "
        f"resources returned then. {BEFORE_LINE}",
    )
    reusable_returned: ResourceMap = recorded_map(
        f"Reusable resources returned once the work ended. {BEFORE_LINE}"
    )
    compensations: list[CompensationRecord] = compensations_field()
    queue_reason: str | None = Field(
        default=None, max_length=MESSAGE_LENGTH, description="Why the claim is still Pending."
    )
    ledger: LedgerEntry | None = Field(
        default=None,
        description="The claim's ledger line: the authoritative record of what it holds and "
        "how it settled (its envelope keeps a copy only while a move of it is in flight).",
    )
    envelope_uid: str | None = Field(
        default=None,
        max_length=64,
        description="The UID of the envelope whose ledger decided on this claim, written with "
        "its first line and never changed: an envelope re-created under the same name never "
        "moves capacity for it (the claim is set aside with condition EnvelopeReplaced).",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Reserved, Committed, Running, Detached, CancelRequested, Settled, ...",
        json_schema_extra={"maxItems": MAX_CONDITIONS},
    )
    observed_generation: int | None = Field(default=None, description="Spec generation seen.")

    def to_api(self) -> dict[str, Any]:
        """As the API wants it, without the empty fields of a line (`LINE_FIELDS`): the
        operator writes the line once, in `ledger`."""
        empty = {name for name in LINE_FIELDS if not getattr(self, name)}
        return self.model_dump(mode="json", by_alias=True, exclude_none=True, exclude=empty)


# The fields of a claim's line that its status carried beside `ledger` before the line was
# written once: a claim settled then keeps its record in them (reservoir.core.claimstatus
# lays a line's fields over them for readers: `expanded`).
LINE_FIELDS = frozenset(
    {
        "reserved", "consumed", "released", "usage", "lease", "settlement", "late", "overrun",
        "provider", "result", "history", "adjustment", "retry", "occupancy", "work_ended_at",
        "reusable_returned", "compensations",
    }
)  # fmt: skip
