"""`keep_alive`: a claim's lease renewed in the background while a worker runs its branch.

    async with reservoir.keep_alive(claim, on_lost=stop_work) as lease:
        lease.require()                  # raises LeaseUncertainError once it is uncertain
        await reservoir.dispatch(lease.claim)
        ...

Entering confirms one renewal first (so the lease is vouched for from a known instant of
this process's monotonic clock), then `LeaseKeeper` renews at a third of the lease, with
jittered backoff on failures, and gives up `margin` seconds before the last grant could
end. While the lease is kept, the SDK's `dispatch` of that claim refuses
(`LeaseUncertainError`) once it is no longer valid, whatever the claim's record says.

`Reservoir` (synchronous) runs the renewals on a thread of their own, with their own
connection and event loop, since no loop runs between its calls."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from reservoir.sdk.errors import ClaimNotFoundError, LeaseUncertainError
from reservoir.sdk.keepalive import Grant, LeaseKeeper
from reservoir.sdk.views import ClaimView
from reservoir.sdk.watch import WaitTimeoutError

if TYPE_CHECKING:
    from reservoir.sdk.client import AsyncReservoir

OnLost = Callable[[str], None]
T = TypeVar("T")
FOLLOW_ROUND_SECONDS = 300.0  # a watch of the claim, renewed this often while it lasts


class KeptLease(LeaseKeeper):
    """A claim's lease kept alive by `AsyncReservoir.renew`; `claim` is the claim as the
    last confirmed renewal returned it."""

    def __init__(
        self,
        reservoir: AsyncReservoir,
        claim: ClaimView,
        *,
        margin: float,
        on_lost: OnLost | None = None,
        confirm_timeout: float = 10.0,
    ) -> None:
        super().__init__(self._renew_claim, margin=margin, on_lost=on_lost)
        self.reservoir = reservoir
        self.claim = claim
        self._confirm_timeout = confirm_timeout

    async def _renew_claim(self) -> Grant:
        view = await self.reservoir.renew(self.claim, self._confirm_timeout)
        entry = view.entry
        seconds = entry.granted_seconds if entry is not None else None
        if seconds is None:
            raise LeaseUncertainError(
                f"branchclaim/{view.name}: the renewal's grant is not recorded on the claim"
            )
        self.claim = view
        return Grant(seconds)

    async def __aenter__(self) -> KeptLease:
        await self.renew_once()
        self.reservoir.kept_leases[self.claim.uid] = self
        self.start()
        self.also_run(self._follow_claim())
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.stop()
        finally:
            if self.reservoir.kept_leases.get(self.claim.uid) is self:
                del self.reservoir.kept_leases[self.claim.uid]

    async def _follow_claim(self) -> None:
        """The lease is no longer vouched for the moment the claim shows it is over for this
        worker (settled, cancelled, being deleted, handed to another, another claim of the
        name), not only at the next renewal (found by review: a claim Released while kept
        was vouched for until then)."""
        uid, name = self.claim.uid, self.claim.name
        reservoir = self.reservoir

        def over(view: ClaimView) -> bool:
            return view.uid != uid or reservoir.renew_problem(view) is not None

        while self.lost_because is None:
            try:
                view = await reservoir.await_claim(name, over, FOLLOW_ROUND_SECONDS)
            except WaitTimeoutError:
                continue
            except ClaimNotFoundError:
                self.lose(f"branchclaim/{name} no longer exists")
                return
            problem = reservoir.renew_problem(view) if view.uid == uid else "another claim"
            self.lose(f"branchclaim/{name}: {problem}")
            return


class ThreadedKeptLease:
    """`KeptLease` for the synchronous SDK: its renewals run on a thread with an event loop
    and a connection of their own (`make_reservoir` builds that connection there). The
    lease's state is read from the caller's thread: `valid` is computed from the monotonic
    clock when read."""

    def __init__(
        self,
        make_reservoir: Callable[[], AsyncReservoir],
        claim: ClaimView,
        registry: dict[str, LeaseKeeper],
        *,
        margin: float,
        on_lost: OnLost | None = None,
        confirm_timeout: float = 10.0,
    ) -> None:
        self._make_reservoir = make_reservoir
        self._registry = registry
        self._first = claim
        self._margin, self._on_lost, self._confirm_timeout = margin, on_lost, confirm_timeout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.kept: KeptLease | None = None

    @property
    def claim(self) -> ClaimView:
        return self.kept.claim if self.kept is not None else self._first

    @property
    def valid(self) -> bool:
        return self.kept is not None and self.kept.valid

    def remaining(self) -> float:
        return self.kept.remaining() if self.kept is not None else 0.0

    def require(self) -> None:
        if self.kept is None:
            raise LeaseUncertainError("do not start irreversible work: no lease confirmed")
        self.kept.require()

    def __enter__(self) -> ThreadedKeptLease:
        self._thread.start()
        try:
            self.kept = self._call(self._enter())
        except BaseException:
            self._shut()
            raise
        self._registry[self.claim.uid] = self.kept
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        try:
            if self.kept is not None:
                try:
                    self._call(self._exit(self.kept))
                finally:
                    if self._registry.get(self.claim.uid) is self.kept:
                        del self._registry[self.claim.uid]
        finally:
            self._shut()

    async def _enter(self) -> KeptLease:
        reservoir = self._make_reservoir()
        kept = KeptLease(
            reservoir,
            self._first,
            margin=self._margin,
            on_lost=self._on_lost,
            confirm_timeout=self._confirm_timeout,
        )
        try:
            return await kept.__aenter__()
        except BaseException:
            await reservoir.close()
            raise

    async def _exit(self, kept: KeptLease) -> None:
        try:
            await kept.__aexit__()
        finally:
            await kept.reservoir.close()

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _shut(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
