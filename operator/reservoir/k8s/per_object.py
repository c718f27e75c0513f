"""Work done per object off the watch stream, one at a time per object, on its latest state.

The informers (reservoir.k8s.informer) take every event in on the watch's own task, so
nothing they call may wait on the API server. What must (adopting a claim made without
the SDK) is handed here: per object, one run at a time, always on the latest state
submitted (a newer state replaces one still waiting, as kopf's per-object worker took
the latest event). Runs wait for `ready` (the operator's start-up: every first list
complete, as kopf's handlers did), and at most `limit` run at once per group (a
namespace): one tenant's thousand claims made by hand never delay another's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger(__name__)

Work = Callable[..., Awaitable[None]]


class LatestPerObject:
    def __init__(
        self, work: Work, limit: int = 4, ready: Callable[[], Awaitable[Any]] | None = None
    ) -> None:
        self._work = work
        self._limit = limit
        self._ready = ready
        self._latest: dict[str, tuple[Any, ...]] = {}  # object UID -> its latest arguments
        self._running: dict[str, asyncio.Task[None]] = {}
        self._slots: dict[str, asyncio.Semaphore] = {}  # by group, while it has runs
        self._runs: dict[str, int] = {}  # by group: objects with a run under way or waiting

    def submit(self, uid: str, group: str, *args: Any) -> None:
        """Run the work on `args` for object `uid` (of `group`), after any run of it under
        way."""
        self._latest[uid] = args
        if uid not in self._running:
            self._runs[group] = self._runs.get(group, 0) + 1
            self._running[uid] = asyncio.get_running_loop().create_task(self._run(uid, group))

    async def drained(self) -> None:
        """Once every run submitted so far (and any submitted meanwhile) has ended."""
        while self._running:
            await asyncio.gather(*list(self._running.values()), return_exceptions=True)

    async def _run(self, uid: str, group: str) -> None:
        try:
            if self._ready is not None:
                await self._ready()
            slots = self._slots.setdefault(group, asyncio.Semaphore(self._limit))
            while uid in self._latest:
                args = self._latest.pop(uid)
                try:
                    async with slots:
                        await self._work(*args)
                except asyncio.CancelledError:
                    raise
                except Exception:  # its next event submits it again
                    logger.exception("work on object %s failed", uid)
        finally:
            self._latest.pop(uid, None)  # cancelled (at shutdown): nothing runs it now
            self._running.pop(uid, None)
            self._runs[group] -= 1
            if not self._runs[group]:
                del self._runs[group]
                self._slots.pop(group, None)
