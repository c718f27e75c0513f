"""A full ledger must fit in one etcd object (~1.5 MiB) with a wide margin."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime
from decimal import Decimal

import pytest

from reservoir.core.inflight import IN_FLIGHT_LIMIT
from reservoir.core.ledgersize import (
    LEDGER_BYTES_BUDGET,
    base_bytes,
    parent_record_bytes,
    pool_lines,
    status_bytes,
)
from reservoir.core.lifecycle import ClaimFacts, PodFacts
from reservoir.core.model import (
    MAX_DEPTH,
    MAX_LEDGER_ENTRIES,
    MAX_POOL_NAMESPACES,
    MAX_PREEMPTIONS,
    MAX_RESOURCES,
    BranchClaimSpec,
    ChildEntry,
    ChildPhase,
    ClaimPhase,
    EnvelopePolicy,
    LateReport,
    LedgerEntry,
    NamespaceUsage,
    Overrun,
    ParentKind,
    ParentRecord,
    PreemptionRequest,
    ReservationEnvelopeSpec,
    ReservationEnvelopeStatus,
    ReservationPoolStatus,
    Settlement,
)
from reservoir.core.model import ClaimPhase as P
from reservoir.core.model.pool import MAX_TENTATIVE_CLAIMS
from reservoir.core.reconcile import EnvelopeFacts, reconcile
from tests.unit.sim import Sim

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
        cancel_requested_at=NOW,
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


# --- the byte budget: no schema-valid input can push the ledger past it ---------------


def test_the_byte_budget_leaves_a_wide_margin_in_etcd_with_managed_fields() -> None:
    # managedFields measured at about 0.75 of the status against the real API server
    assert LEDGER_BYTES_BUDGET * 1.75 < ETCD_OBJECT_LIMIT * 0.75


def test_the_widest_claims_the_schema_allows_never_push_the_ledger_past_its_budget() -> None:
    resources = {f"example.com/{'r' * 49}{i:02d}": "1E" for i in range(MAX_RESOURCES)}
    envelope = EnvelopeFacts(
        spec=ReservationEnvelopeSpec(
            capacity=resources, policy=EnvelopePolicy(max_active_claims=256)
        ),
        created_at=NOW,
    )
    claims = {
        f"00000000-0000-0000-0000-{i:012d}": ClaimFacts(
            uid=f"00000000-0000-0000-0000-{i:012d}",
            name=f"{'c' * 247}-{i:05d}",
            created_at=NOW,
            spec=BranchClaimSpec(
                envelope="e" * 253,
                branch="b" * 253,
                requests={r: "1" for r in resources},
                dispatch=True,
            ),
            heartbeat="h" * 128,
        )
        for i in range(MAX_LEDGER_ENTRIES)
    }
    result = reconcile(envelope, ReservationEnvelopeStatus(), list(claims.values()), NOW)
    admitted = [uid for uid, e in result.status.entries.items() if e.phase is P.COMMITTED]
    assert 0 < len(admitted) <= IN_FLIGHT_LIMIT, "the record in flight is bounded"
    assert {result.pending[u].reason for u in claims if u not in admitted} == {"MovesInFlight"}
    # Every admitted claim reports the largest overrun it can and finishes; then its pod
    # starts late and it reports again: the ledger grows as far as it ever can.
    huge = {r: "999999999999999999.999999999" for r in resources}
    for uid in admitted:
        spec = BranchClaimSpec.model_validate(
            {**claims[uid].spec.model_dump(), "usage": huge, "final": True, "outcome": "Failed"}
        )
        claims[uid] = replace(claims[uid], spec=spec)
    status = reconcile(envelope, result.status, list(claims.values()), NOW).status
    assert all(status.entries[u].phase is P.CONSUMED for u in admitted)
    for uid in admitted:
        spec = BranchClaimSpec.model_validate(
            {**claims[uid].spec.model_dump(), "outcome": "Succeeded"}
        )
        claims[uid] = replace(claims[uid], spec=spec, pod=PodFacts(scheduled=True, running=True))
    status = reconcile(envelope, status, list(claims.values()), NOW).status
    size = status_bytes(status)
    print(f"widest ledger: {len(admitted)} entries, {size / 1024:.0f} KiB")
    assert size <= LEDGER_BYTES_BUDGET


def test_a_wide_fan_out_is_admitted_in_batches_and_the_record_in_flight_stays_bounded() -> None:
    """Each line in flight reserves room for all it can gain (history, provider record,
    result, a late adjustment, an occupancy, a Reusable part returned early); the claims hold
    their own lines, so a fan-out of any width is admitted a batch a pass, the rest waiting
    as MovesInFlight, never refused (before issue 23: about 125 live claims at most)."""
    sim = Sim(capacity={"tokens": "10M", "cost": "1000", "nvidia.com/gpu": "512"})
    for i in range(256):
        sim.create(f"research-agent-branch-{i:04d}", {"tokens": "20k", "cost": "1.50"})
    sim.reconcile()
    assert sim.last is not None
    assert sim.last.pending["research-agent-branch-0255"].reason == "MovesInFlight"
    for _ in range(8):
        assert len(sim.status.entries) <= IN_FLIGHT_LIMIT
        assert status_bytes(sim.status) <= LEDGER_BYTES_BUDGET
        sim.write_lines().reconcile()
    phases = [sim.phase(f"research-agent-branch-{i:04d}") for i in range(256)]
    assert phases.count(P.TENTATIVE) == 256
    assert sim.total("reserved") == "5120000"


LONGEST_DIMENSIONS = frozenset(f"{'r' * 62}{i:02d}" for i in range(MAX_RESOURCES))


def largest_map(dimensions: frozenset[str]) -> dict[str, Decimal]:
    return {name: Decimal("999999999999999999.999999999") for name in dimensions}


def largest_line(dimensions: frozenset[str]) -> ChildEntry:
    """A child envelope's line with every field at its largest."""
    full = largest_map(dimensions)
    return ChildEntry(
        envelope="n" * 253,
        stamp=2**62,
        namespace="s" * 63,
        phase=ChildPhase.SETTLED,
        reserved=full,
        consumed=full,
        released=full,
        reserved_at=NOW,
        tentative_claims=2**62,
        priority_class="c" * 63,
        settled_at=NOW,
        reason="x" * 64,
    )


