"""One envelope's reconcile: from its spec, its current ledger and the facts of its claims,
compute the next ledger. Level-triggered and idempotent: the result depends only on the
inputs, and feeding it back with the same facts changes nothing.

Decide only on recorded facts (see reservoir.core.lifecycle): the ledger passed in is the
durable record, the claims' facts are read as monotonic, and a claim missing from the
facts has been confirmed gone by the caller. A claim that vanished keeps the usage its
entry recorded; its settlement then waits for its facts (deadline) or for a person's
decision named on the envelope (`force_settle_gone`).

The ledger stays bounded: a settled entry is compacted away once its claim's own status
carries the same record (`ClaimFacts.settled_record`), and a claim that never held
anything gets an entry only while the ledger has plenty of room; otherwise its verdict
lives in its status alone (`Reconciliation.off_ledger`).

The operator calls this once per batch of claim events (group commit) and writes the
result with one compare-and-swap; on a conflict it re-reads and calls it again.

`reconcile` reads as the pass's steps, each a function named in its docstring: where the
capacity comes from, the claims in view, advance the held lines, late facts of settled
claims, children and loans, admit the queue, borrow or lend, compact, close the books,
place each line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from reservoir.core.borrowing import (
    SiblingFacts,
    borrowed_total,
    close_borrowings,
    lend,
    lent_total,
    receive_loans,
    repay,
    settle_loans,
    shortage,
)
from reservoir.core.budgets import (
    ChildFacts,
    ChildLedger,
    ParentIdentity,
    ParentView,
    admit_child,
    draw_record,
    settle_children,
    waiting_children,
)
from reservoir.core.childlines import ChildView, lost_line, merge_children, place_children
from reservoir.core.childlines import adds_up as children_add_up
from reservoir.core.childlines import missing as children_missing
from reservoir.core.claimstatus import settled_view
from reservoir.core.compensation import Moved, compensate
from reservoir.core.conditions import Desired, merge_conditions
from reservoir.core.contracts import (
    Contracts,
    of_type,
    raise_peak,
    resolve,
    reusable,
    summary,
    types,
    uncommit_reusable,
)
from reservoir.core.devices import DeviceFacts, device_counts, device_problem
from reservoir.core.inflight import (
    IN_FLIGHT_LIMIT,
    LOST_PREFIX,
    MOVES_PER_PASS,
    NEXT_MOVES,
    ClaimViewBehindError,
    View,
    adds_up,
    footprint,
    lost_amounts,
    merge,
    place,
)
from reservoir.core.ledger import (
    ZERO,
    add,
    compute_totals,
    devices_in_use,
    fits,
    one_line,
    subtract,
)
from reservoir.core.ledgersize import (
    LEDGER_BYTES_BUDGET,
    entry_bytes,
    ledger_bytes,
    projected_bytes,
)
from reservoir.core.lifecycle import (
    ClaimFacts,
    LedgerEvent,
    Step,
    advance,
    close_retry_window,
    fits_holder,
    queue_bound,
    record_after_settlement,
    record_transition,
    record_usage,
    settle,
)
from reservoir.core.model import (
    MAX_SPECULATION_GROUPS,
    SUMMARY_LENGTH,
    BorrowRequest,
    BranchClaimSpec,
    ChildEntry,
    ChildPhase,
    ClaimPhase,
    ContractType,
    DeviceHold,
    EnvelopePhase,
    EnvelopePolicy,
    EnvelopeState,
    EnvelopeSummary,
    Fallback,
    LedgerEntry,
    LoanPhase,
    ParentKind,
    ParentRecord,
    PhysicalHold,
    PreemptionOutcome,
    ReservationEnvelopeSpec,
    ReservationEnvelopeStatus,
    ResourceTotals,
    RetryHold,
    Trigger,
)
from reservoir.core.policy import (
    Admission,
    QueueKey,
    admission,
    ambiguity_deadline,
    first_expiry,
    queue_expired,
    request_problem,
    within_grant,
)
from reservoir.core.preemption import decided_on, preempted, verdict
from reservoir.core.provider import (
    FIRST_LOOKUP_WAIT_SECONDS,
    OBJECT_LOOKUP_SECONDS,
    Adapter,
    adapter_for,
    cancel_to_forward,
    late_answer_wanted,
    needs_lookup,
)
from reservoir.core.quiet import QuietClaims, Terms, stays_quiet
from reservoir.core.speculation import superseded, winners
from reservoir.core.text import MESSAGE_LENGTH, bounded
from reservoir.core.windows import expire_windows, next_return, record_windows, refill_note

# Claims that never held anything get a line in flight only while the record in flight has
# room for half its new lines, so rejections never crowd out admissions.
UNADMITTED_ENTRIES_ROOM = IN_FLIGHT_LIMIT // 2
# Behind the head of the queue, which says why it waits: a message that named the head
# changed for every claim queued behind it at each admission, a status write each (a queue
# of N claims rewrote N statuses per admission).
QUEUED = Admission(False, "Queued", "queued behind claims ahead of it (priority, then age)")
# Why an admissible claim waits when the pass has no room left for new lines in flight.
MOVES_IN_FLIGHT = Admission(
    False,
    "MovesInFlight",
    f"the envelope records at most {IN_FLIGHT_LIMIT} new claims' moves at once: "
    "admitted on the next pass",
)


UNRECORDED = "(not recorded)"  # an earlier envelope's UID a claim's status does not hold


@dataclass(frozen=True)
class EnvelopeFacts:
    spec: ReservationEnvelopeSpec
    created_at: datetime
    generation: int = 1
    deleting: bool = False
    # claim name or UID -> a person's audited reason, for entries whose claim object is gone
    force_settle_gone: Mapping[str, str] = field(default_factory=dict)
    name: str = ""
    uid: str = ""
    # The parent it names, or the pool covering its namespace; None: it is a root.
    parent: ParentView | None = None
    children: Sequence[ChildFacts] = ()  # envelopes naming this one as their parent
    siblings: Sequence[SiblingFacts] = ()  # the other children of its parent envelope
    closed: bool = False  # its ledger recorded that it closed: it never admits again
    # Its ledger recorded that it expired (status.phase Expired): expired for good, whatever
    # its lifetime says since (the API server refuses raising or removing it then).
    expired_recorded: bool = False

    def expired(self, now: datetime) -> bool:
        if self.expired_recorded:
            return True
        lifetime = self.spec.lifetime_seconds
        return lifetime is not None and now >= self.created_at + timedelta(seconds=lifetime)

    def accepting(self, now: datetime) -> bool:
        return not (
            self.deleting
            or self.closed
            or self.spec.state is EnvelopeState.CLOSED
            or self.expired(now)
        )

    def effective(self, record: ParentRecord | None) -> EnvelopeFacts:
        """Deleting a parent (or losing it) closes its children and cancels their claims,
        as deleting the envelope itself would."""
        parent = self.parent
        admitted = record is not None and record.admitted_at is not None
        if (
            admitted
            and record is not None
            and record.kind is not ParentKind.ROOT
            and parent is not None
            and (parent.deleting or parent.uid != record.uid)
            and not self.deleting
        ):
            return replace(self, deleting=True)
        return self


@dataclass
class Reconciliation:
    status: ReservationEnvelopeStatus
    now: datetime
    events: list[LedgerEvent] = field(default_factory=list)
    dimensions: frozenset[str] = frozenset()  # the envelope's resources
    # New lines (admissions, verdicts) this pass may still put in flight, and what the
    # byte budget of the envelope's status still has for lines in flight (each line is
    # charged the most it can ever grow to: the record in flight can never outgrow etcd).
    new_lines_room: int = IN_FLIGHT_LIMIT
    room_bytes: int = 0
    pending: dict[str, Admission] = field(default_factory=dict)  # claim uid -> why waiting
    # settled claims whose record lives in their own status, not the ledger: uid -> record
    off_ledger: dict[str, LedgerEntry] = field(default_factory=dict)
    expired_claims: list[str] = field(default_factory=list)  # names past the settled TTL
    # uid -> device counts: claims whose devices must be held (a ResourceClaim and a
    # placeholder pod). Any other claim's ResourceClaim is to be let go.
    device_holds: dict[str, dict[str, int]] = field(default_factory=dict)
    # uids of device claims handed to their workload pod (recorded in this ledger): the
    # pod's gate may be lifted, and its placeholder goes once the pod holds the devices.
    # (claim uid -> the UID of the pod it was handed to, "" if not recorded)
    handed_off: dict[str, str] = field(default_factory=dict)
    # Of those, the claims whose workload pod's gate stays: a cancel was recorded first.
    keep_gated: set[str] = field(default_factory=set)
    devices_seen: Mapping[str, DeviceFacts] = field(default_factory=dict)
    awaiting: list[LedgerEntry] = field(default_factory=list)  # would-be entries, this pass
    # uid -> why an admitted claim that asked for its devices has none yet (policy Commit)
    awaiting_devices: dict[str, str] = field(default_factory=dict)
    wake_at: datetime | None = None  # when to reconcile again even without new facts
    admitted: bool = False  # its parent (or pool) holds its capacity, or it is a root
    # the claim at the head of the queue that waits for capacity, and what it is short of
    short: tuple[ClaimFacts, dict[str, Decimal]] | None = None
    # Closed, and its parent has nothing more to learn from it: settled its line, recorded
    # a withdrawal, or is gone. Only then may the envelope object go.
    done_upward: bool = False
    children_unsettled: int = 0
    # Its child envelopes' lines: the view the pass starts from, and every line after it
    # (status.children holds those in flight; see reservoir.core.childlines).
    child_view: ChildView = field(default_factory=ChildView)
    child_lines: dict[str, ChildEntry] = field(default_factory=dict)
    lost_children: str | None = None  # the line kept for children gone with their lines
    lost_children_amount: dict[str, Decimal] = field(default_factory=dict)  # found this pass
    pending_children: dict[str, Admission] = field(default_factory=dict)  # child uid -> why
    # Retry holds (by id) a retry waiting for its devices counts on in this pass.
    holds_in_use: set[int] = field(default_factory=set)
    envelope_uid: str = ""  # the envelope's UID: a claim's status is bound to it
    # Every resource's contract (reservoir.core.contracts), and the Reusable ones.
    contracts: Contracts = field(default_factory=dict)
    reusable: frozenset[str] = frozenset()
    windowed: frozenset[str] = frozenset()  # the Replenishing ones
    # Compensation charges waiting for room: the envelope does not close before they had
    # their last call on its balance.
    charges_waiting: dict[str, Decimal] = field(default_factory=dict)
    # claim uid -> why it is set aside: bound to an earlier envelope of the same name
    replaced: dict[str, str] = field(default_factory=dict)
    # Every line in view after the pass (status.entries holds those in flight), the lines
    # as the pass found them, and the lines to write to claims' statuses.
    lines: dict[str, LedgerEntry] = field(default_factory=dict)
    before: dict[str, LedgerEntry] = field(default_factory=dict)
    to_claims: dict[str, LedgerEntry] = field(default_factory=dict)
    lost: str | None = None  # the line this pass made for claims gone without their lines
    postponed: set[str] = field(default_factory=set)  # held lines left for the next pass
    quiet: QuietClaims = field(default_factory=QuietClaims)  # settled claims to pass by

    def entry(self, uid: str) -> LedgerEntry | None:
        return self.lines.get(uid) or self.off_ledger.get(uid)

    def look_again_by(self, moment: datetime) -> None:
        """The next pass comes at `moment` at the latest, even without new facts."""
        self.wake_at = min(self.wake_at or moment, moment)


def reconcile(
    envelope: EnvelopeFacts,
    status: ReservationEnvelopeStatus,
    claims: Sequence[ClaimFacts],
    now: datetime,
    devices: Mapping[str, DeviceFacts] | None = None,
    departed: Mapping[str, LedgerEntry] | None = None,
    fresh: bool = True,
    quiet: QuietClaims | None = None,
) -> Reconciliation:
    """`devices`: claim uid -> what its ResourceClaim shows, for every ResourceClaim of the
    envelope's claims that exists (listed after the claims). `departed`: the last lines of
    this envelope's claims seen deleted. `fresh`: the claims were read from the API server
    just now (not from a watch that may lag): lines the envelope counts and no claim holds
    are then lost, not late (see reservoir.core.inflight). `quiet`: the settled claims the
    previous pass found quiet (reservoir.core.quiet), passed by while their facts are equal.

    Raises ClaimViewBehindError when the claims, not fresh, do not add up to the record.

    The pass, step by step (each a function of this module):
      0. `_where_capacity_comes_from`: its parent's or pool's verdict, recorded once;
         `_claims_in_view`: the claims it decides on and every line in view;
      1. `_advance_held`: every claim that holds a line, by its facts;
      2. `_late_facts_of_settled`: settled claims whose record is their own status;
         `_settle_closed_children` (2b) and `_settle_sibling_loans` (2c);
      3. `_admit_the_queue`: waiting claims and child envelopes, in one queue order;
         `_borrow_repay_or_lend` (3b);
      4. `_compact`: settled lines leave once their claims carry them;
         `_close_the_books`: totals, the envelope's own lifecycle, when to look again;
      5. `_place`: each line in flight on the envelope, or to its claim alone."""
    dimensions = frozenset(envelope.spec.capacity)
    result = Reconciliation(status=status.copied(), now=now, dimensions=dimensions)
    result.devices_seen = devices or {}
    result.contracts = resolve(dimensions, envelope.spec.contracts)
    result.reusable = reusable(result.contracts)
    result.windowed = of_type(result.contracts, ContractType.REPLENISHING)
    envelope = _where_capacity_comes_from(result, envelope)
    facts_by_uid, view = _claims_in_view(result, envelope, status, claims, departed or {}, fresh)
    _supersede_the_losers(result, facts_by_uid, view, envelope.spec.policy)
    envelope = _give_room_if_preempted(result, envelope, facts_by_uid, view)
    books = _Books.open(result, envelope, facts_by_uid, view)
    _advance_held(books)
    _late_facts_of_settled(books, quiet)
    _settle_closed_children(books)
    _settle_sibling_loans(books)
    _admit_the_queue(books)
    _borrow_repay_or_lend(books)
    _compact(books)
    _close_the_books(books)
    _place(result, view, status, facts_by_uid)
    return result


@dataclass
class _Books:
    """The books as one pass keeps them from step to step: the envelope as the pass reads
    it, its claims' facts, and the balance as the steps move it."""

    result: Reconciliation
    envelope: EnvelopeFacts  # its parent's verdict applied (reservoir.core.budgets)
    facts: dict[str, ClaimFacts]  # claim uid -> facts, of the claims it decides on
    view: View
    # What is consumed for good so far, as the steps settle lines (the totals' input).
    committed: dict[str, Decimal]
    # What a late completion may be charged from: the balance as last written (nothing in
    # steps 1 and 2 draws it down), only while the envelope is open.
    room: dict[str, Decimal] | None
    # A compensation may move the balance until the envelope has closed; closing, with
    # nothing held any more, a charge that waits for room takes what there is.
    comp_room: dict[str, Decimal] | None
    last_call: bool
    charges_waiting: dict[str, Decimal] = field(default_factory=dict)
    look_again: datetime | None = None
    children: ChildLedger | None = None  # its child envelopes' lines (step 2b)
    waiting: list[ClaimFacts] = field(default_factory=list)  # claims queued (step 3)
    balance: dict[str, Decimal] = field(default_factory=dict)  # what is left to admit on

    @classmethod
    def open(
        cls,
        result: Reconciliation,
        envelope: EnvelopeFacts,
        facts: dict[str, ClaimFacts],
        view: View,
    ) -> _Books:
        ledger, now = result.status, result.now
        committed = dict(ledger.totals.committed)
        if ledger.closed_at is None:
            # A Replenishing resource's consumption returns once its window has passed (a
            # closed envelope's balance is recorded: it no longer moves).
            committed, ledger.windows = expire_windows(
                committed, ledger.windows, result.contracts, now
            )
            # A Reusable resource is never committed: what a ledger recorded as committed
            # before its contract existed (every resource settled R − C) comes back.
            committed = uncommit_reusable(committed, result.reusable)
        open_now = envelope.accepting(now)
        available = ledger.totals.available  # copied: each room is drawn down on its own
        return cls(
            result=result,
            envelope=envelope,
            facts=facts,
            view=view,
            committed=committed,
            room=dict(available) if open_now and result.admitted else None,
            comp_room=dict(available) if result.admitted and ledger.closed_at is None else None,
            last_call=not open_now and not _holds_any(ledger),
        )

    @property
    def ledger(self) -> ReservationEnvelopeStatus:
        return self.result.status

    @property
    def now(self) -> datetime:
        return self.result.now

    @property
    def policy(self) -> EnvelopePolicy:
        return self.envelope.spec.policy

    @property
    def renewals_open(self) -> bool:
        """It admits work: leases may be renewed (reservoir.core.lifecycle)."""
        return self.envelope.accepting(self.now)

    @property
    def open_now(self) -> bool:
        """Open: its parent (or pool) holds its capacity and it admits work (claims,
        children, loans)."""
        return self.result.admitted and self.renewals_open

    def again_at(self, moment: datetime) -> None:
        """Look again at `moment` at the latest, even without new facts."""
        self.look_again = min(self.look_again or moment, moment)

    def advance(
        self, entry: LedgerEntry, facts: ClaimFacts, adjust: bool = True
    ) -> list[LedgerEvent]:
        return _advance(
            self.result, entry, facts, self.policy, self.renewals_open, self.room, adjust
        )

    def compensate(self, line: LedgerEntry, facts: ClaimFacts) -> Moved:
        """The compensations `facts` asks that `line` has not recorded (in place)."""
        result = self.result
        return compensate(
            line,
            facts,
            self.envelope.spec.contracts,
            _fits(result),
            result.dimensions,
            self.comp_room,
            self.now,
            self.last_call,
        )


