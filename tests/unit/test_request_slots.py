"""One pass's many API requests do not hold back another pass's few (request_slots.py)."""

from __future__ import annotations

import asyncio

from reservoir.k8s.request_slots import RequestSlots


async def _served_order(slots: RequestSlots) -> list[str]:
    order: list[str] = []
    in_flight = 0
    most = 0

    async def request(who: str, limit: object) -> None:
        nonlocal in_flight, most
        async with limit:  # type: ignore[attr-defined]
            in_flight += 1
            most = max(most, in_flight)
            for _ in range(3):  # the request's round trip
                await asyncio.sleep(0)
            in_flight -= 1
            order.append(who)

    big = slots.for_pass()
    wide = [asyncio.create_task(request("big", big)) for _ in range(2000)]
    await asyncio.sleep(0)  # every one of them is waiting for a slot
    small = slots.for_pass()
    await asyncio.gather(request("small", small), *wide)
    assert most <= 16, most
    return order


def test_a_pass_with_one_request_waits_behind_a_few_not_behind_thousands() -> None:
    order = asyncio.run(_served_order(RequestSlots(total=16, per_pass=8)))
    assert len(order) == 2001
    assert order.index("small") < 32, order.index("small")


def test_without_the_per_pass_bound_it_waited_behind_all_of_them() -> None:
    """The measure above can fail: one shared bound alone serves first come, first served."""
    order = asyncio.run(_served_order(RequestSlots(total=16, per_pass=16 * 1000)))
    assert order.index("small") > 1900


def test_a_request_cancelled_while_waiting_gives_its_slot_back() -> None:
    async def main() -> None:
        slots = RequestSlots(total=1, per_pass=1)
        limit = slots.for_pass()
        async with slots.for_pass():  # another pass holds the only shared slot
            waiting = asyncio.create_task(limit.__aenter__())  # holds its own, waits
            await asyncio.sleep(0)
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
        async with limit:  # its own slot was given back (else: stuck here for good)
            pass

    asyncio.run(asyncio.wait_for(main(), 5))
