"""BranchClaim: kept for its envelope's writer; every change wakes that writer.

Claims have no kopf handlers: their watch is served by the claim informer (reservoir.k8s.
informer), which keeps each claim's record and calls `claim_changed`. kopf keeps no
diff-base annotation on them and adds no finalizer of its own, so a claim's life costs the
operator no write beyond the ledger's own (its status mirror, and the removal of its
finalizer once settled). A claim made without the SDK gets its envelope owner and the
claim finalizer here, once (`adopt`, off the watch's task: reservoir.k8s.per_object).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import kopf
from lightkube import ApiError
from lightkube.types import PatchType

from reservoir.core.model import API_GROUP, API_VERSION, BranchClaimStatus
from reservoir.core.text import MESSAGE_LENGTH, bounded
from reservoir.k8s.informer import UNLISTED, Key
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
    if isinstance(status, Mapping) and status.get("queueReason") is not None:
        view["status"] = {"queueReason": status["queueReason"]}
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
