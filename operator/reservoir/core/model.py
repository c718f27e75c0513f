"""The object model of Reservoir's two kinds, as plain pydantic models.

`ReservationEnvelope` is a workflow's bounded parent budget; `BranchClaim` is one tool-call
branch's draw on it. Spec is written by people and orchestrators, status only by the
operator. Field names are the API's camelCase; descriptions become the CRD's, so
`kubectl explain` teaches the API. The CRD-only validation (CEL rules, bounds) lives next
to each field in `json_schema_extra`, and `reservoir.crdgen` turns these models into the
manifests under `crds/`.
"""

from __future__ import annotations

import re
from datetime import datetime
from decimal import Decimal
from enum import StrEnum
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    WithJsonSchema,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict, JsonValue

from reservoir.core.quantity import (
    MAX_QUANTITY_LENGTH,
    QUANTITY_PATTERN,
    format_quantity,
    parse_quantity,
)
from reservoir.core.scheduling import (
    MAX_NODE_SELECTOR_LABELS,
    MAX_TOLERATIONS,
    Affinity,
    Toleration,
    labels,
)

API_GROUP = "reservoir.dev"
API_VERSION = "v1alpha1"

# Bounds keep every object small enough for etcd and cheap for the API server's CEL cost
# budget. A full ledger at MAX_LEDGER_ENTRIES stays far below etcd's ~1.5 MiB object cap
# (measured by tests/unit/test_ledger_size.py). Every list, map and string of every spec
# and status is bounded (no schemaless field): a spec at every bound is at most
# SPEC_WORST_CASE_BYTES, 240,000 (a claim's, with placement hints and compensations:
# 229,143), computed from the generated schema by tests/unit/test_crds.py.
MAX_RESOURCES = 16
MAX_LEDGER_ENTRIES = 512
MAX_ACTIVE_CLAIMS_LIMIT = 256
MAX_NAME_LENGTH = 253
MAX_CONDITIONS = 16
MAX_SECONDS = 366 * 24 * 3600
SUMMARY_LENGTH = 1024  # one printer-column rendering of the totals
# Texts the operator generates (reservoir.core.text bounds them where they are made).
MESSAGE_LENGTH = 1024  # a condition's message, a queue reason
REASON_LENGTH = 64  # a condition's reason, a settlement's: one CamelCase word
# Resources held on real devices through Dynamic Resource Allocation (DESIGN.md §7), and
# the DeviceClass their devices come from. A claim's request for one is a device count.
DEVICE_CLASSES = {"nvidia.com/gpu": "gpu.reservoir.dev"}
MAX_DEVICES_PER_CLAIM = 32  # DRA allocates node-local devices: no node has more
MAX_DEVICE_NAME_LENGTH = 63
# Budgets nest (DESIGN.md §4): pool → envelope → child envelope → ...; a root envelope is at
# depth 1. Deeper trees are refused: every level is one more settlement to wait for.
MAX_DEPTH = 4
# Lines a ledger holds at once, settled ones included: child envelopes in an envelope's
# (their worst-case bytes are reserved in its byte budget, see reservoir.core.ledgersize),
# root envelopes in a pool's (fewer when its resources' names are long: see pool_lines).
MAX_ENVELOPE_CHILDREN = 64
MAX_CHILDREN = 256
MAX_POOL_NAMESPACES = 64
MAX_LOANS = 8  # loans an envelope has out (or in) at once
MAX_RESULT_LENGTH = 256  # a result reference: a URI or an object's name, not the result
MAX_TRANSITIONS = 6  # the phase graph is acyclic: at most 5 moves, plus an adjustment
MAX_ERROR_LENGTH = 96

Quantity = Annotated[
    Decimal,
    BeforeValidator(parse_quantity),
    PlainSerializer(format_quantity, return_type=str),
    WithJsonSchema(
        {"type": "string", "pattern": QUANTITY_PATTERN, "maxLength": MAX_QUANTITY_LENGTH}
    ),
]

RESOURCE_NAME = "^([a-z0-9.-]{1,253}/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
RESOURCE_NAME_RULE: JsonDict = {
    "rule": f"self.all(k, size(k) <= 63 && k.matches('{RESOURCE_NAME}'))",
    "message": "resource names look like 'tokens', 'cost' or 'nvidia.com/gpu' "
    "(an optional DNS prefix and a name of at most 63 characters)",
}


