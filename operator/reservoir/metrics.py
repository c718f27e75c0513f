"""Prometheus metrics. Names follow Kueue's style: reservoir_<noun>_<unit>, with the
envelope, namespace and resource as labels so exposure and settlement quality show per
workflow."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram

from reservoir.core.lifecycle import LedgerEvent
from reservoir.core.model import ReservationEnvelopeStatus

ENVELOPE = ["namespace", "envelope"]

capacity = Gauge(
    "reservoir_envelope_capacity",
    "Capacity of the envelope, by resource and ledger state "
    "(capacity, reserved, committed, reconciling, available).",
    [*ENVELOPE, "resource", "state"],
)
claims = Gauge(
    "reservoir_envelope_claims",
    "Claims of the envelope by phase.",
    [*ENVELOPE, "phase"],
)
transitions = Counter(
    "reservoir_claim_transitions_total",
    "Claim transitions and refusals, by reason (Reserved, LeaseExpired, Completed, "
    "Overrun, LateReport, DispatchRefused, RenewalRefused, ...).",
    [*ENVELOPE, "reason"],
)
ledger_writes = Counter(
    "reservoir_ledger_writes_total",
    "Compare-and-swap writes of envelope ledgers, by result "
    "(written, conflict, unchanged, refused).",
    ["namespace", "result"],
)
reconcile_seconds = Histogram(
    "reservoir_ledger_reconcile_seconds",
    "Time to read, reconcile and write one envelope's ledger.",
    ["namespace"],
)
ledger_errors = Counter(
    "reservoir_ledger_errors_total",
    "Reconciles that could not move a ledger, by reason (UnreadableEnvelope, "
    "InvariantViolation, WriteRefused, MirrorRefused).",
    ["namespace", "reason"],
)
finalizer_waits = Counter(
    "reservoir_finalizer_waits_total",
    "Deletions held back because their settlement is not recorded yet.",
    ["namespace", "kind"],
)


def observe(namespace: str, envelope: str, status: ReservationEnvelopeStatus) -> None:
    totals = status.totals
    for state in ("capacity", "reserved", "committed", "reconciling", "available"):
        for resource, amount in getattr(totals, state).items():
            # Gauges are floats by Prometheus' definition; the ledger itself stays exact.
            capacity.labels(namespace, envelope, resource, state).set(float(amount))
    for phase, count in status.counts.items():
        claims.labels(namespace, envelope, phase).set(count)


def count_events(namespace: str, envelope: str, events: Iterable[LedgerEvent]) -> None:
    for event in events:
        transitions.labels(namespace, envelope, event.reason).inc()
