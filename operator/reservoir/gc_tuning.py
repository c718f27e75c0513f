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
collector's sight with `gc.freeze()`, so that no full collection walks it again."""

from __future__ import annotations

import gc

YOUNG = 50_000  # container allocations (less deallocations) between young collections
OLDER = 20  # collections of a generation between collections of the next


def tune() -> None:
    """Freeze what start-up made and space out the collections (see the module)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG, OLDER, OLDER)
