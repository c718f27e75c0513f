"""A deleted envelope's handler (handlers/envelopes.py): it waits for its settlement with
passes on news, not one every 2 s, and hands back to kopf about once a minute."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import kopf
import pytest

from reservoir.handlers import envelopes
from reservoir.k8s.triggers import Trigger


def live_claim() -> Any:
    return SimpleNamespace(claim="c1", phase=SimpleNamespace(terminal=False))


def pass_result(*, live: bool = False, done_upward: bool = True) -> Any:
    return SimpleNamespace(
        lines={"u1": live_claim()} if live else {},
        child_lines={},
        children_unsettled=0,
        done_upward=done_upward,
        status=SimpleNamespace(parent=SimpleNamespace(name="pool-a")),
        wake_at=None,
    )


posted: list[str] = []


def waits_counted() -> float:
    return envelopes.metrics.finalizer_waits.labels("t", "ReservationEnvelope")._value.get()


class Writer:
    """Passes answer from a script; pokes come from the test."""

    def __init__(self, *results: Any) -> None:
        self.results = list(results)
        self.passes = 0
        self.parent_pokes = 0
        self.waiting = Trigger()
        self.forgotten = False
        self.kept_while_waiting: list[bool] = []
        self._kept = 0

    async def reconcile_once(self, namespace: str, name: str) -> Any:
        self.passes += 1
        self.kept_while_waiting.append(self._kept > 0)
        return self.results.pop(0) if len(self.results) > 1 else self.results[0]

    @contextlib.contextmanager
    def keeping(self, namespace: str, name: str) -> Iterator[Trigger]:
        self._kept += 1
        try:
            yield self.waiting
        finally:
            self._kept -= 1

    def poke_parent(self, namespace: str, record: Any) -> None:
        self.parent_pokes += 1

    def forget(self, namespace: str, name: str) -> None:
        self.forgotten = True


def run(
    writer: Writer, news: list[float], monkeypatch: pytest.MonkeyPatch, retry: int = 0
) -> str | None:
    """The handler, with a poke `news[i]` seconds after it starts; what it raised, if any."""
    owned: list[str] = []

    async def own_claims(services: Any, namespace: str, body: Any) -> None:
        owned.append(namespace)

    monkeypatch.setattr(envelopes, "own_claims", own_claims)
    monkeypatch.setattr(envelopes, "DELETE_HOLD_SECONDS", 1.0)
    monkeypatch.setattr(envelopes, "DELETE_NEWS_BATCH_SECONDS", 0.01)
    monkeypatch.setattr(envelopes.kopf, "warn", lambda *a, **k: posted.append(k["message"]))
    memo: Any = SimpleNamespace(services=SimpleNamespace(writer=writer))

    async def scenario() -> str | None:
        async def poke_later() -> None:
            for at in news:
                await asyncio.sleep(at)
                writer.waiting.poke()

        poker = asyncio.create_task(poke_later())
        try:
            await envelopes.settle_children_before_removal(
                namespace="t", name="wf", body={}, retry=retry, memo=memo
            )
        except kopf.TemporaryError as error:
            return str(error)
        finally:
            poker.cancel()
        assert owned == ["t"] and writer.forgotten
        return None

    return asyncio.run(asyncio.wait_for(scenario(), timeout=10))


def test_a_deletion_passes_again_on_news_and_goes_once_settled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    writer = Writer(pass_result(live=True), pass_result())
    assert run(writer, [0.2], monkeypatch) is None
    assert writer.passes == 2
    assert writer.kept_while_waiting == [True, True]  # pokes reach it: claims need not adopt


def test_without_news_it_makes_one_pass_and_hands_back_to_kopf_after_the_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: a pass (and a kopf progress patch) every 2 s for as long as it waited."""
    writer = Writer(pass_result(live=True))
    raised = run(writer, [], monkeypatch)
    assert raised == "waiting for 1 to settle: claim c1"
    assert writer.passes == 1


def test_waiting_on_its_parent_it_pokes_the_parent_each_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    writer = Writer(pass_result(done_upward=False), pass_result(done_upward=False), pass_result())
    assert run(writer, [0.1, 0.1], monkeypatch) is None
    assert writer.passes == 3
    assert writer.parent_pokes == 3  # and once it goes: its parent retires its line


def test_a_deletion_held_back_is_counted_and_announced_once_at_its_first_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Even when it settles within the hold (found by review: counted only at hand-back)."""
    posted.clear()
    before = waits_counted()
    assert run(Writer(pass_result(live=True), pass_result()), [0.1], monkeypatch) is None
    assert waits_counted() == before + 1
    assert posted == ["waiting for 1 to settle: claim c1"]
    posted.clear()
    raised = run(Writer(pass_result(live=True)), [], monkeypatch, retry=3)
    assert raised is not None
    assert waits_counted() == before + 1  # a retry of the same deletion: not again
    assert posted == [raised]  # only at the hand-back, about once a minute


def test_a_daemon_stopped_for_the_deletion_hands_its_last_news_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kopf stops the daemon while the deletion handler already waits on the same trigger:
    news the daemon took and made no pass of was lost (found by review)."""

    class Stopped:
        flag = False

        def __bool__(self) -> bool:
            return self.flag

    writer = Writer(pass_result())
    stopped = Stopped()
    monkeypatch.setattr(envelopes.metrics.envelopes, "still_current", lambda *a: None)
    services = SimpleNamespace(writer=writer, health=SimpleNamespace(succeeded=lambda: None))
    memo: Any = SimpleNamespace(services=services)

    async def scenario() -> bool:
        daemon = asyncio.create_task(
            envelopes.keep_the_ledger(
                namespace="t", name="wf", stopped=stopped, memo=memo, logger=logging.getLogger()
            )
        )
        await asyncio.sleep(0.05)  # its first pass made, it waits for news
        stopped.flag = True
        writer.waiting.poke()  # news, as the deletion begins
        await asyncio.wait_for(daemon, timeout=5)
        return writer.waiting.event.is_set()

    assert asyncio.run(scenario()) is True
    assert writer.passes == 1  # the daemon made no pass of that news: the handler will
