"""`ReservationEnvelope`: a workflow's bounded parent budget. Its spec (`capacity`, the
admission, lease and deadline `EnvelopePolicy`, the HTTP `ProviderEndpoint`) and its status
(the ledger of its claims and children, its `ParentRecord`, loans and totals)."""

from __future__ import annotations

from datetime import datetime

from pydantic import (
    ConfigDict,
    Field,
)
from pydantic.config import JsonValue

from reservoir.core.model.common import (
    MAX_ACTIVE_CLAIMS_LIMIT,
    MAX_CONDITIONS,
    MAX_DEPTH,
    MAX_ENVELOPE_CHILDREN,
    MAX_LEDGER_ENTRIES,
    MAX_LOANS,
    MAX_NAME_LENGTH,
    MAX_SECONDS,
    MESSAGE_LENGTH,
    OBJECT_NAME,
    SPECULATION_GROUP,
    Condition,
    DeadlineAction,
    EnvelopePhase,
    EnvelopeState,
    Fallback,
    LateCompletion,
    Model,
    ParentKind,
    PhysicalHold,
    QueueBoundAction,
    ResourceMap,
    SpeculationWinner,
    UpstreamCancel,
    recorded_map,
    resource_map,
)
from reservoir.core.model.contract import (
    CAPACITY_RULES,
    CONTRACTS_NAME_CAPACITY,
    Contract,
    ContractBook,
    contracts_field,
)
from reservoir.core.model.ledger import (
    ChildEntry,
    ChildRecords,
    ClaimRecords,
    EnvelopeSummary,
    LedgerEntry,
    ResourceTotals,
)
from reservoir.core.model.lending import Borrowing, BorrowRequest, Lending, Loan
from reservoir.core.model.preemption import Preemption

SECRET_KEY = "^[-._a-zA-Z0-9]+$"


class SecretKeyRef(Model):
    name: str = Field(
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        pattern=OBJECT_NAME,
        description="A Secret in the envelope's namespace.",
    )
    key: str = Field(
        min_length=1,
        max_length=253,
        pattern=SECRET_KEY,
        description="The key holding the token.",
    )


OPERATION_URL = r"^https?://[^\s]+$"


class ProviderEndpoint(Model):
    """The HTTP provider contract (README "Provider adapters"): GET the status URL with the
    operation id substituted; the answer is JSON {operationId, state, usage, result}."""

    status_url: str = Field(
        max_length=1024,
        pattern=OPERATION_URL,
        alias="statusURL",
        description="GET for an operation's status; '{operationId}' is replaced by the "
        "claim's upstream.operationId (URL-escaped).",
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.contains('{operationId}')",
                    "message": "statusURL names {operationId}",
                }
            ]
        },
    )
    cancel_url: str | None = Field(
        default=None,
        max_length=1024,
        pattern=OPERATION_URL,
        alias="cancelURL",
        description="POST to ask for cancellation (same substitution). Unset: the provider "
        "cannot cancel.",
    )
    token_secret: SecretKeyRef | None = Field(
        default=None,
        description="A bearer token for both calls, from a Secret the operator is allowed "
        'to read: its namespace grants it (README "Security model").',
    )


