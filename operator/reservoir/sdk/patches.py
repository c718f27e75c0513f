"""The SDK's writes on a claim as JSON patches that carry their own preconditions (pure).

A verb reads at most the claim, decides on it, and sends one JSON patch to the claim's main
resource whose `test` operations say what the decision relied on: the claim's UID and
`metadata.generation` (its spec and its deletion, which move the generation), and the fields
of the claim's record it read (its phase, its settlement, its lease's end). The API server
applies the whole patch to the whole object, status included, before it drops what a write
to the main resource may not change: a `test` of a `/status/...` path is checked against the
status as stored (tests/integration/test_sdk_requests.py shows it on a real API server), so
a decision taken on a view that is no longer current is refused with 422 and never applied.

The claim's record is `status.ledger` (its line of the ledger, a LedgerEntry) when the claim
carries one, else the status mirror (`status.phase`, `status.settlement`,
`status.lease.expiresAt`). A patch decided on the mirror also tests that no `status.ledger`
has appeared meanwhile, so it is never applied over a record it did not read.

The API server takes a `test` of null to match a missing member (not a missing parent):
`record_tests` tests the first missing ancestor of a path for null, which `failed_tests`
(the same comparison, run locally on the claim read again) agrees with.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Patch = list[dict[str, Any]]

# The record's fields a verb may rely on, as LedgerEntry spells them in `status.ledger`, and
# where the status mirror keeps each.
PHASE = "phase"
SETTLEMENT = "settlement"
EXPIRES_AT = "expiresAt"
MIRROR_PATHS = {PHASE: ("phase",), SETTLEMENT: ("settlement",), EXPIRES_AT: ("lease", "expiresAt")}
LEDGER_FIELD = "ledger"

# What each verb relies on in the claim's record. Dispatch: the claim still holds capacity
# (Tentative) on the lease it checked; the others: the claim has not settled since, which
# its settlement alone says (the operator records it in the same write as the terminal
# phase, reservoir.core.lifecycle.settle): testing the phase too refused every report made
# on a view older than the claim's commit, a 422 and a read again per claim for nothing.
DISPATCH_RELIES_ON = (PHASE, SETTLEMENT, EXPIRES_AT)
UNSETTLED = (SETTLEMENT,)

_MISSING = object()


def pointer(segments: Iterable[str]) -> str:
    """A JSON pointer (RFC 6901) of `segments`: "nvidia.com/gpu" is "nvidia.com~1gpu"."""
    return "".join("/" + segment.replace("~", "~0").replace("/", "~1") for segment in segments)


def segments_of(path: str) -> list[str]:
    if not path:
        return []
    return [part.replace("~1", "/").replace("~0", "~") for part in path.split("/")[1:]]


def expect(path: Sequence[str], value: Any) -> dict[str, Any]:
    """A JSON-patch `test` operation: `path` holds `value` (null: is missing)."""
    return {"op": "test", "path": pointer(path), "value": value}


def _lookup(obj: Any, segments: Sequence[str]) -> Any:
    """The value at `segments` in `obj`, or _MISSING (a list index is a decimal)."""
    current = obj
    for segment in segments:
        if isinstance(current, Mapping) and segment in current:
            current = current[segment]
        elif isinstance(current, list) and segment.isdigit() and int(segment) < len(current):
            current = current[int(segment)]
        else:
            return _MISSING
    return current


def expect_as_read(obj: Mapping[str, Any], path: Sequence[str]) -> dict[str, Any]:
    """A test that `path` in the object still holds what it holds in `obj`: its value, or,
    where it is missing, null at its first missing segment (its parent exists there)."""
    for depth in range(1, len(path) + 1):
        if _lookup(obj, path[:depth]) is _MISSING:
            return expect(path[:depth], None)
    return expect(path, _lookup(obj, path))


def identity_tests(obj: Mapping[str, Any]) -> Patch:
    """The claim is the one read (UID) and its spec and deletion are as read (generation,
    which the operator's status writes do not move)."""
    meta = obj["metadata"]
    return [
        expect(("metadata", "uid"), meta["uid"]),
        expect(("metadata", "generation"), int(meta.get("generation") or 0)),
    ]


def record_of(obj: Mapping[str, Any]) -> tuple[tuple[str, ...], bool]:
    """Where the claim's record is in `obj`: ("status", "ledger") and True when it carries
    its ledger line, else ("status",) and False (the status mirror)."""
    status = obj.get("status")
    if isinstance(status, Mapping) and status.get(LEDGER_FIELD) is not None:
        return ("status", LEDGER_FIELD), True
    return ("status",), False


def record_tests(obj: Mapping[str, Any], fields: Iterable[str]) -> Patch:
    """Tests that the claim's record still shows `fields` as `obj` shows them (none when
    the decision relied on no field of it)."""
    fields = list(fields)
    if not fields:
        return []
    base, ledger = record_of(obj)
    tests: Patch = []
    if not ledger:
        # Decided on the mirror: no ledger line may have appeared since.
        tests.append(expect_as_read(obj, ("status", LEDGER_FIELD)))
    for field in fields:
        path = (*base, field) if ledger else (*base, *MIRROR_PATHS[field])
        tests.append(expect_as_read(obj, path))
    return _unique(tests)


def _unique(tests: Patch) -> Patch:
    seen: set[str] = set()
    kept: Patch = []
    for op in tests:
        if op["path"] not in seen:
            seen.add(op["path"])
            kept.append(op)
    return kept


def spec_writes(spec: Mapping[str, Any], spec_patch: Mapping[str, Any]) -> Patch:
    """`spec_patch` written into `spec` (the claim's spec as read) as a merge patch would: a
    map merges key by key (usage reported for one resource keeps the others)."""
    writes: Patch = []
    for field, value in spec_patch.items():
        current = spec.get(field)
        if isinstance(value, Mapping) and isinstance(current, Mapping) and current:
            writes += [
                {"op": "add", "path": pointer(("spec", field, key)), "value": item}
                for key, item in value.items()
            ]
        else:
            writes.append({"op": "add", "path": pointer(("spec", field)), "value": value})
    return writes


# The spec fields whose writes the API server fences with the lease
# (reservoir.lease_fence_rules): a dispatch, and every report of what the work did.
LEASE_FENCED = frozenset({"dispatch", "usage", "final", "outcome", "result", "upstream"})


def lease_fence(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The claim's current lease as `spec.lease.fence` must name it, read as the API
    server's rule reads it (reservoir.lease_fence_rules): `status.lease` as stored (its
    holder, else the holder the claim names), else the generation the claim's line implies
    (a line written before status.lease existed); 0 before any grant."""
    status = obj.get("status")
    status = status if isinstance(status, Mapping) else {}
    lease = status.get("lease") or {}
    named = ((obj.get("spec") or {}).get("lease") or {}).get("holder")
    holder = lease.get("holder") or named
    if "generation" in lease:
        generation = int(lease.get("generation") or 0)
    else:
        line = status.get("ledger") or {}
        reserved = line.get("firstReservedAt") is not None
        taken = int(line.get("renewals") or 0) + int(line.get("handovers") or 0)
        generation = taken + 1 if reserved else 0
    fence: dict[str, Any] = {"generation": generation}
    if holder:
        fence["holder"] = holder
    return fence


def fenced_patch(
    obj: Mapping[str, Any], spec_patch: Mapping[str, Any], relies_on: Iterable[str] = ()
) -> Patch:
    """One JSON patch writing `spec_patch` into the claim's spec, applied only if the claim
    is still `obj` as far as the decision went: the same claim (UID), its spec and deletion
    unmoved (generation), and its record showing `relies_on` (PHASE, SETTLEMENT,
    EXPIRES_AT) as read. The operator's other status writes do not refuse it. A dispatch or
    a report carries the lease as read (`spec.lease.fence`) and tests that `status.lease` is
    still what was read: a lease renewed or handed on since refuses it as a moved claim
    (read again, decide again), never as the API server's fencing refusal."""
    tests = [*identity_tests(obj), *record_tests(obj, relies_on)]
    writes = dict(spec_patch)
    if LEASE_FENCED & writes.keys():
        tests = _unique([*tests, expect_as_read(obj, ("status", "lease"))])
        writes["lease"] = {**dict(writes.get("lease") or {}), "fence": lease_fence(obj)}
    return [*tests, *spec_writes(obj.get("spec") or {}, writes)]


def compensation_patch(obj: Mapping[str, Any], item: Mapping[str, Any]) -> Patch:
    """A JSON patch appending `item` to the claim's spec.compensations, applied only if the
    claim is still the one read (UID, generation) and its list is still exactly as read (so
    its length too): two writers never lose one's compensation."""
    patch = identity_tests(obj)
    listed = (obj.get("spec") or {}).get("compensations")
    if listed is None:
        return [*patch, {"op": "add", "path": "/spec/compensations", "value": [dict(item)]}]
    return [
        *patch,
        expect(("spec", "compensations"), listed),
        {"op": "add", "path": "/spec/compensations/-", "value": dict(item)},
    ]


def failed_tests(patch: Patch, obj: Mapping[str, Any] | None) -> list[str]:
    """The paths of `patch`'s tests that `obj` (the claim read again; None: gone) fails, as
    the API server compares them (null matches a missing member, not a missing parent).
    Empty: the patch's preconditions still hold, so a 422 for it was a refusal (a rule of
    the schema or of an admission policy), not a moved claim."""
    tests = [op for op in patch if op["op"] == "test"]
    if obj is None:
        return [op["path"] for op in tests]
    failed = []
    for op in tests:
        segments = segments_of(op["path"])
        found = _lookup(obj, segments)
        if found is _MISSING:
            parent_there = _lookup(obj, segments[:-1]) is not _MISSING
            if op["value"] is None and parent_there:
                continue
            failed.append(op["path"])
        elif found != op["value"]:
            failed.append(op["path"])
    return failed
