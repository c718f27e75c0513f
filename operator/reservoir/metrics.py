"""Prometheus metrics, named like Kueue's: reservoir_<noun>_<unit>, with bounded labels.

Two kinds of label sets, so that cardinality stays bounded on a cluster that runs a new
workflow (a new envelope) every minute:
- per-envelope gauges (capacity by state, claims by phase, stranded capacity, health, the
  oldest waiting finalizer) are snapshots taken at each reconcile and dropped when the
  envelope is gone;
- counters and histograms are labelled by namespace and workflow class (the envelope's
  `reservoir.dev/workflow-class` label), never by envelope or claim.

Every label value a tenant chooses (namespace, envelope, workflow class, resource name) is
bounded, whatever tenants create: each counter and histogram keeps at most
`MAX_SERIES_PER_METRIC` label sets, and at most `MAX_SERIES_PER_NAMESPACE` of one
namespace (past that, its new ones count with `_other` for its other tenant-chosen
labels), and later ones count under `_other` for those labels;
the per-envelope gauges show at most `MAX_ENVELOPES` envelopes, at most
`MAX_ENVELOPES_PER_NAMESPACE` of one namespace (those seen first; one that goes frees its
place), and `MAX_RESOURCES_PER_ENVELOPE` resources of each, the rest
summed into `namespace="_other", envelope="_other"` and `resource="_other"` series
(their per-envelope-only gauges, such as the deadline and health, are left out).

Resources keep contracts (README "Resource contracts"), and the gauges say which: the
per-resource envelope gauges carry a `contract` label (Reusable, Consumable, Replenishing;
a fixed vocabulary, one value per resource, so it adds no label sets), and some exist only
for some contracts: what is in use now and the most ever in use at once (Reusable and
Replenishing), what a Replenishing resource has committed in its window. Occupancy, the
units a Reusable resource was held times the seconds (GPU-seconds, permit-seconds), is a
counter by class, counted at each claim's settlement. A `_other` resource has the contract
`_other`.

Open reservations are shown live, not only once settled (issue 25): what open claims hold
by phase, the oldest open reservation and the most pressing lease of each envelope, and a
gauge histogram of the ages of every open reservation by namespace and class (taken at
each scrape from the envelope's last snapshot, so it falls as claims settle: read it with
histogram_quantile directly, never with rate). Pools have their own gauges
(`PoolGauges`), at most `MAX_POOLS` pools and `MAX_NAMESPACES_PER_POOL` namespaces each.

Gauges are floats by Prometheus' definition; the ledger itself stays exact.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import (
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from reservoir import __version__, gc_tuning
from reservoir.core.compensation import APPLIED, RECORDED
from reservoir.core.contracts import in_use, type_of
from reservoir.core.lifecycle import LedgerEvent
from reservoir.core.model import (
    ClaimPhase,
    ContractType,
    LedgerEntry,
    NamespaceUsage,
    ProviderState,
    ResourceTotals,
    WindowSlice,
)
from reservoir.core.windows import in_window

OTHER = "_other"
ZERO = Decimal(0)
# Labels whose values tenants choose: bounded (see the module's docstring).
TENANT_LABELS = frozenset({"namespace", "envelope", "class", "resource"})
MAX_SERIES_PER_METRIC = 1000
MAX_SERIES_PER_NAMESPACE = 100
MAX_ENVELOPES = 500
MAX_ENVELOPES_PER_NAMESPACE = 100
MAX_RESOURCES_PER_ENVELOPE = 16


class _BoundedLabels:
    """A metric whose label sets stop growing at MAX_SERIES_PER_METRIC, and those of one
    namespace at MAX_SERIES_PER_NAMESPACE: past its share, a namespace's new label sets
    count with its other tenant-chosen labels as `_other` (one tenant cannot crowd the
    others out: found by review); past the metric's cap, with all of them as `_other`."""

    _labelnames: tuple[str, ...]

    def labels(self, *values: Any, **named: Any) -> Any:
        if named:
            values = tuple(named[name] for name in self._labelnames)
        key = tuple(str(v) for v in values)
        with _series_lock:
            seen = _series.setdefault(id(self), set())
            if key not in seen:
                namespace = dict(zip(self._labelnames, key, strict=True)).get("namespace")
                share = _shares.setdefault(id(self), {})
                if len(seen) >= MAX_SERIES_PER_METRIC:
                    key = self._other(key, keep=frozenset())
                elif namespace is not None and share.get(namespace, 0) >= MAX_SERIES_PER_NAMESPACE:
                    key = self._other(key, keep=frozenset({"namespace"}))
                if key not in seen:
                    seen.add(key)
                    if namespace is not None:
                        share[namespace] = share.get(namespace, 0) + 1
        return super().labels(*key)  # type: ignore[misc]

    def _other(self, key: tuple[str, ...], keep: frozenset[str]) -> tuple[str, ...]:
        return tuple(
            OTHER if name in TENANT_LABELS and name not in keep else value
            for name, value in zip(self._labelnames, key, strict=True)
        )


_series: dict[int, set[tuple[str, ...]]] = {}
_shares: dict[int, dict[str, int]] = {}  # metric -> namespace -> label sets it holds
_series_lock = threading.Lock()


class BoundedCounter(_BoundedLabels, Counter):
    pass


class BoundedHistogram(_BoundedLabels, Histogram):
    pass


ENVELOPE = ["namespace", "envelope"]
CLASS = ["namespace", "class"]
STATES = ("capacity", "reserved", "committed", "reconciling", "available")

