"""A tenant pool's ledger writer: read the pool, the pools (which one a namespace draws
from) and the root envelopes of its namespaces, reconcile, compare-and-swap the status.
The same discipline as an envelope's writer (reservoir.k8s.ledger_writer): one writer per
pool, a 409 means re-read and recompute, Events only once the ledger is durable."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Mapping
from typing import Any

from lightkube import ApiError, AsyncClient
from lightkube.models.meta_v1 import ObjectMeta
from pydantic import ValidationError

from reservoir import metrics
from reservoir.core.budgets import ChildFacts
from reservoir.core.inflight import EnvelopeBehindError
from reservoir.core.ledger import InvariantViolationError
from reservoir.core.model import ReservationPoolSpec, ReservationPoolStatus
from reservoir.core.pool import PoolFacts, PoolReconciliation, reconcile_pool
from reservoir.k8s import budgets
from reservoir.k8s.clock import utcnow
from reservoir.k8s.facts import UnreadableEnvelopeError, as_dict, force_settle_gone
from reservoir.k8s.ledger_writer import MAX_ATTEMPTS, Conflict, LedgerStuckError, Recorder
from reservoir.k8s.resources import ReservationEnvelope, ReservationPool
from reservoir.k8s.triggers import Trigger, Triggers

log = logging.getLogger(__name__)


class PoolWriter:
    def __init__(
        self,
        client: AsyncClient,
        record: Recorder,
        poke_envelope: Callable[[str, str], None],
        clock: Callable[..., Any] = utcnow,
        watched: frozenset[str] | None = None,
    ) -> None:
        """watched: the namespaces this operator serves; None for the whole cluster."""
        self.client = client
        self.watched = watched
        self.record = record
        self.poke_envelope = poke_envelope
        self.clock = clock
        self._locks: dict[str, asyncio.Lock] = {}
        self._triggers: Triggers[str] = Triggers()

    def keeping(self, name: str) -> contextlib.AbstractContextManager[Trigger]:
        """While the pool's daemon waits for pokes on its trigger."""
        return self._triggers.holding(name)

    def poke(self, name: str) -> None:
        self._triggers.poke(name)

    async def reconcile_once(self, name: str) -> PoolReconciliation | None:
        """Converge one pool's ledger. None if the pool does not exist."""
        async with self._locks.setdefault(name, asyncio.Lock()):
            for attempt in range(MAX_ATTEMPTS):
                outcome = await self._attempt(name)
                if not isinstance(outcome, Conflict):
                    return outcome
                await asyncio.sleep(random.uniform(0, 0.05 * 2**attempt))
            raise RuntimeError(f"pool {name}: {MAX_ATTEMPTS} conflicts in a row")

    async def _attempt(self, name: str) -> PoolReconciliation | Conflict | None:
        try:
            pool = as_dict(await self.client.get(ReservationPool, name))
        except ApiError as error:
            if error.status.code == 404:
                metrics.pools.forget(name)
                return None
            raise
        meta = pool["metadata"]
        try:
            spec = ReservationPoolSpec.model_validate(pool.get("spec") or {})
            status = ReservationPoolStatus.model_validate(pool.get("status") or {})
        except ValidationError as error:
            self.record(pool, "Warning", "UnreadablePool", str(error)[:900])
            raise LedgerStuckError(f"pool {name}: unreadable: {error}") from None
        outside = sorted(set(spec.namespaces) - self.watched) if self.watched is not None else []
        if outside:
            # Another operator (or none) serves those namespaces: their envelopes' fate
            # cannot be read from here, so this operator leaves the pool alone.
            log.info("pool %s lists namespaces this operator does not watch: %s", name, outside)
            return PoolReconciliation(status, [], {}, lines=dict(status.children))
        facts = PoolFacts(
            spec=spec,
            name=name,
            uid=meta["uid"],
            generation=int(meta.get("generation", 1)),
            deleting=bool(meta.get("deletionTimestamp")),
            force_settle_gone=force_settle_gone(meta.get("annotations") or {}),
        )
        # Listed after the pool: an envelope its ledger names but no list holds is gone.
        pools = await budgets.list_pools(self.client)
        now = self.clock()
        try:
            envelopes, bodies = await self._envelopes(facts, status, pools, now)
        except UnreadableEnvelopeError as error:
            self.record(pool, "Warning", "UnreadableEnvelope", str(error)[:900])
            raise LedgerStuckError(f"pool {name}: {error}") from None
        try:
            result = reconcile_pool(facts, status, envelopes, now)
        except EnvelopeBehindError:
            return Conflict()  # an envelope shows a move newer than the pool as read
        except InvariantViolationError as error:
            self.record(pool, "Warning", "InvariantViolation", str(error)[:900])
            raise LedgerStuckError(f"pool {name}: {error}") from None
        if result.status != status:
            body = ReservationPool.Status(
                metadata=ObjectMeta(name=name, resourceVersion=meta["resourceVersion"]),
                status=result.status.to_api(),
            )
            try:
                await self.client.replace(body, name)
            except ApiError as error:
                if error.status.code == 409:
                    return Conflict()
                self.record(pool, "Warning", "WriteRefused", str(error.status.message)[:900])
                raise LedgerStuckError(f"pool {name}: {error.status.message}") from None
            # The envelopes with a line in flight copy it, those asked to give their room
            # decide; being deleted, the pool closes them all. (The others have nothing to
            # read here: a pool of thousands of envelopes wakes only those its write
            # concerns.)
            preempting = {r.preemptor_uid for r in result.status.preemptions.values()} | {
                r.preemptor_uid for r in status.preemptions.values()
            }
            for uid, envelope in bodies.items():
                # Asked to decide on a request, or waiting for those asked for it (its
                # queue reason counts them).
                asked = uid in result.status.preemptions or uid in preempting
                if facts.deleting or uid in result.status.children or asked:
                    meta = envelope["metadata"]
                    self.poke_envelope(meta["namespace"], meta["name"])
        metrics.pools.record(
            name,
            metrics.PoolSnapshot.of(
                result.status.totals, result.status.shares, len(result.status.preemptions)
            ),
        )
        for event in result.events:
            target = bodies.get(event.uid, pool)
            self.record(
                target, "Warning" if event.warning else "Normal", event.reason, event.message
            )
        return result

    async def _envelopes(
        self,
        pool: PoolFacts,
        status: ReservationPoolStatus,
        pools: list[dict[str, Any]],
        now: Any,
    ) -> tuple[list[ChildFacts], dict[str, Mapping[str, Any]]]:
        """The root envelopes this pool admits (its namespaces draw from it) and those its
        ledger already names."""
        facts: list[ChildFacts] = []
        bodies: dict[str, Mapping[str, Any]] = {}
        for namespace in pool.spec.namespaces:
            chosen = budgets.chosen_pool(pools, namespace)
            ours = chosen is not None and chosen["metadata"]["uid"] == pool.uid
            async for item in self.client.list(ReservationEnvelope, namespace=namespace):
                body = as_dict(item)
                uid = body["metadata"]["uid"]
                if (body.get("spec") or {}).get("parent") is not None:
                    continue  # drawn from its parent envelope, not from a pool
                fact = budgets.child_facts(body, now)
                drawn = uid in status.children or (
                    fact.record is not None and fact.record.uid == pool.uid
                )
                if not ours and not drawn:
                    continue  # another pool's
                facts.append(fact)
                bodies[uid] = body
        return facts, bodies
