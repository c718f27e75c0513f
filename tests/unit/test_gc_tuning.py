"""The operator's garbage-collector settings (reservoir.gc_tuning): what start-up made is
frozen out of the collector's sight, the young generation is collected far less often
than CPython's default, what lives on is frozen as it goes and thawed now and then, and
every collection's pause is measured. The benchmark (bench/run.py --only scale) shows what
it saves."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest

from reservoir import gc_tuning, metrics


@pytest.fixture
def collector() -> Iterator[None]:
    """The test process's own collector, as it was, afterwards."""
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)
    if gc_tuning._time_collections in gc.callbacks:
        gc.callbacks.remove(gc_tuning._time_collections)


def test_tune_freezes_what_exists_and_spaces_out_collections(collector: None) -> None:
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    start_up = [{"made": "at start-up"} for _ in range(100)]

    gc_tuning.tune()

    assert gc.get_threshold() == (gc_tuning.YOUNG, gc_tuning.OLDER, gc_tuning.OLDER)
    assert gc.get_freeze_count() >= len(start_up)


def full_pauses() -> float:
    return (
        metrics.REGISTRY.get_sample_value("reservoir_gc_pause_seconds_count", {"generation": "2"})
        or 0.0
    )


def test_every_collection_s_pause_is_measured(collector: None) -> None:
    gc_tuning.tune()
    before = full_pauses()
    gc.collect()
    gc.collect()
    assert full_pauses() == before + 2


def test_pauses_are_counted_in_cumulative_buckets_that_agree_with_the_count(
    collector: None,
) -> None:
    gc_tuning.tune()
    gc.collect()
    sample = metrics.REGISTRY.get_sample_value
    count = sample("reservoir_gc_pause_seconds_count", {"generation": "2"})
    buckets = [
        sample("reservoir_gc_pause_seconds_bucket", {"generation": "2", "le": str(b)})
        for b in (*gc_tuning.PAUSE_BUCKETS, "+Inf")
    ]
    assert buckets == sorted(buckets) and buckets[-1] == count  # type: ignore[type-var]


def test_no_freeze_while_another_thread_s_collection_is_under_way(
    collector: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    gc.unfreeze()
    monkeypatch.setattr(gc_tuning, "_started", [0.0])  # a collection started elsewhere
    gc_tuning.freeze_survivors()
    assert gc.get_freeze_count() == 0
    monkeypatch.setattr(gc_tuning, "_started", [])
    gc_tuning.freeze_survivors()
    assert gc.get_freeze_count() > 0


def test_the_freeze_runs_on_the_event_loop_every_interval(
    collector: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    ticks: list[bool] = []
    monkeypatch.setattr(gc_tuning, "FREEZE_EVERY_SECONDS", 0.01)
    monkeypatch.setattr(gc_tuning, "THAW_EVERY_SECONDS", 0.025)
    monkeypatch.setattr(gc_tuning, "freeze_survivors", lambda thaw=False: ticks.append(thaw))

    async def run() -> None:
        task = asyncio.create_task(gc_tuning.keep_frozen())
        await asyncio.sleep(0.2)
        task.cancel()

    asyncio.run(run())
    assert len(ticks) >= 5
    assert any(ticks) and not all(ticks)  # thawed now and then, not on every tick


def test_a_failed_tick_does_not_end_the_freezing(
    collector: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    ticks: list[bool] = []

    def tick(thaw: bool = False) -> None:
        ticks.append(thaw)
        if len(ticks) == 1:
            raise MemoryError("the first tick fails")

    monkeypatch.setattr(gc_tuning, "FREEZE_EVERY_SECONDS", 0.01)
    monkeypatch.setattr(gc_tuning, "freeze_survivors", tick)

    async def run() -> None:
        task = asyncio.create_task(gc_tuning.keep_frozen())
        await asyncio.sleep(0.1)
        assert not task.done()
        task.cancel()

    asyncio.run(run())
    assert len(ticks) >= 3


class Node:
    """An object in a reference cycle (only the collector frees it)."""

    def __init__(self) -> None:
        self.me = self


def test_survivors_are_frozen_and_their_cycles_wait_for_the_thaw(collector: None) -> None:
    gc.unfreeze()
    lived_on = Node()
    gone = weakref.ref(lived_on)
    gc_tuning.freeze_survivors()
    assert gc.get_freeze_count() > 0

    young = Node()  # made after the freeze: collected as ever
    young_gone = weakref.ref(young)
    del lived_on, young
    gc.collect()
    assert young_gone() is None
    assert gone() is not None  # frozen alive: a full collection does not walk it

    gc_tuning.freeze_survivors(thaw=True)
    assert gone() is None
