"""`ReservationPool`: a tenant's quota, from which the root envelopes of its namespaces are
admitted like claims."""

from __future__ import annotations

from typing import Annotated

from pydantic import (
    ConfigDict,
    Field,
)

from reservoir.core.model.common import (
    MAX_CHILDREN,
    MAX_CONDITIONS,
    MAX_POOL_NAMESPACES,
    Condition,
    Model,
    ResourceMap,
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