class EnvelopePolicy(Model):
    max_active_claims: int | None = Field(
        default=None,
        ge=1,
        le=MAX_ACTIVE_CLAIMS_LIMIT,
        description="Most claims that may hold capacity at once (fan-out cap). "
        f"Unset means {MAX_ACTIVE_CLAIMS_LIMIT}.",
    )
    max_tentative_claims: int | None = Field(
        default=None,
        ge=0,
        le=MAX_ACTIVE_CLAIMS_LIMIT,
        description="Most claims that may hold capacity before their commit point. "
        "Unset means no separate cap.",
    )
    default_lease_seconds: int = Field(
        default=60,
        ge=1,
        le=MAX_SECONDS,
        description="Lease a claim gets when it reserves, and per renewal, unless the claim "
        "asks for less.",
    )
    max_claim_lifetime_seconds: int = Field(
        default=3600,
        ge=1,
        le=MAX_SECONDS,
        description="No renewal extends a claim's lease past this long after it first reserved.",
    )
    max_renewals: int | None = Field(
        default=None,
        ge=0,
        description="Renewal budget per claim; unset means bounded only by the lifetime.",
    )
    max_queue_seconds: int = Field(
        default=600,
        ge=1,
        le=MAX_SECONDS,
        description="A claim still Pending this long after creation is Rejected "
        "(reason MaxQueueAge).",
    )
    physical_hold: PhysicalHold = Field(
        default=PhysicalHold.TENTATIVE,
        description="Tentative: a claim with device resources is admitted only once its "
        "devices are allocated and held. Commit: a speculative branch holds only its logical "
        "budget, and asks the scheduler for devices when it is dispatched or its workload "
        "pod appears (it may then wait for devices).",
    )
    fallback: Fallback = Field(
        default=Fallback.WAIT,
        description="Wait: a claim that does not fit waits Pending in priority order. "
        "Fail: it is Rejected at once with a reason the caller can act on.",
    )
    settled_claim_ttl_seconds: int | None = Field(
        default=None,
        alias="settledClaimTTLSeconds",
        ge=0,
        le=MAX_SECONDS,
        description="The operator deletes a settled claim this long after its settlement "
        "(the claim's status keeps the record until then). Unset: settled claims stay until "
        "someone deletes them.",
    )
    ambiguity_deadline_seconds: int = Field(
        default=600,
        ge=1,
        le=MAX_SECONDS,
        description="How long a Detached claim (outcome unknown) waits for its final "
        "report before the deadline action applies.",
    )
    speculation_winner: SpeculationWinner = Field(
        default=SpeculationWinner.FIRST_COMMIT,
        description="Which copy of a speculation group (claims' spec.speculationGroup) wins: "
        "FirstCommit, the first recorded at its commit point; FirstSuccess, the first "
        "recorded settled with outcome Succeeded. The others are cancelled.",
    )
    at_ambiguity_deadline: DeadlineAction = Field(
        default=DeadlineAction.QUARANTINE,
        description="Hold: keep its capacity reconciling until a report comes. "
        "Quarantine: charge the whole reservation as consumed (safe for scarce "
        "capacity). Release: return it to the envelope. Recorded on the claim.",
    )
    provider: ProviderEndpoint | None = Field(
        default=None,
        description="An HTTP status endpoint for the claims' upstream operations (those "
        "with upstream.operationId and supportsStatus and no upstream.ref): looked up for "
        "claims that need it (Detached, cancel requested, submitted but not accepted), with "
        "bounded, jittered backoff.",
    )
    queue_bound_seconds: int | None = Field(
        default=None,
        ge=1,
        le=MAX_SECONDS,
        description="How long an operation the provider accepted but has not started "
        "(upstream.state Accepted, or the provider's Pending) may hold capacity, from when "
        "the acceptance was recorded (lease-renewal.txt: an explicit provider-queue policy, "
        "acceptance is not execution). Unset: no bound. A claim's upstream.deadline (the "
        "provider's own expiry of the request) bounds it too.",
    )
    at_queue_bound: QueueBoundAction = Field(
        default=QueueBoundAction.CANCEL,
        description="At the queue bound: Cancel (a cancel is requested and forwarded to the "
        "provider; the capacity returns on its answer, a final report or the ambiguity "
        "deadline) or Hold (only recorded). Never a release on the clock alone.",
    )
    upstream_cancel: UpstreamCancel = Field(
        default=UpstreamCancel.SUSPEND,
        description="A cancel after the commit point, for a claim whose upstream.supportsCancel "
        "is true: Suspend (HTTP: the cancel call; a Job is suspended), Delete (HTTP: the "
        "cancel call; the referenced object is deleted) or Never (only recorded). Always "
        "recorded as requested, never as confirmed: the capacity waits for a terminal "
        "answer, a final report or the ambiguity deadline.",
    )
    provider_lookup_max_seconds: int = Field(
        default=300,
        ge=2,
        le=86400,
        description="The longest wait between two provider lookups of one claim (the wait "
        "doubles from 2 s after each lookup that does not settle it, with jitter).",
    )
    late_completion: LateCompletion = Field(
        default=LateCompletion.ADJUST,
        description="A final report or terminal provider answer after a deadline decision "
        "(Quarantine or Release): Adjust records one adjustment while the envelope is open "
        "(a quarantined claim that used less returns the difference; a released one that "
        "used more is charged it, at most what the envelope has available). Record only "
        "records it. The settlement itself never changes.",
    )
    lending: Lending | None = Field(
        default=None,
        description="Lend unused balance to sibling envelopes (same parent envelope) whose "
        "claims wait for capacity. Unset (the default): lend nothing. A loan is recorded in "
        "both ledgers, never revoked by preemption: the borrower repays as its claims "
        "settle, and what its claims consumed of the loan is charged here when it closes.",
    )


