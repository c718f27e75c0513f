"""BranchClaim: kept for its envelope's writer; every change wakes that writer.

Claims have no kopf handlers: their watch is served by the claim informer (reservoir.k8s.
informer), which keeps each claim's record and calls `claim_changed`. kopf keeps no
diff-base annotation on them and adds no finalizer of its own, so a claim's life costs the
operator no write beyond the ledger's own (its status mirror, and the removal of its
finalizer once settled). A claim made without the SDK gets its envelope owner and the
claim finalizer here, once (`adopt`, off the watch's task: reservoir.k8s.per_object).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import kopf
from lightkube import ApiError
from lightkube.types import PatchType

from reservoir.core.model import API_GROUP, API_VERSION, BranchClaimStatus
from reservoir.core.text import MESSAGE_LENGTH, bounded
from reservoir.k8s.facts import as_dict
from reservoir.k8s.informer import UNLISTED, Key
from reservoir.k8s.ledger_writer import LedgerStuckError, remove_finalizer
from reservoir.k8s.resources import (
    CLAIM_FINALIZER,
    LIST_PAGE,
    BranchClaim,
    ReservationEnvelope,
    field_value,
    get_object,
)
from reservoir.services import Services

logger = logging.getLogger(__name__)

CLAIMS = (API_GROUP, API_VERSION, "branchclaims")
OWN_AT_ONCE = 16  # owner references added at once, when an envelope's deletion adds them


def pending_without_envelope(envelope: str) -> BranchClaimStatus:
    return BranchClaimStatus(
        queue_reason=bounded(
            f"EnvelopeNotFound: no ReservationEnvelope {envelope!r} in this namespace",
            MESSAGE_LENGTH,
        )
    )


@kopf.index(*CLAIMS)
async def claims_by_envelope(**_: Any) -> None:
    """Declares the watch of claims, each namespace's first list held before any daemon
    runs (kopf does both for an indexed kind). Their events never reach kopf's handlers:
    the claim informer (`Services.claims`, reservoir.k8s.informer) takes them in, keeping
    each claim's compact record (`claim_record`) by envelope for the writer, and calls
    `claim_changed`."""


def claim_key(body: Mapping[str, Any]) -> Key:
    """Where a claim's record is kept: its namespace and envelope."""
    spec = body.get("spec")
    envelope = spec.get("envelope") if isinstance(spec, Mapping) else None
    return str(body["metadata"].get("namespace") or ""), str(envelope or "")


def claim_changed(
    services: Services,
    event: str | None,
    body: Mapping[str, Any],
    record: Mapping[str, Any],
    key: Key,
) -> None:
    """Any change to a claim is a fact for its envelope's ledger (the writer's own status
    writes are not: it has reconciled them already). A claim missing from a new list is
    only news: the writer reads it fresh if its ledger still names it."""
    namespace, envelope = key
    if not namespace:
        return
    uid = str(record["metadata"]["uid"])
    if event == "DELETED":
        services.writer.saw_deleted(uid, record)
    elif event != UNLISTED:
        # Before the own-write check: a claim whose adoption lost a race against the
        # writer's status write is adopted on that write's event (found by review).
        if adoption_needed(services, namespace, body, envelope):
            services.adoptions.submit(uid, namespace, namespace, adoption_view(body), envelope)
        if services.writer.own_write(uid, str(record["metadata"].get("resourceVersion"))):
            return
    if envelope:
        services.writer.poke(namespace, envelope)


def adoption_needed(
    services: Services, namespace: str, body: Mapping[str, Any], envelope: str
) -> bool:
    """Whether `adopt` has anything to do for this version of a claim: one made without
    the SDK (no owner, or no claim finalizer), or one being deleted whose envelope's
    daemon does not run (so no pass would release it)."""
    meta = body["metadata"]
    finalizers = meta.get("finalizers") or []
    deleting = bool(meta.get("deletionTimestamp"))
    if deleting:
        return CLAIM_FINALIZER in finalizers and not services.writer.kept(namespace, envelope)
    return not meta.get("ownerReferences") or CLAIM_FINALIZER not in finalizers


def adoption_view(body: Mapping[str, Any]) -> dict[str, Any]:
    """Of a claim, what `adopt` reads: kept while the adoption waits its turn, not the
    whole object (whose placement hints may be a megabyte)."""
    meta = body["metadata"]
    view: dict[str, Any] = {
        "metadata": {
            k: meta[k]
            for k in (
                "name",
                "uid",
                "resourceVersion",
                "finalizers",
                "ownerReferences",
                "deletionTimestamp",
            )
            if k in meta
        }
    }
    status = body.get("status")
    if isinstance(status, Mapping):
        view["status"] = {k: status[k] for k in ("phase", "queueReason") if k in status}
    return view


