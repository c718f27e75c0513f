"""The Reservoir SDK: hold, dispatch, renew, report usage, finish, cancel, wait, ledger,
a claim's result and history, and compensations after settlement."""

from reservoir.sdk.client import AsyncReservoir, Reservoir
from reservoir.sdk.errors import (
    ClaimExistsError,
    ClaimNotFoundError,
    CompensationError,
    DuplicateRequestIdError,
    LeaseUncertainError,
    NotReservedError,
    ReservoirError,
    StaleClaimError,
)
from reservoir.sdk.pods import workload_pod
from reservoir.sdk.views import ClaimView, EnvelopeTree, EnvelopeView, PoolView, ResultView

__all__ = [
    "AsyncReservoir",
    "ClaimExistsError",
    "ClaimNotFoundError",
    "ClaimView",
    "CompensationError",
    "DuplicateRequestIdError",
    "EnvelopeTree",
    "EnvelopeView",
    "LeaseUncertainError",
    "NotReservedError",
    "PoolView",
    "Reservoir",
    "ReservoirError",
    "ResultView",
    "StaleClaimError",
    "workload_pod",
]
