"""Keeping a claim's lease alive from the worker's side, without ever outliving it.

lease-renewal.txt asks the owner to "renew early enough to recover", to "use monotonic
elapsed-time measurement", to back off with jitter, and to stop: "retrying must stop before
the system can no longer determine ownership safely", and "it should not launch new
provider work after lease validity becomes uncertain". `LeaseKeeper` does that around a
`renew` coroutine (one heartbeat, then the operator's grant), and nothing else: it knows no
Kubernetes (the SDK's `keep_alive` gives it `AsyncReservoir.renew`).

How long the lease is known to be valid is measured on this process's monotonic clock,
never by comparing the wall clock with the operator's timestamps: a grant of G seconds
(`expiresAt − renewedAt`, both on the operator's clock, so their difference is exact) was
made no earlier than the heartbeat it answers was sent, so the lease holds at least until
`sent + G`. When a renewal goes unconfirmed its heartbeat may still be granted later, so
the next grant is counted from the earliest heartbeat not yet confirmed. Validity ends
`margin` seconds before that bound: from then on `valid` is False, `require()` raises, the
keeper stops renewing and calls `on_lost` once. A process paused past its lease (a stopped
container, a long GC pause) finds `valid` False the moment it runs again: the property is
computed when read, not kept by the renewal loop.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from reservoir.sdk.errors import LeaseUncertainError, StaleClaimError

log = logging.getLogger(__name__)

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]

RENEW_FRACTION = 1 / 3  # renew once a third of the lease has gone: two more tries fit
FIRST_BACKOFF_SECONDS = 0.5
MAX_BACKOFF_FRACTION = 1 / 6  # of the lease: several tries fit in what is left of it


@dataclass(frozen=True)
class Grant:
    """What a confirmed renewal says: how long the operator granted, in seconds."""

    seconds: float


Renew = Callable[[], Awaitable[Grant]]


class LeaseKeeper:
    """Renews through `renew` until stopped or the lease can no longer be vouched for.

    `renew` sends one heartbeat and waits for its grant: it returns the `Grant`, raises
    `LeaseUncertainError` (or any other error: a timeout, the API server unreachable) when
    the grant cannot be confirmed, which is retried, or `StaleClaimError` when the claim
    moved on (settled, cancelled, another holder's), which ends the keeper at once."""

    def __init__(
        self,
        renew: Renew,
        *,
        margin: float,
        on_lost: Callable[[str], None] | None = None,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        jitter: Callable[[], float] = random.random,
        attempt_timeout: float | None = None,
    ) -> None:
        self._renew = renew
        self.margin = margin
        self._on_lost = on_lost
        self._clock = clock
        self._sleep = sleep
        self._jitter = jitter
        self._attempt_timeout = attempt_timeout
        self.valid_until: float | None = None  # monotonic; None: nothing confirmed yet
        self.lease_seconds: float | None = None  # the last grant's length
        self.lost_because: str | None = None
        self.renewals = 0
        self.failures = 0  # unconfirmed renewals since the last confirmed one
        self._unconfirmed_since: float | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # --- what a worker asks -----------------------------------------------------------

    @property
    def valid(self) -> bool:
        """The lease is known to hold for at least `margin` more seconds."""
        if self.lost_because is not None or self.valid_until is None:
            return False
        if self._clock() >= self.valid_until:
            self.lose("the lease could not be renewed in time: its validity is uncertain")
            return False
        return True

    def remaining(self) -> float:
        """Seconds the lease is still vouched for (0 once it is not)."""
        if not self.valid or self.valid_until is None:
            return 0.0
        return max(0.0, self.valid_until - self._clock())

    def require(self) -> None:
        """Raise `LeaseUncertainError` unless the lease is valid: call it before starting
        any work that cannot be taken back (a provider call, a dispatch)."""
        if not self.valid:
            raise LeaseUncertainError(
                f"do not start irreversible work: {self.lost_because or 'no lease confirmed'}"
            )

    # --- the loop -------------------------------------------------------------------------

    async def renew_once(self) -> None:
        """One renewal, counted from the earliest heartbeat not yet confirmed. Raises what
        `renew` raised (StaleClaimError also ends the keeper)."""
        sent = self._clock()
        if self._unconfirmed_since is None:
            self._unconfirmed_since = sent
        try:
            if self._attempt_timeout is None:
                grant = await self._renew()
            else:
                grant = await asyncio.wait_for(self._renew(), self._attempt_timeout)
        except StaleClaimError as error:
            self.lose(str(error))
            raise
        except BaseException:
            self.failures += 1
            raise
        start = self._unconfirmed_since
        self._unconfirmed_since = None
        self.failures = 0
        self.renewals += 1
        self.lease_seconds = grant.seconds
        until = start + grant.seconds - self.margin
        # A grant never shortens a lease the operator already gave (renewal keeps the later
        # end), but a bound is only as good as what it was measured from: keep the later.
        self.valid_until = until if self.valid_until is None else max(self.valid_until, until)

    async def run(self) -> None:
        """Renew at RENEW_FRACTION of the lease; on a failure retry with jittered, growing
        backoff, never sleeping past the end of validity; stop once validity ends (or the
        claim moved on)."""
        while self.valid:
            await self._sleep(self._next_delay())
            if not self.valid:
                return
            try:
                await self.renew_once()
            except StaleClaimError:
                return
            except Exception:  # any failure is one more unconfirmed try
                continue  # counted in failures: the next delay backs off

    async def watch(self) -> None:
        """Call `on_lost` when validity ends, even while a renewal hangs (a stalled API
        server), and stop the renewals then: none may be counted on after it."""
        while self.valid:
            assert self.valid_until is not None
            await self._sleep(max(0.0, self.valid_until - self._clock()))
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()

    def start(self) -> None:
        """Run the renewals and the watch in the background (after a first grant)."""
        self._tasks = [asyncio.ensure_future(self.run()), asyncio.ensure_future(self.watch())]

    def also_run(self, task: Awaitable[None]) -> None:
        """One more background task, stopped with the others (a watch of the claim)."""
        self._tasks.append(asyncio.ensure_future(task))

    async def stop(self) -> None:
        """Stop renewing (the lease is left to run out, or to be renewed by another)."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:  # already counted as lost: nothing more to tell the caller
                log.exception("the lease's renewals ended with an error")

    def _next_delay(self) -> float:
        assert self.valid_until is not None and self.lease_seconds is not None
        left = max(0.0, self.valid_until - self._clock())
        if self.failures == 0:
            delay = self.lease_seconds * RENEW_FRACTION
        else:
            cap = max(FIRST_BACKOFF_SECONDS, self.lease_seconds * MAX_BACKOFF_FRACTION)
            backoff = min(cap, FIRST_BACKOFF_SECONDS * 2 ** (self.failures - 1))
            delay = backoff * (0.5 + self._jitter() / 2)  # "jittered backoff"
        return min(delay, left)

    def lose(self, why: str) -> None:
        """The lease is no longer vouched for (`why`): once, whoever notices first. The
        renewals stop at their next turn; `on_lost` is called here, and what it raises is
        logged, never let out (it would end the renewals' task, or a caller's `valid`)."""
        if self.lost_because is not None:
            return
        self.lost_because = why
        if self._on_lost is None:
            return
        try:
            self._on_lost(why)
        except Exception:  # a caller's callback: logged, never let out
            log.exception("on_lost raised")
