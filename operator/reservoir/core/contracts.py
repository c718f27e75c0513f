"""Each resource of a budget keeps its own contract (README "Resource contracts").

lease-renewal.txt: "Capacity reservations, concurrency permits, and financial holds are
different contracts", each with its own authority and what expiration should do;
child-settlement.txt: "Returning token headroom does not necessarily free GPU memory, and
releasing a GPU slot does not erase token usage already committed."

- Reusable (devices, concurrency permits, slots): held while a claim holds it, and all of
  it comes back when the claim ends, whatever its outcome. Reported usage is occupancy,
  never a charge.
- Consumable (tokens, money): the usage C is committed at settlement, R − C returns.
- Replenishing (a provider's rate limit): C is committed and comes back once its window
  has passed (reservoir.core.windows).

Nothing here knows Kubernetes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from decimal import Decimal

from reservoir.core.model import DEFAULT_REUSABLE, Contract, ContractType, ResourceTotals
from reservoir.core.quantity import MAX_QUANTITY

Contracts = dict[str, Contract]

CONSUMABLE = Contract(type=ContractType.CONSUMABLE)
REUSABLE = Contract(type=ContractType.REUSABLE)


def default_contract(name: str) -> Contract:
    """The contract of a resource nobody declared one for."""
    return REUSABLE if name in DEFAULT_REUSABLE else CONSUMABLE


def resolve(resources: Iterable[str], declared: Mapping[str, Contract]) -> Contracts:
    """Every resource's contract: the declared one, else its default by name."""
    return {name: declared.get(name) or default_contract(name) for name in sorted(resources)}


def of_type(contracts: Mapping[str, Contract], kind: ContractType) -> frozenset[str]:
    return frozenset(name for name, c in contracts.items() if c.type is kind)


def reusable(contracts: Mapping[str, Contract]) -> frozenset[str]:
    return of_type(contracts, ContractType.REUSABLE)


def types(contracts: Mapping[str, Contract]) -> dict[str, ContractType]:
    """The resolved contracts as status.contracts records them."""
    return {name: c.type for name, c in sorted(contracts.items())}


def summary(contracts: Mapping[str, Contract]) -> str:
    """`nvidia.com/gpu=Reusable tokens=Consumable`, for the Contracts printer column."""
    return " ".join(f"{name}={c.type.value}" for name, c in sorted(contracts.items()))


def mismatch(child: Mapping[str, Contract], parent: Mapping[str, Contract]) -> list[str]:
    """Resources a child and its parent (or pool) both have under different contracts (a
    window is part of the contract): the child cannot draw them from that parent."""
    return sorted(name for name, c in child.items() if name in parent and parent[name] != c)


def occupancy(
    reserved: Mapping[str, Decimal],
    reusable_names: frozenset[str],
    since: datetime | None,
    until: datetime,
) -> dict[str, Decimal]:
    """R times the whole seconds it was held, per Reusable resource (device-seconds,
    permit-seconds): a right-sizing figure, never charged. Exact (whole seconds), and at
    most a quantity's bound."""
    if since is None:
        return {}
    seconds = max(int((until - since).total_seconds()), 0)
    if seconds == 0:
        return {}  # held less than a second: nothing worth a line
    return {
        name: min(amount * seconds, MAX_QUANTITY)
        for name, amount in reserved.items()
        if name in reusable_names and amount > 0
    }


def type_of(resource: str, recorded: Mapping[str, ContractType]) -> ContractType:
    """A resource's contract as a budget's status records it, else its default by name."""
    found = recorded.get(resource)
    return found if found is not None else default_contract(resource).type


def in_use(totals: ResourceTotals, recorded: Mapping[str, ContractType]) -> dict[str, Decimal]:
    """What is in use of each Reusable and Replenishing resource: the capacity (and what
    was borrowed) that is not available, i.e. held by claims and child envelopes, lent to
    siblings and, for Replenishing, committed in the window."""
    return {
        name: amount
        + totals.borrowed.get(name, Decimal(0))
        - totals.available.get(name, Decimal(0))
        for name, amount in totals.capacity.items()
        if type_of(name, recorded) is not ContractType.CONSUMABLE
    }


def raise_peak(
    peak: Mapping[str, Decimal], totals: ResourceTotals, contracts: Mapping[str, Contract]
) -> dict[str, Decimal]:
    """The most ever in use at once of each Reusable and Replenishing resource: what
    right-sizing compares with capacity. Only grows."""
    result = dict(peak)
    for name, amount in in_use(totals, types(contracts)).items():
        result[name] = max(result.get(name, Decimal(0)), amount)
    return result


def uncommit_reusable(
    committed: Mapping[str, Decimal], reusable_names: frozenset[str]
) -> dict[str, Decimal]:
    """The committed total with nothing of a Reusable resource: under its contract nothing
    of it is ever spent, so an amount there was recorded before the contract existed."""
    return {k: (Decimal(0) if k in reusable_names else v) for k, v in committed.items()}
