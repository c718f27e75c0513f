"""The two writers of a claim fence on what each depends on, against the real API server:
the operator's status mirror on the status it read (`status_patch`), the SDK's spec
writes on the UID and generation of the claim it checked (`fenced_patch`). Neither is
refused by the other's writes; each is refused when what it checked has moved."""

from __future__ import annotations

from typing import Any

from lightkube import ApiError, AsyncClient
from lightkube.types import PatchType

from reservoir.core.model import BranchClaimStatus, ClaimPhase
from reservoir.k8s.facts import as_dict
from reservoir.k8s.ledger_writer import (
    reencoded_text,
    status_moved,
    status_patch,
    write_claim_status,
)
from reservoir.k8s.resources import BranchClaim
from reservoir.sdk.client import fenced_patch
from reservoir.sdk.views import ClaimView
from tests.clusters import ClusterHandle
from tests.integration.helpers import make_claim
from tests.integration.helpers import with_client as run


async def body(client: AsyncClient, ns: str, name: str) -> dict[str, Any]:
    return as_dict(await client.get(BranchClaim, name, namespace=ns))


async def write_status(client: AsyncClient, ns: str, claim: dict[str, Any], status: Any) -> Any:
    return await client.patch(
        BranchClaim.Status,
        claim["metadata"]["name"],
        status_patch(claim, status),
        namespace=ns,
        patch_type=PatchType.JSON,
    )


async def write_spec(client: AsyncClient, ns: str, view: ClaimView, spec: dict[str, Any]) -> Any:
    return await client.patch(
        BranchClaim,
        view.name,
        fenced_patch(view, spec),
        namespace=ns,
        patch_type=PatchType.JSON,
    )


def test_a_status_patch_applies_over_a_spec_write_but_never_over_another_status(
    cluster: ClusterHandle, ns: str
) -> None:
    make_claim(cluster, ns, "s")

    async def refused(client: AsyncClient, claim: dict[str, Any], status: Any) -> int:
        try:
            await write_status(client, ns, claim, status)
        except ApiError as error:
            return error.status.code or 0
        return 0

    async def scenario(client: AsyncClient) -> tuple[Any, Any, list[int], bool, Any]:
        first = await body(client, ns, "s")
        assert first["status"] == {"phase": "Pending"}  # the CRD's default, unwritten
        # The SDK dispatches on the ledger's word before the first status is written:
        # the resourceVersion moves, the (default) status read still stands.
        fenced = {"dispatch": True, "lease": {"fence": {"generation": 0}}}  # no lease yet
        await client.patch(
            BranchClaim, "s", {"spec": fenced}, namespace=ns, patch_type=PatchType.MERGE
        )
        await write_status(client, ns, first, {"phase": "Tentative"})
        read = await body(client, ns, "s")
        tentative = read["status"]
        await client.patch(
            BranchClaim,
            "s",
            {"spec": {"usage": {"tokens": "3"}}},
            namespace=ns,
            patch_type=PatchType.MERGE,
        )
        await write_status(client, ns, read, {"phase": "Committed"})
        committed = (await body(client, ns, "s"))["status"]
        # Other writers (a deposed operator) write statuses computed from older reads:
        # the status moved since, so each is refused and what is recorded stays.
        codes = [
            await refused(client, first, {"phase": "Pending"}),
            await refused(client, read, {"phase": "Expired"}),
        ]
        after = await body(client, ns, "s")
        return tentative, committed, codes, status_moved(read, after), after

    tentative, committed, codes, moved, after = run(cluster, scenario)
    assert tentative == {"phase": "Tentative"}
    assert committed == {"phase": "Committed"}
    assert codes == [422, 422]
    assert moved, "the refusal is told apart from an invalid status by the status read fresh"
    assert not status_moved(after, after)
    assert after["status"] == {"phase": "Committed"}


def test_a_spec_patch_applies_over_a_status_write_but_not_over_another_spec_write(
    cluster: ClusterHandle, ns: str
) -> None:
    make_claim(cluster, ns, "d", usage={"tokens": "5", "nvidia.com/gpu": "1"})

    async def scenario(client: AsyncClient) -> tuple[dict[str, Any], int, int]:
        view = ClaimView.from_api(await body(client, ns, "d"))
        # The operator mirrors a status: the generation the view read still stands.
        await client.patch(
            BranchClaim.Status,
            "d",
            {"status": {"phase": "Tentative"}},
            namespace=ns,
            patch_type=PatchType.MERGE,
        )
        await write_spec(client, ns, view, {"dispatch": True})
        moved = ClaimView.from_api(await body(client, ns, "d"))
        # A usage report merges key by key (a resource name with a "/" included).
        await write_spec(client, ns, moved, {"usage": {"nvidia.com/gpu": "2"}})
        spec = (await body(client, ns, "d"))["spec"]
        # The view from before the dispatch is stale now: its write is refused.
        code = 0
        try:
            await write_spec(client, ns, view, {"cancel": True})
        except ApiError as error:
            code = error.status.code or 0
        return spec, code, moved.generation

    spec, code, generation = run(cluster, scenario)
    assert spec["dispatch"] is True
    assert spec["usage"] == {"tokens": "5", "nvidia.com/gpu": "2"}
    assert spec["cancel"] is False
    assert code == 422
    assert generation == 2


def test_a_status_with_text_the_api_server_reencodes_is_still_written(
    cluster: ClusterHandle, ns: str
) -> None:
    """The API server encodes "<", ">", "&" (and U+2028/9) escaped, and its JSON patch test
    compares strings as encoded: a status holding one never tests equal to itself. Such
    a status is written conditional on the resourceVersion instead (found by review: a
    provider's error "<queued>" in a condition message froze the claim's status)."""
    make_claim(cluster, ns, "t")
    message = "answer has an unknown state '<queued>' & more\u2028"

    async def scenario(client: AsyncClient) -> tuple[Any, Any, int]:
        first = await body(client, ns, "t")
        await write_claim_status(
            client, ns, first, BranchClaimStatus(phase=ClaimPhase.PENDING, queue_reason=message)
        )
        read = await body(client, ns, "t")
        assert reencoded_text(read["status"])
        await write_claim_status(
            client,
            ns,
            read,
            BranchClaimStatus(phase=ClaimPhase.PENDING, queue_reason=message + "!"),
        )
        written = (await body(client, ns, "t"))["status"]
        code = 0  # the copy written over is stale now: refused, not overwritten
        try:
            await write_claim_status(client, ns, read, BranchClaimStatus(phase=ClaimPhase.EXPIRED))
        except ApiError as error:
            code = error.status.code or 0
        return read["status"], written, code

    first, written, code = run(cluster, scenario)
    assert first["phase"] == "Pending" and first["queueReason"] == message
    assert written["queueReason"] == message + "!"
    assert code == 409
