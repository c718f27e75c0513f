"""Compensations after settlement (issue 22): recorded once per key, whatever the pass
sequence; Consumable resources only; a refund never takes a claim's charge below zero; a
charge at most what the envelope has available; recorded only while it is not open; a
compensation on an unsettled claim waits. Driven through the pure core (tests/unit/sim.py),
with the writer's crash points: a pass whose envelope write was lost, and a pass written
whose claim statuses were not mirrored."""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from reservoir import metrics
from reservoir.cli.plugin import compensation_line, envelope_ledger, history_lines
from reservoir.core.claimstatus import claim_status, expanded, settled_record
from reservoir.core.compensation import APPLIED, RECORDED
from reservoir.core.ledger import ZERO
from reservoir.core.lifecycle import LedgerEvent
from reservoir.core.model import (
    MAX_COMPENSATIONS,
    ClaimPhase,
    CompensationRecord,
    ReservationEnvelopeSpec,
)
from reservoir.sdk.compensation import already_sent, compensation_request
from reservoir.sdk.errors import CompensationError
from reservoir.sdk.patches import compensation_patch
from reservoir.sdk.views import EnvelopeView
from tests.unit.sim import Sim

CAPACITY = {"tokens": "100", "cost": "10", "concurrency": "2"}
RESOURCES = ("tokens", "cost", "concurrency")


def settled(sim: Sim | None = None, mirror: bool = True) -> Sim:
    """Claim `a` settled Consumed: tokens C=30 of R=50, cost C=4 of R=5, a permit."""
    sim = sim or Sim(capacity=CAPACITY)
    sim.create("a", {"tokens": "50", "cost": "5", "concurrency": "1"}).reconcile()
    sim.dispatch("a").reconcile()
    sim.update("a", usage={"tokens": "30", "cost": "4"}, final=True, outcome="Succeeded")
    sim.reconcile()
    if mirror:
        sim.mirror().reconcile()  # the ledger compacts the entry away
    return sim


def ask(sim: Sim, key: str, refund: dict[str, str] | None = None, **charge: str) -> Sim:
    asked = list(sim.claims["a"].spec.model_dump(by_alias=True)["compensations"])
    asked.append({"key": key, "refund": refund or {}, "charge": charge, "reason": "why"})
    return sim.update("a", compensations=asked)


def committed(sim: Sim, resource: str) -> Decimal:
    return sim.status.totals.committed[resource]


def records(sim: Sim) -> list[CompensationRecord]:
    return sim.entry("a").compensations


def test_a_refund_moves_the_committed_total_once_and_the_record_compacts_away() -> None:
    sim = settled()
    assert "a" not in sim.status.entries and committed(sim, "cost") == Decimal(4)
    ask(sim, "void-1", {"cost": "2.5"}).reconcile()
    # Written with the totals it changes: the record is back in the ledger.
    assert "a" in sim.status.entries
    assert committed(sim, "cost") == Decimal("1.5")
    assert sim.available("cost") == "8.5"
    for _ in range(3):  # passes before the mirror change nothing
        sim.reconcile()
    assert committed(sim, "cost") == Decimal("1.5")
    sim.mirror().reconcile()
    assert "a" not in sim.status.entries  # the claim's status carries it: compacted
    (record,) = sim.claims["a"].settled_record.compensations  # type: ignore[union-attr]
    assert record.applied and record.refunded == {"cost": Decimal("2.5")}
    for _ in range(3):
        sim.reconcile().mirror()
    assert committed(sim, "cost") == Decimal("1.5")
    assert sim.reasons("a").count(APPLIED) == 1


def test_a_refund_never_takes_the_claims_charge_below_zero() -> None:
    sim = settled()
    ask(sim, "r1", {"tokens": "20"}).reconcile().mirror().reconcile()
    ask(sim, "r2", {"tokens": "25"}).reconcile().mirror().reconcile()
    assert committed(sim, "tokens") == ZERO
    first, second = records(sim)
    assert first.refunded == {"tokens": Decimal(20)}
    assert second.refunded == {"tokens": Decimal(10)} and second.applied
    assert second.note is not None and "refunded 10 of 25" in second.note
    ask(sim, "r3", {"tokens": "1"}).reconcile().mirror().reconcile()
    assert not records(sim)[2].applied and committed(sim, "tokens") == ZERO


