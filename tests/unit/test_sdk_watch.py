"""The SDK's shared claim watch: which events a wait may take, and how waits ride the watch.

No API server here: the waiters' bookkeeping is pure, and the watch's event handling and
its waits are driven by hand (a watch whose task delivers nothing by itself)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from reservoir.core.model import ClaimPhase
from reservoir.sdk import watch as watch_module
from reservoir.sdk.errors import ClaimNotFoundError
from reservoir.sdk.views import ClaimView
from reservoir.sdk.watch import (
    ADDED,
    DELETED,
    MODIFIED,
    ClaimWatch,
    Waiter,
    WaitTimeoutError,
)


def body(version: str, phase: str = "Pending", name: str = "x", uid: str = "u1") -> dict[str, Any]:
    return {
        "apiVersion": "reservoir.dev/v1alpha1",
        "kind": "BranchClaim",
        "metadata": {"name": name, "namespace": "ns", "uid": uid, "resourceVersion": version},
        "spec": {"envelope": "wf", "branch": "b", "requests": {"tokens": "10"}},
        "status": {"phase": phase},
    }


def claim(version: str, phase: str = "Pending", name: str = "x") -> ClaimView:
    return ClaimView.from_api(body(version, phase, name))


def event(kind: str, version: str, phase: str = "Pending", name: str = "x") -> dict[str, Any]:
    return {"type": kind, "object": body(version, phase, name)}


def tentative(view: ClaimView) -> bool:
    return view.phase is ClaimPhase.TENTATIVE


# --- the waiter's bookkeeping ------------------------------------------------------------


def test_a_read_that_satisfies_the_wait_ends_it() -> None:
    waiter = Waiter("x", tentative)
    waiter.begin_round(None)
    waiter.read(claim("7", "Tentative"))
    assert waiter.done and waiter.result is not None
    assert waiter.result.resource_version == "7" and waiter.wake.is_set()


def test_events_before_the_read_on_the_stream_are_older_and_ignored() -> None:
    """The stream has yet to reach the version read: what comes before it is older, even
    when it would satisfy the wait (the claim was Tentative before it was read Pending)."""
    waiter = Waiter("x", tentative)
    waiter.begin_round(None)
    waiter.read(claim("7"))
    waiter.offer(MODIFIED, claim("5", "Tentative"))
    waiter.offer(MODIFIED, claim("6", "Tentative"))
    assert not waiter.done
    waiter.offer(MODIFIED, claim("7"))  # the state read: the stream caught up
    assert not waiter.done
    waiter.offer(MODIFIED, claim("9", "Tentative"))
    assert waiter.result is not None and waiter.result.resource_version == "9"


def test_events_received_during_the_read_count_from_the_version_read() -> None:
    waiter = Waiter("x", tentative)
    waiter.begin_round(None)
    waiter.offer(MODIFIED, claim("5", "Tentative"))  # older than the read
    waiter.offer(MODIFIED, claim("7"))  # the read's version
    waiter.offer(MODIFIED, claim("9", "Tentative"))  # newer: a change during the read
    assert not waiter.done  # buffered until the read answers
    waiter.read(claim("7"))
    assert waiter.result is not None and waiter.result.resource_version == "9"


def test_a_version_the_watch_had_delivered_before_the_round_makes_every_later_event_newer() -> None:
    waiter = Waiter("x", tentative)
    waiter.begin_round("7")  # the watch's last event for x, when the round began
    waiter.offer(MODIFIED, claim("9", "Tentative"))
    waiter.read(claim("7"))
    assert waiter.result is not None and waiter.result.resource_version == "9"


def test_without_that_the_same_event_is_not_taken() -> None:
    """The counterpart of the test above: the watch had not delivered 7, so 9 may be an
    older state than the read (versions are compared for equality only)."""
    waiter = Waiter("x", tentative)
    waiter.begin_round(None)
    waiter.offer(MODIFIED, claim("9", "Tentative"))
    waiter.read(claim("7"))
    assert not waiter.done


def test_a_deletion_after_the_read_ends_the_wait_and_an_older_one_does_not() -> None:
    waiter = Waiter("x", tentative)
    waiter.begin_round(None)
    waiter.read(claim("7"))
    waiter.offer(DELETED, claim("3"))  # an earlier claim of the name, before the read
    assert not waiter.gone
    waiter.offer(MODIFIED, claim("7"))
    waiter.offer(DELETED, claim("8"))
    assert waiter.gone and waiter.result is None and waiter.wake.is_set()


def test_a_new_round_forgets_what_the_last_one_was_waiting_for() -> None:
    waiter = Waiter("x", tentative)
    waiter.begin_round(None)
    waiter.read(claim("7"))  # anchored on 7
    waiter.begin_round(None)
    waiter.offer(MODIFIED, claim("7"))  # now only buffered: the round's read is pending
    assert not waiter.done
    waiter.read(claim("8"))
    waiter.offer(MODIFIED, claim("8"))
    waiter.offer(ADDED, claim("10", "Tentative"))
    assert waiter.result is not None and waiter.result.resource_version == "10"


def test_a_done_waiter_keeps_its_first_answer() -> None:
    waiter = Waiter("x", tentative)
    waiter.begin_round("7")
    waiter.read(claim("7"))
    waiter.offer(MODIFIED, claim("8", "Tentative"))
    waiter.offer(MODIFIED, claim("9", "Tentative"))
    waiter.offer(DELETED, claim("10"))
    assert waiter.result is not None and waiter.result.resource_version == "8"
    assert not waiter.gone


# --- the watch's event handling ----------------------------------------------------------


def test_the_watch_hands_each_event_to_the_waiters_of_its_claim_only() -> None:
    watch = ClaimWatch(None, "ns")  # type: ignore[arg-type]  # no request is made here
    x, y = Waiter("x", tentative), Waiter("y", tentative)
    for waiter in (x, y):
        watch._waiters[waiter.name] = {waiter}
        waiter.begin_round(None)
        waiter.read(claim("1", name=waiter.name))
    watch.handle(event(MODIFIED, "1"))
    watch.handle(event(MODIFIED, "2", "Tentative"))
    assert x.result is not None and x.result.resource_version == "2"
    assert not y.done
    assert watch._known == {"x": "2"} and watch._resume == "2"


def test_bookmarks_move_the_resume_point_and_deletions_forget_the_claim() -> None:
    watch = ClaimWatch(None, "ns")  # type: ignore[arg-type]
    watch.handle(event(ADDED, "4", name="z"))
    assert watch._known == {"z": "4"}
    watch.handle({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "11"}}})
    assert watch._resume == "11" and watch._known == {"z": "4"}
    watch.handle(event(DELETED, "12", name="z"))
    assert watch._known == {} and watch._resume == "12"


def test_a_gone_resource_version_asks_for_a_new_list() -> None:
    watch = ClaimWatch(None, "ns")  # type: ignore[arg-type]
    with pytest.raises(watch_module._GoneError):
        watch.handle({"type": "ERROR", "object": {"kind": "Status", "code": 410}})
    with pytest.raises(RuntimeError, match="watch error"):
        watch.handle({"type": "ERROR", "object": {"kind": "Status", "code": 500, "message": "x"}})


def test_an_unreadable_claim_on_the_stream_breaks_nothing() -> None:
    watch = ClaimWatch(None, "ns")  # type: ignore[arg-type]
    waiter = Waiter("x", tentative)
    watch._waiters["x"] = {waiter}
    broken = event(MODIFIED, "3")
    broken["object"]["spec"] = {"requests": "not a map"}
    watch.handle(broken)
    assert watch._known == {"x": "3"} and not waiter.done


# --- waits on a watch driven by hand -----------------------------------------------------


class HandWatch(ClaimWatch):
    """A watch whose task only says it is listed (or broken): the test delivers events."""

    def __init__(self, healthy: bool = True) -> None:
        super().__init__(None, "ns")  # type: ignore[arg-type]
        self.start_healthy = healthy

    async def _run(self) -> None:
        self._set_healthy(self.start_healthy, force=True)
        self._ready.set()
        await asyncio.Event().wait()


class Reads:
    """A GET of the claim: answers in turn, each optionally with events the watch delivers
    while the GET is under way."""

    def __init__(self, watch: ClaimWatch, *answers: tuple[ClaimView | None, list[Any]]) -> None:
        self.watch = watch
        self.answers = list(answers)
        self.calls = 0

    async def __call__(self, name: str) -> ClaimView:
        self.calls += 1
        view, during = self.answers[min(self.calls, len(self.answers)) - 1]
        for delivered in during:
            self.watch.handle(delivered)
        await asyncio.sleep(0)
        if view is None:
            raise ClaimNotFoundError(f"branchclaim/{name} not found")
        return view


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the condition never held")


async def test_a_change_delivered_while_the_claim_is_read_is_not_lost() -> None:
    watch = HandWatch()
    read = Reads(watch, (claim("7"), [event(MODIFIED, "7"), event(MODIFIED, "9", "Tentative")]))
    try:
        view = await asyncio.wait_for(watch.wait_for("x", tentative, 30, read), 10)
    finally:
        await watch.stop()
    assert view.resource_version == "9" and read.calls == 1


async def test_a_change_after_the_read_ends_the_wait_without_another_read() -> None:
    watch = HandWatch()
    read = Reads(watch, (claim("7"), []))
    waiting = asyncio.ensure_future(watch.wait_for("x", tentative, 30, read))
    try:
        await until(lambda: read.calls == 1 and watch.waiters == 1)
        await asyncio.sleep(0.01)
        assert not waiting.done()
        watch.handle(event(MODIFIED, "7"))
        watch.handle(event(MODIFIED, "8", "Tentative"))
        view = await asyncio.wait_for(waiting, 10)
    finally:
        waiting.cancel()
        await watch.stop()
    assert view.resource_version == "8" and read.calls == 1 and watch.waiters == 0


async def test_a_claim_deleted_while_waited_for_is_not_found() -> None:
    watch = HandWatch()
    read = Reads(watch, (claim("7"), [event(MODIFIED, "7")]))
    waiting = asyncio.ensure_future(watch.wait_for("x", tentative, 30, read))
    try:
        await until(lambda: read.calls == 1)
        await asyncio.sleep(0.01)
        watch.handle(event(DELETED, "8"))
        with pytest.raises(ClaimNotFoundError, match="branchclaim/x"):
            await asyncio.wait_for(waiting, 10)
    finally:
        await watch.stop()


async def test_a_wait_times_out_with_the_last_view_it_saw() -> None:
    watch = HandWatch()
    read = Reads(watch, (claim("7"), [event(MODIFIED, "7"), event(MODIFIED, "8", "Committed")]))
    try:
        with pytest.raises(WaitTimeoutError) as raised:
            await watch.wait_for("x", tentative, 0.05, read)
    finally:
        await watch.stop()
    assert raised.value.last.resource_version == "8" and watch.waiters == 0


async def test_a_broken_watch_falls_back_to_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watch_module, "FALLBACK_INTERVAL", 0.01)
    watch = HandWatch(healthy=False)
    read = Reads(watch, (claim("7"), []), (claim("8"), []), (claim("9", "Tentative"), []))
    try:
        view = await asyncio.wait_for(watch.wait_for("x", tentative, 30, read), 10)
    finally:
        await watch.stop()
    assert view.resource_version == "9" and read.calls == 3


async def test_a_watch_that_starts_over_makes_its_waiters_read_again() -> None:
    """A re-list (after 410 Gone): events may have been missed, so each waiter reads."""
    watch = HandWatch()
    read = Reads(watch, (claim("7"), []), (claim("12", "Tentative"), []))
    waiting = asyncio.ensure_future(watch.wait_for("x", tentative, 30, read))
    try:
        await until(lambda: read.calls == 1)
        await asyncio.sleep(0.01)
        assert not waiting.done()
        watch._set_healthy(True, force=True)
        view = await asyncio.wait_for(waiting, 10)
    finally:
        await watch.stop()
    assert view.resource_version == "12" and read.calls == 2


async def test_a_missing_claim_is_not_found_at_once() -> None:
    watch = HandWatch()
    read = Reads(watch, (None, []))
    try:
        with pytest.raises(ClaimNotFoundError):
            await watch.wait_for("x", tentative, 30, read)
    finally:
        await watch.stop()
    assert watch.waiters == 0


async def test_stopping_the_watch_ends_its_task() -> None:
    watch = HandWatch()
    watch.start()
    await until(lambda: watch.healthy)
    assert watch.running
    await watch.stop()
    assert not watch.running and not watch.healthy
    await watch.stop()  # twice is harmless
