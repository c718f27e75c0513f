"""Where the ledger writer reads an envelope's claims and their Leases from.

`ListedClaims` lists them from the API server on every pass: always fresh, and one LIST
of claims and one of Leases per pass, however little changed. `WatchedClaims` reads them
from the operator's watch-fed informers (reservoir.k8s.informer; no request at all) and
is only as fresh as the watch. A stale view can only lack facts, never invent them
(every object version is a consistent snapshot, and a claim's facts only grow), so the
writer confirms with a direct GET exactly the decisions that a missing fact could
change: a claim the ledger names but the index lacks (gone?), and a claim about to take
or return capacity (see LedgerWriter). Correctness never rests on the index being
fresh; the envelope's compare-and-swap still fences every decision.

Both hand the writer, and the informers keep, a compact record of each claim and Lease
(`claim_record`, `lease_record`): the fields decisions read, not the whole object (a
claim's placement hints alone may be a megabyte).

The writer's own claim-status writes are written through: the object the API server
returned (as a record) replaces the index's older copy until the watch delivers it (or
anything newer), so the next pass neither mirrors again against a stale resourceVersion
nor treats its own write as news (`own_write`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from lightkube import AsyncClient
from lightkube.resources.coordination_v1 import Lease

from reservoir.core.model import API_GROUP, API_VERSION, CommitPoint
from reservoir.k8s.facts import PLACEMENT_PROBLEM, as_dict, placement_problem
from reservoir.k8s.resources import (
    CLAIM_FINALIZER,
    ENVELOPE_LABEL,
    FORCE_SETTLE_ANNOTATION,
    BranchClaim,
    envelope_label,
    field_value,
)

Body = dict[str, Any]
Record = Mapping[str, Any]  # a claim's (`ClaimRecord`) or a Lease's (`lease_record`)
Key = tuple[str, str]  # (namespace, envelope name)
# How long a written-through object is kept when the watch never shows a newer one (the
# claim was deleted meanwhile): long enough for any watch lag, short enough to stay small.
WRITTEN_KEEP_SECONDS = 120.0
# How long a deletion the watch delivered is remembered: a settled entry of a deleted claim
# is compacted by the next pass; one left longer is read with a GET, which answers too.
DELETED_KEEP_SECONDS = 600.0


# Of a claim's metadata, what the writer reads: its identity and versions, whether it is
# being deleted, and (`claim_record`) the force-settle annotation and the claim finalizer.
CLAIM_METADATA = (
    "name",
    "namespace",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
)


def claim_record(body: Mapping[str, Any]) -> ClaimRecord:
    """The copy of a claim the operator keeps (in its informer, and its own writes laid
    over it) and decides on: every field a decision reads, in the object's own shape, so
    that a record and the object read alike. The whole status is kept (a status write is a
    compare-and-swap on it) and the whole spec but its placement hints, which only the
    placeholder pod of a device hold needs: they are read fresh when it is made
    (k8s/devices.py), and a hint of a megabyte never stays in memory. Of the metadata only
    `CLAIM_METADATA`, the force-settle annotation, and the finalizers up to the claim's own
    (removed by position). A record of a record is the same record."""
    meta = body["metadata"]
    kept = {k: meta[k] for k in CLAIM_METADATA if k in meta}
    annotations = meta.get("annotations") or {}
    if FORCE_SETTLE_ANNOTATION in annotations:
        kept["annotations"] = {FORCE_SETTLE_ANNOTATION: annotations[FORCE_SETTLE_ANNOTATION]}
    finalizers = list(meta.get("finalizers") or [])
    if CLAIM_FINALIZER in finalizers:
        kept["finalizers"] = finalizers[: finalizers.index(CLAIM_FINALIZER) + 1]
    spec = body.get("spec", _MISSING)
    problem = None
    if isinstance(spec, Mapping):
        problem = body.get(PLACEMENT_PROBLEM) or placement_problem(spec.get("placement"))
        spec = {k: v for k, v in spec.items() if k != "placement"}
    # (a spec that is not an object is kept as it is: read as unreadable, as before)
    return ClaimRecord(
        body.get("apiVersion", f"{API_GROUP}/{API_VERSION}"),
        body.get("kind", "BranchClaim"),
        kept,
        spec,
        body.get("status", _MISSING),
        problem or _MISSING,
    )


def commit_point(claim: Mapping[str, Any]) -> Any:
    """A claim's commit point (its spec's `commitPoint`), from a record without decoding."""
    if isinstance(claim, ClaimRecord):
        return claim.commit_point
    return _commit_point_of(claim.get("spec"))


def _commit_point_of(spec: Any) -> Any:
    return (spec.get("commitPoint") if isinstance(spec, Mapping) else None) or (
        CommitPoint.DISPATCH
    )


class _Missing:
    """A part the claim does not have (not the same as one that is null)."""

    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Any = _Missing()


class ClaimRecord(Mapping[str, Any]):
    """A claim's record as kept, read like the claim itself (`record["spec"]`,
    `record.get("status")`, and never written to): its metadata as it came (every pass
    reads it), its spec and status as compact JSON, decoded each time they are read (a
    pass reads them only of the claims that moved). Kept as dicts, a Tentative claim's
    spec and status were 4.4 of its record's 6 KB, as JSON 1.8 (measured with
    hack/measure_claim_memory.py): at 100,000 live claims, 330 MiB. A part JSON cannot
    carry as it is (an integer past 64 bits, a lone surrogate) stays as it came."""

    __slots__ = (
        "_api_version",
        "_kind",
        "_metadata",
        "_problem",
        "_spec",
        "_status",
        "commit_point",
    )

    def __init__(
        self,
        api_version: Any,
        kind: Any,
        metadata: dict[str, Any],
        spec: Any = _MISSING,
        status: Any = _MISSING,
        problem: Any = _MISSING,
    ) -> None:
        self._api_version = api_version
        self._kind = kind
        self._metadata = metadata
        # Read of every claim on every pass (`commit_point`): kept as it is, not decoded.
        self.commit_point = _commit_point_of(spec)
        self._spec = packed(spec)
        self._status = packed(status)
        self._problem = problem

    def __getitem__(self, key: str) -> Any:
        if key == "metadata":
            return self._metadata
        value = self._part(key)
        if value is _MISSING:
            raise KeyError(key)
        return unpacked(value)

    def _part(self, key: str) -> Any:
        if key == "spec":
            return self._spec
        if key == "status":
            return self._status
        if key == "apiVersion":
            return self._api_version
        if key == "kind":
            return self._kind
        if key == PLACEMENT_PROBLEM:
            return self._problem
        return _MISSING

    def __iter__(self) -> Iterator[str]:
        yield "apiVersion"
        yield "kind"
        yield "metadata"
        for key in ("spec", "status", PLACEMENT_PROBLEM):
            if self._part(key) is not _MISSING:
                yield key

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, key: object) -> bool:
        return key == "metadata" or (isinstance(key, str) and self._part(key) is not _MISSING)

    def __repr__(self) -> str:
        return f"ClaimRecord({dict(self)!r})"


def packed(value: Any) -> Any:
    """`value` (an object or a list) as compact JSON, if it reads back equal; else as it
    is: an integer past 64 bits or a lone surrogate (which orjson refuses), a NaN (which it
    writes as null; the watch's fallback decoder reads one)."""
    if not isinstance(value, dict | list):
        return value
    try:
        # orjson's answer keeps the capacity it grew to (about twice the text): copied to
        # its exact size (found measuring: otherwise the packing saved nothing).
        text = bytes(memoryview(orjson.dumps(value)))
    except orjson.JSONEncodeError:  # a TypeError too: a key not a string, say
        return value
    return text if orjson.loads(text) == value else value


def unpacked(value: Any) -> Any:
    # Bytes are only ever what `packed` made: decoded JSON holds none.
    return orjson.loads(value) if type(value) is bytes else value


def lease_record(body: Mapping[str, Any]) -> Body:
    """The copy of a claim's Lease the operator keeps: its identity and version, and the
    renewal it shows (holder, renew time, transitions). Nothing else of it is read."""
    meta = body["metadata"]
    spec = body.get("spec") or {}
    return share_strings(
        {
            "metadata": {
                k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion") if k in meta
            },
            "spec": {
                k: spec[k] for k in ("holderIdentity", "renewTime", "leaseTransitions") if k in spec
            },
        }
    )


# Strings up to this long are shared between records (reasons, phases, quantities, the
# timestamps a claim's conditions repeat); a longer one (a message) is kept as it came.
SHARED_STRING_LENGTH = 64
# The most strings kept for sharing: past it the table starts again (a UID or a timestamp
# seen once must not stay for the life of the process, as `sys.intern` keeps everything on
# Python 3.12: found by review), and what is common is shared again from the next record.
SHARED_STRINGS = 65_536
_shared: dict[str, str] = {}


def share_strings(record: Body) -> Body:
    """`record` (a Lease's: a claim's keeps its spec and status as JSON) with the short
    strings of its spec and status replaced, in place, by one shared copy of each: a
    decoder makes new strings for every object, so each of 100,000 records kept its own
    holder name and each renewal time its Lease repeats. Keys are shared by
    the watch's decoder already (`undecodable`). Equal strings replace equal strings:
    nothing that reads the record can tell. Only the spec and the status, whose size the
    CRD's schema bounds (its metadata may hold a megabyte of finalizers: found by review);
    walked with a stack, not recursion."""
    shared = _shared
    stack: list[Any] = [record[part] for part in ("spec", "status") if part in record]
    while stack:
        item = stack.pop()
        if type(item) is dict:
            pairs: Iterable[tuple[Any, Any]] = item.items()
        elif type(item) is list:
            pairs = enumerate(item)
        else:
            continue
        for key, child in pairs:  # values replaced, never keys: the dict keeps its size
            kind = type(child)
            if kind is str:
                if len(child) <= SHARED_STRING_LENGTH:
                    one = shared.get(child)
                    if one is None:
                        if len(shared) >= SHARED_STRINGS:
                            shared.clear()
                        one = shared[child] = child
                    item[key] = one
            elif kind is dict or kind is list:
                stack.append(child)
    return record


class ClaimSource(Protocol):
    """An envelope's claims (by `spec.envelope`) and their Leases (by name)."""

    fresh: bool  # True: read from the API server on each call, nothing to confirm

    async def claims(self, namespace: str, envelope: str) -> list[Record]: ...

    async def leases(self, namespace: str, envelope: str) -> dict[str, Record]: ...

    def written(self, before: Mapping[str, Any], after: Record, own: bool = True) -> None: ...

    def own_write(self, uid: str, version: str) -> bool: ...

    def deleted(self, uid: str) -> bool: ...


@dataclass
class ListedClaims:
    """Straight from the API server, on every pass."""

    client: AsyncClient
    fresh: bool = True

    async def claims(self, namespace: str, envelope: str) -> list[Record]:
        return [
            claim_record(as_dict(c))
            async for c in self.client.list(
                BranchClaim, namespace=namespace, fields={"spec.envelope": field_value(envelope)}
            )
        ]

    async def leases(self, namespace: str, envelope: str) -> dict[str, Record]:
        found: dict[str, Record] = {}
        async for lease in self.client.list(
            Lease, namespace=namespace, labels={ENVELOPE_LABEL: envelope_label(envelope)}
        ):
            body = lease_record(lease.to_dict())
            found[body["metadata"]["name"]] = body
        return found

    def written(self, before: Mapping[str, Any], after: Record, own: bool = True) -> None:
        return None

    def own_write(self, uid: str, version: str) -> bool:
        return False

    def deleted(self, uid: str) -> bool:
        return False


class Index(Protocol):
    """Records by (namespace, envelope): an informer (reservoir.k8s.informer), or a dict."""

    def get(self, key: Key, /) -> Iterable[Record] | None: ...


@dataclass
class Written:
    """An object this operator wrote (or read fresh), and the versions it supersedes: the
    one the write replaced and, for writes in a row, every one before it."""

    superseded: frozenset[str]
    body: Record
    at: float
    # Our own status writes (in a row): the statuses they replaced (none: a fresh read).
    replaced_statuses: tuple[Any, ...] = ()

    def before_ours(self, copy: Record) -> bool:
        """Whether `copy`, a version the watch delivered that this write did not supersede,
        comes before our own status write: it still shows the status we replaced.
        Another's spec write between our read and our write is such a version (found by
        the benchmark: the next status write tested a status older than our own and was
        refused). resourceVersions are compared for equality only."""
        return copy.get("status") in self.replaced_statuses


@dataclass
class WatchedClaims:
    """From the watch-fed informers of claims and of Leases (`Services.claims`, `leases`),
    each keyed by (namespace, envelope name), with this operator's own writes laid over
    them."""

    claim_index: Index
    lease_index: Index
    fresh: bool = False
    _written: dict[str, Written] = field(default_factory=dict)  # by claim UID
    _own_versions: dict[str, str] = field(default_factory=dict)  # claim UID -> version
    # Claims the watch saw deleted (its DELETED event): gone for good, no GET needed.
    _deleted: dict[str, float] = field(default_factory=dict)  # claim UID -> when seen

    async def claims(self, namespace: str, envelope: str) -> list[Record]:
        now = time.monotonic()
        found: list[Record] = []
        for body in self.claim_index.get((namespace, envelope)) or ():
            uid = body["metadata"]["uid"]
            written = self._written.get(uid)
            if written is not None and (
                body["metadata"]["resourceVersion"] in written.superseded
                or written.before_ours(body)
            ):
                # The watch has not delivered our write yet (it may have delivered a
                # version written by another between the one we read and ours).
                found.append(written.body)
                continue
            if written is not None:  # the watch delivered it, or something newer
                del self._written[uid]
            found.append(body)
        self._written = {
            uid: w for uid, w in self._written.items() if now - w.at < WRITTEN_KEEP_SECONDS
        }
        return found

    async def leases(self, namespace: str, envelope: str) -> dict[str, Record]:
        return {
            body["metadata"]["name"]: body
            for body in self.lease_index.get((namespace, envelope)) or ()
        }

    def written(self, before: Mapping[str, Any], after: Record, own: bool = True) -> None:
        """The writer replaced `before` by `after` (own), or read `after` fresh where the
        index still had `before` (not own: its watch event is news)."""
        uid = after["metadata"]["uid"]
        replaced = before["metadata"]["resourceVersion"]
        if replaced == after["metadata"]["resourceVersion"]:
            return
        superseded = {replaced}
        statuses: tuple[Any, ...] = ()
        if own and before.get("status") != after.get("status"):
            statuses = (before.get("status"),)
        earlier = self._written.get(uid)
        if earlier is not None and earlier.body["metadata"]["resourceVersion"] == replaced:
            # A write over our own earlier one: the index may still show any version that
            # one superseded (found by review: the overlay was lost after two writes).
            superseded |= earlier.superseded
            statuses += earlier.replaced_statuses
        kept = Written(frozenset(superseded), claim_record(after), time.monotonic(), statuses)
        self._written[uid] = kept
        if not own:
            return
        self._own_versions[uid] = after["metadata"]["resourceVersion"]
        if len(self._own_versions) > 4 * len(self._written) + 1024:
            self._own_versions = {u: v for u, v in self._own_versions.items() if u in self._written}

    def own_write(self, uid: str, version: str) -> bool:
        """Whether this claim version is one this operator's writer wrote itself: its
        watch event brings nothing the ledger has not reconciled."""
        if self._own_versions.get(uid) == version:
            del self._own_versions[uid]
            return True
        return False

    def saw_deleted(self, uid: str) -> None:
        """The watch delivered the claim's deletion: the API server says it is gone."""
        now = time.monotonic()
        self._deleted[uid] = now
        self._written.pop(uid, None)
        self._own_versions.pop(uid, None)
        forget_older(self._deleted, now - DELETED_KEEP_SECONDS)

    def deleted(self, uid: str) -> bool:
        return uid in self._deleted


def forget_older(seen: dict[str, float], cutoff: float) -> None:
    """Drop the entries recorded before `cutoff` from a dict filled in time order: from the
    front, so each entry costs O(1) once (found by review: rebuilding the whole dict on
    every insert was quadratic under churn)."""
    while seen:
        oldest = next(iter(seen))
        if seen[oldest] >= cutoff:
            return
        del seen[oldest]
