"""The one serialized writer per envelope. A pass (`LedgerWriter._attempt`) is its steps:

1. `_read`: the envelope, fresh (its resourceVersion fences the write), the budget tree
   around it, its claims and their Leases (listed, or from the watch-fed index), their pods
   and the envelope's devices;
2. `_decide_on`: the pure core's next ledger (reservoir.core.reconcile); claims that do not
   add up to the envelope's record are listed afresh, and a decision that rests on a fact
   being absent is taken again on the claims read fresh;
3. `_write`: the envelope's status with a PUT conditional on the version read, when the
   totals or the lines in flight changed (reservoir.core.inflight); a 409 means someone
   else wrote first (another replica, or this one on a stale read): re-read, recompute,
   retry with jitter;
4. `_announce_durable`: Events, gauges and lost lines, for what is now recorded;
5. `_mirror_and_announce`: each claim's status gets its line, then the Events that waited;
6. `_hold_devices`: ResourceClaims and placeholder pods follow the ledger, gates lift;
7. `_release_settled` and `_delete_expired`: finalizers of settled claims, expired claims.

Many claim events between two passes are settled by one pass (group commit).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, NoReturn, Protocol, TypeVar

from lightkube import ApiError, AsyncClient
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.operators import not_exists
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Pod
from lightkube.types import PatchType

from reservoir import metrics
from reservoir.core.borrowing import LOAN_EVENTS, SiblingFacts
from reservoir.core.budgets import ChildFacts, ParentView
from reservoir.core.claimstatus import claim_status, set_aside, wait_told_at
from reservoir.core.conditions import Desired, merge_conditions
from reservoir.core.devices import DeviceFacts, device_occupancy, has_device_resources
from reservoir.core.inflight import ClaimViewBehindError, EnvelopeBehindError, counts, newest
from reservoir.core.ledger import InvariantViolationError
from reservoir.core.lifecycle import ClaimFacts, LedgerEvent
from reservoir.core.model import (
    MAX_CONDITIONS,
    BranchClaimStatus,
    ClaimPhase,
    CommitPoint,
    Condition,
    EnvelopePolicy,
    LedgerEntry,
    ParentKind,
    ParentRecord,
    ReservationEnvelopeStatus,
    UpstreamCancel,
)
from reservoir.core.model import Trigger as Cause
from reservoir.core.policy import settlement_due
from reservoir.core.provider import (
    Adapter,
    ForwardedCancel,
    adapter_for,
    cancel_to_forward,
    lookup_due,
    needs_lookup,
)
from reservoir.core.quiet import QuietClaims
from reservoir.core.reconcile import EnvelopeFacts, Reconciliation, reconcile
from reservoir.core.stranded import stranded
from reservoir.k8s import budgets
from reservoir.k8s import facts as read
from reservoir.k8s.claim_source import (
    ClaimSource,
    ListedClaims,
    Record,
    WatchedClaims,
    claim_record,
    commit_point,
    forget_older,
    lease_record,
)
from reservoir.k8s.clock import utcnow
from reservoir.k8s.devices import PLACEHOLDER_LABEL, DeviceHolder
from reservoir.k8s.passes_in_flight import PassesInFlight
from reservoir.k8s.providers import ProviderClient
from reservoir.k8s.request_ids import claims_with_request_id
from reservoir.k8s.request_slots import RequestSlots
from reservoir.k8s.resources import (
    CLAIM_FINALIZER,
    CLAIM_LABEL,
    WORKFLOW_CLASS_LABEL,
    BranchClaim,
    ReservationEnvelope,
    claim_of_label,
    get_object,
)
from reservoir.k8s.transition_events import TransitionEvents, posts_event
from reservoir.k8s.triggers import Trigger, Triggers

log = logging.getLogger(__name__)
T = TypeVar("T")
# What to ask a claim's provider: the cancel to forward (or None), the adapter, and whether
# to look its operation up.
ProviderCall = tuple[UpstreamCancel | None, Adapter | None, bool]
MAX_ATTEMPTS = 8
LOOKUPS_PER_NAMESPACE = 4  # provider calls in flight at once for one namespace
# Claim reads and writes in flight at once, for all envelopes: within the HTTP client's
# pool of kept-alive connections (20), so that none is opened per request under load.
REQUESTS_IN_FLIGHT = 16
PASS_REQUESTS = 8  # of which one pass queues at most this many at a time (request_slots.py)
# Envelope passes running at once, and of one namespace's envelopes (passes_in_flight.py).
PASSES_IN_FLIGHT = 32
PASSES_PER_NAMESPACE = 16
# A claim's status shows usage reported on the way at most this late: a report followed by
# the final report (or any other move) within it costs one status write, not two.
MIRROR_USAGE_WITHIN = timedelta(seconds=2)
# How soon a pass comes back to retire lines in flight its claims now show: soon, and
# late enough that one envelope write retires the lines of many claims.
RETIRE_WITHIN = timedelta(seconds=1)
# How soon a pass comes back to lift a recorded hand-off's gate whose lift failed.
GATE_RETRY = timedelta(seconds=5)
# How soon a pass comes back to what the API server refused without saying the copy was
# stale (a claim status write refused, a device hold refused or not deleted): no news may
# come to bring it sooner (found by review once passes without news came every 5 minutes).
RETRY_REFUSED_SECONDS = 30
RELEASED_KEEP_SECONDS = 600.0
# What the writer keeps of an envelope (its parsed claims, what they were told, its gauges)
# goes this long after no daemon or deletion handler keeps it, swept at most this often.
LET_GO_SECONDS = 600.0
LET_GO_SWEEP_SECONDS = 60.0
# Refusals reported once each, an envelope; lines of claims seen deleted kept for its pass.
REFUSALS_KEPT = 32
DEPARTED_KEPT = 10_000
# A lease that ends moves the claim here: the renewal the index may lack is read first.
LEASE_PHASES = frozenset({ClaimPhase.EXPIRED, ClaimPhase.DETACHED})


def decided_on_absence(before: LedgerEntry | None, after: LedgerEntry) -> bool:
    """Whether a pass's decision about one entry rests on a fact being absent, which a
    stale copy of the claim could wrongly show: an admission (no settlement recorded in
    its status: one compacted away would otherwise be admitted again) and a move the clock
    decided (a lease end without a renewal or dispatch, a deadline without a report). A
    move decided on a fact the copy shows (a dispatch, a final report, a cancel, a
    deletion, a force-settle annotation) stands: a newer copy still shows that fact, and
    every fact recorded before it."""
    if before is None:
        return True
    if before.phase == after.phase:
        return False
    moves = [t for t in after.history if t not in before.history]
    return not moves or any(t.trigger is Cause.CLOCK for t in moves)


def versions(
    claims: list[Record], leases: Mapping[str, Mapping[str, Any]]
) -> tuple[frozenset[tuple[str, str]], frozenset[tuple[str, str]]]:
    """Which object versions a pass read: the same versions decide the same."""
    return (
        frozenset((c["metadata"]["uid"], c["metadata"]["resourceVersion"]) for c in claims),
        frozenset(
            (n, str(lease["metadata"].get("resourceVersion"))) for n, lease in leases.items()
        ),
    )


class Recorder(Protocol):
    """Posts a Kubernetes Event about an object (kopf's poster in the operator)."""

    def __call__(self, obj: Mapping[str, Any], type_: str, reason: str, message: str) -> None: ...


def drop_departed(
    departed: dict[str, tuple[str | None, LedgerEntry]], recorded: Iterable[str], envelope_uid: str
) -> None:
    """After an envelope's pass: the lines of claims seen deleted that the pass recorded are
    in flight now, or settled; those it left for the next pass, and deletions seen since,
    stay. Lines bound to another envelope of its name (one gone before it, or a claim's
    status saying so) are never this envelope's: they go too, or they stayed for its life."""
    for uid in recorded:
        departed.pop(uid, None)
    for uid in [u for u, (bound, _) in departed.items() if bound != envelope_uid]:
        del departed[uid]


async def gather_or_cancel(*steps: Awaitable[T]) -> list[T]:
    """`asyncio.gather`, but the first failure cancels the others (and waits for them)
    before it is raised: none goes on after its pass has failed (found by review: a
    provider call that outlived its pass took that pass's slot for good)."""
    tasks = [asyncio.ensure_future(step) for step in steps]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class Conflict:
    """The compare-and-swap lost: someone wrote the envelope since we read it."""


Invalid = tuple[Record, "ClaimFacts | read.InvalidClaim"]


FactsKey = tuple[str, str, str | None, tuple[tuple[str, str], ...]]


@dataclass
class PassFacts:
    """The facts of one pass's claims. A claim version (with its Lease's and its pods'
    versions) is parsed once, and kept for the next pass (`parsed`, `used`): an envelope
    of many claims re-reads only those that moved. Providers are consulted once a pass."""

    writer: LedgerWriter
    namespace: str
    status: ReservationEnvelopeStatus
    policy: EnvelopePolicy
    parsed: Mapping[FactsKey, ClaimFacts | read.InvalidClaim]  # by the previous pass
    used: dict[FactsKey, ClaimFacts | read.InvalidClaim] = field(default_factory=dict)
    facts: list[ClaimFacts] = field(default_factory=list)
    invalid: list[Invalid] = field(default_factory=list)
    _asked: dict[FactsKey, ClaimFacts] = field(default_factory=dict)
    _by_uid: dict[str, ClaimFacts] = field(default_factory=dict)  # as first asked this pass

    async def update(
        self,
        claims: list[Record],
        leases: Mapping[str, Mapping[str, Any]],
        pods: Mapping[str, list[Mapping[str, Any]]],
    ) -> None:
        keys = []
        for claim in claims:
            meta = claim["metadata"]
            lease = leases.get(meta["name"])
            workload = pods.get(meta["uid"]) or []
            key = (
                meta["uid"],
                meta["resourceVersion"],
                version_of(lease),
                tuple(sorted((p["metadata"]["uid"], str(version_of(p))) for p in workload)),
            )
            keys.append((claim, key))
            if key not in self.used:
                found = self.parsed.get(key)
                self.used[key] = found or read.claim_facts(claim, lease, workload)
        # Ask the providers of the claims that need it, and find the submissions that
        # reuse an older claim's idempotency key (only for claims still waiting).
        ask: dict[FactsKey, ClaimFacts] = {}
        for _, key in keys:
            fact = self.used[key]
            if not isinstance(fact, ClaimFacts) or key in self._asked:
                continue
            earlier = self._by_uid.get(key[0])
            if earlier is not None:
                # Read again in this pass (a newer version): its provider was asked and its
                # cancel forwarded already; never twice in one pass (found by review).
                self._asked[key] = replace(
                    fact,
                    provider=earlier.provider,
                    cancel_forwarded=earlier.cancel_forwarded,
                    duplicate_of=earlier.duplicate_of,
                )
                continue
            ask[key] = fact
        answers = await self.writer.consult(
            self.namespace, list(ask.values()), self.status, self.policy
        )
        for key, answer in zip(ask, answers, strict=True):
            self._asked[key] = answer
            self._by_uid[key[0]] = answer
        self.facts, self.invalid = [], []
        for claim, key in keys:
            parsed = self.used[key]
            if isinstance(parsed, read.InvalidClaim):
                self.invalid.append((claim, parsed))
                continue
            fact = self._asked[key]
            if fact.problem is not None:
                self.invalid.append((claim, fact))
            self.facts.append(fact)


def version_of(body: Mapping[str, Any] | None) -> str | None:
    return None if body is None else str((body.get("metadata") or {}).get("resourceVersion"))


def unhealthy(
    envelope: Mapping[str, Any], reason: str, message: str, now: datetime
) -> list[Condition]:
    """The envelope's conditions with LedgerHealthy=False added (the ledger itself is left
    as it is), merged like every other condition."""
    status = envelope.get("status") or {}
    previous = [Condition.model_validate(c) for c in status.get("conditions") or []]
    generation = envelope["metadata"].get("generation")
    kept = [c for c in previous if c.type != "LedgerHealthy"][: MAX_CONDITIONS - 1]
    return kept + merge_conditions(
        previous, [Desired("LedgerHealthy", False, reason, message[:1024])], now, generation
    )


@dataclass
class PassRead:
    """What one pass read, in the order it read it (LedgerWriter._read)."""

    namespace: str
    name: str
    envelope: dict[str, Any]  # as read: its resourceVersion fences the write
    envelope_facts: EnvelopeFacts
    status: ReservationEnvelopeStatus
    parent: ParentView | None
    tree_bodies: dict[str, dict[str, Any]]  # its children and siblings, to poke
    child_bodies: dict[str, dict[str, Any]]  # child-line Events go on the child envelope
    claims: list[Record]
    leases: dict[str, Record]
    confirmed: set[str]  # claims read fresh in this pass (or confirmed gone)
    pods: dict[str, list[Mapping[str, Any]]]
    resource_claims: dict[str, dict[str, Any]]
    placeholders: dict[str, dict[str, Any]]
    devices: Mapping[str, DeviceFacts]
    now: datetime
    facts: PassFacts
    departed: dict[str, LedgerEntry]  # last lines of claims seen deleted
    fresh: bool  # the claims were listed from the API server in this pass

    @property
    def by_uid(self) -> dict[str, Mapping[str, Any]]:
        found = {c["metadata"]["uid"]: c for c in self.claims}
        found.update(self.child_bodies)
        return found


class LedgerStuckError(RuntimeError):
    """The envelope's ledger cannot move (unreadable, an invariant would break, or the API
    server refuses the write). Reported on the envelope; retried later, never a crash."""


class LedgerWriter:
    def __init__(
        self,
        client: AsyncClient,
        record: Recorder,
        clock: Callable[[], datetime] = utcnow,
        devices: DeviceHolder | None = None,
        providers: ProviderClient | None = None,
    ) -> None:
        self.client = client
        self.providers = providers or ProviderClient(client)
        # Provider calls in flight, per namespace: a slow tenant's provider (each call is
        # bounded by its own deadline) never holds back another tenant's lookups.
        self._lookups: dict[str, asyncio.Semaphore] = {}
        self.record = record
        self.clock = clock
        self.devices = devices or DeviceHolder(client, None)
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        # Each envelope's last completed pass, numbered in the order passes and requests
        # for them came (reconcile_once shares a pass with whoever asked before it began).
        self._pass_numbers = itertools.count()
        self._last_pass: dict[tuple[str, str], tuple[int, Reconciliation | Exception | None]] = {}
        self._waiting: dict[tuple[str, str], int] = {}  # callers of reconcile_once
        self._fan_out = RequestSlots(REQUESTS_IN_FLIGHT, PASS_REQUESTS)
        self._passes = PassesInFlight(PASSES_IN_FLIGHT, PASSES_PER_NAMESPACE)
        # Where claims and Leases are read from: the API server on every pass, unless the
        # operator hands over its watch-fed indexes at start-up (handlers/startup.py).
        self.source: ClaimSource = ListedClaims(client)
        # Claims of a ledger entry confirmed gone, by envelope: not read again.
        self._gone: dict[tuple[str, str], set[str]] = {}
        # Which envelopes draw on which, (namespace, parent) -> names, fed by the watch: an
        # envelope that has no child line and no child there lists none. None: always list.
        self.children: Mapping[tuple[str, str], Iterable[str]] | None = None
        # Each envelope's claims as its last pass parsed them (by object versions).
        self._parsed: dict[tuple[str, str], Mapping[FactsKey, ClaimFacts | read.InvalidClaim]] = {}
        # Settled claims each envelope's last pass found quiet (reservoir.core.quiet).
        self._quiet: dict[tuple[str, str], QuietClaims] = {}
        # Claims whose status said all of it at the last mirror, by envelope: claim UID ->
        # what it was told then, with the version it had (LedgerWriter._mirror).
        self._told: dict[tuple[str, str], dict[str, tuple[object, ...]]] = {}
        # Usage-only status changes held back, by envelope: claim UID -> when due.
        self._deferred: dict[tuple[str, str], dict[str, datetime]] = {}
        # Claims whose deletion waits for settlement, already announced (once each).
        self._awaiting: set[str] = set()
        # The last ledger line of claims seen deleted, by envelope (namespace, name): claim
        # UID -> (the UID of the envelope it was bound to, its line). Kept until a pass
        # has recorded them (a claim gone with a line that still counts: its finalizer
        # was removed by hand).
        self._departed: dict[tuple[str, str], dict[str, tuple[str | None, LedgerEntry]]] = {}
        # Claims whose finalizer this writer removed (claim UID -> when): not patched again.
        self._released: dict[str, float] = {}
        # Wake-ups for each envelope's passes, held by its daemon or deletion handler.
        self._triggers: Triggers[tuple[str, str]] = Triggers()
        # Envelopes no daemon or deletion handler keeps, since when (monotonic): what the
        # writer keeps about them goes after LET_GO_SECONDS (_forget_let_go).
        self._let_go: dict[tuple[str, str], float] = {}
        self._next_let_go_sweep = 0.0
        # Claim UID -> the resourceVersion of its unreadable spec last reported: one Event a
        # version, and one entry a live claim (a tenant rewriting an unreadable claim made a
        # set of every version grow for the operator's life).
        self._reported_invalid: dict[str, str] = {}
        # By envelope, (its uid, generation, reason, message): reported once, so that the
        # report's own write (a new resourceVersion) never wakes a loop of reports. At most
        # REFUSALS_KEPT an envelope, and forgotten with it (a tenant's claims can make each
        # refusal's message new).
        self._reported_refusals: dict[tuple[str, str], set[tuple[str, int, str, str]]] = {}
        # Which moves post an Event (each is an API write; the claim's status records
        # every move either way).
        self.transition_events = TransitionEvents.EXCEPTIONS
        # How long a claim that only waits its turn keeps its default status (Pending)
        # before its reason is written (--queue-reason-after; 0 here: tests and tools).
        self.queue_reason_after = timedelta(0)
        # Wakes a pool's writer when one of its envelopes wrote news (set at start-up).
        self.poke_pool: Callable[[str], None] = lambda _name: None

    def own_write(self, uid: str, version: str) -> bool:
        """Whether this claim version is the writer's own status write (no news)."""
        return self.source.own_write(uid, version)

    def saw_deleted(self, uid: str, body: Mapping[str, Any] | None = None) -> None:
        """The watch delivered a claim's deletion (no GET needed to know it is gone), with
        the claim's last state: a line it still held is kept for its envelope's next pass,
        if a pass of that envelope runs (its daemon or deletion handler holds its trigger)
        or ran lately (a deletion handler between two of kopf's calls: found by review, the
        line dropped there left a lost line that only a person could settle). Not
        otherwise: a tenant's claims may name any envelope, and a line kept for one that no
        pass reads was kept for the operator's life. (An envelope's pass that finds
        its claim gone without the line keeps what it held, as a lost line: never
        returned on a guess.)"""
        self._awaiting.discard(uid)
        self._reported_invalid.pop(uid, None)
        if isinstance(self.source, WatchedClaims):
            self.source.saw_deleted(uid)
        if body is None:
            return
        line = read.claim_line(body)
        if line is None or not counts(line):
            return
        status = body.get("status") or {}
        envelope = str((body.get("spec") or {}).get("envelope") or "")
        namespace = str(body["metadata"].get("namespace") or "")
        if not self.kept(namespace, envelope) and (namespace, envelope) not in self._let_go:
            return
        bound = status.get("envelopeUid") if isinstance(status, Mapping) else None
        departed = self._departed.setdefault((namespace, envelope), {})
        if len(departed) < DEPARTED_KEPT or uid in departed:
            departed[uid] = (str(bound) if bound else None, line)

    def departed(self, namespace: str, envelope: str, uid: str) -> dict[str, LedgerEntry]:
        """The lines of claims seen deleted that were bound to this envelope (`uid`)."""
        return {
            claim: line
            for claim, (bound, line) in self._departed.get((namespace, envelope), {}).items()
            if bound == uid
        }

    def forget(self, namespace: str, envelope: str) -> None:
        """The envelope is going: what this writer kept about it goes too, and its gauges'
        series with it."""
        kept_by_envelope = (
            self._parsed, self._quiet, self._told, self._gone, self._deferred,
            self._departed, self._reported_refusals,
        )  # fmt: skip
        for kept in kept_by_envelope:
            kept.pop((namespace, envelope), None)
        self._triggers.forget((namespace, envelope))
        metrics.envelopes.forget(namespace, envelope)

    @contextlib.contextmanager
    def keeping(self, namespace: str, envelope: str) -> Iterator[Trigger]:
        """While the envelope's daemon runs, or its deletion handler waits for news: `kept`
        says a poke will reach a pass."""
        key = (namespace, envelope)
        self._let_go.pop(key, None)
        self._forget_let_go()
        try:
            with self._triggers.holding(key) as trigger:
                yield trigger
        finally:
            if not self._triggers.held(key):
                self._let_go.setdefault(key, time.monotonic())

    def _forget_let_go(self) -> None:
        """Forget the envelopes no daemon or deletion handler has kept for LET_GO_SECONDS.
        An envelope that goes is forgotten by the pass that finds it gone, or by its
        deletion handler; one removed without either (its finalizer taken off by hand)
        kept its parsed claims and its gauges for the operator's life (found by review:
        500 of them also pushed every other tenant's envelopes out of the gauges shown by
        name). Swept at most once a LET_GO_SWEEP_SECONDS, as daemons start."""
        now = time.monotonic()
        if now < self._next_let_go_sweep:
            return
        self._next_let_go_sweep = now + LET_GO_SWEEP_SECONDS
        for key, since in list(self._let_go.items()):
            if now - since > LET_GO_SECONDS:
                del self._let_go[key]
                self.forget(*key)

    def kept(self, namespace: str, envelope: str) -> bool:
        """Whether a poke reaches a pass of the envelope: its daemon runs, or its deletion
        handler waits for news (kopf stops the daemon once the envelope is being deleted,
        and never starts it for an envelope that does not exist)."""
        return self._triggers.held((namespace, envelope))

    def poke(self, namespace: str, envelope: str) -> None:
        self._triggers.poke((namespace, envelope))

    async def reconcile_once(self, namespace: str, envelope: str) -> Reconciliation | None:
        """Converge one envelope's ledger. None if the envelope does not exist.

        Callers that wait while a pass runs share the next one: a pass that began after a
        caller asked has read everything that caller knew of (the 2,000 claims of a
        deleted namespace each asking for their envelope's pass cost one or two passes,
        not 2,000 in a row, each reading every claim)."""
        key = (namespace, envelope)
        asked = next(self._pass_numbers)
        lock = self._locks.setdefault(key, asyncio.Lock())
        self._waiting[key] = self._waiting.get(key, 0) + 1
        try:
            async with lock:
                shared = self._last_pass.get(key)
                if shared is not None and shared[0] > asked:
                    if isinstance(shared[1], Exception):
                        raise shared[1]  # it failed for them as it would for this caller
                    return shared[1]
                # Numbered once it may run: whoever asks while it waits for a slot shares it.
                async with self._passes.slot(namespace):
                    number = next(self._pass_numbers)
                    try:
                        outcome = await self._converge(namespace, envelope)
                    except Exception as error:
                        self._last_pass[key] = (number, error)
                        raise
                self._last_pass[key] = (number, outcome)
                return outcome
        finally:
            self._waiting[key] -= 1
            if not self._waiting[key]:  # no one left to share it with, or holding the lock
                del self._waiting[key]
                self._last_pass.pop(key, None)
                del self._locks[key]  # kept only while in use: envelopes come and go
            if not self._triggers.held(key):  # a pass no daemon asked for (claims.adopt)
                self._let_go.setdefault(key, time.monotonic())

    async def _converge(self, namespace: str, envelope: str) -> Reconciliation | None:
        """Passes until one is not a conflict (bounded, with jittered back-off)."""
        started = time.monotonic()
        try:
            for attempt in range(MAX_ATTEMPTS):
                outcome = await self._attempt(namespace, envelope)
                if not isinstance(outcome, Conflict):
                    return outcome
                # Someone wrote first: back off with jitter, then read again.
                await asyncio.sleep(random.uniform(0, 0.05 * 2**attempt))
            raise RuntimeError(f"{namespace}/{envelope}: {MAX_ATTEMPTS} conflicts in a row")
        finally:
            metrics.reconcile_seconds.labels(namespace).observe(time.monotonic() - started)

    async def _attempt(self, namespace: str, name: str) -> Reconciliation | Conflict | None:
        """One pass, as its steps: read, decide, write, announce, mirror, devices, release."""
        fetched = await self._read(namespace, name)
        if fetched is None:
            return None
        result = await self._decide_on(fetched)
        if isinstance(result, Conflict):
            return result
        conflict = await self._write(fetched, result)
        if conflict is not None:
            return conflict
        # The ledger is durable (and so healthy again): now tell the world.
        held_back = self._announce_durable(fetched, result)
        await self._mirror_and_announce(fetched, result, held_back)
        await self._hold_devices(fetched, result)
        await self._release_settled(namespace, fetched.claims, result)
        await self._delete_expired(namespace, result.expired_claims)
        return result

    async def _read(self, namespace: str, name: str) -> PassRead | None:
        """Read: the envelope first, fresh (the compare-and-swap is conditional on this
        version), then the budget tree around it, its claims (from the source: a LIST, or
        the watch-fed index with every doubtful claim read again after the envelope), their
        Leases and pods, and its devices. None: the envelope is gone."""
        envelope = await get_object(self.client, ReservationEnvelope, name, namespace)
        if envelope is None:
            self.forget(namespace, name)
            return None
        try:
            envelope_facts, status = read.envelope_facts(envelope)
        except read.UnreadableEnvelopeError as error:
            await self._refused(envelope, "UnreadableEnvelope", str(error))
        # The budget tree around it: where it draws from, and the envelopes drawing on it
        # (listed after the envelope: a child the ledger names but the list lacks is gone).
        uid = envelope["metadata"]["uid"]
        try:
            parent = await budgets.parent_view(
                self.client, envelope, envelope_facts.spec, status.parent
            )
        except read.UnreadableEnvelopeError as error:
            await self._refused(envelope, "UnreadableParent", str(error))
        children: list[ChildFacts] = []
        child_bodies: dict[str, dict[str, Any]] = {}
        held_by_children = status.child_records is not None and status.child_records.count > 0
        indexed = self.children is None or self.children.get((namespace, name))
        siblings: list[SiblingFacts] = []
        sibling_bodies: dict[str, dict[str, Any]] = {}
        try:
            if status.children or held_by_children or indexed:
                children, child_bodies = await budgets.children_of(
                    self.client, namespace, name, self.clock()
                )
            if envelope_facts.spec.parent is not None:  # loans are between siblings
                siblings, sibling_bodies = await budgets.siblings_of(
                    self.client, namespace, envelope_facts.spec.parent, uid, self.clock()
                )
        except read.UnreadableEnvelopeError as error:
            await self._refused(envelope, "UnreadableChild", str(error))
        envelope_facts = replace(
            envelope_facts,
            name=name,
            uid=uid,
            parent=parent,
            children=children,
            siblings=siblings,
        )
        claims = await self.source.claims(namespace, name)
        leases = await self.source.leases(namespace, name)
        confirmed: set[str] = set()
        if not self.source.fresh:
            # A claim the ledger names but the index lacks may only be late in the watch:
            # read it. One found gone is gone for good (UIDs are never reused).
            gone = self._gone.setdefault((namespace, name), set())
            gone &= set(status.entries)
            present = {c["metadata"]["uid"] for c in claims}
            gone |= {u for u in status.entries if u not in present and self.source.deleted(u)}
            missing = {u: e.claim for u, e in status.entries.items() if u not in present | gone}
            claims, leases = await self._confirm(namespace, missing, claims, leases, set())
            gone |= set(missing) - {c["metadata"]["uid"] for c in claims}
            confirmed |= set(missing) | gone
        has_devices = has_device_resources(envelope_facts.spec.capacity)
        pods = await self._workload_pods(namespace, claims, has_devices)
        # Listed after the claims: a ResourceClaim missing here is gone (deallocated).
        resource_claims: dict[str, dict[str, Any]] = {}
        placeholders: dict[str, dict[str, Any]] = {}
        if has_devices:
            resource_claims, placeholders = await self.devices.observe(namespace, name)
        parsed = self._parsed.get((namespace, name), {})
        facts = PassFacts(self, namespace, status, envelope_facts.spec.policy, parsed)
        await facts.update(claims, leases, pods)
        return PassRead(
            namespace=namespace,
            name=name,
            envelope=envelope,
            envelope_facts=envelope_facts,
            status=status,
            parent=parent,
            tree_bodies={**child_bodies, **sibling_bodies},
            child_bodies=child_bodies,
            claims=claims,
            leases=leases,
            confirmed=confirmed,
            pods=pods,
            resource_claims=resource_claims,
            placeholders=placeholders,
            devices=self.devices.facts(resource_claims, placeholders),
            now=self.clock(),
            facts=facts,
            departed=self.departed(namespace, name, uid),
            fresh=self.source.fresh,
        )

    async def _decide_on(self, fetched: PassRead) -> Reconciliation | Conflict:
        """Decide: the core's next ledger on what was read. Claims that do not add up to
        the envelope's record are listed afresh; a decision that rests on a fact being
        absent is taken again on the claims read fresh when the index's copies were not
        the latest (a stale copy can only lack a fact, never add one). Each round reads
        claims not read yet, so the rounds end (at worst when every claim was read)."""
        try:
            result = await self._decide(fetched)
        except EnvelopeBehindError:
            return Conflict()  # another writer moved it since we read it
        except ClaimViewBehindError:
            # The watch has not shown every line the envelope counts yet: list them. What
            # the list lacks then is lost, not late (reservoir.core.inflight).
            listed = ListedClaims(self.client)
            fetched.claims = await listed.claims(fetched.namespace, fetched.name)
            fetched.leases = await listed.leases(fetched.namespace, fetched.name)
            fetched.confirmed |= {c["metadata"]["uid"] for c in fetched.claims}
            await fetched.facts.update(fetched.claims, fetched.leases, fetched.pods)
            fetched.fresh = True
            try:
                result = await self._decide(fetched)
            except EnvelopeBehindError:
                return Conflict()
        while not self.source.fresh:
            moving = {
                uid: entry.claim
                for uid, entry in result.lines.items()
                if uid not in fetched.confirmed
                and decided_on_absence(result.before.get(uid), entry)
            }
            if not moving:
                break
            lapsing = {uid for uid in moving if result.lines[uid].phase in LEASE_PHASES}
            seen = versions(fetched.claims, fetched.leases)
            fetched.claims, fetched.leases = await self._confirm(
                fetched.namespace, moving, fetched.claims, fetched.leases, lapsing
            )
            fetched.confirmed |= set(moving)
            if versions(fetched.claims, fetched.leases) == seen:
                break
            await fetched.facts.update(fetched.claims, fetched.leases, fetched.pods)
            try:
                result = await self._decide(fetched)
            except (ClaimViewBehindError, EnvelopeBehindError):
                return Conflict()  # a claim moved past the envelope read: read both again
        self._parsed[(fetched.namespace, fetched.name)] = fetched.facts.used
        self._quiet[(fetched.namespace, fetched.name)] = result.quiet
        return result

    async def _write(self, fetched: PassRead, result: Reconciliation) -> Conflict | None:
        """Write: the envelope's status with one PUT conditional on the version read, when
        the pass changed it (a move of the totals, lines in flight retired). Otherwise
        claim-only moves follow only if the envelope read is still the newest."""
        namespace, name, envelope = fetched.namespace, fetched.name, fetched.envelope
        if not ledger_moved(fetched.status, result.status):
            metrics.ledger_writes.labels(namespace, "unchanged").inc()
            # Nothing to write, so the ledger we read may be older than a status another
            # replica mirrored after we read it: mirror only if it is still the newest.
            if not await self._still_current(namespace, name, envelope):
                return Conflict()
            return None
        version = envelope["metadata"]["resourceVersion"]
        body = ReservationEnvelope.Status(
            metadata=ObjectMeta(name=name, namespace=namespace, resourceVersion=version),
            status=result.status.to_api(),
        )
        try:
            # lightkube types generic status bodies as resources; the call is right
            await self.client.replace(body, name, namespace=namespace)  # type: ignore[call-overload]
        except ApiError as error:
            if error.status.code == 409:
                metrics.ledger_writes.labels(namespace, "conflict").inc()
                return Conflict()
            # Anything else (422, 413, a 500 for an object etcd will not store) would
            # come back the same on every retry: say so on the envelope, retry later.
            metrics.ledger_writes.labels(namespace, "refused").inc()
            await self._refused(
                envelope, "WriteRefused", f"{error.status.code}: {error.status.message}"
            )
        metrics.ledger_writes.labels(namespace, "written").inc()
        # Its parent and children read this ledger: they have news.
        self._poke_tree(namespace, fetched.parent, fetched.tree_bodies, result)
        # The moves this write recorded (the lines in flight); claim-only moves are
        # observed once their claim's status holds them (_mirror_and_announce).
        self._observe(fetched, result, set(result.status.entries))
        return None

    def _observe(self, fetched: PassRead, result: Reconciliation, recorded: set[str]) -> None:
        """Latencies, renewals, C/R and occupancy of the lines `recorded` just made durable."""
        metrics.observe_written(
            fetched.namespace,
            workflow_class(fetched.envelope),
            {u: line for u, line in result.before.items() if u in recorded},
            {u: line for u, line in result.lines.items() if u in recorded},
            {
                c["metadata"]["uid"]: read.parse_time(c["metadata"]["creationTimestamp"])
                for c in fetched.claims
            },
            result.status.contracts,
        )

    def _announce_durable(self, fetched: PassRead, result: Reconciliation) -> set[str]:
        """Announce: Events for the decisions the envelope now records, the invalid claims,
        the gauges, and lines lost. Returns the claims whose Events wait for their own
        status write: a verdict kept off the ledger is durable only once its claim's status
        holds it, so no Event announces a decision that may be taken again differently."""
        envelope = fetched.envelope
        self._reported_refusals.pop((fetched.namespace, fetched.name), None)
        held_back = set(result.off_ledger)
        self._announce(
            fetched.namespace,
            workflow_class(envelope),
            fetched.by_uid,
            [e for e in result.events if e.uid not in held_back],
            envelope,
        )
        self._announce_invalid(fetched.facts.invalid)
        metrics.envelopes.record(
            fetched.namespace,
            fetched.name,
            snapshot(envelope, fetched.envelope_facts, fetched.claims, result),
        )
        if result.lost is not None:
            lost = result.lines[result.lost]
            self.record(
                envelope,
                "Warning",
                "ClaimLinesLost",
                "claims removed by hand while the operator was away held "
                f"{', '.join(f'{k} {v}' for k, v in sorted(lost.reserved.items()))}: "
                f"kept held as line {result.lost}; settle it by name with the "
                "reservoir.dev/force-settle-gone annotation once you know what ran",
            )
        if result.lost_children is not None:
            amount = result.lost_children_amount
            self.record(
                envelope,
                "Warning",
                "ChildLinesLost",
                "child envelopes removed by hand while the operator was away held "
                f"{', '.join(f'{k} {v}' for k, v in sorted(amount.items()))}: "
                f"kept held as line {result.lost_children}; settle it by name with the "
                "reservoir.dev/force-settle-gone annotation once you know what ran",
            )
        drop_departed(
            self._departed.get((fetched.namespace, fetched.name), {}),
            set(fetched.departed) - result.postponed,
            fetched.envelope["metadata"]["uid"],
        )
        return held_back

    async def _mirror_and_announce(
        self, fetched: PassRead, result: Reconciliation, held_back: set[str]
    ) -> None:
        """Mirror: each claim's status gets its line (and its queue position or verdict),
        then the Events that waited for it. Lines in flight its claims now show are
        retired by a pass soon (the status writes themselves wake no pass)."""
        problems = {fact.uid: fact.problem for _, fact in fetched.facts.invalid if fact.problem}
        mirrored, rewritten = await self._mirror(
            fetched.namespace, fetched.name, fetched.claims, result, fetched.now, problems
        )
        in_flight = set(result.status.entries)
        if rewritten & in_flight:
            retire = fetched.now + RETIRE_WITHIN  # one pass retires many at once
            result.look_again_by(retire)
        self._observe(fetched, result, rewritten - in_flight)  # claim-only moves, now durable
        durable = held_back & mirrored
        self._announce(
            fetched.namespace,
            workflow_class(fetched.envelope),
            fetched.by_uid,
            [e for e in result.events if e.uid in durable],
            fetched.envelope,
        )

    async def _hold_devices(self, fetched: PassRead, result: Reconciliation) -> None:
        """Devices: hold what the ledger says claims hold (a ResourceClaim and a placeholder
        pod each), let go of the rest, and lift a workload pod's gate (with or without
        devices) only once its claim's hand-off is recorded."""
        held = fetched.resource_claims or fetched.placeholders or result.device_holds
        if not (held or result.handed_off):
            return
        by_uid = fetched.by_uid
        known = dict(self.devices.problems)
        failed_deletes = self.devices.failed_deletes
        lifted = await self.devices.sync(
            by_uid,
            result.device_holds,
            fetched.resource_claims,
            fetched.placeholders,
            {
                uid: [
                    p
                    for p in fetched.pods.get(uid, [])
                    if p["metadata"].get("uid") == pod_uid
                    and not (uid in result.keep_gated and read.still_gated(p))
                ]
                for uid, pod_uid in result.handed_off.items()
                if uid in by_uid
            },
        )
        if not lifted:
            # A recorded hand-off's gate is still there: try again soon, not only on the
            # next claim event (issue 21 §3.5: the next pass was often the lease lapse).
            retry = fetched.now + GATE_RETRY
            result.look_again_by(retry)
        if self.devices.problems != known:
            # A hold refused (placement not allowed, a create refused) is the claim's
            # queue reason: the next pass writes it (nothing else may wake one).
            result.wake_at = fetched.now
        elif self.devices.problems or self.devices.failed_deletes != failed_deletes:
            # Refused holds and failed deletes are tried again by a later pass: a quota
            # freed elsewhere or an API server back is no news to this envelope.
            retry = fetched.now + timedelta(seconds=RETRY_REFUSED_SECONDS)
            result.look_again_by(retry)

    async def _decide(self, fetched: PassRead) -> Reconciliation:
        """The core's next ledger; a ledger it cannot compute is reported, never guessed."""
        try:
            return reconcile(
                fetched.envelope_facts,
                fetched.status,
                fetched.facts.facts,
                fetched.now,
                fetched.devices,
                fetched.departed,
                fetched.fresh,
                self._quiet.get((fetched.namespace, fetched.name)),
            )
        except (ClaimViewBehindError, EnvelopeBehindError):
            raise
        except InvariantViolationError as error:
            await self._refused(fetched.envelope, "InvariantViolation", str(error))
        except Exception as error:  # a bug in the core: report it, never loop on it blindly
            log.exception("reconciling %s/%s failed", fetched.namespace, fetched.name)
            await self._refused(
                fetched.envelope, "ReconcileFailed", f"{type(error).__name__}: {error}"
            )

    async def _confirm(
        self,
        namespace: str,
        wanted: Mapping[str, str],
        claims: list[Record],
        leases: dict[str, Record],
        lapsing: set[str],
    ) -> tuple[list[Record], dict[str, Record]]:
        """The claims `wanted` (UID -> name) read fresh, and the Leases of those `lapsing`:
        a claim that is not found (or is another claim now) is gone."""
        if not wanted:
            return claims, leases
        by_uid = {c["metadata"]["uid"]: c for c in claims}
        limit = self._fan_out.for_pass()

        async def read_fresh(uid: str, name: str) -> tuple[Any, Any]:
            async with limit:
                found = await self._read_over(namespace, name, uid, by_uid.get(uid))
                lease = None
                if uid in lapsing:
                    lease = await get_object(self.client, Lease, name, namespace)
                return found, lease

        answers = await asyncio.gather(*(read_fresh(u, n) for u, n in wanted.items()))
        leases = dict(leases)
        for (uid, name), (found, lease) in zip(wanted.items(), answers, strict=True):
            by_uid.pop(uid, None)
            if found is not None:
                by_uid[uid] = found
            if uid in lapsing:
                if lease is None:
                    leases.pop(name, None)
                else:
                    leases[name] = lease_record(lease)
        return list(by_uid.values()), leases

    async def _read_over(
        self, namespace: str, name: str, uid: str, old: Mapping[str, Any] | None
    ) -> Record | None:
        """The claim read fresh (its record), laid over the index's copy `old` (when there is
        one); None if it is gone or is another claim now (UIDs are never reused)."""
        read_now = await get_object(self.client, BranchClaim, name, namespace)
        if read_now is None or read_now["metadata"]["uid"] != uid:
            return None
        found = claim_record(read_now)
        if old is not None:
            self.source.written(old, found, own=False)
        return found

    async def consult(
        self,
        namespace: str,
        facts: list[ClaimFacts],
        status: ReservationEnvelopeStatus,
        policy: EnvelopePolicy,
    ) -> list[ClaimFacts]:
        """Claims' facts with their providers' answers and their duplicates, if any. The
        providers answer in their own time: the pass's slot is another pass's meanwhile
        (PassesInFlight.aside); the duplicates are looked for at the API server with it."""
        calls = [(f, self._provider_call(f, status, policy)) for f in facts]
        asked = [(f, call) for f, call in calls if call is not None]
        if asked:
            async with PassesInFlight.aside():
                answered = await gather_or_cancel(
                    *(self._consult_provider(namespace, f, policy, call) for f, call in asked)
                )
            by_uid = {f.uid: f for f in answered}
            facts = [by_uid.get(f.uid, f) for f in facts]
        return await gather_or_cancel(*(self._find_duplicate(namespace, f, status) for f in facts))

    def _provider_call(
        self, fact: ClaimFacts, status: ReservationEnvelopeStatus, policy: EnvelopePolicy
    ) -> ProviderCall | None:
        """What to ask a claim's provider, if anything: the cancel to forward (or None),
        the adapter, and whether to look its operation up."""
        entry = newest(status.entries.get(fact.uid), fact.line) or fact.settled_record
        if entry is None:
            return None
        how = cancel_to_forward(entry, fact.spec, policy)
        adapter = adapter_for(fact.spec, policy)
        lookup = needs_lookup(entry, fact.spec, policy) and (
            adapter is Adapter.OBJECT or lookup_due(entry, self.clock())
        )
        if how is None and not lookup:
            return None
        return how, adapter, lookup

    async def _consult_provider(
        self,
        namespace: str,
        fact: ClaimFacts,
        policy: EnvelopePolicy,
        call: ProviderCall,
    ) -> ClaimFacts:
        """A status lookup for a claim that needs one (Detached, cancel asked, submitted
        but unconfirmed): an object is read whenever asked (one GET), an HTTP provider only
        when its backoff says so. A cancel asked after the commit point is forwarded once."""
        how, adapter, lookup = call
        async with self._lookups.setdefault(namespace, asyncio.Semaphore(LOOKUPS_PER_NAMESPACE)):
            if how is not None:
                done, text = await self.providers.forward_cancel(
                    namespace, fact.spec, policy, how, fact.name, fact.uid
                )
                fact = replace(fact, cancel_forwarded=ForwardedCancel(how, done, text))
            if lookup:
                answer = await self.providers.look_up(namespace, fact.spec, policy)
                result = "failed" if answer.error else "answered"
                metrics.provider_lookups.labels(namespace, str(adapter), result).inc()
                fact = replace(fact, provider=answer)
        return fact

    async def _find_duplicate(
        self, namespace: str, fact: ClaimFacts, status: ReservationEnvelopeStatus
    ) -> ClaimFacts:
        """A waiting claim whose upstream.requestId an older claim of the namespace already
        has (any envelope) is a retried submission: it is rejected, the older one stands.
        The older one is the one admitted first, else the one created first (then by name):
        every envelope's writer picks the same."""
        request = fact.spec.upstream.request_id
        admitted = fact.uid in status.entries or fact.line is not None
        if request is None or admitted or fact.settled_record is not None:
            return fact
        rivals = []
        for body in await claims_with_request_id(self.client, namespace, request):
            admitted = (body.get("status") or {}).get("phase") not in (None, "Pending")
            meta = body["metadata"]
            rivals.append((not admitted, meta["creationTimestamp"], meta["name"], meta["uid"]))
        first = min(rivals, default=None)
        if first is None or first[3] == fact.uid:
            return fact
        return replace(fact, duplicate_of=first[2])

    def poke_parent(self, namespace: str, record: ParentRecord | None) -> None:
        """Wake the writer of the parent (envelope or pool) this envelope draws from."""
        if record is None or record.kind is ParentKind.ROOT:
            return
        if record.kind is ParentKind.POOL:
            self.poke_pool(record.name)
        else:
            self.poke(namespace, record.name)

    def _poke_tree(
        self,
        namespace: str,
        parent: ParentView | None,
        children: Mapping[str, Mapping[str, Any]],
        result: Reconciliation,
    ) -> None:
        if parent is not None and parent.kind is ParentKind.POOL:
            self.poke_pool(parent.name)
        elif parent is not None:
            self.poke(namespace, parent.name)
        names = {c["metadata"]["name"] for c in children.values()}
        names |= {line.envelope for line in result.status.children.values()}
        for child in names:
            self.poke(namespace, child)

    async def _still_current(self, namespace: str, name: str, envelope: dict[str, Any]) -> bool:
        now = await get_object(self.client, ReservationEnvelope, name, namespace)
        if now is None:
            return False
        return bool(now["metadata"]["resourceVersion"] == envelope["metadata"]["resourceVersion"])

    async def _refused(self, envelope: dict[str, Any], reason: str, message: str) -> NoReturn:
        """The ledger cannot move: say so on the envelope (condition, Event, metric) and
        stop this reconcile, instead of crashing or spinning on it."""
        meta = envelope["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        metrics.ledger_errors.labels(namespace, reason).inc()
        metrics.envelopes.unhealthy(namespace, name)
        key = (meta["uid"], int(meta.get("generation", 0)), reason, message)
        reported = self._reported_refusals.setdefault((namespace, name), set())
        if key not in reported:
            if len(reported) >= REFUSALS_KEPT:
                reported.clear()  # at worst a refusal is reported again
            reported.add(key)
            self.record(envelope, "Warning", reason, message)
            conditions = unhealthy(envelope, reason, message, self.clock())
            with contextlib.suppress(ApiError):
                await self.client.patch(
                    ReservationEnvelope.Status,
                    name,
                    {"status": {"conditions": [c.to_api() for c in conditions]}},
                    namespace=namespace,
                    patch_type=PatchType.MERGE,
                )
        raise LedgerStuckError(f"{namespace}/{name}: {reason}: {message}")

    async def _release_settled(
        self, namespace: str, claims: list[Record], result: Reconciliation
    ) -> None:
        """A claim being deleted goes once the ledger records its settlement: at once
        before the commit point, after the final report (or deadline) after it; and once
        its own status holds its last line (none in flight) and that line no longer counts
        (its devices are free): no line goes with the object. Its finalizer is removed
        with a JSON patch that tests it is still where it was read."""
        forget_older(self._released, time.monotonic() - RELEASED_KEEP_SECONDS)
        settled = []
        for claim in claims:
            meta = claim["metadata"]
            finalizers = meta.get("finalizers") or []
            if not meta.get("deletionTimestamp") or CLAIM_FINALIZER not in finalizers:
                continue
            entry = result.entry(meta["uid"])
            if entry is not None and not entry.phase.terminal:
                self._await_settlement(namespace, claim, entry)
                continue
            if entry is not None and (counts(entry) or meta["uid"] in result.status.entries):
                continue  # settled; its devices, or its status write, still to come
            self._awaiting.discard(meta["uid"])
            if meta["uid"] not in self._released:
                settled.append(claim)
        limit = self._fan_out.for_pass()

        async def release(claim: Record) -> None:
            async with limit:
                if await remove_finalizer(self.client, namespace, claim):
                    # Gone (or going) for good: the index may show it until its DELETED
                    # event arrives; no second patch meanwhile.
                    uid = claim["metadata"]["uid"]
                    self._released.pop(uid, None)  # kept in time order
                    self._released[uid] = time.monotonic()

        await asyncio.gather(*(release(claim) for claim in settled))

    def _await_settlement(
        self, namespace: str, claim: Mapping[str, Any], entry: LedgerEntry
    ) -> None:
        """Said once per claim: its deletion waits for its settlement."""
        uid = claim["metadata"]["uid"]
        if uid in self._awaiting:
            return
        self._awaiting.add(uid)
        metrics.finalizer_waits.labels(namespace, "BranchClaim").inc()
        self.record(
            claim,
            "Warning",
            "AwaitingSettlement",
            f"deletion waits for settlement (claim is {entry.phase.value}): report final "
            "usage, wait for the ambiguity deadline, or annotate reservoir.dev/force-settle",
        )

    async def _delete_expired(self, namespace: str, names: list[str]) -> None:
        """Settled claims past the envelope's settledClaimTTLSeconds."""
        for claim in names:
            try:
                await self.client.delete(BranchClaim, claim, namespace=namespace)
            except ApiError as error:
                if error.status.code != 404:
                    raise

    async def _workload_pods(
        self, namespace: str, claims: list[Record], has_devices: bool
    ) -> dict[str, list[Mapping[str, Any]]]:
        """Pods labelled for a claim (its UID, or its name), by claim UID, for claims whose
        commit point is a pod's binding or start, or that hand devices over. Listed only
        when some claim may. A label value shaped like a UID names a claim by UID only
        (`claim_of_label`): a claim named like another's UID, in this envelope or another,
        never takes that claim's pods."""
        if not has_devices and all(commit_point(c) == CommitPoint.DISPATCH for c in claims):
            return {}
        uids = {c["metadata"]["uid"] for c in claims}
        by_name = {c["metadata"]["name"]: c["metadata"]["uid"] for c in claims}
        pods: dict[str, list[Mapping[str, Any]]] = {}
        workloads: dict[str, Any] = {CLAIM_LABEL: None, PLACEHOLDER_LABEL: not_exists()}
        async for pod in self.client.list(Pod, namespace=namespace, labels=workloads):
            body = pod.to_dict()
            value = body["metadata"]["labels"][CLAIM_LABEL]
            uid = claim_of_label(value, uids, by_name)
            if uid is not None:
                pods.setdefault(uid, []).append(body)
        return pods

    def _announce_invalid(
        self, invalid: list[tuple[Record, ClaimFacts | read.InvalidClaim]]
    ) -> None:
        """One Event per unreadable spec version, not one per reconcile."""
        for claim, fact in invalid:
            version = claim["metadata"]["resourceVersion"]
            if self._reported_invalid.get(fact.uid) != version and fact.problem:
                self._reported_invalid[fact.uid] = version
                self.record(claim, "Warning", "InvalidSpec", fact.problem)

    def _announce(
        self,
        namespace: str,
        klass: str,
        claims: Mapping[str, Mapping[str, Any]],
        events: list[LedgerEvent],
        envelope: Mapping[str, Any],
    ) -> None:
        """Events and transition metrics for decisions that are durable: on the claim (or
        child envelope) they are about; a loan's on the envelope whose ledger moved."""
        metrics.count_events(namespace, klass, events)
        envelope_uid = envelope["metadata"]["uid"]
        for event in events:
            if not posts_event(event, self.transition_events):
                continue
            about_envelope = event.reason in LOAN_EVENTS or event.uid == envelope_uid
            target = envelope if about_envelope else claims.get(event.uid)
            if target is not None:
                self.record(
                    target, "Warning" if event.warning else "Normal", event.reason, event.message
                )

    async def _mirror(
        self,
        namespace: str,
        envelope: str,
        claims: list[Record],
        result: Reconciliation,
        now: datetime,
        problems: Mapping[str, str],
    ) -> tuple[set[str], set[str]]:
        """Write each claim's status from the ledger just read or written (its entry, its
        queue position, or a record kept off the ledger), if it moved. Conditional on the
        status read (`write_claim_status`); a conflict just waits for the next reconcile, since
        the mirror can always be recomputed. A refused write is reported, never raised.
        Returns the UIDs whose status now says what the ledger says, and of them those whose
        status this call wrote."""
        mirrored: set[str] = set()
        rewritten: set[str] = set()  # of them, those whose status this call wrote
        deferred = dict(self._deferred.get((namespace, envelope), {}))
        wake: datetime | None = None
        writes: list[tuple[Record, BranchClaimStatus]] = []
        told_before = self._told.get((namespace, envelope), {})
        told_now: dict[str, tuple[object, ...]] = {}
        for claim in claims:
            meta = claim["metadata"]
            uid = meta["uid"]
            entry = result.entry(uid)
            pending = result.pending.get(uid)
            replaced = result.replaced.get(uid)
            if entry is None and pending is None and replaced is None:
                continue  # settled and pruned (or quiet), or unreadable: leave its status alone
            deleting = bool(meta.get("deletionTimestamp"))
            # A claim whose status said all of it, unchanged since, and still told the same
            # (its place in the queue, or the line it holds, which this pass left as it
            # found it and not in flight): not parsed again. A queue of hundreds is told the
            # same every pass, and so are the live claims of an envelope each admission
            # wakes (parsing and comparing them all was a fifth of the operator's CPU with
            # 100 live claims an envelope, profiled). A line in flight is the envelope's
            # copy, which the claim may not show yet: always compared.
            told = (
                meta.get("resourceVersion"), pending, problems.get(uid),
                result.awaiting_devices.get(uid), result.envelope_uid, deleting,
            )  # fmt: skip
            if (
                replaced is None
                and told_before.get(uid) == told
                and (
                    entry is None
                    or (uid not in result.status.entries and entry == result.before.get(uid))
                )
            ):
                told_now[uid] = told
                mirrored.add(uid)
                continue
            # Parsed on each pass, not kept: about 25 µs a claim, where keeping the parsed
            # statuses cost about 10 KB a claim (measured: 525 → 424 MiB at 10,000 claims).
            previous = read.claim_status(claim)
            if replaced is not None and previous is not None:
                # Bound to an envelope of this name that was deleted: it says so, and
                # nothing else of its status changes (issue 21 #3).
                aside = set_aside(previous, replaced, meta.get("generation"), now)
                if aside != previous:
                    self.record(claim, "Warning", "EnvelopeReplaced", replaced)
                    writes.append((claim, aside))
                else:
                    mirrored.add(uid)
                continue
            if entry is None and pending is None:
                continue  # bound to a replaced envelope, its status unreadable: left alone
            due = None
            if entry is None and pending is not None and problems.get(uid) is None:
                created = read.parse_time(meta["creationTimestamp"])
                due = wait_told_at(pending, previous, created, self.queue_reason_after)
            if due is not None and now < due:
                wake = min(wake or due, due)  # its default status says Pending until then
                continue
            if deleting and previous is not None and previous.settlement is not None:
                continue  # settled and going: its status already says so
            wanted = claim_status(
                entry,
                pending,
                previous,
                meta.get("generation"),
                now,
                deleting=deleting,
                problem=problems.get(uid),
                awaiting_devices=result.awaiting_devices.get(uid),
                envelope_uid=result.envelope_uid or None,
            )
            if previous is not None and wanted == previous:
                mirrored.add(uid)
                told_now[uid] = told
                continue
            if previous is not None and only_usage_moved(previous, wanted):
                # Usage reported on the way: mirrored with the next move, or once it has
                # waited MIRROR_USAGE_WITHIN (a report then a final report: one write).
                due = deferred.setdefault(uid, now + MIRROR_USAGE_WITHIN)
                if now < due:
                    wake = min(wake or due, due)
                    continue
            deferred.pop(uid, None)
            writes.append((claim, wanted))
        if wake is not None:
            result.look_again_by(wake)
        self._told[(namespace, envelope)] = told_now
        here = {c["metadata"]["uid"] for c in claims}
        self._deferred[(namespace, envelope)] = {u: d for u, d in deferred.items() if u in here}
        limit = self._fan_out.for_pass()

        async def write(claim: Record, wanted: BranchClaimStatus) -> None:
            meta = claim["metadata"]
            try:
                async with limit:
                    written = await write_claim_status(self.client, namespace, claim, wanted)
                self.source.written(claim, claim_record(read.as_dict(written)))
                mirrored.add(meta["uid"])
                rewritten.add(meta["uid"])
            except ApiError as error:
                code = error.status.code or 0
                fresh = None
                if code in (404, 409, 422):
                    # Laid over the copy for the next pass (found by review: a lagging
                    # index made every pass fail the same write).
                    fresh = await self._read_over(namespace, meta["name"], meta["uid"], claim)
                if code in (404, 409) or (code == 422 and status_moved(claim, fresh)):
                    # The copy was stale (its status moved, or the claim went).
                    self.poke(namespace, claim["spec"].get("envelope", ""))
                elif 400 <= code < 500:
                    metrics.ledger_errors.labels(namespace, "MirrorRefused").inc()
                    self.record(claim, "Warning", "MirrorRefused", str(error.status.message))
                    refused.append(meta["uid"])
                else:
                    raise

        refused: list[str] = []
        await asyncio.gather(*(write(claim, wanted) for claim, wanted in writes))
        if refused:  # tried again by a later pass: no news may come to bring it sooner
            retry = now + timedelta(seconds=RETRY_REFUSED_SECONDS)
            result.look_again_by(retry)
        return mirrored, rewritten


def status_patch(claim: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A JSON patch of a claim's status that applies only if the claim is still the one
    read (its UID) and its status is still exactly the one read (a claim without one
    tests null, which the API server's JSON patch takes to match a missing member): a
    compare-and-swap on the status alone. It is not conditional on the resourceVersion, so
    the SDK's spec writes (a dispatch sent on the ledger's word, before the status says
    Tentative; usage; a final report) do not make it fail; a status moved by another
    writer (a deposed operator mid-pass) still does, so a settled status is never
    overwritten."""
    return [
        {"op": "test", "path": "/metadata/uid", "value": claim["metadata"]["uid"]},
        {"op": "test", "path": "/status", "value": claim.get("status")},
        {"op": "add", "path": "/status", "value": wanted},
    ]


async def write_claim_status(
    client: AsyncClient, namespace: str, claim: Mapping[str, Any], wanted: BranchClaimStatus
) -> Any:
    """Write a claim's status, conditional on the status read: with `status_patch`, unless
    the status read holds text the API server's JSON patch would compare unequal to itself
    (`reencoded_text`); then with a PUT conditional on the claim's resourceVersion."""
    meta = claim["metadata"]
    if reencoded_text(claim.get("status")):
        body = BranchClaim.Status(
            metadata=ObjectMeta(
                name=meta["name"], namespace=namespace, resourceVersion=meta["resourceVersion"]
            ),
            status=wanted.to_api(),
        )
        return await client.replace(body, meta["name"], namespace=namespace)
    return await client.patch(
        BranchClaim.Status,
        meta["name"],
        status_patch(claim, wanted.to_api()),
        namespace=namespace,
        patch_type=PatchType.JSON,
    )


# Characters the API server's JSON encoder escapes (\u003c, \u0026, ...) where a client
# sends them as they are. Its JSON patch `test` compares strings as encoded, so a status
# holding one never tests equal to itself (found by review: a provider's error "<queued>"
# in a condition message froze the claim's status for good).
_REENCODED = frozenset("<>&\u2028\u2029") | frozenset(chr(c) for c in range(0x20))


def reencoded_text(value: Any) -> bool:
    """Whether any string in `value` (keys included) holds a character in `_REENCODED`."""
    if isinstance(value, str):
        return not _REENCODED.isdisjoint(value)
    if isinstance(value, Mapping):
        return any(reencoded_text(k) or reencoded_text(v) for k, v in value.items())
    if isinstance(value, list):
        return any(reencoded_text(item) for item in value)
    return False


def status_moved(claim: Mapping[str, Any], fresh: Mapping[str, Any] | None) -> bool:
    """Whether the claim read fresh is gone, another claim, or shows another status than
    `claim`: why a status patch's tests failed (the API server answers 422, as for a
    refusal)."""
    return (
        fresh is None
        or fresh["metadata"]["uid"] != claim["metadata"]["uid"]
        or fresh.get("status") != claim.get("status")
    )


def ledger_moved(read: ReservationEnvelopeStatus, wanted: ReservationEnvelopeStatus) -> bool:
    """Whether the envelope's status must be written: anything moved but the claims' count
    by phase (a commit moves a claim from Tentative to Committed and nothing the envelope
    decides on: that is one write to the claim alone; the counts follow with the next
    write of the envelope)."""
    return wanted != read.model_copy(update={"counts": wanted.counts})


def only_usage_moved(previous: BranchClaimStatus, wanted: BranchClaimStatus) -> bool:
    """Whether the status to write differs from the one shown in its line's usage so far
    alone."""
    line, new = previous.ledger, wanted.ledger
    if line is None or new is None or line.usage == new.usage:
        return False
    return wanted == previous.model_copy(
        update={"ledger": line.model_copy(update={"usage": new.usage})}
    )


def workflow_class(envelope: Mapping[str, Any]) -> str:
    """The envelope's workflow class label, "" when it has none."""
    return str((envelope["metadata"].get("labels") or {}).get(WORKFLOW_CLASS_LABEL, ""))


def snapshot(
    envelope: Mapping[str, Any],
    facts: EnvelopeFacts,
    claims: list[Record],
    result: Reconciliation,
) -> metrics.EnvelopeSnapshot:
    """What the envelope's gauges show after this reconcile."""
    waiting = {
        c["metadata"]["uid"]: read.parse_time(c["metadata"]["deletionTimestamp"])
        for c in claims
        if c["metadata"].get("deletionTimestamp")
        and CLAIM_FINALIZER in (c["metadata"].get("finalizers") or [])
    }
    policy = facts.spec.policy
    return metrics.EnvelopeSnapshot(
        workflow_class=workflow_class(envelope),
        totals=result.status.totals,
        counts=result.status.counts,
        stranded=stranded(result.lines.values(), facts.spec.capacity, facts.accepting(result.now)),
        ambiguity_deadline_seconds=facts.spec.policy.ambiguity_deadline_seconds,
        oldest_finalizer=min(waiting.values(), default=None),
        devices=(
            device_occupancy(result.lines.values())
            if has_device_resources(facts.spec.capacity)
            else {}
        ),
        finalizer_due=min(
            (settlement_due(result.entry(uid), at, policy) for uid, at in waiting.items()),
            default=None,
        ),
        contracts=result.status.contracts,
        peak=result.status.peak,
        windows=result.status.windows,
        shortfall=result.short[1] if result.short is not None else {},
        open_claims=metrics.OpenClaim.of_pass(result.lines, result.now, result.postponed),
    )


async def remove_finalizer(client: AsyncClient, namespace: str, claim: Mapping[str, Any]) -> bool:
    """Remove the claim finalizer from a claim, if it is still where `claim` shows it (a
    JSON patch that tests it first): a claim changed meanwhile is left for the next pass.
    True if it is removed (or the claim is gone)."""
    meta = claim["metadata"]
    finalizers = list(meta.get("finalizers") or [])
    at = finalizers.index(CLAIM_FINALIZER)
    patch = [
        {"op": "test", "path": f"/metadata/finalizers/{at}", "value": CLAIM_FINALIZER},
        {"op": "remove", "path": f"/metadata/finalizers/{at}"},
    ]
    try:
        await client.patch(
            BranchClaim, meta["name"], patch, namespace=namespace, patch_type=PatchType.JSON
        )
    except ApiError as error:
        # Gone already, or its finalizers moved (the test failed): nothing to do now.
        if error.status.code not in (404, 409, 422):
            raise
        return error.status.code == 404
    return True
