"""Read-only views of claims and envelopes, as the SDK returns them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from reservoir.core import contracts
from reservoir.core.childlines import current, line_of
from reservoir.core.claimstatus import expanded
from reservoir.core.inflight import newest
from reservoir.core.model import (
    Adjustment,
    BranchClaimSpec,
    BranchClaimStatus,
    ChildEntry,
    ClaimPhase,
    Contract,
    ContractType,
    EnvelopePhase,
    EnvelopeState,
    LedgerEntry,
    Outcome,
    ReservationPoolSpec,
    ReservationPoolStatus,
    RetryHold,
    Settlement,
    Transition,
    WindowSlice,
)
from reservoir.core.model import ReservationEnvelopeStatus as EnvelopeStatus
from reservoir.core.quantity import QuantityError, parse_quantity
from reservoir.core.windows import replenishing
from reservoir.sdk.patches import LEDGER_FIELD

# Envelope phases in which the operator extends no lease and admits no work.
NOT_ACCEPTING_PHASES = frozenset(
    {EnvelopePhase.CLOSING, EnvelopePhase.CLOSED, EnvelopePhase.EXPIRED}
)


def claim_record(obj: Mapping[str, Any]) -> tuple[BranchClaimStatus, LedgerEntry | None]:
    """A claim's status (with its line's fields laid over it: `expanded`) and its ledger
    line as the claim carries it (`status.ledger`, None when absent)."""
    status = expanded(BranchClaimStatus.model_validate(obj.get("status") or {}))
    return status, status.ledger


@dataclass(frozen=True)
class ClaimView:
    """A claim as last read: pass it back to the next verb, which decides on it and sends
    one JSON patch whose tests carry what the decision relied on (reservoir.sdk.patches).

    The claim's authoritative record is its line of the ledger. It is read from the claim
    itself: `status.ledger` (a LedgerEntry) when the operator writes it there, else the
    claim's status, which mirrors the line (and carries it once a settled line was
    compacted away). Views listed with their envelope (`claims`, `tree`) take a claim's
    line from the envelope's ledger when the claim carries none. The `ledger_*` properties
    and `settlement` read `entry` when there is one and the status otherwise. `phase`,
    `expires_at` and `renewals` are the status mirror, as `kubectl get` shows it.
    """

    name: str
    namespace: str
    uid: str
    resource_version: str
    spec: BranchClaimSpec
    status: BranchClaimStatus
    deleting: bool = False  # metadata.deletionTimestamp is set
    # metadata.generation: moves with every spec write and with the deletion, not with the
    # operator's status writes; the SDK's spec writes are conditional on it.
    generation: int = 0
    # The claim's line of the ledger: its `status.ledger`, else (views listed with their
    # envelope) its entry in the envelope's ledger; None: not admitted, compacted, or not
    # carried. `ledger_read` says whether the envelope was read at all.
    entry: LedgerEntry | None = None
    ledger_read: bool = False
    # Known only when the envelope was read (`claims`, `tree`); the verbs do not read it: the
    # operator refuses work on a deleting or closed envelope (see AsyncReservoir.dispatch).
    envelope_deleting: bool = False
    # False once the envelope is closed, expired or deleting: no lease is extended.
    envelope_accepting: bool = True
    # The claim object as read: the verbs' patches test what they relied on against it.
    body: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def from_api(cls, obj: Mapping[str, Any]) -> ClaimView:
        meta = obj["metadata"]
        status, line = claim_record(obj)
        return cls(
            name=meta["name"],
            namespace=meta.get("namespace", ""),
            uid=meta["uid"],
            resource_version=meta["resourceVersion"],
            spec=BranchClaimSpec.model_validate(obj.get("spec") or {}),
            status=status,
            deleting=bool(meta.get("deletionTimestamp")),
            generation=int(meta.get("generation") or 0),
            entry=line,
            body=obj,
        )

    @property
    def created_at(self) -> datetime | None:
        """When the API server created it (the age a queue orders by)."""
        created = ((self.body or {}).get("metadata") or {}).get("creationTimestamp")
        return datetime.fromisoformat(created) if isinstance(created, str) else None

    def with_ledger(self, envelope: dict[str, Any] | None) -> ClaimView:
        """This view with what `envelope` (a ReservationEnvelope as read; None when it does
        not exist) says of it: whether it is deleting or admits work, and, when the claim
        carries no `status.ledger` of its own, its entry in the envelope's ledger."""
        own = self.entry if self.carries_ledger else None
        if envelope is None:
            return dataclasses.replace(
                self, entry=own, ledger_read=True, envelope_deleting=False, envelope_accepting=True
            )
        # Only this claim's entry and the envelope's phase are parsed, not the whole ledger:
        # a verb reads the envelope once per call, and the ledger grows with the envelope.
        status = envelope.get("status") or {}
        raw_entry = (status.get("entries") or {}).get(self.uid)
        phase = EnvelopeStatus.model_validate({k: v for k, v in status.items() if k == "phase"})
        deleting = bool((envelope.get("metadata") or {}).get("deletionTimestamp"))
        closed = (envelope.get("spec") or {}).get("state") == EnvelopeState.CLOSED.value
        entry = None if raw_entry is None else LedgerEntry.model_validate(raw_entry)
        entry = newest(entry, own)  # the claim's own line, unless a newer move is in flight
        return dataclasses.replace(
            self,
            entry=entry,
            ledger_read=True,
            envelope_deleting=deleting,
            envelope_accepting=not (deleting or closed or phase.phase in NOT_ACCEPTING_PHASES),
        )

    def with_object(self, obj: Mapping[str, Any]) -> ClaimView:
        """The claim object `obj` (a newer read or a write's answer), with this view's
        envelope-ledger entry only when the claim carries no line of its own."""
        fresh = ClaimView.from_api(obj)
        if fresh.carries_ledger or not self.ledger_read:
            return fresh
        return dataclasses.replace(
            fresh,
            entry=self.entry,
            ledger_read=True,
            envelope_deleting=self.envelope_deleting,
            envelope_accepting=self.envelope_accepting,
        )

    @property
    def carries_ledger(self) -> bool:
        """Whether the claim object carries its ledger line (`status.ledger`)."""
        status = (self.body or {}).get("status")
        return isinstance(status, Mapping) and status.get(LEDGER_FIELD) is not None

    # --- the status mirror (what `kubectl get` shows) ------------------------------------

    @property
    def phase(self) -> ClaimPhase:
        return self.status.phase

    @property
    def expires_at(self) -> datetime | None:
        return self.status.lease.expires_at if self.status.lease else None

    @property
    def renewals(self) -> int:
        return self.status.lease.renewals if self.status.lease else 0

    def condition(self, kind: str) -> bool:
        return any(c.type == kind and c.status == "True" for c in self.status.conditions)

    # --- the authoritative record: the ledger entry if there is one, else the status ----

    @property
    def ledger_phase(self) -> ClaimPhase:
        return self.entry.phase if self.entry is not None else self.status.phase

    @property
    def ledger_expires_at(self) -> datetime | None:
        return self.entry.expires_at if self.entry is not None else self.expires_at

    @property
    def ledger_renewals(self) -> int:
        return self.entry.renewals if self.entry is not None else self.renewals

    @property
    def settlement(self) -> Settlement | None:
        return self.entry.settlement if self.entry is not None else self.status.settlement

    @property
    def speculation_group(self) -> str | None:
        return self.spec.speculation_group

    @property
    def superseded_by(self) -> str | None:
        """The copy of its speculation group that won, if this one lost (its record)."""
        return self.entry.superseded_by if self.entry is not None else None

    @property
    def settled(self) -> bool:
        return self.ledger_phase.terminal or self.settlement is not None

    @property
    def record(self) -> LedgerEntry | BranchClaimStatus:
        """The claim's authoritative record: its ledger entry, else its status (which
        carries it once a settled entry was compacted out of the ledger)."""
        return self.entry if self.entry is not None else self.status

    @property
    def history(self) -> list[Transition]:
        """The claim's transitions, oldest first, as its record keeps them."""
        return list(self.record.history)

    @property
    def occupancy(self) -> dict[str, Decimal]:
        """Reusable resources: R times the seconds the claim held them (device-seconds,
        permit-seconds), recorded at settlement; never charged. Empty until settled."""
        return dict(self.record.occupancy)


