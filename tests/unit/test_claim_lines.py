"""Each claim holds its own ledger line; the envelope holds totals and the moves in flight
(reservoir.core.inflight). The pure core, driven as the writer drives it: a pass, then the
claims' status writes (`write_lines`), some of them lost, late or never seen."""

from __future__ import annotations

import json

import pytest

from reservoir.core.inflight import (
    IN_FLIGHT_LIMIT,
    LOST_PREFIX,
    MOVES_PER_PASS,
    ClaimViewBehindError,
    EnvelopeBehindError,
    digest,
)
from reservoir.core.model import ClaimPhase as P
from tests.unit.sim import Sim


def fan_out(n: int, **policy: object) -> Sim:
    sim = Sim(capacity={"tokens": "10M"}, default_lease_seconds=600, **policy)
    for i in range(n):
        sim.create(f"c{i:05d}", {"tokens": "10"})
    return sim


def settle_in(sim: Sim, passes: int = 50) -> Sim:
    """Passes, each followed by the claims' status writes, until nothing is in flight."""
    for _ in range(passes):
        sim.reconcile().write_lines()
        if not sim.status.entries and not sim.last.pending:  # type: ignore[union-attr]
            return sim.reconcile()
    raise AssertionError("moves still in flight after many passes")


def test_a_wide_fan_out_is_admitted_a_bounded_batch_a_pass_and_leaves_the_envelope_small() -> None:
    sim = fan_out(1000)
    sim.reconcile()
    assert len(sim.status.entries) == IN_FLIGHT_LIMIT, "a pass puts a bounded batch in flight"
    assert sim.last is not None
    assert sim.last.pending["c00999"].reason == "MovesInFlight"
    settle_in(sim)
    assert all(sim.phase(f"c{i:05d}") is P.TENTATIVE for i in range(1000))
    assert sim.status.entries == {}, "every claim shows its line: nothing is in flight"
    assert sim.status.claim_records is not None and sim.status.claim_records.count == 1000
    assert sim.total("reserved") == "10000"
    size = len(json.dumps(sim.status.to_api()))
    assert size < 4096, f"the envelope holds totals only, not 1,000 lines ({size} bytes)"


def test_a_kill_between_the_envelope_write_and_the_claim_writes_loses_and_repeats_nothing() -> None:
    sim = fan_out(3)
    sim.reconcile()  # written to the envelope; the operator dies before any claim write
    in_flight = dict(sim.status.entries)
    assert set(in_flight) == {"c00000", "c00001", "c00002"}
    sim.reconcile()  # a new operator: the same lines, still in flight, nothing admitted twice
    assert sim.status.entries == in_flight
    assert sim.total("reserved") == "30"
    sim.write_lines(only={"c00001"})  # it dies again part way through the mirror
    sim.reconcile()
    assert set(sim.status.entries) == {"c00000", "c00002"}, "the line its claim shows retires"
    sim.write_lines().reconcile()
    assert sim.status.entries == {}
    assert sim.total("reserved") == "30"


def test_a_move_that_leaves_the_totals_alone_is_written_to_the_claim_only() -> None:
    sim = settle_in(fan_out(2))
    stamp = sim.status.stamp
    sim.dispatch("c00000").reconcile()
    assert sim.phase("c00000") is P.COMMITTED
    assert sim.status.entries == {}, "a commit never goes through the envelope"
    assert sim.status.stamp == stamp
    assert sim.last is not None and set(sim.last.to_claims) == {"c00000"}
    sim.write_lines().reconcile()
    assert sim.claims["c00000"].line is not None
    assert sim.claims["c00000"].line.phase is P.COMMITTED


def test_a_settlement_goes_in_flight_and_returns_capacity_exactly_once() -> None:
    sim = settle_in(fan_out(2))
    sim.cancel("c00000").reconcile()
    assert sim.phase("c00000") is P.RELEASED
    assert "c00000" in sim.status.entries, "a move of the totals is in flight first"
    assert sim.status.entries["c00000"].stamp == sim.status.stamp
    assert sim.available() == str(10_000_000 - 10)
    for _ in range(3):  # the claim write is lost, again and again: nothing moves twice
        sim.reconcile()
        assert sim.available() == str(10_000_000 - 10)
    sim.write_lines().reconcile()
    assert sim.status.entries == {}
    assert sim.available() == str(10_000_000 - 10)
    assert sim.phase("c00000") is P.RELEASED
    assert sim.status.claim_records is not None and sim.status.claim_records.count == 1


