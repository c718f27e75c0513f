"""Fair sharing of one pool between its namespaces: which waiting envelope the pool admits
next when several tenants want more than it has (branch-claims.txt: "maximum tentative
claims per tenant", "priority ordering for interactive, batch, and agentic work").

The order, recomputed after every admission:

1. Class: the pool's priority classes, which its administrator defines (higher first). A
   tenant names a class; it never picks a number that ranks it above other tenants.
2. Share: weighted dominant resource fairness (DRF: Ghodsi et al., NSDI 2011). A
   namespace's dominant share is the largest fraction of any one pool resource its open
   envelopes hold; divided by its weight, the namespace with the lowest goes first. Why
   DRF: an envelope asks for a bundle (GPUs, tokens, cost), and DRF is the policy for
   bundles that is strategy-proof (asking for more than it needs never helps a tenant),
   envy-free and Pareto-efficient; with one binding resource it is weighted max-min
   fairness. Kueue's fair sharing and YARN's DominantResourceCalculator rank the same way.
3. Age, then name, then UID: within one namespace and class, first come first served.

Strict head of line: once the next envelope in that order does not fit, those after it
wait too, so smaller envelopes never overtake a large one forever (no starvation within a
class). The exception is an envelope whose namespace stays within its guarantee: that part
of the pool is its own, and no one else could have used it.

A guarantee is kept, not lent: other namespaces are admitted only into what is left after
every namespace's unused guarantee, so keeping it needs no preemption. A cap (open
envelopes per namespace, or in the whole pool) makes a namespace's envelopes wait without
blocking anyone else's.

Pure: no Kubernetes, no clock. The pool's pass (reservoir.core.pool) feeds it its lines and
the waiting envelopes; `kubectl reservoir why` replays the same pass to show the order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal

from reservoir.core.contracts import of_type, resolve, reusable
from reservoir.core.ledger import ZERO, add
from reservoir.core.model import (
    ContractType,
    EnvelopeState,
    NamespaceUsage,
    PreemptionPolicy,
    ReservationPoolSpec,
)
from reservoir.core.policy import Admission

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
DEFAULT_CLASS_VALUE = 0
SHARE_PLACES = Decimal("0.0001")
POOL_CLOSED = Admission(
    False,
    "PoolClosed",
    "the pool is Closed: it admits no envelopes until it is opened again (its open "
    "envelopes go on)",
)


@dataclass(frozen=True)
class Share:
    """One namespace's part of the pool."""

    weight: int = 1
    guaranteed: Mapping[str, Decimal] = field(default_factory=dict)
    max_open: int | None = None
    max_tentative: int | None = None


@dataclass(frozen=True)
class ClassRule:
    value: int
    namespaces: frozenset[str] | None = None  # None: every namespace of the pool
    preemption: PreemptionPolicy = PreemptionPolicy.NEVER


@dataclass(frozen=True)
class SharingRules:
    """What a pool's spec says about sharing it."""

    capacity: Mapping[str, Decimal]
    shares: Mapping[str, Share] = field(default_factory=dict)
    classes: Mapping[str, ClassRule] = field(default_factory=dict)
    max_open_per_namespace: int | None = None
    max_open: int | None = None
    max_tentative_per_namespace: int | None = None
    max_tentative: int | None = None
    # Guarantees named on resources that are not Reusable: not kept (see `of`).
    unkept: frozenset[str] = frozenset()

    @classmethod
    def of(cls, spec: ReservationPoolSpec) -> SharingRules:
        """A guarantee is kept only of a Reusable resource (GPUs, permits: what a namespace
        holds comes back). Of a Consumable one (tokens, cost) what is spent is gone, so
        keeping an amount free for a namespace would either let it drain the pool past
        everyone (measured by what it holds) or lock the others out once it spent it
        (measured by what is left): a tenant's budget of those is a pool of its own."""
        kept = reusable(resolve(spec.capacity, spec.contracts))
        named = {r for share in spec.shares.values() for r in share.guaranteed}
        return cls(
            capacity=dict(spec.capacity),
            shares={
                namespace: Share(
                    share.weight,
                    {r: v for r, v in share.guaranteed.items() if r in kept},
                    share.max_open_envelopes,
                    share.max_tentative_claims,
                )
                for namespace, share in spec.shares.items()
            },
            unkept=frozenset(named - kept),
            classes={
                name: ClassRule(
                    rule.value,
                    None if rule.namespaces is None else frozenset(rule.namespaces),
                    rule.preemption_policy,
                )
                for name, rule in spec.priority_classes.items()
            },
            max_open_per_namespace=spec.max_open_envelopes_per_namespace,
            max_open=spec.max_open_envelopes,
            max_tentative_per_namespace=spec.max_tentative_claims_per_namespace,
            max_tentative=spec.max_tentative_claims,
        )

    def share(self, namespace: str) -> Share:
        return self.shares.get(namespace) or Share()

    def kept(self) -> dict[str, dict[str, Decimal]]:
        """Each namespace's guarantee as it can be kept: where the guarantees add up to more
        than the capacity of a resource, each is scaled down in proportion (else each
        namespace would keep the others' unreachable guarantees from all of them, and the
        pool would idle with every guaranteed namespace waiting)."""
        total: dict[str, Decimal] = {}
        for share in self.shares.values():
            total = add(total, share.guaranteed)
        kept: dict[str, dict[str, Decimal]] = {}
        for namespace, share in self.shares.items():
            amounts = {}
            for resource, amount in share.guaranteed.items():
                capacity = self.capacity.get(resource, ZERO)
                over = total[resource] > capacity
                amounts[resource] = amount * capacity / total[resource] if over else amount
            kept[namespace] = amounts
        return kept

    def cap(self, namespace: str) -> int | None:
        own = self.share(namespace).max_open
        return own if own is not None else self.max_open_per_namespace

    def tentative_cap(self, namespace: str) -> int | None:
        own = self.share(namespace).max_tentative
        return own if own is not None else self.max_tentative_per_namespace