DEVICE_COUNT_RULE: JsonDict = {
    "rule": " && ".join(
        f"(!('{name}' in self) || (quantity(self['{name}']).isInteger() && "
        f"quantity(self['{name}']).compareTo(quantity('{MAX_DEVICES_PER_CLAIM}')) <= 0))"
        for name in DEVICE_CLASSES
    ),
    "message": f"device resources ({', '.join(DEVICE_CLASSES)}) are whole numbers of devices, "
    f"at most {MAX_DEVICES_PER_CLAIM} per claim (devices are held on one node)",
}

QUANTITY_BOUND_RULE: JsonDict = {
    "rule": "self.all(k, quantity(self[k]).compareTo(quantity('1E')) <= 0)",
    "message": "quantities may not exceed 1E (10^18)",
}


def resource_map(description: str, *rules: JsonDict, required: bool = False) -> Any:
    """A bounded map of resource name to quantity, e.g. {"tokens": "20k"}.

    A map with a transition rule (one that reads oldSelf) is either required or defaults
    to `{}` in the schema: the API server fills a removed map back in before validation,
    so the rule cannot be skipped by deleting the field (a transition rule only runs when
    both the old and the new value exist)."""
    extra: JsonDict = {
        "maxProperties": MAX_RESOURCES,
        "x-kubernetes-validations": [RESOURCE_NAME_RULE, QUANTITY_BOUND_RULE, *rules],
    }
    if not required and any("oldSelf" in str(rule.get("rule")) for rule in rules):
        extra["default"] = {}
    if required:
        return Field(description=description, json_schema_extra={**extra, "minProperties": 1})
    return Field(default_factory=dict, description=description, json_schema_extra=extra)


def recorded_map(description: str) -> Any:
    """A bounded map of resource name to quantity that the operator records (a ledger
    line, a total, a claim's status): no CEL rules. Its names and amounts come from specs
    the rules of `resource_map` already checked, and a rule here would run again on every
    map of every ledger entry on each ledger write (about a tenth of the API server's CPU
    for writing a 40-entry ledger, measured on this project's control plane). A status
    write is the operator's, never a user's input."""
    return Field(
        default_factory=dict,
        description=description,
        json_schema_extra={"maxProperties": MAX_RESOURCES},
    )


ResourceMap = dict[str, Quantity]


class Model(BaseModel):
    """Base: camelCase on the wire, snake_case in Python, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
    )

    def to_api(self) -> dict[str, Any]:
        """The object as the Kubernetes API wants it: camelCase, no nulls."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


# --- enums -----------------------------------------------------------------------------


class CommitPoint(StrEnum):
    """The event that makes a claim chargeable: no longer freely releasable."""

    DISPATCH = "Dispatch"
    POD_SCHEDULED = "PodScheduled"
    POD_RUNNING = "PodRunning"


class Outcome(StrEnum):
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    CANCELLED = "Cancelled"


class UpstreamState(StrEnum):
    """How far the provider has confirmed the work: accepted is not running."""

    SUBMITTED = "Submitted"
    ACCEPTED = "Accepted"
    RUNNING = "Running"

    @property
    def rank(self) -> int:
        """How far it has got: the state only moves up (CEL rule UPSTREAM_RANK)."""
        return list(UpstreamState).index(self)


class ProviderState(StrEnum):
    """What the provider says about the upstream operation, in the response contract's words.
    Succeeded, Failed, Cancelled and NeverStarted are terminal answers: authoritative, the
    claim settles on them (the first three only with the usage: a completion that does not
    say what was used is not proof of zero usage). Unknown (or a lookup that failed) keeps
    the claim as it is."""

    PENDING = "Pending"  # accepted or queued, not started
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    CANCELLED = "Cancelled"
    NEVER_STARTED = "NeverStarted"  # never started and never will: nothing ran
    UNKNOWN = "Unknown"

    @property
    def terminal(self) -> bool:
        return self in (
            ProviderState.SUCCEEDED,
            ProviderState.FAILED,
            ProviderState.CANCELLED,
            ProviderState.NEVER_STARTED,
        )


class UpstreamCancel(StrEnum):
    """What a cancel after the commit point does upstream, when the provider supports it."""

    NEVER = "Never"  # record the request only
    SUSPEND = "Suspend"  # HTTP: the cancel call; a Job: spec.suspend=true
    DELETE = "Delete"  # HTTP: the cancel call; a Job, Pod or other object: deleted


class LateCompletion(StrEnum):
    """What a final report (or provider answer) after a deadline decision does."""

    ADJUST = "Adjust"  # one recorded adjustment while the envelope is open
    RECORD = "Record"  # recorded only


