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


def test_passes_waiting_on_providers_give_their_slots_back_meanwhile() -> None:
    """Two tenants whose providers are slow held every slot, and a third tenant's one pass
    waited behind them (found by review); now their passes step aside while they wait."""

    async def scenario() -> tuple[float, int]:
        passes = PassesInFlight(total=4, per_namespace=2)
        provider = asyncio.Event()
        slow_started = 0

        async def slow_pass(namespace: str) -> None:
            nonlocal slow_started
            async with passes.slot(namespace):
                slow_started += 1

                async with PassesInFlight.aside():  # its providers, asked at once
                    await asyncio.gather(provider.wait(), provider.wait())

        slow = [asyncio.create_task(slow_pass(n)) for n in ("a", "a", "b", "b", "a", "b")]
        await asyncio.sleep(0.05)
        started = asyncio.get_running_loop().time()
        async with passes.slot("quiet"):
            waited = asyncio.get_running_loop().time() - started
        provider.set()
        await asyncio.gather(*slow)
        return waited, slow_started

    waited, slow_started = asyncio.run(asyncio.wait_for(scenario(), timeout=5))
    assert waited < 0.5  # at once: no slow pass holds a slot while its provider is asked
    assert slow_started == 6


def test_a_pass_takes_its_slot_again_before_it_goes_on() -> None:
    async def scenario() -> list[str]:
        passes = PassesInFlight(total=1, per_namespace=1)
        order: list[str] = []
        answered = asyncio.Event()

        async def first() -> None:
            async with passes.slot("t"):
                async with PassesInFlight.aside():
                    order.append("first asks its provider")
                    await answered.wait()
                order.append("first goes on")  # only once the second gave its slot back

        async def second() -> None:
            await asyncio.sleep(0.01)
            async with passes.slot("t"):
                order.append("second runs")
                answered.set()
                await asyncio.sleep(0.05)
                order.append("second ends")

        await asyncio.gather(first(), second())
        return order

    assert asyncio.run(scenario()) == [
        "first asks its provider",
        "second runs",
        "second ends",
        "first goes on",
    ]


def test_a_failed_provider_call_cancels_the_others_and_its_pass_slot_comes_back() -> None:
    """With a plain gather, a call still waiting on its provider outlived its failed pass
    and took that pass's slot for good when it returned (found by review)."""
    from reservoir.k8s.ledger_writer import gather_or_cancel

    async def scenario() -> list[str]:
        passes = PassesInFlight(total=1, per_namespace=1)
        seen: list[str] = []

        async def slow_provider() -> None:
            try:
                await asyncio.sleep(0.2)
                seen.append("slow provider answered")
            except asyncio.CancelledError:
                seen.append("slow provider cancelled")
                raise

        async def failing_provider() -> None:
            await asyncio.sleep(0.01)
            raise RuntimeError("connection reset")

        async def one_pass() -> None:
            async with passes.slot("t"), PassesInFlight.aside():
                await gather_or_cancel(slow_provider(), failing_provider())

        with pytest.raises(RuntimeError):
            await one_pass()
        await asyncio.sleep(0.3)
        async with passes.slot("other"):  # not leaked
            seen.append("another pass ran")
        return seen

    assert asyncio.run(asyncio.wait_for(scenario(), timeout=5)) == [
        "slow provider cancelled",
        "another pass ran",
    ]
