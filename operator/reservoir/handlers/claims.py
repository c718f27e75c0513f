"""BranchClaim: every change wakes its envelope's writer; deletion waits for settlement."""

from __future__ import annotations

from typing import Any

import kopf
from lightkube import ApiError
from lightkube.types import PatchType

from reservoir import metrics
from reservoir.core.model import API_GROUP, API_VERSION, BranchClaimStatus
from reservoir.k8s.ledger_writer import LedgerStuckError
from reservoir.k8s.resources import BranchClaim, ReservationEnvelope
from reservoir.services import Services

CLAIMS = (API_GROUP, API_VERSION, "branchclaims")
REMIND_EVERY_RETRIES = 30  # retries come every 2 s: about once a minute


def pending_without_envelope(envelope: str) -> BranchClaimStatus:
    return BranchClaimStatus(
        queue_reason=f"EnvelopeNotFound: no ReservationEnvelope {envelope!r} in this namespace"
    )


@kopf.on.event(*CLAIMS)
async def wake_the_envelope(
    spec: kopf.Spec, namespace: str | None, memo: kopf.Memo, **_: Any
) -> None:
    """Any change to a claim is a fact for its envelope's ledger."""
    envelope = spec.get("envelope")
    if envelope and namespace:
        services: Services = memo.services
        services.writer.poke(namespace, envelope)


@kopf.on.create(*CLAIMS)
async def belong_to_the_envelope(
    spec: kopf.Spec, name: str, namespace: str | None, meta: kopf.Meta, memo: kopf.Memo, **_: Any
) -> None:
    """Owned by its envelope, so deleting the envelope collects its (settled) claims."""
    services: Services = memo.services
    if meta.get("ownerReferences") or namespace is None:
        return
    try:
        envelope = await services.client.get(
            ReservationEnvelope, spec["envelope"], namespace=namespace
        )
    except ApiError as error:
        if error.status.code != 404:
            raise
        # No envelope (yet): say so on the claim. It waits, unowned; the envelope's writer
        # takes it over if the envelope appears.
        await services.client.patch(
            BranchClaim.Status,
            name,
            {"status": pending_without_envelope(spec["envelope"]).to_api()},
            namespace=namespace,
            patch_type=PatchType.MERGE,
        )
        return
    owner = {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": "ReservationEnvelope",
        "name": spec["envelope"],
        "uid": envelope["metadata"]["uid"],
    }
    await services.client.patch(
        BranchClaim,
        name,
        {"metadata": {"ownerReferences": [owner]}},
        namespace=namespace,
        patch_type=PatchType.MERGE,
    )


@kopf.on.delete(*CLAIMS, retries=None, timeout=None, errors=kopf.ErrorsMode.TEMPORARY)
async def settle_before_removal(
    spec: kopf.Spec,
    uid: str,
    namespace: str | None,
    body: kopf.Body,
    retry: int,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """A claim is removed only once its settlement is recorded in the envelope's ledger:
    at once before the commit point, after the final report (or deadline) after it."""
    assert namespace is not None
    services: Services = memo.services
    try:
        result = await services.writer.reconcile_once(namespace, spec.get("envelope", ""))
    except LedgerStuckError as error:
        raise kopf.TemporaryError(f"the envelope's ledger cannot move: {error}", delay=30) from None
    if result is None:
        return  # no envelope: this claim never held anything
    entry = result.entry(uid)
    if entry is None or entry.phase.terminal:
        return
    if retry == 0:  # one deletion held back, however many times it is retried
        metrics.finalizer_waits.labels(namespace, "BranchClaim").inc()
    if retry % REMIND_EVERY_RETRIES == 0:  # an Event now and then, not on every retry
        kopf.warn(
            body,
            reason="AwaitingSettlement",
            message=f"deletion waits for settlement (claim is {entry.phase.value}): report "
            "final usage, wait for the ambiguity deadline, or annotate "
            "reservoir.dev/force-settle",
        )
    raise kopf.TemporaryError(
        f"waiting for settlement: the claim is {entry.phase.value}; report final usage, "
        "or wait for the ambiguity deadline, or annotate reservoir.dev/force-settle",
        delay=2,
    )
