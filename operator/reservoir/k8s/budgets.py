"""Read the budget tree around an envelope: the parent it draws from (an envelope or the
tenant's pool) and the child envelopes drawing on it, into the core's facts.

Each read is fresh from the API server, after the envelope itself, so a child the list
lacks really is gone (and so is the line it held). A child whose spec cannot be read is
never admitted, its line kept as it recorded it; a child whose status (its line) or a
parent that cannot be read stops the reconcile (reported on the envelope, retried): never
read as gone, which would take the child's line for lost or close the whole subtree.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from lightkube import ApiError, AsyncClient
from pydantic import ValidationError

from reservoir.core.borrowing import SiblingFacts
from reservoir.core.budgets import ChildFacts, ParentView, drawn_part
from reservoir.core.fairshare import pool_refusal
from reservoir.core.model import (
    MAX_DEPTH,
    ParentKind,
    ParentRecord,
    ReservationEnvelopeSpec,
    ReservationEnvelopeStatus,
    ReservationPoolSpec,
    ReservationPoolStatus,
)
from reservoir.core.preemption import preemptible, still_asked
from reservoir.core.serving_classes import UnknownServingClassError
from reservoir.k8s import serving
from reservoir.k8s.facts import UnreadableEnvelopeError, as_dict, parse_time
from reservoir.k8s.resources import (
    ReservationEnvelope,
    ReservationPool,
    field_value,
    get_object,
)


def child_facts(envelope: Mapping[str, Any], now: datetime) -> ChildFacts:
    """What a parent reads of a child envelope. The child holds its own line (its status,
    written by the operator alone): a status that cannot be read stops the parent's pass
    (UnreadableEnvelopeError, reported), since reading it as absent would take the child
    for gone with its line. A spec that cannot be read (the schema accepted what the code
    cannot read) leaves the line as recorded and the child never admitted until it can be."""
    meta = envelope["metadata"]
    try:
        status = ReservationEnvelopeStatus.model_validate(envelope.get("status") or {})
    except ValidationError as error:
        raise UnreadableEnvelopeError(
            f"the status of child envelope {meta.get('name')} cannot be read: {error}"
        ) from None
    created = parse_time(meta["creationTimestamp"])
    closed = bool(
        meta.get("deletionTimestamp") or status.closed_at is not None or status.closed_by_parent
    )
    common: dict[str, Any] = {
        "uid": meta["uid"],
        "name": meta["name"],
        "namespace": meta.get("namespace", ""),
        "created_at": created,
        "record": status.parent,
        "balance_released": status.balance_released if status.closed_at is not None else None,
        "committed": status.totals.committed,
        "preemptible": preemptible(status),
        "preemption": status.preemption,
    }
    try:
        spec = serving.effective(ReservationEnvelopeSpec.model_validate(envelope.get("spec") or {}))
    except (ValidationError, UnknownServingClassError):
        return ChildFacts(capacity={}, accepting=not closed, readable=False, **common)
    lifetime = spec.lifetime_seconds
    expired = lifetime is not None and (now - created).total_seconds() >= lifetime
    return ChildFacts(
        capacity=spec.capacity,
        priority=spec.priority,
        priority_class=spec.priority_class_name,
        max_tentative_claims=spec.policy.max_tentative_claims,
        accepting=not (closed or spec.state.value == "Closed" or expired),
        contracts=spec.contracts,
        **common,
    )


async def children_of(
    client: AsyncClient, namespace: str, name: str, now: datetime
) -> tuple[list[ChildFacts], dict[str, dict[str, Any]]]:
    """The envelopes naming `name` as their parent: their facts, and the objects by UID."""
    facts: list[ChildFacts] = []
    bodies: dict[str, dict[str, Any]] = {}
    async for child in client.list(
        ReservationEnvelope, namespace=namespace, fields={"spec.parent": field_value(name)}
    ):
        body = as_dict(child)
        fact = child_facts(body, now)
        facts.append(fact)
        bodies[fact.uid] = body
    return facts, bodies


def spec_closed(body: Mapping[str, Any]) -> bool:
    return (body.get("spec") or {}).get("state") == "Closed"


async def siblings_of(
    client: AsyncClient, namespace: str, parent: str, uid: str, now: datetime
) -> tuple[list[SiblingFacts], dict[str, dict[str, Any]]]:
    """The other envelopes drawing on the same parent envelope, as loans see them."""
    children, bodies = await children_of(client, namespace, parent, now)
    facts: list[SiblingFacts] = []
    for child in children:
        if child.uid == uid:
            continue
        body = bodies[child.uid]
        status = ReservationEnvelopeStatus.model_validate(body.get("status") or {})
        facts.append(
            SiblingFacts(
                uid=child.uid,
                name=child.name,
                accepting=child.accepting,
                sealed=bool(body["metadata"].get("deletionTimestamp"))
                or spec_closed(body)
                or status.closed_at is not None
                or status.closed_by_parent,
                wants=status.wants,
                loan_to_me=status.loans.get(uid),
                borrowing_from_me=status.borrowed.get(uid),
            )
        )
    return facts, {k: v for k, v in bodies.items() if k != uid}


async def parent_view(
    client: AsyncClient,
    envelope: Mapping[str, Any],
    spec: ReservationEnvelopeSpec,
    record: ParentRecord | None,
) -> ParentView | None:
    """The parent this envelope draws from, or would: the one it recorded, else the one its
    spec names, else the pool covering its namespace. None: a root."""
    meta = envelope["metadata"]
    namespace, uid = meta["namespace"], meta["uid"]
    if record is not None:
        if record.kind is ParentKind.ROOT:
            return None
        if record.kind is ParentKind.POOL:
            body = await get_object(client, ReservationPool, record.name, None)
            return pool_view(body, uid, admitted_as=record.priority_class)
        body = await get_object(client, ReservationEnvelope, record.name, namespace)
        return envelope_view(body, record.name, uid)
    if spec.parent is not None:
        body = await get_object(client, ReservationEnvelope, spec.parent, namespace)
        view = envelope_view(body, spec.parent, uid)
        if view.depth is None and view.uid is not None:
            view = ParentView(
                **{**view.__dict__, "cycle": await _cycle(client, namespace, uid, spec.parent)}
            )
        return view
    return await covering_pool(client, namespace, uid, spec)


def envelope_view(body: Mapping[str, Any] | None, name: str, child_uid: str) -> ParentView:
    if body is None:
        return ParentView(ParentKind.ENVELOPE, name)
    try:
        spec = ReservationEnvelopeSpec.model_validate(body.get("spec") or {})
        status = ReservationEnvelopeStatus.model_validate(body.get("status") or {})
    except ValidationError as error:
        # Never read as gone: that would close the whole subtree for good.
        raise UnreadableEnvelopeError(f"its parent {name} cannot be read: {error}") from None
    record = status.parent
    opened = record is not None and record.admitted_at is not None
    return ParentView(
        ParentKind.ENVELOPE,
        name,
        uid=body["metadata"]["uid"],
        depth=record.depth if opened and record is not None else None,
        capacity=spec.capacity,
        contracts=spec.contracts,
        line=status.children.get(child_uid),
        deleting=bool(body["metadata"].get("deletionTimestamp")) or status.closed_by_parent,
    )


def pool_view(
    body: Mapping[str, Any] | None,
    child_uid: str,
    name: str = "",
    child: ReservationEnvelopeSpec | None = None,
    namespace: str = "",
    admitted_as: str | None = None,
) -> ParentView:
    """`child`, `namespace`: the waiting envelope's, to say why the pool will not admit it
    (Closed, or a priority class its namespace may not use). `admitted_as`: an admitted
    envelope's class as its line recorded it, for the pool's preemption request."""
    if body is None:
        return ParentView(ParentKind.POOL, name)
    try:
        spec = ReservationPoolSpec.model_validate(body.get("spec") or {})
        status = ReservationPoolStatus.model_validate(body.get("status") or {})
    except ValidationError as error:
        pool = body["metadata"]["name"]
        raise UnreadableEnvelopeError(f"its pool {pool} cannot be read: {error}") from None
    refusal = (
        pool_refusal(
            spec,
            namespace,
            child.priority_class_name,
            status.shares,
            child.policy.max_tentative_claims,
            drawn_part(ParentKind.POOL, child.capacity, spec.capacity),
            status.totals.committed,
        )
        if child is not None
        else None
    )
    return ParentView(
        ParentKind.POOL,
        body["metadata"]["name"],
        uid=body["metadata"]["uid"],
        depth=0,
        capacity=spec.capacity,
        contracts=spec.contracts,
        line=status.children.get(child_uid),
        deleting=bool(body["metadata"].get("deletionTimestamp")),
        refusal=None if refusal is None else refusal.message,
        preemption=still_asked(spec, status.preemptions.get(child_uid), admitted_as),
        preempting=sum(1 for r in status.preemptions.values() if r.preemptor_uid == child_uid),
    )


async def list_pools(client: AsyncClient) -> list[dict[str, Any]]:
    """Every pool, oldest first; none when pools cannot be read (a namespaced install)."""
    try:
        pools = [as_dict(p) async for p in client.list(ReservationPool)]
    except ApiError as error:
        if error.status.code in (403, 404):
            return []
        raise
    return sorted(pools, key=lambda p: (p["metadata"]["creationTimestamp"], p["metadata"]["name"]))


def chosen_pool(pools: list[dict[str, Any]], namespace: str) -> dict[str, Any] | None:
    """The pool a namespace's new root envelopes draw from: the oldest one listing it that
    is not being deleted."""
    for pool in pools:
        listed = namespace in ((pool.get("spec") or {}).get("namespaces") or [])
        if listed and not pool["metadata"].get("deletionTimestamp"):
            return pool
    return None


async def covering_pool(
    client: AsyncClient, namespace: str, uid: str, spec: ReservationEnvelopeSpec
) -> ParentView | None:
    """The pool whose ledger already holds a line for this envelope (even one being
    deleted), else the pool its namespace draws from now; None: no pool covers it."""
    pools = await list_pools(client)
    for pool in pools:
        if uid in ((pool.get("status") or {}).get("children") or {}):
            return pool_view(pool, uid)
    chosen = chosen_pool(pools, namespace)
    return pool_view(chosen, uid, child=spec, namespace=namespace) if chosen else None


async def _cycle(client: AsyncClient, namespace: str, uid: str, parent: str) -> bool:
    """Whether following spec.parent from this envelope leads back to it (within the
    deepest tree allowed: a longer chain is refused for its depth anyway)."""
    name: str | None = parent
    for _ in range(MAX_DEPTH + 1):
        if name is None:
            return False
        body = await get_object(client, ReservationEnvelope, name, namespace)
        if body is None:
            return False
        if body["metadata"]["uid"] == uid:
            return True
        name = (body.get("spec") or {}).get("parent")
    return False