build_info = Gauge("reservoir_build_info", "Always 1: the running operator's version.", ["version"])
build_info.labels(__version__).set(1)

transitions = BoundedCounter(
    "reservoir_claim_transitions_total",
    "Claim transitions and refusals, by reason (Reserved, CommitPointReached, Completed, "
    "LeaseExpired, LeaseLapsed, Overrun, LateReport, DispatchRefused, RenewalRefused, ...).",
    [*CLASS, "reason"],
)
admission_wait = BoundedHistogram(
    "reservoir_claim_admission_wait_seconds",
    "From a claim's creation to its capacity being reserved (queueing included).",
    CLASS,
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600),
)
commit_wait = BoundedHistogram(
    "reservoir_claim_commit_wait_seconds",
    "From a claim's reservation to its commit point (dispatch, pod bound or pod running).",
    CLASS,
    buckets=(0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600, 14400),
)
hold = BoundedHistogram(
    "reservoir_claim_hold_seconds",
    "From a claim's reservation to its settlement, for claims whose work ran (settled "
    "Consumed): how long the envelope held R for such a branch.",
    CLASS,
    buckets=(1, 5, 10, 30, 60, 300, 900, 1800, 3600, 14400, 86400),
)
consumed_ratio = BoundedHistogram(
    "reservoir_claim_consumed_ratio",
    "C/R per Consumable or Replenishing resource of claims settled Consumed: how much of a "
    "reservation was used. The basis of `kubectl reservoir recommend` for Consumable "
    "resources (a Reusable resource consumes nothing: see reservoir_envelope_peak_in_use).",
    [*CLASS, "resource"],
    buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
)
occupancy = BoundedCounter(
    "reservoir_claim_occupancy_seconds_total",
    "Occupancy of Reusable resources by settled claims: units held times seconds held "
    "(GPU-seconds, permit-seconds), counted when each claim settles. Its rate is the "
    "average number of units settled claims held.",
    [*CLASS, "resource"],
)
lease_renewals = BoundedCounter(
    "reservoir_lease_renewals_total",
    "Lease renewals asked for by a new heartbeat, by result (granted, refused).",
    [*CLASS, "result"],
)
lease_expiries = BoundedCounter(
    "reservoir_lease_expiries_total",
    "Leases that lapsed: a Tentative claim expired, or a committed one was Detached.",
    CLASS,
)
late_reports = BoundedCounter(
    "reservoir_claim_late_reports_total",
    "Usage reports that arrived after their claim settled (kept for audit, never applied).",
    CLASS,
)
overruns = BoundedCounter(
    "reservoir_claim_overruns_total",
    "Claims that reported usage above their reservation.",
    CLASS,
)
compensations = BoundedCounter(
    "reservoir_compensations_total",
    "Compensations of settled claims (reversals, voids, follow-up charges), by result: "
    "applied (moved the envelope's committed total once) or recorded (the envelope was "
    "not open, or nothing it asked could move).",
    [*CLASS, "result"],
)
ledger_writes = BoundedCounter(
    "reservoir_ledger_writes_total",
    "Compare-and-swap writes of envelope ledgers, by result "
    "(written, conflict (retried), unchanged, refused).",
    ["namespace", "result"],
)
reconcile_seconds = BoundedHistogram(
    "reservoir_ledger_reconcile_seconds",
    "Time to read, reconcile and write one envelope's ledger.",
    ["namespace"],
)
ledger_errors = BoundedCounter(
    "reservoir_ledger_errors_total",
    "Reconciles that could not move a ledger, by reason (UnreadableEnvelope, "
    "InvariantViolation, WriteRefused, ReconcileFailed, MirrorRefused).",
    ["namespace", "reason"],
)
provider_lookups = BoundedCounter(
    "reservoir_provider_lookups_total",
    "Status lookups of claims' upstream operations, by adapter (Object, HTTP) and result "
    "(answered, failed).",
    ["namespace", "adapter", "result"],
)
finalizer_waits = BoundedCounter(
    "reservoir_finalizer_waits_total",
    "Deletions held back because their settlement is not recorded yet.",
    ["namespace", "kind"],
)
watch_events = BoundedCounter(
    "reservoir_watch_events_total",
    "Objects the API server sent to the operator's watches (listed or changed), by resource "
    "(plural.group). Pods, Jobs, Leases and ResourceClaims are selected by label server-side: "
    "other tenants' objects are not sent at all.",
    ["resource"],
)
initial_states = BoundedCounter(
    "reservoir_watch_initial_states_total",
    "Initial states the operator's watches began with (at start, and again after a watch "
    "expired or failed), by resource (plural.group) and how they came: streamed (the API "
    "server sent every object on the watch itself) or listed (in pages, where the API "
    "server cannot stream them or a stream was cut short).",
    ["resource", "how"],
)
objects_set_aside = BoundedCounter(
    "reservoir_watch_objects_set_aside_total",
    "Objects the operator could not decode and set aside (each with an Undecodable Event), "
    "by kind.",
    ["kind"],
)

