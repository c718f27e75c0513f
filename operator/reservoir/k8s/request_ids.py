"""Claims by idempotency key (`spec.upstream.requestId`): what the writer's duplicate check
and the SDK's early refusal both read."""

from __future__ import annotations

from typing import Any

from lightkube import AsyncClient

from reservoir.k8s.facts import as_dict
from reservoir.k8s.resources import BranchClaim, field_value

DUPLICATE = "DuplicateRequestId"  # the settlement reason of a claim that lost its key


async def claims_with_request_id(
    client: AsyncClient, namespace: str, request_id: str
) -> list[dict[str, Any]]:
    """The claims of the namespace carrying exactly this key, those already rejected for
    repeating it left out. Selected by field (the value escaped), then compared: a match is
    never trusted blindly."""
    found = []
    async for claim in client.list(
        BranchClaim,
        namespace=namespace,
        fields={"spec.upstream.requestId": field_value(request_id)},
    ):
        body = as_dict(claim)
        if ((body.get("spec") or {}).get("upstream") or {}).get("requestId") != request_id:
            continue
        status = body.get("status") or {}
        settled = (status.get("ledger") or {}).get("settlement") or status.get("settlement")
        if (settled or {}).get("reason") == DUPLICATE:
            continue  # it lost already
        found.append(body)
    return found
