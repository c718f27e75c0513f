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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from lightkube import AsyncClient
from lightkube.resources.coordination_v1 import Lease

from reservoir.core.model import API_GROUP, API_VERSION
from reservoir.k8s.facts import PLACEMENT_PROBLEM, as_dict, placement_problem
from reservoir.k8s.resources import (
    CLAIM_FINALIZER,
    ENVELOPE_LABEL,
    FORCE_SETTLE_ANNOTATION,
    BranchClaim,
    field_value,
)

Body = dict[str, Any]
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


def claim_record(body: Mapping[str, Any]) -> Body:
    """The copy of a claim the operator keeps (in its index, and its own writes laid over
    it) and decides on: every field a decision reads, in the object's own shape, so that a
    record and the object read alike. The whole status is kept (a status write is a
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
    record: Body = {
        "apiVersion": body.get("apiVersion", f"{API_GROUP}/{API_VERSION}"),
        "kind": body.get("kind", "BranchClaim"),
        "metadata": kept,
    }
    spec = body.get("spec")
    if isinstance(spec, Mapping):
        record["spec"] = {k: v for k, v in spec.items() if k != "placement"}
        problem = body.get(PLACEMENT_PROBLEM) or placement_problem(spec.get("placement"))
        if problem:
            record[PLACEMENT_PROBLEM] = problem
    elif spec is not None:
        record["spec"] = spec  # not an object: read as unreadable, as before
    if "status" in body:
        record["status"] = body["status"]
    return share_strings(record)


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
    """`record` with the short strings of its spec and status replaced, in place, by one
    shared copy of each: a decoder makes new strings for every object, so each of 100,000
    records kept its own "Tentative", "True" and each timestamp its conditions repeat
    (measured on a Tentative claim's record: 8.4 KB, 5.4 KB shared). Keys are shared by
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

    async def claims(self, namespace: str, envelope: str) -> list[Body]: ...

    async def leases(self, namespace: str, envelope: str) -> dict[str, Body]: ...

    def written(self, before: Mapping[str, Any], after: Body, own: bool = True) -> None: ...

    def own_write(self, uid: str, version: str) -> bool: ...

    def deleted(self, uid: str) -> bool: ...


@dataclass
class ListedClaims:
    """Straight from the API server, on every pass."""

    client: AsyncClient
    fresh: bool = True

    async def claims(self, namespace: str, envelope: str) -> list[Body]:
        return [
            claim_record(as_dict(c))
            async for c in self.client.list(
                BranchClaim, namespace=namespace, fields={"spec.envelope": field_value(envelope)}
            )
        ]

    async def leases(self, namespace: str, envelope: str) -> dict[str, Body]:
        found: dict[str, Body] = {}
        async for lease in self.client.list(
            Lease, namespace=namespace, labels={ENVELOPE_LABEL: envelope}
        ):
            body = lease_record(lease.to_dict())
            found[body["metadata"]["name"]] = body
        return found

    def written(self, before: Mapping[str, Any], after: Body, own: bool = True) -> None:
        return None

    def own_write(self, uid: str, version: str) -> bool:
        return False

    def deleted(self, uid: str) -> bool:
        return False


class Index(Protocol):
    """Records by (namespace, envelope): an informer (reservoir.k8s.informer), or a dict."""

    def get(self, key: Key, /) -> Iterable[Body] | None: ...


@dataclass
class Written:
    """An object this operator wrote (or read fresh), and the versions it supersedes: the
    one the write replaced and, for writes in a row, every one before it."""

    superseded: frozenset[str]
    body: Body
    at: float
    # Our own status writes (in a row): the statuses they replaced (none: a fresh read).
    replaced_statuses: tuple[Any, ...] = ()

    def before_ours(self, copy: Body) -> bool:
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

    async def claims(self, namespace: str, envelope: str) -> list[Body]:
        now = time.monotonic()
        found: list[Body] = []
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

    async def leases(self, namespace: str, envelope: str) -> dict[str, Body]:
        return {
            body["metadata"]["name"]: body
            for body in self.lease_index.get((namespace, envelope)) or ()
        }

    def written(self, before: Mapping[str, Any], after: Body, own: bool = True) -> None:
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
