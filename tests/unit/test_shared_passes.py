"""Callers of `LedgerWriter.reconcile_once` that wait while a pass runs share the next
one: a namespace deleted with 2,000 claims asks its envelope for 2,000 passes at once, and
run one after the other (each reading every claim) they held the operator for minutes
while other tenants' claims waited (found by the cluster-wide integration tests)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from reservoir.k8s.ledger_writer import LedgerStuckError, LedgerWriter


class CountedWriter(LedgerWriter):
    def __init__(self, fail: bool = False) -> None:
        super().__init__(client=None, record=lambda *_: None)  # type: ignore[arg-type]
        self.passes = 0
        self.fail = fail

    async def _converge(self, namespace: str, envelope: str) -> Any:
        self.passes += 1
        number = self.passes
        await asyncio.sleep(0.01)  # the pass's reads and writes
        if self.fail:
            raise LedgerStuckError(f"pass {number}")
        return number


def test_callers_waiting_on_a_pass_share_the_next_one() -> None:
    async def main() -> tuple[CountedWriter, list[Any]]:
        writer = CountedWriter()
        results = await asyncio.gather(*(writer.reconcile_once("ns", "wf") for _ in range(2000)))
        return writer, list(results)

    writer, results = asyncio.run(main())
    # the first caller's pass, then one pass for everyone who asked while it ran
    assert writer.passes == 2
    assert results[0] == 1 and set(results[1:]) == {2}


def test_a_pass_asked_for_after_one_began_is_run_again() -> None:
    """A pass that began before the caller asked may have missed its news: not shared."""

    async def main() -> CountedWriter:
        writer = CountedWriter()
        first = asyncio.create_task(writer.reconcile_once("ns", "wf"))
        await asyncio.sleep(0.005)  # the first pass is running
        assert await writer.reconcile_once("ns", "wf") == 2
        assert await first == 1
        assert await writer.reconcile_once("ns", "wf") == 3  # nobody waiting: a new pass
        return writer

    assert asyncio.run(main()).passes == 3


def test_other_envelopes_do_not_share() -> None:
    async def main() -> list[Any]:
        writer = CountedWriter()
        return list(
            await asyncio.gather(*(writer.reconcile_once("ns", f"wf{i}") for i in range(3)))
        )

    assert sorted(asyncio.run(main())) == [1, 2, 3]


def test_a_failed_pass_fails_for_those_who_shared_it_and_is_not_kept() -> None:
    async def main() -> CountedWriter:
        writer = CountedWriter(fail=True)
        outcomes = await asyncio.gather(
            *(writer.reconcile_once("ns", "wf") for _ in range(50)), return_exceptions=True
        )
        assert all(isinstance(o, LedgerStuckError) for o in outcomes)
        assert {str(o) for o in outcomes} == {"pass 1", "pass 2"}
        assert not writer._last_pass and not writer._waiting and not writer._locks  # nor kept
        with pytest.raises(LedgerStuckError, match="pass 3"):
            await writer.reconcile_once("ns", "wf")
        return writer

    assert asyncio.run(main()).passes == 3