def _where_capacity_comes_from(result: Reconciliation, envelope: EnvelopeFacts) -> EnvelopeFacts:
    """Step 0: where its capacity comes from, recorded once, before any claim is admitted
    on it. Returns the envelope as the pass reads it: deleted if its parent went, closed
    once its ledger recorded it, holding what its parent or pool reserved for it."""
    ledger, now = result.status, result.now
    if ledger.parent is None and ledger.phase is EnvelopePhase.OPEN:
        # Opened before budgets nested (no record): it has always been a root.
        ledger.parent = ParentRecord(kind=ParentKind.ROOT, admitted_at=ledger.closed_at or now)
    parent = envelope.parent
    if parent is None and envelope.spec.parent is not None:  # named, but not found
        parent = ParentView(ParentKind.ENVELOPE, envelope.spec.parent)
        envelope = replace(envelope, parent=parent)
    drawn = draw_record(ledger.parent, parent, envelope.spec.capacity, now, envelope.spec.contracts)
    ledger.parent = drawn.record
    ledger.queue_reason = bounded(drawn.waiting, MESSAGE_LENGTH) if drawn.waiting else None
    deleted_itself = envelope.deleting
    envelope = envelope.effective(ledger.parent)
    if envelope.deleting and not deleted_itself:
        ledger.closed_by_parent = True  # recorded: its children read it, ancestors may go
    if ledger.closed_by_parent:
        envelope = replace(envelope, deleting=True)
    if ledger.closed_at is not None:
        # Closed (or expired) and its balance returned: whatever its spec says since (a
        # lifetime removed, say), it never admits again (found by review).
        envelope = replace(envelope, closed=True)
    if preempted(ledger):
        # It gave its room to a higher class: closed for good (reservoir.core.preemption).
        envelope = replace(envelope, closed=True)
    if ledger.phase is EnvelopePhase.EXPIRED:
        # Expired, perhaps still closing: a lifetime raised or removed since never reopens
        # it (issue 25), even before its balance is returned.
        envelope = replace(envelope, expired_recorded=True)
    result.admitted = ledger.parent is not None and ledger.parent.admitted_at is not None
    if result.admitted and ledger.parent is not None and ledger.parent.reserved:
        # Drawn from a parent or pool: it holds what was reserved there, whatever its spec
        # says since (a pool-drawn root's capacity may grow in spec; the pool holds no more).
        reserved = {k: v for k, v in ledger.parent.reserved.items() if k in result.dimensions}
        spec = envelope.spec.model_copy(update={"capacity": {**envelope.spec.capacity, **reserved}})
        envelope = replace(envelope, spec=spec)
    return envelope