released = BoundedCounter(
    "reservoir_claim_released_total",
    "Amounts settled claims returned to their envelope (R - C), by resource and the reason "
    "they settled (Completed, Cancelled, Deleted, LeaseExpired, ...): what expired leases "
    "gave back is reason LeaseExpired. Counted once, by the write that records the "
    "settlement.",
    [*CLASS, "resource", "reason"],
)
# How much of its lease a claim had left when a renewal was granted (the expiry it had, minus
# the grant's time, both on the operator's clock). Chosen over the interval between
# renewals because it is what an operator acts on: a margin near 0 says the workers
# heartbeat too late for their lease (raise the lease, or heartbeat more often) before the
# leases start to lapse; the interval alone says nothing without the lease's length.
renewal_margin = BoundedHistogram(
    "reservoir_lease_renewal_margin_seconds",
    "Time a lease had left when a renewal was granted (its expiry before the grant minus "
    "the grant's time, operator clock): near 0, heartbeats come too late for the lease.",
    CLASS,
    buckets=(0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 900),
)
cancel_after_dispatch = BoundedHistogram(
    "reservoir_claim_cancel_after_dispatch_seconds",
    "From a claim's commit point (dispatch) to the cancel (or deletion), as recorded on the "
    "claim's ledger line; observed once, when both are recorded (a cancel recorded before "
    "the commit point counts as 0 s).",
    CLASS,
    buckets=(0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600, 14400),
)
cancel_confirmation = BoundedHistogram(
    "reservoir_claim_cancel_confirmation_seconds",
    "From a cancel asked after the commit point to the provider's confirmation (its answer "
    "Cancelled, recorded when the work ended or at the settlement), operator clock.",
    CLASS,
    buckets=(0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600),
)

EXPIRY_REASONS = frozenset({"LeaseExpired", "LeaseLapsed"})
COMPENSATION_RESULTS = {APPLIED: "applied", RECORDED: "recorded"}
# A snapshot older than this is not shown: the replica stopped reconciling the envelope
# (it was paused behind a peer, or the envelope went while it was not looking). An active
# replica's daemon wakes for every envelope at least every 30 s (and says its snapshot is
# still current when nothing moved).
STALE_AFTER_SECONDS = 90.0
# Distinct workflow classes labelled on counters and histograms; later ones count as
# "_other", so a class label set per run cannot grow the series without bound.
MAX_CLASSES = 100
OTHER_CLASS = "_other"
_classes: set[str] = set()
_classes_lock = threading.Lock()


def bounded_class(workflow_class: str) -> str:
    with _classes_lock:
        if workflow_class in _classes:
            return workflow_class
        if len(_classes) < MAX_CLASSES:
            _classes.add(workflow_class)
            return workflow_class
    return OTHER_CLASS


# Leases that can still lapse: a Detached claim's has lapsed already.
LEASED_PHASES = (ClaimPhase.TENTATIVE, ClaimPhase.COMMITTED, ClaimPhase.RUNNING)
# Buckets of the ages of open reservations (reservoir_claim_open_age_seconds).
OPEN_AGE_BUCKETS = (10, 30, 60, 300, 900, 1800, 3600, 7200, 14400, 43200, 86400, 259200)


@dataclass(frozen=True)
class OpenClaim:
    """What the live gauges need of one claim holding capacity: its ledger line's recorded
    times (operator clock) and what it holds."""

    phase: ClaimPhase
    reserved: Mapping[str, Decimal]
    reserved_at: datetime  # first_reserved_at: renewals never move it
    expires_at: datetime | None = None
    granted_at: datetime | None = None  # the last renewal, else the reservation
    # Tentative past its lease when the pass that wrote it looked: held on purpose (a
    # workload pod of it may still start), not a lapse the operator has yet to record.
    held_past_lease: bool = False

    @classmethod
    def of(
        cls, entries: Iterable[LedgerEntry], passed_at: datetime | None = None
    ) -> tuple[OpenClaim, ...]:
        """The claims of `entries` that hold capacity now, in a stable order; `passed_at`:
        when the pass that decided on them looked."""
        return tuple(
            cls(
                phase=e.phase,
                reserved=dict(e.reserved),
                reserved_at=e.first_reserved_at,
                expires_at=e.expires_at,
                granted_at=e.renewed_at or e.first_reserved_at,
                held_past_lease=e.phase is ClaimPhase.TENTATIVE
                and e.expires_at is not None
                and passed_at is not None
                and e.expires_at <= passed_at,
            )
            for e in entries
            if e.phase.holds_capacity and e.first_reserved_at is not None
        )

    @classmethod
    def of_pass(
        cls,
        lines: Mapping[str, LedgerEntry],
        passed_at: datetime,
        postponed: Collection[str] = (),
    ) -> tuple[OpenClaim, ...]:
        """The open claims after a pass at `passed_at`. The lines it `postponed` (past its
        moves' bound) were not decided on then: a lapse among them is one not recorded yet,
        not a claim held past its lease on purpose (found by review)."""
        decided = cls.of((e for uid, e in lines.items() if uid not in postponed), passed_at)
        return decided + cls.of(e for uid, e in lines.items() if uid in postponed)


