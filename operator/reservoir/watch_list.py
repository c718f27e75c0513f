"""A watch that begins with the API server streaming every object (a "watch-list",
KEP-3157), where kopf lists in pages.

Why: at 100,000 claims a restart's first list was 2,002 pages of 50, one after the other:
the API server answered a page while the operator waited, then the operator took it in
while the API server waited (84 of the 94 s from a restart to its first ledger write). A
watch with `sendInitialEvents=true` sends every object as an event from the API server's
watch cache, then a BOOKMARK annotated `k8s.io/initial-events-end` at the resourceVersion
of that state, and goes on as the watch: both sides work at once on one stream, and no
page of objects is held whole on either side. client-go's informers do the same.

`continuous_watch` takes the place of kopf's (see `kopf_watch.apply`) and yields what
kopf's does: each object of the initial state as an event of type None, then
`Bookmark.LISTED`, then the watch's events, resumed after a disconnect from the last
resourceVersion seen, and ended on "410 Gone" (kopf's `infinite_watch` starts it again).
It lists in pages, as kopf does, instead:
- for every kind, once the API server refuses the parameters (400 or 422: a server before
  Kubernetes 1.32, or 1.33, whose WatchList gate is off by default);
- for one kind's watch, once its initial stream ended before its end bookmark (the
  server's watch timeout cut it, the connection dropped);
each for RETRY_STREAMING_SECONDS, after which the next initial state is streamed again.
The initial events carry each object's own resourceVersion, in no order: the watch
resumes only from the end bookmark's, and an initial stream cut short is never resumed
(a resume from one object's version could skip objects not yet sent).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from kopf._cogs.clients import errors, watching
from kopf._cogs.configs.configuration import OperatorSettings

from reservoir import metrics

logger = logging.getLogger(__name__)

END_ANNOTATION = "k8s.io/initial-events-end"
# What a server that cannot stream the initial state answers (the parameters are invalid).
REFUSED = frozenset({400, 422})
EVENT_TYPES = frozenset({"ADDED", "MODIFIED", "DELETED", "BOOKMARK"})
RETRY_STREAMING_SECONDS = 600.0

ListedWatch = Callable[..., AsyncIterator[Any]]  # kopf's continuous_watch


@dataclasses.dataclass
class WatchLists:
    """Whether the API server streams initial states, and the watches that list instead.
    Either lists for RETRY_STREAMING_SECONDS, then tries a stream again (a control plane
    upgraded since, or an older replica that answered once during an upgrade)."""

    clock: Callable[[], float] = time.monotonic
    refused_at: float | None = None
    cut_at: dict[tuple[str, str | None], float] = dataclasses.field(default_factory=dict)

    def streams(self, resource: Any, namespace: str | None) -> bool:
        now = self.clock()
        if self.refused_at is not None and now - self.refused_at < RETRY_STREAMING_SECONDS:
            return False
        cut = self.cut_at.get((kind_of(resource), namespace))
        return cut is None or now - cut >= RETRY_STREAMING_SECONDS

    def refused(self, error: errors.APIError) -> None:
        self.refused_at = self.clock()
        logger.info(
            "the API server does not stream initial states (%s %s): listing in pages",
            error.status,
            str(error)[:200],
        )

    def cut_short(self, resource: Any, namespace: str | None) -> None:
        self.cut_at[(kind_of(resource), namespace)] = self.clock()
        logger.warning(
            "the initial stream of %s %s ended before its end: that watch lists in pages "
            "for a while",
            kind_of(resource),
            f"in {namespace}" if namespace else "cluster-wide",
        )


def kind_of(resource: Any) -> str:
    """A kopf resource as `plural.group` (`core` for the core group)."""
    return f"{resource.plural}.{resource.group or 'core'}"


def streaming(settings: OperatorSettings) -> OperatorSettings:
    """`settings` for a watch that asks for the initial state (kopf's `watch_objs` adds
    `sendInitialEvents` and `resourceVersionMatch` to a watch with no resourceVersion)."""
    return dataclasses.replace(
        settings, watching=dataclasses.replace(settings.watching, initial_streaming=True)
    )


def _ends_initial_events(body: Mapping[str, Any]) -> bool:
    meta = body.get("metadata") or {}
    return bool((meta.get("annotations") or {}).get(END_ANNOTATION) == "true")


async def continuous_watch(
    state: WatchLists,
    listed_watch: ListedWatch,
    *,
    settings: OperatorSettings,
    resource: Any,
    namespace: Any,
    operator_pause_waiter: Any,
) -> AsyncIterator[Any]:
    """kopf's list-then-watch, the list streamed where the server can (see the module)."""
    listed = metrics.initial_states.labels(kind_of(resource), "listed")
    if not state.streams(resource, namespace):
        async for event in listed_watch(
            settings=settings,
            resource=resource,
            namespace=namespace,
            operator_pause_waiter=operator_pause_waiter,
        ):
            if event is watching.Bookmark.LISTED:
                listed.inc()
            yield event
        return
    streamed = metrics.initial_states.labels(kind_of(resource), "streamed")
    since: str | None = None  # None until the initial state is complete
    initial = streaming(settings)
    while not operator_pause_waiter.done():
        stream = watching.watch_objs(
            settings=initial if since is None else settings,
            resource=resource,
            namespace=namespace,
            since=since,
            operator_pause_waiter=operator_pause_waiter,
        )
        try:
            async for event in stream:
                kind, body = event["type"], event["object"]
                if kind == "ERROR":
                    if body.get("code") == 410:  # too old: kopf's infinite_watch starts again
                        if since is None:  # (in the initial state: a stream cut short)
                            state.cut_short(resource, namespace)
                        return
                    raise watching.WatchingError(f"Error in the watch-stream: {body}")
                if kind not in EVENT_TYPES:
                    logger.warning("ignoring an unsupported event type: %r", kind)
                    continue
                if since is None:
                    # The initial state: ended by its bookmark only (another bookmark, such
                    # as the decoder's stand-in for an object it set aside, does not end it).
                    if kind == "BOOKMARK":
                        if _ends_initial_events(body):
                            since = str(body["metadata"]["resourceVersion"])
                            streamed.inc()
                            yield watching.Bookmark.LISTED
                        continue
                    yield {"type": None, "object": body} if kind == "ADDED" else event
                    continue
                since = (body.get("metadata") or {}).get("resourceVersion") or since
                yield event
        except errors.APIClientError as error:
            if since is None and error.status in REFUSED:
                state.refused(error)
                return  # kopf's infinite_watch starts again, and that watch lists
            raise
        if since is None:
            if not operator_pause_waiter.done():
                state.cut_short(resource, namespace)
            return
