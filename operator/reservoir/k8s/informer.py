"""The operator's own informer for the kinds it keeps many of: BranchClaims and their Leases.

kopf hands every event of every object it watches to a worker of that object's own (a
queue, a task, a memory of the object, a cause with a dozen arguments), then to the
indexers and the handlers. For envelopes and pools that is cheap; for a claim, of which a
cluster holds 100,000, it was the largest per-object cost the operator had: about 2 KB of
kopf's memory an object (claim and Lease each) and its per-event CPU on every claim write.

An `Informer` keeps, per object, only the compact record the ledger writer reads
(`claim_source.claim_record`, `lease_record`), by the key its readers ask for (namespace
and envelope), and calls one function per event. kopf still lists and watches the kind
(its watch stream, with this operator's tolerant decoders and restarting watcher: see
`reservoir.kopf_watch.serve_informer`), and still holds every daemon until each
namespace's first list is complete; only what it did per object is done here.

A list that is complete again (after a watch expired, or the watch was restarted) is
the whole truth at its resourceVersion, but for what the decoder set aside: an object
kept from before that the list lacks was deleted meanwhile or cannot be read now. Its
record is dropped and its envelope woken (`UNLISTED`), never reported deleted: only a
DELETED event or a fresh read says that (the writer reads a claim its ledger names and no
informer holds). Each list attempt starts its count afresh (`list_begins`): a list cut off
half-way says nothing about what its second attempt lacks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

Record = Mapping[str, Any]
Key = tuple[str, str]  # (namespace, envelope name)
# An object kept before that a complete list lacks (deleted, or set aside by the decoder).
UNLISTED = "UNLISTED"
# An event's type (None for an object of a list, ADDED, MODIFIED, DELETED, UNLISTED), the
# object as the API server sent it (for UNLISTED, the record), its record (the object's
# own; for DELETED or UNLISTED the last one kept, if any) and where the record is (or
# was) kept.
Changed = Callable[[str | None, Mapping[str, Any], Record, Key], None]


class Informer:
    """Records of one kind by (namespace, envelope), fed by its watch events."""

    def __init__(
        self,
        kind: str,
        record: Callable[[Mapping[str, Any]], Record],
        key: Callable[[Mapping[str, Any]], Key],
        changed: Changed,
    ) -> None:
        self.kind = kind
        self._record = record
        self._key = key
        self._changed = changed
        self._by_key: dict[Key, dict[str, Record]] = {}
        self._keys: dict[str, Key] = {}  # uid -> where its record is kept
        self._names: dict[tuple[str, str], str] = {}  # (namespace, name) -> uid
        # UIDs listed since the list of each watch (namespace, or None: the cluster) began.
        self._listing: dict[str | None, set[str]] = {}

    def get(self, key: Key) -> Iterable[Record]:
        """The records kept under `key` (an envelope's claims, or their Leases)."""
        return tuple((self._by_key.get(key) or {}).values())

    def key_of_uid(self, namespace: str, uid: str) -> Key | None:
        """Where the object of this UID is kept, if it is, and it is in `namespace`."""
        key = self._keys.get(uid)
        return key if key is not None and key[0] == namespace else None

    def key_of(self, namespace: str, name: str) -> Key | None:
        """Where the object named `name` in `namespace` is kept (its envelope), if it is."""
        uid = self._names.get((namespace, name))
        return None if uid is None else self._keys.get(uid)

    def __len__(self) -> int:
        return len(self._keys)

    def list_begins(self, scope: str | None) -> None:
        """The watch of `scope` starts a list (again): count what it shows from here."""
        self._listing[scope] = set()

    def apply(self, event: Mapping[str, Any], scope: str | None) -> None:
        """One event of the watch of `scope` (a namespace, or None: the whole cluster).
        One object's failure is logged and never stops the stream of the others."""
        kind = event.get("type")
        body = event.get("object")
        try:
            if not isinstance(body, Mapping):
                return
            uid = str(body["metadata"]["uid"])
            if kind is None:
                self._listing.setdefault(scope, set()).add(uid)
            if kind == "DELETED":
                where = self._keys.get(uid)
                kept = self._drop(uid)
                # The last state the API server sent, unless the decoder set it aside (then
                # only its metadata came): the record kept before it, status and all.
                if kept is None or "spec" in body:
                    kept = self._record(body)
                self._changed(kind, body, kept, where or self._key(body))
                return
            record = self._record(body)
            key = self._key(body)
            self._keep(uid, key, record)
            self._changed(kind, body, record, key)
        except Exception:
            meta = body.get("metadata") if isinstance(body, Mapping) else None
            meta = meta if isinstance(meta, Mapping) else {}
            logger.exception(
                "could not take in a %s event of %s %s/%s",
                kind, self.kind, meta.get("namespace"), meta.get("name"),
            )  # fmt: skip

    def listed(self, scope: str | None) -> None:
        """The list of `scope`'s watch is complete: what it lacks is not there now."""
        seen = self._listing.pop(scope, set())
        unlisted = [
            (uid, key)
            for uid, key in self._keys.items()
            if uid not in seen and (scope is None or key[0] == scope)
        ]
        for uid, key in unlisted:
            record = self._drop(uid) or {}
            try:
                self._changed(UNLISTED, record, record, key)
            except Exception:
                logger.exception("could not take in the absence of %s %s", self.kind, uid)

    def _keep(self, uid: str, key: Key, record: Record) -> None:
        before = self._keys.get(uid)
        if before is not None and before != key:
            self._drop(uid)
        self._by_key.setdefault(key, {})[uid] = record
        self._keys[uid] = key
        meta = record.get("metadata") or {}
        self._names[(key[0], str(meta.get("name") or ""))] = uid

    def _drop(self, uid: str) -> Record | None:
        """Forget `uid`'s record; the record it was, if one was kept."""
        key = self._keys.pop(uid, None)
        if key is None:
            return None
        records = self._by_key.get(key) or {}
        record = records.pop(uid, None)
        if not records:
            self._by_key.pop(key, None)
        name = (key[0], str(((record or {}).get("metadata") or {}).get("name") or ""))
        if self._names.get(name) == uid:
            del self._names[name]
        return record
