"""kopf's toggle sets, as `reservoir.kopf_readiness` makes them: waiters are woken when the
set's state changes and only then, so the start-up's index readiness over N objects costs
O(N) wake-ups instead of N²/2 (a restart over 10,000 claims spent minutes in them)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest
from kopf._cogs.aiokits.aiotoggles import ToggleSet

from reservoir import kopf_readiness

ORIGINAL = (ToggleSet.make_toggle, ToggleSet.drop_toggle, ToggleSet.drop_toggles)


@pytest.fixture
def patched() -> Iterator[None]:
    kopf_readiness.apply()
    try:
        yield
    finally:
        ToggleSet.make_toggle, ToggleSet.drop_toggle, ToggleSet.drop_toggles = ORIGINAL  # type: ignore[method-assign]


def counting_notifications(toggles: ToggleSet) -> Callable[[], int]:
    condition = toggles._condition
    notify_all = condition.notify_all
    calls = [0]

    def counted() -> None:
        calls[0] += 1
        notify_all()

    condition.notify_all = counted  # type: ignore[method-assign]
    return lambda: calls[0]


async def start_up(objects: int) -> int:
    """kopf's start-up: the watcher makes a toggle per listed object as it arrives (and
    one for the listing); each object's worker, once indexed, drops its toggle and waits
    for the whole set. Returns how many times waiters were woken."""
    indexed = ToggleSet(all)
    notifications = counting_notifications(indexed)
    listing = await indexed.make_toggle(name="listing")
    workers = []

    async def worker(toggle: object) -> None:
        await asyncio.sleep(0)
        await indexed.drop_toggle(toggle)  # type: ignore[arg-type]
        await indexed.wait_for(True)

    for index in range(objects):
        toggle = await indexed.make_toggle(name=str(index))
        workers.append(asyncio.create_task(worker(toggle)))
        await asyncio.sleep(0)  # the stream goes on while earlier workers wait
    await indexed.drop_toggle(listing)
    await asyncio.wait_for(asyncio.gather(*workers), timeout=60)
    assert indexed.is_on()
    return notifications()


def test_kopf_as_shipped_wakes_every_waiter_on_every_toggle() -> None:
    # What the patch is for: without it, a notification per toggle made or dropped.
    assert asyncio.run(start_up(500)) >= 1000


@pytest.mark.usefixtures("patched")
def test_start_up_wakes_the_waiters_once_when_every_object_is_indexed() -> None:
    assert asyncio.run(start_up(500)) <= 2  # on → off at the first toggle, off → on at the end


@pytest.mark.usefixtures("patched")
def test_waiters_still_wake_on_every_change_of_state() -> None:
    async def scenario() -> list[str]:
        seen: list[str] = []
        paused = ToggleSet(any)  # as kopf's operator pause: on while any toggle is on

        async def wait(state: bool, label: str) -> None:
            await paused.wait_for(state)
            seen.append(label)

        resumed = asyncio.create_task(wait(True, "on"))
        await asyncio.sleep(0)
        first = await paused.make_toggle(True, name="first")  # off → on
        await asyncio.wait_for(resumed, 5)
        second = await paused.make_toggle(True, name="second")  # stays on
        off = asyncio.create_task(wait(False, "off"))
        await paused.drop_toggle(first)  # still on: the waiter for off keeps waiting
        await asyncio.sleep(0.01)
        assert not off.done()
        await paused.drop_toggles([second])  # on → off
        await asyncio.wait_for(off, 5)
        third = await paused.make_toggle(False, name="third")
        again = asyncio.create_task(wait(True, "on again"))
        await asyncio.sleep(0)
        await third.turn_to(True)  # a toggle's own change wakes the set's waiters too
        await asyncio.wait_for(again, 5)
        return seen

    assert asyncio.run(scenario()) == ["on", "off", "on again"]
