"""Wake-ups for the writers' passes: one trigger per envelope (or pool), kept only while
it can matter.

Anything that sees news about an envelope pokes its trigger (a claim, its Lease, a pod,
the envelope itself); the envelope's daemon (or its deletion handler) holds the trigger
and waits on it. Pokes name envelopes by what a tenant wrote (a claim's
`spec.envelope`), so a trigger is made for any name: one for an envelope that does not
exist, or no longer does, is dropped once no one holds it and it has no poke waiting, or
its poke has waited PENDING_POKE_SECONDS (a daemon that starts makes its first pass at
once: a poke older than that reaches no one). Found by review: every name ever poked
kept its trigger for the operator's life.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

# A poke no holder has taken in this long is for an object no daemon keeps.
PENDING_POKE_SECONDS = 600.0
# Triggers are swept when their number reaches this, or twice what the last sweep left.
SWEEP_AT_LEAST = 1024


class Trigger:
    """Wakes an object's writer: many pokes before it runs coalesce into one pass."""

    __slots__ = ("clock", "event", "poked_at")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.event = asyncio.Event()
        self.poked_at: float | None = None  # when the poke waiting now came (clock)

    def poke(self) -> None:
        if not self.event.is_set():
            self.poked_at = self.clock()
        self.event.set()

    async def wait(self, seconds: float) -> bool:
        """Wait for a poke, at most `seconds`: whether one came (or was waiting)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.event.wait(), seconds)
        poked = self.event.is_set()
        self.event.clear()
        self.poked_at = None
        return poked

    def idle(self, now: float) -> bool:
        """No poke waits on it, or its poke has waited too long to reach anyone."""
        return self.poked_at is None or now - self.poked_at > PENDING_POKE_SECONDS


class Triggers(Generic[K]):
    """The triggers of one writer, by object key."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._triggers: dict[K, Trigger] = {}
        self._holders: dict[K, int] = {}
        self._sweep_at = SWEEP_AT_LEAST

    def __len__(self) -> int:
        return len(self._triggers)

    def get(self, key: K) -> Trigger:
        trigger = self._triggers.get(key)
        if trigger is None:
            if len(self._triggers) >= self._sweep_at:
                self.sweep()
            trigger = self._triggers[key] = Trigger(self._clock)
        return trigger

    def poke(self, key: K) -> None:
        self.get(key).poke()

    @contextlib.contextmanager
    def holding(self, key: K) -> Iterator[Trigger]:
        """While a daemon (or a deletion handler) waits on the trigger: it is kept, and
        `held` says a poke reaches a pass."""
        self._holders[key] = self._holders.get(key, 0) + 1
        try:
            yield self.get(key)
        finally:
            self._holders[key] -= 1
            if not self._holders[key]:
                del self._holders[key]

    def held(self, key: K) -> bool:
        return key in self._holders

    def forget(self, key: K) -> None:
        """The object is gone: its trigger goes too, unless someone still waits on it."""
        if key not in self._holders:
            self._triggers.pop(key, None)

    def sweep(self) -> None:
        """Drop the triggers no one holds and no poke needs."""
        now = self._clock()
        for key in [k for k, t in self._triggers.items() if k not in self._holders and t.idle(now)]:
            del self._triggers[key]
        self._sweep_at = max(SWEEP_AT_LEAST, 2 * len(self._triggers))