@dataclass(frozen=True)
class EnvelopeSnapshot:
    """What one reconcile saw of an envelope, for its gauges."""

    workflow_class: str
    totals: ResourceTotals
    counts: Mapping[str, int]
    stranded: Mapping[str, Decimal]
    ambiguity_deadline_seconds: int
    oldest_finalizer: datetime | None = None
    finalizer_due: datetime | None = None  # when the earliest waiting deletion is due
    devices: Mapping[str, int] = field(default_factory=dict)  # state -> device count
    contracts: Mapping[str, ContractType] = field(default_factory=dict)  # status.contracts
    peak: Mapping[str, Decimal] = field(default_factory=dict)  # status.peak
    windows: Mapping[str, Sequence[WindowSlice]] = field(default_factory=dict)  # status.windows
    # What the claim at the head of the queue is short of, per resource (the queue waits).
    shortfall: Mapping[str, Decimal] = field(default_factory=dict)
    # The claims holding capacity, for the live gauges (what they hold by phase, their ages
    # and leases).
    open_claims: Sequence[OpenClaim] = ()

    def held_by_phase(self) -> dict[str, dict[str, Decimal]]:
        """What open claims reserve, per holding phase and resource (exact)."""
        held: dict[str, dict[str, Decimal]] = {}
        for claim in self.open_claims:
            amounts = held.setdefault(claim.phase.value, {})
            for resource, amount in claim.reserved.items():
                amounts[resource] = amounts.get(resource, ZERO) + amount
        return held

    def oldest_reservation(self) -> datetime | None:
        return min((c.reserved_at for c in self.open_claims), default=None)

    def leases(self) -> list[OpenClaim]:
        """The open claims whose lease can still lapse (not one held past it on purpose:
        its lease says nothing more, and it hid the healthy claims' least time left)."""
        return [
            c
            for c in self.open_claims
            if c.phase in LEASED_PHASES and c.expires_at and not c.held_past_lease
        ]

    def contract(self, resource: str) -> str:
        """The resource's contract as a label value (`_other` for the summed rest)."""
        if resource == OTHER:
            return OTHER
        return type_of(resource, self.contracts).value

    def window_committed(self) -> dict[str, Decimal]:
        """Replenishing resources: committed in the window, the sum of its slices."""
        return in_window(self.windows)

    def in_use(self) -> dict[str, Decimal]:
        """Reusable and Replenishing resources: the figure the peak records (so it never
        shows above the peak)."""
        return in_use(self.totals, self.contracts)


