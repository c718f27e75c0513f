"""kopf registrations only: each handler translates an event into a call on a service."""

from reservoir.handlers import (
    claims,
    devices,
    envelopes,
    leases,
    pods,
    pools,
    providers,
    startup,
)

__all__ = ["claims", "devices", "envelopes", "leases", "pods", "pools", "providers", "startup"]
