"""Workload pods for claims: turn a pod of yours into the one that runs a claim's branch.

The pod gets the claim's label (its UID; its name in an annotation) and waits behind the
hand-off gate until the operator has recorded the hand-off of what the claim holds (which
commits the claim, whatever its commitPoint: creating the pod is sending the branch) and
lifted it: it never starts for a claim that is Pending, cancelled or settled. For a claim
with device resources (GPUs) the pod also references the claim's ResourceClaim, so it runs
on exactly the devices the claim holds; the placeholder that held them goes once the pod
holds them. (With the chart's tenant policies, the API server refuses a pod labelled for a
claim without the gate.)
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from reservoir.core.devices import device_counts
from reservoir.core.model import DEVICE_CLASSES
from reservoir.k8s.devices import resource_claim_name
from reservoir.k8s.resources import CLAIM_LABEL, CLAIM_NAME_ANNOTATION, HAND_OFF_GATE
from reservoir.sdk.views import ClaimView

DEVICES = "reservoir-devices"  # the pod's name for the claim's ResourceClaim


def workload_pod(claim: ClaimView, pod: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `pod` (a core/v1 Pod manifest) that runs `claim`'s branch. Device
    resources in the containers' requests and limits are removed: the devices come from
    the claim, and asking for them again would book them twice."""
    body = copy.deepcopy(dict(pod))
    body.setdefault("apiVersion", "v1")
    body.setdefault("kind", "Pod")
    meta = body.setdefault("metadata", {})
    meta.setdefault("namespace", claim.namespace)
    # The claim's UID (a name may be longer than a label value); its name for people.
    meta.setdefault("labels", {})[CLAIM_LABEL] = claim.uid
    meta.setdefault("annotations", {})[CLAIM_NAME_ANNOTATION] = claim.name
    spec = body.setdefault("spec", {})
    gates = spec.setdefault("schedulingGates", [])
    if not any(g.get("name") == HAND_OFF_GATE for g in gates):
        gates.append({"name": HAND_OFF_GATE})
    if not device_counts(claim.spec.requests):  # "0" GPUs is no device at all (review)
        return body
    spec.setdefault("resourceClaims", []).append(
        {"name": DEVICES, "resourceClaimName": resource_claim_name(claim.uid)}
    )
    for container in spec.get("containers", []):
        resources = container.setdefault("resources", {})
        for part in ("requests", "limits"):
            for name in DEVICE_CLASSES:
                (resources.get(part) or {}).pop(name, None)
        resources.setdefault("claims", []).append({"name": DEVICES})
    return body
