"""`ReservationPool`: a tenant's quota, from which the root envelopes of its namespaces are
admitted like claims."""

from __future__ import annotations

from typing import Annotated

from pydantic import (
    ConfigDict,
    Field,
)
from pydantic.config import JsonDict

from reservoir.core.model.common import (
    MAX_CHILDREN,
    MAX_CONDITIONS,
    MAX_POOL_NAMESPACES,
    SPECULATION_GROUP,
    Condition,
    EnvelopeState,
    Model,
    ResourceMap,
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
    EnvelopeSummary,
    ResourceTotals,
)
from reservoir.core.model.preemption import MAX_PREEMPTIONS, PreemptionPolicy, PreemptionRequest

NAMESPACE_NAME = "^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
MAX_PRIORITY_CLASSES = 16
MAX_WEIGHT = 1000
MAX_OPEN_ENVELOPES = 10_000
MAX_TENTATIVE_CLAIMS = 1_000_000


SHARES_LISTED: JsonDict = {
    "rule": "!has(self.shares) || self.shares.all(n, n in self.namespaces)",
    "message": "shares name only namespaces the pool lists",
}


class NamespaceShare(Model):
    """One namespace's part of the pool: its weight in the fair share, the amounts no other
    namespace may take from it, and a cap on what it holds open at once."""

    weight: int = Field(
        default=1,
        ge=1,
        le=MAX_WEIGHT,
        description="Its weight in the pool's fair share (weighted dominant resource "
        "fairness): under saturation each namespace holds about weight / Σ weights of the "
        "pool in its dominant resource. Default 1.",
    )
    guaranteed: ResourceMap = resource_map(
        "Amounts of the pool's Reusable resources (GPUs, permits) kept for this namespace: "
        "while it holds less, no other namespace is admitted into what it does not use. Not "
        "lent out (so not reclaimed by preempting anyone): a guarantee costs idle capacity "
        "while unused. Guarantees adding up to more than the capacity are each kept scaled "
        "down in proportion; one of a resource that is not Reusable is not kept (what is "
        "spent does not come back: give that budget a pool of its own), and the pool's "
        "GuaranteesFit condition says so."
    )
    max_open_envelopes: int | None = Field(
        default=None,
        ge=1,
        le=MAX_OPEN_ENVELOPES,
        description="At most this many of its envelopes hold lines here at once; others wait "
        "(overrides the pool's maxOpenEnvelopesPerNamespace).",
    )
    max_tentative_claims: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TENTATIVE_CLAIMS,
        description="At most this many claims of its envelopes hold capacity before their "
        "commit point at once (overrides the pool's maxTentativeClaimsPerNamespace).",
    )


class PriorityClass(Model):
    """A priority an administrator defines for the pool's queue: tenants name a class
    (`spec.priorityClassName` on a root envelope), never pick a number across tenants."""

    value: int = Field(
        ge=-1_000_000,
        le=1_000_000,
        description="Higher is admitted first across the pool's namespaces, before fair "
        "share and age.",
    )
    namespaces: list[Annotated[str, Field(max_length=63, pattern=NAMESPACE_NAME)]] | None = Field(
        default=None,
        max_length=MAX_POOL_NAMESPACES,
        description="The namespaces that may name this class; unset: every namespace of "
        "the pool. An envelope naming a class its namespace may not use waits, and says "
        "so.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    preemption_policy: PreemptionPolicy = Field(
        default=PreemptionPolicy.NEVER,
        description="PreemptLowerPriority: an envelope of this class waiting at the head of "
        "the pool's queue for room takes it from admitted envelopes of lower classes that "
        "hold nothing past a commit point (tentative holds only: never a claim committed, "
        "running or settling): each such envelope releases its Tentative claims once, with "
        "reason Preempted, and closes; a workflow may queue again with a new envelope. "
        "Lowest class first, then the most recently admitted; only when they free enough, "
        "and never below a namespace's guarantee. Never (the default): it waits.",
    )


