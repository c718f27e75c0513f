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

from reservoir.handlers.envelopes import IDLE_WAKEUP_SECONDS, keep_the_ledger, seconds_to_wake
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

    health = SimpleNamespace(succeeded=lambda: None, failed=lambda message: None)
    services: Any = SimpleNamespace(writer=Writer(), health=health)
    asyncio.run(
        keep_the_ledger(
            namespace="ns",
            name="wf",
            stopped=stopped,  # type: ignore[arg-type]
            memo=SimpleNamespace(services=services),  # type: ignore[arg-type]
            logger=logging.getLogger("test"),
        )
    )
    assert len(waited) == 2 and all(6.0 < seconds <= 7.1 for seconds in waited)


def test_it_looks_again_at_the_pass_s_wake_up_or_when_idle() -> None:
    assert seconds_to_wake(None) == IDLE_WAKEUP_SECONDS
    assert seconds_to_wake(Pass(wake_in=None)) == IDLE_WAKEUP_SECONDS  # type: ignore[arg-type]
    assert 2.0 < seconds_to_wake(Pass(wake_in=2.0)) <= 2.1  # type: ignore[arg-type]