class Trigger(StrEnum):
    """Who or what moved a claim: the source of the fact a transition was decided on."""

    ADMISSION = "Admission"  # the operator's queue
    WORKER = "Worker"  # the claim's spec: dispatch, cancel, usage, a final report
    POD = "Pod"  # a workload pod bound, started, or went away
    PROVIDER = "Provider"  # a provider lookup
    CLOCK = "Clock"  # a lease end, a deadline, a retry window
    PERSON = "Person"  # a force-settle annotation
    DELETION = "Deletion"  # the claim or its envelope was deleted


class ClaimPhase(StrEnum):
    PENDING = "Pending"
    TENTATIVE = "Tentative"
    COMMITTED = "Committed"
    RUNNING = "Running"
    DETACHED = "Detached"
    CONSUMED = "Consumed"
    RELEASED = "Released"
    EXPIRED = "Expired"
    REJECTED = "Rejected"

    @property
    def holds_capacity(self) -> bool:
        return self in HOLDING_PHASES

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_PHASES

    @property
    def committed(self) -> bool:
        """Past the commit point: a release can no longer return it without usage."""
        return self in (ClaimPhase.COMMITTED, ClaimPhase.RUNNING, ClaimPhase.DETACHED)


HOLDING_PHASES = frozenset(
    {ClaimPhase.TENTATIVE, ClaimPhase.COMMITTED, ClaimPhase.RUNNING, ClaimPhase.DETACHED}
)
TERMINAL_PHASES = frozenset(
    {ClaimPhase.CONSUMED, ClaimPhase.RELEASED, ClaimPhase.EXPIRED, ClaimPhase.REJECTED}
)


class EnvelopeState(StrEnum):
    OPEN = "Open"
    CLOSED = "Closed"


class EnvelopePhase(StrEnum):
    PENDING = "Pending"
    OPEN = "Open"
    CLOSING = "Closing"
    CLOSED = "Closed"
    EXPIRED = "Expired"


class ChildPhase(StrEnum):
    """A child envelope's line in its parent's ledger: its capacity held, or settled."""

    RESERVED = "Reserved"
    SETTLED = "Settled"


class ParentKind(StrEnum):
    """Where an envelope's capacity comes from."""

    ROOT = "Root"  # its own capacity: no parent, no pool covers its namespace
    ENVELOPE = "ReservationEnvelope"
    POOL = "ReservationPool"


class DeadlineAction(StrEnum):
    """What happens to a Detached claim whose outcome is still unknown at its deadline."""

    HOLD = "Hold"
    QUARANTINE = "Quarantine"
    RELEASE = "Release"


class Fallback(StrEnum):
    """What a claim that cannot be admitted now does: wait in the queue, or fail at once."""

    WAIT = "Wait"
    FAIL = "Fail"


class PhysicalHold(StrEnum):
    """When a claim's devices are held: from admission, or only once its branch is chosen."""

    TENTATIVE = "Tentative"
    COMMIT = "Commit"


class ContractType(StrEnum):
    """How a resource comes back (README "Resource contracts"; lease-renewal.txt: capacity
    reservations, concurrency permits and financial holds are different contracts)."""

    REUSABLE = "Reusable"  # devices, permits, slots: all of R returns when a claim ends
    CONSUMABLE = "Consumable"  # tokens, money: C is committed, R − C returns, once
    REPLENISHING = "Replenishing"  # rate limits: C is committed and returns a window later


# Resources that are Reusable when nothing is declared: every device resource, and the
# concurrency permit. Anything else is Consumable by default.
DEFAULT_REUSABLE = frozenset({*DEVICE_CLASSES, "concurrency"})
# A Replenishing resource's window is kept in this many slices: a consumption returns
# between one window and one window plus a slice after it was committed, never earlier
# (see reservoir.core.windows).
WINDOW_SLICES = 12
MAX_WINDOW_SECONDS = 7 * 24 * 3600


class Contract(Model):
    """The contract one resource of a budget keeps."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.windowSeconds) == (self.type == 'Replenishing')",
                    "message": "windowSeconds is set for a Replenishing resource, and only for one",
                }
            ]
        }
    )

    type: ContractType = Field(
        description="Reusable (all of R returns when a claim ends: devices, concurrency "
        "permits, slots), Consumable (the usage C is committed and R − C returns: tokens, "
        "cost) or Replenishing (C is committed and returns once its window has passed: a "
        "provider's requests or tokens per minute)."
    )
    window_seconds: int | None = Field(
        default=None,
        ge=1,
        le=MAX_WINDOW_SECONDS,
        description="Replenishing only: the provider's window. What a claim consumed comes "
        "back one window after its settlement (a sliding window, kept in "
        f"{WINDOW_SLICES} slices: never early, at most one slice late).",
    )

    @model_validator(mode="after")
    def _window_only_when_replenishing(self) -> Contract:
        # The CRD's rule, again where the SDK and the operator read a spec: a contract the
        # code cannot keep is an error here, never a resource silently without its window.
        if (self.window_seconds is not None) != (self.type is ContractType.REPLENISHING):
            raise ValueError("windowSeconds is set for a Replenishing resource, and only for one")
        return self


# --- ReservationEnvelope ----------------------------------------------------------------


class Lending(Model):
    """Sibling borrowing, off unless an envelope's policy names it."""

    floor: ResourceMap = resource_map(
        "Never lent: this much of each resource stays available for the envelope's own "
        "claims. A resource not named has a floor of zero."
    )