def test_a_claim_that_has_not_seen_its_latest_move_is_overruled_by_the_envelope() -> None:
    sim = settle_in(fan_out(1))
    old = sim.claims["c00000"].line
    sim.cancel("c00000").reconcile()  # Released in flight; the claim still shows Tentative
    assert old is not None and old.phase is P.TENTATIVE
    sim.reconcile()
    assert sim.phase("c00000") is P.RELEASED
    assert sim.total("reserved") == "0"


def test_a_claim_line_newer_than_the_envelope_read_means_the_envelope_read_is_old() -> None:
    sim = settle_in(fan_out(1))
    older = sim.status.model_copy(deep=True)
    sim.cancel("c00000").reconcile().write_lines()
    sim.status = older  # a replica that read the envelope before that write
    with pytest.raises(EnvelopeBehindError):
        sim.reconcile()


def test_a_view_of_the_claims_that_lags_is_read_again_and_a_lost_line_is_kept_held() -> None:
    sim = settle_in(fan_out(3))
    sim.remove("c00001")  # gone with its line, and the operator never saw the deletion
    with pytest.raises(ClaimViewBehindError):
        sim.reconcile(fresh=False)
    sim.reconcile(fresh=True)  # read fresh: lost, not late
    lost = [u for u in sim.status.entries if u.startswith(LOST_PREFIX)]
    assert len(lost) == 1
    assert sim.status.entries[lost[0]].phase is P.DETACHED
    assert sim.total("reserved") == "20" and sim.total("reconciling") == "10"
    assert sim.available() == str(10_000_000 - 30), "what was lost is never returned on a guess"
    for _ in range(3):  # the other two lapse and return; the lost line stays held
        sim.tick(3600).reconcile().write_lines()
        assert sim.status.entries[lost[0]].phase is P.DETACHED, "no deadline settles it"
        assert sim.total("reconciling") == "10"
    sim.force_gone(lost[0], "checked the provider: nothing ran").reconcile()
    assert lost[0] not in sim.status.entries, "settled by a person, and pruned"
    assert sim.total("reconciling") == "0"


def test_a_claim_seen_deleted_with_its_line_is_settled_from_that_line() -> None:
    sim = settle_in(fan_out(2))
    line = sim.claims["c00001"].line
    assert line is not None
    sim.remove("c00001")
    sim.reconcile(departed={"c00001": line}, fresh=False)
    assert not any(u.startswith(LOST_PREFIX) for u in sim.status.entries)
    assert "c00001" in sim.status.entries, "its line is in flight: no claim can hold it"
    assert sim.total("reserved") == "20", "a vanished claim may have run: its R stays held"
    sim.reconcile()  # the departed line is not needed again: the envelope has it
    assert "c00001" in sim.status.entries
    sim.force_gone("c00001", "it never ran").reconcile()
    assert "c00001" not in sim.status.entries, "settled by a person, and pruned: it is gone"
    assert sim.total("reserved") == "10"


def test_a_mass_move_goes_in_flight_a_bounded_batch_a_pass() -> None:
    n = MOVES_PER_PASS + 100
    sim = settle_in(fan_out(n))
    for i in range(n):
        sim.cancel(f"c{i:05d}")
    sim.reconcile()
    assert 0 < len(sim.status.entries) <= MOVES_PER_PASS, "the count and byte budget bound it"
    left = n - len(sim.status.entries)
    assert sim.total("reserved") == str(10 * left), "the lines left for the next pass still hold"
    assert sim.last is not None and sim.last.wake_at is not None
    settle_in(sim)
    assert sim.total("reserved") == "0"
    assert sim.available() == "10000000"


def test_the_digest_is_order_free_and_names_each_stamp() -> None:
    assert digest([("a", 1), ("b", 2)]) == digest([("b", 2), ("a", 1)])
    assert digest([("a", 1)]) != digest([("a", 2)])
    assert digest([]) == "0" * 32


def test_a_commit_writes_the_claim_and_not_the_envelope_even_though_its_counts_move() -> None:
    from reservoir.k8s.ledger_writer import ledger_moved

    sim = settle_in(fan_out(2))
    before = sim.status.model_copy(deep=True)
    sim.dispatch("c00000").reconcile()
    assert sim.status.counts != before.counts, "the count by phase moved"
    assert not ledger_moved(before, sim.status), "but the envelope need not be written"
    sim.write_lines().cancel("c00001").reconcile()
    assert ledger_moved(before, sim.status), "a settlement moves the totals"
