"""A budget tree driven through the pure core only: a tenant's ReservationPool, envelopes
drawn from it or from one another (spec.parent), and their claims.

Each object's status is its own durable record, written only by its own reconcile (one
compare-and-swap), as the Kubernetes adapter does:

- an envelope's reconcile reads its own spec and status fresh, its claims' facts, and the
  other envelopes and the pool's status (k8s/budgets.py): its parent (ParentView: the
  parent's UID, its recorded depth once admitted, its ledger line for this envelope, whether
  it is being deleted, whether following the parents leads back here) and its children
  (ChildFacts: spec, and from their status the record of where they draw from and, once
  closed, the balance they released);
- an envelope with a parent envelope also reads its siblings (the other envelopes naming the
  same parent), as loans see them (k8s/budgets.py siblings_of: each one's accepting flag,
  its `wants`, its loan to this envelope and its record of a loan from this one);
- the pool's reconcile reads the root envelopes (those without a parent) the same way;
- a deleted envelope goes away (its finalizer is removed) only in its own reconcile, once it
  has closed, its parent knows its fate (its line settled and mirrored here, or it was
  withdrawn, or never admitted and its parent is gone) and every child of its own has
  recorded its fate (`may_go`, as handlers/envelopes.py decides);
- claims are never removed: their settled records are mirrored into their own status after
  each reconcile of their envelope, so the ledger compacts.

The adapter reads the other objects fresh from the API server. A reconcile here may read
them older than that (`lag`): from an informer-like cache, consistent as of one moment (a
prefix of the event stream), monotonic, and never older than the reconciled object's own
latest event. A `Run` is one operator's view of one shared `World` of client-written facts
(the pool's spec and deletion are always read fresh); two runs over the same world are two
operators, one of which may have missed states (coalescing).

`Books` is an auditor that shares no arithmetic with the core: it checks every status
after every step, and keeps the first-seen admission and settlement of every claim, every
child line and every loan between siblings (both sides: the lender's `Loan`, the borrower's
`Borrowing`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from reservoir.core import borrowing
from reservoir.core.borrowing import SiblingFacts
from reservoir.core.budgets import ChildFacts, ParentView
from reservoir.core.childlines import LOST_CHILDREN_PREFIX, current, line_of
from reservoir.core.claimstatus import claim_status, settled_record
from reservoir.core.fairshare import pool_refusal
from reservoir.core.lifecycle import ClaimFacts
from reservoir.core.model import (
    MAX_DEPTH,
    Borrowing,
    BranchClaimSpec,
    ChildEntry,
    ChildPhase,
    ClaimPhase,
    ContractType,
    EnvelopePhase,
    EnvelopePolicy,
    EnvelopeState,
    LedgerEntry,
    Lending,
    Loan,
    LoanPhase,
    ParentKind,
    ParentRecord,
    ReservationEnvelopeSpec,
    ReservationEnvelopeStatus,
    ReservationPoolSpec,
    ReservationPoolStatus,
    ResourceTotals,
)
from reservoir.core.pool import POOL_DEPTH, PoolFacts, PoolReconciliation, reconcile_pool
from reservoir.core.preemption import preemptible, still_asked
from reservoir.core.reconcile import EnvelopeFacts, Reconciliation, reconcile

T0 = datetime(2026, 1, 1, tzinfo=UTC)
NAMESPACE = "team-a"
POOL = "pool"  # the pool's key wherever envelopes and the pool are named together
ZERO = Decimal(0)
# Leases that never lapse in a history: the tree's protocol is the subject here (the claim
# audits cover leases and deadlines).
LONG_LIVED = EnvelopePolicy(default_lease_seconds=10**6, max_claim_lifetime_seconds=10**6)


def lending(floor: Mapping[str, Any], base: EnvelopePolicy = LONG_LIVED) -> EnvelopePolicy:
    """A policy that lends to siblings, never below `floor`."""
    return base.model_copy(update={"lending": Lending(floor=amounts(floor))})


def amounts(resources: Mapping[str, Any]) -> dict[str, Decimal]:
    return {name: Decimal(str(value)) for name, value in resources.items()}


def same(a: Mapping[str, Decimal], b: Mapping[str, Decimal]) -> bool:
    """Equal as resource maps (a missing resource is zero)."""
    return all(a.get(k, ZERO) == b.get(k, ZERO) for k in {*a, *b})


def plus(a: Mapping[str, Decimal], b: Mapping[str, Decimal]) -> dict[str, Decimal]:
    return {k: a.get(k, ZERO) + b.get(k, ZERO) for k in {*a, *b}}


def minus(a: Mapping[str, Decimal], b: Mapping[str, Decimal]) -> dict[str, Decimal]:
    return {k: a.get(k, ZERO) - b.get(k, ZERO) for k in {*a, *b}}


def at_most(a: Mapping[str, Decimal], b: Mapping[str, Decimal]) -> bool:
    """a <= b in every resource (a missing resource is zero)."""
    return all(a.get(k, ZERO) <= b.get(k, ZERO) for k in {*a, *b})


def still_owed(record: Borrowing) -> dict[str, Decimal]:
    """What a borrower still owes on its record (the auditor's own arithmetic)."""
    return {k: v for k, v in minus(record.amount, record.repaid).items() if v != ZERO}


# --- what people, orchestrators and workers write ----------------------------------------


@dataclass(frozen=True)
class Envelope:
    uid: str
    name: str
    created_at: datetime
    spec: ReservationEnvelopeSpec
    deleting: bool = False
    namespace: str = NAMESPACE
    # a person's audited decisions about gone objects (the force-settle-gone annotation)
    force_settle_gone: Mapping[str, str] = field(default_factory=dict)

    @property
    def accepting(self) -> bool:
        """Not closed nor being deleted (its lifetime aside: see `open_at`)."""
        return not self.deleting and self.spec.state is EnvelopeState.OPEN

    def open_at(self, now: datetime) -> bool:
        lifetime = self.spec.lifetime_seconds
        expired = lifetime is not None and now >= self.created_at + timedelta(seconds=lifetime)
        return self.accepting and not expired


@dataclass
class World:
    """Client-written facts, shared by every run: specs, deletions, claims' declared facts."""

    pool: PoolFacts | None = None
    envelopes: dict[str, Envelope] = field(default_factory=dict)  # uid -> envelope
    claims: dict[str, ClaimFacts] = field(default_factory=dict)  # uid (= name) -> facts
    now: datetime = T0
    changes: int = 0  # bumped by every write: runs log a snapshot per change

    @staticmethod
    def with_pool(
        capacity: Mapping[str, Any],
        contracts: Mapping[str, Any] | None = None,
        namespaces: Iterable[str] = (NAMESPACE,),
        **sharing: Any,
    ) -> World:
        """`sharing`: the pool's other spec fields (shares, priorityClasses, state, ...)."""
        spec = ReservationPoolSpec.model_validate(
            {
                "capacity": capacity,
                "namespaces": list(namespaces),
                "contracts": contracts or {},
                **sharing,
            }
        )
        return World(pool=PoolFacts(spec=spec, name="tenant", uid="pool-uid"))

    def update_pool(self, **changes: Any) -> None:
        """An administrator edits the pool's spec (its shares, classes, state)."""
        assert self.pool is not None
        spec = ReservationPoolSpec.model_validate(
            {**self.pool.spec.model_dump(by_alias=True), **changes}
        )
        self.pool = replace(self.pool, spec=spec)
        self.changes += 1

    def uid(self, name: str) -> str:
        """The uid of the latest envelope of that name (or the one it would get)."""
        named = [e.uid for e in self.envelopes.values() if e.name == name]
        return named[-1] if named else f"{name}-uid"

    def envelope(self, name: str) -> Envelope:
        return self.envelopes[self.uid(name)]

    def create_envelope(
        self,
        name: str,
        capacity: Mapping[str, Any],
        parent: str | None = None,
        priority: int = 0,
        policy: EnvelopePolicy = LONG_LIVED,
        uid: str | None = None,
        lifetime: int | None = None,
        contracts: Mapping[str, Any] | None = None,
        namespace: str = NAMESPACE,
        priority_class: str | None = None,
    ) -> str:
        """`uid`: another one for a name used before (the one it had must be gone)."""
        uid = uid or f"{name}-uid"
        assert uid not in self.envelopes, f"{uid} exists"
        spec = ReservationEnvelopeSpec.model_validate(
            {
                "capacity": capacity,
                "parent": parent,
                "priority": priority,
                "policy": policy,
                "lifetimeSeconds": lifetime,
                "contracts": contracts or {},
                "priorityClassName": priority_class,
            }
        )
        self.envelopes[uid] = Envelope(uid, name, self.now, spec, namespace=namespace)
        self.changes += 1
        return uid

    def close(self, name: str) -> None:
        env = self.envelope(name)
        spec = env.spec.model_copy(update={"state": EnvelopeState.CLOSED})
        self.envelopes[env.uid] = replace(env, spec=spec)
        self.changes += 1

    def delete(self, name: str) -> None:
        env = self.envelope(name)
        self.envelopes[env.uid] = replace(env, deleting=True)
        self.changes += 1

    def force_settle_gone(self, name: str, gone: str, reason: str = "checked by hand") -> None:
        """A person names a gone claim, child or borrower (its name or UID) on the envelope."""
        env = self.envelope(name)
        decided = {**env.force_settle_gone, gone: reason}
        self.envelopes[env.uid] = replace(env, force_settle_gone=decided)
        self.changes += 1

    def create_claim(
        self, name: str, envelope: str, requests: Mapping[str, Any], **spec: Any
    ) -> None:
        assert name not in self.claims
        full = BranchClaimSpec(envelope=envelope, branch=name, requests=requests, **spec)
        self.claims[name] = ClaimFacts(uid=name, name=name, created_at=self.now, spec=full)

    def update_claim(self, name: str, **changes: Any) -> None:
        facts = self.claims[name]
        spec = BranchClaimSpec.model_validate({**facts.spec.model_dump(), **changes})
        self.claims[name] = replace(facts, spec=spec)

    def grow(self, name: str, capacity: Mapping[str, Any]) -> None:
        """A root's capacity may grow (the CRD fixes a child's, with spec.parent)."""
        env = self.envelope(name)
        assert env.spec.parent is None
        grown = {**env.spec.capacity, **amounts(capacity)}
        spec = env.spec.model_copy(update={"capacity": grown})
        self.envelopes[env.uid] = replace(env, spec=spec)
        self.changes += 1

    def delete_pool(self) -> None:
        assert self.pool is not None
        self.pool = replace(self.pool, deleting=True)
        self.changes += 1

    def delete_claim(self, name: str) -> None:
        self.claims[name] = replace(self.claims[name], deleting=True)

    def tick(self, seconds: float = 1) -> None:
        self.now += timedelta(seconds=seconds)


# --- one operator ------------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """An informer cache at one moment: the envelopes that exist, with their status."""

    envelopes: Mapping[str, tuple[Envelope, ReservationEnvelopeStatus]]
    pool: ReservationPoolStatus


def child_facts(envelope: Envelope, status: ReservationEnvelopeStatus, now: datetime) -> ChildFacts:
    return ChildFacts(
        uid=envelope.uid,
        name=envelope.name,
        created_at=envelope.created_at,
        capacity=envelope.spec.capacity,
        namespace=envelope.namespace,
        priority=envelope.spec.priority,
        priority_class=envelope.spec.priority_class_name,
        max_tentative_claims=envelope.spec.policy.max_tentative_claims,
        accepting=envelope.open_at(now)
        and status.closed_at is None
        and not status.closed_by_parent,
        record=status.parent,
        balance_released=dict(status.balance_released) if status.closed_at is not None else None,
        contracts=envelope.spec.contracts,
        committed=status.totals.committed,
        preemptible=preemptible(status),
        preemption=status.preemption,
    )


def refusal_message(
    spec: ReservationPoolSpec, envelope: Envelope, pool: ReservationPoolStatus
) -> str | None:
    refusal = pool_refusal(
        spec,
        envelope.namespace,
        envelope.spec.priority_class_name,
        pool.shares,
        envelope.spec.policy.max_tentative_claims,
        {k: v for k, v in envelope.spec.capacity.items() if k in spec.capacity},
        pool.totals.committed,
    )
    return None if refusal is None else refusal.message


def sibling_facts(
    sibling: Envelope, status: ReservationEnvelopeStatus, reader: str, now: datetime
) -> SiblingFacts:
    """What `reader` reads of a sibling (k8s/budgets.py siblings_of): its accepting flag as
    a child's; whether it is sealed (can never record a loan again, on recorded facts only:
    being deleted, closed in its spec, closed in its ledger, or closed by its parent); its
    wants; its loan to the reader; its record of a loan from the reader."""
    loan, record = status.loans.get(reader), status.borrowed.get(reader)
    return SiblingFacts(
        uid=sibling.uid,
        name=sibling.name,
        accepting=child_facts(sibling, status, now).accepting,
        sealed=(
            sibling.deleting
            or sibling.spec.state is EnvelopeState.CLOSED
            or status.closed_at is not None
            or status.closed_by_parent
        ),
        wants=status.wants.model_copy(deep=True) if status.wants is not None else None,
        loan_to_me=loan.model_copy(deep=True) if loan is not None else None,
        borrowing_from_me=record.model_copy(deep=True) if record is not None else None,
    )


def leads_back(envelope: Envelope, seen: Iterable[Envelope]) -> bool:
    """Following the parents from this envelope's parent leads back to it."""
    by_name = {e.name: e for e in seen}
    name, visited = envelope.spec.parent, set[str]()
    while name is not None and name not in visited:
        if name == envelope.name:
            return True
        visited.add(name)
        parent = by_name.get(name)
        name = parent.spec.parent if parent is not None else None
    return False


def may_go(result: Reconciliation) -> bool:
    """A deleted envelope's finalizer goes (handlers/envelopes.py): nothing live in its
    ledger, every child has recorded its fate from its own line (children_unsettled), and
    its parent has nothing more to learn from it (done_upward: closed, and its line settled
    and mirrored, or withdrawn, or never admitted and its parent gone)."""
    status = result.status
    live = [e for e in status.entries.values() if not e.phase.terminal]
    live += [c for c in result.child_lines.values() if c.phase is ChildPhase.RESERVED]
    return not live and not result.children_unsettled and result.done_upward


class Run:
    """One operator over a shared world: its own statuses, finalizers and cache."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.pool = ReservationPoolStatus()
        self.statuses: dict[str, ReservationEnvelopeStatus] = {}
        self.gone: set[str] = set()
        self.removed_by_hand: set[str] = set()  # gone whatever they held (finalizer removed)
        self.records: dict[str, LedgerEntry] = {}  # claim uid -> its status's settled record
        self.results: dict[str, Reconciliation] = {}
        self.pool_result: PoolReconciliation | None = None
        self.log: list[Snapshot] = [self.snapshot()]
        self.logged_changes = world.changes
        self.changed_at: dict[str, int] = {}  # object -> log index of its latest event
        self.read_at = 0  # the cache never goes back
        self.books = Books(self)

    # - state -
    def status(self, uid: str) -> ReservationEnvelopeStatus:
        return self.statuses.get(uid) or ReservationEnvelopeStatus()

    def exists(self, uid: str) -> bool:
        return uid in self.world.envelopes and uid not in self.gone

    def live(self) -> dict[str, Envelope]:
        return {u: e for u, e in self.world.envelopes.items() if u not in self.gone}

    def snapshot(self) -> Snapshot:
        return Snapshot({u: (e, self.status(u)) for u, e in self.live().items()}, self.pool)

    def observe(self, *changed: str) -> None:
        """Log the state after a step (the informer's event stream)."""
        if self.world.changes != self.logged_changes:
            self.logged_changes = self.world.changes
            changed = (*changed, *self.world.envelopes)  # a spec write: mark them all
        self.log.append(self.snapshot())
        for uid in changed:
            self.changed_at[uid] = len(self.log) - 1

    def view(self, uid: str, lag: int) -> Snapshot:
        self.observe()
        index = max(self.read_at, self.changed_at.get(uid, 0), len(self.log) - 1 - lag)
        self.read_at = index
        return self.log[index]

    # - the operator -
    def reconcile(self, target: str, lag: int = 0) -> None:
        if target == POOL:
            self.reconcile_pool(lag)
        else:
            self.reconcile_envelope(target, lag)

    def reconcile_envelope(self, uid: str, lag: int = 0) -> None:
        if not self.exists(uid):
            return
        world, envelope = self.world, self.world.envelopes[uid]
        snap = self.view(uid, lag)
        seen = dict(snap.envelopes)
        seen[uid] = (envelope, self.status(uid))  # its own spec and status: fresh
        siblings: tuple[SiblingFacts, ...] = ()
        if envelope.spec.parent is not None:  # loans are between siblings
            siblings = tuple(
                sibling_facts(e, s, uid, world.now)
                for e, s in sorted(seen.values(), key=lambda pair: pair[0].name)
                if e.spec.parent == envelope.spec.parent and e.uid != uid
            )
        facts = EnvelopeFacts(
            spec=envelope.spec,
            created_at=envelope.created_at,
            deleting=envelope.deleting,
            force_settle_gone=envelope.force_settle_gone,
            name=envelope.name,
            uid=uid,
            parent=self.parent_view(envelope, seen, snap.pool),
            children=tuple(
                child_facts(e, s, world.now)
                for e, s in seen.values()
                if e.spec.parent == envelope.name
            ),
            siblings=siblings,
        )
        claims = [
            replace(c, settled_record=self.records.get(c.uid))
            for c in world.claims.values()
            if c.spec.envelope == envelope.name
        ]
        result = reconcile(facts, self.status(uid), claims, world.now)
        self.statuses[uid], self.results[uid] = result.status, result
        for claim in claims:  # the writer mirrors settled entries into the claims' status
            entry = result.entry(claim.uid)
            if entry is not None and entry.settlement is not None:
                status = claim_status(entry, None, None, None, world.now)
                record = settled_record(status, claim.uid, claim.name, claim.spec.attempt)
                assert record is not None
                self.records[claim.uid] = record
        # The status as written, before its finalizer may go (read fresh: every loss noticed).
        self.books.check(noticed=uid if lag == 0 else None)
        self.books.check_lending(uid, siblings)
        if envelope.deleting and may_go(result):
            self.gone.add(uid)
            self.books.check()
        self.observe(uid)

    def remove_finalizer_by_hand(self, name: str) -> None:
        """A person removes an envelope's finalizer: it is gone, whatever its ledger held."""
        self.gone.add(self.world.uid(name))
        self.removed_by_hand.add(self.world.uid(name))
        self.observe(self.world.uid(name))
        self.books.check()

    def reconcile_pool(self, lag: int = 0) -> None:
        pool = self.world.pool
        if pool is None:
            return
        snap = self.view(POOL, lag)
        envelopes = [
            child_facts(e, s, self.world.now)
            for e, s in snap.envelopes.values()
            if e.spec.parent is None or e.uid in self.pool.children or drawn_from(s, pool.uid)
        ]
        self.pool_result = reconcile_pool(pool, self.pool, envelopes, self.world.now)
        self.pool = self.pool_result.status
        self.observe(POOL)
        self.books.check(noticed=POOL if lag == 0 else None)

    def parent_view(
        self,
        envelope: Envelope,
        seen: Mapping[str, tuple[Envelope, ReservationEnvelopeStatus]],
        pool_status: ReservationPoolStatus,
    ) -> ParentView | None:
        if envelope.spec.parent is None:
            pool = self.world.pool
            if pool is None:
                return None
            own = self.status(envelope.uid)
            return ParentView(
                ParentKind.POOL,
                pool.name,
                pool.uid,
                POOL_DEPTH,
                pool.spec.capacity,
                pool.spec.contracts,
                pool_status.children.get(envelope.uid),
                pool.deleting,
                refusal=refusal_message(pool.spec, envelope, pool_status),
                preemption=still_asked(
                    pool.spec,
                    pool_status.preemptions.get(envelope.uid),
                    own.parent.priority_class if own.parent is not None else None,
                ),
                preempting=sum(
                    1 for r in pool_status.preemptions.values() if r.preemptor_uid == envelope.uid
                ),
            )
        named = [(e, s) for e, s in seen.values() if e.name == envelope.spec.parent]
        if not named:
            return None  # not found: the core shows it waiting (or closes it, deleted)
        parent, status = named[0]
        record = status.parent
        admitted = record is not None and record.admitted_at is not None
        return ParentView(
            ParentKind.ENVELOPE,
            parent.name,
            parent.uid,
            record.depth if record is not None and admitted else None,
            parent.spec.capacity,
            parent.spec.contracts,
            status.children.get(envelope.uid),
            parent.deleting or status.closed_by_parent,
            leads_back(envelope, (e for e, _ in seen.values())),
        )

    def round(self) -> None:
        """Every object once, fresh: the pool first, then the envelopes by name."""
        self.reconcile_pool()
        for uid in sorted(self.live()):
            self.reconcile_envelope(uid)

    def settle(self, max_rounds: int = 40) -> int:
        """Reconcile everything until nothing changes; returns the rounds it took."""
        for rounds in range(1, max_rounds + 1):
            before = self.fingerprint()
            self.round()
            if self.fingerprint() == before:
                return rounds
        raise AssertionError(f"still changing after {max_rounds} rounds")

    def fingerprint(self) -> Any:
        return (
            self.pool.model_dump(),
            {u: s.model_dump() for u, s in self.statuses.items() if u not in self.gone},
            frozenset(self.gone),
            {u: r.model_dump() for u, r in self.records.items()},
        )

    # - reading -
    def of(self, name: str) -> ReservationEnvelopeStatus:
        return self.status(self.world.uid(name))

    def totals(self, name: str) -> ResourceTotals:
        return self.pool.totals if name == POOL else self.of(name).totals

    def line(self, parent: str, child: str) -> ChildEntry | None:
        key = POOL if parent == POOL else self.world.uid(parent)
        return self.lines(key).get(self.world.uid(child))

    def lines(self, parent: str) -> dict[str, ChildEntry]:
        """Every line of a parent's ledger (POOL or an envelope's uid): in flight there,
        else as its child holds it (reservoir.core.childlines)."""
        if parent == POOL:
            in_flight = self.pool.children
            uid = self.world.pool.uid if self.world.pool is not None else ""
        else:
            in_flight, uid = self.status(parent).children, parent
        held = {
            child: line
            for child in self.live()
            if (line := line_of(self.status(child).parent, "", "", uid)) is not None
        }
        found = {u: current(in_flight.get(u), held.get(u)) for u in {*in_flight, *held}}
        return {u: line for u, line in found.items() if line is not None}

    def claim(self, name: str) -> LedgerEntry | None:
        facts = self.world.claims[name]
        env = self.world.uid(facts.spec.envelope)
        return self.status(env).entries.get(name) or self.records.get(name)


# --- the auditor ---------------------------------------------------------------------------


def check_totals(where: str, totals: ResourceTotals) -> None:
    for name, capacity in totals.capacity.items():
        parts = [
            totals.committed.get(name, ZERO),
            totals.reserved.get(name, ZERO),
            totals.reconciling.get(name, ZERO),
            totals.available.get(name, ZERO),
        ]
        assert all(p >= 0 for p in parts), f"{where} {name}: negative part in {parts}"
        # Loans between siblings (policy.lending) keep the identity with lent on the left
        # and borrowed on the right.
        lent, borrowed = totals.lent.get(name, ZERO), totals.borrowed.get(name, ZERO)
        assert lent >= 0 and borrowed >= 0, f"{where} {name}: negative loan"
        assert sum(parts, lent) == capacity + borrowed, f"{where} {name}: {parts} != {capacity}"


def held(entries: Iterable[LedgerEntry], lines: Iterable[ChildEntry]) -> tuple[dict, dict]:
    reserved: dict[str, Decimal] = {}
    reconciling: dict[str, Decimal] = {}
    for entry in entries:
        if entry.phase is ClaimPhase.DETACHED:
            reconciling = plus(reconciling, entry.reserved)
        elif entry.phase in (ClaimPhase.TENTATIVE, ClaimPhase.COMMITTED, ClaimPhase.RUNNING):
            reserved = plus(reserved, entry.reserved)
        if kept_for_retry(entry):  # a failed attempt's hold for its branch's next attempt
            reserved = plus(reserved, entry.retry.resources if entry.retry else {})
    for line in lines:
        if line.phase is ChildPhase.RESERVED:
            reserved = plus(reserved, line.reserved)
    return reserved, reconciling


def kept_for_retry(entry: LedgerEntry) -> bool:
    """A failed attempt still keeps what it did not use for its branch's next attempt: no
    attempt took it and its window has not returned it."""
    hold = entry.retry
    return hold is not None and hold.taken_by is None and not hold.returned


@dataclass
class Closed:
    closed_at: datetime
    balance: dict[str, Decimal]
    totals: ResourceTotals
    admitted: bool


@dataclass
class LoanSeen:
    """One loan between siblings as the auditor saw it, on both sides: the lender's line as
    first written (Lent) and as first settled, the borrower's record as first written, as
    last seen and as written when the borrower closed."""

    lender: str
    borrower: str
    lent: Loan
    settled: Loan | None = None
    record_first: Borrowing | None = None
    record: Borrowing | None = None
    record_closed: Borrowing | None = None

    @property
    def identity(self) -> tuple[str, str, datetime, tuple[tuple[str, Decimal], ...]]:
        """What two runs compare: who lent what to whom, when."""
        amount = tuple(sorted(self.lent.amount.items()))
        return (self.lender, self.borrower, self.lent.lent_at, amount)

    def received(self) -> tuple[str, str, datetime | None]:
        at = self.record_first.received_at if self.record_first is not None else None
        return (self.lender, self.borrower, at)


class Books:
    """The auditor's own records of one run, checked after every reconcile."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.claim_admitted: dict[str, tuple[str, datetime, dict[str, Decimal]]] = {}
        self.claim_settled: dict[str, tuple[str, LedgerEntry]] = {}  # uid -> (envelope, entry)
        self.line_reserved: dict[tuple[str, str], tuple[datetime | None, dict]] = {}
        self.line_settled: dict[tuple[str, str], ChildEntry] = {}  # (parent, child) -> line
        self.records: dict[str, ParentRecord] = {}  # envelope -> its first record, unsettled
        self.closed: dict[str, Closed] = {}
        self.loans: list[LoanSeen] = []  # every loan ever made, in order
        # (lender, borrower) -> the loan its ledger holds now, and that line as last seen
        self.loan_now: dict[tuple[str, str], LoanSeen | None] = {}
        self.loan_last: dict[tuple[str, str], Loan] = {}
        # (borrower, lender) -> the loan its record is of, and that record as last seen
        self.record_now: dict[tuple[str, str], LoanSeen | None] = {}
        self.record_last: dict[tuple[str, str], Borrowing] = {}

    def check(self, noticed: str | None = None) -> None:
        """Every level; `noticed`: a parent that has just passed on a fresh view."""
        run = self.run
        if run.pool.totals.capacity:
            check_totals("pool", run.pool.totals)
        self._lines(POOL, run.lines(POOL))
        self._reserved(POOL, run.pool.totals.reserved, held((), run.lines(POOL).values())[0])
        self._committed(POOL, run.pool.totals, (), run.pool)
        for uid in run.live():
            status = run.status(uid)
            if not status.totals.capacity:
                continue  # never reconciled
            self._envelope(uid, status)
        self._loan_pairs()
        self._one_line_each()
        if noticed is not None and (noticed == POOL or run.exists(noticed)):
            self.check_noticed(noticed)

    def _reserved(self, parent: str, recorded: Mapping[str, Decimal], lines: dict) -> None:
        """The totals' reserved part is what the lines in view reserve, plus what children
        gone with their lines held and the parent has not noticed yet (nothing once it has
        passed with a fresh view: check_noticed)."""
        unnoticed = self._unnoticed(parent)
        assert same(recorded, plus(lines, unnoticed)), (
            f"{parent}: reserved {recorded} != {lines} + {unnoticed} gone unnoticed"
        )

    def _unnoticed(self, parent: str) -> dict[str, Decimal]:
        """What children gone by hand held here that no lost line (open or settled) keeps:
        never negative (nothing kept twice, nothing kept for a child still there)."""
        kept = plus(self._lost(parent), self._lost_settled(parent))
        unnoticed = minus(self._went(parent), kept)
        assert all(v >= ZERO for v in unnoticed.values()), (
            f"{parent} keeps {kept} for lost children: only {self._went(parent)} went"
        )
        return unnoticed

    def check_noticed(self, parent: str) -> None:
        """After the parent's pass on a fresh view: every child gone with its line is kept,
        exactly, in a lost line."""
        unnoticed = self._unnoticed(parent)
        assert all(v == ZERO for v in unnoticed.values()), f"{parent}: {unnoticed} not kept"

    def _lost_settled(self, parent: str) -> dict[str, Decimal]:
        total: dict[str, Decimal] = {}
        for (where, name), line in self.line_settled.items():
            if where == parent and name.startswith(LOST_CHILDREN_PREFIX):
                total = plus(total, line.reserved)
        return total

    def _lost(self, parent: str) -> dict[str, Decimal]:
        """What the parent keeps in lines for children lost with theirs (unsettled)."""
        total: dict[str, Decimal] = {}
        for uid, line in self.run.lines(parent).items():
            if uid.startswith(LOST_CHILDREN_PREFIX) and line.phase is ChildPhase.RESERVED:
                total = plus(total, line.reserved)
        return total

    def _went(self, parent: str) -> dict[str, Decimal]:
        """What children gone by hand held here, unsettled (their lines went with them):
        read from their last status."""
        run = self.run
        uid = parent
        if parent == POOL:
            uid = run.world.pool.uid if run.world.pool is not None else ""
        in_view = run.lines(parent)
        total: dict[str, Decimal] = {}
        for child in run.removed_by_hand:
            if (parent, child) in self.line_settled:
                continue  # its parent settled its line (in flight when it went)
            line = line_of(run.status(child).parent, "", "", uid)
            if child not in in_view and line is not None and line.phase is ChildPhase.RESERVED:
                total = plus(total, line.reserved)
        return total

    def _envelope(self, uid: str, status: ReservationEnvelopeStatus) -> None:
        run, envelope = self.run, self.run.world.envelopes[uid]
        totals = status.totals
        check_totals(uid, totals)
        self._lines(uid, run.lines(uid))  # (first: it records lost lines settled now)
        reserved, reconciling = held(status.entries.values(), run.lines(uid).values())
        self._reserved(uid, totals.reserved, reserved)
        assert same(totals.reconciling, reconciling), uid
        self._loans(uid, status)
        self._borrowed(uid, status)
        # claims: admitted once, settled once
        claims = [c.uid for c in run.world.claims.values() if c.spec.envelope == envelope.name]
        for claim in claims:
            entry = status.entries.get(claim) or run.records.get(claim)
            if entry is None:
                continue
            if entry.first_reserved_at is not None:
                admitted = (uid, entry.first_reserved_at, dict(entry.reserved))
                assert self.claim_admitted.setdefault(claim, admitted) == admitted, claim
            if entry.settlement is not None:
                first = self.claim_settled.setdefault(claim, (uid, entry.model_copy(deep=True)))
                assert first[1].settlement == entry.settlement, f"{claim} settled twice"
                assert (first[1].consumed, first[1].released) == (
                    entry.consumed,
                    entry.released,
                ), f"{claim} settled twice"
                assert same(plus(entry.consumed, entry.released), entry.reserved), claim
        record = status.parent
        admitted = record is not None and record.admitted_at is not None
        if not admitted:
            live = [e for e in status.entries.values() if e.first_reserved_at is not None]
            assert not live, f"{uid} admitted claims before its parent held its capacity"
            assert not [c for c in run.lines(uid).values() if c.phase is ChildPhase.RESERVED]
        if record is not None:
            first_record = record.model_copy(update={"settled": None, "stamp": 0})
            known = self.records.setdefault(uid, first_record)
            assert known == first_record, f"{uid}: its record changed: {known} -> {record}"
            assert record.depth <= MAX_DEPTH, f"{uid} at depth {record.depth}"
            if record.settled is not None:
                line = self.line_settled.get((parent_key(record), uid))
                assert line is not None, f"{uid} mirrored a line its parent never settled"
                assert unstamped(record.settled) == unstamped(line), (
                    f"{uid} mirrored another line: {record.settled}"
                )
            if admitted and record.kind is ParentKind.ENVELOPE and run.exists(record.uid):
                parent = run.status(record.uid).parent
                assert parent is not None and record.depth == parent.depth + 1, (
                    f"{uid} at depth {record.depth} under a parent recorded {parent}"
                )
            if admitted and record.kind is ParentKind.POOL:
                assert record.depth == POOL_DEPTH + 1, uid
            if admitted and record.kind is not ParentKind.ROOT:
                # it holds what its parent reserved for it, whatever its spec says since
                drawn = {k: totals.capacity.get(k) for k in record.reserved}
                assert drawn == record.reserved, f"{uid}: {totals} != {record}"
        self._committed(uid, totals, claims, status)
        if status.closed_at is not None:
            # Nothing it recorded at close changes again (its capacity may still grow in its
            # spec where it is its own: a root's, or what a pool does not name).
            frozen = totals.model_copy(update={"capacity": {}, "available": {}})
            closed = Closed(status.closed_at, dict(status.balance_released), frozen, admitted)
            first = self.closed.setdefault(uid, closed)
            assert first == closed, f"{uid} changed after it closed: {first} -> {closed}"
            assert same(totals.reserved, {}) and same(totals.reconciling, {}), uid
            # Closed for good: it admits nothing after it released its balance. (Its phase
            # may show Closing again for a while: test_a_closed_envelope_stays_closed.)
            assert status.phase not in (EnvelopePhase.OPEN, EnvelopePhase.PENDING), uid
            late = [e for e in status.entries.values() if e.phase.holds_capacity]
            late += [c for c in run.lines(uid).values() if c.phase is ChildPhase.RESERVED]
            assert not late, f"{uid} admitted after it closed: {late}"
            if first is closed:  # as it closed: R − C, or nothing if it never held anything
                # (with loans: what it still owes was consumed by its claims, so its
                # balance is R + borrowed − C; nothing is lent out by then)
                assert same(totals.lent, {}), f"{uid} closed with loans out: {totals}"
                expected = minus(plus(totals.capacity, totals.borrowed), totals.committed)
                expected = expected if admitted else {}
                assert same(status.balance_released, expected), f"{uid}: balance {status}"
        else:
            assert uid not in self.closed, f"{uid} reopened"

    def _lines(self, parent: str, lines: Mapping[str, ChildEntry]) -> None:
        for child, line in lines.items():
            if child.startswith(LOST_CHILDREN_PREFIX):
                # What children gone with their lines held: settled by a person, once.
                if line.phase is ChildPhase.SETTLED:
                    first = self.line_settled.setdefault((parent, child), line)
                    assert first == line, f"{child} settled twice"
                    assert line.reason == "ForceSettled", f"{child}: {line.reason}"
                    assert same(plus(line.consumed, line.released), line.reserved), child
                continue
            key = (parent, child)
            if line.phase is ChildPhase.RESERVED:
                assert key not in self.line_settled, f"{key}: a settled line reopened"
                # (when: the parent's time in flight, the child's once it holds the line)
                reserved = (None, dict(line.reserved))
                assert self.line_reserved.setdefault(key, reserved) == reserved, key
                # R is the child's capacity when it was reserved (a root's may grow since)
                envelope = self.run.world.envelopes.get(child)
                assert envelope is not None, key
                capacity = envelope.spec.capacity
                assert set(line.reserved) <= set(capacity), key  # from a pool: what it names
                if parent != POOL:
                    assert set(line.reserved) == set(capacity), key
                assert all(v <= capacity[k] for k, v in line.reserved.items()), key
                record = self.run.status(child).parent
                if record is not None and record.admitted_at is not None:
                    assert same(line.reserved, record.reserved), f"{key}: {line} != {record}"
                continue
            first = self.line_settled.setdefault(key, line.model_copy(deep=True))
            assert unstamped(first) == unstamped(line), f"{key} settled twice: {first} -> {line}"
            if line.reason == "Withdrawn":
                assert key not in self.line_reserved, f"{key} withdrawn after it was reserved"
                assert not (line.reserved or line.consumed or line.released), key
                continue
            if line.reason == "ForceSettled":  # gone without settling: a person decided
                assert child in self.run.removed_by_hand, (
                    f"{key} force-settled, not removed by hand"
                )
                assert same(plus(line.consumed, line.released), line.reserved), key
                continue
            assert line.reason == "Closed", f"{key}: settled as {line.reason}"
            assert key in self.line_reserved, f"{key} settled without being reserved"
            assert same(plus(line.consumed, line.released), line.reserved), key
            # R − C upward: C is the child's committed total at close, R − C its balance
            # (less what it consumed of loans from siblings: those lenders commit that).
            closed = self.closed.get(child)
            assert closed is not None, f"{key} settled before the child closed"
            # (in the resources drawn from here: from a pool, those the pool names)
            drawn = set(line.reserved)
            balance = {k: v for k, v in closed.balance.items() if k in drawn}
            charged = minus(closed.totals.committed, closed.totals.borrowed)
            committed = {k: v for k, v in charged.items() if k in drawn}
            assert same(line.released, balance), f"{key}: returned {line.released}"
            assert same(line.consumed, committed), f"{key}: charged {line}"

    def _committed(
        self,
        parent: str,
        totals: ResourceTotals,
        claims: Iterable[str],
        status: ReservationEnvelopeStatus | ReservationPoolStatus,
    ) -> None:
        """committed == Σ C of its settled claims + Σ C of its settled child lines + what
        borrowers consumed of its settled loans; for a Replenishing resource (issue 22),
        what is still in its window: exactly its slices, at most that Σ C."""
        expected = self.loans_consumed(parent)
        for claim in claims:
            settled = self.claim_settled.get(claim)
            if settled is not None and settled[0] == parent:
                expected = plus(expected, settled[1].consumed)
        for (where, _), line in self.line_settled.items():
            if where == parent:
                expected = plus(expected, line.consumed)
        for name, contract in status.contracts.items():
            if contract is not ContractType.REPLENISHING:
                continue
            slices = status.windows.get(name, [])
            in_window = sum((s.amount for s in slices), ZERO)
            assert totals.committed.get(name, ZERO) == in_window, f"{parent} {name}: {slices}"
            assert in_window <= expected.get(name, ZERO), f"{parent} {name}: {expected}"
            expected[name] = in_window
        assert same(totals.committed, expected), f"{parent}: committed {totals} != {expected}"

    def _one_line_each(self) -> None:
        """A child's capacity is one Reserved line in one parent while it is open and
        admitted, and no Reserved line is left for an envelope that is gone."""
        run = self.run
        reserved: dict[str, list[str]] = {}
        for parent, lines in [(POOL, run.lines(POOL))] + [(u, run.lines(u)) for u in run.live()]:
            for child, line in lines.items():
                if line.phase is ChildPhase.RESERVED and not child.startswith(LOST_CHILDREN_PREFIX):
                    reserved.setdefault(child, []).append(parent)
        for child, parents in reserved.items():
            assert len(parents) == 1, f"{child} is reserved in {parents}"
            # (but one removed by hand before it copied its line: kept under its UID)
            gone = not run.exists(child) and child not in run.removed_by_hand
            assert not gone, f"{parents[0]} holds a line for {child}, which is gone"
            record = run.status(child).parent
            if record is not None and record.admitted_at is not None:
                assert parent_key(record) == parents[0], f"{child} draws from {record}"
        for uid in run.live():
            status = run.status(uid)
            record = status.parent
            if record is None or record.admitted_at is None or record.kind is ParentKind.ROOT:
                continue
            if record.uid in run.removed_by_hand:
                continue  # its parent went with every line it had (it closes: parent gone)
            if status.closed_at is None and record.settled is None:
                assert reserved.get(uid) == [parent_key(record)], f"{uid}: lines {reserved}"

    # - loans between siblings -
    def loans_consumed(self, lender: str) -> dict[str, Decimal]:
        """What the lender's settled loans charge it: what its borrowers consumed."""
        consumed: dict[str, Decimal] = {}
        for seen in self.loans:
            if seen.lender == lender and seen.settled is not None:
                consumed = plus(consumed, seen.settled.consumed)
        return consumed

    def _loans(self, uid: str, status: ReservationEnvelopeStatus) -> None:
        """Its loans to siblings: made only as policy.lending allows, above its floor, while
        its own queue wants nothing; repaid only grows; settled once, never reopened; gone
        from its ledger only once settled; `lent` is what is out and not repaid."""
        lent: dict[str, Decimal] = {}
        for borrower, loan in status.loans.items():
            pair = (uid, borrower)
            seen, last = self.loan_now.get(pair), self.loan_last.get(pair)
            if (
                seen is None
                or last is None
                or (last.phase is LoanPhase.SETTLED and loan.phase is LoanPhase.LENT)
            ):
                seen = self._lent(uid, borrower, loan, status)
            else:
                first = seen.lent
                assert (loan.borrower, loan.amount, loan.lent_at) == (
                    first.borrower,
                    first.amount,
                    first.lent_at,
                ), f"{pair}: the loan changed: {first} -> {loan}"
                assert at_most(last.repaid, loan.repaid), f"{pair}: repaid went back: {loan}"
                if last.phase is LoanPhase.SETTLED:
                    assert loan == last, f"{pair}: a settled loan changed: {last} -> {loan}"
            assert all(v >= 0 for v in (*loan.repaid.values(), *loan.consumed.values())), pair
            assert at_most(loan.repaid, loan.amount), f"{pair}: repaid more than lent: {loan}"
            if loan.phase is LoanPhase.SETTLED:
                if seen.settled is None:
                    self._loan_settled(seen, loan, last)
                assert seen.settled == loan, f"{pair} settled twice: {seen.settled} -> {loan}"
            else:
                assert not loan.consumed and loan.settled_at is None, f"{pair}: {loan}"
                lent = plus(lent, minus(loan.amount, loan.repaid))
            self.loan_now[pair], self.loan_last[pair] = seen, loan.model_copy(deep=True)
        for pair, seen in self.loan_now.items():
            if pair[0] == uid and pair[1] not in status.loans and seen is not None:
                assert seen.settled is not None, f"{pair}: a loan left the ledger unsettled"
                if self.run.exists(pair[1]):  # only once its borrower's record is gone or
                    # closed (it never changes again)
                    record = self.run.status(pair[1]).borrowed.get(uid)
                    assert record is None or record.closed_at is not None, f"{pair}: {seen}"
                self.loan_now[pair] = None
        assert same(status.totals.lent, lent), f"{uid}: lent {status.totals.lent} != {lent}"

    def check_lending(self, uid: str, siblings: Iterable[SiblingFacts]) -> None:
        """Lending stays live: after a pass in which an envelope could lend (open, under
        policy.lending, owing nothing, its own queue wanting nothing), no sibling it read
        asking for what it has above its floor is left without a loan, unless MAX_LOANS
        loans hold a place: outstanding ones, and settled ones only while their borrower
        is open or just this pass (issue 21 #7: settled loans of closed borrowers filled
        the ledger and blocked lending for good)."""
        status = self.run.status(uid)
        policy = self.run.world.envelopes[uid].spec.policy.lending
        if policy is None or status.phase is not EnvelopePhase.OPEN or status.wants is not None:
            return
        if any(v for v in status.totals.borrowed.values()):
            return
        read = {s.uid: s for s in siblings}
        places = sum(
            1
            for borrower, loan in status.loans.items()
            if loan.phase is LoanPhase.LENT
            or loan.settled_at == self.run.world.now
            or (borrower in read and read[borrower].accepting)
        )
        if places >= borrowing.MAX_LOANS:
            return
        spare = minus(status.totals.available, policy.floor)
        for sibling in read.values():
            wants = sibling.wants
            if wants is None or not sibling.accepting or sibling.uid in status.loans:
                continue
            need = {k: v for k, v in wants.resources.items() if v > ZERO}
            if need and all(v <= spare.get(k, ZERO) for k, v in need.items()):
                raise AssertionError(
                    f"{uid}: {sibling.name} asks for {need}, {spare} is spare above the "
                    f"floor and {places} loans hold a place: not lent"
                )

    def _lent(
        self, uid: str, borrower: str, loan: Loan, status: ReservationEnvelopeStatus
    ) -> LoanSeen:
        """A loan made in the pass just written: what the lending rules allow."""
        world = self.run.world
        envelope, pair = world.envelopes[uid], (uid, borrower)
        policy = envelope.spec.policy.lending
        assert policy is not None, f"{pair}: lent without policy.lending"
        assert loan.phase is LoanPhase.LENT and loan.lent_at == world.now, f"{pair}: {loan}"
        assert not (loan.repaid or loan.consumed) and loan.settled_at is None, pair
        assert status.wants is None, f"{pair}: lent while its own queue wants {status.wants}"
        assert status.phase is EnvelopePhase.OPEN, f"{pair}: lent while {status.phase}"
        other = world.envelopes.get(borrower)
        assert other is not None and other.uid != uid, f"{pair}: lent to no sibling"
        assert other.spec.parent is not None and other.spec.parent == envelope.spec.parent, pair
        assert loan.borrower == other.name, pair
        assert loan.amount and all(v > 0 for v in loan.amount.values()), pair
        assert set(loan.amount) <= set(status.totals.capacity), f"{pair}: {loan.amount}"
        # Sibling protection: never lent below the floor (what is left after this pass).
        available = status.totals.available
        for name in loan.amount:
            floor = policy.floor.get(name, ZERO)
            assert available.get(name, ZERO) >= floor, f"{pair}: {name} lent below {floor}"
        seen = LoanSeen(uid, borrower, loan.model_copy(deep=True))
        self.loans.append(seen)
        return seen

    def _loan_settled(self, seen: LoanSeen, loan: Loan, last: Loan | None) -> None:
        """A loan settles on what its borrower recorded: repaid in full, or what was not
        repaid when it closed is committed here (its claims consumed it), or in full when
        it never drew on it; once the borrower is gone, only by a person's decision, which
        charges what was not repaid (what was taken back stays taken back)."""
        pair, world = (seen.lender, seen.borrower), self.run.world
        assert loan.settled_at == world.now, f"{pair}: {loan}"
        assert same(plus(loan.repaid, loan.consumed), loan.amount), f"{pair}: {loan}"
        record = self.run.status(seen.borrower).borrowed.get(seen.lender)
        mine = self.record_now.get((seen.borrower, seen.lender)) is seen
        if self.run.exists(seen.borrower):
            if record is not None and mine:
                if record.closed_at is None:
                    assert not still_owed(record), f"{pair} settled while owed: {record}"
                assert same(loan.repaid, record.repaid), f"{pair}: {loan} != {record}"
                assert same(loan.consumed, record.consumed), f"{pair}: {loan} != {record}"
            else:  # never drawn on: nothing consumed
                assert seen.record_first is None, f"{pair}: its record went: {seen}"
                assert same(loan.repaid, loan.amount), f"{pair} charged, never drawn on: {loan}"
        else:  # its borrower is gone: only a person's decision settles it
            decided = world.envelopes[seen.lender].force_settle_gone
            borrower = world.envelopes[seen.borrower]
            assert seen.borrower in decided or borrower.name in decided, pair
            taken_back = last.repaid if last is not None else {}
            assert same(loan.repaid, taken_back), f"{pair}: charged again: {last} -> {loan}"
            if seen.record_closed is not None:  # never less than what its claims consumed
                assert at_most(seen.record_closed.consumed, loan.consumed), f"{pair}: {loan}"
        seen.settled = loan.model_copy(deep=True)

    def _borrowed(self, uid: str, status: ReservationEnvelopeStatus) -> None:
        """Its records of loans from siblings: each of a loan its lender made (same amount),
        recorded once while open; repaid only grows, never beyond the amount; frozen at
        close, with what is still owed as consumed; dropped only once repaid in full;
        `borrowed` is what is still owed."""
        world = self.run.world
        owed: dict[str, Decimal] = {}
        for lender, record in status.borrowed.items():
            pair = (uid, lender)
            seen, last = self.record_now.get(pair), self.record_last.get(pair)
            if seen is None or last is None:
                loan = self.loan_now.get((lender, uid))
                assert loan is not None, f"{pair}: recorded a loan its lender does not hold"
                assert loan.record_first is None, f"{pair}: recorded the same loan twice"
                assert record.received_at == world.now, f"{pair}: {record}"
                assert record.amount == loan.lent.amount, f"{pair}: {record} != {loan.lent}"
                assert record.lender == world.envelopes[lender].name, pair
                # (it may repay at once: its queue may want nothing by the time it records)
                assert not record.consumed and record.closed_at is None, f"{pair}: {record}"
                assert status.phase is EnvelopePhase.OPEN, f"{pair}: recorded while closed"
                seen = loan
                seen.record_first = record.model_copy(deep=True)
            else:
                first = seen.record_first
                assert first is not None, pair
                assert (record.lender, record.amount, record.received_at) == (
                    first.lender,
                    first.amount,
                    first.received_at,
                ), f"{pair}: the record changed: {first} -> {record}"
                assert at_most(last.repaid, record.repaid), f"{pair}: repaid went back"
                if last.closed_at is not None:
                    assert record == last, f"{pair}: changed after close: {last} -> {record}"
            assert all(v >= 0 for v in record.repaid.values()), pair
            assert at_most(record.repaid, record.amount), f"{pair}: repaid too much: {record}"
            if record.closed_at is not None and seen.record_closed is None:
                assert record.closed_at == status.closed_at, f"{pair}: {record}"
                assert same(record.consumed, still_owed(record)), f"{pair}: {record}"
                seen.record_closed = record.model_copy(deep=True)
            elif record.closed_at is None:
                assert not record.consumed and status.closed_at is None, f"{pair}: {record}"
            seen.record = record.model_copy(deep=True)
            owed = plus(owed, still_owed(record))
            self.record_now[pair], self.record_last[pair] = seen, seen.record
        for pair, seen in self.record_now.items():
            if pair[0] == uid and pair[1] not in status.borrowed and seen is not None:
                last = self.record_last[pair]
                assert not still_owed(last), f"{pair}: dropped a record still owed: {last}"
                if self.run.exists(pair[1]):  # and only once its lender settled the loan
                    loan = self.run.status(pair[1]).loans.get(uid)
                    if loan is None:  # (its settled line went first: the record was closed)
                        assert seen.settled is not None and last.closed_at is not None, pair
                    else:
                        assert loan.phase is LoanPhase.SETTLED, pair
                self.record_now[pair] = None
        assert same(status.totals.borrowed, owed), f"{uid}: borrowed {status.totals} != {owed}"

    def _loan_pairs(self) -> None:
        """Both ledgers agree on every loan: a borrower's record is of the loan its lender
        holds (same amount); the lender has taken back at most what the borrower recorded
        as repaid, exactly that once settled; a loan whose borrower is gone is held."""
        run = self.run
        for borrower in run.live():
            for lender, record in run.status(borrower).borrowed.items():
                pair = (lender, borrower)
                seen = self.record_now.get((borrower, lender))
                if not run.exists(lender):
                    # its lender went: it had settled the loan, on this record
                    assert seen is not None and seen.settled is not None, pair
                    if record.closed_at is None:
                        assert not still_owed(record), f"{pair}: owed to a gone lender"
                    continue
                loan = run.status(lender).loans.get(borrower)
                if loan is None:  # its lender settled it and let the line go: closed since
                    assert seen is not None and seen.settled is not None, pair
                    assert record.closed_at is not None, f"{pair}: a loan its lender dropped"
                    continue

                assert self.loan_now.get(pair) is seen, f"{pair}: records another loan"
                assert loan.amount == record.amount, f"{pair}: {loan} != {record}"
                if loan.phase is LoanPhase.LENT:
                    assert at_most(loan.repaid, record.repaid), f"{pair}: {loan} > {record}"
                else:
                    assert same(loan.repaid, record.repaid), f"{pair}: {loan} != {record}"
                    assert same(loan.consumed, record.consumed), f"{pair}: {loan} != {record}"
                    if record.closed_at is None:
                        assert not still_owed(record), f"{pair}: settled while owed"


def unstamped(line: ChildEntry) -> ChildEntry:
    """A line as settled, whatever write recorded it (an upgrade leaves old stamps at 0)."""
    return line.model_copy(update={"stamp": 0})


def drawn_from(status: ReservationEnvelopeStatus, uid: str) -> bool:
    return status.parent is not None and status.parent.uid == uid


def parent_key(record: ParentRecord) -> str:
    """Where the auditor keys a parent: the pool, or the parent envelope's uid."""
    return POOL if record.kind is ParentKind.POOL else record.uid
