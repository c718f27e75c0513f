"""Each child envelope holds its own line (issue 23): a parent (an envelope or the tenant's
pool) keeps only the lines in flight and a digest of those its children hold
(reservoir.core.childlines). Driven through the pure core with the tree simulator, whose
auditor (tree_sim.Books) checks every level after every reconcile: the invariant, one line
per child, R − C returned once."""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal

import pytest

from reservoir.core.budgets import ChildFacts
from reservoir.core.childlines import LOST_CHILDREN_PREFIX, merge_children
from reservoir.core.inflight import EnvelopeBehindError
from reservoir.core.model import (
    MAX_ENVELOPE_CHILDREN,
    ChildEntry,
    ChildPhase,
    EnvelopePhase,
    ParentKind,
    ParentRecord,
)
from tests.unit.tree_sim import POOL, T0, Run, World


def open_roots(count: int, tokens: int = 10) -> tuple[World, Run]:
    world = World.with_pool({"tokens": 1_000})
    run = Run(world)
    for n in range(count):
        world.create_envelope(f"r{n}", {"tokens": tokens})
    run.settle()
    return world, run


def test_a_pool_keeps_no_line_its_envelopes_hold_and_totals_add_up() -> None:
    _, run = open_roots(3)
    assert run.pool.children == {}
    assert run.pool.child_records is not None and run.pool.child_records.count == 3
    assert run.pool.totals.reserved == {"tokens": 30}
    record = run.of("r0").parent
    assert record is not None and record.stamp > 0 and record.reserved == {"tokens": 10}


def test_a_line_stays_in_flight_until_its_child_records_it() -> None:
    """kill -9 between the parent's write and the child's: the parent's copy holds the
    capacity for as long as the child has not recorded it, and nothing is reserved twice."""
    world = World.with_pool({"tokens": 100})
    run = Run(world)
    world.create_envelope("r", {"tokens": 40})
    for _ in range(3):  # the pool's writer runs; the envelope's never does
        run.reconcile_pool()
        world.tick()
    uid = world.uid("r")
    assert set(run.pool.children) == {uid}
    assert run.pool.children[uid].phase is ChildPhase.RESERVED
    assert run.pool.totals.reserved == {"tokens": 40}
    run.reconcile_envelope(uid)  # the envelope records its admission
    assert run.of("r").phase is EnvelopePhase.OPEN
    run.reconcile_pool()
    assert run.pool.children == {} and run.pool.totals.reserved == {"tokens": 40}


def test_a_settlement_in_flight_wins_over_the_childs_older_copy() -> None:
    world, run = open_roots(2)
    world.close("r0")
    run.reconcile_envelope(world.uid("r0"))  # closed: its balance released
    run.reconcile_pool()  # the pool settles its line: in flight
    line = run.pool.children[world.uid("r0")]
    assert line.phase is ChildPhase.SETTLED and line.released == {"tokens": 10}
    for _ in range(2):  # the pool alone again: the settlement is never repeated
        run.reconcile_pool()
        assert run.pool.totals.available == {"tokens": 990}
    run.settle()
    assert run.pool.children == {}
    record = run.of("r0").parent
    assert record is not None and record.settled == line


def test_an_envelope_gone_with_its_line_is_held_until_a_person_settles_it() -> None:
    world, run = open_roots(3)
    run.remove_finalizer_by_hand("r1")
    run.settle()
    (lost,) = run.pool.children
    assert lost.startswith(LOST_CHILDREN_PREFIX)
    assert run.pool.totals.reserved == {"tokens": 30}, "never returned on a guess"
    assert run.pool.child_records is not None and run.pool.child_records.count == 2
    assert world.pool is not None
    world.pool = replace(world.pool, force_settle_gone={lost: "OPS-1: it ran to the end"})
    run.settle()
    assert run.pool.children == {}
    assert run.pool.totals.committed == {"tokens": 10}, "charged in full"
    assert run.pool.totals.reserved == {"tokens": 20}


def test_more_children_close_at_once_than_the_record_in_flight_holds() -> None:
    """A parent whose children all close together settles them in batches: each once."""
    world = World()
    run = Run(world)
    count = MAX_ENVELOPE_CHILDREN + 6
    world.create_envelope("planner", {"tokens": 10 * count})
    for n in range(count):
        world.create_envelope(f"c{n:03}", {"tokens": 10}, parent="planner")
    check, run.books.check = run.books.check, lambda: None  # type: ignore[method-assign]
    run.settle()  # (the auditor is quadratic: it watches the closing only)
    run.books.check = check  # type: ignore[method-assign]
    assert run.totals("planner").reserved == {"tokens": 10 * count}
    assert len(run.of("planner").children) == 0
    for n in range(count):
        world.close(f"c{n:03}")
    for n in range(count):
        run.reconcile_envelope(world.uid(f"c{n:03}"))
    run.reconcile_envelope(world.uid("planner"))
    planner = run.of("planner")
    assert len(planner.children) == MAX_ENVELOPE_CHILDREN, "the rest wait for room"
    run.settle()
    assert run.of("planner").children == {}
    assert run.totals("planner").reserved == {"tokens": 0}
    assert run.totals("planner").available == {"tokens": 10 * count}


def test_lines_written_before_children_held_them_are_retired_as_they_stand() -> None:
    """Upgrading: a parent written by an operator before issue 23 lists every child line
    (unstamped) and no digest; its children's records carry no stamp. The first pass
    retires each line its child already recorded, and no capacity moves."""
    world, run = open_roots(3)
    world.close("r2")
    run.settle()
    before = run.pool.totals
    legacy: dict[str, ChildEntry] = {}
    for uid, line in run.lines(POOL).items():
        legacy[uid] = line.model_copy(update={"stamp": 0})
        record = run.statuses[uid].parent
        assert record is not None
        settled = record.settled.model_copy(update={"stamp": 0}) if record.settled else None
        unstamped = record.model_copy(update={"stamp": 0, "settled": settled})
        run.statuses[uid] = run.statuses[uid].model_copy(update={"parent": unstamped})
    assert len(legacy) == 3  # two open, one settled and mirrored
    run.pool = run.pool.model_copy(update={"children": legacy, "child_records": None})
    run.reconcile_pool()
    assert run.pool.children == {}
    assert run.pool.child_records is not None and run.pool.child_records.count == 2
    assert run.pool.totals == before
    world.close("r0")
    run.settle()
    assert run.pool.totals.available == {"tokens": 990}
    record = run.of("r0").parent
    assert record is not None and record.settled is not None


def test_a_child_showing_a_move_newer_than_its_parent_sends_the_pass_to_read_again() -> None:
    record = ParentRecord(
        kind=ParentKind.POOL, name="p", uid="p-uid", admitted_at=T0, reserved={}, stamp=5
    )
    child = ChildFacts(
        uid="c", name="c", created_at=T0, capacity={"tokens": Decimal(1)}, record=record
    )
    with pytest.raises(EnvelopeBehindError):
        merge_children({}, 4, [child], "p-uid")
    view = merge_children({}, 5, [child], "p-uid")
    assert set(view.held) == {"c"} and not view.in_flight
