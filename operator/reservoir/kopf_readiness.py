"""kopf's index readiness at start-up, made linear in the number of watched objects.

kopf holds every handler back until every index is filled: one toggle per object listed at
start, in a `ToggleSet` whose waiters are the workers of the objects already indexed. Its
`make_toggle` and `drop_toggle` wake every waiter on each call (`notify_all`), although a
waiter waits only for the set's aggregate state, which adding an off toggle to an unfilled
set, or dropping one of many, does not change. With N objects that is N²/2 wake-ups before
the first handler runs: measured on this project's benchmark, a restart over 2,000 claims
took 18 s, and over 10,000 the operator spent minutes at full CPU in `notify_all` and in
the woken waiters going back to sleep before its first ledger write.

`apply()` replaces those three methods (the same checks, under the same lock) with ones
that notify only when the set's state changes, which is exactly when a waiter's predicate
(`is_on() == state`) can change. A single toggle's own waiters are woken by its own
`turn_to`, which is untouched. Applied once, before `kopf.run`.

Offered upstream as `hack/upstream/kopf-toggleset-notify-on-change.patch`: this module goes
once a kopf release carries it. Claims and their Leases no longer go through kopf's
per-object toggles (they have informers of their own), but envelopes do, thousands of them
in one pool.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable

from kopf._cogs.aiokits.aiotoggles import Toggle, ToggleSet


@contextlib.asynccontextmanager
async def _notifying_on_change(toggles: ToggleSet) -> AsyncIterator[None]:
    """Under the set's lock: wake its waiters after the change only if its state moved."""
    async with toggles._condition:
        before = toggles.is_on()
        yield
        if toggles.is_on() != before:
            toggles._condition.notify_all()


async def _make_toggle(self: ToggleSet, __val: bool = False, *, name: str | None = None) -> Toggle:
    toggle = Toggle(__val, name=name, condition=self._condition)
    async with _notifying_on_change(self):
        self._toggles.add(toggle)
    return toggle


async def _drop_toggle(self: ToggleSet, toggle: Toggle) -> None:
    async with _notifying_on_change(self):
        self._toggles.discard(toggle)


async def _drop_toggles(self: ToggleSet, toggles: Iterable[Toggle]) -> None:
    async with _notifying_on_change(self):
        self._toggles.difference_update(toggles)


def apply() -> None:
    """Make kopf's toggle sets notify their waiters only when their state changes."""
    ToggleSet.make_toggle = _make_toggle  # type: ignore[method-assign]
    ToggleSet.drop_toggle = _drop_toggle  # type: ignore[method-assign]
    ToggleSet.drop_toggles = _drop_toggles  # type: ignore[method-assign]
