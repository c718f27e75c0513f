"""Envelope passes running at once: a bound for the whole writer, and a share of it for
each namespace.

A pass reads its envelope, works out its claims' lines and writes. Unbounded, the 1,000
envelopes of a restarted operator at 100,000 claims all began their first pass at once:
their requests queued for the HTTP client's 20 connections, and 685 of the passes failed
after waiting 10 s for one (an ERROR with a traceback each, retried 2 s later). Bounded,
the others wait their turn without failing. The share per namespace keeps one tenant's
envelopes from holding every slot while another tenant's one admission waits behind them.

A pass that waits on its tenants' providers (each call bounded by its own deadline, and
a few at once per namespace) gives its slot back meanwhile (`aside`): holding it, two
tenants with slow providers held every slot, and every other tenant's passes waited
behind them (found by review). It asks all its providers at once, then takes its slot
again before it reads or writes anything more."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator

from reservoir.k8s.request_slots import acquire_both


class Slot:
    """One pass's place: its namespace's share and the writer's."""

    def __init__(self, own: asyncio.Semaphore, shared: asyncio.Semaphore) -> None:
        self._own = own
        self._shared = shared
        self.held = False

    async def take(self) -> None:
        await acquire_both(self._own, self._shared)
        self.held = True

    def give_back(self) -> None:
        if self.held:
            self.held = False
            self._shared.release()
            self._own.release()


_current: contextvars.ContextVar[Slot | None] = contextvars.ContextVar("pass_slot", default=None)


class PassesInFlight:
    def __init__(self, total: int, per_namespace: int) -> None:
        self._shared = asyncio.Semaphore(total)
        self._per_namespace = per_namespace
        # Each namespace's own bound, kept only while a pass of it runs or waits.
        self._namespaces: dict[str, tuple[asyncio.Semaphore, int]] = {}

    @contextlib.asynccontextmanager
    async def slot(self, namespace: str) -> AsyncIterator[None]:
        """Held for the length of one pass of an envelope of `namespace`."""
        own, users = self._namespaces.get(namespace) or (asyncio.Semaphore(self._per_namespace), 0)
        self._namespaces[namespace] = (own, users + 1)
        place = Slot(own, self._shared)
        token = _current.set(place)
        try:
            await place.take()
            yield
        finally:
            place.give_back()
            _current.reset(token)
            own, users = self._namespaces[namespace]
            if users == 1:
                del self._namespaces[namespace]
            else:
                self._namespaces[namespace] = (own, users - 1)

    @staticmethod
    @contextlib.asynccontextmanager
    async def aside() -> AsyncIterator[None]:
        """The current pass's slot given back while it waits on something other than the
        API server (its tenants' providers), and taken again before it goes on. Entered by
        the pass itself, never by several of its steps at once (whatever they do meanwhile
        would run without the slot). Outside a pass, or already aside, nothing."""
        place = _current.get()
        if place is None or not place.held:
            yield
            return
        place.give_back()
        try:
            yield
        finally:
            await place.take()

    def namespaces(self) -> int:
        """Namespaces with a pass running or waiting (for the tests: none kept after)."""
        return len(self._namespaces)
