"""The operator's garbage-collector settings (reservoir.gc_tuning): what start-up made is
frozen out of the collector's sight, and the young generation is collected far less often
than CPython's default. The benchmark (bench/run.py --only scale) shows what it saves."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from reservoir import gc_tuning


@pytest.fixture
def collector() -> Iterator[None]:
    """The test process's own collector, as it was, afterwards."""
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_tune_freezes_what_exists_and_spaces_out_collections(collector: None) -> None:
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    start_up = [{"made": "at start-up"} for _ in range(100)]

    gc_tuning.tune()

    assert gc.get_threshold() == (gc_tuning.YOUNG, gc_tuning.OLDER, gc_tuning.OLDER)
    assert gc.get_freeze_count() >= len(start_up)