@dataclass(frozen=True)
class ResultView:
    """What became of a claim, as a client that reconnects asks for it by name: the
    phase, the outcome and the durable result reference, C and R − C. Read from the
    claim's own record, which outlives its worker and its ledger entry."""

    name: str
    namespace: str
    phase: ClaimPhase
    outcome: Outcome | None = None  # the settlement's outcome (None: none reported)
    result: str | None = None  # the recorded result reference (URI or object name)
    reason: str | None = None  # why it settled
    settled_at: datetime | None = None
    reserved: dict[str, Decimal] = dataclasses.field(default_factory=dict)  # R
    consumed: dict[str, Decimal] = dataclasses.field(default_factory=dict)  # C
    released: dict[str, Decimal] = dataclasses.field(default_factory=dict)  # R − C
    # A late completion after a deadline decision (returned/charged since), and what a
    # failed attempt keeps for the branch's next attempt: R − C is not all back yet.
    adjustment: Adjustment | None = None
    retry: RetryHold | None = None
    # Reusable resources: R times the seconds held (returned in full, never charged).
    occupancy: dict[str, Decimal] = dataclasses.field(default_factory=dict)

    @property
    def settled(self) -> bool:
        return self.phase.terminal or self.settled_at is not None

    @classmethod
    def of(cls, claim: ClaimView) -> ResultView:
        record = claim.record
        settlement = record.settlement
        return cls(
            name=claim.name,
            namespace=claim.namespace,
            phase=record.phase,
            outcome=settlement.outcome if settlement else None,
            result=record.result,
            reason=settlement.reason if settlement else None,
            settled_at=settlement.at if settlement else None,
            reserved=dict(record.reserved),
            consumed=dict(record.consumed),
            released=dict(record.released),
            adjustment=record.adjustment,
            retry=record.retry,
            occupancy=dict(record.occupancy),
        )


