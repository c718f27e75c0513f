"""What the operator keeps of each live claim (its index record, DESIGN.md §1.6 and §1.7):
every fact a decision reads, and nothing a tenant can make large beyond the schema's
bounds. A claim with a megabyte of placement hints costs a few KB in the index, and its
record gives exactly the facts the whole object gives."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import Any

from reservoir.handlers.claims import adoption_view, claim_key
from reservoir.handlers.leases import lease_key
from reservoir.k8s import claim_source
from reservoir.k8s import facts as read
from reservoir.k8s.claim_source import (
    SHARED_STRING_LENGTH,
    SHARED_STRINGS,
    claim_record,
    lease_record,
    share_strings,
)
from reservoir.k8s.informer import Informer, Key
from reservoir.k8s.resources import CLAIM_FINALIZER, FORCE_SETTLE_ANNOTATION

MEGABYTE = 1_000_000
RECORD_BOUND = 8 * 1024  # bytes: a few KB, whatever the object's size
AT = "2026-12-01T10:00:00Z"


def deep_size(value: Any, seen: set[int] | None = None) -> int:
    """Bytes of every object reachable from `value` (each counted once)."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return 0
    seen.add(id(value))
    size = sys.getsizeof(value)
    if isinstance(value, dict):
        size += sum(deep_size(k, seen) + deep_size(v, seen) for k, v in value.items())
    elif isinstance(value, list | tuple | set | frozenset):
        size += sum(deep_size(item, seen) for item in value)
    for slot in getattr(type(value), "__slots__", ()):  # a ClaimRecord's parts
        size += deep_size(getattr(value, slot, None), seen)
    return size


def affinity(size: int) -> dict[str, Any]:
    """A node affinity of about `size` bytes of JSON."""
    expressions = [
        {"key": f"k{i:07d}", "operator": "In", "values": [f"v{i:07d}"]} for i in range(size // 50)
    ]
    required = {"nodeSelectorTerms": [{"matchExpressions": expressions}]}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}


