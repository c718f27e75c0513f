"""Python's cyclic garbage collector, set for an operator that keeps many objects alive.

Why: measured on the scale benchmark (3,000 live claims filling 30 envelopes, gc.callbacks
timing each collection), the collector took 18 % of the operator's CPU, 7.2 s of it in 53
full collections of about 240,000 objects each. The operator holds every watched object
(kopf's indexes, the claim records) and turns over short-lived ones (each watch event's
decoded JSON) fast, and with CPython's default thresholds (700, 10, 10) that turnover sets
off a collection of the young generation every 700 container allocations and a full one
whenever a quarter more objects have lived long enough to be promoted.

Objects here are freed by reference counting as soon as they are dropped; the collector is
only for reference cycles, which the operator makes few of. So the young generation is
collected every `YOUNG` allocations instead of 700, and what exists once the operator has
started (modules, classes, kopf's registry: long-lived by construction) is moved out of the
collector's sight with `gc.freeze()`, so that no full collection walks it again.

`YOUNG` bounds how much cyclic garbage waits for the collector: each exception kept with
its traceback is a cycle holding its frames (and whatever they hold, a response body).
`bench/gc_cycles.py` (20,000 such exceptions, each frame holding 20 KB): 14 MiB peak at
700, 50 MiB at 10,000, 182 MiB at 50,000. The scale benchmark's operator CPU an admission
is about the same at 10,000 as at 50,000 (15.1-15.2 ms against 14.9, 3,000 live claims,
`bench/results/issue-23-full/dec03-gc-young/`). So 10,000.

What lives on (the records of live claims, their parsed facts) is frozen too, every
`FREEZE_EVERY_SECONDS`: a full collection walks every tracked object, and the operator's
grow with its claims. py-spy on the scale benchmark's operator at 67,000 live claims caught
one full collection stopping the event loop for 5.5 s (CPython runs one whenever a
quarter more objects have been promoted since the last, under churn as well as growth);
during it no watch event, renewal or probe is served. Frozen, a full collection walks
only what was made since the last freeze. Reference counting still frees frozen objects
the moment they are dropped; a reference cycle that passes through a frozen object (an
asyncio task alive at a freeze that later fails, its exception holding its frames: about
20 KiB each, found by review) waits for the thaw every `THAW_EVERY_SECONDS`, which hands
everything back to the collector (one full collection then, where CPython's own rule ran
one whenever a quarter of the claims turned over).

The freeze runs on the event loop (`keep_frozen`), between two of its callbacks: a
collection already under way in another thread would make `gc.collect()` return at once
and the freeze keep the garbage it left (found by review), and no other code of the loop's
runs between the collection and the freeze; a tick that finds a collection of another
thread's under way does not freeze. Each collection's pause is counted without taking a
lock (the collector can start inside any allocation, a metrics scrape holding its lock
included), and `reservoir_gc_pause_seconds` reports them by generation."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import Any

YOUNG = 10_000  # container allocations (less deallocations) between young collections
OLDER = 20  # collections of a generation between collections of the next
logger = logging.getLogger(__name__)

FREEZE_EVERY_SECONDS = 60.0
THAW_EVERY_SECONDS = 900.0

# Each collection's pause, counted by generation into the histogram's buckets (upper
# bounds, seconds; the last count is every collection's) inside the collector: no lock, no
# queue (`metrics.GcPauses` reads them at scrape time).
PAUSE_BUCKETS = (0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
pause_counts: dict[int, list[int]] = {g: [0] * (len(PAUSE_BUCKETS) + 1) for g in range(3)}
pause_seconds: dict[int, float] = dict.fromkeys(range(3), 0.0)
_started: list[float] = []  # when the collection under way started


def _time_collections(phase: str, info: dict[str, Any]) -> None:
    """gc.callbacks: count each collection's pause by generation (no lock, no raising: it
    runs inside the collector, which may have started in any allocation)."""
    if phase == "start":
        _started.append(time.perf_counter())
        return
    if not _started:
        return
    seconds = time.perf_counter() - _started.pop()
    generation = info.get("generation", 0)
    counts = pause_counts.get(generation)
    if counts is None:
        return
    for i, bound in enumerate(PAUSE_BUCKETS):
        if seconds <= bound:
            counts[i] += 1
    counts[-1] += 1
    pause_seconds[generation] += seconds


def freeze_survivors(thaw: bool = False) -> None:
    """Collect what is garbage now and freeze what survives (`thaw`: first give back to the
    collector everything frozen before, so that cycles through them are collected). Not
    while another thread's collection is under way (kopf runs synchronous handlers in
    threads): `gc.collect()` then returns at once, and the freeze would keep that
    collection's garbage (found by review); the next tick freezes instead."""
    if thaw:
        gc.unfreeze()
    gc.collect()
    if not _started:
        gc.freeze()


async def keep_frozen() -> None:
    """On the event loop, for as long as the operator runs: freeze survivors every
    `FREEZE_EVERY_SECONDS`, thawing first every `THAW_EVERY_SECONDS` (see the module). A
    tick that fails is logged and the next one runs: nothing awaits this task, so an error
    would otherwise end it unseen."""
    thawed = time.monotonic()
    while True:
        await asyncio.sleep(FREEZE_EVERY_SECONDS)
        thaw = time.monotonic() - thawed >= THAW_EVERY_SECONDS
        if thaw:
            thawed = time.monotonic()
        try:
            freeze_survivors(thaw)
        except Exception:
            logger.exception("freezing the garbage collector's survivors failed; next tick")


def tune() -> None:
    """Freeze what start-up made, space out the collections and time each (see the module;
    `keep_frozen` is started on the event loop)."""
    freeze_survivors()
    gc.set_threshold(YOUNG, OLDER, OLDER)
    if _time_collections not in gc.callbacks:
        gc.callbacks.append(_time_collections)