@dataclass(eq=False)  # registries key collectors by identity
class EnvelopeGauges(Collector):
    """Per-envelope gauges built from the latest snapshot of each envelope, so that an
    envelope's series disappear with it instead of lingering at their last value."""

    _snapshots: dict[tuple[str, str], EnvelopeSnapshot] = field(default_factory=dict)
    _healthy: dict[tuple[str, str], bool] = field(default_factory=dict)
    _seen: dict[tuple[str, str], float] = field(default_factory=dict)  # monotonic
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # The envelopes shown by name, in the order first seen; the others are summed.
    _shown: dict[tuple[str, str], None] = field(default_factory=dict)
    stale_after: float = STALE_AFTER_SECONDS
    max_envelopes: int = MAX_ENVELOPES
    # One tenant's envelopes take at most this many of the places: 500 envelopes of one
    # namespace hid every other tenant's (and their age alert could not fire: review).
    max_per_namespace: int = MAX_ENVELOPES_PER_NAMESPACE

    def record(self, namespace: str, envelope: str, snapshot: EnvelopeSnapshot) -> None:
        with self._lock:
            key = (namespace, envelope)
            if (
                key not in self._shown
                and len(self._shown) < self.max_envelopes
                and sum(ns == namespace for ns, _ in self._shown) < self.max_per_namespace
            ):
                self._shown[key] = None
            self._snapshots[(namespace, envelope)] = snapshot
            self._healthy[(namespace, envelope)] = True
            self._seen[(namespace, envelope)] = time.monotonic()

    def still_current(self, namespace: str, envelope: str) -> None:
        """The envelope's daemon is alive and nothing moved since its last snapshot."""
        with self._lock:
            if (namespace, envelope) in self._seen:
                self._seen[(namespace, envelope)] = time.monotonic()

    def unhealthy(self, namespace: str, envelope: str) -> None:
        with self._lock:
            self._healthy[(namespace, envelope)] = False
            self._seen[(namespace, envelope)] = time.monotonic()

    def forget(self, namespace: str, envelope: str) -> None:
        with self._lock:
            self._snapshots.pop((namespace, envelope), None)
            self._healthy.pop((namespace, envelope), None)
            self._seen.pop((namespace, envelope), None)
            self._shown.pop((namespace, envelope), None)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            cutoff = time.monotonic() - self.stale_after
            fresh = {key for key, seen in self._seen.items() if seen >= cutoff}
            snapshots = {k: v for k, v in self._snapshots.items() if k in fresh}
            healthy = {k: v for k, v in self._healthy.items() if k in fresh}
        capacity = GaugeMetricFamily(
            "reservoir_envelope_capacity",
            "Capacity of the envelope by resource and ledger state "
            "(capacity, reserved, committed, reconciling, available), and the resource's "
            "contract (Reusable, Consumable, Replenishing).",
            labels=[*ENVELOPE, "resource", "state", "contract"],
        )
        in_use = GaugeMetricFamily(
            "reservoir_envelope_in_use",
            "Reusable and Replenishing resources of the envelope in use now: held by claims "
            "and child envelopes, lent to siblings, and (Replenishing) committed in the "
            "window. At capacity, claims wait: for claims to end (Reusable) or for the "
            "window (Replenishing).",
            labels=[*ENVELOPE, "resource", "contract"],
        )
        peak = GaugeMetricFamily(
            "reservoir_envelope_peak_in_use",
            "Reusable and Replenishing resources: the most of each the envelope ever had in "
            "use at once (Replenishing: within one window), against its capacity for "
            "right-sizing.",
            labels=[*ENVELOPE, "resource", "contract"],
        )
        window = GaugeMetricFamily(
            "reservoir_envelope_window_committed",
            "Replenishing resources: what the envelope's claims consumed that is still in "
            "its window; it returns to available as the window passes.",
            labels=[*ENVELOPE, "resource"],
        )
        shortfall = GaugeMetricFamily(
            "reservoir_envelope_shortfall",
            "What the claim at the head of the envelope's queue is short of, per resource: "
            "above 0 while claims wait for that resource.",
            labels=[*ENVELOPE, "resource", "contract"],
        )
        claims = GaugeMetricFamily(
            "reservoir_envelope_claims",
            "Claims of the envelope by phase.",
            labels=[*ENVELOPE, "phase"],
        )
        stranded = GaugeMetricFamily(
            "reservoir_envelope_stranded",
            "Capacity held by claims nobody drives: Detached claims, and every holding claim "
            "once the envelope stops admitting work.",
            labels=[*ENVELOPE, "resource"],
        )
        info = GaugeMetricFamily(
            "reservoir_envelope_info",
            "Always 1: the envelope's workflow class, for joins.",
            labels=[*ENVELOPE, "class"],
        )
        deadline = GaugeMetricFamily(
            "reservoir_envelope_ambiguity_deadline_seconds",
            "The envelope's ambiguity deadline: how long an unknown outcome may be held.",
            labels=ENVELOPE,
        )
        oldest = GaugeMetricFamily(
            "reservoir_envelope_oldest_finalizer_timestamp_seconds",
            "When the oldest deletion of one of the envelope's claims that still waits for "
            "its settlement was asked (Unix time); absent when none waits.",
            labels=ENVELOPE,
        )
        due = GaugeMetricFamily(
            "reservoir_envelope_finalizer_due_timestamp_seconds",
            "When the earliest waiting claim deletion of the envelope is due to settle (Unix "
            "time): at once before the commit point, else at the ambiguity deadline after "
            "its lease ends or it detaches. Absent when none waits.",
            labels=ENVELOPE,
        )
        devices = GaugeMetricFamily(
            "reservoir_envelope_devices",
            "Devices (GPUs) of the envelope's claims by state: held (by claims holding "
            "capacity) and settled_occupied (settled, but the allocation is not gone yet: "
            "its pods still use them).",
            labels=[*ENVELOPE, "state"],
        )
        health = GaugeMetricFamily(
            "reservoir_envelope_ledger_healthy",
            "1 when the envelope's last reconcile wrote or confirmed its ledger, 0 when the "
            "ledger could not move (see the LedgerHealthy condition).",
            labels=ENVELOPE,
        )
        held = GaugeMetricFamily(
            "reservoir_envelope_claims_reserved",
            "What the envelope's open claims reserve, by resource and claim phase: Tentative "
            "(before the commit point), Committed and Running (past it), Detached "
            "(reconciling: outcome unknown).",
            labels=[*ENVELOPE, "resource", "phase", "contract"],
        )
        oldest_reservation = GaugeMetricFamily(
            "reservoir_envelope_oldest_reservation_timestamp_seconds",
            "When the oldest claim of the envelope still holding capacity first reserved it "
            "(Unix time, operator clock); absent when none holds any.",
            labels=ENVELOPE,
        )
        lease_remaining = GaugeMetricFamily(
            "reservoir_envelope_lease_remaining_seconds",
            "The least time left on the lease of any open claim of the envelope (Tentative, "
            "Committed or Running) at the scrape, operator clock: below 0, a lapse the "
            "operator has not recorded yet (a Tentative claim it holds past its lease on "
            "purpose, its workload pod may still start, is left out). Absent when no lease "
            "is open.",
            labels=ENVELOPE,
        )
        lease_age = GaugeMetricFamily(
            "reservoir_envelope_lease_age_seconds",
            "The longest time since a lease of an open claim of the envelope was granted or "
            "last renewed, at the scrape (operator clock). Absent when no lease is open.",
            labels=ENVELOPE,
        )
        open_age = GaugeHistogramMetricFamily(
            "reservoir_claim_open_age_seconds",
            "Ages of the reservations open now (claims holding capacity, since they first "
            "reserved it), by namespace and workflow class, at the scrape. A gauge "
            "histogram: it falls as claims settle; use histogram_quantile on it directly.",
            labels=CLASS,
        )
        ages: dict[tuple[str, str], list[float]] = {}
        now = datetime.now(UTC)
        # Past MAX_ENVELOPES, the sums of the others (see the module's docstring).
        others: dict[tuple[str, ...], float] = {}

        def add(family: GaugeMetricFamily, labels: list[str], value: float, shown: bool) -> None:
            if shown:
                family.add_metric(labels, value)
            else:
                key = (family.name, OTHER, OTHER, *labels[2:])
                others[key] = others.get(key, 0.0) + value

        for (namespace, envelope), snap in sorted(snapshots.items()):
            key = [namespace, envelope]
            shown = (namespace, envelope) in self._shown
            for state in STATES:
                for resource, amount in _bounded_resources(getattr(snap.totals, state)):
                    labels = [*key, resource, state, snap.contract(resource)]
                    add(capacity, labels, float(amount), shown)
            for family, amounts in (
                (in_use, snap.in_use()),
                (peak, snap.peak),
                (shortfall, snap.shortfall),
            ):
                for resource, amount in _bounded_resources(amounts):
                    add(family, [*key, resource, snap.contract(resource)], float(amount), shown)
            for resource, amount in _bounded_resources(snap.window_committed()):
                add(window, [*key, resource], float(amount), shown)
            for phase in ClaimPhase:
                add(claims, [*key, phase.value], snap.counts.get(phase.value, 0), shown)
            for resource, amount in _bounded_resources(snap.stranded):
                add(stranded, [*key, resource], float(amount), shown)
            for state, count in snap.devices.items():
                add(devices, [*key, state], count, shown)
            for held_phase, amounts in sorted(snap.held_by_phase().items()):
                for resource, amount in _bounded_resources(amounts):
                    labels = [*key, resource, held_phase, snap.contract(resource)]
                    add(held, labels, float(amount), shown)
            if snap.open_claims:
                # Only an envelope with open claims takes a class's place (an idle one
                # taking places at every scrape crowded other tenants' classes out: review).
                group = (namespace, bounded_class(snap.workflow_class)) if shown else (OTHER, OTHER)
                ages.setdefault(group, []).extend(
                    _seconds(c.reserved_at, now) for c in snap.open_claims
                )
            if not shown:
                continue
            reserved_at = snap.oldest_reservation()
            if reserved_at is not None:
                oldest_reservation.add_metric(key, reserved_at.timestamp())
            leases = snap.leases()
            if leases:
                remaining = min(c.expires_at for c in leases if c.expires_at is not None)
                lease_remaining.add_metric(key, (remaining - now).total_seconds())
                granted = min(c.granted_at or c.reserved_at for c in leases)
                lease_age.add_metric(key, _seconds(granted, now))
            info.add_metric([*key, snap.workflow_class], 1)
            deadline.add_metric(key, snap.ambiguity_deadline_seconds)
            if snap.oldest_finalizer is not None:
                oldest.add_metric(key, snap.oldest_finalizer.timestamp())
            if snap.finalizer_due is not None:
                due.add_metric(key, snap.finalizer_due.timestamp())
        families = {
            f.name: f
            for f in (capacity, claims, stranded, devices, in_use, peak, window, shortfall, held)
        }
        for (name, *labels), value in sorted(others.items()):
            families[name].add_metric(labels, value)
        for (namespace, envelope), ok in sorted(healthy.items()):
            if (namespace, envelope) in self._shown:
                health.add_metric([namespace, envelope], 1 if ok else 0)
        yield from (capacity, claims, stranded, info, deadline, oldest, due, devices, health)
        yield from (in_use, peak, window, shortfall)
        for group, seen in sorted(ages.items()):
            if seen:
                open_age.add_metric(list(group), **_gauge_buckets(seen, OPEN_AGE_BUCKETS))
        yield from (held, oldest_reservation, lease_remaining, lease_age, open_age)


