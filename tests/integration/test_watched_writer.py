"""The ledger writer reading claims from a watch-fed index, against the real API server,
with the index crafted to be stale: an index can lag the API server, and a decision that
takes or returns capacity must come out as it would on the claims read fresh.

Each test first builds the real state with a writer that lists from the API server, then
runs a writer whose index holds an older copy (or none) of a claim, and compares."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from lightkube import AsyncClient
from lightkube.types import PatchType

from reservoir.core.model import ClaimPhase, ReservationEnvelopeStatus
from reservoir.k8s.claim_source import WatchedClaims, claim_record
from reservoir.k8s.facts import as_dict
from reservoir.k8s.ledger_writer import LedgerWriter
from reservoir.k8s.resources import BranchClaim, ReservationEnvelope
from tests.clusters import ClusterHandle
from tests.integration.helpers import create_envelope, make_claim, under_lease
from tests.integration.helpers import with_client as run

START = datetime.now(UTC).replace(microsecond=0)


def no_events(obj: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    """These writers post no Events: the tests read the ledger instead."""


def at(seconds: float) -> Callable[[], datetime]:
    return lambda: START + timedelta(seconds=seconds)


async def claim_body(client: AsyncClient, ns: str, name: str) -> dict[str, Any]:
    return claim_record(as_dict(await client.get(BranchClaim, name, namespace=ns)))


async def ledger(client: AsyncClient, ns: str) -> ReservationEnvelopeStatus:
    body = as_dict(await client.get(ReservationEnvelope, "wf", namespace=ns))
    return ReservationEnvelopeStatus.model_validate(body.get("status") or {})


def watched(client: AsyncClient, ns: str, *claims: dict[str, Any], clock: float) -> LedgerWriter:
    """A writer whose index holds exactly `claims` for envelope wf, and no Leases."""
    writer = LedgerWriter(client, no_events, clock=at(clock))
    writer.source = WatchedClaims({(ns, "wf"): list(claims)}, {})
    return writer


def test_a_stale_copy_of_a_settled_and_compacted_claim_is_not_admitted_again(
    cluster: ClusterHandle, ns: str
) -> None:
    """The index still shows the claim as just created; the ledger has settled it and
    compacted its entry away (its status carries the record). Read as it stands in the
    index it is a new claim: admitting it would hold its capacity a second time."""
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=300)
    make_claim(cluster, ns, "x", dispatch=True)

    async def scenario(client: AsyncClient) -> tuple[ReservationEnvelopeStatus, Any]:
        created = await claim_body(client, ns, "x")
        listing = LedgerWriter(client, no_events, clock=at(1))
        await listing.reconcile_once(ns, "wf")
        final = {"usage": {"tokens": "5"}, "final": True, "outcome": "Succeeded"}
        await client.patch(
            BranchClaim,
            "x",
            {"spec": under_lease(await claim_body(client, ns, "x"), final)},
            namespace=ns,
            patch_type=PatchType.MERGE,
        )
        for _ in range(4):  # settle, mirror the settlement, compact
            await listing.reconcile_once(ns, "wf")
        before = await ledger(client, ns)
        assert created["metadata"]["uid"] not in before.entries, "compacted"
        result = await watched(client, ns, created, clock=2).reconcile_once(ns, "wf")
        return before, result

    before, result = run(cluster, scenario)
    assert result.status.totals == before.totals
    assert result.status.entries == before.entries
    assert result.status.counts == before.counts, result.status.counts


def test_a_dispatch_the_index_lacks_is_read_before_the_lease_end_returns_capacity(
    cluster: ClusterHandle, ns: str
) -> None:
    """The branch was dispatched before its lease ended, but the index still shows it
    undispatched: read as the index has it, the lease end would return its capacity
    (Expired) while the branch runs."""
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=30)
    make_claim(cluster, ns, "z")

    async def scenario(client: AsyncClient) -> tuple[ClaimPhase, ClaimPhase]:
        await LedgerWriter(client, no_events, clock=at(0)).reconcile_once(ns, "wf")
        stale = await claim_body(client, ns, "z")  # Tentative, not dispatched
        uid = stale["metadata"]["uid"]
        assert (await ledger(client, ns)).entries[uid].phase is ClaimPhase.TENTATIVE
        await client.patch(
            BranchClaim,
            "z",
            {"spec": under_lease(stale, {"dispatch": True})},
            namespace=ns,
            patch_type=PatchType.MERGE,
        )
        result = await watched(client, ns, stale, clock=45).reconcile_once(ns, "wf")
        fresh = LedgerWriter(client, no_events, clock=at(45))
        # The same decision a writer listing from the API server takes (its ledger is
        # the one just written; one more pass changes nothing).
        again = await fresh.reconcile_once(ns, "wf")
        return result.lines[uid].phase, again.lines[uid].phase

    seen, listed = run(cluster, scenario)
    assert seen is not ClaimPhase.EXPIRED
    assert seen is listed


def test_a_claim_the_index_lacks_but_the_ledger_holds_is_read_not_taken_for_gone(
    cluster: ClusterHandle, ns: str
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=300)
    make_claim(cluster, ns, "w")

    async def scenario(client: AsyncClient) -> tuple[Any, Any]:
        listing = LedgerWriter(client, no_events, clock=at(1))
        await listing.reconcile_once(ns, "wf")
        before = await ledger(client, ns)
        result = await watched(client, ns, clock=2).reconcile_once(ns, "wf")  # empty index
        return before, result

    before, result = run(cluster, scenario)
    # Not taken for gone: its line is still in view (retired from the envelope's record
    # once the claim shows it), and nothing moved.
    assert {u: e.phase for u, e in result.lines.items()} == {
        u: e.phase for u, e in before.entries.items()
    }
    assert result.status.totals == before.totals


def test_the_writers_own_status_write_is_laid_over_the_index_and_is_no_news(
    cluster: ClusterHandle, ns: str
) -> None:
    """After the writer mirrors a claim's status, its index (not yet updated by the watch)
    is read through the write: the next pass writes nothing again, and the watch event of
    that write is recognised as the writer's own."""
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=300)
    make_claim(cluster, ns, "v")

    async def scenario(client: AsyncClient) -> tuple[bool, bool, str, str]:
        stale = await claim_body(client, ns, "v")
        writer = watched(client, ns, stale, clock=1)
        await writer.reconcile_once(ns, "wf")
        mirrored = await claim_body(client, ns, "v")
        version = mirrored["metadata"]["resourceVersion"]
        await writer.reconcile_once(ns, "wf")  # reads the index (still stale) + the write
        unchanged = (await claim_body(client, ns, "v"))["metadata"]["resourceVersion"]
        uid = mirrored["metadata"]["uid"]
        return writer.own_write(uid, version), writer.own_write(uid, version), version, unchanged

    own, twice, version, unchanged = run(cluster, scenario)
    assert own, "the watch event of the writer's own write is not news"
    assert not twice, "only once: a later event of the same version is not expected"
    assert unchanged == version, "no second mirror against the stale copy"