def _claims_in_view(
    result: Reconciliation,
    envelope: EnvelopeFacts,
    status: ReservationEnvelopeStatus,
    claims: Sequence[ClaimFacts],
    departed: Mapping[str, LedgerEntry],
    fresh: bool,
) -> tuple[dict[str, ClaimFacts], View]:
    """Step 0, continued: the claims this envelope decides on (claim uid -> facts) and
    every line in view: the envelope's lines in flight, and those its claims hold."""
    ledger, now = result.status, result.now
    # Each claim's facts carry what its ResourceClaim shows, set once here.
    # A claim seen deleted is gone, whatever a lagging view of the claims still shows.
    facts_by_uid = {
        c.uid: _with_devices(_effective(c, envelope), result.devices_seen.get(c.uid))
        for c in claims
        if c.uid not in departed
    }
    # A claim joins its envelope by name, but is bound to the one that decided on it: bound
    # to an earlier envelope of this name (deleted since), it never moves this one's
    # capacity, whatever it reports late (issue 21 #3). One never decided on may join.
    result.envelope_uid = envelope.uid
    for claim in claims:
        bound = claim.envelope_uid
        if (
            bound is None
            and claim.settled_record is not None
            and claim.created_at < envelope.created_at
        ):
            # Settled with no binding recorded (a status written before the binding
            # existed): a claim created before this envelope was decided on by another
            # (creation times are the API server's and never change; found by review).
            bound = UNRECORDED
        if envelope.uid and bound and bound != envelope.uid and claim.uid not in ledger.entries:
            del facts_by_uid[claim.uid]
            earlier = f"with UID {bound}" if bound != UNRECORDED else "created before it"
            result.replaced[claim.uid] = (
                f"decided on by an earlier envelope {envelope.name} ({earlier}), since deleted: "
                f"its replacement (UID {envelope.uid}) moves no capacity for this claim"
            )
    view = merge(
        status.entries,
        status.stamp,
        {c.uid: c.line for c in facts_by_uid.values() if c.line is not None},
        departed,
    )
    # Its child envelopes' lines, the same way: in flight here, or held by each child
    # (listed after the envelope, always fresh).
    children = merge_children(status.children, status.stamp, envelope.children, envelope.uid)
    result.child_view, ledger.children = children, children.lines
    if not children_add_up(children, status.child_records):
        # A child went with its line: what it held, exactly (recorded with the digest).
        gone = children_missing(children, status.child_records)
        decided = envelope.force_settle_gone
        result.lost_children = lost_line(children, gone, status.stamp + 1, now, decided)
        result.lost_children_amount = gone
    if not adds_up(view, status.claim_records):
        if not fresh:
            raise ClaimViewBehindError(f"the claims of {envelope.name} as seen are behind")
        result.lost = _keep_what_is_lost(view, children, status, now)
    # Every line in view, the pass's to move: `result.entry` reads them from the start of
    # the pass (`_place` then keeps in the envelope only those in flight).
    ledger.entries = result.lines = view.lines
    # The lines as read, not copied again (a pass over an envelope with N live claims made
    # 2N deep copies: 40 % of the operator's CPU while 100-claim envelopes filled, profiled);
    # a line made by this pass (what lost claims held) starts as a copy of itself.
    result.before = {
        uid: view.read[uid] if uid in view.read else line.copied()
        for uid, line in view.lines.items()
    }
    result.new_lines_room = IN_FLIGHT_LIMIT - len(view.in_flight)
    result.room_bytes = LEDGER_BYTES_BUDGET - ledger_bytes(
        view.in_flight.values(), result.dimensions
    )
    return facts_by_uid, view


def _supersede_the_losers(
    result: Reconciliation, facts_by_uid: dict[str, ClaimFacts], view: View, policy: EnvelopePolicy
) -> None:
    """Step 0, last: each speculation group's winner, decided on the lines as read and
    recorded on the envelope (kept: it outlives the winner's claim), and its losers read as
    cancelled (reservoir.core.speculation)."""
    kept = result.status.speculation
    decided = winners(facts_by_uid, view.lines, policy.speculation_winner, kept)
    for group, winner in decided.items():
        if group not in kept and len(kept) < MAX_SPECULATION_GROUPS:
            kept[group] = winner
    for uid, winner in superseded(decided, facts_by_uid, view.lines).items():
        facts_by_uid[uid] = replace(facts_by_uid[uid], superseded_by=winner)


def _give_room_if_preempted(
    result: Reconciliation,
    envelope: EnvelopeFacts,
    facts_by_uid: dict[str, ClaimFacts],
    view: View,
) -> EnvelopeFacts:
    """Step 0, last: its pool's request that it give its room to a higher class, decided
    once per request on its own lines and its claims' facts as read in this pass, before
    any claim advances (reservoir.core.preemption). Preempted: its Tentative claims read as
    cancelled (released once, reason Preempted) and it closes. Returns the envelope as the
    rest of the pass reads it."""
    ledger, parent = result.status, envelope.parent
    request = parent.preemption if parent is not None else None
    record = ledger.parent
    if (
        request is None
        or parent is None
        or record is None
        or record.kind is not ParentKind.POOL
        or record.uid != parent.uid
        or record.settled is not None
        or not result.admitted
        or not envelope.accepting(result.now)
        or decided_on(ledger.preemption, request)
    ):
        return envelope
    others = []
    if any(line.phase is ChildPhase.RESERVED for line in result.child_view.lines.values()):
        others.append("child envelopes draw on it")
    if any(loan.phase is LoanPhase.LENT for loan in ledger.loans.values()):
        others.append("it lent to a sibling")
    if result.lost is not None:
        others.append("claims went without settling (a line is kept for them)")
    decision, released = verdict(request, view.lines, facts_by_uid, others, result.now)
    ledger.preemption = decision
    if decision.outcome is PreemptionOutcome.REFUSED:
        result.events.append(
            LedgerEvent(envelope.uid, envelope.name, "PreemptionRefused", decision.message)
        )
        return envelope
    result.events.append(
        LedgerEvent(envelope.uid, envelope.name, "EnvelopePreempted", decision.message)
    )
    for uid in released:
        facts_by_uid[uid] = replace(facts_by_uid[uid], preempted_by=request.preemptor)
    return replace(envelope, closed=True)


