"""One watch of a namespace's BranchClaims, shared by every `wait` of an SDK.

A waiter registers (claim name, predicate) and gets the first view of the claim that
satisfies the predicate, or `ClaimNotFoundError` once the claim is gone. The watch does
not replace the read: a round of a waiter reads the claim (GET, linearizable) after its
registration is active, so a change made between the read and the watch delivering events
is never missed; the watch's events then carry every later state, in order.

Ordering without comparing resourceVersions (they are opaque: equality only). The stream
delivers each claim's states in order, and the watch remembers the resourceVersion of the
last event it delivered for each claim (seeded by the list the watch starts from). A round
records that version before its read; then, if the read's version
  - is among the events the waiter received since the round began, the events after it
    are newer than the read;
  - is the version the watch had already delivered when the round began, every event the
    waiter received since is newer;
  - else the stream has yet to deliver it: events until it are older than the read and
    are ignored (a stale event never satisfies a wait).
A watch that starts over (the first list, a 410 Gone re-list) or breaks or recovers makes
every waiter start a new round. While the watch is broken, rounds repeat every
`FALLBACK_INTERVAL` seconds: a plain poll, never a hang.

The watch resumes from the last resourceVersion it saw (events and bookmarks: the server
sends bookmarks, `allowWatchBookmarks`, so the version stays fresh on a quiet namespace),
and re-lists on 410 Gone. lightkube's public `watch()` asks for no bookmarks and, told to
retry, silently restarts a 410'd watch from "now"; so the stream is requested here through
lightkube's request builder and read line by line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, cast

from lightkube import AsyncClient

from reservoir.k8s.resources import BranchClaim, field_value
from reservoir.sdk.errors import ClaimNotFoundError
from reservoir.sdk.views import ClaimView

log = logging.getLogger(__name__)

# While the watch is broken, each waiter reads its claim this often.
FALLBACK_INTERVAL = 1.0
# The server ends a watch after this long; it is resumed from the last version seen.
SERVER_TIMEOUT_SECONDS = 240
# No line (event or bookmark) for this long: the connection is taken as dead.
READ_TIMEOUT_SECONDS = SERVER_TIMEOUT_SECONDS + 30
# Between attempts to restore a broken watch.
RETRY_BACKOFF = (0.2, 0.5, 1.0, 2.0, 5.0)

Predicate = Callable[[ClaimView], bool]
Read = Callable[[str], Awaitable[ClaimView]]

ADDED, MODIFIED, DELETED, BOOKMARK, ERROR = "ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"


class WaitTimeoutError(TimeoutError):
    """No view satisfied the predicate in time; `last` is the last view the waiter saw."""

    def __init__(self, last: ClaimView) -> None:
        super().__init__(f"branchclaim/{last.name}: wait timed out")
        self.last = last


class Waiter:
    """One wait's bookkeeping: which of the events it receives are newer than its read.
    Pure: the watch feeds it events (`offer`), the waiting coroutine its reads (`read`)."""

    def __init__(self, name: str, predicate: Predicate) -> None:
        self.name = name
        self.predicate = predicate
        self.result: ClaimView | None = None  # the first view that satisfied the predicate
        self.gone = False  # the claim read was deleted
        self.last: ClaimView | None = None  # the last view seen (read or event)
        self.wake = asyncio.Event()  # set when done, and when the watch starts over
        self._reading = False  # a round's read is under way: events are buffered
        self._buffer: list[tuple[str, ClaimView]] = []
        self._known_before: str | None = None  # the watch's last version when the round began
        self._anchor: str | None = None  # the read's version, not yet seen on the stream
        self._synced = False  # events now received are newer than the read

    @property
    def done(self) -> bool:
        return self.result is not None or self.gone

    @property
    def following(self) -> bool:
        """The claim was read and did not satisfy the wait: events decide now."""
        return not self._reading and self.last is not None and not self.done

    def begin_round(self, known: str | None) -> None:
        """A new read is about to be made; `known`: the resourceVersion of the last event
        the watch delivered for this claim (None if none, or the watch is not running)."""
        self._reading = True
        self._buffer = []
        self._known_before = known
        self._anchor = None
        self._synced = False

    def read(self, view: ClaimView) -> None:
        """The round's read of the claim."""
        self._reading = False
        self.last = view
        if self.predicate(view):
            self._finish(view)
            return
        buffered, self._buffer = self._buffer, []
        versions = [event.resource_version for _, event in buffered]
        if view.resource_version in versions:
            newer = buffered[versions.index(view.resource_version) + 1 :]
        elif view.resource_version == self._known_before:
            newer = buffered
        else:
            self._anchor = view.resource_version
            return
        self._synced = True
        for kind, event in newer:
            self._apply(kind, event)
            if self.done:
                return

    def offer(self, kind: str, view: ClaimView) -> None:
        """An event of the watch for this claim (ADDED, MODIFIED or DELETED)."""
        if self.done:
            return
        if self._reading:
            self._buffer.append((kind, view))
        elif self._synced:
            self._apply(kind, view)
        elif self._anchor is not None and view.resource_version == self._anchor:
            self._synced = True  # the state read: what follows is newer

    def _apply(self, kind: str, view: ClaimView) -> None:
        self.last = view
        if kind == DELETED:
            self.gone = True
            self.wake.set()
        elif self.predicate(view):
            self._finish(view)

    def _finish(self, view: ClaimView) -> None:
        self.result = view
        self.wake.set()


