"""The operator's own informer for claims and Leases (reservoir.k8s.informer): it keeps
exactly the latest record of every object the watch says exists, by envelope, whatever
order the events come in, drops what a new complete list lacks, and survives an object it
cannot take in. And its runner off the watch's task (reservoir.k8s.per_object)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from reservoir import kopf_watch
from reservoir.handlers.claims import claim_key
from reservoir.k8s.claim_source import claim_record
from reservoir.k8s.informer import Informer
from reservoir.k8s.per_object import LatestPerObject


def claim(
    uid: str, namespace: str = "ns", envelope: str = "wf", version: int = 1
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"c-{uid}",
            "namespace": namespace,
            "uid": uid,
            "resourceVersion": str(version),
        },
        "spec": {"envelope": envelope},
    }


class Seen:
    def __init__(self) -> None:
        self.calls: list[tuple[str | None, str]] = []

    def __call__(
        self, event: str | None, body: Mapping[str, Any], record: Mapping[str, Any]
    ) -> None:
        self.calls.append((event, str(record["metadata"]["uid"])))


def informer(seen: Seen | None = None) -> Informer:
    return Informer("branchclaims", claim_record, claim_key, seen or Seen())


def uids(found: Any) -> set[str]:
    return {r["metadata"]["uid"] for r in found}


def test_records_are_kept_by_envelope_and_follow_their_claim() -> None:
    seen = Seen()
    kept = informer(seen)
    kept.apply({"type": None, "object": claim("a")}, "ns")
    kept.apply({"type": "ADDED", "object": claim("b", envelope="other")}, "ns")
    kept.apply({"type": "MODIFIED", "object": claim("a", version=2)}, "ns")
    assert uids(kept.get(("ns", "wf"))) == {"a"}
    [record] = kept.get(("ns", "wf"))
    assert record["metadata"]["resourceVersion"] == "2"
    assert kept.key_of("ns", "c-b") == ("ns", "other")
    # A claim whose envelope changed (its spec is the schema's to guard): kept once, anew.
    kept.apply({"type": "MODIFIED", "object": claim("b", version=3)}, "ns")
    assert uids(kept.get(("ns", "wf"))) == {"a", "b"} and not kept.get(("ns", "other"))
    kept.apply({"type": "DELETED", "object": claim("a", version=4)}, "ns")
    assert uids(kept.get(("ns", "wf"))) == {"b"} and kept.key_of("ns", "c-a") is None
    assert seen.calls == [(None, "a"), ("ADDED", "b"), ("MODIFIED", "a"), ("MODIFIED", "b"),
                          ("DELETED", "a")]  # fmt: skip
    assert len(kept) == 1


def test_a_new_list_drops_what_it_lacks_in_its_own_namespace_only() -> None:
    """After a watch expired (410) kopf lists again: a claim deleted meanwhile sent no
    DELETED event, and the list is the only word that it is gone."""
    seen = Seen()
    kept = informer(seen)
    for uid, namespace in (("a", "ns"), ("b", "ns"), ("c", "other")):
        kept.apply({"type": None, "object": claim(uid, namespace)}, namespace)
    kept.listed("ns")
    kept.listed("other")
    seen.calls.clear()
    kept.apply({"type": None, "object": claim("b", version=5)}, "ns")  # "a" went unseen
    kept.listed("ns")
    assert uids(kept.get(("ns", "wf"))) == {"b"}
    assert uids(kept.get(("other", "wf"))) == {"c"}, "another namespace's watch listed it"
    assert ("DELETED", "a") in seen.calls
    # A cluster-wide list answers for every namespace.
    kept.apply({"type": None, "object": claim("b", version=6)}, None)
    kept.listed(None)
    assert len(kept) == 1 and not kept.get(("other", "wf"))


def test_an_object_it_cannot_take_in_stops_nothing() -> None:
    seen = Seen()
    kept = informer(seen)
    kept.apply({"type": "ADDED", "object": {"metadata": {"name": "no-uid"}}}, "ns")
    kept.apply({"type": "ADDED", "object": "not an object"}, "ns")

    def failing(event: str | None, body: Mapping[str, Any], record: Mapping[str, Any]) -> None:
        raise RuntimeError("a handler's bug")

    broken = Informer("branchclaims", claim_record, claim_key, failing)
    broken.apply({"type": "ADDED", "object": claim("x")}, "ns")
    assert uids(broken.get(("ns", "wf"))) == {"x"}, "kept, though its handler failed"
    kept.apply({"type": "ADDED", "object": claim("a")}, "ns")
    assert uids(kept.get(("ns", "wf"))) == {"a"} and seen.calls == [("ADDED", "a")]


events = st.lists(
    st.tuples(
        st.sampled_from(["ADDED", "MODIFIED", "DELETED", "LIST"]),
        st.sampled_from(["a", "b", "c", "d"]),
        st.sampled_from(["ns", "other"]),
        st.sampled_from(["wf", "wf2"]),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(events)
def test_it_keeps_the_latest_state_of_each_live_object(history: list[Any]) -> None:
    """Over any order of events (a watch per namespace, lists complete or not), the
    informer holds exactly the objects alive in the latest word on each, as last seen."""
    kept = informer()
    alive: dict[str, tuple[str, str, int]] = {}
    listing: dict[str, set[str]] = {}
    for version, (kind, uid, namespace, envelope) in enumerate(history):
        if uid in alive:
            namespace = alive[uid][0]  # a claim's namespace never changes
        body = claim(uid, namespace, envelope, version)
        if kind == "LIST":  # an object of a new list, then (half the time) its end
            kept.apply({"type": None, "object": body}, namespace)
            alive[uid] = (namespace, envelope, version)
            listing.setdefault(namespace, set()).add(uid)
            if version % 2:
                kept.listed(namespace)
                done = listing.pop(namespace)
                alive = {u: a for u, a in alive.items() if a[0] != namespace or u in done}
        elif kind == "DELETED":
            kept.apply({"type": kind, "object": body}, namespace)
            alive.pop(uid, None)
        else:
            kept.apply({"type": kind, "object": body}, namespace)
            alive[uid] = (namespace, envelope, version)
    assert len(kept) == len(alive)
    for uid, (namespace, envelope, version) in alive.items():
        records = {r["metadata"]["uid"]: r for r in kept.get((namespace, envelope))}
        assert records[uid]["metadata"]["resourceVersion"] == str(version)
        assert kept.key_of(namespace, f"c-{uid}") == (namespace, envelope)


def test_the_watch_feeds_the_informer_and_its_list_releases_the_daemons(
    monkeypatch: Any,
) -> None:
    """kopf's watcher for a served kind: every event into the informer, kopf's bookmarks
    and the API server's BOOKMARK events not, and the end of the list drops the kind's
    hold on the daemons (kopf's resource toggle)."""

    async def stream(**kwargs: Any) -> Any:
        assert kwargs["namespace"] == "ns"
        yield {"type": None, "object": claim("a")}
        yield kopf_watch.watching.Bookmark.LISTED
        yield {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}}
        yield {"type": "ADDED", "object": claim("b")}

    class Toggles:
        def __init__(self) -> None:
            self.dropped: list[object] = []

        async def drop_toggle(self, toggle: object) -> None:
            self.dropped.append(toggle)

    monkeypatch.setattr(kopf_watch.watching, "infinite_watch", stream)
    seen = Seen()
    kept = informer(seen)
    toggles, toggle = Toggles(), object()
    asyncio.run(
        kopf_watch.serve_informer(
            kept,
            namespace="ns",
            settings=None,
            resource=None,
            operator_indexed=toggles,
            resource_indexed=toggle,
        )
    )
    assert seen.calls == [(None, "a"), ("ADDED", "b")]
    assert toggles.dropped == [toggle]


