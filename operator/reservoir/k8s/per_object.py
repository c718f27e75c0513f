"""Work done per object off the watch stream, one at a time per object, on its latest state.

The informers (reservoir.k8s.informer) take every event in on the watch's own task, so
nothing they call may wait on the API server. What must (adopting a claim made without
the SDK) is handed here: per object, one run at a time, always on the latest state
submitted (a newer state replaces one still waiting, as kopf's per-object worker took
the latest event), and at most `limit` runs at once across all objects.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger(__name__)

Work = Callable[..., Awaitable[None]]


class LatestPerObject:
    def __init__(self, work: Work, limit: int = 16) -> None:
        self._work = work
        self._slots = asyncio.Semaphore(limit)
        self._latest: dict[str, tuple[Any, ...]] = {}  # object UID -> its latest arguments
        self._running: dict[str, asyncio.Task[None]] = {}

    def submit(self, uid: str, *args: Any) -> None:
        """Run the work on `args` for object `uid`, after any run of it under way."""
        self._latest[uid] = args
        if uid not in self._running:
            self._running[uid] = asyncio.get_running_loop().create_task(self._run(uid))

    async def drained(self) -> None:
        """Once every run submitted so far (and any submitted meanwhile) has ended."""
        while self._running:
            await asyncio.gather(*list(self._running.values()), return_exceptions=True)

    async def _run(self, uid: str) -> None:
        try:
            while uid in self._latest:
                args = self._latest.pop(uid)
                try:
                    async with self._slots:
                        await self._work(*args)
                except asyncio.CancelledError:
                    raise
                except Exception:  # its next event submits it again
                    logger.exception("work on object %s failed", uid)
        finally:
            self._running.pop(uid, None)
