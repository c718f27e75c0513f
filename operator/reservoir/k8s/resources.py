"""Reservoir's resources as lightkube types, and the names the operator puts on objects."""

from __future__ import annotations

import hashlib
import re
import weakref
from collections.abc import Collection, Mapping
from typing import Any
from urllib.parse import quote

from lightkube import ApiError, AsyncClient
from lightkube.generic_resource import create_global_resource, create_namespaced_resource

from reservoir.core.model import API_GROUP, API_VERSION

ReservationEnvelope = create_namespaced_resource(
    API_GROUP, API_VERSION, "ReservationEnvelope", "reservationenvelopes"
)
BranchClaim = create_namespaced_resource(API_GROUP, API_VERSION, "BranchClaim", "branchclaims")
ReservationPool = create_global_resource(
    API_GROUP, API_VERSION, "ReservationPool", "reservationpools"
)

ENVELOPE_LABEL = f"{API_GROUP}/envelope"
# The envelope's name, on what carries the label above (see `envelope_label`).
ENVELOPE_NAME_ANNOTATION = f"{API_GROUP}/envelope-name"
MAX_LABEL_VALUE = 63
# A label value no object name can be: names are lowercase, without underscores.
_DIGEST_PREFIX = "H_"
# A claim's workload pods, Lease and placeholder pod: the label holds the claim's UID (a
# label value is at most 63 characters, a claim's name up to 253), and the annotation
# below its name, for people. A pod or Job a tenant labels with the claim's name (one that
# fits) is the claim's too: the operator matches the label on either.
CLAIM_LABEL = f"{API_GROUP}/claim"
CLAIM_NAME_ANNOTATION = f"{API_GROUP}/claim-name"
# An envelope's workflow class: metrics and right-sizing aggregate over it.
WORKFLOW_CLASS_LABEL = f"{API_GROUP}/workflow-class"


def envelope_label(name: str) -> str:
    """The `reservoir.dev/envelope` label value of the envelope named `name`: the name when
    it fits in a label value (63 characters: unchanged from before issue 25), else a digest
    of it that no object's name can equal, so no envelope's label is another's. The name
    itself goes in the `reservoir.dev/envelope-name` annotation."""
    if len(name) <= MAX_LABEL_VALUE:
        return name
    return _DIGEST_PREFIX + hashlib.sha256(name.encode()).hexdigest()[:60]


def labelled_envelope(
    labels: Mapping[str, Any] | None, annotations: Mapping[str, Any] | None
) -> str | None:
    """The envelope an object's label names: the annotation's name when the label is that
    name's (a digest, or the name itself), else the label (a name that fits). None when
    it has no label; a digest without its name names no envelope there is."""
    label = (labels or {}).get(ENVELOPE_LABEL)
    if not label:
        return None
    name = (annotations or {}).get(ENVELOPE_NAME_ANNOTATION)
    if isinstance(name, str) and name and envelope_label(name) == label:
        return name
    return str(label)


# A UID's shape (what the API server generates). A label value of this shape names a claim
# by UID only: a claim may be named like another claim's UID (a UID is a valid object
# name), and matching it by name too let such a claim take another's pod (found by review).
UID_SHAPE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def is_uid(value: str) -> bool:
    return bool(UID_SHAPE.match(value))


def labelled_for(value: str | None, uid: str, name: str) -> bool:
    """Whether a `reservoir.dev/claim` label value names the claim: its UID, or its name
    when the value is not shaped like a UID."""
    if not value:
        return False
    return value == uid or (not is_uid(value) and value == name)


def claim_of_label(value: str, uids: Collection[str], by_name: Mapping[str, str]) -> str | None:
    """The UID of the claim (among `uids`, named as `by_name` says) a label value names."""
    if value in uids:
        return value
    return None if is_uid(value) else by_name.get(value)


