"""Envelope passes running at once (k8s/passes_in_flight.py): bounded for the writer, and
one namespace's passes never hold every slot."""

from __future__ import annotations

import asyncio

import pytest

from reservoir.k8s.passes_in_flight import PassesInFlight


def test_passes_wait_their_turn_and_one_namespace_never_holds_every_slot() -> None:
    async def scenario() -> tuple[int, int, list[str]]:
        passes = PassesInFlight(total=4, per_namespace=3)
        running: dict[str, int] = {}
        most = {"all": 0, "busy": 0}
        release = asyncio.Event()
        order: list[str] = []

        async def one_pass(namespace: str, name: str) -> None:
            async with passes.slot(namespace):
                running[namespace] = running.get(namespace, 0) + 1
                most["all"] = max(most["all"], sum(running.values()))
                most["busy"] = max(most["busy"], running.get("busy", 0))
                order.append(name)
                if namespace == "busy":
                    await release.wait()  # a slow provider, say
                running[namespace] -= 1

        busy = [asyncio.create_task(one_pass("busy", f"busy-{i}")) for i in range(20)]
        await asyncio.sleep(0.01)
        # Another tenant's one pass runs while the busy tenant's wait for its share.
        await asyncio.wait_for(one_pass("quiet", "quiet"), timeout=1)
        release.set()
        await asyncio.gather(*busy)
        assert passes.namespaces() == 0  # nothing kept once no pass runs or waits
        return most["all"], most["busy"], order

    most_all, most_busy, order = asyncio.run(scenario())
    assert most_busy == 3
    assert most_all == 4
    assert order.index("quiet") == 3  # after the busy tenant's first three, before the rest
    assert len(order) == 21


def test_a_pass_cancelled_while_it_waits_gives_up_its_place() -> None:
    async def scenario() -> int:
        passes = PassesInFlight(total=1, per_namespace=1)
        held = asyncio.Event()
        release = asyncio.Event()

        async def holder() -> None:
            async with passes.slot("t"):
                held.set()
                await release.wait()

        first = asyncio.create_task(holder())
        await held.wait()

        async def waiter() -> None:
            async with passes.slot("t"):
                pass

        waiting = asyncio.create_task(waiter())
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        release.set()
        await first
        async with passes.slot("t"):  # the slots all came back
            pass
        return passes.namespaces()

    assert asyncio.run(scenario()) == 0