def _gauge_buckets(values: Sequence[float], bounds: Sequence[float]) -> dict[str, Any]:
    """A gauge histogram's cumulative buckets and sum of `values`."""
    buckets = [(str(float(b)), float(sum(1 for v in values if v <= b))) for b in bounds]
    buckets.append(("+Inf", float(len(values))))
    return {"buckets": buckets, "gsum_value": float(sum(values))}


def _bounded_resources(amounts: Mapping[str, Decimal]) -> list[tuple[str, Decimal]]:
    """The first MAX_RESOURCES_PER_ENVELOPE resources by name; the rest summed as _other."""
    ordered = sorted(amounts.items())
    if len(ordered) <= MAX_RESOURCES_PER_ENVELOPE:
        return ordered
    kept = ordered[: MAX_RESOURCES_PER_ENVELOPE - 1]
    rest = sum((amount for _, amount in ordered[MAX_RESOURCES_PER_ENVELOPE - 1 :]), Decimal(0))
    return [*kept, (OTHER, rest)]


envelopes = EnvelopeGauges()
REGISTRY.register(envelopes)


MAX_POOLS = 100
MAX_NAMESPACES_PER_POOL = 100
POOL_STATES = ("capacity", "reserved", "committed", "available")


@dataclass(frozen=True)
class PoolSnapshot:
    """What one write of a pool recorded, for its gauges: its totals, and per namespace its
    envelopes admitted (a Reserved line here) and waiting, and its weighted dominant share
    (the pool's `status.shares`)."""

    totals: ResourceTotals
    reserved: Mapping[str, int] = field(default_factory=dict)  # namespace -> envelopes
    pending: Mapping[str, int] = field(default_factory=dict)  # namespace -> envelopes
    share: Mapping[str, Decimal] = field(default_factory=dict)  # namespace -> weighted share
    preemptions: int = 0  # requests that envelopes give their room, not yet decided

    @classmethod
    def of(
        cls, totals: ResourceTotals, shares: Mapping[str, NamespaceUsage], preemptions: int = 0
    ) -> PoolSnapshot:
        return cls(
            totals=totals,
            reserved={ns: u.open for ns, u in shares.items() if u.open},
            pending={ns: u.waiting for ns, u in shares.items() if u.waiting},
            share={ns: Decimal(u.share) for ns, u in shares.items()},
            preemptions=preemptions,
        )