@dataclass(frozen=True)
class Waiting:
    """An envelope waiting for the pool, as its queue sees it."""

    uid: str
    namespace: str
    name: str
    created_at: datetime
    wanted: Mapping[str, Decimal]
    priority_class: str | None = None
    max_tentative: int | None = None  # its own policy's cap on tentative claims


def standing(
    rules: SharingRules,
    namespace: str,
    held: Mapping[str, Decimal],
    open_count: int,
    tentative: int,
) -> Decimal:
    """A namespace's weighted dominant share: the largest fraction it takes of anything the
    pool limits (each resource, and the pool's caps on open envelopes and tentative claims,
    which an envelope asking for none of the resources still uses up), over its weight."""
    fractions = [dominant_share(held, rules.capacity)]
    if rules.max_open:
        fractions.append(Decimal(open_count) / rules.max_open)
    if rules.max_tentative:
        fractions.append(Decimal(tentative) / rules.max_tentative)
    return max(fractions) / rules.share(namespace).weight


def dominant_share(held: Mapping[str, Decimal], capacity: Mapping[str, Decimal]) -> Decimal:
    """The largest fraction of any one resource `held` takes of `capacity`."""
    fractions = [held.get(r, ZERO) / amount for r, amount in capacity.items() if amount > ZERO]
    return max(fractions, default=ZERO)


def class_refusal(rules: SharingRules, namespace: str, name: str | None) -> Admission | None:
    """Why an envelope's class keeps it waiting, or None: a class the pool does not define,
    or one its namespace may not use. Not permanent: the tenant may name another, the
    administrator may add it."""
    if name is None:
        return None
    rule = rules.classes.get(name)
    if rule is None:
        known = ", ".join(sorted(rules.classes)) or "none"
        return Admission(
            False,
            "UnknownPriorityClass",
            f"the pool defines no priority class {name!r} (it defines: {known})",
        )
    if rule.namespaces is not None and namespace not in rule.namespaces:
        return Admission(
            False,
            "PriorityClassNotAllowed",
            f"namespace {namespace} may not use priority class {name!r}",
        )
    return None


def pool_refusal(
    spec: ReservationPoolSpec,
    namespace: str,
    priority_class: str | None,
    shares: Mapping[str, NamespaceUsage] | None = None,
    max_tentative: int | None = None,
    wanted: Mapping[str, Decimal] | None = None,
    committed: Mapping[str, Decimal] | None = None,
) -> Admission | None:
    """Why the pool admits none of this envelope now, whatever its room: it is Closed, the
    envelope names a class it may not use, or (from what the pool recorded: each
    namespace's `shares`, its `committed` total) a cap is reached or what it asks for
    (`wanted`) can never be free for it. What the envelope shows while it waits."""
    if spec.state is EnvelopeState.CLOSED:
        return POOL_CLOSED
    rules = SharingRules.of(spec)
    refusal = class_refusal(rules, namespace, priority_class)
    if refusal is not None:
        return refusal
    recorded = shares or {}
    probe = Waiting("", namespace, "", EPOCH, wanted or {}, priority_class, max_tentative)
    queue = FairQueue(
        rules,
        {},
        {ns: usage.open for ns, usage in recorded.items()},
        [probe],
        {ns: usage.tentative_claims for ns, usage in recorded.items()},
    )
    if queue.next() is None:
        return queue.refused.get("")
    if queue.tentative_grant(probe) == 0 and max_tentative != 0:
        return tentative_limit_reason()
    if queue.never_fits(probe, spent_for_good(spec, committed or {})):
        return never_fits_reason()
    return None