@pytest.mark.parametrize("dimensions", [frozenset({"t"}), LONGEST_DIMENSIONS], ids=["1", "16"])
def test_an_envelopes_parent_record_at_its_largest_stays_in_its_allowance(
    dimensions: frozenset[str],
) -> None:
    record = ParentRecord(
        kind=ParentKind.POOL,
        name="p" * 253,
        uid="u" * 64,
        depth=MAX_DEPTH,
        admitted_at=NOW,
        reserved=largest_map(dimensions),
        stamp=2**62,
        tentative_claims=2**62,
        priority_class="c" * 63,
        settled=largest_line(dimensions),
    )
    written = len(record.model_dump_json(by_alias=True, exclude_none=True).encode())
    assert written <= parent_record_bytes(dimensions)


def test_a_pools_status_at_its_largest_stays_in_its_budget() -> None:
    """Every line in flight its bound allows, at its largest, with 16 resources of the
    longest names; every namespace's share; every preemption request: within what the
    budget leaves beside the totals, summaries, conditions and windows (`base_bytes`)."""
    dimensions, full = LONGEST_DIMENSIONS, largest_map(LONGEST_DIMENSIONS)
    long_name = "n" * 253
    line = largest_line(LONGEST_DIMENSIONS)
    request = PreemptionRequest(
        envelope=long_name,
        namespace="s" * 63,
        preemptor=f"{'s' * 63}/{long_name}",
        preemptor_uid="u" * 64,
        priority_class="c" * 63,
        requested_at=NOW,
    )
    status = ReservationPoolStatus(
        children={f"{i:036d}": line for i in range(pool_lines(dimensions))},
        shares={
            f"{'s' * 61}{i:02d}": NamespaceUsage(
                held=full,
                share="1000000.0000",
                weight=1000,
                open=10_000,
                waiting=10**9,
                tentative_claims=MAX_TENTATIVE_CLAIMS * 10_000,
            )
            for i in range(MAX_POOL_NAMESPACES)
        },
        preemptions={f"{i:036d}": request for i in range(MAX_PREEMPTIONS)},
    )
    written = len(status.model_dump_json(by_alias=True, exclude_none=True).encode())
    assert written <= LEDGER_BYTES_BUDGET - base_bytes(dimensions)
