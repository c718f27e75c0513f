"""`get_object` reads an object with a LIST selecting it by name, which the API server
answers from its watch cache: it must still be a read of the latest version (a consistent
read), or a decision taken on it would rest on a stale fact."""

from __future__ import annotations

import asyncio
from typing import Any

from lightkube import AsyncClient, KubeConfig
from lightkube.types import PatchType

from reservoir.k8s.facts import as_dict
from reservoir.k8s.resources import ReservationEnvelope, get_object
from tests.clusters import ClusterHandle
from tests.integration.helpers import create_envelope


def test_a_read_right_after_a_write_sees_the_write(cluster: ClusterHandle, ns: str) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100"})

    async def scenario() -> tuple[list[tuple[str, str]], Any, Any]:
        client = AsyncClient(config=KubeConfig.from_file(str(cluster.kubeconfig_path)))
        try:
            seen: list[tuple[str, str]] = []
            for count in range(50):
                written = await client.patch(
                    ReservationEnvelope,
                    "wf",
                    {"metadata": {"annotations": {"example.com/count": str(count)}}},
                    namespace=ns,
                    patch_type=PatchType.MERGE,
                )
                read = await get_object(client, ReservationEnvelope, "wf", ns)
                assert read is not None
                seen.append(
                    (
                        as_dict(written)["metadata"]["resourceVersion"],
                        read["metadata"]["resourceVersion"],
                    )
                )
            missing = await get_object(client, ReservationEnvelope, "nope", ns)
            other_namespace = await get_object(client, ReservationEnvelope, "wf", f"{ns}-other")
            return seen, missing, other_namespace
        finally:
            await client.close()

    seen, missing, other_namespace = asyncio.run(scenario())
    stale = [pair for pair in seen if pair[0] != pair[1]]
    assert not stale, f"reads behind the write they followed: {stale}"
    assert missing is None
    assert other_namespace is None
