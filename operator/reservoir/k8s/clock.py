"""The operator's clock: the only one that decides leases and timestamps (UTC)."""

from __future__ import annotations

from datetime import UTC, datetime


def utcnow() -> datetime:
    return datetime.now(UTC)
