"""The writers' wake-ups are kept only while they can matter (reservoir.k8s.triggers)."""

from __future__ import annotations

import asyncio

from reservoir.k8s.triggers import PENDING_POKE_SECONDS, SWEEP_AT_LEAST, Triggers


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_pokes_to_names_no_one_keeps_do_not_pile_up() -> None:
    """A tenant's claims name 20,000 envelopes that do not exist, one after another: the
    triggers made for them are swept once their pokes have waited long enough."""
    clock = Clock()
    triggers: Triggers[tuple[str, str]] = Triggers(clock)
    for i in range(20_000):
        clock.now = i * 0.1  # ten new names a second: 2,000 s in all
        triggers.poke(("team-a", f"nowhere-{i}"))
    # What remains: the pokes younger than PENDING_POKE_SECONDS, and at most one sweep's
    # worth of older ones.
    assert len(triggers) <= 2 * max(SWEEP_AT_LEAST, int(PENDING_POKE_SECONDS * 10) + 1)
    assert len(triggers) < 20_000


def test_a_held_trigger_outlives_every_sweep_and_keeps_its_poke() -> None:
    clock = Clock()
    triggers: Triggers[str] = Triggers(clock)

    async def scenario() -> bool:
        with triggers.holding("kept") as trigger:
            triggers.poke("kept")
            clock.now = 10 * PENDING_POKE_SECONDS
            triggers.sweep()
            triggers.forget("kept")  # its envelope's deletion finished while a holder waits
            assert triggers.held("kept")
            assert triggers.get("kept") is trigger  # pokes still reach the holder
            return await trigger.wait(0)

    assert asyncio.run(scenario())
    assert not triggers.held("kept")


def test_a_fresh_poke_waits_for_its_holder_across_a_sweep() -> None:
    """The stopping daemon hands a poke on to the deletion handler: no one holds the
    trigger between the two, and a sweep then must not lose the poke."""
    clock = Clock()
    triggers: Triggers[str] = Triggers(clock)
    triggers.poke("going")
    clock.now = PENDING_POKE_SECONDS / 2
    triggers.sweep()

    async def handler() -> bool:
        with triggers.holding("going") as trigger:
            return await trigger.wait(0)

    assert asyncio.run(handler())


def test_idle_and_stale_triggers_are_swept() -> None:
    clock = Clock()
    triggers: Triggers[str] = Triggers(clock)
    triggers.get("quiet")  # made, never poked
    triggers.poke("stale")
    clock.now = PENDING_POKE_SECONDS + 1
    triggers.poke("recent")
    triggers.sweep()
    assert len(triggers) == 1
    assert asyncio.run(triggers.get("recent").wait(0))
    assert not asyncio.run(triggers.get("stale").wait(0))  # made again, without the poke
