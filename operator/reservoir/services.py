"""The operator's services, built once at start-up and shared by every handler."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import kopf
from lightkube import AsyncClient

from reservoir.endpoints import Health
from reservoir.k8s.devices import DeviceHolder, PlacementAllowList
from reservoir.k8s.informer import Informer
from reservoir.k8s.ledger_writer import LedgerWriter
from reservoir.k8s.per_object import LatestPerObject
from reservoir.k8s.pool_writer import PoolWriter
from reservoir.k8s.provider_http import ProviderHttp, ProviderSettings
from reservoir.k8s.providers import ProviderClient
from reservoir.k8s.resources import FIELD_MANAGER, ReservationEnvelope
from reservoir.k8s.transition_events import TransitionEvents
from reservoir.k8s.transport import fast_client


def post_event(obj: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    """Kubernetes Events through kopf's poster (batched, non-blocking)."""
    kopf.event(dict(obj), type=type_, reason=reason, message=message[:1000])  # type: ignore[arg-type]


def placement_allow_list() -> PlacementAllowList | None:
    """The administrator's allow-list of placement hints (reservoir-operator
    --restrict-placement), or None: hints are copied as they are."""
    given = os.environ.get("RESERVOIR_PLACEMENT_ALLOWED")
    if not given:
        return None
    keys = json.loads(given)
    return PlacementAllowList(
        toleration_keys=frozenset(keys["tolerationKeys"]),
        node_label_keys=frozenset(keys["nodeLabelKeys"]),
    )


@dataclass
class Services:
    client: AsyncClient
    writer: LedgerWriter
    pools: PoolWriter
    health: Health
    # The watch-fed records of claims and their Leases, and the adoptions of claims made
    # without the SDK: made at start-up, with the handlers they call (handlers/startup.py).
    claims: Informer = field(init=False, repr=False)
    leases: Informer = field(init=False, repr=False)
    adoptions: LatestPerObject = field(init=False, repr=False)
    # Set once every watched kind's first list is complete (when kopf starts its daemons).
    indexed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @classmethod
    def build(cls) -> Services:
        client = fast_client(field_manager=FIELD_MANAGER)
        priority_class = os.environ.get("RESERVOIR_PLACEHOLDER_PRIORITY_CLASS") or None
        devices = DeviceHolder(client, priority_class, placement_allow_list())
        # HTTP providers: the administrator's allow-list, caps and rates (the CLI's flags).
        providers = ProviderClient(client, ProviderHttp(ProviderSettings.from_env()))
        writer = LedgerWriter(client, post_event, devices=devices, providers=providers)
        writer.transition_events = TransitionEvents(
            os.environ.get("RESERVOIR_TRANSITION_EVENTS") or TransitionEvents.EXCEPTIONS
        )
        after = int(os.environ.get("RESERVOIR_QUEUE_REASON_AFTER") or 0)
        writer.queue_reason_after = timedelta(seconds=max(after, 0))
        watched = os.environ.get("RESERVOIR_WATCHED_NAMESPACES") or ""
        pools = PoolWriter(
            client,
            post_event,
            writer.poke,
            watched=frozenset(watched.split(",")) if watched else None,
        )
        writer.poke_pool = pools.poke
        return cls(client=client, writer=writer, pools=pools, health=Health())

    async def probe_api(self) -> None:
        """The cheapest read the operator is allowed: one envelope of a watched namespace
        (any namespace when it watches the whole cluster)."""
        namespace = os.environ.get("RESERVOIR_PROBE_NAMESPACE") or "*"
        async for _ in self.client.list(ReservationEnvelope, namespace=namespace, chunk_size=1):
            break
