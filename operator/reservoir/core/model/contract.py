"""Resource contracts (README "Resource contracts"): how each resource of a budget comes
back (`ContractType`, `Contract`), the spec fields and rules an envelope and a pool share
for them (`contracts_field`, `CAPACITY_RULES`), and what a budget's status records of them
(`ContractBook`, `WindowSlice`)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any

from pydantic import (
    ConfigDict,
    Field,
    model_validator,
)
from pydantic.config import JsonDict

from reservoir.core.model.common import (
    DEVICE_CLASSES,
    MAX_RESOURCES,
    RESOURCE_NAME_RULE,
    Model,
    Quantity,
    ResourceMap,
    recorded_map,
)


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


class WindowSlice(Model):
    """What a Replenishing resource committed in one slice of its window, until it returns."""

    start: datetime = Field(description="The slice's start (operator clock, UTC).")
    returns_at: datetime = Field(description="When it returns to the budget.")
    amount: Quantity = Field(description="Committed in this slice.")


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