# Object names as Kubernetes makes them (RFC 1123 subdomains): a name is a path segment
# in the API's URLs, so nothing else may reach the operator's requests (found by review:
# "../../other-namespace/..." read and deleted other namespaces' objects).
OBJECT_NAME = "^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
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
        f"Unset means {MAX_ACTIVE_CLAIMS_LIMIT}, the most one envelope's ledger holds.",
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


def contracts_field(owner: str) -> Any:
    return Field(
        default_factory=dict,
        description=f"The contract each resource of the {owner} keeps, by resource name. A "
        "resource not named is Reusable if it is a device resource ("
        + ", ".join(sorted(DEVICE_CLASSES))
        + ") or 'concurrency', else Consumable. A device resource is always Reusable. "
        "Fixed at creation: status.contracts shows every resource's.",
        json_schema_extra={
            "maxProperties": MAX_RESOURCES,
            "default": {},
            "x-kubernetes-validations": [
                RESOURCE_NAME_RULE,
                {"rule": "self == oldSelf", "message": "contracts are fixed at creation"},
                {
                    "rule": " && ".join(
                        f"(!('{name}' in self) || self['{name}'].type == 'Reusable')"
                        for name in sorted(DEVICE_CLASSES)
                    ),
                    "message": "a device resource ("
                    + ", ".join(sorted(DEVICE_CLASSES))
                    + ") is Reusable: its devices come back when a claim ends",
                },
            ],
        },
    )


CONTRACTS_NAME_CAPACITY: JsonDict = {
    "rule": "self.contracts.all(k, k in self.capacity)",
    "message": "contracts name resources of the capacity",
}


CAPACITY_RULES: tuple[JsonDict, ...] = (
    {
        "rule": "oldSelf.all(k, k in self && "
        "quantity(self[k]).compareTo(quantity(oldSelf[k])) >= 0)",
        "message": "capacity may grow but never shrink or lose a resource",
    },
    {
        "rule": "self.all(k, k in oldSelf)",
        "message": "the resources of a budget are fixed at creation: create a new one "
        "for another resource",
    },
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
        "claims and releases its balance once every claim has settled.",
    )
    policy: EnvelopePolicy = Field(
        default_factory=EnvelopePolicy, description="Admission, lease and deadline policy."
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
        description="Order among what waits for the same parent or pool (claims and "
        "envelopes alike): higher first, then older first.",
    )


