"""The worker's keep-alive (reservoir.sdk.keepalive) on a fake monotonic clock: renewals at
a third of the lease, validity measured from the heartbeat's sending, jittered backoff that
never sleeps past validity, and a lease given up (require() raising, renewals stopped,
on_lost called once) on a stalled API server, a paused process or a claim that moved on.
A jump of the wall clock changes nothing: only the monotonic clock is read."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from reservoir.core.model import ClaimPhase, LedgerEntry
from reservoir.sdk.errors import LeaseUncertainError, StaleClaimError
from reservoir.sdk.keepalive import FIRST_BACKOFF_SECONDS, Grant, LeaseKeeper
from reservoir.sdk.kept_lease import KeptLease
from reservoir.sdk.views import ClaimView


class FakeClock:
    """A monotonic clock that moves only when told; `sleep` waits for it."""

    def __init__(self) -> None:
        self.now = 0.0
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.now + seconds, next(self._order), future))
        await future

    async def advance(self, seconds: float) -> None:
        """Move time on, waking each sleeper at its time and letting it run."""
        target = self.now + seconds
        await settle()
        while self._sleepers and self._sleepers[0][0] <= target:
            wake, _, future = heapq.heappop(self._sleepers)
            self.now = max(self.now, wake)
            if not future.done():
                future.set_result(None)
            await settle()
        self.now = target
        await settle()


async def settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0)


class Renewals:
    """A scripted operator: each call to `renew` is recorded at its (fake) time and answered
    by the next script item: a Grant's seconds, an exception, "hang" or a (delay, seconds)."""

    def __init__(self, clock: FakeClock, script: list[Any]) -> None:
        self.clock = clock
        self.script = list(script)
        self.calls: list[float] = []

    async def __call__(self) -> Grant:
        self.calls.append(self.clock.now)
        step = self.script.pop(0) if self.script else 30.0
        if step == "hang":
            await asyncio.get_running_loop().create_future()  # a stalled API server
        if isinstance(step, BaseException):
            raise step
        if isinstance(step, tuple):
            delay, step = step
            await self.clock.sleep(delay)
        return Grant(float(step))


def keeper(
    clock: FakeClock, renew: Callable[[], Awaitable[Grant]], lost: list[str], jitter: float = 0.0
) -> LeaseKeeper:
    return LeaseKeeper(
        renew,
        margin=2.0,
        on_lost=lost.append,
        clock=clock,
        sleep=clock.sleep,
        jitter=lambda: jitter,
    )


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())


def test_validity_counts_from_the_heartbeats_sending_and_renews_at_a_third() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        renewals = Renewals(clock, [(5.0, 30.0), 30.0, 30.0])
        lost: list[str] = []
        lease = keeper(clock, renewals, lost)
        first = asyncio.ensure_future(lease.renew_once())
        await clock.advance(5)  # the grant is confirmed 5 s after the heartbeat went
        await first
        assert lease.valid_until == 0 + 30 - 2, "from the sending, not the confirmation"
        lease.start()
        await clock.advance(9.9)
        assert renewals.calls == [0.0]
        await clock.advance(0.2)  # a third of the lease after the confirmation
        assert renewals.calls == [0.0, 15.0]
        assert lease.valid_until == 15 + 30 - 2 and lease.valid and not lost
        await lease.stop()

    run(scenario)


def test_a_stalled_api_server_ends_validity_before_the_lease_and_stops_renewals() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        renewals = Renewals(clock, [30.0, "hang"])
        lost: list[str] = []
        lease = keeper(clock, renewals, lost)
        await lease.renew_once()
        lease.start()
        await clock.advance(10)  # the renewal at a third hangs
        assert renewals.calls == [0.0, 10.0] and lease.valid
        await clock.advance(17.9)
        assert lease.valid, "28 s (30 − margin) after the last confirmed heartbeat's sending"
        lease.require()
        await clock.advance(0.2)
        assert not lease.valid and len(lost) == 1 and "uncertain" in lost[0]
        with pytest.raises(LeaseUncertainError, match="do not start irreversible work"):
            lease.require()
        await clock.advance(300)
        assert renewals.calls == [0.0, 10.0], "no renewal after validity ended"
        assert len(lost) == 1, "on_lost is called once"
        await lease.stop()

    run(scenario)