def _advance_held(books: _Books) -> None:
    """Step 1: advance every admitted claim by its facts. A claim confirmed gone without
    settling (its finalizer removed by hand) is advanced on what its entry recorded. Lines
    its claims hold move at most MOVES_PER_PASS at a time (each move is written in flight)."""
    result, ledger, envelope, now = books.result, books.ledger, books.envelope, books.now
    dimensions = result.dimensions
    moves, last = 0, None  # held lines that moved so far; the last held line advanced

    def count_move(uid: str | None) -> int:
        """1 if held line `uid` goes in flight in this pass: it moved, or no claim holds it
        any more (charged to the byte budget); else 0."""
        if uid is None:
            return 0
        moved = footprint(ledger.entries[uid]) != footprint(result.before[uid])
        if not moved and uid in books.facts:
            return 0
        result.room_bytes -= projected_bytes(ledger.entries[uid], dimensions)
        return 1

    for uid, entry in list(ledger.entries.items()):
        facts = books.facts.get(uid)
        moves, last = moves + count_move(last), None
        if uid.startswith(LOST_PREFIX) and uid not in envelope.force_settle_gone:
            continue  # lost lines are settled by a person, by name, and only so
        if uid not in books.view.in_flight:
            if moves >= MOVES_PER_PASS or projected_bytes(entry, dimensions) > result.room_bytes:
                _hold_as_is(result, uid, entry)
                result.postponed.add(uid)
                books.again_at(now + NEXT_MOVES)
                continue
            last = uid
        if facts is None:
            if entry.phase.terminal:
                # Settled and gone: pruned below, once its devices are known to be free.
                _keep_or_release_devices(result, uid, entry)
                step = Step(
                    entry, _gone(uid, entry, envelope), now, None, result.reusable, result.windowed
                )
                close_retry_window(step, books.renewals_open)
                result.events += step.events
                continue
            facts = _gone(uid, entry, envelope)
        was_settled, was_adjusted = entry.settlement is not None, entry.adjustment is not None
        result.events += books.advance(entry, facts)
        if not was_settled and entry.settlement is not None:
            books.committed = add(books.committed, entry.consumed)
        if not was_adjusted:
            books.committed = _adjusted(books.committed, entry)
        if was_settled:
            # Not in the pass that settles it: `room` is the balance from before the
            # settlement returned R − C, and a charge refused for it would be refused for
            # good where an operator that saw the settlement first applies it (review).
            moved = books.compensate(entry, facts)
            books.committed = moved.committed(books.committed)
            books.charges_waiting = add(books.charges_waiting, moved.waiting)
            result.events += moved.events
        elif entry.settlement is not None and facts.spec.compensations:
            books.again_at(now)  # the next pass applies them, on the balance written now
        _keep_or_release_devices(result, uid, entry, facts, books.policy)
    count_move(last)  # the last held line advanced is charged too


def _late_facts_of_settled(books: _Books, quiet: QuietClaims | None) -> None:
    """Step 2: settled claims whose record moved to their own status: only late facts
    remain. A late completion that moves capacity brings the record back into the ledger,
    so the adjustment is written with the totals it changes: exactly once."""
    result, ledger = books.result, books.ledger
    terms = Terms(books.policy, result.dimensions, books.envelope.spec.contracts)
    quiet_now: dict[str, ClaimFacts] = {}
    for facts in books.facts.values():
        record = facts.settled_record
        if facts.uid in ledger.entries or record is None:
            continue
        if quiet is not None and quiet.passes_by(facts, terms):
            quiet_now[facts.uid] = facts
            continue
        record = record.copied()
        was_adjusted = record.adjustment is not None
        # An adjustment that moves capacity waits until the record fits back in the
        # ledger: deferred, never recorded as "not applied" for a momentary lack of room.
        # (Sized only for a record that may still be adjusted: the check walks the ledger.)
        adjust = (
            books.room is None or not late_answer_wanted(record) or _has_room_for(result, record)
        )
        events = books.advance(record, facts, adjust)
        # A compensation that moves capacity comes back into the ledger the same way.
        moved = books.compensate(record, facts)
        books.charges_waiting = add(books.charges_waiting, moved.waiting)
        if record == facts.settled_record:
            if stays_quiet(record, facts, adjust, events + moved.events):
                quiet_now[facts.uid] = facts
            continue  # nothing new: its status already says all of it
        result.events += events + moved.events
        if not was_adjusted and record.adjustment is not None and record.adjustment.applied:
            books.committed = _adjusted(books.committed, record)
            ledger.entries[facts.uid] = record
        if moved.moves:
            books.committed = moved.committed(books.committed)
            ledger.entries[facts.uid] = record
        if facts.uid in ledger.entries:
            _charge(result, record)  # back in flight, with the totals it moved
        else:
            result.off_ledger[facts.uid] = record
    result.quiet = QuietClaims(terms, quiet_now)


def _settle_closed_children(books: _Books) -> None:
    """Step 2b: child envelopes: settle the lines of those that closed (R − C returns
    here)."""
    envelope = books.envelope
    children = ChildLedger(
        ParentIdentity(ParentKind.ENVELOPE, envelope.name, envelope.uid),
        books.ledger.children,
        books.now,
        books.committed,
        contracts=envelope.spec.contracts,
        in_flight=set(books.result.child_view.in_flight),
    )
    if books.result.lost_children is not None:
        children.in_flight.add(books.result.lost_children)
    children_by_uid = {c.uid: c for c in envelope.children}
    settle_children(children, children_by_uid, envelope.force_settle_gone)
    books.committed = children.committed
    books.children = children


def _settle_sibling_loans(books: _Books) -> None:
    """Step 2c: loans between siblings (policy.lending): record loans received, take back
    what borrowers repaid, settle loans that are over."""
    result, ledger, envelope, now = books.result, books.ledger, books.envelope, books.now
    result.events += receive_loans(ledger, envelope.siblings, books.open_now, now)
    consumed_loans, loan_events = settle_loans(
        ledger,
        {s.uid: s for s in envelope.siblings},
        envelope.force_settle_gone,
        now,
        result.reusable,
    )
    books.committed = add(books.committed, consumed_loans)
    result.events += loan_events


def _admit_the_queue(books: _Books) -> None:
    """Step 3: admit waiting claims and child envelopes in one queue order."""
    result, ledger, envelope, now = books.result, books.ledger, books.envelope, books.now
    children = books.children
    assert children is not None  # step 2b made it
    books.waiting = [
        c for c in books.facts.values() if c.uid not in ledger.entries and c.settled_record is None
    ]
    children_waiting = waiting_children(envelope.children, ledger.children)
    queue: list[ClaimFacts | ChildFacts] = [*books.waiting, *children_waiting]
    queue.sort(key=lambda item: _queue_key(item).sort_key())
    blocked_by: str | None = None
    balance = _totals(envelope, books.committed, ledger).available
    # A charge waiting for room has first call on it (a tenant cannot dodge an invoice by
    # holding its budget, nor by claiming what comes back first).
    charges_waiting = books.charges_waiting
    balance = {k: max(v - charges_waiting.get(k, ZERO), ZERO) for k, v in balance.items()}
    books.balance = balance
    result.charges_waiting = charges_waiting
    depth = ledger.parent.depth if ledger.parent is not None else 1
    # Not open yet, but it may open: it admits no child, and still records the withdrawal
    # of a child closed or deleted meanwhile (the child may then go).
    may_open = not result.admitted and books.renewals_open and not _withdrawn(result)
    for item in queue:
        if isinstance(item, ChildFacts):
            if not (may_open and item.accepting):
                blocked_by = admit_child(
                    children, item, balance, envelope.spec.capacity, depth, books.open_now,
                    blocked_by,
                )  # fmt: skip
            continue
        blocked_by = _admit_one(result, envelope, item, balance, blocked_by, now)
    result.events += children.events
    result.pending_children = children.pending
    # Lines its children have not yet mirrored, and children it has not even answered: a
    # parent goes only once every child knows its fate from the child's own record.
    result.children_unsettled = len(ledger.children) + sum(
        1 for c in children_waiting if c.uid not in ledger.children
    )
    if children.postponed:
        books.again_at(now + NEXT_MOVES)  # its record of lines in flight was full


