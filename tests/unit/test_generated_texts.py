"""Every text the operator generates fits the field it is written to, at its worst case
(issue 21, §3 defect 4): 16 resources of 63-character names, the longest object names, a
person's annotation of any length. Found by review: an InsufficientCapacity message of
1,059 characters against the status field's 1,024 made every status write of the
envelope fail, so no claim status was written, nothing compacted, finalizers stayed.

Each case drives the generator (the core's admission, the claim status, the ledger pass,
the conditions, the summary) and checks its text against the maxLength of the generated
CRD schema: the API server's bound, not a copy of it."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from reservoir import crdgen
from reservoir.core.budgets import ParentView
from reservoir.core.claimstatus import claim_status
from reservoir.core.conditions import Desired, merge_conditions
from reservoir.core.ledger import one_line
from reservoir.core.lifecycle import LedgerEvent
from reservoir.core.model import (
    MAX_NAME_LENGTH,
    MAX_RESOURCES,
    BranchClaimStatus,
    ParentKind,
    ReservationEnvelopeStatus,
)
from reservoir.core.policy import request_problem
from reservoir.core.text import ELLIPSIS, EVENT_MESSAGE_LENGTH, bounded
from reservoir.handlers.claims import pending_without_envelope
from tests.unit.sim import Sim

NOW = datetime(2026, 1, 1, tzinfo=UTC)
# The longest resource names the schema accepts, as many as it accepts.
LONG_NAMES = [f"{index:02d}" + "r" * 61 for index in range(MAX_RESOURCES)]


def schema_bound(crd: dict[str, Any], path: str) -> int:
    """maxLength of the field at `path` (dotted; `[]` for list items) in a generated CRD."""
    node = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for part in path.split("."):
        node = node["items"] if part == "[]" else node["properties"][part]
    bound: int = node["maxLength"]
    return bound


CLAIM = crdgen.claim_crd()
ENVELOPE = crdgen.envelope_crd()


def fits_claim_status(status: BranchClaimStatus) -> None:
    """The status as written, checked against the CRD's bounds (the model checks them too:
    building it raised on main)."""
    if status.queue_reason is not None:
        assert len(status.queue_reason) <= schema_bound(CLAIM, "status.queueReason")
    for condition in status.conditions:
        assert len(condition.message) <= schema_bound(CLAIM, "status.conditions.[].message")
        assert len(condition.reason) <= schema_bound(CLAIM, "status.conditions.[].reason")
    BranchClaimStatus.model_validate(status.to_api())


def test_bounded_cuts_with_an_ellipsis_in_bytes_never_mid_character() -> None:
    assert bounded("short", 10) == "short"
    cut = bounded("é" * 600, 1024)
    assert cut.endswith(ELLIPSIS) and len(cut.encode()) <= 1024
    assert "\ufffd" not in cut


def test_insufficient_capacity_at_its_worst_case_fits_the_claims_status() -> None:
    sim = Sim(capacity={name: "10" for name in LONG_NAMES})
    sim.create("first", {name: "9" for name in LONG_NAMES}).reconcile()
    sim.create("second", {name: "2" for name in LONG_NAMES}).reconcile()
    assert sim.last is not None
    waiting = sim.last.pending["second"]
    assert waiting.reason == "InsufficientCapacity"
    assert len(waiting.message) <= schema_bound(CLAIM, "status.conditions.[].message")
    fits_claim_status(claim_status(None, waiting, None, None, NOW))


def test_an_unknown_resource_rejection_at_its_worst_case_fits() -> None:
    capacity = {name.replace("r", "c"): Decimal(1) for name in LONG_NAMES}
    problem = request_problem({name: Decimal(1) for name in LONG_NAMES}, capacity)
    assert problem is not None and problem.reason == "UnknownResource"
    fits_claim_status(claim_status(None, problem, None, None, NOW))
    # and through the ledger: the claim is rejected, its status and events fit
    sim = Sim(capacity={"tokens": "100"})
    sim.create("wide", {name: "1" for name in LONG_NAMES}).reconcile()
    entry = sim.status.entries["wide"]
    assert entry.phase == "Rejected"
    fits_claim_status(claim_status(entry, None, None, None, NOW))
    for event in sim.events:
        assert len(event.message.encode()) <= EVENT_MESSAGE_LENGTH


def test_a_force_settle_annotation_of_any_length_makes_bounded_events_and_status() -> None:
    sim = Sim()
    sim.create("a").reconcile().dispatch("a").reconcile()
    sim.force("a", "x" * 300_000).reconcile()
    assert "ForceSettled" in sim.reasons("a")
    for event in sim.events:
        assert len(event.message.encode()) <= EVENT_MESSAGE_LENGTH, event.reason
    fits_claim_status(claim_status(sim.entry("a"), None, None, None, NOW))


def test_every_ledger_event_message_is_bounded_where_it_is_made() -> None:
    event = LedgerEvent("uid", "claim", "Reason", "m" * 5000)
    assert len(event.message.encode()) <= EVENT_MESSAGE_LENGTH
    assert event.message.endswith(ELLIPSIS)


def test_conditions_bound_their_reason_and_message() -> None:
    (condition,) = merge_conditions(
        [], [Desired("InvalidSpec", True, "R" * 200, "unreadable: " + "m" * 5000)], NOW, 1
    )
    assert len(condition.reason) <= schema_bound(CLAIM, "status.conditions.[].reason")
    assert len(condition.message) <= schema_bound(CLAIM, "status.conditions.[].message")
    status = claim_status(None, None, None, None, NOW, problem="p" * 100_000)
    fits_claim_status(status)
    status = claim_status(None, None, None, None, NOW, awaiting_devices="w" * 100_000)
    fits_claim_status(status)


def test_the_envelopes_queue_reason_and_summary_fit_at_their_worst_case() -> None:
    most = {name: Decimal("1000000000000000000.000000001") for name in LONG_NAMES}
    assert len(one_line(most)) <= schema_bound(ENVELOPE, "status.summary.capacity")
    sim = Sim(capacity={name: "1" for name in LONG_NAMES})
    # a parent named on the old schema (no name pattern then), never found
    parent = ParentView(ParentKind.ENVELOPE, "p" * 100_000)
    sim.envelope = replace(sim.envelope, parent=parent)
    sim.reconcile()
    reason = sim.status.queue_reason
    assert reason is not None and reason.startswith("waiting for ReservationEnvelope ppp")
    assert len(reason) <= schema_bound(ENVELOPE, "status.queueReason")
    for condition in sim.status.conditions:
        assert len(condition.message) <= schema_bound(ENVELOPE, "status.conditions.[].message")
    ReservationEnvelopeStatus.model_validate(sim.status.to_api())


def test_a_claim_waiting_for_a_missing_envelope_of_the_longest_name_fits() -> None:
    fits_claim_status(pending_without_envelope("e" * MAX_NAME_LENGTH))
    fits_claim_status(pending_without_envelope("e" * 100_000))  # an object on the old schema