def test_a_refund_counts_a_follow_up_charge_and_stays_within_what_was_charged() -> None:
    sim = settled()
    ask(sim, "c1", tokens="10").reconcile().mirror().reconcile()
    assert committed(sim, "tokens") == Decimal(40)
    ask(sim, "r1", {"tokens": "100"}).reconcile().mirror().reconcile()
    assert records(sim)[1].refunded == {"tokens": Decimal(40)}
    assert committed(sim, "tokens") == ZERO


def test_a_charge_waits_for_room_with_first_call_on_what_comes_back() -> None:
    """Found by review: a charge was capped by what was available when it came and its key
    recorded as done, so a tenant dodged an invoice by holding its budget for a moment."""
    sim = settled()
    sim.create("b", {"tokens": "60"}).reconcile()  # holds 60: 10 tokens available
    assert sim.available() == "10"
    ask(sim, "late-invoice", tokens="25", cost="1").reconcile().reconcile()
    assert records(sim) == []  # waits, unrecorded
    assert committed(sim, "tokens") == Decimal(30)
    # What comes back goes to the charge first: a new claim is not admitted ahead of it.
    sim.tick().create("c", {"tokens": "60"}).cancel("b").reconcile()
    sim.reconcile()
    (record,) = records(sim)
    assert record.applied and record.charged == {"tokens": Decimal(25), "cost": Decimal(1)}
    assert committed(sim, "tokens") == Decimal(55)
    # 70 came back: c (60) is not admitted ahead of the charge (25), which leaves 45.
    assert sim.phase("c") is ClaimPhase.PENDING and sim.available() == "45"


def test_at_its_last_call_a_charge_takes_what_there_is_and_the_rest_is_recorded() -> None:
    sim = settled()
    sim.create("b", {"tokens": "60"}).reconcile()
    ask(sim, "late-invoice", tokens="80").reconcile()
    assert records(sim) == []
    sim.close().reconcile()  # b still holds: the envelope waits, and so does the charge
    assert records(sim) == [] and sim.status.closed_at is None
    # No wake-up per pass while a claim holds (it spun the writer): b's own end wakes it.
    assert sim.last is not None and sim.last.wake_at != sim.now
    sim.cancel("b").reconcile()  # b settles: nothing held, the next pass is the last call
    assert records(sim) == [] and sim.last.wake_at == sim.now
    sim.reconcile()  # the last call, then the close
    (record,) = records(sim)
    assert record.applied and record.charged == {"tokens": Decimal(70)}
    assert record.note is not None and "charged 70 of 80" in record.note
    assert sim.status.closed_at is not None
    assert sim.status.balance_released.get("tokens", ZERO) == ZERO


def test_only_consumable_resources_move_and_the_others_are_named() -> None:
    sim = settled()
    ask(sim, "k", {"concurrency": "1", "cost": "1", "gpu-hours": "3"}).reconcile()
    (record,) = records(sim)
    assert record.refunded == {"cost": Decimal(1)}
    assert record.note is not None
    assert "concurrency: Reusable" in record.note and "gpu-hours: not a resource" in record.note
    assert committed(sim, "concurrency") == ZERO
    # Only a Reusable resource asked: nothing moves, recorded only.
    ask(sim, "k2", {"concurrency": "1"}).reconcile().mirror().reconcile()
    assert not records(sim)[1].applied


def test_a_declared_contract_decides_what_moves() -> None:
    sim = Sim(capacity=CAPACITY)
    spec = {**sim.envelope.spec.model_dump(), "contracts": {"cost": {"type": "Reusable"}}}
    sim.envelope = replace(sim.envelope, spec=ReservationEnvelopeSpec.model_validate(spec))
    settled(sim)
    ask(sim, "k", {"cost": "1", "tokens": "5"}).reconcile()
    (record,) = records(sim)
    assert record.refunded == {"tokens": Decimal(5)}
    assert record.note is not None and "cost: Reusable" in record.note