def _borrow_repay_or_lend(books: _Books) -> None:
    """Step 3b: borrow what the queue is short of, or repay what is owed; lend what is
    spare."""
    result, ledger, envelope, now = books.result, books.ledger, books.envelope, books.now
    open_now = books.open_now
    ledger.wants = None
    if result.short is not None and open_now and _has_parent_envelope(ledger.parent):
        head, short = result.short
        ledger.wants = BorrowRequest(
            resources=short, priority=head.spec.priority, since=head.created_at
        )
    if ledger.wants is None:
        result.events += repay(ledger, books.balance)
        lending = envelope.spec.policy.lending
        # It lends only while it owes nothing itself: loans never run in a cycle.
        if lending is not None and open_now and not borrowed_total(ledger):
            result.events += lend(ledger, lending, envelope.siblings, books.balance, now)


def _compact(books: _Books) -> None:
    """Step 4: a settled entry leaves the ledger once its claim's status carries the same
    record, or once the claim is gone."""
    ledger = books.ledger
    for uid in [u for u, e in ledger.entries.items() if e.phase.terminal]:
        held = ledger.entries[uid].devices
        if held is not None and not held.released:
            continue  # settled, but its devices are not free yet: it stays in view
        kept = ledger.entries[uid].retry
        if kept is not None and kept.active:
            continue  # it holds capacity for the branch's next attempt
        facts = books.facts.get(uid)
        if facts is None or _carries(facts, ledger.entries[uid]):
            del ledger.entries[uid]


def _close_the_books(books: _Books) -> None:
    """Step 4, continued: the totals, the envelope's own lifecycle, and when to look again
    even without new facts."""
    result, ledger, envelope, now = books.result, books.ledger, books.envelope, books.now
    if books.charges_waiting and not books.renewals_open and not _holds_any(ledger):
        # Its last call is the next pass: nothing else would wake it (a pass's own status
        # write does not). Not sooner: a wake-up per pass while claims still hold spins.
        books.again_at(now)
    if ledger.closed_at is None:
        ledger.windows = record_windows(books.committed, ledger.windows, result.contracts, now)
    ledger.totals = _totals(envelope, books.committed, ledger)
    ledger.contracts = types(result.contracts)
    ledger.peak = raise_peak(ledger.peak, ledger.totals, result.contracts)
    _envelope_lifecycle(result, envelope, now)
    ttl_moment = _settled_ttl(result, envelope, books.facts.values(), now)
    lookups = _next_lookups(result, envelope, books.facts)
    result.wake_at = min(
        (
            m
            for m in (
                next_deadline(result, envelope, books.waiting, books.facts),
                ttl_moment,
                lookups,
                next_return(ledger.windows) if ledger.closed_at is None else None,
                books.look_again,
            )
            if m is not None
        ),
        default=None,
    )


def _place(
    result: Reconciliation,
    view: View,
    status: ReservationEnvelopeStatus,
    claims: Mapping[str, ClaimFacts],
) -> None:
    """The envelope keeps the lines in flight; each claim gets its own line (the first
    time with the stamp of the envelope write that records it)."""
    ledger = result.status
    placement = place(view, result.lines, claims, status.stamp + 1, result.postponed)
    if any(line.stamp > status.stamp for line in placement.in_flight.values()):
        ledger.stamp = status.stamp + 1
    ledger.entries = dict(sorted(placement.in_flight.items()))
    ledger.claim_records = placement.records
    result.to_claims = placement.to_claims
    # Child envelopes keep their lines too; the envelope, those in flight.
    result.child_lines = dict(ledger.children)
    children = place_children(result.child_view, ledger.children, status.stamp + 1)
    ledger.children, ledger.child_records = children.in_flight, children.records
    if any(line.stamp > status.stamp for line in ledger.children.values()):
        ledger.stamp = status.stamp + 1


def _keep_what_is_lost(
    view: View, children: ChildView, status: ReservationEnvelopeStatus, now: datetime
) -> str | None:
    """Claims read fresh (or child envelopes) that do not add up to the envelope's record:
    lines went with their objects (a finalizer removed by hand while the operator was
    away). What the totals hold that no line accounts for stays held, as one Detached line
    named LOST_PREFIX + stamp that only a person settles (`force-settle-gone` naming it)."""
    reserved, reconciling = status.totals.reserved, status.totals.reconciling
    lost = lost_amounts(view, reserved, reconciling, children.reserved())
    if not lost:
        return None
    name = f"{LOST_PREFIX}{status.stamp}"
    line = LedgerEntry(
        claim=name,
        phase=ClaimPhase.DETACHED,
        reserved=lost,
        first_reserved_at=now,
        detached_at=now,
    )
    record_transition(line, ClaimPhase.DETACHED, "ClaimLinesLost", Trigger.DELETION, now)
    view.lines[name] = line
    return name


def _has_room_for(result: Reconciliation, line: LedgerEntry) -> bool:
    """Whether a new line may go in flight in this pass (see Reconciliation.room_bytes)."""
    room = result.room_bytes
    return result.new_lines_room > 0 and projected_bytes(line, result.dimensions) <= room


def _fits(result: Reconciliation) -> Callable[[LedgerEntry, LedgerEntry], bool]:
    """Whether a line may grow by its new compensation records within what the record in
    flight's byte budget has left (each record's growth is charged as it is made)."""

    def fits(before: LedgerEntry, after: LedgerEntry) -> bool:
        growth = entry_bytes(after) - entry_bytes(before)
        if growth > result.room_bytes:
            return False
        result.room_bytes -= growth
        return True

    return fits


def _charge(result: Reconciliation, line: LedgerEntry) -> None:
    result.new_lines_room -= 1
    result.room_bytes -= projected_bytes(line, result.dimensions)


def _gate_to_lift(entry: LedgerEntry) -> bool:
    """A recorded hand-off's gate is lifted only for live work: not once the claim is
    Detached or settled, nor once a cancel (or deletion) is recorded. A pod still behind its
    gate then never starts, and the lease's lapse settles the claim as never run
    (GateNeverLifted) instead of a pod starting for a cancelled branch (found by review)."""
    live = entry.phase.holds_capacity and entry.phase is not ClaimPhase.DETACHED
    return live and entry.handed_off_at is not None and not entry.cancel_requested


def _hand_off_devices(result: Reconciliation, uid: str, entry: LedgerEntry) -> None:
    """A device claim handed to its workload pod: its placeholder goes once that pod holds
    the devices, and the pod's gate is lifted unless a cancel came first (`keep_gated`)."""
    result.handed_off[uid] = entry.handed_off_to or ""
    if not _gate_to_lift(entry):
        result.keep_gated.add(uid)


def _lift_recorded_hand_off(result: Reconciliation, uid: str, entry: LedgerEntry) -> None:
    """A claim without devices whose capacity was handed to its workload pod has that
    pod's gate lifted while it is live work (a device claim's goes with its devices)."""
    if _gate_to_lift(entry) and not device_counts(entry.reserved):
        result.handed_off[uid] = entry.handed_off_to or ""


def _hold_as_is(result: Reconciliation, uid: str, entry: LedgerEntry) -> None:
    """A line left for the next pass keeps its devices held as they are."""
    _lift_recorded_hand_off(result, uid, entry)
    if entry.phase.holds_capacity and device_counts(entry.reserved):
        result.device_holds[uid] = device_counts(entry.reserved)
        if entry.handed_off_at is not None and entry.phase is not ClaimPhase.DETACHED:
            _hand_off_devices(result, uid, entry)


def _holds_any(ledger: ReservationEnvelopeStatus) -> bool:
    """A claim of the ledger still holds capacity, or its settled devices are not free."""
    return any(e.phase.holds_capacity or devices_in_use(e) for e in ledger.entries.values())


def _advance(
    result: Reconciliation,
    entry: LedgerEntry,
    facts: ClaimFacts,
    policy: EnvelopePolicy,
    renewals_open: bool,
    room: dict[str, Decimal] | None = None,
    adjust: bool = True,
) -> list[LedgerEvent]:
    """lifecycle.advance with the envelope's resources and their contracts."""
    return advance(
        entry,
        facts,
        policy,
        result.now,
        renewals_open,
        result.dimensions,
        room,
        adjust,
        result.reusable,
        result.windowed,
    )


