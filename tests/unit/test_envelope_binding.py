"""Issue 21 #3: claims join their envelope by name but are bound to the envelope that
decided on them (its UID, in their status). An envelope re-created under an old name never
moves capacity for a claim of the one before it."""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal

from reservoir.core.claimstatus import claim_status, settled_record
from reservoir.core.model import ReservationEnvelopeStatus
from tests.unit.sim import Sim


def quarantined_then_replaced() -> Sim:
    """x (20) detaches with usage 0 and is quarantined (C = R) in envelope env (UID old);
    env is deleted with x surviving and re-created under its name (UID new)."""
    sim = Sim(default_lease_seconds=10, ambiguity_deadline_seconds=5)
    sim.envelope = replace(sim.envelope, name="env", uid="old")
    sim.create("x").dispatch("x").reconcile()
    sim.tick(11).reconcile()  # lease lapsed: Detached
    sim.tick(6).reconcile()  # deadline: Quarantined, all of R charged
    assert sim.entry("x").settlement is not None
    assert sim.status.totals.committed == {"tokens": Decimal(20)}
    # Its status as the mirror writes it: the record, bound to the envelope that decided.
    assert sim.last is not None
    entry = sim.last.entry("x")
    assert entry is not None
    status = claim_status(entry, None, None, None, sim.now, envelope_uid="old")
    assert status.envelope_uid == "old"
    record = settled_record(status, "x", "x", 1)
    sim.claims["x"] = replace(sim.claims["x"], settled_record=record, envelope_uid="old")
    # Deleted, then created again under the same name: a new object, a new ledger.
    sim.envelope = replace(sim.envelope, uid="new")
    sim.status = ReservationEnvelopeStatus()
    sim.tick().reconcile()
    assert sim.status.totals.available == {"tokens": Decimal(100)}
    return sim


def test_a_late_report_of_a_claim_of_a_deleted_envelope_moves_nothing_in_its_successor() -> None:
    """The late report (5 of 20) would return 15 to the new envelope it never drew from:
    committed went to -15 (the ledger refused every write: wedged), or it gained 15."""
    sim = quarantined_then_replaced()
    sim.usage("x", "5", final=True).tick().reconcile()
    totals = sim.status.totals
    assert totals.committed.get("tokens", Decimal(0)) == 0
    assert totals.available == {"tokens": Decimal(100)}
    assert "x" not in sim.status.entries
    assert sim.last is not None and "x" in sim.last.replaced
    assert "since deleted" in sim.last.replaced["x"]


def test_a_claim_never_decided_on_joins_the_new_envelope() -> None:
    sim = quarantined_then_replaced()
    sim.create("y").reconcile()
    assert sim.phase("y").value == "Tentative"
    assert sim.status.totals.reserved == {"tokens": Decimal(20)}
    assert sim.last is not None
    entry = sim.last.entry("y")
    assert entry is not None
    bound = claim_status(entry, None, None, None, sim.now, envelope_uid=sim.last.envelope_uid)
    assert bound.envelope_uid == "new"