def test_recorded_only_while_the_envelope_is_not_open() -> None:
    sim = settled()
    sim.close().reconcile().mirror().reconcile()
    before = dict(sim.status.totals.committed)
    ask(sim, "after-close", {"cost": "2"}).reconcile()
    assert "a" not in sim.status.entries  # nothing moves: the record stays off the ledger
    sim.mirror().reconcile()
    (record,) = records(sim)
    assert not record.applied and record.refunded == {"cost": Decimal(2)}
    assert record.note is not None and "not open" in record.note
    assert sim.status.totals.committed == before
    assert RECORDED in sim.reasons("a")


def test_a_compensation_on_an_unsettled_claim_waits_for_its_settlement() -> None:
    sim = Sim(capacity=CAPACITY)
    sim.create("a", {"tokens": "50", "cost": "5"}).reconcile().dispatch("a").reconcile()
    ask(sim, "early", {"tokens": "5"}).reconcile().reconcile()
    assert records(sim) == [] and committed(sim, "tokens") == ZERO
    sim.update("a", usage={"tokens": "30"}, final=True, outcome="Succeeded").reconcile()
    # Settled in one pass (C=30), compensated in the next, on the balance written then
    # (found by review: in the settling pass the balance was the one before R − C returned).
    assert committed(sim, "tokens") == Decimal(30) and records(sim) == []
    assert sim.last is not None and sim.last.wake_at == sim.now
    sim.reconcile()
    assert committed(sim, "tokens") == Decimal(25)
    assert [r.key for r in records(sim)] == ["early"]


def test_a_compensation_waits_for_room_in_the_ledgers_byte_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from reservoir.core import reconcile

    sim = settled()
    monkeypatch.setattr(reconcile, "LEDGER_BYTES_BUDGET", 0)
    ask(sim, "k", {"cost": "1"}).reconcile().mirror().reconcile()
    assert records(sim) == [] and committed(sim, "cost") == Decimal(4)
    monkeypatch.undo()
    sim.reconcile().mirror().reconcile()
    assert [r.key for r in records(sim)] == ["k"] and committed(sim, "cost") == Decimal(3)


def test_the_claim_status_round_trips_its_compensations() -> None:
    sim = settled()
    ask(sim, "k", {"cost": "1"}).reconcile()
    entry = sim.status.entries["a"]
    status = claim_status(entry, None, None, None, sim.now)
    assert status.ledger == entry, "written once, as the line"
    assert expanded(status).compensations == entry.compensations, "read as before"
    back = settled_record(status, "a", "a", 1)
    assert back is not None and back.compensations == entry.compensations


# --- the property: once per key, whatever the pass sequence ----------------------------

amounts = st.dictionaries(
    st.sampled_from(RESOURCES), st.integers(min_value=-40, max_value=40).filter(bool), max_size=3
)
steps = st.lists(
    st.one_of(
        st.tuples(st.just("ask"), amounts),
        st.sampled_from([("pass",), ("lost",), ("mirror",), ("hold",), ("free",)]),
    ),
    max_size=30,
)