def _adjusted(committed: Mapping[str, Decimal], entry: LedgerEntry) -> dict[str, Decimal]:
    """The committed total after a late completion's adjustment applied in this pass."""
    adjustment = entry.adjustment
    if adjustment is None or not adjustment.applied:
        return dict(committed)
    return subtract(add(committed, adjustment.charged), adjustment.returned)


def _next_lookups(
    result: Reconciliation, envelope: EnvelopeFacts, claims: Mapping[str, ClaimFacts]
) -> datetime | None:
    """When a claim that needs its provider asked is due for the next lookup, or a cancel
    this pass recorded is due to be forwarded (the next pass forwards it, on the recorded
    request: at once the first time, then every FIRST_LOOKUP_WAIT_SECONDS until it goes)."""
    policy = envelope.spec.policy
    moments: list[datetime] = []
    for uid, facts in claims.items():
        entry = result.entry(uid) or facts.settled_record
        if entry is not None and cancel_to_forward(entry, facts.spec, policy) is not None:
            tried = entry.provider is not None and entry.provider.cancel is not None
            moments.append(
                result.now + timedelta(seconds=FIRST_LOOKUP_WAIT_SECONDS if tried else 0)
            )
        if entry is None or not needs_lookup(entry, facts.spec, policy):
            continue
        record = entry.provider
        due = record.next_lookup_at if record is not None else None
        first = result.now + timedelta(seconds=FIRST_LOOKUP_WAIT_SECONDS)
        moments.append(due if due is not None else first)
        if adapter_for(facts.spec, policy) is Adapter.OBJECT:
            moments.append(result.now + timedelta(seconds=OBJECT_LOOKUP_SECONDS))
    return min(moments, default=None)


def wants_devices_now(facts: ClaimFacts, policy: EnvelopePolicy) -> bool:
    """A claim with device resources needs them held now: always under the Tentative
    policy; under Commit, once its branch is chosen (dispatched, or its pod is waiting)."""
    if not device_counts(facts.spec.requests):
        return False
    chosen = facts.spec.dispatch or (facts.pod is not None and facts.pod.gated)
    return policy.physical_hold is PhysicalHold.TENTATIVE or chosen


def _devices_at_dispatch(
    result: Reconciliation,
    uid: str,
    entry: LedgerEntry,
    facts: ClaimFacts | None,
    policy: EnvelopePolicy,
    seen: DeviceFacts | None,
) -> None:
    """Under the Commit policy an admitted claim asks for its devices once chosen, and
    records them once the scheduler placed them (then the hand-off can follow)."""
    if facts is None or not entry.phase.holds_capacity or entry.phase is ClaimPhase.DETACHED:
        return
    if not wants_devices_now(facts, policy) or facts.cancelling:
        return
    result.device_holds[uid] = device_counts(entry.reserved)
    if seen is None or not seen.held or seen.node is None:
        why = seen.waiting if seen is not None and seen.waiting else None
        result.awaiting_devices[uid] = why or "devices requested from the scheduler"
    else:
        entry.devices = DeviceHold(node=seen.node, devices=list(seen.devices))
        result.events.append(
            LedgerEvent(
                uid,
                entry.claim,
                "DevicesHeld",
                f"devices {', '.join(entry.devices.devices)} held on {entry.devices.node}",
            )
        )


def _keep_or_release_devices(
    result: Reconciliation,
    uid: str,
    entry: LedgerEntry,
    facts: ClaimFacts | None = None,
    policy: EnvelopePolicy | None = None,
) -> None:
    """A holding claim keeps its devices held; a settled one lets them go, and records
    that they are free once its ResourceClaim's allocation is gone (the scheduler's
    confirmation, not the ledger's say-so)."""
    _lift_recorded_hand_off(result, uid, entry)
    held = entry.devices
    seen = result.devices_seen.get(uid)
    if held is None:
        if policy is not None:
            _devices_at_dispatch(result, uid, entry, facts, policy, seen)
        return
    if entry.phase.holds_capacity and entry.work_ended_at is not None:
        # Its work is over, its usage still unknown: the devices go now, and count as
        # free once the scheduler confirms it (issue 22: they follow the scheduler).
        if not held.released and (seen is None or not seen.allocated):
            held.released = True
            entry.reusable_returned = add(
                entry.reusable_returned,
                {k: Decimal(v) for k, v in device_counts(entry.reserved).items()},
            )
            result.events.append(
                LedgerEvent(
                    uid,
                    entry.claim,
                    "DevicesReleased",
                    f"devices {', '.join(held.devices)} on {held.node} are free again "
                    "(the work is over; its usage is still awaited)",
                )
            )
        return
    if entry.phase.holds_capacity:
        result.device_holds[uid] = device_counts(entry.reserved)
        if entry.handed_off_at is not None:
            if entry.phase is not ClaimPhase.DETACHED:  # live work: not once Detached
                _hand_off_devices(result, uid, entry)
        elif seen is not None and seen.held and seen.node is not None:
            moved = (seen.node, list(seen.devices)) != (held.node, held.devices)
            if moved:  # its placeholder was lost and the scheduler placed it again
                held.node, held.devices = seen.node, list(seen.devices)
                result.events.append(
                    LedgerEvent(
                        uid,
                        entry.claim,
                        "DevicesMoved",
                        f"held again with devices {', '.join(held.devices)} on {held.node}",
                        warning=True,
                    )
                )
        return
    if not held.released and (seen is None or not seen.allocated):
        held.released = True
        result.events.append(
            LedgerEvent(
                uid,
                entry.claim,
                "DevicesReleased",
                f"devices {', '.join(held.devices)} on {held.node} are free again",
            )
        )


def _carries(facts: ClaimFacts, entry: LedgerEntry) -> bool:
    """The claim's status holds this settled entry's whole record."""
    record = facts.settled_record
    return record is not None and settled_view(record) == settled_view(entry)


def _settled_ttl(
    result: Reconciliation,
    envelope: EnvelopeFacts,
    claims: Iterable[ClaimFacts],
    now: datetime,
) -> datetime | None:
    """Names the settled claims past the envelope's settledClaimTTLSeconds (the operator
    deletes them) and returns when the next one will be."""
    ttl = envelope.spec.policy.settled_claim_ttl_seconds
    if ttl is None:
        return None
    upcoming: list[datetime] = []
    for facts in claims:
        record = result.status.entries.get(facts.uid) or facts.settled_record
        if facts.deleting or record is None or record.settlement is None:
            continue
        due = record.settlement.at + timedelta(seconds=ttl)
        if due <= now:
            result.expired_claims.append(facts.name)
        else:
            upcoming.append(due)
    return min(upcoming, default=None)


def next_deadline(
    result: Reconciliation,
    envelope: EnvelopeFacts,
    waiting: Sequence[ClaimFacts],
    claims: Mapping[str, ClaimFacts] | None = None,
) -> datetime | None:
    """The next moment the ledger changes with no new facts: a lease end, an ambiguity
    deadline, a provider queue bound, a queue-age limit or the envelope's own lifetime."""
    policy = envelope.spec.policy
    moments: list[datetime] = []
    for uid, entry in result.status.entries.items():
        if uid.startswith(LOST_PREFIX):
            continue  # only a person settles it: no moment of its own
        claim = (claims or {}).get(uid)
        bound = queue_bound(entry, claim.spec, policy) if claim is not None else None
        if bound is not None:
            moments.append(max(bound, result.now))
        # A lease end already past that left the claim as it was (a Tentative claim whose
        # workload pod may still start waits for the pod's news) is no moment: every pass
        # would ask for the next at once (found by review).
        lease_end = entry.expires_at
        if (
            entry.phase.holds_capacity
            and entry.phase is not ClaimPhase.DETACHED
            and lease_end is not None
            and lease_end > result.now
        ):
            moments.append(lease_end)
        deadline = ambiguity_deadline(entry, policy)
        if entry.phase is ClaimPhase.DETACHED and deadline and entry.deadline_action is None:
            moments.append(deadline)
        if entry.retry is not None and entry.retry.active:
            moments.append(entry.retry.until)
    for facts in waiting:
        if facts.uid in result.pending:
            moments.append(facts.created_at + timedelta(seconds=policy.max_queue_seconds))
    if envelope.spec.lifetime_seconds is not None and result.status.closed_at is None:
        moments.append(envelope.created_at + timedelta(seconds=envelope.spec.lifetime_seconds))
    return min(moments, default=None)


def _with_devices(facts: ClaimFacts, devices: DeviceFacts | None) -> ClaimFacts:
    """The facts with what its ResourceClaim shows: the same object when that is already
    so (a pass reads every claim of its envelope; most hold no devices)."""
    return facts if facts.devices == devices else replace(facts, devices=devices)