class Condition(Model):
    """A Kubernetes-style condition (metav1.Condition)."""

    type: str = Field(max_length=64, description="The condition's type, e.g. Committed.")
    status: str = Field(
        max_length=8,
        description="True, False or Unknown.",
        json_schema_extra={"enum": ["True", "False", "Unknown"]},
    )
    reason: str = Field(max_length=REASON_LENGTH, description="One CamelCase word: why.")
    message: str = Field(
        default="", max_length=MESSAGE_LENGTH, description="Human-readable detail."
    )
    last_transition_time: datetime = Field(description="When the status last changed.")
    observed_generation: int | None = Field(
        default=None, description="The spec generation this condition was computed from."
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


DeviceNames = list[Annotated[str, Field(max_length=MAX_DEVICE_NAME_LENGTH)]]


def device_names(description: str) -> Any:
    """A claim's device names, bounded like its device count."""
    return Field(default_factory=list, max_length=MAX_DEVICES_PER_CLAIM, description=description)


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


class WindowSlice(Model):
    """What a Replenishing resource committed in one slice of its window, until it returns."""

    start: datetime = Field(description="The slice's start (operator clock, UTC).")
    returns_at: datetime = Field(description="When it returns to the budget.")
    amount: Quantity = Field(description="Committed in this slice.")


class DeviceHold(Model):
    """Devices the scheduler allocated to a claim (through its ResourceClaim), recorded
    when the claim was admitted on them."""

    node: str = Field(max_length=MAX_NAME_LENGTH, description="The node the devices are on.")
    devices: DeviceNames = device_names("The allocated devices.")
    released: bool = Field(
        default=False,
        description="The allocation is gone (the devices are free): recorded after settlement.",
    )


class LedgerEntry(Model):
    """One claim's line in its envelope's ledger: the authoritative record of what the claim
    holds and how it settled. Claim status mirrors it."""

    claim: str = Field(max_length=MAX_NAME_LENGTH, description="The BranchClaim's name.")
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
    heartbeat: str | None = Field(
        default=None,
        max_length=128,
        description="The last heartbeat token seen from the lease holder.",
    )
    committed_at: datetime | None = Field(default=None, description="When it committed.")
    started_at: datetime | None = Field(default=None, description="When execution started.")
    detached_at: datetime | None = Field(
        default=None, description="When its lease lapsed after the commit point."
    )
    cancel_requested: bool = Field(
        default=False, description="Cancel (or deletion) was asked after the commit point."
    )
    pod_started_late: bool = Field(
        default=False,
        description="A workload pod was bound or ran after the claim settled (a late fact).",
    )
    deadline_action: DeadlineAction | None = Field(
        default=None, description="The ambiguity-deadline decision taken, once taken."
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
    its whole capacity is one reserved entry until it closes, then R − C returns here."""

    envelope: str = Field(max_length=MAX_NAME_LENGTH, description="The child envelope's name.")
    namespace: str = Field(
        default="", max_length=63, description="Its namespace (in a pool's ledger)."
    )
    phase: ChildPhase = Field(description="Reserved (holds R here) or Settled.")
    reserved: ResourceMap = recorded_map("R: the child's capacity, held here.")
    consumed: ResourceMap = recorded_map("C: what the child committed, committed here too.")
    released: ResourceMap = recorded_map("R − C: the child's balance, returned here.")
    reserved_at: datetime | None = Field(default=None, description="When R was reserved.")
    settled_at: datetime | None = Field(default=None, description="When it settled here.")
    reason: str | None = Field(
        default=None,
        max_length=64,
        description="Why it settled: Closed (the child closed and returned its balance), "
        "Withdrawn (deleted or closed before it was admitted), AdmittedElsewhere, "
        "ForceSettled (gone, charged in full by a person's decision).",
    )


class LoanPhase(StrEnum):
    LENT = "Lent"
    SETTLED = "Settled"


class Loan(Model):
    """A loan to a sibling, in the lender's ledger (keyed by the borrower's UID). The
    borrower's own record of it (`Borrowing`) says what was repaid and, once it closed,
    what its claims consumed of it."""

    borrower: str = Field(max_length=MAX_NAME_LENGTH, description="The borrowing envelope.")
    phase: LoanPhase = Field(description="Lent (outstanding) or Settled.")
    amount: ResourceMap = recorded_map("What was lent.")
    repaid: ResourceMap = recorded_map("Repaid so far, as the borrower recorded it.")
    consumed: ResourceMap = recorded_map(
        "Not repaid when the borrower closed: consumed by its claims, committed here."
    )
    lent_at: datetime = Field(description="When it was lent (operator clock).")
    settled_at: datetime | None = Field(default=None, description="When it settled.")


class Borrowing(Model):
    """A loan from a sibling, in the borrower's ledger (keyed by the lender's UID)."""

    lender: str = Field(max_length=MAX_NAME_LENGTH, description="The lending envelope.")
    amount: ResourceMap = recorded_map("What was borrowed.")
    repaid: ResourceMap = recorded_map(
        "Repaid so far (only grows): returned as this envelope's claims settled."
    )
    consumed: ResourceMap = recorded_map("What its claims consumed of it, set at closing.")
    received_at: datetime = Field(description="When the loan was recorded here.")
    closed_at: datetime | None = Field(
        default=None, description="When this envelope closed: nothing more is repaid."
    )


class BorrowRequest(Model):
    """What this envelope's queue is short of: siblings that lend may cover it."""

    resources: ResourceMap = recorded_map("The shortage of the claim at the head of its queue.")
    priority: int = Field(default=0, description="That claim's priority.")
    since: datetime = Field(description="That claim's creation time.")


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
    settled: ChildEntry | None = Field(
        default=None, description="This envelope's settled line in its parent's ledger."
    )


