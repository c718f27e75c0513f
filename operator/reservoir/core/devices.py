"""Device resources: what a claim asks of real devices, and what the scheduler's
allocation (a ResourceClaim) is recorded as. DESIGN.md §7; nothing here knows Kubernetes.

A claim that asks for a device resource (`nvidia.com/gpu: 2`) is admitted only on a
recorded fact: its devices are allocated and held by a pod of ours. Until then it waits
Pending with the scheduler's reason, its logical room kept, never reported as held. After
settlement its devices count as free only once the allocation is gone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal

from reservoir.core.model import DEVICE_CLASSES, MAX_DEVICES_PER_CLAIM, LedgerEntry
from reservoir.core.policy import Admission


@dataclass(frozen=True)
class DeviceFacts:
    """What a claim's ResourceClaim shows. No ResourceClaim at all is `None`, not this."""

    node: str | None = None  # the allocation's node; None while unallocated
    devices: tuple[str, ...] = ()  # the allocated devices
    held: bool = False  # allocated, and a pod of ours is in its reservedFor
    waiting: str | None = None  # why the scheduler has not placed the placeholder yet

    @property
    def allocated(self) -> bool:
        return self.node is not None


def has_device_resources(capacity: Mapping[str, Decimal]) -> bool:
    """An envelope whose budget names a device resource: its claims may hold devices."""
    return bool(DEVICE_CLASSES.keys() & capacity.keys())


def device_occupancy(entries: Iterable[LedgerEntry]) -> dict[str, int]:
    """Devices per state: `held` by claims that hold capacity, and `settled_occupied`:
    settled claims whose devices are not free yet (their allocation is still there)."""
    counts = {"held": 0, "settled_occupied": 0}
    for entry in entries:
        held = entry.devices
        if held is None:
            continue
        if entry.phase.holds_capacity:
            counts["held"] += len(held.devices)
        elif not held.released:
            counts["settled_occupied"] += len(held.devices)
    return counts


def device_counts(requests: Mapping[str, Decimal]) -> dict[str, int]:
    """The device resources a request asks for, as device counts (zero counts left out)."""
    return {
        name: int(amount)
        for name, amount in requests.items()
        if name in DEVICE_CLASSES and amount > 0
    }


def device_problem(requests: Mapping[str, Decimal]) -> Admission | None:
    """A device request no allocation can satisfy (the CRD refuses these already)."""
    for name, amount in requests.items():
        if name in DEVICE_CLASSES and (
            amount != amount.to_integral_value() or amount > MAX_DEVICES_PER_CLAIM
        ):
            return Admission(
                False,
                "InvalidDeviceCount",
                f"{name} is a whole number of devices, at most {MAX_DEVICES_PER_CLAIM}",
                permanent=True,
            )
    return None
