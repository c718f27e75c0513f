"""The watch that begins with the API server streaming every object (reservoir.watch_list),
driven with kopf's `watch_objs` replaced by scripted streams: what it yields, where it
resumes, and when it lists in pages instead."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import kopf
import pytest
from kopf._cogs.clients import errors, watching

from reservoir import metrics, watch_list


class Resource:
    plural, group = "branchclaims", "reservoir.dev"


def claim(name: str, version: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": name, "resourceVersion": version}}


def bookmark(version: str, end: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"resourceVersion": version}
    if end:
        meta["annotations"] = {watch_list.END_ANNOTATION: "true"}
    return {"type": "BOOKMARK", "object": {"metadata": meta}}


class Server:
    """Scripted answers to kopf's `watch_objs`, one list of events (or an error) a call;
    each call's `since` and whether it asked for the initial state."""

    def __init__(self, *answers: list[dict[str, Any]] | errors.APIError) -> None:
        self.answers = list(answers)
        self.calls: list[tuple[str | None, bool]] = []

    async def watch_objs(self, *, settings: Any, since: Any, **_: Any) -> AsyncIterator[Any]:
        self.calls.append((since, settings.watching.initial_streaming))
        if not self.answers:
            await asyncio.sleep(3600)
        answer = self.answers.pop(0)
        if isinstance(answer, errors.APIError):
            raise answer
        for event in answer:
            yield event


async def listed_in_pages(**_: Any) -> AsyncIterator[Any]:
    yield {"type": None, "object": claim("paged", "1")}
    yield watching.Bookmark.LISTED


def run(
    server: Server, state: watch_list.WatchLists, monkeypatch: pytest.MonkeyPatch, take: int
) -> list[Any]:
    monkeypatch.setattr(watching, "watch_objs", server.watch_objs)

    async def scenario() -> list[Any]:
        seen: list[Any] = []
        stream = watch_list.continuous_watch(
            state,
            listed_in_pages,
            settings=kopf.OperatorSettings(),
            resource=Resource(),
            namespace="t",
            operator_pause_waiter=asyncio.get_running_loop().create_future(),
        )
        async for event in stream:
            seen.append(event)
            if len(seen) == take:
                break
        await stream.aclose()
        return seen

    return asyncio.run(asyncio.wait_for(scenario(), timeout=5))


def count(how: str) -> float:
    return metrics.initial_states.labels("branchclaims.reservoir.dev", how)._value.get()


def test_the_initial_state_is_streamed_then_watched_from_its_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = Server(
        [
            {"type": "ADDED", "object": claim("a", "7")},
            bookmark("3"),  # the decoder's stand-in for an object it set aside: not the end
            {"type": "ADDED", "object": claim("b", "5")},
            bookmark("9", end=True),
            {"type": "MODIFIED", "object": claim("a", "10")},
        ],
        # The server ended the watch (its timeout): resumed from the last version seen.
        [{"type": "DELETED", "object": claim("b", "11")}],
    )
    streamed = count("streamed")
    seen = run(server, watch_list.WatchLists(), monkeypatch, take=5)
    assert seen == [
        {"type": None, "object": claim("a", "7")},
        {"type": None, "object": claim("b", "5")},
        watching.Bookmark.LISTED,
        {"type": "MODIFIED", "object": claim("a", "10")},
        {"type": "DELETED", "object": claim("b", "11")},
    ]
    assert server.calls == [(None, True), ("10", False)]
    assert count("streamed") == streamed + 1


def test_a_stream_cut_before_its_end_is_never_resumed_and_that_watch_lists_from_then_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Resuming from one object's version could skip objects not yet sent."""
    state = watch_list.WatchLists()
    server = Server([{"type": "ADDED", "object": claim("a", "7")}])
    assert run(server, state, monkeypatch, take=10) == [{"type": None, "object": claim("a", "7")}]
    assert server.calls == [(None, True)]
    assert not state.streams(Resource(), "t")
    assert state.streams(Resource(), "other")  # only that watch
    listed = count("listed")
    again = run(Server(), state, monkeypatch, take=2)
    assert again == [{"type": None, "object": claim("paged", "1")}, watching.Bookmark.LISTED]
    assert count("listed") == listed + 1


@pytest.mark.parametrize("status", [400, 422])
def test_a_server_that_refuses_to_stream_is_listed_in_pages_for_every_kind(
    monkeypatch: pytest.MonkeyPatch, status: int
) -> None:
    state = watch_list.WatchLists()
    refused = errors.APIClientError(
        {"message": "sendInitialEvents is forbidden"}, status=status, headers={}
    )
    server = Server(refused)
    assert run(server, state, monkeypatch, take=10) == []
    assert not state.streams(Resource(), "t")
    assert not state.streams(Resource(), "other")
    again = run(Server(), state, monkeypatch, take=2)
    assert again[-1] is watching.Bookmark.LISTED


def test_other_refusals_and_watch_errors_fail_the_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    """kopf_watch's watcher starts a failed watch again and says so on /readyz."""
    state = watch_list.WatchLists()
    forbidden = errors.APIForbiddenError({"message": "forbidden"}, status=403, headers={})
    with pytest.raises(errors.APIForbiddenError):
        run(Server(forbidden), state, monkeypatch, take=10)
    assert state.streams(Resource(), "t")
    failing = Server([{"type": "ERROR", "object": {"code": 500, "message": "boom"}}])
    with pytest.raises(watching.WatchingError):
        run(failing, state, monkeypatch, take=10)


def test_gone_ends_the_watch_for_kopf_to_start_again(monkeypatch: pytest.MonkeyPatch) -> None:
    state = watch_list.WatchLists()
    server = Server(
        [bookmark("9", end=True), {"type": "ERROR", "object": {"code": 410, "message": "too old"}}]
    )
    assert run(server, state, monkeypatch, take=10) == [watching.Bookmark.LISTED]
    assert state.streams(Resource(), "t")  # it had listed: the next attempt streams again
    gone = Server([{"type": "ERROR", "object": {"code": 410, "message": "too old"}}])
    assert run(gone, state, monkeypatch, take=10) == []
    assert not state.streams(Resource(), "t")  # gone before its end: a stream cut short


def test_a_refused_or_cut_stream_is_tried_again_after_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An upgraded control plane, or an older replica that answered once mid-upgrade, does
    not leave the operator listing in pages until it restarts (found by review)."""
    now = [1000.0]
    state = watch_list.WatchLists(clock=lambda: now[0])
    refused = errors.APIClientError({"message": "no"}, status=422, headers={})
    run(Server(refused), state, monkeypatch, take=10)
    assert not state.streams(Resource(), "t")
    now[0] += watch_list.RETRY_STREAMING_SECONDS
    assert state.streams(Resource(), "t")
    run(Server([{"type": "ADDED", "object": claim("a", "7")}]), state, monkeypatch, take=10)
    assert not state.streams(Resource(), "t") and state.streams(Resource(), "other")
    now[0] += watch_list.RETRY_STREAMING_SECONDS
    server = Server([bookmark("9", end=True)])
    assert run(server, state, monkeypatch, take=1) == [watching.Bookmark.LISTED]
    assert server.calls == [(None, True)]
