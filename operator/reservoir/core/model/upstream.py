"""The provider operation a claim's branch runs as (`Upstream`), and the Kubernetes object
that may run it (`ObjectRef`)."""

from __future__ import annotations

from datetime import datetime

from pydantic import (
    ConfigDict,
    Field,
)

from reservoir.core.model.common import MAX_NAME_LENGTH, OBJECT_NAME, Model, UpstreamState

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
    deadline: datetime | None = Field(
        default=None,
        description="The provider's own deadline for the request: past it, an operation it "
        "accepted and has not started never will (lease-renewal.txt: a valid local lease "
        "must not revive an expired provider request). Tracked apart from the lease; the "
        "envelope's atQueueBound applies at it. Set once, then fixed.",
    )
    supports_cancel: bool = Field(
        default=False,
        description="The provider can cancel the operation while it is queued (accepted, "
        "not started); while it runs too unless cancelsRunning is false.",
    )
    cancels_running: bool | None = Field(
        default=None,
        description="With supportsCancel: whether the provider can also cancel it once it "
        "runs (client-disconnect.txt: cancellation is evaluated by operation phase). Unset "
        "or true: yes. False: a cancel of running work is only recorded, and its final "
        "report settles it.",
    )
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
