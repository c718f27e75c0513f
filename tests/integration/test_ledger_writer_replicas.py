"""Two ledger writers (two operator replicas) interleaved at the worst moment, against the
real API server: a replica whose recompute finds nothing to change must not mirror a
claim status from a ledger that another replica has since moved on."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from lightkube import AsyncClient, KubeConfig

from reservoir.k8s.facts import as_dict
from reservoir.k8s.ledger_writer import LedgerWriter
from reservoir.k8s.resources import BranchClaim
from tests.clusters import ClusterHandle
from tests.integration.helpers import create_envelope


def no_events(obj: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    """These writers post no Events: the test reads the ledger and statuses instead."""


def test_a_replica_with_nothing_to_write_never_rolls_back_a_newer_mirror(
    cluster: ClusterHandle, ns: str
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=30)
    claim = {
        "apiVersion": "reservoir.dev/v1alpha1",
        "kind": "BranchClaim",
        "metadata": {"name": "x", "namespace": ns},
        "spec": {"envelope": "wf", "requests": {"tokens": "20"}, "dispatch": True},
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(claim))
    start = datetime.now(UTC)

    async def scenario() -> str:
        config = KubeConfig.from_file(str(cluster.kubeconfig_path))
        slow_client, fast_client = AsyncClient(config=config), AsyncClient(config=config)
        # The two replicas' clocks: the fast one already sees the lease end.
        slow = LedgerWriter(slow_client, no_events, clock=lambda: start)
        fast = LedgerWriter(fast_client, no_events, clock=lambda: start + timedelta(minutes=5))
        await slow.reconcile_once(ns, "wf")  # admits x: Committed, lease to start + 30 s

        # The slow replica reads the ledger; before it lists the claims, the fast one
        # detaches x (its lease lapsed) and mirrors that into x's status.
        original_list = slow_client.list

        def list_after_the_other_replica(resource: Any, *args: Any, **kwargs: Any) -> Any:
            async def listing() -> Any:
                if resource is BranchClaim:
                    await fast.reconcile_once(ns, "wf")
                async for item in original_list(resource, *args, **kwargs):
                    yield item

            return listing()

        slow_client.list = list_after_the_other_replica  # type: ignore[method-assign]
        await slow.reconcile_once(ns, "wf")
        slow_client.list = original_list  # type: ignore[method-assign]
        got = await fast_client.get(BranchClaim, "x", namespace=ns)
        await slow_client.close()
        await fast_client.close()
        return str(as_dict(got)["status"]["phase"])

    assert asyncio.run(scenario()) == "Detached", "the newer mirror stands"
