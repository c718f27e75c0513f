"""The operator's own informer for claims and Leases (reservoir.k8s.informer): it keeps
exactly the latest record of every object the watch says exists, by envelope, whatever
order the events come in; what a new complete list lacks is dropped and its envelope woken
but never reported deleted; it survives an object it cannot take in. Its watcher in kopf's
place (reservoir.kopf_watch.serve_informer), the handlers it calls, and its runner off the
watch's task (reservoir.k8s.per_object)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from reservoir import kopf_watch
from reservoir.handlers.claims import claim_changed, claim_key
from reservoir.handlers.leases import lease_key, renewal_requested
from reservoir.k8s.claim_source import claim_record, lease_record
from reservoir.k8s.informer import UNLISTED, Informer, Key
from reservoir.k8s.per_object import LatestPerObject
from reservoir.k8s.resources import CLAIM_FINALIZER


def claim(
    uid: str, namespace: str = "ns", envelope: str = "wf", version: int = 1
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"c-{uid}",
            "namespace": namespace,
            "uid": uid,
            "resourceVersion": str(version),
            "finalizers": [CLAIM_FINALIZER],
            "ownerReferences": [{"kind": "ReservationEnvelope", "name": envelope}],
        },
        "spec": {"envelope": envelope},
        "status": {"phase": "Tentative"},
    }


class Seen:
    def __init__(self) -> None:
        self.calls: list[tuple[str | None, str]] = []
        self.keys: list[Key] = []

    def __call__(
        self, event: str | None, body: Mapping[str, Any], record: Mapping[str, Any], key: Key
    ) -> None:
        self.calls.append((event, str(record["metadata"]["uid"])))
        self.keys.append(key)


def informer(seen: Seen | None = None) -> Informer:
    return Informer("branchclaims", claim_record, claim_key, seen or Seen())


def uids(found: Any) -> set[str]:
    return {r["metadata"]["uid"] for r in found}


def listing(kept: Informer, scope: str | None, *bodies: dict[str, Any]) -> None:
    """A whole list of `scope`'s watch, as kopf's stream gives it."""
    kept.list_begins(scope)
    for body in bodies:
        kept.apply({"type": None, "object": body}, scope)
    kept.listed(scope)


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
    # A Lease whose envelope label changed (a claim's envelope cannot): kept once, anew.
    kept.apply({"type": "MODIFIED", "object": claim("b", version=3)}, "ns")
    assert uids(kept.get(("ns", "wf"))) == {"a", "b"} and not kept.get(("ns", "other"))
    kept.apply({"type": "DELETED", "object": claim("a", version=4)}, "ns")
    assert uids(kept.get(("ns", "wf"))) == {"b"} and kept.key_of("ns", "c-a") is None
    assert seen.calls == [(None, "a"), ("ADDED", "b"), ("MODIFIED", "a"), ("MODIFIED", "b"),
                          ("DELETED", "a")]  # fmt: skip
    assert len(kept) == 1


def test_a_claim_is_found_by_uid_in_its_own_namespace_only() -> None:
    """A workload pod's label holds its claim's UID (issue 25): the UID finds the claim's
    envelope only from the claim's own namespace (a pod elsewhere labelled with it wakes
    nothing of another tenant)."""
    kept = informer(Seen())
    kept.apply({"type": None, "object": claim("a", namespace="team-a")}, "team-a")
    assert kept.key_of_uid("team-a", "a") == ("team-a", "wf")
    assert kept.key_of_uid("team-b", "a") is None
    assert kept.key_of_uid("team-a", "c-a") is None  # a name is not a UID
    kept.apply({"type": "DELETED", "object": claim("a", namespace="team-a")}, "team-a")
    assert kept.key_of_uid("team-a", "a") is None


def test_a_deletion_the_decoder_cut_down_still_carries_the_last_status() -> None:
    """A DELETED event of an object the decoder set aside brings only its metadata: the
    handler gets the record kept before it (its line and envelope) and where it was."""
    seen: list[tuple[Mapping[str, Any], Key]] = []
    kept = Informer(
        "branchclaims",
        claim_record,
        claim_key,
        lambda e, b, record, key: seen.append((record, key)),
    )
    kept.apply({"type": "ADDED", "object": claim("a")}, "ns")
    stub = {"metadata": {"name": "c-a", "namespace": "ns", "uid": "a", "resourceVersion": "9"}}
    kept.apply({"type": "DELETED", "object": stub}, "ns")
    record, key = seen[-1]
    assert key == ("ns", "wf") and record["status"] == {"phase": "Tentative"}
    assert len(kept) == 0


def test_a_new_list_drops_what_it_lacks_in_its_own_namespace_only() -> None:
    """After a watch expired (410) kopf lists again: a claim deleted meanwhile sent no
    DELETED event. Its record goes and its envelope is woken, but it is not reported
    deleted: a list also lacks what the decoder set aside, which still lives."""
    seen = Seen()
    kept = informer(seen)
    listing(kept, "ns", claim("a"), claim("b"))
    listing(kept, "other", claim("c", "other"))
    seen.calls.clear()
    listing(kept, "ns", claim("b", version=5))  # "a" went unseen
    assert uids(kept.get(("ns", "wf"))) == {"b"}
    assert uids(kept.get(("other", "wf"))) == {"c"}, "another namespace's watch listed it"
    assert (UNLISTED, "a") in seen.calls and seen.keys[-1] == ("ns", "wf")
    # A cluster-wide list answers for every namespace.
    listing(kept, None, claim("b", version=6))
    assert len(kept) == 1 and not kept.get(("other", "wf"))


def test_a_list_cut_off_and_made_again_counts_only_the_second() -> None:
    """Found by review: a list that failed half-way, then made again, was counted with
    the first attempt's objects, so a claim deleted between the two stayed for good."""
    seen = Seen()
    kept = informer(seen)
    listing(kept, "ns", claim("a"), claim("b"))
    kept.list_begins("ns")
    kept.apply({"type": None, "object": claim("a")}, "ns")  # then the connection broke
    listing(kept, "ns", claim("b", version=7))  # "a" was deleted in between
    assert uids(kept.get(("ns", "wf"))) == {"b"} and (UNLISTED, "a") in seen.calls


