"""Fair sharing on the real control plane: three namespaces with weights 1, 1 and 2 draw
on one ReservationPool under saturation (each keeps envelopes waiting all the time; each
envelope goes a few seconds after its admission) for two and a half minutes. Their
time-averaged holdings, read from the pool's own status, are within 0.08 of the pool of
1/4, 1/4 and 1/2; afterwards everything is back in the pool. bench/fairshare.py is the
driver (`bench/run.py --only fairshare` runs it longer and plots it)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from decimal import Decimal

import pytest
from bench import fairshare

from reservoir.sdk import Reservoir
from tests.clusters import ClusterHandle
from tests.integration.conftest import StartOperator
from tests.integration.helpers import eventually, plugin

TOLERANCE = Decimal("0.08")


@pytest.fixture
def namespaces(cluster: ClusterHandle, ns: str) -> Iterator[list[str]]:
    others = [f"{ns}-b", f"{ns}-c"]
    for name in others:
        cluster.kubectl("create", "namespace", name)
    yield [ns, *others]
    for name in others:
        cluster.kubectl("delete", "namespace", name, "--wait=false")


def test_weights_1_1_2_share_a_saturated_pool_1_1_2(
    cluster: ClusterHandle, namespaces: list[str], start_operator: StartOperator
) -> None:
    a, b, c = namespaces
    start_operator("-n", b, "-n", c)  # with the fixture's own -n a: all three
    client = fairshare.client_for(str(cluster.kubeconfig_path))
    pool = f"fair-{uuid.uuid4().hex[:8]}"
    shape = fairshare.Saturation(weights={a: 1, b: 1, c: 2}, seconds=150)
    fairshare.create_pool(client, pool, shape)
    try:
        outcome = fairshare.run(client, pool, shape)
        fractions = outcome.fractions(shape.warm_up_seconds)
        expected = outcome.expected(shape.weights)
        assert len(outcome.samples) > 100
        for namespace, share in expected.items():
            assert abs(fractions[namespace] - share) <= TOLERANCE, (fractions, outcome.admitted)
        # Every namespace was admitted over and over, not once at the start.
        assert all(n >= 10 for n in outcome.admitted.values()), outcome.admitted
        status = fairshare.wait_returned(client, pool)
        assert status["totals"]["available"] == {fairshare.RESOURCE: "12"}
    finally:
        cluster.kubectl("delete", "rpool", pool, "--wait=false", "--ignore-not-found")


def test_why_shows_the_pools_queue_and_a_claims_place_from_what_is_recorded(
    cluster: ClusterHandle, namespaces: list[str], start_operator: StartOperator
) -> None:
    """One slot, held by a's envelope; b's envelope waits behind a's second one (a holds the
    whole pool, so b goes first once it frees); a claim waits inside a's admitted envelope.
    `kubectl reservoir why` says so, as a user runs it."""
    a, b, c = namespaces
    start_operator("-n", b, "-n", c)
    client = fairshare.client_for(str(cluster.kubeconfig_path))
    pool = f"why-{uuid.uuid4().hex[:8]}"
    shape = fairshare.Saturation(weights={a: 1, b: 1, c: 2}, capacity=1)
    fairshare.create_pool(client, pool, shape)
    try:
        client.create(fairshare.envelope_object(a, "holder", 1))
        eventually("a's envelope admitted", lambda: admitted(cluster, a, "holder"))
        client.create(fairshare.envelope_object(a, "second", 1))
        client.create(fairshare.envelope_object(b, "nightly", 1))
        eventually(
            "the pool to count both waiting",
            lambda: waiting_in(cluster, pool) == {a: 1, b: 1},
        )
        shown = plugin(cluster, b, "why", "renv/nightly")
        assert shown.returncode == 0, shown.stderr
        text = shown.stdout
        assert text.startswith("reservationenvelope/nightly is Pending: waiting for room in")
        assert f"namespace {b}: weight 1" in text
        assert "the pool's queue: 1 of 2 it can see" in text, text
        rows = [line.split() for line in text.splitlines() if line.startswith((a, b))]
        assert [(row[0], row[2]) for row in rows] == [(b, "0.0000"), (a, "1.0000")], text

        # A claim waiting in a's admitted envelope: its place there, nothing about the pool.
        sdk_hold(cluster, a, "holder", "first")
        sdk_hold(cluster, a, "holder", "waiting")
        eventually("the second claim to wait", lambda: claim_phase(cluster, a, "waiting"))
        shown = plugin(cluster, a, "why", "waiting")
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.startswith("branchclaim/waiting is Pending: "), shown.stdout
        assert "its envelope's queue (priority, then age): 1 of 1" in shown.stdout
        assert "pool" not in shown.stdout
        missing = plugin(cluster, a, "why", "no-such-claim")
        assert missing.returncode == 1 and missing.stderr.startswith("error: "), missing
    finally:
        cluster.kubectl("delete", "renv", "--all", "-n", a, "--wait=false")
        cluster.kubectl("delete", "renv", "--all", "-n", b, "--wait=false")
        cluster.kubectl("delete", "rpool", pool, "--wait=false", "--ignore-not-found")


def admitted(cluster: ClusterHandle, ns: str, name: str) -> bool:
    body = json.loads(cluster.kubectl("get", "renv", name, "-n", ns, "-o", "json"))
    return bool(((body.get("status") or {}).get("parent") or {}).get("admittedAt"))


def waiting_in(cluster: ClusterHandle, pool: str) -> dict[str, int]:
    body = json.loads(cluster.kubectl("get", "rpool", pool, "-o", "json"))
    shares = (body.get("status") or {}).get("shares") or {}
    return {ns: usage["waiting"] for ns, usage in shares.items() if usage.get("waiting")}


def sdk_hold(cluster: ClusterHandle, ns: str, envelope: str, name: str) -> None:
    with Reservoir(namespace=ns, kubeconfig=str(cluster.kubeconfig_path)) as sdk:
        sdk.hold(envelope, name, {fairshare.RESOURCE: "1"}, name=name, lease_seconds=300)


def claim_phase(cluster: ClusterHandle, ns: str, name: str) -> bool:
    body = json.loads(cluster.kubectl("get", "bclaim", name, "-n", ns, "-o", "json"))
    return (body.get("status") or {}).get("phase") == "Pending"
