"""Placement of physical resources (GPUs): a claim's hints (`Placement`, copied onto its
placeholder pod and ResourceClaim) and where its reservation landed (`PlacementStatus`)."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated

from pydantic import (
    AfterValidator,
    Field,
)

from reservoir.core.model.common import MAX_NAME_LENGTH, DeviceNames, Model, device_names
from reservoir.core.scheduling import (
    MAX_NODE_SELECTOR_LABELS,
    MAX_TOLERATIONS,
    Affinity,
    Toleration,
    labels,
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
