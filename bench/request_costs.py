"""The API server's CPU per request, one kind of request at a time, on an envelope with
`claims` live claims (each holding its own ledger line since issue 23): what a fresh read
(a GET from etcd, or a consistent LIST by name from the watch cache), an envelope status
write and a claim status write cost. The figures behind `get_object` (reads by LIST) and
`recorded_map` (no CEL rules on statuses); the `requests` scenario of bench/run.py runs
it.

What the claim's schema and CEL rules cost a write: the same JSON patches (the SDK's usage
report to the spec, the operator's whole status) on claim c-000 and on a copy of it kept as
a schemaless RawClaim (bench/load.py's baseline kind, installed by bench/run.py)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from lightkube import ApiError, AsyncClient
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.types import PatchType

from load import RawClaim
from reservoir.k8s.facts import as_dict
from reservoir.k8s.ledger_writer import LedgerWriter
from reservoir.k8s.resources import (
    BranchClaim,
    ReservationEnvelope,
    ReservationPool,
    get_object,
)

# A request kind and the call that makes one request of it.
Request = Callable[[int], Awaitable[Any]]


async def served(client: AsyncClient, namespace: str, within: float = 60.0) -> None:
    """Until the API server serves Reservoir's kinds from its watch cache (a CRD just
    created answers 429 "storage is (re)initializing" for a while)."""
    deadline = time.monotonic() + within
    while True:
        try:
            await get_object(client, ReservationPool, "none", None)
            for kind in (ReservationEnvelope, BranchClaim):
                await get_object(client, kind, "none", namespace)
            return
        except ApiError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1.0)


async def fill_ledger(client: AsyncClient, namespace: str, claims: int) -> dict[str, Any]:
    """An envelope with `claims` dispatched claims in its ledger, written by the writer
    itself (no operator runs): the envelope as it then stands."""
    await served(client, namespace)
    await client.create(
        ReservationEnvelope(
            metadata=ObjectMeta(name="costs", namespace=namespace),
            spec={
                "capacity": {"tokens": "1M", "cost": "1000"},
                "policy": {"maxActiveClaims": claims},
            },
        )
    )
    for index in range(claims):
        await client.create(
            BranchClaim(
                metadata=ObjectMeta(name=f"c-{index:03d}", namespace=namespace),
                spec={
                    "envelope": "costs",
                    "branch": f"b{index}",
                    "requests": {"tokens": "20", "cost": "1"},
                    "dispatch": True,
                },
            )
        )
    writer = LedgerWriter(client, lambda *_: None)
    for _ in range(3):  # admit, commit, mirror
        await writer.reconcile_once(namespace, "costs")
    envelope = await get_object(client, ReservationEnvelope, "costs", namespace)
    assert envelope is not None
    return envelope


async def raw_copy(client: AsyncClient, namespace: str) -> dict[str, Any]:
    """Claim c-000 as it stands, and a schemaless RawClaim of the same name, spec and
    status: the same bytes under no schema and no CEL rule."""
    claim = await get_object(client, BranchClaim, "c-000", namespace)
    assert claim is not None
    await client.create(
        RawClaim(metadata=ObjectMeta(name="c-000", namespace=namespace), spec=claim["spec"])
    )
    await client.patch(
        RawClaim.Status,
        "c-000",
        {"status": claim["status"]},
        namespace=namespace,
        patch_type=PatchType.MERGE,
    )
    return claim


def requests(
    client: AsyncClient, namespace: str, envelope: dict[str, Any], claim: dict[str, Any]
) -> dict[str, Request]:
    current = {"envelope": envelope}
    status = claim["status"]

    def whole_status(count: int) -> list[dict[str, Any]]:
        """The operator's kind of status write: the whole status, one field moved."""
        moved = {**status, "observedGeneration": count + 1}
        return [{"op": "replace", "path": "/status", "value": moved}]

    def usage_report(count: int) -> list[dict[str, Any]]:
        """The SDK's kind of spec write: cumulative usage, growing."""
        return [{"op": "add", "path": "/spec/usage", "value": {"tokens": str(count + 1)}}]

    def json_patch(kind: Any, body: Callable[[int], list[dict[str, Any]]]) -> Request:
        async def send(count: int) -> None:
            await client.patch(
                kind, "c-000", body(count), namespace=namespace, patch_type=PatchType.JSON
            )

        return send

    async def envelope_status_write(count: int) -> None:
        body = current["envelope"]
        body["status"]["stamp"] = int(body["status"].get("stamp") or 0) + 1  # a real change
        written = await client.replace(
            ReservationEnvelope.Status(
                metadata=ObjectMeta(
                    name="costs",
                    namespace=namespace,
                    resourceVersion=body["metadata"]["resourceVersion"],
                ),
                status=body["status"],
            ),
            "costs",
            namespace=namespace,
        )
        current["envelope"] = as_dict(written)

    async def claim_status_write(count: int) -> None:
        await client.patch(
            BranchClaim.Status,
            "c-000",
            {"status": {"renewals": count + 1}},
            namespace=namespace,
            patch_type=PatchType.MERGE,
        )

    async def envelope_get(_: int) -> None:
        await client.get(ReservationEnvelope, "costs", namespace=namespace)

    async def envelope_list_by_name(_: int) -> None:
        await get_object(client, ReservationEnvelope, "costs", namespace)

    async def claim_get(_: int) -> None:
        await client.get(BranchClaim, "c-000", namespace=namespace)

    async def claim_list_by_name(_: int) -> None:
        await get_object(client, BranchClaim, "c-000", namespace)

    return {
        "envelope GET (from etcd)": envelope_get,
        "envelope LIST by name (watch cache)": envelope_list_by_name,
        "envelope status write (whole ledger)": envelope_status_write,
        "claim GET (from etcd)": claim_get,
        "claim LIST by name (watch cache)": claim_list_by_name,
        "claim status write (merge patch)": claim_status_write,
        "claim whole-status write (schema)": json_patch(BranchClaim.Status, whole_status),
        "raw claim whole-status write (no schema)": json_patch(RawClaim.Status, whole_status),
        "claim usage report (schema + CEL)": json_patch(BranchClaim, usage_report),
        "raw claim usage report (no schema)": json_patch(RawClaim, usage_report),
    }


async def measure(
    client: AsyncClient, apiserver_cpu: Callable[[], float], namespace: str, claims: int, count: int
) -> dict[str, Any]:
    """Milliseconds of API server CPU (and of wall time) per request of each kind, over
    `count` requests made one after another."""
    envelope = await fill_ledger(client, namespace, claims)
    claim = await raw_copy(client, namespace)
    figures: dict[str, Any] = {
        "ledger_entries": int((envelope["status"].get("claimRecords") or {}).get("count", 0))
        + len(envelope["status"].get("entries") or {}),
        "envelope_bytes": len(json.dumps(envelope)),
        "per_request_ms": {},
    }
    for kind, request in requests(client, namespace, envelope, claim).items():
        cpu, began = apiserver_cpu(), time.monotonic()
        for index in range(count):
            await request(index)
        figures["per_request_ms"][kind] = {
            "apiserver_cpu": round((apiserver_cpu() - cpu) / count * 1000, 2),
            "wall": round((time.monotonic() - began) / count * 1000, 2),
        }
    return figures