def spent_for_good(
    spec: ReservationPoolSpec, committed: Mapping[str, Decimal]
) -> dict[str, Decimal]:
    """What the pool committed of its Consumable resources: it never comes back."""
    consumable = of_type(resolve(spec.capacity, spec.contracts), ContractType.CONSUMABLE)
    return {r: amount for r, amount in committed.items() if r in consumable}


def never_fits_reason() -> Admission:
    return Admission(
        False,
        "LargerThanAttainable",
        "it asks for more than the pool can ever have free for it (its capacity less what "
        "is spent for good and the other namespaces' guarantees): it waits without holding "
        "up the queue, until the pool grows",
    )


def over_guaranteed(rules: SharingRules) -> list[str]:
    """The resources whose guarantees add up to more than the pool's capacity."""
    total: dict[str, Decimal] = {}
    for share in rules.shares.values():
        total = add(total, share.guaranteed)
    return sorted(r for r, amount in total.items() if amount > rules.capacity.get(r, ZERO))


def class_value(rules: SharingRules, name: str | None) -> int:
    rule = rules.classes.get(name) if name is not None else None
    return rule.value if rule is not None else DEFAULT_CLASS_VALUE


def namespace_cap_reason(cap: int) -> Admission:
    return Admission(
        False,
        "NamespaceEnvelopeLimit",
        f"its namespace holds its most open envelopes in the pool ({cap})",
    )


def tentative_limit_reason() -> Admission:
    return Admission(
        False,
        "TentativeClaimLimit",
        "its namespace's (or the pool's) cap on tentative claims is granted to envelopes "
        "already open: admitted once one of them closes",
    )


def pool_cap_reason(cap: int) -> Admission:
    return Admission(False, "PoolEnvelopeLimit", f"the pool holds its most open envelopes ({cap})")