def claim(placement: dict[str, Any] | None = None, **meta: Any) -> dict[str, Any]:
    """A claim as the watch delivers it (parsed from JSON)."""
    spec: dict[str, Any] = {
        "envelope": "wf",
        "requests": {"tokens": "20"},
        "commitPoint": "Dispatch",
        "dispatch": True,
        "usage": {"tokens": "12"},
        "final": True,
        "outcome": "Succeeded",
        "upstream": {"requestId": "r-1"},
    }
    if placement is not None:
        spec["placement"] = placement
    body = {
        "apiVersion": "reservoir.dev/v1alpha1",
        "kind": "BranchClaim",
        "metadata": {
            "name": "c",
            "namespace": "ns",
            "uid": "u-1",
            "resourceVersion": "7",
            "generation": 2,
            "creationTimestamp": AT,
            "labels": {"team": "x" * 60},
            "annotations": {"note": "y" * (MEGABYTE // 4)},
            "ownerReferences": [{"kind": "ReservationEnvelope", "name": "wf", "uid": "e"}],
            "managedFields": [{"manager": "sdk", "fieldsV1": {"f:spec": {}}}],
            **meta,
        },
        "spec": spec,
        "status": {
            "phase": "Committed",
            "reserved": {"tokens": "20"},
            "history": [
                {
                    "from": "Pending",
                    "to": "Tentative",
                    "reason": "Admitted",
                    "trigger": "Admission",
                    "at": AT,
                },
                {
                    "from": "Tentative",
                    "to": "Committed",
                    "reason": "Dispatched",
                    "trigger": "Worker",
                    "at": AT,
                },
            ],
        },
    }
    parsed: dict[str, Any] = json.loads(json.dumps(body))
    return parsed


def lease() -> dict[str, Any]:
    return {
        "metadata": {
            "name": "c",
            "namespace": "ns",
            "uid": "l-1",
            "resourceVersion": "9",
            "labels": {"reservoir.dev/envelope": "wf"},
            "annotations": {"note": "z" * MEGABYTE},
        },
        "spec": {"holderIdentity": "w-1", "renewTime": AT, "leaseTransitions": 2},
    }


def kept_by(informer: Informer, body: dict[str, Any], key: Key) -> dict[str, Any]:
    """The record an informer keeps of `body`, taken in as the watch delivers it."""
    informer.apply({"type": "ADDED", "object": json.loads(json.dumps(body))}, None)
    [record] = informer.get(key)
    return record


def indexed_claim(body: dict[str, Any]) -> dict[str, Any]:
    """The record the operator's claim informer keeps, as it keeps it."""
    informer = Informer("branchclaims", claim_record, claim_key, lambda *_: None)
    return kept_by(informer, body, claim_key(body))


def indexed_lease(body: dict[str, Any]) -> dict[str, Any]:
    informer = Informer("leases", lease_record, lease_key, lambda *_: None)
    return kept_by(informer, body, lease_key(body))


def test_a_claim_with_a_megabyte_of_placement_hints_is_kept_in_a_few_kilobytes() -> None:
    hints = {
        "nodeSelector": {"pool": "gpu"},
        "tolerations": [{"key": f"t{i}", "operator": "Exists"} for i in range(32)],
        "affinity": affinity(MEGABYTE),
    }
    body = claim(hints)
    assert len(json.dumps(body)) > MEGABYTE
    assert deep_size(body) > 100 * RECORD_BOUND  # the whole object, as parsed
    record = indexed_claim(body)
    assert deep_size(record) < RECORD_BOUND
    # The writer's parsed facts (kept from pass to pass) hold no hint either.
    facts = read.claim_facts(record, None)
    assert isinstance(facts, read.ClaimFacts) and facts.spec.placement is None


def test_a_lease_with_a_megabyte_of_annotations_is_kept_in_a_few_kilobytes() -> None:
    assert deep_size(indexed_lease(lease())) < RECORD_BOUND // 4


def test_a_claim_waiting_for_adoption_keeps_no_megabyte() -> None:
    """A claim made without the SDK waits for `adopt` off the watch's task, with what
    `adopt` reads of it: never its hints or annotations."""
    body = claim(
        {"affinity": affinity(MEGABYTE)},
        finalizers=["other.example/keep"],
        annotations={FORCE_SETTLE_ANNOTATION: "node lost", "note": "n" * MEGABYTE},
    )
    view = adoption_view(body)
    assert deep_size(view) < RECORD_BOUND // 4
    meta = view["metadata"]
    assert meta["finalizers"] == ["other.example/keep"] and meta["ownerReferences"]
    assert meta["name"] == "c" and meta["resourceVersion"] == body["metadata"]["resourceVersion"]


def test_a_record_gives_the_same_facts_as_the_whole_claim() -> None:
    """Every fact a decision reads survives: identity, versions, deletion, the force-settle
    annotation, the settlement its status records, the Lease's renewal."""
    body = claim(
        {"nodeSelector": {"pool": "gpu"}, "affinity": affinity(200)},
        deletionTimestamp=AT,
        finalizers=["other.example/keep", CLAIM_FINALIZER, "late.example/f"],
        annotations={FORCE_SETTLE_ANNOTATION: "node lost", "note": "n"},
    )
    body["status"] = {
        "phase": "Consumed",
        "reserved": {"tokens": "20"},
        "consumed": {"tokens": "12"},
        "released": {"tokens": "8"},
        "history": [
            {
                "from": "Pending",
                "to": "Tentative",
                "reason": "Admitted",
                "trigger": "Admission",
                "at": AT,
            },
            {
                "from": "Tentative",
                "to": "Consumed",
                "reason": "Reported",
                "trigger": "Worker",
                "at": AT,
            },
        ],
        "settlement": {"key": "u-1/1/1", "phase": "Consumed", "reason": "Reported", "at": AT},
    }
    whole = read.claim_facts(body, lease())
    kept = read.claim_facts(indexed_claim(body), indexed_lease(lease()))
    assert isinstance(whole, read.ClaimFacts) and isinstance(kept, read.ClaimFacts)
    assert whole.spec.placement is not None and kept.spec.placement is None
    assert kept == replace(whole, spec=whole.spec.model_copy(update={"placement": None}))
    assert kept.force_settle == "node lost" and kept.deleting
    assert kept.settled_record is not None and kept.heartbeat is not None
    record = indexed_claim(body)
    # The finalizer is removed by its position, tested first (remove_finalizer).
    assert record["metadata"]["finalizers"] == ["other.example/keep", CLAIM_FINALIZER]
    assert record["status"] == body["status"]  # a status write is a compare-and-swap on it
    assert claim_record(record) == record


def test_unreadable_placement_hints_are_a_problem_of_the_record_too() -> None:
    """Hints the operator cannot read keep the claim waiting (InvalidSpec), as when the
    whole object is read: the record keeps why, not the hints."""
    body = claim({"affinity": "not an object", "tolerations": [{"key": "t"}]})
    whole = read.claim_facts(body, None)
    record = claim_record(body)
    kept = read.claim_facts(record, None)
    assert isinstance(whole, read.ClaimFacts) and isinstance(kept, read.ClaimFacts)
    assert whole.problem is not None and "placement.affinity" in whole.problem
    assert kept.problem == whole.problem
    assert claim_record(record) == record  # a record of a record keeps the problem


def test_a_lease_record_keeps_what_a_renewal_reads() -> None:
    record = lease_record(lease())
    assert read.heartbeat_token(record) == read.heartbeat_token(lease())
    assert read.heartbeat_holder(record) == "w-1"
    assert record["metadata"]["resourceVersion"] == "9"


def test_a_record_reads_as_the_claim_and_keeps_its_spec_and_status_as_json() -> None:
    body = claim()
    record = claim_record(body)
    expected = {k: v for k, v in body.items() if k != "metadata"}
    assert {k: v for k, v in record.items() if k != "metadata"} == expected
    assert list(record) == ["apiVersion", "kind", "metadata", "spec", "status"]
    assert len(record) == 5 and "status" in record and "deletionTimestamp" not in record
    assert record.get("placementProblem") is None and "placementProblem" not in record
    # Kept as compact JSON: each read is a fresh copy, so no reader can change the record.
    assert type(record._spec) is bytes and type(record._status) is bytes
    assert record["status"] is not record["status"]
    record["status"]["phase"] = "Released"
    assert record["status"]["phase"] == "Committed"
    assert json.dumps(dict(record)) == json.dumps(dict(claim_record(claim())))
    assert deep_size(record) < deep_size({k: v for k, v in body.items() if k != "metadata"})


def test_what_json_cannot_carry_exactly_is_kept_as_it_came() -> None:
    """The watch's fallback decoder reads an integer past 64 bits, a NaN, a lone
    surrogate: orjson refuses the first and last and writes a NaN as null. Such a part is
    kept as it is, never changed."""
    for odd in (2**70, float("nan"), "\ud800", {1: "a key not a string"}):
        body = claim()
        body["status"]["odd"] = odd
        record = claim_record(body)
        assert type(record._status) is dict
        assert record["status"] is body["status"]
        assert type(record._spec) is bytes and record["spec"] == body["spec"]
    body = claim()
    body["spec"] = "not an object"  # read as unreadable, as before
    assert claim_record(body)["spec"] == "not an object"
    del body["status"]
    assert "status" not in claim_record(body) and claim_record(body).get("status") is None


def test_lease_records_share_their_short_strings() -> None:
    one, other = lease_record(lease()), lease_record(lease())
    at_one = one["spec"]["renewTime"]
    assert at_one == AT and at_one is other["spec"]["renewTime"]


def test_long_strings_and_metadata_are_kept_as_they_came() -> None:
    long_text = "m" * (SHARED_STRING_LENGTH + 1)
    finalizer = "".join(["example.com/", "f"])
    record = share_strings({"metadata": {"finalizers": [finalizer]}, "status": {"m": long_text}})
    assert record["status"]["m"] is long_text
    assert record["metadata"]["finalizers"][0] is finalizer  # a tenant's list: not walked


def test_the_shared_strings_are_bounded() -> None:
    for i in range(SHARED_STRINGS + 10):
        share_strings({"status": {"at": f"2026-12-04T00:00:00.{i:06d}Z"}})
    assert len(claim_source._shared) <= SHARED_STRINGS
    common = share_strings({"status": {"phase": "".join(["Tent", "ative"])}})["status"]["phase"]
    again = share_strings({"status": {"phase": "".join(["Tent", "ative"])}})["status"]["phase"]
    assert again is common


def test_sharing_strings_walks_any_depth_without_recursion() -> None:
    shared = share_strings({"status": {"x": "".join(["deep", "-", "leaf"])}})["status"]["x"]
    leaf = "".join(["deep", "-", "leaf"])  # another copy, made at run time
    assert leaf is not shared
    deep: Any = leaf
    for level in range(10_000):
        deep = [deep] if level % 2 else {"k": deep}
    share_strings({"spec": deep})
    while not isinstance(deep, str):
        deep = deep[0] if isinstance(deep, list) else deep["k"]
    assert deep is shared


def test_the_commit_point_is_read_without_decoding(monkeypatch: Any) -> None:
    """Every pass reads every claim's commit point (whether to list workload pods): kept
    as it is, so a pass over 10,000 records decodes no spec (found by review: 265 ms a
    pass with specs at the schema's bounds)."""
    body = claim()
    body["spec"]["commitPoint"] = "PodRunning"
    record, plain = claim_record(body), claim_record(claim())

    def refuse(value: Any) -> Any:
        raise AssertionError("decoded")

    monkeypatch.setattr(claim_source, "unpacked", refuse)
    assert claim_source.commit_point(record) == "PodRunning"
    assert claim_source.commit_point(plain) == "Dispatch"
    assert claim_source.commit_point({"spec": {"commitPoint": "PodScheduled"}}) == "PodScheduled"
    assert claim_source.commit_point({"spec": "not an object"}) == "Dispatch"