@dataclass(eq=False)  # registries key collectors by identity
class PoolGauges(Collector):
    """Per-pool gauges from each pool's latest snapshot (pools are cluster-scoped and an
    administrator's, but bounded all the same: MAX_POOLS pools, the rest summed as
    `_other`; MAX_NAMESPACES_PER_POOL namespaces of each, the rest as `_other`). Stale
    snapshots are dropped as the envelopes' are (a pool's daemon wakes every 30 s)."""

    _snapshots: dict[str, PoolSnapshot] = field(default_factory=dict)
    _seen: dict[str, float] = field(default_factory=dict)  # monotonic
    _shown: dict[str, None] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    stale_after: float = STALE_AFTER_SECONDS
    max_pools: int = MAX_POOLS

    def record(self, pool: str, snapshot: PoolSnapshot) -> None:
        with self._lock:
            if pool not in self._shown and len(self._shown) < self.max_pools:
                self._shown[pool] = None
            self._snapshots[pool] = snapshot
            self._seen[pool] = time.monotonic()

    def forget(self, pool: str) -> None:
        with self._lock:
            self._snapshots.pop(pool, None)
            self._seen.pop(pool, None)
            self._shown.pop(pool, None)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            cutoff = time.monotonic() - self.stale_after
            for pool in [k for k in self._snapshots if self._seen.get(k, 0) < cutoff]:
                # Not written to for a while (gone, or another replica's now): its place goes.
                self._snapshots.pop(pool, None)
                self._seen.pop(pool, None)
                self._shown.pop(pool, None)
            snapshots = dict(self._snapshots)
            shown = set(self._shown)
        capacity = GaugeMetricFamily(
            "reservoir_pool_capacity",
            "Capacity of the pool by resource and ledger state (capacity; reserved: held "
            "by open envelopes; committed: what closed ones used; available).",
            labels=["pool", "resource", "state"],
        )
        envelopes = GaugeMetricFamily(
            "reservoir_pool_envelopes",
            "Root envelopes drawing on the pool by namespace and state: reserved (admitted, "
            "holding their capacity here) or pending (waiting for admission).",
            labels=["pool", "namespace", "state"],
        )
        share = GaugeMetricFamily(
            "reservoir_pool_namespace_share",
            "A namespace's weighted dominant share of the pool (the largest fraction of any "
            "one resource its open envelopes hold, divided by its weight): the pool admits "
            "the lowest first, so under saturation the namespaces' shares level out.",
            labels=["pool", "namespace"],
        )
        preemptions = GaugeMetricFamily(
            "reservoir_pool_preemption_requests",
            "Envelopes the pool asked to give their room to a higher class's waiting envelope "
            "and that have not decided yet (each decides on its own claims: Preempted or "
            "Refused). Lingering requests: the victims' passes are not running.",
            labels=["pool"],
        )
        sums: dict[tuple[str, ...], float] = {}
        for pool, snap in sorted(snapshots.items()):
            name = pool if pool in shown else OTHER
            asked = (preemptions.name, name)
            sums[asked] = sums.get(asked, 0.0) + snap.preemptions
            for state in POOL_STATES:
                for resource, amount in _bounded_resources(getattr(snap.totals, state)):
                    key = (capacity.name, name, resource, state)
                    sums[key] = sums.get(key, 0.0) + float(amount)
            for state, counts in (("reserved", snap.reserved), ("pending", snap.pending)):
                for namespace, count in _bounded_namespaces(counts):
                    key = (envelopes.name, name, namespace, state)
                    sums[key] = sums.get(key, 0.0) + count
            if name != OTHER:  # a share is not summed across pools
                for namespace, weighted in sorted(snap.share.items()):
                    sums[(share.name, name, namespace)] = float(weighted)
        families = {f.name: f for f in (capacity, envelopes, share, preemptions)}
        for (family, *labels), value in sorted(sums.items()):
            families[family].add_metric(labels, value)
        yield capacity
        yield envelopes
        yield share
        yield preemptions


def _bounded_namespaces(counts: Mapping[str, int]) -> list[tuple[str, int]]:
    """The first MAX_NAMESPACES_PER_POOL namespaces by name; the rest summed as _other."""
    ordered = sorted(counts.items())
    if len(ordered) <= MAX_NAMESPACES_PER_POOL:
        return ordered
    kept = ordered[: MAX_NAMESPACES_PER_POOL - 1]
    return [*kept, (OTHER, sum(count for _, count in ordered[MAX_NAMESPACES_PER_POOL - 1 :]))]


pools = PoolGauges()
REGISTRY.register(pools)


class GcPauses(Collector):
    """reservoir_gc_pause_seconds: the garbage collector's pauses, by generation, as the
    collector's hook counted them (`gc_tuning`). The hook takes no lock: a collection can
    start inside any allocation, one made while a metric's lock is held included, and a hook
    that took that lock would wait on itself (as prometheus_client's own GC collector once
    did). Each generation's counts are copied at once (one list), so its buckets and count
    agree."""

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            "reservoir_gc_pause_seconds",
            "Pauses of Python's cyclic garbage collector (the whole operator stops), by "
            "generation collected (2: a full collection).",
            labels=["generation"],
        )
        bounds = [str(b) for b in gc_tuning.PAUSE_BUCKETS] + ["+Inf"]
        for generation, counts in sorted(gc_tuning.pause_counts.items()):
            family.add_metric(
                [str(generation)],
                buckets=list(zip(bounds, list(counts), strict=True)),
                sum_value=gc_tuning.pause_seconds[generation],
            )
        yield family


gc_pauses = GcPauses()
REGISTRY.register(gc_pauses)


