"""How many HTTP provider calls the operator makes, in all and for each namespace.

Every tenant is hostile to every other: one tenant's envelopes with slow or many providers
must not take the operator's outbound capacity from the others. A call needs a slot of the
global cap and one of its namespace's cap (both held for the whole call, resolution
included) and a token of its namespace's bucket (a rate, not only a concurrency: fast
calls in a loop are bounded too). A call that finds its namespace's bucket empty is not
made (it is tried again on a later pass); one that waits for a slot waits within its
deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

MAX_IDLE_NAMESPACES = 256  # namespaces with a full bucket and no call kept before pruning


class RateLimitedError(Exception):
    """The namespace made too many calls lately (its bucket is empty)."""


@dataclass
class _Namespace:
    slots: asyncio.Semaphore
    tokens: float
    updated: float
    in_flight: int = 0


@dataclass
class CallGate:
    max_in_flight: int = 32
    max_in_flight_per_namespace: int = 4
    calls_per_second_per_namespace: float = 2.0
    burst_per_namespace: int = 10
    clock: Callable[[], float] = time.monotonic
    _global: asyncio.Semaphore | None = None
    _namespaces: dict[str, _Namespace] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("max_in_flight", "max_in_flight_per_namespace", "burst_per_namespace"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.calls_per_second_per_namespace <= 0:
            raise ValueError("calls_per_second_per_namespace must be positive")

    def _refill(self, state: _Namespace, now: float) -> None:
        rate, burst = self.calls_per_second_per_namespace, self.burst_per_namespace
        state.tokens = min(float(burst), state.tokens + (now - state.updated) * rate)
        state.updated = now

    def _namespace(self, namespace: str, now: float) -> _Namespace:
        state = self._namespaces.get(namespace)
        if state is None:
            if len(self._namespaces) >= MAX_IDLE_NAMESPACES:
                self._prune(now)
            state = _Namespace(
                asyncio.Semaphore(self.max_in_flight_per_namespace),
                float(self.burst_per_namespace),
                now,
            )
            self._namespaces[namespace] = state
        self._refill(state, now)
        return state

    def _prune(self, now: float) -> None:
        """Forget namespaces that hold nothing: no call in flight, a full bucket (a new
        state for them is the same)."""
        for name, state in list(self._namespaces.items()):
            self._refill(state, now)
            if state.in_flight == 0 and state.tokens >= self.burst_per_namespace:
                del self._namespaces[name]

    @asynccontextmanager
    async def call(self, namespace: str) -> AsyncIterator[None]:
        """Hold a call's slots for the `async with` block. RateLimitedError at once if the
        namespace has no token; waits for slots otherwise (the caller's deadline bounds
        the wait)."""
        if self._global is None:
            self._global = asyncio.Semaphore(self.max_in_flight)
        state = self._namespace(namespace, self.clock())
        if state.tokens < 1:
            raise RateLimitedError(namespace)
        state.tokens -= 1
        state.in_flight += 1
        try:
            async with state.slots, self._global:
                yield
        finally:
            state.in_flight -= 1

    def in_flight(self, namespace: str | None = None) -> int:
        """Calls holding (or waiting for) slots: of one namespace, or of all."""
        if namespace is not None:
            state = self._namespaces.get(namespace)
            return state.in_flight if state else 0
        return sum(s.in_flight for s in self._namespaces.values())