def shown_contracts(
    resources: Iterable[str],
    recorded: Mapping[str, ContractType],
    declared: Mapping[str, Contract],
) -> dict[str, ContractType]:
    """Each resource's contract as the operator recorded it (status.contracts); for a
    resource it has not recorded yet (a budget it has not written), the declared one or
    the default by name (reservoir.core.contracts)."""
    resolved = contracts.types(contracts.resolve({*resources, *declared}, declared))
    return {name: recorded.get(name, kind) for name, kind in resolved.items()} | {
        name: kind for name, kind in recorded.items() if name not in resolved
    }


def declared_contracts(spec: Mapping[str, Any]) -> dict[str, Contract]:
    """spec.contracts as written (an unreadable one is left out: the view only shows it)."""
    declared: dict[str, Contract] = {}
    for name, raw in (spec.get("contracts") or {}).items():
        try:
            declared[name] = Contract.model_validate(raw)
        except ValueError:
            continue
    return declared


class BudgetContracts:
    """What an envelope's and a pool's views show of their resources' contracts."""

    status: EnvelopeStatus | ReservationPoolStatus
    declared: dict[str, Contract]  # spec.contracts, as written
    capacity: tuple[str, ...]  # the names of spec.capacity's resources

    @property
    def contracts(self) -> dict[str, ContractType]:
        """Every resource's contract: Reusable, Consumable or Replenishing."""
        resources = [*self.capacity, *self.status.totals.capacity]
        return shown_contracts(resources, self.status.contracts, self.declared)

    @property
    def peak(self) -> dict[str, Decimal]:
        """Reusable and Replenishing resources: the most ever in use at once."""
        return dict(self.status.peak)

    @property
    def windows(self) -> dict[str, list[WindowSlice]]:
        """Replenishing resources: what is committed in each slice, until it returns."""
        return {name: list(slices) for name, slices in self.status.windows.items()}

    @property
    def window_seconds(self) -> dict[str, int]:
        """Replenishing resources: the provider's window, in seconds."""
        return replenishing(self.declared)


@dataclass(frozen=True)
class EnvelopeView(BudgetContracts):
    name: str
    namespace: str
    status: EnvelopeStatus
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    uid: str = ""
    parent: str | None = None  # spec.parent: the envelope it asks to draw from
    # spec.contracts: the contracts declared at creation (the others are defaults by name).
    declared: dict[str, Contract] = dataclasses.field(default_factory=dict)
    capacity: tuple[str, ...] = ()  # the names of spec.capacity's resources
    amounts: dict[str, Decimal] = dataclasses.field(default_factory=dict)  # spec.capacity
    created_at: datetime | None = None
    priority_class: str | None = None  # spec.priorityClassName: its class in its pool
    accepting: bool = True  # Open, not being deleted

    @classmethod
    def from_api(cls, obj: dict[str, Any]) -> EnvelopeView:
        meta = obj["metadata"]
        spec = obj.get("spec") or {}
        created = meta.get("creationTimestamp")
        return cls(
            name=meta["name"],
            namespace=meta.get("namespace", ""),
            status=EnvelopeStatus.model_validate(obj.get("status") or {}),
            labels=dict(meta.get("labels") or {}),
            uid=meta.get("uid", ""),
            parent=spec.get("parent"),
            declared=declared_contracts(spec),
            capacity=tuple(spec.get("capacity") or ()),
            amounts=readable_amounts(spec.get("capacity")),
            created_at=datetime.fromisoformat(created) if isinstance(created, str) else None,
            priority_class=spec.get("priorityClassName"),
            accepting=spec.get("state", "Open") == "Open" and not meta.get("deletionTimestamp"),
        )


