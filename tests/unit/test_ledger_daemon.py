"""The envelope's daemon (handlers/envelopes.keep_the_ledger): between passes it keeps only
when to look again, never the pass itself (a pass holds a copy of every live line of its
envelope; every envelope's daemon keeping its last one cost about 3 KiB a live claim)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import weakref
from collections.abc import Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from reservoir import metrics
from reservoir.handlers.envelopes import (
    IDLE_WAKEUP_SECONDS,
    QUIET_PASS_SECONDS,
    PassSchedule,
    keep_the_ledger,
    seconds_to_wake,
)
from reservoir.k8s.clock import utcnow


class Pass:
    """Stands for a pass's result: weakly referenceable, with its next wake-up."""

    def __init__(self, wake_in: float | None) -> None:
        self.wake_at = None if wake_in is None else utcnow() + timedelta(seconds=wake_in)
        self.lines = {f"claim-{i}": object() for i in range(100)}


class Stopped:
    def __init__(self) -> None:
        self.stop = False

    def __bool__(self) -> bool:
        return self.stop


def run_daemon(writer: Any, stopped: Stopped) -> None:
    """The envelope's daemon for ns/wf with this writer, until `stopped`."""
    health = SimpleNamespace(succeeded=lambda: None, failed=lambda message: None)
    services: Any = SimpleNamespace(writer=writer, health=health)
    asyncio.run(
        keep_the_ledger(
            namespace="ns",
            name="wf",
            stopped=stopped,  # type: ignore[arg-type]
            memo=SimpleNamespace(services=services),  # type: ignore[arg-type]
            logger=logging.getLogger("test"),
        )
    )


def test_the_daemon_keeps_no_pass_while_it_waits() -> None:
    stopped = Stopped()
    made: list[weakref.ref[Pass]] = []
    waited: list[float] = []

    class Trigger:
        async def wait(self, seconds: float) -> None:
            gc.collect()
            assert made and made[-1]() is None, "the last pass is still held while waiting"
            waited.append(seconds)
            stopped.stop = len(waited) == 2

    class Writer:
        async def reconcile_once(self, namespace: str, name: str) -> Pass:
            result = Pass(wake_in=7.0)
            made.append(weakref.ref(result))
            return result

        @contextlib.contextmanager
        def keeping(self, namespace: str, name: str) -> Iterator[Trigger]:
            yield Trigger()

    run_daemon(Writer(), stopped)
    assert len(waited) == 2 and all(6.0 < seconds <= 7.1 for seconds in waited)


def test_it_looks_again_at_the_pass_s_wake_up_or_only_on_news() -> None:
    assert seconds_to_wake(None) is None
    assert seconds_to_wake(Pass(wake_in=None)) is None  # type: ignore[arg-type]
    assert 2.0 < seconds_to_wake(Pass(wake_in=2.0)) <= 2.1  # type: ignore[arg-type]


def test_a_pass_comes_on_news_at_its_wake_up_or_quietly_every_few_minutes() -> None:
    schedule = PassSchedule()
    assert schedule.due(0.0, poked=False), "the first pass comes at once"
    schedule.ran(0.0, None)  # nothing due by the clock: only news, or the safety net
    for now in range(1, int(QUIET_PASS_SECONDS * 0.9)):
        assert not schedule.due(float(now), poked=False)
        assert 0.05 <= schedule.wait(float(now)) <= IDLE_WAKEUP_SECONDS
    assert schedule.due(10.0, poked=True), "news makes a pass at once"
    assert schedule.due(QUIET_PASS_SECONDS, poked=False), "and without any, a safety net"
    schedule.ran(100.0, 7.0)  # a lease ends in 7 s
    assert not schedule.due(106.9, poked=False) and schedule.due(107.0, poked=False)
    assert 6.9 <= schedule.wait(100.1) <= 7.0
    schedule.ran(200.0, 4 * QUIET_PASS_SECONDS)  # far off: the safety net comes first
    assert schedule.due(200.0 + QUIET_PASS_SECONDS, poked=False)
    schedule.ran(300.0, -5.0)  # overdue already: soon, without spinning
    assert schedule.wait(300.0) <= 0.051


def test_between_passes_the_daemon_keeps_its_metrics_current_without_a_pass() -> None:
    stopped = Stopped()
    passes: list[float] = []
    current: list[tuple[str, str]] = []
    waits = iter([False, False, True, False])

    class Trigger:
        async def wait(self, seconds: float) -> bool:
            poked = next(waits)
            stopped.stop = poked is False and len(passes) == 2
            return poked

    class Writer:
        async def reconcile_once(self, namespace: str, name: str) -> Pass:
            passes.append(seconds_to_wake(None) or 0.0)
            return Pass(wake_in=None)

        @contextlib.contextmanager
        def keeping(self, namespace: str, name: str) -> Iterator[Trigger]:
            yield Trigger()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(metrics.envelopes, "still_current", lambda *key: current.append(key))
        run_daemon(Writer(), stopped)
    # The first pass, two quiet wake-ups (no pass, metrics kept), a poke (a pass), then
    # stopped.
    assert len(passes) == 2
    assert current == [("ns", "wf")] * 2


def test_a_snapshot_kept_current_is_seen_again_and_an_unknown_one_is_not_made_up() -> None:
    gauges = metrics.EnvelopeGauges(stale_after=60.0)
    gauges._seen[("ns", "wf")] = 0.0  # recorded long ago
    gauges.still_current("ns", "wf")
    gauges.still_current("ns", "never-seen")
    assert list(gauges._seen) == [("ns", "wf")] and gauges._seen[("ns", "wf")] > 0.0