class FairQueue:
    """The pool's waiting envelopes, handed out one at a time in fair-share order. The
    caller says which it admitted (`admitted`); the shares move with each admission."""

    def __init__(
        self,
        rules: SharingRules,
        held: Mapping[str, Mapping[str, Decimal]],
        open_counts: Mapping[str, int],
        waiting: Iterable[Waiting],
        tentative: Mapping[str, int] | None = None,
    ) -> None:
        """`tentative`: per namespace, the tentative claims granted to its open envelopes."""
        self.rules = rules
        self.guaranteed = rules.kept()
        self.held: dict[str, dict[str, Decimal]] = {ns: dict(h) for ns, h in held.items()}
        self.open: dict[str, int] = dict(open_counts)
        self.tentative: dict[str, int] = dict(tentative or {})
        self.refused: dict[str, Admission] = {}  # uid -> why it waits, set aside
        self.order: list[Waiting] = []  # handed out so far, in order
        queues: dict[str, list[Waiting]] = {}
        for entry in waiting:
            refusal = class_refusal(rules, entry.namespace, entry.priority_class)
            if refusal is not None:
                self.refused[entry.uid] = refusal
                continue
            queues.setdefault(entry.namespace, []).append(entry)
        for queue in queues.values():
            # Popped from the end: the namespace's first is last.
            queue.sort(key=self._own_order, reverse=True)
        self._queues = queues

    def _own_order(self, entry: Waiting) -> tuple[int, datetime, str, str]:
        value = class_value(self.rules, entry.priority_class)
        return (-value, entry.created_at, entry.name, entry.uid)

    def share(self, namespace: str) -> Decimal:
        return standing(
            self.rules,
            namespace,
            self.held.get(namespace, {}),
            self.open.get(namespace, 0),
            self.tentative.get(namespace, 0),
        )

    def never_fits(self, entry: Waiting, spent: Mapping[str, Decimal]) -> bool:
        """Whether `entry`, within the pool's capacity, would not fit even once everything
        held came back: the capacity less what is spent for good (`spent`: Consumable
        amounts committed) and the other namespaces' guarantees. Such an envelope must not
        hold the queue up behind it. (One beyond the capacity is refused for good instead.)"""
        capacity = self.rules.capacity
        if any(amount > capacity.get(r, ZERO) for r, amount in entry.wanted.items()):
            return False
        others: dict[str, Decimal] = {}
        for namespace, guaranteed in self.guaranteed.items():
            if namespace != entry.namespace:
                others = add(others, guaranteed)
        return any(
            amount > capacity.get(r, ZERO) - spent.get(r, ZERO) - others.get(r, ZERO)
            for r, amount in entry.wanted.items()
        )

    def next(self) -> Waiting | None:
        """The next envelope to consider, or None once every one has been handed out or
        set aside (capped)."""
        self._set_aside_capped()
        heads = [queue[-1] for queue in self._queues.values() if queue]
        if not heads:
            return None
        chosen = min(
            heads,
            key=lambda e: (
                -class_value(self.rules, e.priority_class),
                self.share(e.namespace),
                e.created_at,
                e.name,
                e.uid,
            ),
        )
        self._queues[chosen.namespace].pop()
        self.order.append(chosen)
        return chosen

    def _set_aside_capped(self) -> None:
        limit = self.rules.max_open
        if limit is not None and sum(self.open.values()) >= limit:
            for queue in self._queues.values():
                self._refuse_all(queue, pool_cap_reason(limit))
            return
        for namespace, queue in self._queues.items():
            cap = self.rules.cap(namespace)
            if cap is not None and self.open.get(namespace, 0) >= cap:
                self._refuse_all(queue, namespace_cap_reason(cap))

    def _refuse_all(self, queue: list[Waiting], reason: Admission) -> None:
        for entry in queue:
            self.refused[entry.uid] = reason
        queue.clear()

    def admitted(self, entry: Waiting, tentative: int | None = None) -> None:
        self.held[entry.namespace] = add(self.held.get(entry.namespace, {}), entry.wanted)
        self.open[entry.namespace] = self.open.get(entry.namespace, 0) + 1
        if tentative:
            self.tentative[entry.namespace] = self.tentative.get(entry.namespace, 0) + tentative

    def tentative_grant(self, entry: Waiting) -> int | None:
        """What `entry` may be granted of the caps on tentative claims: its own cap, or all
        that is left if it declares none; None when no cap applies. Zero for an envelope
        that asks for some: it waits (`tentative_limit_reason`)."""
        left: list[int] = []
        cap = self.rules.tentative_cap(entry.namespace)
        if cap is not None:
            left.append(cap - self.tentative.get(entry.namespace, 0))
        if self.rules.max_tentative is not None:
            left.append(self.rules.max_tentative - sum(self.tentative.values()))
        if not left:
            return None
        room = max(min(left), 0)
        return room if entry.max_tentative is None else min(entry.max_tentative, room)

    def kept_for_others(self, namespace: str) -> dict[str, Decimal]:
        """The unused guarantees of every other namespace: what `namespace` may not take."""
        kept: dict[str, Decimal] = {}
        for other, guaranteed in self.guaranteed.items():
            if other == namespace:
                continue
            held = self.held.get(other, {})
            for resource, amount in guaranteed.items():
                unused = amount - held.get(resource, ZERO)
                if unused > ZERO:
                    kept[resource] = kept.get(resource, ZERO) + unused
        return kept

    def room(self, entry: Waiting, available: Mapping[str, Decimal]) -> dict[str, Decimal]:
        """What `entry` may draw on: the pool's available amounts less the others' unused
        guarantees (never below zero)."""
        kept = self.kept_for_others(entry.namespace)
        return {r: max(amount - kept.get(r, ZERO), ZERO) for r, amount in available.items()}

    def within_guarantee(self, entry: Waiting) -> bool:
        """Its namespace, having admitted it, would still hold no more than its guarantee
        of every resource it asks for: it draws on its own part of the pool."""
        guaranteed = self.guaranteed.get(entry.namespace)
        if not guaranteed:
            return False
        held = self.held.get(entry.namespace, {})
        return all(
            held.get(r, ZERO) + amount <= guaranteed.get(r, ZERO)
            for r, amount in entry.wanted.items()
            if amount > ZERO
        )


def rendered_share(share: Decimal) -> str:
    return str(share.quantize(SHARE_PLACES))