def _effective(facts: ClaimFacts, envelope: EnvelopeFacts) -> ClaimFacts:
    """Deleting an envelope cancels its children first."""
    if envelope.deleting and not facts.deleting:
        return ClaimFacts(**{**facts.__dict__, "deleting": True})
    return facts


def _gone(uid: str, entry: LedgerEntry, envelope: EnvelopeFacts) -> ClaimFacts:
    """Stand-in facts for a claim whose object is gone (its finalizer removed by hand):
    what its entry recorded (recorded usage stays recorded), dispatched as far as anyone
    can tell, deleted, and settled by its deadline or by a person the envelope names."""
    # A Tentative claim that vanished may have been dispatched after the operator last
    # looked: it is held like a dispatched one, never released on a guess.
    spec = BranchClaimSpec(
        envelope="gone",  # a stand-in: the object (and its spec) is gone
        attempt=entry.attempt,
        requests=entry.reserved,
        dispatch=True,
        cancel=True,
        usage=entry.usage,
    )
    gone_reason = envelope.force_settle_gone
    return ClaimFacts(
        uid=uid,
        name=entry.claim,
        created_at=entry.first_reserved_at or datetime.min.replace(tzinfo=UTC),
        spec=spec,
        deleting=True,
        force_settle=gone_reason.get(uid, gone_reason.get(entry.claim)),
    )


def _new_entry(facts: ClaimFacts, reserved: dict[str, Decimal]) -> LedgerEntry:
    return LedgerEntry(
        claim=facts.name,
        branch=facts.spec.branch,
        attempt=facts.spec.attempt,
        phase=ClaimPhase.PENDING,
        reserved=reserved,
    )


def _close_unadmitted(
    result: Reconciliation, facts: ClaimFacts, phase: ClaimPhase, reason: str, message: str
) -> None:
    """Settle a claim that never held anything (rejected, or cancelled while waiting). It
    gets a ledger entry only while there is plenty of room; otherwise the verdict is
    recorded in the claim's status alone: it moves no capacity either way."""
    entry = _new_entry(facts, {})
    step = Step(entry, facts, result.now, result.dimensions, result.reusable, result.windowed)
    # Usage from a claim that never held anything is all excess: an overrun, kept for
    # people to see and never charged to the envelope.
    record_usage(step)
    trigger = {
        "DeletedWhilePending": Trigger.DELETION,
        "CancelledWhilePending": Trigger.WORKER,
        "SupersededWhilePending": Trigger.SPECULATION,
        "FinishedBeforeAdmission": Trigger.WORKER,
    }.get(reason, Trigger.ADMISSION)
    entry.superseded_by = facts.superseded_by
    settle(step, phase, reason, message=message, outcome=facts.spec.outcome, trigger=trigger)
    # What the claim already declares (a Dispatch, a usage report) is recorded now, so a
    # replay of the same facts finds nothing left to do.
    record_after_settlement(step)
    if result.new_lines_room > IN_FLIGHT_LIMIT - UNADMITTED_ENTRIES_ROOM and _has_room_for(
        result, entry
    ):
        result.status.entries[facts.uid] = entry
        _charge(result, entry)
    else:
        result.off_ledger[facts.uid] = entry
    result.events += step.events


def _admit_one(
    result: Reconciliation,
    envelope: EnvelopeFacts,
    facts: ClaimFacts,
    available: dict[str, Decimal],
    blocked_by: str | None,
    now: datetime,
) -> str | None:
    """Admit, reject or queue one waiting claim. Returns the name blocking the queue.
    `available` is this pass's running balance: admitting a claim draws it down.

    Whether it may be admitted is decided before any would-be line is made for it: a queue
    of hundreds behind a shortage or a cap waits (or is refused) without one each, every
    pass; a refusal is recorded within the room it has (`_close_unadmitted`)."""
    record = result.status.parent
    granted = record.tentative_claims if record is not None else None
    spec, policy = facts.spec, within_grant(envelope.spec.policy, granted)
    if _settled_or_told_before_its_turn(result, envelope, facts, now):
        return blocked_by
    entries = result.status.entries
    # A retry of a failed attempt may use what that attempt kept for it, ahead of the
    # queue when that is enough (the hold is its own).
    kept = _retry_hold_for(entries.values(), facts, result.holds_in_use)
    balance = add(available, kept.resources) if kept is not None else available
    if blocked_by is not None and not (kept is not None and fits(spec.requests, balance)):
        result.pending[facts.uid] = QUEUED
        return blocked_by
    # Claims waiting for their devices in this pass count as admitted for the caps: each
    # has devices being allocated for it (found by review: caps were bypassed, and which
    # placeholder bound first decided the queue order).
    live = [e for e in entries.values() if e.phase.holds_capacity] + result.awaiting
    decision = admission(
        spec.requests,
        balance,
        live,
        will_be_tentative=not spec.dispatch,
        policy=policy,
    )
    if not decision.admitted:
        return _not_admitted(result, facts, policy, decision, available, blocked_by)
    entry = _new_entry(facts, dict(spec.requests))
    if not _has_room_for(result, entry):
        result.pending[facts.uid] = MOVES_IN_FLIGHT  # never a refusal: it waits a pass
        return blocked_by
    entry.first_reserved_at = now
    record_transition(entry, ClaimPhase.TENTATIVE, "Reserved", Trigger.ADMISSION, now)
    entry.phase = ClaimPhase.TENTATIVE
    entry.expires_at = first_expiry(now, spec.lease.duration_seconds, policy)
    entry.heartbeat = facts.heartbeat  # the heartbeat at admission is not a renewal
    entry.holder = spec.lease.holder or (
        facts.heartbeat_holder if fits_holder(facts.heartbeat_holder) else None
    )
    placed = result.devices_seen.get(facts.uid)
    if wants_devices_now(facts, policy) and (placed is None or not placed.held):
        _await_devices(result, facts, entry, available, kept, placed)
    else:
        _reserve(result, envelope, facts, entry, available, kept, placed)
    return blocked_by


def _settled_or_told_before_its_turn(
    result: Reconciliation, envelope: EnvelopeFacts, facts: ClaimFacts, now: datetime
) -> bool:
    """What settles a waiting claim, or keeps it waiting, whatever the queue and balance
    say: cancelled, malformed, its envelope closed or not open yet, finished, a duplicate,
    queued too long. True if it did (the claim's turn is over for this pass)."""
    spec, policy = facts.spec, envelope.spec.policy
    if facts.cancelling:
        reason = f"{facts.cancel_reason}WhilePending"
        _close_unadmitted(result, facts, ClaimPhase.RELEASED, reason, "pruned before it reserved")
        return True
    problem = request_problem(spec.requests, envelope.spec.capacity) or device_problem(
        spec.requests
    )
    if problem is not None:
        _close_unadmitted(result, facts, ClaimPhase.REJECTED, problem.reason, problem.message)
        return True
    if not envelope.accepting(now) or _withdrawn(result):
        _close_unadmitted(
            result, facts, ClaimPhase.REJECTED, "EnvelopeClosed", "the envelope admits no claims"
        )
        return True
    if not result.admitted:
        result.pending[facts.uid] = Admission(
            False, "EnvelopePending", result.status.queue_reason or "the envelope is not open yet"
        )
        return True
    if facts.problem is not None:
        result.pending[facts.uid] = Admission(False, "InvalidSpec", facts.problem)
        return True
    if spec.final:
        _close_unadmitted(
            result, facts, ClaimPhase.RELEASED, "FinishedBeforeAdmission", "finished unadmitted"
        )
        return True
    if facts.duplicate_of is not None:
        _close_unadmitted(
            result,
            facts,
            ClaimPhase.REJECTED,
            "DuplicateRequestId",
            f"upstream.requestId {spec.upstream.request_id!r} is already claim "
            f"{facts.duplicate_of!r}: a retried submission reuses that claim (hold(name=...) "
            "is idempotent), a new attempt needs a new requestId",
        )
        return True
    if queue_expired(facts.created_at, now, policy):
        _close_unadmitted(
            result,
            facts,
            ClaimPhase.REJECTED,
            "MaxQueueAge",
            f"still pending after {policy.max_queue_seconds}s",
        )
        return True
    return False


def _not_admitted(
    result: Reconciliation,
    facts: ClaimFacts,
    policy: EnvelopePolicy,
    decision: Admission,
    available: Mapping[str, Decimal],
    blocked_by: str | None,
) -> str | None:
    """A claim the balance or a cap does not admit now: refused under fallback Fail, else
    told why it waits. Returns the name blocking the queue: only a shortage blocks the queue
    behind it (a tentative-claim cap does not stop a dispatched claim, and the other caps
    stop everyone anyway)."""
    spec = facts.spec
    if policy.fallback is Fallback.FAIL:
        _close_unadmitted(result, facts, ClaimPhase.REJECTED, decision.reason, decision.message)
        return blocked_by
    if decision.reason != "InsufficientCapacity":
        result.pending[facts.uid] = decision
        return blocked_by
    short = shortage(spec.requests, available)
    refill = refill_note(short, result.status.windows)
    if refill:
        decision = replace(
            decision, message=bounded(f"{decision.message} ({refill})", MESSAGE_LENGTH)
        )
    result.pending[facts.uid] = decision
    if result.short is None:
        result.short = (facts, short)
    return facts.name


