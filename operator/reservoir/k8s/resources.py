"""Reservoir's resources as lightkube types, and the names the operator puts on objects."""

from __future__ import annotations

from lightkube.generic_resource import create_global_resource, create_namespaced_resource

from reservoir.core.model import API_GROUP, API_VERSION

ReservationEnvelope = create_namespaced_resource(
    API_GROUP, API_VERSION, "ReservationEnvelope", "reservationenvelopes"
)
BranchClaim = create_namespaced_resource(API_GROUP, API_VERSION, "BranchClaim", "branchclaims")
ReservationPool = create_global_resource(
    API_GROUP, API_VERSION, "ReservationPool", "reservationpools"
)

ENVELOPE_LABEL = f"{API_GROUP}/envelope"
CLAIM_LABEL = f"{API_GROUP}/claim"
# An envelope's workflow class: metrics and right-sizing aggregate over it.
WORKFLOW_CLASS_LABEL = f"{API_GROUP}/workflow-class"
FORCE_SETTLE_ANNOTATION = f"{API_GROUP}/force-settle"
FORCE_SETTLE_GONE_ANNOTATION = f"{API_GROUP}/force-settle-gone"
FINALIZER = f"{API_GROUP}/settlement"
# A device claim's workload pod is created behind this scheduling gate; the operator lifts
# it once the hand-off of the claim's devices is recorded.
HAND_OFF_GATE = f"{API_GROUP}/hand-off"
FIELD_MANAGER = "reservoir-operator"


def field_value(value: str) -> str:
    """A value as a field selector must spell it: `\\`, `,` and `=` escaped (as
    k8s.io/apimachinery fields.EscapeValue does), so any value the schema accepts selects
    exactly itself (found by review: `a,b=c` broke the list, `a\\b` matched `a\b`)."""
    return value.replace("\\", "\\\\").replace(",", "\\,").replace("=", "\\=")
