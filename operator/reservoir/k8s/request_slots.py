"""API requests in flight: a bound for the whole writer, shared fairly between passes.

The writer keeps at most `total` claim reads and writes in flight (within the HTTP
client's pool of kept-alive connections), and one pass queues at most `per_pass` of them
for those slots at a time. Without the second bound, the semaphore's queue is first come,
first served: a pass writing 2,000 claims (a namespace deleted with all of them) queued
2,000 requests at once, and another tenant's one admission write waited behind all of
them."""

from __future__ import annotations

import asyncio
from types import TracebackType


class RequestSlots:
    def __init__(self, total: int, per_pass: int) -> None:
        self._shared = asyncio.Semaphore(total)
        self._per_pass = per_pass

    def for_pass(self) -> PassSlots:
        """The slots of one pass's requests: `async with` it around each request."""
        return PassSlots(asyncio.Semaphore(self._per_pass), self._shared)


async def acquire_both(own: asyncio.Semaphore, shared: asyncio.Semaphore) -> None:
    """A place in a share (`own`) and in the bound it is a share of: both, or neither."""
    await own.acquire()
    try:
        await shared.acquire()
    except BaseException:
        own.release()
        raise


class PassSlots:
    def __init__(self, own: asyncio.Semaphore, shared: asyncio.Semaphore) -> None:
        self._own = own
        self._shared = shared

    async def __aenter__(self) -> None:
        await acquire_both(self._own, self._shared)

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._shared.release()
        self._own.release()
