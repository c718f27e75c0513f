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
from reservoir.sdk.views import ClaimView, EnvelopeTree, EnvelopeView, PoolView

__all__ = [
    "AsyncReservoir",
    "ClaimNotFoundError",
    "ClaimView",
    "EnvelopeTree",
    "EnvelopeView",
    "LeaseUncertainError",
    "NotReservedError",
    "PoolView",
    "Reservoir",
    "ReservoirError",
    "StaleClaimError",
    "workload_pod",
]
