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
`bench/results/issue-23-full/dec03-gc-young/`). So 10,000."""

from __future__ import annotations

import gc

YOUNG = 10_000  # container allocations (less deallocations) between young collections
OLDER = 20  # collections of a generation between collections of the next


def tune() -> None:
    """Freeze what start-up made and space out the collections (see the module)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG, OLDER, OLDER)