def _await_devices(
    result: Reconciliation,
    facts: ClaimFacts,
    entry: LedgerEntry,
    available: dict[str, Decimal],
    kept: RetryHold | None,
    placed: DeviceFacts | None,
) -> None:
    """Admit a claim that must hold its devices first: its logical room is kept while the
    scheduler looks for devices, and it is admitted on the recorded allocation, never
    reported as held before it. The hold stays the failed attempt's until this one holds
    its devices (review): the claim needs from the balance only what the hold does not
    cover, and no other retry uses that hold in this pass."""
    requests = facts.spec.requests
    if kept is not None:
        result.holds_in_use.add(id(kept))
        uncovered = {k: max(v - kept.resources.get(k, ZERO), ZERO) for k, v in requests.items()}
        available.update(subtract(available, uncovered))
    else:
        available.update(subtract(available, requests))
    result.device_holds[facts.uid] = device_counts(requests)
    result.awaiting.append(entry)
    why = placed.waiting if placed is not None and placed.waiting else None
    result.pending[facts.uid] = Admission(
        False, "AwaitingDevices", why or "devices requested from the scheduler"
    )


def _reserve(
    result: Reconciliation,
    envelope: EnvelopeFacts,
    facts: ClaimFacts,
    entry: LedgerEntry,
    available: dict[str, Decimal],
    kept: RetryHold | None,
    placed: DeviceFacts | None,
) -> None:
    """Admit the claim: its line holds R (with the devices it holds, if any) and the
    balance is drawn down. A claim created already dispatched (the lazy strategy)
    reserves and commits at once."""
    requests = facts.spec.requests
    wanted = device_counts(requests)
    if wanted and placed is not None and placed.node is not None:
        entry.devices = DeviceHold(node=placed.node, devices=list(placed.devices))
    available.update(subtract(_take(available, kept, facts), requests))
    _charge(result, entry)
    result.status.entries[facts.uid] = entry
    where = ""
    if entry.devices is not None:
        where = f" with devices {', '.join(entry.devices.devices)} on {entry.devices.node}"
        result.device_holds[facts.uid] = wanted
    result.events.append(
        LedgerEvent(
            facts.uid, facts.name, "Reserved", f"capacity reserved{where}", False, entry.phase
        )
    )
    policy = envelope.spec.policy
    result.events += _advance(result, entry, facts, policy, envelope.accepting(result.now))
    if _gate_to_lift(entry):
        result.handed_off[facts.uid] = entry.handed_off_to or ""


def _retry_hold_for(
    entries: Iterable[LedgerEntry], facts: ClaimFacts, in_use: set[int]
) -> RetryHold | None:
    """What an earlier failed attempt of the same branch keeps for this one, if anything
    (and no other retry waiting for its devices uses in this pass)."""
    branch, attempt = facts.spec.branch, facts.spec.attempt
    if not branch:
        return None
    kept = [
        e.retry
        for e in entries
        if e.branch == branch
        and e.attempt < attempt
        and e.retry is not None
        and e.retry.active
        and id(e.retry) not in in_use
    ]
    return kept[0] if kept else None


def _take(
    available: Mapping[str, Decimal], kept: RetryHold | None, facts: ClaimFacts
) -> dict[str, Decimal]:
    """The balance once a retry takes what its failed attempt kept (it counts as available
    to this attempt only)."""
    if kept is None:
        return dict(available)
    kept.taken_by = facts.name
    return add(available, kept.resources)


def _totals(
    envelope: EnvelopeFacts, committed: Mapping[str, Decimal], ledger: ReservationEnvelopeStatus
) -> ResourceTotals:
    return compute_totals(
        envelope.spec.capacity,
        committed,
        ledger.entries.values(),
        ledger.children.values(),
        lent=lent_total(ledger),
        borrowed=borrowed_total(ledger),
    )


def _has_parent_envelope(record: ParentRecord | None) -> bool:
    return record is not None and record.kind is ParentKind.ENVELOPE


def _withdrawn(result: Reconciliation) -> bool:
    """Its parent recorded that it will never hold this envelope's capacity."""
    record = result.status.parent
    return record is not None and record.admitted_at is None


def _done_upward(record: ParentRecord | None, envelope: EnvelopeFacts) -> bool:
    parent = envelope.parent
    if record is None:  # closed unadmitted: only once its parent is gone
        return parent is None or parent.gone
    if record.kind is ParentKind.ROOT or record.admitted_at is None or record.settled is not None:
        return True
    return parent is None or parent.uid != record.uid


def _queue_key(item: ClaimFacts | ChildFacts) -> QueueKey:
    if isinstance(item, ChildFacts):
        return item.queue_key
    return QueueKey(item.spec.priority, item.created_at, item.name, item.uid)


def _envelope_lifecycle(result: Reconciliation, envelope: EnvelopeFacts, now: datetime) -> None:
    ledger = result.status
    live = (
        bool(result.charges_waiting)
        or _holds_any(ledger)
        or any(c.phase is ChildPhase.RESERVED for c in ledger.children.values())
        or any(loan.phase is LoanPhase.LENT for loan in ledger.loans.values())
    )
    parent_gone = envelope.parent is not None and envelope.parent.gone
    if envelope.accepting(now) and not _withdrawn(result):
        ledger.phase = EnvelopePhase.OPEN if result.admitted else EnvelopePhase.PENDING
    else:
        settled = not live and not result.pending and not result.pending_children
        if not result.admitted and not _withdrawn(result) and not parent_gone:
            # Never admitted, but its parent may have reserved for it since it last looked:
            # it closes once the parent recorded the withdrawal (or the admission shows up).
            settled = False
        if ledger.closed_at is not None:
            # Closed once, closed for good: the phase it closed in stays.
            if ledger.phase not in (EnvelopePhase.CLOSED, EnvelopePhase.EXPIRED):
                ledger.phase = EnvelopePhase.CLOSED
        elif envelope.expired(now):
            ledger.phase = EnvelopePhase.EXPIRED
        else:
            ledger.phase = EnvelopePhase.CLOSED if settled else EnvelopePhase.CLOSING
        if settled and ledger.closed_at is None:
            # Every child has settled: the remaining balance goes back where it came from
            # (its parent reads it from here), or to the cluster for a root. An envelope
            # never admitted held nothing, so it returns nothing.
            # What it still owes siblings is repaid first; the rest was consumed.
            available = dict(ledger.totals.available)
            result.events += repay(ledger, available)
            close_borrowings(ledger, now)
            ledger.totals = _totals(envelope, ledger.totals.committed, ledger)
            ledger.balance_released = dict(ledger.totals.available) if result.admitted else {}
            ledger.closed_at = now
    result.done_upward = (
        ledger.closed_at is not None
        and _done_upward(ledger.parent, envelope)
        # and every sibling that lent to it has settled the loan: what its claims used of
        # a loan is read from this envelope's record (found by review)
        and all(
            s.loan_to_me is None or s.loan_to_me.phase is LoanPhase.SETTLED
            for s in envelope.siblings
        )
    )
    counts: dict[str, int] = {}
    for entry in ledger.entries.values():
        counts[entry.phase.value] = counts.get(entry.phase.value, 0) + 1
    if result.pending:
        counts[ClaimPhase.PENDING.value] = len(result.pending)
    ledger.counts = dict(sorted(counts.items()))
    ledger.summary = EnvelopeSummary(
        capacity=one_line(ledger.totals.capacity),
        available=one_line(ledger.totals.available),
        committed=one_line(ledger.totals.committed),
        live=sum(1 for e in ledger.entries.values() if e.phase.holds_capacity),
        contracts=bounded(summary(result.contracts), SUMMARY_LENGTH),
    )
    open_ = ledger.phase is EnvelopePhase.OPEN
    ledger.conditions = merge_conditions(
        ledger.conditions,
        [
            Desired("Open", open_, ledger.phase.value, "admits claims" if open_ else ""),
            Desired(
                "Settled",
                ledger.closed_at is not None,
                "BalanceReleased" if ledger.closed_at else "ClaimsLive",
                "every claim settled and the balance was released" if ledger.closed_at else "",
            ),
        ],
        now,
        envelope.generation,
    )
    ledger.observed_generation = envelope.generation