class ContractBook(Model):
    """What a budget's status (an envelope's, a pool's) records of its resources'
    contracts (reservoir.core.contracts, reservoir.core.windows)."""

    contracts: dict[str, ContractType] = Field(
        default_factory=dict,
        description="Every resource's contract, declared or by default: Reusable, Consumable "
        "or Replenishing.",
        json_schema_extra={"maxProperties": MAX_RESOURCES},
    )
    windows: dict[str, Annotated[list[WindowSlice], Field(max_length=WINDOW_SLICES + 1)]] = Field(
        default_factory=dict,
        description="Replenishing resources: what is committed in each slice of the window, "
        "until it returns. Their committed total is the sum of these slices.",
        json_schema_extra={"maxProperties": MAX_RESOURCES},
    )
    peak: ResourceMap = recorded_map(
        "Reusable and Replenishing resources: the most ever in use at once (held, plus "
        "committed in the window), against capacity for right-sizing."
    )


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
        description="Ledger entries keyed by claim UID. A settled entry is compacted away "
        "once its claim's status carries the settlement (or the claim is gone).",
        json_schema_extra={"maxProperties": MAX_LEDGER_ENTRIES},
    )
    counts: dict[str, int] = Field(
        default_factory=dict,
        description="Number of claims per phase.",
        json_schema_extra={"maxProperties": 16},
    )
    children: dict[str, ChildEntry] = Field(
        default_factory=dict,
        description="Child envelopes drawing on this one, keyed by UID: each holds its whole "
        "capacity here until it settles. A settled line is compacted away once the child's "
        "status carries it (or the child is gone).",
        json_schema_extra={"maxProperties": MAX_ENVELOPE_CHILDREN},
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


# --- BranchClaim ------------------------------------------------------------------------


KIND_NAME = "^[A-Z][A-Za-z0-9]*$"
REQUEST_ID = "^[\\x21-\\x7e]+$"  # printable ASCII, no spaces


API_VERSION_PATTERN = "^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?v[0-9]+[a-z0-9]*$"
DEFAULT_API_VERSIONS = {"Job": "batch/v1", "Pod": "v1"}


class ObjectRef(Model):
    """A Kubernetes object in the claim's namespace."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.apiVersion) || "
                    "(has(self.kind) ? self.kind : 'Job') in ['Job', 'Pod']",
                    "message": "apiVersion is required for kinds other than Job (batch/v1) and "
                    "Pod (v1)",
                }
            ]
        }
    )

    api_version: str | None = Field(
        default=None,
        max_length=253,
        pattern=API_VERSION_PATTERN,
        description="Its apiVersion, e.g. example.com/v1. Unset: batch/v1 for a Job, v1 for a Pod.",
    )
    kind: str = Field(
        default="Job",
        min_length=1,
        max_length=63,
        pattern=KIND_NAME,
        description="Its kind: Job, Pod, or a kind with status.conditions.",
    )
    name: str = Field(
        min_length=1, max_length=MAX_NAME_LENGTH, pattern=OBJECT_NAME, description="Its name."
    )

    @property
    def resolved_api_version(self) -> str | None:
        return self.api_version or DEFAULT_API_VERSIONS.get(self.kind)


class Upstream(Model):
    """The provider operation the branch runs as: kept so that reconciliation can find it."""

    operation_id: str | None = Field(
        default=None, max_length=256, description="The provider's operation or job id."
    )
    state: UpstreamState | None = Field(
        default=None,
        description="Submitted, Accepted (provider queued it) or Running (compute started). "
        "Only moves forward and is never removed: Accepted commits the claim, Running "
        "proves it ran.",
    )
    supports_cancel: bool = Field(default=False, description="Provider can cancel it.")
    supports_status: bool = Field(default=False, description="Provider can report status.")
    ref: ObjectRef | None = Field(
        default=None,
        description="A Kubernetes object (same namespace) that runs the branch: a Job, a Pod, "
        "or any object with standard conditions. Its status is the provider's authoritative "
        "answer. Set once, then fixed.",
    )
    request_id: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        pattern=REQUEST_ID,
        description="The client's idempotency key for the submission. Two claims of a "
        "namespace may not share one: the younger is Rejected (DuplicateRequestId). Set "
        "once, then fixed.",
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
        "holder (the Lease's holderIdentity) renew the claim.",
    )


DEVICE_ATTRIBUTE_NAME = "^[A-Za-z][A-Za-z0-9_]{0,31}$"
DEVICE_ATTRIBUTE_VALUE = "^[A-Za-z0-9][-A-Za-z0-9_.]{0,62}$"


def _attribute_name(name: str) -> str:
    if not re.fullmatch(DEVICE_ATTRIBUTE_NAME, name):
        raise ValueError(f"device attribute names match {DEVICE_ATTRIBUTE_NAME}: {name!r}")
    return name


class Placement(Model):
    """Hints for physical resources: the pod fields are copied onto the placeholder pod,
    the device attributes become the ResourceClaim's selector. Read when the hold is made."""

    device_attributes: dict[
        Annotated[str, AfterValidator(_attribute_name)],
        Annotated[str, Field(pattern=DEVICE_ATTRIBUTE_VALUE, max_length=63)],
    ] = Field(
        default_factory=dict,
        description="Attributes every device must have, as exact string values: "
        "{productName: NVIDIA-H100-80GB-HBM3}.",
        json_schema_extra={
            "maxProperties": 8,
            "x-kubernetes-validations": [
                {
                    "rule": f"self.all(k, size(k) <= 32 && k.matches('{DEVICE_ATTRIBUTE_NAME}'))",
                    "message": "device attribute names are identifiers of at most 32 characters",
                }
            ],
        },
    )

    node_selector: dict[str, str] = labels(
        "Node labels the reservation must land on (core/v1 nodeSelector).",
        MAX_NODE_SELECTOR_LABELS,
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        max_length=MAX_TOLERATIONS,
        description="Pod tolerations (core/v1 Toleration).",
    )
    affinity: Affinity | None = Field(default=None, description="Pod affinity (core/v1 Affinity).")


def immutable(what: str) -> JsonDict:
    return {"x-kubernetes-validations": [{"rule": "self == oldSelf", "message": f"{what}"}]}


# A spec's execution facts (usage and the provider's state) are what they were: read by the
# rule below and by the admission policy for claims being deleted (reservoir.crdgen).
EXECUTION_FACTS_UNCHANGED = (
    "(has(self.usage) ? self.usage : {}) == (has(oldSelf.usage) ? oldSelf.usage : {}) && "
    "(has(self.upstream) && has(self.upstream.state) ? self.upstream.state : '') == "
    "(has(oldSelf.upstream) && has(oldSelf.upstream.state) ? oldSelf.upstream.state : '')"
)

UPSTREAM_RANK = "{" + ", ".join(f"'{s.value}': {s.rank}" for s in UpstreamState) + "}"

# Rules over several fields of a claim's spec, checked by the API server (with oldSelf).
# Every field they read has a schema default or is required, and each rule also reads
# absent fields as their default through has(): removing a field cannot skip a rule.
CLAIM_SPEC_RULES: list[JsonValue] = [
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
        "rule": "!(has(oldSelf.cancel) && oldSelf.cancel) || "
        "(has(oldSelf.dispatch) && oldSelf.dispatch) || "
        "(has(oldSelf.commitPoint) && oldSelf.commitPoint != 'Dispatch') || "
        f"({EXECUTION_FACTS_UNCHANGED})",
        "message": "a branch cancelled before dispatch never ran: it cannot report usage or "
        "a provider start",
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
]


class BranchClaimSpec(Model):
    """What one branch asks for, and the facts its orchestrator and worker declare."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": CLAIM_SPEC_RULES})

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
        "reported with or before the final report. Recorded in status.result and kept "
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

    @property
    def declared(self) -> str:
        """The declared facts in a word: Hold, Dispatch, Cancel or Dispatch+Cancel."""
        facts = [word for word, on in (("Dispatch", self.dispatch), ("Cancel", self.cancel)) if on]
        return "+".join(facts) or "Hold"


class LeaseStatus(Model):
    holder: str | None = Field(
        default=None, max_length=MAX_NAME_LENGTH, description="Who holds the lease."
    )
    generation: int = Field(default=0, ge=0, description="Lease generation (fencing aid).")
    first_reserved_at: datetime | None = Field(default=None, description="First reserved.")
    renewed_at: datetime | None = Field(default=None, description="Last renewal granted.")
    expires_at: datetime | None = Field(default=None, description="Lease end (operator clock).")
    renewals: int = Field(default=0, ge=0, description="Renewals granted.")


class PlacementStatus(Model):
    node: str | None = Field(
        default=None, max_length=MAX_NAME_LENGTH, description="Node the reservation is on."
    )
    placeholder_pod: str | None = Field(
        default=None, max_length=MAX_NAME_LENGTH, description="The placeholder pod."
    )
    devices: DeviceNames = device_names("The devices allocated to the claim.")
    devices_released: bool = Field(
        default=False,
        description="After settlement: the allocation is gone, the devices are free again. "
        "Until then they count as settled but still occupied.",
    )
    handed_off_at: datetime | None = Field(
        default=None,
        description="When its devices were handed to its workload pod (the commit point).",
    )
    handed_off_to: str | None = Field(
        default=None, max_length=64, description="The UID of that workload pod."
    )


class BranchClaimStatus(Model):
    phase: ClaimPhase = Field(default=ClaimPhase.PENDING, description="The claim's phase.")
    reserved: ResourceMap = recorded_map("What the claim holds (R).")
    consumed: ResourceMap = recorded_map("What settlement committed (C).")
    released: ResourceMap = recorded_map("What settlement returned (R − C).")
    usage: ResourceMap = recorded_map("Latest accepted cumulative usage.")
    lease: LeaseStatus | None = Field(default=None, description="The claim's lease.")
    placement: PlacementStatus | None = Field(default=None, description="Node placement.")
    settlement: Settlement | None = Field(default=None, description="The settlement record.")
    late: LateReport | None = Field(default=None, description="Reports after settlement.")
    overrun: Overrun | None = Field(default=None, description="Usage above the reservation.")
    provider: ProviderRecord | None = Field(
        default=None, description="The provider's last answer about the upstream operation."
    )
    result: str | None = Field(
        default=None,
        max_length=MAX_RESULT_LENGTH,
        description="The result reference, from the final report or the provider: kept after "
        "settlement (`kubectl reservoir result`).",
    )
    history: list[Transition] = Field(
        default_factory=list,
        description="Every transition, oldest first (`kubectl reservoir history`).",
        json_schema_extra={"maxItems": MAX_TRANSITIONS},
    )
    adjustment: Adjustment | None = Field(
        default=None, description="A late completion after a deadline decision."
    )
    retry: RetryHold | None = Field(
        default=None, description="What this failed attempt keeps for the next attempt."
    )
    occupancy: ResourceMap = recorded_map(
        "Reusable resources: R times the seconds held, recorded at settlement."
    )
    work_ended_at: datetime | None = Field(
        default=None,
        description="When the work was known to have ended before its usage: its Reusable "
        "resources returned then (status.reusableReturned).",
    )
    reusable_returned: ResourceMap = recorded_map(
        "Reusable resources returned before settlement, once the work ended."
    )
    compensations: list[CompensationRecord] = compensations_field()
    queue_reason: str | None = Field(
        default=None, max_length=MESSAGE_LENGTH, description="Why the claim is still Pending."
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


# --- ReservationPool --------------------------------------------------------------------

NAMESPACE_NAME = "^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"


class ReservationPoolSpec(Model):
    """A tenant's quota: what the root envelopes of its namespaces may hold in total."""

    model_config = ConfigDict(
        json_schema_extra={"x-kubernetes-validations": [CONTRACTS_NAME_CAPACITY]}
    )

    capacity: ResourceMap = resource_map(
        "The tenant's budget, per resource. Every root envelope of the pool's namespaces is "
        "admitted from it like a claim, and returns its balance here when it closes. May "
        "grow, never shrink; the resources are fixed at creation.",
        *CAPACITY_RULES,
        required=True,
    )
    contracts: dict[str, Contract] = contracts_field("pool")
    namespaces: list[Annotated[str, Field(max_length=63, pattern=NAMESPACE_NAME)]] = Field(
        min_length=1,
        max_length=MAX_POOL_NAMESPACES,
        description="The namespaces whose root envelopes (those without a parent) draw from "
        "this pool. The list may grow, never lose a namespace (an admitted envelope stays "
        "this pool's). A namespace listed by two pools draws from the older one.",
        json_schema_extra={
            "x-kubernetes-list-type": "set",
            "x-kubernetes-validations": [
                {
                    "rule": "oldSelf.all(n, n in self)",
                    "message": "a pool's namespaces may grow but never lose one",
                }
            ],
        },
    )


class ReservationPoolStatus(ContractBook):
    summary: EnvelopeSummary = Field(
        default_factory=EnvelopeSummary, description="Totals rendered for `kubectl get`."
    )
    totals: ResourceTotals = Field(
        default_factory=ResourceTotals,
        description="For every resource: committed + reserved + reconciling + available == "
        "capacity. Reserved is held by open envelopes; committed is what closed ones used.",
    )
    children: dict[str, ChildEntry] = Field(
        default_factory=dict,
        description="The envelopes drawing on this pool, keyed by UID.",
        json_schema_extra={"maxProperties": MAX_CHILDREN},
    )
    counts: dict[str, int] = Field(
        default_factory=dict,
        description="Envelopes per phase here (Pending, Reserved, Settled).",
        json_schema_extra={"maxProperties": 8},
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready and other conditions.",
        json_schema_extra={"maxItems": MAX_CONDITIONS},
    )
    observed_generation: int | None = Field(
        default=None, description="The spec generation the status reflects."
    )
