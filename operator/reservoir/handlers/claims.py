"""BranchClaim: indexed for its envelope's writer; every change wakes that writer.

Claims have no kopf change handlers: kopf keeps no diff-base annotation on them and adds
no finalizer of its own, so a claim's life costs the operator no write beyond the ledger's
own (its status mirror, and the removal of its finalizer once settled). A claim made
without the SDK gets its envelope owner and the claim finalizer here, once.
"""

from __future__ import annotations

import contextlib
from typing import Any

import kopf
from lightkube import ApiError
from lightkube.types import PatchType

from reservoir.core.model import API_GROUP, API_VERSION, BranchClaimStatus
from reservoir.core.text import MESSAGE_LENGTH, bounded
from reservoir.k8s.claim_source import claim_record, shed
from reservoir.k8s.ledger_writer import LedgerStuckError, remove_finalizer
from reservoir.k8s.resources import (
    CLAIM_FINALIZER,
    BranchClaim,
    ReservationEnvelope,
    get_object,
)
from reservoir.services import Services

CLAIMS = (API_GROUP, API_VERSION, "branchclaims")


def pending_without_envelope(envelope: str) -> BranchClaimStatus:
    return BranchClaimStatus(
        queue_reason=bounded(
            f"EnvelopeNotFound: no ReservationEnvelope {envelope!r} in this namespace",
            MESSAGE_LENGTH,
        )
    )


@kopf.index(*CLAIMS)
async def claims_by_envelope(
    body: kopf.Body, spec: kopf.Spec, namespace: str | None, **_: Any
) -> dict[tuple[str, str], dict[str, Any]]:
    """The envelope's writer reads its claims from here (fed by the watch), not by a
    LIST on every pass. kopf fills every index before any handler or daemon runs. Each
    claim is kept as its compact record: the fields decisions read, never its placement
    hints (`claim_record`). (The indexers are coroutines: kopf runs plain functions in a
    thread pool, a hand-off per event.)"""
    record = claim_record(body)
    shed(body)  # kopf's copy: it may wait with it for every other object at start-up
    return {(namespace or "", str(spec.get("envelope") or "")): record}


@kopf.on.event(*CLAIMS)
async def wake_the_envelope(
    event: kopf.RawEvent,
    body: kopf.Body,
    spec: kopf.Spec,
    meta: kopf.Meta,
    uid: str,
    namespace: str | None,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """Any change to a claim is a fact for its envelope's ledger (the writer's own status
    writes are not: it has reconciled them already)."""
    services: Services = memo.services
    envelope = str(spec.get("envelope") or "")
    if not namespace:
        return
    gone = event.get("type") == "DELETED"
    if gone:
        services.writer.saw_deleted(uid, body)
    else:
        # Before the own-write check: a claim whose adoption lost a race against the
        # writer's status write is adopted on that write's event (found by review).
        await adopt(services, namespace, body, envelope)
        if services.writer.own_write(uid, str(meta.get("resourceVersion"))):
            return
    if envelope:
        services.writer.poke(namespace, envelope)


async def adopt(services: Services, namespace: str, body: kopf.Body, envelope: str) -> None:
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
        owner = {
            "apiVersion": f"{API_GROUP}/{API_VERSION}",
            "kind": "ReservationEnvelope",
            "name": envelope,
            "uid": found["metadata"]["uid"],
        }
        patch.append({"op": "add", "path": "/metadata/ownerReferences", "value": [owner]})
    try:
        if len(patch) > 1:
            await services.client.patch(
                BranchClaim, meta["name"], patch, namespace=namespace, patch_type=PatchType.JSON
            )
        if found is None and (body.get("status") or {}).get("queueReason") is None:
            # No envelope (yet): say so on the claim. It waits, unowned; the envelope's
            # writer takes it over if the envelope appears.
            await services.client.patch(
                BranchClaim.Status,
                meta["name"],
                {"status": pending_without_envelope(envelope).to_api()},
                namespace=namespace,
                patch_type=PatchType.MERGE,
            )
    except ApiError as error:
        # Changed or gone meanwhile: its next event adopts it.
        if error.status.code not in (404, 409, 422):
            raise
