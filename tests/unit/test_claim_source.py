"""The watch-fed claim source: the writer's own writes laid over a lagging index."""

from __future__ import annotations

import asyncio
from typing import Any

from reservoir.k8s.claim_source import WatchedClaims, claim_record, forget_older


def claim(uid: str, version: str, phase: str | None = None) -> dict[str, Any]:
    return {
        "metadata": {
            "uid": uid,
            "name": f"c-{uid}",
            "resourceVersion": version,
            "managedFields": [{"manager": "x"}],
        },
        "spec": {"envelope": "wf"},
        "status": {"phase": phase} if phase else {},
    }


def read(source: WatchedClaims) -> list[dict[str, Any]]:
    return asyncio.run(source.claims("ns", "wf"))


def test_an_own_write_is_read_until_the_watch_delivers_it_or_anything_newer() -> None:
    index: dict[tuple[str, str], list[dict[str, Any]]] = {("ns", "wf"): [claim("a", "1")]}
    source = WatchedClaims(index, {})
    source.written(claim("a", "1"), claim("a", "2", "Tentative"))
    assert [c["metadata"]["resourceVersion"] for c in read(source)] == ["2"]
    index[("ns", "wf")] = [claim("a", "3", "Committed")]  # the watch moved past it
    assert [c["status"] for c in read(source)] == [{"phase": "Committed"}]
    index[("ns", "wf")] = [claim("a", "1")]  # never again laid over once dropped
    assert [c["metadata"]["resourceVersion"] for c in read(source)] == ["1"]


def test_own_write_is_recognised_once_and_a_fresh_read_is_never_own() -> None:
    source = WatchedClaims({}, {})
    source.written(claim("a", "1"), claim("a", "2"))
    source.written(claim("b", "1"), claim("b", "5"), own=False)
    assert source.own_write("a", "2")
    assert not source.own_write("a", "2")
    assert not source.own_write("b", "5"), "someone else's change, read fresh: news"
    assert not source.own_write("a", "3")


def test_a_write_that_changed_nothing_is_not_laid_over() -> None:
    index = {("ns", "wf"): [claim("a", "1", "Pending")]}
    source = WatchedClaims(index, {})
    source.written(claim("a", "1"), claim("a", "1", "Tentative"))
    assert [c["status"] for c in read(source)] == [{"phase": "Pending"}]
    assert not source.own_write("a", "1")


def test_the_index_keeps_no_managed_fields() -> None:
    kept = claim_record(claim("a", "1"))
    assert "managedFields" not in kept["metadata"]
    assert kept["metadata"]["uid"] == "a" and kept["spec"] == {"envelope": "wf"}


def test_leases_are_read_by_name() -> None:
    lease = {"metadata": {"name": "c-a", "resourceVersion": "7"}, "spec": {}}
    source = WatchedClaims({}, {("ns", "wf"): [lease]})
    assert asyncio.run(source.leases("ns", "wf")) == {"c-a": lease}
    assert asyncio.run(source.leases("ns", "other")) == {}


def test_a_deletion_the_watch_delivered_is_remembered_and_drops_the_overlay() -> None:
    index: dict[tuple[str, str], list[dict[str, Any]]] = {("ns", "wf"): [claim("a", "1")]}
    source = WatchedClaims(index, {})
    source.written(claim("a", "1"), claim("a", "2"))
    assert not source.deleted("a")
    source.saw_deleted("a")
    assert source.deleted("a")
    assert not source.own_write("a", "2"), "a deleted claim's old write is no news either way"
    assert [c["metadata"]["resourceVersion"] for c in read(source)] == ["1"]


def test_writes_in_a_row_keep_the_overlay_until_the_watch_passes_all_of_them() -> None:
    """Found by review: after two writes in a row the overlay was dropped as soon as the
    index moved to the first write, showing an older status than the writer's last."""
    index: dict[tuple[str, str], list[dict[str, Any]]] = {("ns", "wf"): [claim("a", "1")]}
    source = WatchedClaims(index, {})
    source.written(claim("a", "1"), claim("a", "2", "Tentative"))
    source.written(claim("a", "2", "Tentative"), claim("a", "3", "Expired"))
    assert [c["status"] for c in read(source)] == [{"phase": "Expired"}]
    index[("ns", "wf")] = [claim("a", "2", "Tentative")]  # the watch delivers the first
    assert [c["status"] for c in read(source)] == [{"phase": "Expired"}]
    index[("ns", "wf")] = [claim("a", "3", "Expired")]
    assert [c["metadata"]["resourceVersion"] for c in read(source)] == ["3"]


def test_old_deletions_are_forgotten_from_the_front() -> None:
    seen = {"a": 1.0, "b": 2.0, "c": 3.0}
    forget_older(seen, 2.5)
    assert seen == {"c": 3.0}
    forget_older(seen, 10.0)
    assert seen == {}


def test_a_version_written_by_another_before_ours_keeps_the_overlay() -> None:
    """We wrote a status over version 10; the SDK had written version 11 (a spec write)
    meanwhile, and our write is 12: the watch delivering 11 (still the status we
    replaced) is behind our write, not past it (found by the benchmark: the next status
    write tested a status older than our own and was refused)."""
    index: dict[tuple[str, str], list[dict[str, Any]]] = {("ns", "wf"): [claim("a", "10")]}
    source = WatchedClaims(index, {})
    source.written(claim("a", "10"), claim("a", "12", "Tentative"))
    index[("ns", "wf")] = [claim("a", "11")]
    assert [c["metadata"]["resourceVersion"] for c in read(source)] == ["12"]
    source.written(claim("a", "12", "Tentative"), claim("a", "14", "Committed"))
    index[("ns", "wf")] = [claim("a", "13", "Tentative")]  # a spec write after our first
    assert [c["metadata"]["resourceVersion"] for c in read(source)] == ["14"]
    index[("ns", "wf")] = [claim("a", "11")]  # before both of ours
    assert [c["metadata"]["resourceVersion"] for c in read(source)] == ["14"]
    index[("ns", "wf")] = [claim("a", "15", "Committed")]  # past ours: it shows our status
    assert [c["metadata"]["resourceVersion"] for c in read(source)] == ["15"]


def test_a_fresh_read_keeps_no_version_the_watch_delivers_behind_it() -> None:
    """A claim read fresh (not our write) is laid over only the versions it supersedes:
    any other version the watch delivers replaces it (equality only, never an order)."""
    index: dict[tuple[str, str], list[dict[str, Any]]] = {("ns", "wf"): [claim("a", "10")]}
    source = WatchedClaims(index, {})
    source.written(claim("a", "10"), claim("a", "12", "Tentative"), own=False)
    index[("ns", "wf")] = [claim("a", "11")]
    assert [c["metadata"]["resourceVersion"] for c in read(source)] == ["11"]