def count_events(namespace: str, workflow_class: str, events: Iterable[LedgerEvent]) -> None:
    workflow_class = bounded_class(workflow_class)
    for event in events:
        transitions.labels(namespace, workflow_class, event.reason).inc()
        if event.reason in EXPIRY_REASONS and event.phase is not None:
            lease_expiries.labels(namespace, workflow_class).inc()
        elif event.reason == "RenewalRefused":
            lease_renewals.labels(namespace, workflow_class, "refused").inc()
        elif event.reason == "LateReport":
            late_reports.labels(namespace, workflow_class).inc()
        elif event.reason == "Overrun":
            overruns.labels(namespace, workflow_class).inc()
        elif event.reason in COMPENSATION_RESULTS:
            result = COMPENSATION_RESULTS[event.reason]
            compensations.labels(namespace, workflow_class, result).inc()


def observe_written(
    namespace: str,
    workflow_class: str,
    before: Mapping[str, LedgerEntry],
    after: Mapping[str, LedgerEntry],
    created: Mapping[str, datetime],
    contracts: Mapping[str, ContractType] | None = None,
) -> None:
    """Latencies, renewals, C/R and occupancy of what a ledger write just made durable: each
    moment (reserved, committed, settled) is observed by the one write that first records
    it. `contracts` are the envelope's (status.contracts; a resource it does not name: the
    default by name): C/R is observed for Consumable and Replenishing resources only, since
    a Reusable one consumes nothing, and occupancy for Reusable ones."""
    contracts = contracts or {}
    labels = (namespace, bounded_class(workflow_class))
    for uid, entry in after.items():
        old = before.get(uid)
        reserved_at = entry.first_reserved_at
        if reserved_at is None:
            continue  # still queued: nothing to observe yet
        if _newly(old, entry, "first_reserved_at") and uid in created:
            admission_wait.labels(*labels).observe(_seconds(created[uid], reserved_at))
        if entry.committed_at is not None and _newly(old, entry, "committed_at"):
            commit_wait.labels(*labels).observe(_seconds(reserved_at, entry.committed_at))
        granted = entry.renewals - (old.renewals if old is not None else 0)
        if granted > 0:
            lease_renewals.labels(*labels, "granted").inc(granted)
            margin = _renewal_margin(old, entry)
            if margin is not None:
                renewal_margin.labels(*labels).observe(margin)
        cancelled_at = entry.cancel_requested_at
        dispatched_at = entry.committed_at
        if (
            cancelled_at is not None
            and dispatched_at is not None
            and (_newly(old, entry, "cancel_requested_at") or _newly(old, entry, "committed_at"))
        ):
            # Once, by the write that records the second of the two (a cancel recorded while
            # a pod could still start, then the commit, was never observed: review): a
            # cancel before the commit point counts as 0 s after it.
            cancel_after_dispatch.labels(*labels).observe(_seconds(dispatched_at, cancelled_at))
        # Occupancy is recorded once per resource (at settlement, or when the devices are
        # confirmed free): counted by the write that first records it.
        counted = old.occupancy if old is not None else {}
        for resource, amount in entry.occupancy.items():
            reusable = type_of(resource, contracts) is ContractType.REUSABLE
            if amount > 0 and reusable and resource not in counted:
                occupancy.labels(*labels, resource).inc(float(amount))
        settled = entry.settlement
        if settled is None or not _newly(old, entry, "settlement"):
            continue
        if settled.phase is ClaimPhase.CONSUMED:
            # Branches that ran: a class's quick cancels and expiries would pull its p99 down
            # and make the age alert fire on every healthy long reservation (review).
            hold.labels(*labels).observe(_seconds(reserved_at, settled.at))
        for resource, amount in entry.released.items():
            if amount > 0:
                released.labels(*labels, resource, settled.reason).inc(float(amount))
        confirmed = _cancel_confirmed_at(entry)
        after_commit = (
            cancelled_at is not None and dispatched_at is not None and cancelled_at >= dispatched_at
        )
        if after_commit and cancelled_at is not None and confirmed is not None:
            cancel_confirmation.labels(*labels).observe(_seconds(cancelled_at, confirmed))
        if settled.phase is ClaimPhase.CONSUMED:
            for resource, reserved in entry.reserved.items():
                if reserved > 0 and type_of(resource, contracts) is not ContractType.REUSABLE:
                    ratio = entry.consumed.get(resource, Decimal(0)) / reserved
                    consumed_ratio.labels(*labels, resource).observe(float(ratio))


def _renewal_margin(old: LedgerEntry | None, entry: LedgerEntry) -> float | None:
    """What the lease had left when this write's renewal was granted: the expiry the line
    had before minus the grant's time (both recorded, operator clock); None when either is
    not recorded. Below 0 (a renewal granted past the expiry) counts as 0. Renewals that
    one write records together (coalesced) are observed once, for the last of them."""
    if old is None or old.expires_at is None or entry.renewed_at is None:
        return None
    return _seconds(entry.renewed_at, old.expires_at)


def _cancel_confirmed_at(entry: LedgerEntry) -> datetime | None:
    """When the provider confirmed a cancel: its answer Cancelled, recorded when the work
    ended (its usage still unknown) or else at the settlement it brought. None when the
    provider did not answer Cancelled (a worker's final report confirms nothing upstream)."""
    provider, settled = entry.provider, entry.settlement
    if provider is None or provider.state is not ProviderState.CANCELLED or settled is None:
        return None
    return entry.work_ended_at or settled.at


def _newly(old: LedgerEntry | None, entry: LedgerEntry, attribute: str) -> bool:
    """Set in the new entry and not in the one the ledger held before."""
    return getattr(entry, attribute) is not None and (
        old is None or getattr(old, attribute) is None
    )


def _seconds(start: datetime, end: datetime) -> float:
    return max((end - start).total_seconds(), 0.0)