async def adopt(services: Services, namespace: str, body: Mapping[str, Any], envelope: str) -> None:
    """A claim made without the SDK: owned by its envelope (deleting the envelope collects
    its settled claims) and guarded by the claim finalizer. A claim being deleted is left
    to its envelope's writer, which removes the finalizer once the settlement is recorded,
    when the envelope's daemon runs; when it does not, the envelope is read fresh (the
    watch of envelopes may lag): if it is gone, the claim held nothing and goes, and if it
    is going, its writer is run now (its daemon does not run again)."""
    meta = body["metadata"]
    finalizers = list(meta.get("finalizers") or [])
    owned = bool(meta.get("ownerReferences"))
    deleting = bool(meta.get("deletionTimestamp"))
    if deleting and CLAIM_FINALIZER not in finalizers:
        return
    if not deleting and owned and CLAIM_FINALIZER in finalizers:
        return
    if deleting and services.writer.kept(namespace, envelope):
        return  # the envelope's daemon runs: the poke that follows reaches its writer
    found = await get_object(services.client, ReservationEnvelope, envelope, namespace)
    if deleting:
        if found is None:
            await remove_finalizer(services.client, namespace, body)
        elif found["metadata"].get("deletionTimestamp"):
            with contextlib.suppress(LedgerStuckError):
                await services.writer.reconcile_once(namespace, envelope)
        return
    patch: list[dict[str, Any]] = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": meta["resourceVersion"]}
    ]
    if CLAIM_FINALIZER not in finalizers:
        if finalizers:
            patch.append({"op": "add", "path": "/metadata/finalizers/-", "value": CLAIM_FINALIZER})
        else:
            patch.append({"op": "add", "path": "/metadata/finalizers", "value": [CLAIM_FINALIZER]})
    if not owned and found is not None:
        owner = envelope_owner(envelope, found["metadata"]["uid"])
        patch.append({"op": "add", "path": "/metadata/ownerReferences", "value": [owner]})
    try:
        version = meta["resourceVersion"]
        if len(patch) > 1:
            adopted = await services.client.patch(
                BranchClaim, meta["name"], patch, namespace=namespace, patch_type=PatchType.JSON
            )
            version = as_dict(adopted)["metadata"]["resourceVersion"]
        if found is None and waits_without_reason(body):
            # No envelope (yet): say so on the claim. It waits, unowned; the envelope's
            # writer takes it over if the envelope appears.
            await services.client.patch(
                BranchClaim.Status,
                meta["name"],
                envelope_not_found(body, version, envelope),
                namespace=namespace,
                patch_type=PatchType.JSON,
            )
    except ApiError as error:
        # Changed or gone meanwhile: its next event adopts it.
        if error.status.code not in (404, 409, 422):
            raise


def envelope_owner(name: str, uid: str) -> dict[str, str]:
    """The owner reference a claim gets to its envelope (the garbage collector takes the
    claim with it)."""
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": "ReservationEnvelope",
        "name": name,
        "uid": uid,
    }


def waits_without_reason(body: Mapping[str, Any]) -> bool:
    """Whether this version of a claim waits (Pending: nothing was ever admitted) and
    says nothing of why."""
    status = body.get("status") or {}
    return status.get("phase") in (None, "Pending") and status.get("queueReason") is None


def envelope_not_found(body: Mapping[str, Any], version: str, envelope: str) -> list[Any]:
    """A JSON patch saying on a waiting claim that its envelope is not there, applied only
    to the version read (`version`): a claim the writer admitted or settled meanwhile is
    never set back to Pending (found by review: a merge patch written late, once the
    envelope had gone, turned 126 Released claims Pending)."""
    test = {"op": "test", "path": "/metadata/resourceVersion", "value": version}
    reason = pending_without_envelope(envelope).to_api()
    if "status" not in body:
        return [test, {"op": "add", "path": "/status", "value": reason}]
    return [test, {"op": "add", "path": "/status/queueReason", "value": reason["queueReason"]}]


async def own_claims(services: Services, namespace: str, envelope: Mapping[str, Any]) -> None:
    """Before an envelope goes: each of its claims that has no owner made its own, so that
    the garbage collector takes them with it. A claim made without the SDK is adopted off
    the watch (`adopt`), which may lag behind a quick deletion (found by the 2,000-claim
    test: its envelope went with 1,461 settled claims unowned, kept for good). Read fresh,
    not from the informer: the decision rests on an absence. The owner is added only
    where there is none (a JSON patch testing that), whatever else changed meanwhile: a
    tenant changing its claims cannot hold the deletion back (found by review). A claim
    the API server refuses it (an owner set meanwhile, or a rule it fails) is left as it
    is, and logged: the envelope still goes."""
    meta = envelope["metadata"]
    owner = envelope_owner(meta["name"], meta["uid"])
    unowned: list[str] = []  # names only: a claim's metadata may be large
    async for claim in services.client.list(
        BranchClaim,
        namespace=namespace,
        fields={"spec.envelope": field_value(meta["name"])},
        chunk_size=LIST_PAGE,  # whole claims: one small page at a time (found by review)
    ):
        if not claim.metadata or claim.metadata.ownerReferences:
            continue
        unowned.append(str(claim.metadata.name))

    async def own(name: str) -> None:
        patch = [
            {"op": "test", "path": "/metadata/ownerReferences", "value": None},
            {"op": "add", "path": "/metadata/ownerReferences", "value": [owner]},
        ]
        try:
            await services.client.patch(
                BranchClaim, name, patch, namespace=namespace, patch_type=PatchType.JSON
            )
        except ApiError as error:
            if error.status.code == 422:
                logger.info("claim %s/%s not owned by its envelope: %s", namespace, name, error)
            elif error.status.code != 404:
                raise

    for at in range(0, len(unowned), OWN_AT_ONCE):
        await asyncio.gather(*(own(name) for name in unowned[at : at + OWN_AT_ONCE]))
