"""kopf_watch's hooks into kopf: where kopf decodes lists and watch lines, and its watcher
(started again when it fails, and down on /readyz until it has listed again). Fails if
kopf moves the internals these hooks replace."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import kopf
import pytest
from kopf._cogs.clients import api, fetching, watching
from kopf._core.reactor import queueing

from reservoir import kopf_watch
from reservoir.endpoints import Health


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> Health:
    for module, name in (
        (fetching, "api"),
        (api, "json"),
        (watching, "infinite_watch"),
        (queueing, "watcher"),
    ):
        monkeypatch.setattr(module, name, getattr(module, name))  # restored afterwards
    health = Health(started=True)
    kopf_watch.apply(health, kopf.OperatorSettings())
    return health


class Resource:
    plural, group = "branchclaims", "reservoir.dev"


def test_the_hooks_sit_where_kopf_decodes(installed: Health) -> None:
    assert fetching.api.get is not api.get  # type: ignore[attr-defined]
    deep = '{"a":' * 2000 + "1" + "}" * 2000
    line = (
        '{"type":"ADDED","object":{"apiVersion":"reservoir.dev/v1alpha1","kind":"BranchClaim",'
        '"metadata":{"name":"deep","namespace":"t","uid":"u","resourceVersion":"5"},'
        f'"spec":{{"placement":{{"affinity":{deep}}}}}}}}}'
    )

    async def decode() -> Any:
        # kopf's stream calls api.json.loads on each line: the deep one no longer raises.
        return api.json.loads(line)  # type: ignore[attr-defined]

    assert asyncio.run(decode()) == {
        "type": "BOOKMARK",
        "object": {"metadata": {"resourceVersion": "5"}},
    }
    assert api.json.loads('{"type":"ADDED"}') == {"type": "ADDED"}  # type: ignore[attr-defined]


def test_a_failed_watcher_is_started_again_and_readiness_says_so_meanwhile(
    installed: Health, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[str] = []
    listed = asyncio.Event()
    failed = asyncio.Event()

    async def original_watcher(**kwargs: Any) -> None:
        runs.append("run")
        if len(runs) == 1:
            failed.set()
            raise RuntimeError("Event processing has failed with an unrecoverable error")
        async for _ in watching.infinite_watch(**kwargs):
            pass

    async def original_stream(**_: Any) -> AsyncIterator[Any]:
        yield watching.Bookmark.LISTED
        listed.set()
        await asyncio.sleep(3600)

    monkeypatch.setattr(kopf_watch, "_ORIGINAL_WATCHER", original_watcher)
    monkeypatch.setattr(kopf_watch, "_ORIGINAL_INFINITE_WATCH", original_stream)
    problems: list[str | None] = []

    async def scenario() -> None:
        resource: Any = Resource()
        unused: Any = None
        started = queueing.watcher(
            resource=resource, namespace=None, settings=kopf.OperatorSettings(), processor=unused
        )
        task = asyncio.create_task(started)
        await asyncio.wait_for(failed.wait(), timeout=5)
        await asyncio.sleep(0.1)
        problems.append(installed.problem())  # failed, not yet back
        await asyncio.wait_for(listed.wait(), timeout=5)
        problems.append(installed.problem())  # listed again: up
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert runs == ["run", "run"]
    down, up = problems
    assert down is not None and "branchclaims.reservoir.dev cluster-wide" in down
    assert "RuntimeError" in down
    assert up is None
    json.dumps(problems)  # plain strings, as /readyz serves them
