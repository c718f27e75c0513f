"""kopf's watches, made to survive what they cannot read and to say when they are down.

kopf lists and then watches each kind with one task per kind (cluster-wide: one for every
namespace). Two things stopped all of it for every tenant (issue 21):

- An object its JSON decoder refuses (one nested 2,000 levels deep raises RecursionError)
  failed the whole LIST response or the watch line, the task died, and kopf never starts
  a dead watcher again: its indexes never became ready and every ledger froze, while the
  operator still answered "ready". `apply` puts `undecodable.decode_list` and
  `decode_event` where kopf decodes a list and a watch line (its `fetching` module's
  `api.get`, and `api.stream`'s `json.loads`): such an object is set aside (a log line and
  a Warning Event naming it, and on this operator's own kinds an `Undecodable` condition
  written by a merge patch of its status, whose answer is never decoded) and the others
  are served.
- Any other failure of a watcher (a line that is not JSON, a framework error) still ends
  its task: `apply` wraps kopf's watcher so that it is started again (backing off up to a
  minute), and /readyz says "not ready" from its failure until its list is complete again.

The kinds the operator keeps many of (claims and their Leases) are served by informers
of its own (reservoir.k8s.informer): `serve_informer` takes kopf's watcher's place for
them, with the same watch stream, restarts and readiness, and no per-object worker.

Each watch begins with the API server streaming every object where it can
(`reservoir.watch_list`), and with kopf's list in pages where it cannot.

These are kopf internals (1.45: `_cogs.clients.api`, `fetching`, `watching`,
`_core.reactor.queueing`); `tests/unit/test_kopf_watch.py` fails if they move.
"""

from __future__ import annotations

import asyncio
import json
import logging
import types
import urllib.parse
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime
from typing import Any

from kopf._cogs.clients import api, fetching, watching
from kopf._cogs.configs.configuration import OperatorSettings
from kopf._core.reactor import queueing

from reservoir import metrics, watch_list
from reservoir.core.model import API_GROUP
from reservoir.endpoints import Health
from reservoir.k8s.informer import Informer
from reservoir.undecodable import SetAside, decode_event, decode_list

logger = logging.getLogger(__name__)

CONDITION = "Undecodable"
# This operator's kinds, whose status it writes: the set-aside condition goes there too.
OWN_PLURALS = {
    "BranchClaim": "branchclaims",
    "ReservationEnvelope": "reservationenvelopes",
    "ReservationPool": "reservationpools",
}
MAX_BACKOFF_SECONDS = 60.0

_ORIGINAL_WATCHER = queueing.watcher
_ORIGINAL_INFINITE_WATCH = watching.infinite_watch
_ORIGINAL_CONTINUOUS_WATCH = watching.continuous_watch


class SetAsideReporter:
    """Says once per object version (uid and generation) that it was set aside: a log
    line at once, then a Warning Event and, on this operator's kinds, a condition."""

    def __init__(self, settings: OperatorSettings) -> None:
        self.settings = settings
        self.reported: set[tuple[str, int | None]] = set()
        self.tasks: set[asyncio.Task[None]] = set()

    def __call__(self, found: SetAside) -> None:
        key = (found.uid or f"{found.namespace}/{found.name}", found.generation)
        if key in self.reported:
            return
        if len(self.reported) > 10_000:  # bounded, whatever tenants store
            self.reported.clear()
        self.reported.add(key)
        metrics.objects_set_aside.labels(found.kind[:64]).inc()
        where = f"{found.namespace}/{found.name}" if found.namespace else found.name
        logger.error(
            "set aside %s %s (uid %s, resourceVersion %s): %s; the rest are served",
            found.kind,
            where,
            found.uid,
            found.resource_version,
            found.why,
        )
        task = asyncio.get_running_loop().create_task(self.announce(found))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def message(self, found: SetAside) -> str:
        return (
            f"The operator cannot decode this {found.kind} ({found.why}) and has set it "
            f"aside: it is not served until it is changed to a readable form or deleted."
        )

    async def announce(self, found: SetAside) -> None:
        try:
            if found.namespace:
                await self.post_event(found)
            group = found.api_version.partition("/")[0]
            plural = OWN_PLURALS.get(found.kind)
            if group == API_GROUP and plural is not None:
                await self.write_condition(found, plural)
        except Exception as error:  # announcing is best effort; the log line is written
            logger.warning(
                "could not announce the set-aside %s %s: %r", found.kind, found.name, error
            )

    async def post_event(self, found: SetAside) -> None:
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        namespace = urllib.parse.quote(found.namespace, safe="")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": "reservoir-undecodable-", "namespace": found.namespace},
            "involvedObject": {
                "apiVersion": found.api_version,
                "kind": found.kind,
                "name": found.name,
                "namespace": found.namespace,
                "uid": found.uid,
            },
            "type": "Warning",
            "reason": CONDITION,
            "message": self.message(found)[:1024],
            "source": {"component": "reservoir-operator"},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        response = await api.request(
            "post",
            f"/api/v1/namespaces/{namespace}/events",
            payload=event,
            settings=self.settings,
            logger=logger,
        )
        response.close()

    async def write_condition(self, found: SetAside, plural: str) -> None:
        """A merge patch of the status: the object is never read, nor is the answer (the
        whole object again) decoded."""
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        condition: dict[str, str | int] = {
            "type": CONDITION,
            "status": "True",
            "reason": "SetAside",
            "message": self.message(found)[:1024],
            "lastTransitionTime": now,
        }
        if found.generation is not None:
            condition["observedGeneration"] = found.generation
        name = urllib.parse.quote(found.name, safe="")
        where = f"namespaces/{urllib.parse.quote(found.namespace, safe='')}/" * bool(
            found.namespace
        )
        response = await api.request(
            "patch",
            f"/apis/{found.api_version}/{where}{plural}/{name}/status",
            payload={"status": {"conditions": [condition]}},
            headers={"Content-Type": "application/merge-patch+json"},
            settings=self.settings,
            logger=logger,
        )
        response.close()