ENVELOPE_SPEC_RULES: list[JsonValue] = [
    CONTRACTS_NAME_CAPACITY,
    {
        "rule": "has(self.parent) == has(oldSelf.parent) && "
        "(!has(self.parent) || self.parent == oldSelf.parent)",
        "message": "parent is fixed at creation: create a new envelope to draw from another",
    },
    {
        "rule": "!has(self.parent) || self.capacity == oldSelf.capacity",
        "message": "a child envelope's capacity was reserved from its parent: it cannot change",
    },
]


class ReservationEnvelopeSpec(Model):
    """A workflow's budget and the policy its claims are admitted under."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": ENVELOPE_SPEC_RULES})

    capacity: ResourceMap = resource_map(
        "The budget, per resource: {tokens: 100k, cost: '12.50', nvidia.com/gpu: 8}. "
        "Required, with at least one resource. An amount may grow, never shrink (with a "
        "parent it is fixed); the set of resources is fixed at creation (it bounds the "
        "ledger's size).",
        *CAPACITY_RULES,
        required=True,
    )
    contracts: dict[str, Contract] = contracts_field("envelope")
    state: EnvelopeState = Field(
        default=EnvelopeState.OPEN,
        description="Open admits claims. Closed admits none; the remaining balance is "
        "released once every claim has settled.",
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self == oldSelf || oldSelf == 'Open'",
                    "message": "a Closed envelope cannot be reopened",
                }
            ]
        },
    )
    lifetime_seconds: int | None = Field(
        default=None,
        ge=1,
        le=MAX_SECONDS,
        description="The envelope expires this long after creation: it admits no new "
        "claims and releases its balance once every claim has settled. Once it has expired "
        "(status.phase Expired) it can only be lowered, never raised or removed.",
    )
    policy: EnvelopePolicy = Field(
        default_factory=EnvelopePolicy,
        description="Admission, lease and deadline policy. A field set here overrides the "
        "serving class's preset; one set by neither takes its default.",
    )
    serving_class: str | None = Field(
        default=None,
        max_length=63,
        pattern=SPECULATION_GROUP,
        description="A serving class: named presets of the policy (lease length, queue "
        "bounds, the ambiguity deadline and its action, the cancellation mode) and of "
        "priority. Built in: Interactive, Batch, Agentic; an administrator adds classes in "
        "the chart (servingClasses). The envelope's own policy fields override it.",
    )
    parent: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        pattern=OBJECT_NAME,
        description="A ReservationEnvelope (same namespace) this envelope draws its capacity "
        "from: the parent admits it like a claim (it waits Pending until the parent has "
        "room), and when it closes its committed total stays committed in the parent and "
        "its balance returns there. Unset: the envelope is a root, drawn from the "
        f"ReservationPool covering its namespace if there is one. Fixed at creation; trees "
        f"are at most {MAX_DEPTH} envelopes deep.",
    )
    priority: int = Field(
        default=0,
        ge=-1_000_000,
        le=1_000_000,
        description="Order among what waits inside the same parent envelope (claims and "
        "child envelopes alike): higher first, then older first. A pool orders the root "
        "envelopes of its tenants by the classes its administrator defines "
        "(priorityClassName), never by this number.",
    )
    priority_class_name: str | None = Field(
        default=None,
        max_length=63,
        pattern=SPECULATION_GROUP,
        description="A root envelope's class in its pool's queue: one of the pool's "
        "priorityClasses that its namespace may use. Unset: value 0. (Ignored for an "
        "envelope with a parent: its parent orders it by priority.)",
    )


class ParentRecord(Model):
    """Where this envelope's capacity comes from, recorded once when it was admitted (and
    its settlement there, mirrored once the parent recorded it)."""

    kind: ParentKind = Field(description="Root, ReservationEnvelope or ReservationPool.")
    name: str = Field(default="", max_length=MAX_NAME_LENGTH, description="The parent's name.")
    uid: str = Field(default="", max_length=64, description="The parent's UID.")
    depth: int = Field(
        default=1, ge=1, le=MAX_DEPTH, description="1 for a root; one more than its parent."
    )
    admitted_at: datetime | None = Field(
        default=None,
        description="When the parent's ledger was seen holding this envelope's capacity. "
        "Unset: never admitted (withdrawn before).",
    )
    reserved: ResourceMap = recorded_map(
        "What the parent holds for it: the envelope's capacity from then on."
    )
    stamp: int = Field(
        default=0,
        ge=0,
        description="The stamp of the parent's line it recorded (its `status.children` copy "
        "is retired once this shows it).",
    )
    tentative_claims: int | None = Field(
        default=None,
        ge=0,
        description="The most claims it may hold before their commit point, as its pool "
        "granted (its own policy.maxTentativeClaims may be lower).",
    )
    priority_class: str | None = Field(
        default=None,
        max_length=63,
        description="The pool's priority class it named when admitted: what preemption "
        "ranks it by from then on.",
    )
    settled: ChildEntry | None = Field(
        default=None, description="This envelope's settled line in its parent's ledger."
    )


MAX_SPECULATION_GROUPS = 128  # winners an envelope remembers: ~320 bytes each at most


class ReservationEnvelopeStatus(ContractBook):
    phase: EnvelopePhase = Field(default=EnvelopePhase.PENDING, description="Envelope phase.")
    summary: EnvelopeSummary = Field(
        default_factory=EnvelopeSummary, description="Totals rendered for `kubectl get`."
    )
    totals: ResourceTotals = Field(
        default_factory=ResourceTotals,
        description="The ledger's per-resource totals. For every resource: "
        "committed + reserved + reconciling + available == capacity.",
    )
    entries: dict[str, LedgerEntry] = Field(
        default_factory=dict,
        description="The ledger lines in flight, keyed by claim UID: capacity moves recorded "
        "here and not yet shown by the claim's own `status.ledger` (each claim holds its "
        "line; this record is retired once the claim shows its stamp).",
        json_schema_extra={"maxProperties": MAX_LEDGER_ENTRIES},
    )
    stamp: int = Field(
        default=0,
        ge=0,
        description="Raised by each write that moves capacity: the stamp of the lines it moved.",
    )
    claim_records: ClaimRecords | None = Field(
        default=None,
        description="The count and a digest of the lines held by claims (not in flight) that "
        "still count toward the totals: a pass checks its view of the claims against it.",
    )
    counts: dict[str, int] = Field(
        default_factory=dict,
        description="Number of claims per phase.",
        json_schema_extra={"maxProperties": 16},
    )
    speculation: dict[str, str] = Field(
        default_factory=dict,
        description="Each speculation group's winner (claim name), recorded once it is "
        "decided and kept for the envelope's life, so that it outlives the winner's claim "
        f"(at most {MAX_SPECULATION_GROUPS} groups; beyond, the losers' lines keep it).",
        json_schema_extra={
            "maxProperties": MAX_SPECULATION_GROUPS,
            "additionalProperties": {"type": "string", "maxLength": MAX_NAME_LENGTH},
        },
    )
    children: dict[str, ChildEntry] = Field(
        default_factory=dict,
        description="The lines of child envelopes in flight, keyed by UID: moves recorded "
        "here (reserved, settled, withdrawn) and not yet shown by the child's own "
        "`status.parent` (each child holds its line; this record is retired once the child "
        "shows its stamp).",
        json_schema_extra={"maxProperties": MAX_ENVELOPE_CHILDREN},
    )
    child_records: ChildRecords | None = Field(
        default=None,
        description="The count and a digest of the reserved lines held by child envelopes "
        "(not in flight): a pass checks its view of the children against it.",
    )
    parent: ParentRecord | None = Field(
        default=None,
        description="Where the capacity comes from: set when the envelope opens.",
    )
    queue_reason: str | None = Field(
        default=None, max_length=MESSAGE_LENGTH, description="Why the envelope is still Pending."
    )
    closed_by_parent: bool = Field(
        default=False,
        description="Its parent or pool is being deleted (or is gone): it closes and "
        "cancels its claims as if deleted itself, and its own children do the same. "
        "Recorded once; it never goes back.",
    )
    preemption: Preemption | None = Field(
        default=None,
        description="Its decision on its pool's last preemption request (a pool's class "
        "with preemptionPolicy PreemptLowerPriority): Preempted (it closed) or Refused.",
    )
    loans: dict[str, Loan] = Field(
        default_factory=dict,
        description="Loans to siblings, keyed by the borrower's UID (policy.lending).",
        json_schema_extra={"maxProperties": MAX_LOANS},
    )
    borrowed: dict[str, Borrowing] = Field(
        default_factory=dict,
        description="Loans from siblings, keyed by the lender's UID.",
        json_schema_extra={"maxProperties": MAX_LOANS},
    )
    wants: BorrowRequest | None = Field(
        default=None, description="What its queue is short of, for siblings that lend."
    )
    balance_released: ResourceMap = recorded_map(
        "The balance released when the envelope closed or expired: to its parent or pool "
        "if it has one."
    )
    closed_at: datetime | None = Field(default=None, description="When it closed or expired.")
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Open, Closed and other conditions.",
        json_schema_extra={"maxItems": MAX_CONDITIONS},
    )
    observed_generation: int | None = Field(
        default=None, description="The spec generation the status reflects."
    )
