"""Fair sharing on the real control plane: three namespaces with weights 1, 1 and 2 draw
on one ReservationPool under saturation (each keeps envelopes waiting all the time; each
envelope goes a few seconds after its admission) for two and a half minutes. Their
time-averaged holdings, read from the pool's own status, are within 0.08 of the pool of
1/4, 1/4 and 1/2; afterwards everything is back in the pool. bench/fairshare.py is the
driver (`bench/run.py --only fairshare` runs it longer and plots it)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from decimal import Decimal

import pytest
from bench import fairshare

from tests.clusters import ClusterHandle
from tests.integration.conftest import StartOperator

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