class ClaimWatch:
    """The watch of the BranchClaims of `namespace` (only the one named `name`, if given),
    run as one task from `start()` to `stop()`."""

    def __init__(self, client: AsyncClient, namespace: str, name: str | None = None) -> None:
        self.client = client
        self.namespace = namespace
        self.name = name
        self.healthy = False  # listed, and the stream not broken since
        self.epoch = 0  # bumped whenever waiters must read again
        self.connections = 0  # watch requests opened so far
        self.open_streams = 0  # watch responses being read now
        self.relists = 0
        self._ready = asyncio.Event()  # the first list was tried (listed, or broken)
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._resume: str | None = None  # the version to resume from; None: list first
        self._known: dict[str, str] = {}  # claim name -> version of its last event
        self._waiters: dict[str, set[Waiter]] = {}

    # --- lifecycle ----------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def waiters(self) -> int:
        return sum(len(waiters) for waiters in self._waiters.values())

    @property
    def following(self) -> int:
        """Waiters that read their claim and wait for its events."""
        return sum(w.following for waiters in self._waiters.values() for w in waiters)

    def start(self) -> None:
        if self._task is None:
            self._stopping = False
            label = f"reservoir-watch:{self.namespace}" + (f"/{self.name}" if self.name else "")
            self._task = asyncio.get_running_loop().create_task(self._run(), name=label)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        self._stopping = True
        while not task.done():  # cancelled until it ends: never left behind, never lost
            task.cancel()
            await asyncio.wait({task}, timeout=1)
        with contextlib.suppress(asyncio.CancelledError):
            task.result()
        self._set_healthy(False)

    # --- waiting ------------------------------------------------------------------------

    async def wait_for(
        self, name: str, predicate: Predicate, within: float, read: Read
    ) -> ClaimView:
        """The first view of claim `name` that satisfies `predicate`, as read (`read`: a
        GET, raising ClaimNotFoundError) or as the watch delivers it. ClaimNotFoundError
        when the claim is gone; WaitTimeoutError after `within` seconds (the claim is read at
        least once)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        self.start()
        waiter = Waiter(name, predicate)
        self._waiters.setdefault(name, set()).add(waiter)
        try:
            await _wait_event(self._ready, deadline - loop.time())
            while True:  # rounds: read, then follow the events
                epoch = self.epoch
                waiter.begin_round(self._known.get(name) if self.healthy else None)
                waiter.read(await read(name))
                while not waiter.done:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        assert waiter.last is not None
                        raise WaitTimeoutError(waiter.last)
                    if epoch != self.epoch:
                        break  # started over, broke or recovered: read again
                    polling = not self.healthy
                    waiter.wake.clear()
                    woke = await _wait_event(
                        waiter.wake, min(remaining, FALLBACK_INTERVAL) if polling else remaining
                    )
                    if polling and not woke:
                        break
                if waiter.result is not None:
                    return waiter.result
                if waiter.gone:
                    raise ClaimNotFoundError(f"branchclaim/{name} not found (deleted)")
        finally:
            waiters = self._waiters.get(name)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._waiters[name]

    # --- the watch ----------------------------------------------------------------------

    async def _run(self) -> None:
        failures = 0
        while not self._stopping:
            try:
                if self._resume is None:
                    await self._list()
                await self._follow()
                failures = 0
            except asyncio.CancelledError:
                raise
            except _GoneError:
                log.debug("watch of %s: resourceVersion gone, listing again", self.namespace)
                self._resume = None
            except Exception as error:  # any API or connection error: poll until restored
                log.debug("watch of %s broke: %r", self.namespace, error)
                self._set_healthy(False)
                self._ready.set()
                await asyncio.sleep(RETRY_BACKOFF[min(failures, len(RETRY_BACKOFF) - 1)])
                failures += 1

    async def _list(self) -> None:
        """Where the watch starts (or starts over): every claim's current version."""
        if self.name:
            listed = self.client.list(
                BranchClaim,
                namespace=self.namespace,
                fields={"metadata.name": field_value(self.name)},
            )
        else:
            listed = self.client.list(BranchClaim, namespace=self.namespace)
        known: dict[str, str] = {}
        async for obj in listed:
            meta = obj.metadata
            if meta is not None and meta.name and meta.resourceVersion:
                known[meta.name] = meta.resourceVersion
        self._known = known
        self._resume = listed.resourceVersion
        self.relists += 1
        self._set_healthy(True, force=True)
        self._ready.set()

    async def _follow(self) -> None:
        """Read one watch response from `_resume` to its end (the server's timeout)."""
        generic = self.client._client  # lightkube's request builder: see the module doc
        params: dict[str, Any] = {
            "allowWatchBookmarks": "true",
            "resourceVersion": self._resume,
            "timeoutSeconds": SERVER_TIMEOUT_SECONDS,
        }
        if self.name:
            params["fieldSelector"] = f"metadata.name={self.name}"
        request = generic.prepare_request(
            "list", res=BranchClaim, namespace=self.namespace, watch=True, params=params
        )
        built = generic._client.build_request(
            request.method, request.url, params=request.params, timeout=generic._watch_timeout
        )
        response = await generic.send(built, stream=True)  # type: ignore[no-untyped-call]
        self.connections += 1
        self.open_streams += 1
        try:
            if response.status_code == 410:
                raise _GoneError()
            if response.status_code >= 400:
                await response.aread()
                raise RuntimeError(f"watch refused: HTTP {response.status_code}: {response.text}")
            self._set_healthy(True)
            lines = cast(AsyncGenerator[str, None], response.aiter_lines())
            try:
                while not self._stopping:
                    # Not asyncio.wait_for: on 3.11 it may swallow a cancellation that
                    # arrives as a line does, and stop() would wait on a live stream.
                    async with asyncio.timeout(READ_TIMEOUT_SECONDS):
                        try:
                            line = await anext(lines)
                        except StopAsyncIteration:
                            return
                    if line.strip():
                        self.handle(json.loads(line))
            finally:
                await lines.aclose()
        finally:
            self.open_streams -= 1
            await response.aclose()

    def handle(self, event: dict[str, Any]) -> None:
        """One event of the stream: remember its version, hand it to the claim's waiters."""
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == ERROR:
            if obj.get("code") == 410:
                raise _GoneError()
            raise RuntimeError(f"watch error: {obj.get('message') or obj}")
        meta = obj.get("metadata") or {}
        version = meta.get("resourceVersion")
        if version:
            self._resume = version
        if kind == BOOKMARK or kind not in (ADDED, MODIFIED, DELETED):
            return
        name = meta.get("name")
        if not name or not version:
            return
        if kind == DELETED:
            self._known.pop(name, None)
        else:
            self._known[name] = version
        waiters = self._waiters.get(name)
        if not waiters:
            return
        try:
            view = ClaimView.from_api(obj)
        except Exception as error:  # an unreadable claim: its reads will say so
            log.debug("watch of %s: branchclaim/%s unreadable: %r", self.namespace, name, error)
            return
        for waiter in list(waiters):
            waiter.offer(kind, view)

    def _set_healthy(self, healthy: bool, force: bool = False) -> None:
        """Waiters read again when the watch starts over (force), breaks or recovers."""
        if healthy == self.healthy and not force:
            return
        self.healthy = healthy
        self.epoch += 1
        for waiters in self._waiters.values():
            for waiter in waiters:
                waiter.wake.set()


class _GoneError(Exception):
    """410 Gone: the version to resume from is too old; list again."""


async def _wait_event(event: asyncio.Event, seconds: float) -> bool:
    """Whether `event` was set within `seconds`."""
    if event.is_set():
        return True
    if seconds <= 0:
        return False
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        return False
    return True