class Writer:
    """The writer's crash points over a Sim: a pass is written (envelope status) or lost
    (a crash before the write); the mirror writes claim statuses from the last written
    pass only (a crash between the two writes skips it)."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.written = True

    def step(self, action: tuple[Any, ...], asked: list[dict[str, Any]]) -> None:
        sim = self.sim
        if action[0] == "ask" and len(asked) < MAX_COMPENSATIONS:
            charge = {k: str(v) for k, v in action[1].items() if v > 0}
            refund = {k: str(-v) for k, v in action[1].items() if v < 0}
            asked.append(
                {"key": f"k{len(asked)}", "charge": charge, "refund": refund, "reason": "r"}
            )
            sim.update("a", compensations=list(asked))
        elif action[0] == "pass":
            sim.reconcile()
            self.written = True
        elif action[0] == "lost":
            kept = sim.status
            sim.reconcile()
            sim.status, self.written = kept, False
        elif action[0] == "mirror" and self.written and sim.last is not None:
            sim.mirror()
        elif action[0] == "hold" and "b" not in sim.claims:
            sim.create("b", {"tokens": "60", "cost": "5"})
        elif action[0] == "free" and "b" in sim.claims:
            sim.cancel("b")

    def drain(self) -> None:
        """Every pass lands."""
        for _ in range(4):
            self.sim.reconcile().mirror()

    def settle(self) -> None:
        """Every pass lands; then the envelope closes (a charge that waited for room has
        its last call on the balance once nothing is held)."""
        self.drain()
        if "b" in self.sim.claims:
            self.sim.cancel("b")
        self.sim.close()
        for _ in range(4):
            self.sim.reconcile().mirror()


def outcome(sim: Sim) -> list[tuple[Any, ...]]:
    return [(r.key, r.charged, r.refunded, r.applied, r.note) for r in records(sim)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=steps)
def test_each_key_is_applied_once_whatever_the_pass_sequence(
    history: list[tuple[Any, ...]],
) -> None:
    run = Writer(settled(mirror=False))
    asked: list[dict[str, Any]] = []
    for action in history:
        run.step(action, asked)
        totals = run.sim.status.totals
        for resource in RESOURCES:
            parts = (totals.committed, totals.reserved, totals.reconciling, totals.available)
            assert sum(p[resource] for p in parts) == totals.capacity[resource]
            assert totals.committed[resource] >= ZERO and totals.available[resource] >= ZERO
    run.settle()
    sim = run.sim
    keys = [r.key for r in records(sim)]
    assert keys == [c["key"] for c in asked]  # each once, in order
    assert "a" not in sim.status.entries  # compacted once mirrored
    for resource, consumed in {"tokens": Decimal(30), "cost": Decimal(4)}.items():
        net = consumed + sum(
            (r.charged.get(resource, ZERO) - r.refunded.get(resource, ZERO))
            for r in records(sim)
            if r.applied
        )
        assert net >= ZERO
        # Claim b is never dispatched: it is charged nothing, whatever becomes of it.
        assert committed(sim, resource) == net
    assert committed(sim, "concurrency") == ZERO


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=steps)
def test_coalesced_and_crashed_histories_record_what_a_step_by_step_one_does(
    history: list[tuple[Any, ...]],
) -> None:
    """Without a competing claim (the balance moves only with these compensations), the
    records are the same whether every append was reconciled and mirrored at once, or
    passes were coalesced, lost, or written without their mirror."""
    history = [a for a in history if a[0] not in ("hold", "free")]
    crashed = Writer(settled())
    reference = Writer(settled())
    asked_crashed: list[dict[str, Any]] = []
    asked_reference: list[dict[str, Any]] = []
    for action in history:
        crashed.step(action, asked_crashed)
        if action[0] == "ask":
            reference.step(action, asked_reference)
            reference.drain()
    crashed.settle()
    reference.settle()
    assert outcome(crashed.sim) == outcome(reference.sim)
    assert crashed.sim.status.totals == reference.sim.status.totals


# --- the event's metric, and the SDK's request ------------------------------------------


def test_compensation_events_are_counted_by_result() -> None:
    def value(result: str) -> float:
        labels = {"namespace": "ns-comp", "class": "c", "result": result}
        return REGISTRY.get_sample_value("reservoir_compensations_total", labels) or 0.0

    before = value("applied"), value("recorded")
    metrics.count_events(
        "ns-comp",
        "c",
        [
            LedgerEvent("u", "a", APPLIED, "m"),
            LedgerEvent("u", "a", RECORDED, "m", warning=True),
            LedgerEvent("u", "a", RECORDED, "m", warning=True),
        ],
    )
    assert (value("applied"), value("recorded")) == (before[0] + 1, before[1] + 2)


def test_a_signed_amount_splits_into_charge_and_refund_with_a_stable_key() -> None:
    one = compensation_request({"cost": "-2.50", "tokens": 100}, "refund", "INV-7")
    assert one.refund == {"cost": Decimal("2.5")} and one.charge == {"tokens": Decimal(100)}
    again = compensation_request({"tokens": "100", "cost": Decimal("-2.5")}, "refund", "INV-7")
    assert again.key == one.key  # a retried call is the same compensation
    other = compensation_request({"cost": "-2.50"}, "refund", "INV-8")
    assert other.key != one.key
    assert compensation_request({"cost": "+1"}, "x", key="mine").key == "mine"


@pytest.mark.parametrize(
    ("amount", "reason", "key", "says"),
    [
        ({}, "r", None, "needs an amount"),
        ({"cost": "0"}, "r", None, "zero amount"),
        ({"cost": "-0.0"}, "r", None, "zero amount"),
        ({"cost": "--1"}, "r", None, "cost:"),
        ({"cost": "1"}, " ", None, "needs a reason"),
        ({"cost": "1"}, "r", "-bad key", "key"),
        ({"cost": "1"}, "r" * 300, None, "reason"),
    ],
)
def test_a_compensation_that_cannot_be_sent_is_a_clear_error(
    amount: dict[str, str], reason: str, key: str | None, says: str
) -> None:
    with pytest.raises(CompensationError, match=says):
        compensation_request(amount, reason, key=key)


def test_a_sent_key_is_a_no_op_another_with_it_an_error_and_the_list_is_bounded() -> None:
    wanted = compensation_request({"cost": "-1"}, "refund")
    assert already_sent([wanted], wanted, "a")
    assert not already_sent([], wanted, "a")
    with pytest.raises(CompensationError, match="already names another"):
        already_sent([compensation_request({"cost": "-2"}, "x", key=wanted.key)], wanted, "a")
    full = [compensation_request({"cost": "1"}, f"r{i}") for i in range(MAX_COMPENSATIONS)]
    with pytest.raises(CompensationError, match=f"already holds {MAX_COMPENSATIONS}"):
        already_sent(full, wanted, "a")


def test_the_append_tests_the_list_as_read() -> None:
    wanted = compensation_request({"cost": "-1"}, "refund")
    read = {
        "metadata": {"uid": "uid-1", "generation": 3},
        "spec": {"compensations": [{"key": "k0"}]},
    }
    patch = compensation_patch(read, wanted.to_api())
    assert {"op": "test", "path": "/spec/compensations", "value": [{"key": "k0"}]} in patch
    assert patch[-1] == {"op": "add", "path": "/spec/compensations/-", "value": wanted.to_api()}
    assert {"op": "test", "path": "/metadata/generation", "value": 3} in patch
    fresh = compensation_patch({"metadata": {"uid": "uid-1", "generation": 1}}, wanted.to_api())
    assert fresh[-1] == {"op": "add", "path": "/spec/compensations", "value": [wanted.to_api()]}


# --- what `kubectl reservoir history` and `ledger` show ---------------------------------


def test_history_and_ledger_show_compensations_applied_recorded_and_waiting() -> None:
    sim = settled()
    ask(sim, "void-1", {"cost": "2.5", "concurrency": "1"}).reconcile()
    ask(sim, "late", tokens="5")  # asked, not reconciled yet
    entry = sim.status.entries["a"]
    lines = "\n".join(history_lines("ns/a", entry, sim.claims["a"].spec.compensations))
    assert "compensation void-1 at 2026-01-01T00:00:00Z: refunded cost=2.5; applied" in lines
    assert "concurrency: Reusable" in lines
    assert "compensation late: charge tokens=5 asked, being applied" in lines
    view = EnvelopeView(name="env", namespace="ns", status=sim.status)
    shown = "\n".join(envelope_ledger(view))
    assert "compensations:\n  a: compensation void-1" in shown
    sim.close().reconcile().mirror().reconcile()  # applied while closing, then closed
    assert records(sim)[-1].applied and sim.status.closed_at is not None
    ask(sim, "after-close", tokens="1").reconcile().mirror().reconcile()
    record = records(sim)[-1]  # recorded only, off the ledger
    assert record.key == "after-close" and not record.applied
    assert "recorded only (not applied to the envelope)" in compensation_line(record)