def readable_pool_spec(spec: Mapping[str, Any]) -> ReservationPoolSpec | None:
    try:
        return ReservationPoolSpec.model_validate(spec)
    except ValueError:
        return None


def readable_amounts(capacity: Any) -> dict[str, Decimal]:
    """spec.capacity as amounts, leaving out any the parser cannot read (shown, not judged)."""
    found: dict[str, Decimal] = {}
    for name, text in (capacity or {}).items() if isinstance(capacity, Mapping) else ():
        try:
            found[str(name)] = parse_quantity(str(text))
        except QuantityError:
            continue
    return found


@dataclass(frozen=True)
class EnvelopeTree:
    """An envelope, its claims, and the child envelopes drawing on it, each a tree.

    `children` is None below the depth bound (MAX_DEPTH levels are read): those envelopes
    were not listed. A child's capacity is one line: the child's own status holds it
    (`status.parent`), this envelope's `status.children` while a move of it is in flight
    (keyed by the child's UID): `line` reads the current one, like a claim's line."""

    envelope: EnvelopeView
    claims: tuple[ClaimView, ...] = ()
    children: tuple[EnvelopeTree, ...] | None = ()

    def line(self, child: EnvelopeView) -> ChildEntry | None:
        """`child`'s line in this envelope's ledger, or its settled record of it; None
        while it is not admitted (or was never listed here)."""
        entry = self.envelope.status.children.get(child.uid) if child.uid else None
        record = child.status.parent
        held = line_of(record, child.name, child.namespace, self.envelope.uid)
        return current(entry, held)

    def orphan_lines(self) -> dict[str, ChildEntry]:
        """Lines of this ledger whose child envelope was not found among the children
        (gone, its line held until someone decides, or settled and not yet compacted).
        Empty when the children were not read (below the depth bound)."""
        if self.children is None:
            return {}
        listed = {child.envelope.uid for child in self.children}
        return {
            uid: entry for uid, entry in self.envelope.status.children.items() if uid not in listed
        }


@dataclass(frozen=True)
class PoolView(BudgetContracts):
    """A ReservationPool (cluster-scoped): a tenant's quota and its envelopes' lines."""

    name: str
    status: ReservationPoolStatus
    namespaces: tuple[str, ...] = ()
    uid: str = ""
    declared: dict[str, Contract] = dataclasses.field(default_factory=dict)  # spec.contracts
    capacity: tuple[str, ...] = ()  # the names of spec.capacity's resources
    # The lines its envelopes hold (envelope uid -> line, from their `status.parent`), and
    # whether every namespace of the pool could be listed for them.
    held: dict[str, ChildEntry] = dataclasses.field(default_factory=dict)
    complete: bool = True
    spec: ReservationPoolSpec | None = None  # None: the spec cannot be read
    envelopes: tuple[EnvelopeView, ...] = ()  # those of its namespaces the caller could list
    # The namespaces that draw from it (a namespace two pools list draws from the older);
    # None: not worked out (every namespace it lists).
    drawing: tuple[str, ...] | None = None

    def lines(self) -> dict[str, ChildEntry]:
        """Every line of the pool's ledger: in flight on the pool, else as its envelope
        holds it."""
        uids = set(self.status.children) | set(self.held)
        found = {u: current(self.status.children.get(u), self.held.get(u)) for u in uids}
        return {u: line for u, line in found.items() if line is not None}

    def with_envelopes(self, envelopes: Iterable[EnvelopeView], complete: bool) -> PoolView:
        """This view with the lines `envelopes` (those of its namespaces) hold."""
        held = {
            e.uid: line
            for e in envelopes
            if (line := line_of(e.status.parent, e.name, e.namespace, self.uid)) is not None
        }
        return dataclasses.replace(self, held=held, complete=complete, envelopes=tuple(envelopes))

    @classmethod
    def from_api(cls, obj: dict[str, Any]) -> PoolView:
        meta = obj["metadata"]
        spec = obj.get("spec") or {}
        return cls(
            name=meta["name"],
            status=ReservationPoolStatus.model_validate(obj.get("status") or {}),
            namespaces=tuple(spec.get("namespaces") or ()),
            uid=meta.get("uid", ""),
            declared=declared_contracts(spec),
            capacity=tuple(spec.get("capacity") or ()),
            spec=readable_pool_spec(spec),
            envelopes=(),
        )