class ReservationPoolSpec(Model):
    """A tenant's quota: what the root envelopes of its namespaces may hold in total."""

    model_config = ConfigDict(
        json_schema_extra={"x-kubernetes-validations": [CONTRACTS_NAME_CAPACITY, SHARES_LISTED]}
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
    state: EnvelopeState = Field(
        default=EnvelopeState.OPEN,
        description="Open admits envelopes. Closed admits none and keeps everything else: "
        "the envelopes it holds go on, and return their balance when they close; those "
        "waiting wait (a tenant's budget frozen without deleting the pool). May reopen.",
    )
    shares: dict[str, NamespaceShare] = Field(
        default_factory=dict,
        description="Per namespace (each one listed in namespaces): its weight, guarantee "
        "and cap. A namespace not named here has weight 1, no guarantee, and the pool's "
        "maxOpenEnvelopesPerNamespace.",
        json_schema_extra={
            "maxProperties": MAX_POOL_NAMESPACES,
            "x-kubernetes-validations": [
                {
                    "rule": f"self.all(k, size(k) <= 63 && k.matches('{NAMESPACE_NAME}'))",
                    "message": "shares are keyed by namespace names",
                }
            ],
        },
    )
    max_open_envelopes_per_namespace: int | None = Field(
        default=None,
        ge=1,
        le=MAX_OPEN_ENVELOPES,
        description="At most this many envelopes of one namespace hold lines here at once "
        "(a namespace's share may set its own).",
    )
    max_open_envelopes: int | None = Field(
        default=None,
        ge=1,
        le=MAX_OPEN_ENVELOPES,
        description="At most this many envelopes hold lines here at once, across namespaces.",
    )
    max_tentative_claims_per_namespace: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TENTATIVE_CLAIMS,
        description="At most this many claims of one namespace's envelopes hold capacity "
        "before their commit point at once. Each envelope admitted is granted part of it "
        "(its own policy.maxTentativeClaims, else all that is left; `status.parent."
        "tentativeClaims`) until it closes; an envelope finding none left waits.",
    )
    max_tentative_claims: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TENTATIVE_CLAIMS,
        description="The same cap across all the pool's namespaces.",
    )
    priority_classes: dict[str, PriorityClass] = Field(
        default_factory=dict,
        description="The classes a root envelope of the pool's namespaces may name "
        "(spec.priorityClassName). An envelope naming none has value 0. The envelope's own "
        "`priority` orders only what waits inside it, never across tenants.",
        json_schema_extra={
            "maxProperties": MAX_PRIORITY_CLASSES,
            "x-kubernetes-validations": [
                {
                    "rule": f"self.all(k, size(k) <= 63 && k.matches('{SPECULATION_GROUP}'))",
                    "message": "a priority class's name is a label value (at most 63 "
                    "characters: letters, digits, '-', '_', '.')",
                }
            ],
        },
    )


class NamespaceUsage(Model):
    """What one namespace holds in the pool, as of the last write."""

    held: ResourceMap = recorded_map("The capacity its open envelopes hold here.")
    share: str = Field(
        default="0",
        max_length=32,
        description="Its dominant share (the largest of held / capacity over the pool's "
        "resources) divided by its weight, to 4 decimal places: the pool admits the "
        "namespace with the lowest first.",
    )
    weight: int = Field(default=1, ge=1, le=MAX_WEIGHT, description="Its weight.")
    open: int = Field(default=0, ge=0, description="Its envelopes holding lines here.")
    waiting: int = Field(default=0, ge=0, description="Its envelopes waiting here.")
    tentative_claims: int = Field(
        default=0,
        ge=0,
        description="The tentative claims granted to its open envelopes (when the pool caps them).",
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
        description="The lines of envelopes drawing on this pool in flight, keyed by UID: "
        "moves recorded here and not yet shown by the envelope's own `status.parent` (each "
        "envelope holds its line; this record is retired once the envelope shows its stamp).",
        json_schema_extra={"maxProperties": MAX_CHILDREN},
    )
    stamp: int = Field(
        default=0,
        ge=0,
        description="Raised by each write that moves a line: the stamp of the lines it moved.",
    )
    child_records: ChildRecords | None = Field(
        default=None,
        description="The count and a digest of the reserved lines held by envelopes (not in "
        "flight): a pass checks its view of the envelopes against it.",
    )
    shares: dict[str, NamespaceUsage] = Field(
        default_factory=dict,
        description="Per namespace holding or waiting here: what it holds, its weighted "
        "dominant share, its open and waiting envelopes.",
        json_schema_extra={"maxProperties": MAX_POOL_NAMESPACES},
    )
    preemptions: dict[str, PreemptionRequest] = Field(
        default_factory=dict,
        description="Preemption requests not yet decided, keyed by the UID of the envelope "
        "asked (it decides on its own records, and says so in its status.preemption).",
        json_schema_extra={"maxProperties": MAX_PREEMPTIONS},
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