def _what(resource: Any, namespace: str | None) -> str:
    return f"{watch_list.kind_of(resource)} {f'in {namespace}' if namespace else 'cluster-wide'}"


# A list begins: put in the stream by `continuous_watch` below, before each list kopf
# makes. A BOOKMARK to kopf's own watchers, which pass over those.
LIST_BEGINS = "reservoir.dev/list-begins"


async def serve_informer(
    informer: Informer,
    *,
    namespace: Any,  # kopf's NamespaceName (a str), or None: the whole cluster
    settings: OperatorSettings,
    resource: Any,
    operator_paused: Any = None,
    operator_indexed: Any = None,
    resource_indexed: Any = None,
    **_: Any,
) -> None:
    """kopf's watcher for a kind served by an informer of ours: kopf's watch stream (its
    list, then its watch, each restarted as kopf does), each event into the informer, and
    no per-object worker. The end of the first list releases kopf's hold on the daemons,
    as kopf's own watcher does once a kind's objects are indexed."""
    async for event in watching.infinite_watch(
        settings=settings,
        resource=resource,
        namespace=namespace,
        operator_paused=operator_paused,
    ):
        if event is watching.Bookmark.LISTED:
            informer.listed(namespace)
            if operator_indexed is not None and resource_indexed is not None:
                await operator_indexed.drop_toggle(resource_indexed)
            continue
        if isinstance(event, watching.Bookmark):
            continue
        if event.get("type") == "BOOKMARK":
            if event.get(LIST_BEGINS):
                informer.list_begins(namespace)
            continue
        informer.apply(event, namespace)


async def _set_once_indexed(operator_indexed: Any, indexed: asyncio.Event) -> None:
    await operator_indexed.wait_for(True)
    indexed.set()


def apply(
    health: Health,
    settings: OperatorSettings,
    informers: Mapping[str, Informer] | None = None,
    indexed: asyncio.Event | None = None,
) -> SetAsideReporter:
    """Install the tolerant decoders and the restarting watcher into kopf. Called at
    start-up, before kopf starts its watchers. The kinds in `informers` (by plural and
    group: "branchclaims.reservoir.dev") are served by those, not by kopf's workers.
    `indexed` is set once every kind kopf holds its handlers for has listed (the moment
    kopf's own handlers and daemons start)."""
    served = dict(informers or {})
    lists = watch_list.WatchLists()
    waiting: set[asyncio.Task[None]] = set()
    report = SetAsideReporter(settings)

    async def get_tolerantly(url: str, **kwargs: Any) -> Any:
        """kopf's `api.get`, for its LIST requests, with `decode_list` as the decoder."""
        response = await api.request("get", url, **kwargs)
        async with response:
            body = await response.text()
        return decode_list(body, report)

    # kopf's `fetching` uses only `api.get`; its `api` uses `json` only for watch lines.
    fetching.api = types.SimpleNamespace(get=get_tolerantly)  # type: ignore[attr-defined,assignment]
    api.json = types.SimpleNamespace(  # type: ignore[attr-defined,assignment]
        loads=lambda line: decode_event(line, report), dumps=json.dumps
    )

    async def infinite_watch(**kwargs: Any) -> AsyncIterator[Any]:
        """kopf's watch stream; a complete list means this watch is up (again)."""
        what = _what(kwargs["resource"], kwargs["namespace"])
        received = metrics.watch_events.labels(watch_list.kind_of(kwargs["resource"]))
        async for event in _ORIGINAL_INFINITE_WATCH(**kwargs):
            if event is watching.Bookmark.LISTED:
                health.watch_up(what)
            elif isinstance(event, dict) and event.get("type") != "BOOKMARK":
                received.inc()
            yield event

    async def watcher(**kwargs: Any) -> None:
        """kopf's watcher, started again whenever it fails; down on /readyz meanwhile."""
        what = _what(kwargs["resource"], kwargs["namespace"])
        backoff = 1.0
        informer = served.get(watch_list.kind_of(kwargs["resource"]))
        operator_indexed = kwargs.get("operator_indexed")
        if indexed is not None and not indexed.is_set() and not waiting:
            if operator_indexed is None:
                indexed.set()
            else:
                waiting.add(asyncio.create_task(_set_once_indexed(operator_indexed, indexed)))
        while True:
            try:
                if informer is not None:
                    await serve_informer(informer, **kwargs)
                else:
                    await _ORIGINAL_WATCHER(**kwargs)
                return
            except asyncio.CancelledError:
                raise
            except Exception as error:
                health.watch_down(what, f"{type(error).__name__}: {error}"[:200])
                logger.exception("the watch of %s failed; restarting it in %.0fs", what, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)

    async def continuous_watch(**kwargs: Any) -> AsyncIterator[Any]:
        """kopf's list-then-watch, its list streamed where the API server can (see
        reservoir.watch_list), told apart from the list before it (see LIST_BEGINS)."""
        yield {"type": "BOOKMARK", "object": {"metadata": {}}, LIST_BEGINS: True}
        async for event in watch_list.continuous_watch(lists, _ORIGINAL_CONTINUOUS_WATCH, **kwargs):
            yield event

    watching.continuous_watch = continuous_watch
    watching.infinite_watch = infinite_watch
    queueing.watcher = watcher
    return report
