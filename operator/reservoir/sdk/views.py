"""Read-only views of claims and envelopes, as the SDK returns them."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from reservoir.core.model import BranchClaimSpec, BranchClaimStatus, ClaimPhase
from reservoir.core.model import ReservationEnvelopeStatus as EnvelopeStatus


@dataclass(frozen=True)
class ClaimView:
    """A claim as last read: pass it back to the next verb, which is fenced by its
    resourceVersion."""

    name: str
    namespace: str
    uid: str
    resource_version: str
    spec: BranchClaimSpec
    status: BranchClaimStatus

    @classmethod
    def from_api(cls, obj: dict[str, Any]) -> ClaimView:
        meta = obj["metadata"]
        return cls(
            name=meta["name"],
            namespace=meta.get("namespace", ""),
            uid=meta["uid"],
            resource_version=meta["resourceVersion"],
            spec=BranchClaimSpec.model_validate(obj.get("spec") or {}),
            status=BranchClaimStatus.model_validate(obj.get("status") or {}),
        )

    @property
    def phase(self) -> ClaimPhase:
        return self.status.phase

    @property
    def expires_at(self) -> datetime | None:
        return self.status.lease.expires_at if self.status.lease else None

    @property
    def renewals(self) -> int:
        return self.status.lease.renewals if self.status.lease else 0

    def condition(self, kind: str) -> bool:
        return any(c.type == kind and c.status == "True" for c in self.status.conditions)


@dataclass(frozen=True)
class EnvelopeView:
    name: str
    namespace: str
    status: EnvelopeStatus
