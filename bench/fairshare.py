"""Fair sharing under saturation: namespaces with weights drawing on one ReservationPool,
each keeping envelopes waiting all the time, each envelope let go a few seconds after the
pool admits it. What each namespace holds is sampled from the pool's own status
(`status.shares`) every second; the figure is each namespace's time-averaged fraction of
the pool against weight / Σ weights.

Used by `bench/run.py --only fairshare` (minutes, with a plot) and by the integration test
tests/integration/test_fair_sharing.py (shorter, with a stated tolerance). Talks to the API
server like any client (lightkube); it knows nothing of the operator's arithmetic.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from lightkube import ApiError, Client
from lightkube.codecs import from_dict
from lightkube.config.kubeconfig import KubeConfig

from reservoir.k8s.resources import ReservationEnvelope, ReservationPool

RESOURCE = "slots"
API_VERSION = "reservoir.dev/v1alpha1"


@dataclass(frozen=True)
class Saturation:
    weights: Mapping[str, int]  # namespace -> weight in the pool
    capacity: int = 12  # slots in the pool
    size: int = 1  # slots per envelope
    hold_seconds: float = 3.0  # an admitted envelope is deleted this long after admission
    waiting: int = 3  # envelopes each namespace keeps waiting
    seconds: float = 120.0  # how long the pool stays saturated
    warm_up_seconds: float = 15.0  # not sampled: the first admissions fill the pool by age
    every: float = 1.0  # sampling period


@dataclass
class Outcome:
    samples: list[dict[str, Any]] = field(default_factory=list)  # t, held per namespace
    admitted: dict[str, int] = field(default_factory=dict)  # envelopes admitted per namespace
    created: dict[str, int] = field(default_factory=dict)

    def fractions(self, warm_up: float) -> dict[str, Decimal]:
        """Each namespace's time-averaged fraction of what was held after the warm-up."""
        held: dict[str, Decimal] = {}
        for sample in self.samples:
            if sample["t"] < warm_up:
                continue
            for namespace, amount in sample["held"].items():
                held[namespace] = held.get(namespace, Decimal(0)) + Decimal(amount)
        total = sum(held.values(), Decimal(0))
        return {ns: (v / total if total else Decimal(0)) for ns, v in sorted(held.items())}

    def expected(self, weights: Mapping[str, int]) -> dict[str, Decimal]:
        total = sum(weights.values())
        return {ns: Decimal(w) / total for ns, w in sorted(weights.items())}


def client_for(kubeconfig: str) -> Client:
    return Client(config=KubeConfig.from_file(kubeconfig), field_manager="fairshare-bench")


def create_pool(client: Client, name: str, shape: Saturation) -> None:
    client.create(
        from_dict(
            {
                "apiVersion": API_VERSION,
                "kind": "ReservationPool",
                "metadata": {"name": name},
                "spec": {
                    "capacity": {RESOURCE: str(shape.capacity)},
                    "namespaces": sorted(shape.weights),
                    "shares": {ns: {"weight": w} for ns, w in shape.weights.items()},
                },
            }
        )
    )


def envelope_object(namespace: str, name: str, size: int) -> Any:
    return from_dict(
        {
            "apiVersion": API_VERSION,
            "kind": "ReservationEnvelope",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": {"bench.reservoir.dev/fairshare": "true"},
            },
            "spec": {"capacity": {RESOURCE: str(size)}},
        }
    )


def _admitted(envelope: Any) -> bool:
    record = ((envelope.get("status") or {}).get("parent")) or {}
    return record.get("kind") == "ReservationPool" and bool(record.get("admittedAt"))


def run(client: Client, pool: str, shape: Saturation) -> Outcome:
    """Saturate `pool` (already created, its namespaces existing and served by an operator)
    for `shape.seconds`; returns the samples. Every envelope it made is deleted at the end."""
    outcome = Outcome(
        admitted={ns: 0 for ns in shape.weights}, created={ns: 0 for ns in shape.weights}
    )
    seen_admitted: dict[str, float] = {}  # namespace/name -> when first seen admitted
    deleted: set[str] = set()
    started = time.monotonic()
    next_sample = started
    while (now := time.monotonic()) - started < shape.seconds:
        for namespace in shape.weights:
            waiting = 0
            for item in client.list(
                ReservationEnvelope,
                namespace=namespace,
                labels={"bench.reservoir.dev/fairshare": "true"},
            ):
                body = item.to_dict()
                key = f"{namespace}/{body['metadata']['name']}"
                if key in deleted:
                    continue
                if _admitted(body):
                    if key not in seen_admitted:
                        seen_admitted[key] = now
                        outcome.admitted[namespace] += 1
                    elif now - seen_admitted[key] >= shape.hold_seconds:
                        delete(client, namespace, body["metadata"]["name"])
                        deleted.add(key)
                elif not body["metadata"].get("deletionTimestamp"):
                    waiting += 1
            for _ in range(shape.waiting - waiting):
                name = f"fs-{outcome.created[namespace]:05d}"
                outcome.created[namespace] += 1
                client.create(envelope_object(namespace, name, shape.size))
        if now >= next_sample:
            status = client.get(ReservationPool, pool).to_dict().get("status") or {}
            shares = status.get("shares") or {}
            held = {
                ns: str(((shares.get(ns) or {}).get("held") or {}).get(RESOURCE, "0"))
                for ns in shape.weights
            }
            outcome.samples.append({"t": round(now - started, 2), "held": held})
            next_sample += shape.every
        time.sleep(0.2)
    for namespace in shape.weights:
        for item in client.list(
            ReservationEnvelope,
            namespace=namespace,
            labels={"bench.reservoir.dev/fairshare": "true"},
        ):
            delete(client, namespace, item.metadata.name)
    return outcome


def delete(client: Client, namespace: str, name: str, kind: Any = ReservationEnvelope) -> None:
    """Delete an object the benchmark made (one already gone is fine)."""
    try:
        client.delete(kind, name, namespace=namespace)
    except ApiError as error:
        if error.status.code != 404:
            raise


def wait_returned(client: Client, pool: str, within: float = 120) -> dict[str, Any]:
    """Once every envelope has gone: the pool's totals, everything back."""
    deadline = time.monotonic() + within
    while True:
        status = client.get(ReservationPool, pool).to_dict().get("status") or {}
        reserved = ((status.get("totals") or {}).get("reserved") or {}).get(RESOURCE, "0")
        if str(reserved) == "0" and not status.get("children"):
            return status
        if time.monotonic() > deadline:
            raise RuntimeError(f"pool {pool} still holds {reserved} after {within:.0f} s")
        time.sleep(0.5)
