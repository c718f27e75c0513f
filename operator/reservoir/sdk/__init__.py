"""The Reservoir SDK: hold, dispatch, renew, report usage, finish, cancel, wait, ledger."""

from reservoir.sdk.client import AsyncReservoir, Reservoir
from reservoir.sdk.errors import (
    ClaimNotFoundError,
    LeaseUncertainError,
    NotReservedError,
    ReservoirError,
    StaleClaimError,
)
from reservoir.sdk.pods import workload_pod
from reservoir.sdk.views import ClaimView, EnvelopeView

__all__ = [
    "AsyncReservoir",
    "ClaimNotFoundError",
    "ClaimView",
    "EnvelopeView",
    "LeaseUncertainError",
    "NotReservedError",
    "Reservoir",
    "ReservoirError",
    "StaleClaimError",
    "workload_pod",
]