@pytest.mark.parametrize("jitter", [0.0, 1.0])
def test_failures_back_off_with_jitter_and_never_sleep_past_validity(jitter: float) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        failure = LeaseUncertainError("renewal not confirmed")
        renewals = Renewals(clock, [60.0, *[failure] * 20])
        lost: list[str] = []
        lease = keeper(clock, renewals, lost, jitter=jitter)
        await lease.renew_once()
        lease.start()
        await clock.advance(100)
        gaps = [round(b - a, 6) for a, b in itertools.pairwise(renewals.calls[1:])]
        factor = 0.5 + jitter / 2
        cap = 60 / 6
        expected = [min(cap, FIRST_BACKOFF_SECONDS * 2**n) * factor for n in range(len(gaps))]
        assert gaps[:-1] == pytest.approx(expected[:-1]), "doubling, jittered, capped"
        assert renewals.calls[1] == 20.0, "the first renewal at a third of the lease"
        assert max(renewals.calls) < 58.0, "no try after validity (60 − margin) ended"
        assert lost and not lease.valid

    run(scenario)


def test_an_unconfirmed_heartbeat_counts_the_next_grant_from_its_own_sending() -> None:
    """Its grant may land later, counted from it: the earliest heartbeat not yet confirmed
    bounds the next grant's validity."""

    async def scenario() -> None:
        clock = FakeClock()
        renewals = Renewals(clock, [30.0, TimeoutError(), 30.0])
        lease = keeper(clock, renewals, [])
        await lease.renew_once()
        await clock.advance(10)
        with pytest.raises(TimeoutError):
            await lease.renew_once()
        await clock.advance(1)
        await lease.renew_once()
        assert renewals.calls == [0.0, 10.0, 11.0]
        assert lease.valid_until == 10 + 30 - 2

    run(scenario)


def test_a_paused_process_finds_its_lease_uncertain_the_moment_it_runs_again() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        lost: list[str] = []
        lease = keeper(clock, Renewals(clock, [30.0]), lost)
        await lease.renew_once()
        clock.now = 100.0  # stopped for 100 s: no task ran meanwhile
        assert not lease.valid and lost, "decided when read, not by the renewal loop"
        with pytest.raises(LeaseUncertainError):
            lease.require()

    run(scenario)


def test_a_claim_that_moved_on_ends_the_keeper_at_once() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        stale = StaleClaimError("branchclaim/x: cannot renew: the branch was cancelled")
        renewals = Renewals(clock, [30.0, stale])
        lost: list[str] = []
        lease = keeper(clock, renewals, lost)
        await lease.renew_once()
        lease.start()
        await clock.advance(10)
        assert lost == [str(stale)] and not lease.valid
        await clock.advance(100)
        assert renewals.calls == [0.0, 10.0]

    run(scenario)


class FakeReservoir:
    """Answers `renew` with the claim as the operator would write it after a grant."""

    def __init__(self, renewed_at: datetime, granted: timedelta) -> None:
        self.kept_leases: dict[str, LeaseKeeper] = {}
        self.renewed_at, self.granted = renewed_at, granted

    async def renew(self, claim: ClaimView, confirm_timeout: float | None = 10.0) -> ClaimView:
        line = LedgerEntry(
            claim="x",
            phase=ClaimPhase.TENTATIVE,
            first_reserved_at=self.renewed_at - timedelta(hours=1),
            renewed_at=self.renewed_at,
            expires_at=self.renewed_at + self.granted,
            renewals=1,
        )
        return ClaimView.from_api(claim_body(line))


def claim_body(line: LedgerEntry) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "x",
            "namespace": "ns",
            "uid": "u-1",
            "generation": 1,
            "resourceVersion": "1",
        },
        "spec": {"envelope": "wf", "requests": {"tokens": "1"}},
        "status": {"phase": "Tentative", "ledger": line.to_api()},
    }


@pytest.mark.parametrize("operator_clock", ["1999-01-01", "2026-12-05", "2100-01-01"])
def test_the_grant_is_measured_on_the_operators_clock_whatever_the_wall_clock(
    operator_clock: str,
) -> None:
    """The grant is expiresAt − renewedAt, both the operator's: a wall clock an hour (or
    decades) off the operator's changes nothing."""

    async def scenario() -> None:
        clock = FakeClock()
        at = datetime.fromisoformat(operator_clock).replace(tzinfo=UTC)
        reservoir = FakeReservoir(at, timedelta(seconds=45))
        claim = ClaimView.from_api(claim_body(LedgerEntry(claim="x", phase=ClaimPhase.TENTATIVE)))
        kept = KeptLease(reservoir, claim, margin=2.0)  # type: ignore[arg-type]
        kept._clock = clock
        await kept.renew_once()
        assert kept.lease_seconds == 45.0 and kept.valid_until == 43.0
        assert kept.claim.entry is not None and kept.claim.entry.renewals == 1

    run(scenario)
