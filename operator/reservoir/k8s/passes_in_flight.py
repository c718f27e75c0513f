"""Envelope passes running at once: a bound for the whole writer, and a share of it for
each namespace.

A pass reads its envelope, works out its claims' lines, writes, and may wait on a tenant's
provider (each call bounded by its own deadline). Unbounded, the 1,000 envelopes of a
restarted operator at 100,000 claims all began their first pass at once: their requests
queued for the HTTP client's 20 connections, and 685 of the passes failed after waiting
10 s for one (an ERROR with a traceback each, retried 2 s later). Bounded, the others
wait their turn without failing. The share per namespace keeps one tenant's envelopes
(many, or slow on their provider) from holding every slot while another tenant's one
admission waits behind them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


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
        try:
            async with own, self._shared:
                yield
        finally:
            own, users = self._namespaces[namespace]
            if users == 1:
                del self._namespaces[namespace]
            else:
                self._namespaces[namespace] = (own, users - 1)

    def namespaces(self) -> int:
        """Namespaces with a pass running or waiting (for the tests: none kept after)."""
        return len(self._namespaces)