def test_work_per_object_runs_once_at_a_time_on_the_latest_state() -> None:
    ran: list[tuple[str, int]] = []
    running: set[str] = set()
    most = 0

    async def work(uid: str, version: int) -> None:
        nonlocal most
        assert uid not in running, "one run at a time per object"
        running.add(uid)
        most = max(most, len(running))
        await asyncio.sleep(0.01)
        running.discard(uid)
        if version == 2:
            raise RuntimeError("fails: the next state submitted runs all the same")
        ran.append((uid, version))

    async def main() -> None:
        runner = LatestPerObject(work, limit=2)
        runner.submit("a", "a", 1)
        await asyncio.sleep(0.001)  # its run has begun
        for version in (2, 3, 4):  # each replaces the one before, still waiting
            runner.submit("a", "a", version)
        for uid in "bcd":
            runner.submit(uid, uid, 1)
        await runner.drained()
        runner.submit("a", "a", 2)  # fails, logged
        runner.submit("b", "b", 5)
        await runner.drained()

    asyncio.run(main())
    assert [v for u, v in ran if u == "a"] == [1, 4], "the latest state, the others skipped"
    assert sorted(u for u, v in ran if v == 1) == ["a", "b", "c", "d"]
    assert ("b", 5) in ran
    assert most <= 2, "at most `limit` at once"
