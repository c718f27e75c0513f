"""Kubernetes-style conditions, computed fresh and merged so that lastTransitionTime only
moves when a condition's status actually changes."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from reservoir.core.model import Condition
from reservoir.core.text import MESSAGE_LENGTH, REASON_LENGTH, bounded


@dataclass(frozen=True)
class Desired:
    type: str
    status: bool
    reason: str
    message: str = ""


def merge_conditions(
    previous: list[Condition], desired: list[Desired], now: datetime, generation: int | None
) -> list[Condition]:
    old = {c.type: c for c in previous}
    merged: list[Condition] = []
    for want in desired:
        status = "True" if want.status else "False"
        before = old.get(want.type)
        changed = before is None or before.status != status
        merged.append(
            Condition(
                type=want.type,
                status=status,
                reason=bounded(want.reason, REASON_LENGTH),
                message=bounded(want.message, MESSAGE_LENGTH),
                last_transition_time=now
                if changed or before is None
                else before.last_transition_time,
                observed_generation=generation,
            )
        )
    return merged
