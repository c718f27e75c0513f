"""A claim's status carries its line once (`status.ledger`): readers see the line's fields
through `expanded`, and a claim settled before `status.ledger` existed keeps the record
its status fields carry, settlement included, through the operator's next write."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

from reservoir.core.claimstatus import (
    claim_status,
    expanded,
    line_fields,
    settled_record,
    settled_view,
)
from reservoir.core.model import BranchClaimStatus, ClaimPhase, LedgerEntry, Settlement
from reservoir.core.model.claim import LINE_FIELDS

NOW = datetime(2026, 1, 1, tzinfo=UTC)
SETTLED = Settlement(
    key="uid-a/1/1", phase=ClaimPhase.CONSUMED, reason="FinalUsage", outcome="Succeeded", at=NOW
)
LINE = LedgerEntry(
    claim="a",
    phase=ClaimPhase.CONSUMED,
    reserved={"tokens": Decimal(5)},
    usage={"tokens": Decimal(2)},
    consumed={"tokens": Decimal(2)},
    released={"tokens": Decimal(3)},
    first_reserved_at=NOW,
    expires_at=NOW,
    settlement=SETTLED,
    result="s3://b/out",
)

# What a claim's status holds besides its line (everything else is the line's), and the
# lease: its holder and generation, the fence the API server compares a write's with.
OWN_FIELDS = {"phase", "placement", "queue_reason", "ledger", "envelope_uid", "conditions",
              "observed_generation", "settlement", "lease"}  # fmt: skip


def test_the_operator_writes_the_line_once() -> None:
    written = claim_status(LINE, None, None, 1, NOW)
    assert written.ledger == LINE
    assert set(written.model_fields_set) <= OWN_FIELDS
    assert written.settlement is None, "a new claim's settlement is in its line only"
    api = written.to_api()
    assert set(api) <= {"phase", "ledger", "conditions", "observedGeneration", "lease"}, sorted(api)
    assert api["lease"] == {"generation": 1, "renewals": 0}, "the fence: the rest is the line's"
    held = claim_status(LINE.model_copy(update={"holder": "w", "renewals": 2}), None, None, 1, NOW)
    assert held.to_api()["lease"] == {"holder": "w", "generation": 3, "renewals": 2}
    unreserved = LINE.model_copy(update={"first_reserved_at": None})
    assert "lease" not in claim_status(unreserved, None, None, 1, NOW).to_api()


def test_readers_see_the_lines_fields_on_the_status() -> None:
    seen = expanded(claim_status(LINE, None, None, 1, NOW))
    assert seen.consumed == {"tokens": Decimal(2)} and seen.released == {"tokens": Decimal(3)}
    assert seen.settlement == SETTLED and seen.result == "s3://b/out"
    assert seen.lease is not None and seen.lease.expires_at == NOW
    assert expanded(BranchClaimStatus()) == BranchClaimStatus(), "no line: nothing laid over"


def test_a_settled_line_is_the_claims_record_only_if_keyed_to_it() -> None:
    written = claim_status(LINE, None, None, 1, NOW)
    assert settled_record(written, "uid-a", "a", 1) == LINE
    assert settled_record(written, "uid-b", "a", 1) is None, "another claim's settlement"


def test_a_claim_settled_before_the_line_keeps_its_record_and_its_settlement() -> None:
    old = expanded(claim_status(LINE, None, None, 1, NOW)).model_copy(
        update={"ledger": None, "settlement": SETTLED}
    )
    record = settled_record(old, "uid-a", "a", 1)
    assert record is not None and settled_view(record) == settled_view(LINE)
    rewritten = claim_status(record, None, old, 1, NOW)
    assert rewritten.settlement == SETTLED, "the API server keeps it for good"
    assert rewritten.ledger == record and rewritten.consumed == {}
    again = settled_record(rewritten, "uid-a", "a", 1)
    assert again is not None and settled_view(again) == settled_view(LINE)


def test_readers_get_every_field_the_writer_leaves_out() -> None:
    """`expanded` lays over the status exactly the fields `to_api` leaves out when empty:
    a field added to one list and not the other would vanish for readers."""
    assert set(line_fields(LINE, BranchClaimStatus())) == LINE_FIELDS