FORCE_SETTLE_ANNOTATION = f"{API_GROUP}/force-settle"
FORCE_SETTLE_GONE_ANNOTATION = f"{API_GROUP}/force-settle-gone"
# kopf's own finalizer, on envelopes and pools (their deletion handlers).
FINALIZER = f"{API_GROUP}/settlement"
# A claim's: the SDK creates claims with it (the operator adds it to any claim without it),
# and the ledger writer removes it once the claim's settlement is recorded. Not kopf's:
# claims have no kopf change handlers, so kopf writes nothing on them (no diff-base
# annotation on every spec change, no finalizer of its own).
CLAIM_FINALIZER = f"{API_GROUP}/claim-settlement"
# Objects a page when the operator lists a kind whole (kopf's first LIST of each kind,
# an envelope's claims at its deletion): one small page of whole objects held at a time.
LIST_PAGE = 50
# A device claim's workload pod is created behind this scheduling gate; the operator lifts
# it once the hand-off of the claim's devices is recorded.
HAND_OFF_GATE = f"{API_GROUP}/hand-off"
FIELD_MANAGER = "reservoir-operator"


def field_value(value: str) -> str:
    """A value as a field selector must spell it: `\\`, `,` and `=` escaped (as
    k8s.io/apimachinery fields.EscapeValue does), so any value the schema accepts selects
    exactly itself (found by review: `a,b=c` broke the list, `a\\b` matched `a\b`)."""
    return value.replace("\\", "\\\\").replace(",", "\\,").replace("=", "\\=")


def possible_name(name: str) -> bool:
    """Whether some object could have this name (or a namespace be called it): not empty,
    not '.' or '..', no '/' (the API server refuses such names for every kind)."""
    return name not in ("", ".", "..") and "/" not in name


def path_segment(name: str) -> str:
    """A name as one segment of an API URL, percent-escaped whole ('/', '%', '?', '#' and
    the rest). lightkube joins names into URLs as they are: found by review,
    `../../tenant-b/...` as a claim's spec.envelope read an envelope of another namespace.
    Raises ValueError for a name no object can have ('..' stays '..' escaped)."""
    if not possible_name(name):
        raise ValueError(f"not an object name: {name!r}")
    return quote(name, safe="")


# What a client may not LIST (403: a reader allowed only get), by kind and namespace: read
# with a GET from then on, not asked again on every read. RBAC changes rarely; a client
# made after a role grants list reads by LIST again.
_LIST_FORBIDDEN: weakref.WeakKeyDictionary[AsyncClient, set[tuple[Any, str | None]]] = (
    weakref.WeakKeyDictionary()
)


async def get_object(
    client: AsyncClient, kind: Any, name: str, namespace: str | None
) -> dict[str, Any] | None:
    """One object read fresh, as a plain dict; None if it does not exist. Any other error
    is raised (and retried by the caller's loop), never read as "gone".

    Read with a LIST that selects the object by name, not a GET: both are consistent
    reads (resourceVersion unset), but the API server answers the LIST from its watch
    cache once that has caught up with etcd, while a GET fetches the object from etcd and
    decodes it again: a quarter of the API server's CPU for an envelope's ledger (3 ms
    against 12 for one of 48 KB, measured on this project's control plane), which the
    writer and the SDK read several times per claim. A refused LIST (429 while the cache
    initializes, 403 for a reader allowed only get) falls back to the GET; after a 403,
    that client reads that kind in that namespace with GETs only.

    A name or namespace no object can have (empty, '.', '..', with a '/') reads as
    absent, and a name is escaped before it is joined into a URL."""
    if not possible_name(name) or (namespace is not None and not possible_name(namespace)):
        return None
    forbidden = _LIST_FORBIDDEN.get(client, set())
    if (kind, namespace) not in forbidden:
        try:
            return await _listed_by_name(client, kind, name, namespace)
        except ApiError as error:
            if error.status.code not in (403, 429):
                raise
            if error.status.code == 403:
                _LIST_FORBIDDEN.setdefault(client, set()).add((kind, namespace))
    try:
        if namespace is None:
            found = await client.get(kind, path_segment(name))
        else:
            found = await client.get(kind, path_segment(name), namespace=path_segment(namespace))
    except ApiError as error:
        if error.status.code == 404:
            return None
        raise
    return _as_dict(found)


async def _listed_by_name(
    client: AsyncClient, kind: Any, name: str, namespace: str | None
) -> dict[str, Any] | None:
    selector: Any = {"metadata.name": field_value(name)}
    if namespace is None:
        listing = client.list(kind, fields=selector)
    else:
        listing = client.list(kind, namespace=namespace, fields=selector)
    async for found in listing:
        body = _as_dict(found)
        if body["metadata"]["name"] == name:
            return body
    return None


def _as_dict(found: Any) -> dict[str, Any]:
    if isinstance(found, dict):
        return found
    body: dict[str, Any] = found.to_dict()
    return body
