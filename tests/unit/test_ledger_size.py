"""A full ledger must fit in one etcd object (~1.5 MiB) with a wide margin."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from reservoir.core.model import (
    MAX_LEDGER_ENTRIES,
    ClaimPhase,
    LateReport,
    LedgerEntry,
    Overrun,
    ReservationEnvelopeStatus,
    Settlement,
)

ETCD_OBJECT_LIMIT = 1_572_864  # etcd's default --max-request-bytes (1.5 MiB)
NOW = datetime(2026, 11, 29, 12, 0, 0, 123456, tzinfo=UTC)


def heavy_entry(index: int) -> LedgerEntry:
    """An entry with every field set and four resource dimensions: the worst realistic case."""
    resources = {"tokens": "123456789", "cost": "1234.567891", "nvidia.com/gpu": "8",
                 "requests": "99999"}  # fmt: skip
    uid = f"0b7c4f1e-5d2a-4c3b-9e8f-{index:012d}"
    return LedgerEntry(
        claim=f"workflow-run-0123456789-branch-tool-call-{index:05d}",
        branch=f"tool-call-{index:05d}-web-search-and-summarize",
        attempt=3,
        phase=ClaimPhase.CONSUMED,
        reserved=resources,
        usage=resources,
        consumed=resources,
        released=resources,
        first_reserved_at=NOW,
        expires_at=NOW,
        renewals=1234,
        heartbeat="2026-11-29T12:00:00.123456Z/17",
        committed_at=NOW,
        started_at=NOW,
        detached_at=NOW,
        cancel_requested=True,
        overrun=Overrun(usage=resources, final=True, at=NOW),
        late=LateReport(count=3, usage=resources, final=True, outcome="Succeeded", at=NOW),
        settlement=Settlement(
            key=f"{uid}/3/1",
            phase=ClaimPhase.CONSUMED,
            reason="SettledAfterDetach",
            outcome="Succeeded",
            at=NOW,
        ),
    )


def test_a_full_ledger_fits_in_etcd_with_a_wide_margin() -> None:
    status = ReservationEnvelopeStatus(
        entries={f"uid-{i:08d}": heavy_entry(i) for i in range(MAX_LEDGER_ENTRIES)}
    )
    size = len(json.dumps({"status": status.to_api()}))
    print(f"full ledger ({MAX_LEDGER_ENTRIES} heavy entries): {size / 1024:.0f} KiB")
    assert size < ETCD_OBJECT_LIMIT * 0.75, f"{size} bytes leaves too little margin"