def test_an_object_it_cannot_take_in_stops_nothing() -> None:
    seen = Seen()
    kept = informer(seen)
    kept.apply({"type": "ADDED", "object": {"metadata": {"name": "no-uid"}}}, "ns")
    kept.apply({"type": "ADDED", "object": "not an object"}, "ns")

    def failing(*_: Any) -> None:
        raise RuntimeError("a handler's bug")

    broken = Informer("branchclaims", claim_record, claim_key, failing)
    broken.apply({"type": "ADDED", "object": claim("x")}, "ns")
    assert uids(broken.get(("ns", "wf"))) == {"x"}, "kept, though its handler failed"
    listing(broken, "ns")
    assert len(broken) == 0
    kept.apply({"type": "ADDED", "object": claim("a")}, "ns")
    assert uids(kept.get(("ns", "wf"))) == {"a"} and seen.calls == [("ADDED", "a")]


events = st.lists(
    st.tuples(
        st.sampled_from(["ADDED", "MODIFIED", "DELETED", "LIST", "BEGIN", "LISTED"]),
        st.sampled_from(["a", "b", "c", "d"]),
        st.sampled_from(["ns", "other"]),
        st.sampled_from(["wf", "wf2"]),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(events)
def test_it_keeps_the_latest_state_of_each_live_object(history: list[Any]) -> None:
    """Over any order of events (a watch per namespace, lists begun again and complete
    or not), the informer holds exactly the objects alive in the latest word on each, as
    last seen: a complete list's word is what it showed since it last began."""
    kept = informer()
    alive: dict[str, tuple[str, str, int]] = {}
    shown: dict[str, set[str]] = {}
    for version, (kind, uid, namespace, envelope) in enumerate(history):
        if uid in alive:
            namespace = alive[uid][0]  # a claim's namespace never changes
        body = claim(uid, namespace, envelope, version)
        if kind == "BEGIN":
            kept.list_begins(namespace)
            shown[namespace] = set()
        elif kind == "LISTED":
            kept.listed(namespace)
            done = shown.pop(namespace, set())
            alive = {u: a for u, a in alive.items() if a[0] != namespace or u in done}
        elif kind == "LIST":  # an object of the list under way
            kept.apply({"type": None, "object": body}, namespace)
            alive[uid] = (namespace, envelope, version)
            shown.setdefault(namespace, set()).add(uid)
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


class Toggles:
    def __init__(self) -> None:
        self.dropped: list[object] = []

    async def drop_toggle(self, toggle: object) -> None:
        self.dropped.append(toggle)


def test_the_watch_feeds_the_informer_and_its_list_releases_the_daemons(
    monkeypatch: Any,
) -> None:
    """kopf's watcher for a served kind: every event into the informer, kopf's bookmarks
    and the API server's BOOKMARK events not, a list's beginning marked, and the end of
    the list drops the kind's hold on the daemons (kopf's resource toggle)."""
    begins = {"type": "BOOKMARK", "object": {"metadata": {}}, kopf_watch.LIST_BEGINS: True}

    async def stream(**kwargs: Any) -> Any:
        assert kwargs["namespace"] == "ns"
        yield begins
        yield {"type": None, "object": claim("a")}
        yield {"type": None, "object": claim("gone")}
        yield begins  # the list was cut off, and is made again
        yield {"type": None, "object": claim("a")}
        yield kopf_watch.watching.Bookmark.LISTED
        yield {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}}
        yield {"type": "ADDED", "object": claim("b")}

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
    assert seen.calls == [(None, "a"), (None, "gone"), (None, "a"), (UNLISTED, "gone"),
                          ("ADDED", "b")]  # fmt: skip
    assert toggles.dropped == [toggle]


def test_each_list_kopf_makes_begins_with_the_marker(monkeypatch: Any) -> None:
    """`apply` puts the marker before every list (each call of kopf's continuous watch,
    streamed or listed in pages: reservoir.watch_list); kopf's own watchers pass over it
    as a BOOKMARK."""

    async def begins(*_: Any, **kwargs: Any) -> Any:
        yield {"type": None, "object": claim("a")}

    monkeypatch.setattr(kopf_watch.watch_list, "continuous_watch", begins)
    monkeypatch.setattr(kopf_watch.watching, "continuous_watch", begins)
    monkeypatch.setattr(kopf_watch.watching, "infinite_watch", kopf_watch.watching.infinite_watch)
    monkeypatch.setattr(kopf_watch.queueing, "watcher", kopf_watch.queueing.watcher)
    monkeypatch.setattr(kopf_watch.api, "json", kopf_watch.api.json)
    monkeypatch.setattr(kopf_watch.fetching, "api", kopf_watch.fetching.api)
    kopf_watch.apply(kopf_watch.Health(), None)  # type: ignore[arg-type]

    async def collect() -> list[Any]:
        return [e async for e in kopf_watch.watching.continuous_watch()]

    first, second = asyncio.run(collect())
    assert first["type"] == "BOOKMARK" and first[kopf_watch.LIST_BEGINS]
    assert second["object"]["metadata"]["uid"] == "a"


class Writer:
    def __init__(self) -> None:
        self.pokes: list[tuple[str, str]] = []
        self.deleted: list[str] = []

    def poke(self, namespace: str, envelope: str) -> None:
        self.pokes.append((namespace, envelope))

    def saw_deleted(self, uid: str, body: Mapping[str, Any]) -> None:
        self.deleted.append(uid)

    def own_write(self, uid: str, version: str) -> bool:
        return False

    def kept(self, namespace: str, envelope: str) -> bool:
        return True


class Services:
    def __init__(self) -> None:
        self.writer = Writer()
        self.submitted: list[str] = []
        self.adoptions = self

    def submit(self, uid: str, *_: Any) -> None:
        self.submitted.append(uid)


def test_a_claim_missing_from_a_list_wakes_its_envelope_and_is_not_called_deleted() -> None:
    """Found by review: a claim the decoder set aside on a new list was reported deleted,
    and the writer then counted it gone without a read."""
    services = Services()
    kept = Informer("branchclaims", claim_record, claim_key, lambda *a: claim_changed(services, *a))  # type: ignore[arg-type]
    listing(kept, "ns", claim("a"))
    listing(kept, "ns")
    assert services.writer.deleted == [] and services.writer.pokes[-1] == ("ns", "wf")
    kept.apply({"type": "ADDED", "object": claim("b")}, "ns")
    kept.apply({"type": "DELETED", "object": claim("b")}, "ns")
    assert services.writer.deleted == ["b"]
    # One made by hand (no owner, no finalizer) is handed over for adoption.
    raw = claim("c")
    raw["metadata"].pop("ownerReferences")
    kept.apply({"type": "ADDED", "object": raw}, "ns")
    assert services.submitted == ["c"]


def test_a_lease_missing_from_a_list_wakes_its_envelope() -> None:
    """Found by review: a Lease's record has no labels, so its envelope was not found."""
    services = Services()
    kept = Informer("leases", lease_record, lease_key, lambda *a: renewal_requested(services, *a))  # type: ignore[arg-type]
    lease = {
        "metadata": {
            "name": "c-a",
            "namespace": "ns",
            "uid": "l-a",
            "resourceVersion": "3",
            "labels": {"reservoir.dev/envelope": "wf"},
        },
        "spec": {"holderIdentity": "w"},
    }
    listing(kept, "ns", lease)
    services.writer.pokes.clear()
    listing(kept, "ns")
    assert services.writer.pokes == [("ns", "wf")]


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
        runner.submit("a", "ns", "a", 1)
        await asyncio.sleep(0.001)  # its run has begun
        for version in (2, 3, 4):  # each replaces the one before, still waiting
            runner.submit("a", "ns", "a", version)
        for uid in "bcd":
            runner.submit(uid, "ns", uid, 1)
        await runner.drained()
        runner.submit("a", "ns", "a", 2)  # fails, logged
        runner.submit("b", "ns", "b", 5)
        await runner.drained()

    asyncio.run(main())
    assert [v for u, v in ran if u == "a"] == [1, 4], "the latest state, the others skipped"
    assert sorted(u for u, v in ran if v == 1) == ["a", "b", "c", "d"]
    assert ("b", 5) in ran
    assert most <= 2, "at most `limit` at once in a namespace"


def test_work_waits_for_start_up_and_one_namespace_never_delays_another() -> None:
    """Found by review: adoption ran before every first list was complete (kopf's own
    handlers wait), and one tenant's slow adoptions held every slot."""
    ready = asyncio.Event()
    finished: dict[str, float] = {}

    async def work(uid: str, seconds: float) -> None:
        await asyncio.sleep(seconds)
        finished[uid] = time.monotonic()

    async def main() -> float:
        runner = LatestPerObject(work, limit=2, ready=ready.wait)
        runner.submit("early", "b", "early", 0.0)
        await asyncio.sleep(0.05)
        assert not finished, "nothing runs before start-up is complete"
        ready.set()
        began = time.monotonic()
        for i in range(20):
            runner.submit(f"a{i}", "a", f"a{i}", 0.2)
        runner.submit("b1", "b", "b1", 0.0)
        await runner.drained()
        return began

    began = asyncio.run(main())
    assert finished["b1"] - began < 0.15, "tenant b waits for none of tenant a's runs"
    assert max(finished.values()) - began >= 1.9, "tenant a: two at a time"
