"""Reconciling with the provider: which claims need a status lookup, when, and what an
answer means for the ledger.

The operator looks up the upstream operation of a claim only while the claim needs it
(client-disconnect.txt): it is Detached (its worker is gone), a cancel was asked after the
commit point, or it was submitted and the provider has not yet said it accepted the work.
Lookups back off (2 s, doubling, with jitter, at most the policy's bound); a failed lookup
is counted and changes nothing else. A terminal answer that reports the usage settles the
claim like a final report; one that does not is recorded and settles nothing (a provider's
"completed" is not proof of zero usage, child-settlement.txt): the claim waits for the
worker's final report, an answer with the usage, or the ambiguity deadline, so the outcome
is the same whether the operator saw the answer before the final report or with it.
Unknown keeps the claim as it is until the ambiguity deadline.

The adapters (reservoir.k8s.providers) turn a Job, a Pod, an object with conditions, or an
HTTP endpoint's JSON into a `ProviderAnswer`; everything here is pure.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from enum import StrEnum

from reservoir.core.model import (
    BranchClaimSpec,
    ClaimPhase,
    EnvelopePolicy,
    LedgerEntry,
    Outcome,
    ProviderState,
    UpstreamCancel,
    UpstreamState,
)

FIRST_LOOKUP_WAIT_SECONDS = 2
# An object named by `upstream.ref` (a Job, a Pod) is read on each pass that needs it,
# whatever the provider backoff says (one GET): at least this often, so that a pod that
# ended is seen within this, though nothing watches it.
OBJECT_LOOKUP_SECONDS = 30


class Adapter(StrEnum):
    OBJECT = "Object"  # upstream.ref: a Job, a Pod, or an object with conditions
    HTTP = "HTTP"  # the envelope's policy.provider endpoint, by upstream.operationId


@dataclass(frozen=True)
class ProviderAnswer:
    """One lookup's answer. A lookup that failed has `error` set and state Unknown.
    `usage` None: the provider did not say what the work used (no usage annotation, no
    "usage" in the HTTP answer); {} says it used nothing."""

    state: ProviderState
    usage: Mapping[str, Decimal] | None = None
    result: str | None = None
    error: str | None = None

    @property
    def outcome(self) -> Outcome | None:
        return TERMINAL_OUTCOMES.get(self.state)

    @property
    def settles(self) -> bool:
        """A terminal answer that says what was used: enough to settle the claim on. "Never
        started" says it (nothing); Succeeded, Failed or Cancelled only with the usage."""
        if self.error is not None or not self.state.terminal:
            return False
        return self.state is ProviderState.NEVER_STARTED or self.usage is not None


TERMINAL_OUTCOMES = {
    ProviderState.SUCCEEDED: Outcome.SUCCEEDED,
    ProviderState.FAILED: Outcome.FAILED,
    ProviderState.CANCELLED: Outcome.CANCELLED,
}


@dataclass(frozen=True)
class ForwardedCancel:
    """What forwarding a claim's cancel upstream did in one pass."""

    how: UpstreamCancel
    done: bool  # it went through (anything else is tried again on a later pass)
    text: str


def adapter_for(spec: BranchClaimSpec, policy: EnvelopePolicy) -> Adapter | None:
    """How this claim's upstream operation can be looked up, if at all."""
    upstream = spec.upstream
    if upstream.ref is not None:
        return Adapter.OBJECT
    if policy.provider is not None and upstream.operation_id and upstream.supports_status:
        return Adapter.HTTP
    return None


def submitted_unconfirmed(spec: BranchClaimSpec) -> bool:
    """Submitted, and the provider has not said it accepted the work: maybe running."""
    return spec.upstream.state is UpstreamState.SUBMITTED


def needs_lookup(entry: LedgerEntry, spec: BranchClaimSpec, policy: EnvelopePolicy) -> bool:
    """Whether the operator should ask the provider about this claim at all."""
    if adapter_for(spec, policy) is None:
        return False
    if entry.phase.terminal:
        # Settled by a deadline decision: a late answer may still adjust it (once).
        return late_answer_wanted(entry)
    if not entry.phase.committed:
        return False
    return (
        entry.phase is ClaimPhase.DETACHED
        or entry.cancel_requested
        or (submitted_unconfirmed(spec) and entry.started_at is None)
    )


DEADLINE_REASONS = ("AmbiguityDeadlineQuarantine", "AmbiguityDeadlineRelease")


def late_answer_wanted(entry: LedgerEntry) -> bool:
    settled = entry.settlement
    return settled is not None and settled.reason in DEADLINE_REASONS and entry.adjustment is None


def lookup_due(entry: LedgerEntry, now: datetime) -> bool:
    record = entry.provider
    return record is None or record.next_lookup_at is None or now >= record.next_lookup_at


def next_lookup(uid: str, lookups: int, now: datetime, policy: EnvelopePolicy) -> datetime:
    """2 s, doubling with every lookup that did not settle the claim, at most the policy's
    bound, with jitter (a deterministic half-to-whole of the wait, from the claim's UID and
    the count: replaying the same facts gives the same moment)."""
    bound = policy.provider_lookup_max_seconds
    wait = min(bound, FIRST_LOOKUP_WAIT_SECONDS * 2 ** min(lookups, 30))
    digest = hashlib.sha256(f"{uid}/{lookups}".encode()).digest()
    jitter = Decimal(500 + int.from_bytes(digest[:2], "big") % 501) / Decimal(1000)
    millis = int(Decimal(wait * 1000) * jitter)
    return now + timedelta(milliseconds=max(millis, 1000))


def cancel_to_forward(
    entry: LedgerEntry, spec: BranchClaimSpec, policy: EnvelopePolicy
) -> UpstreamCancel | None:
    """A cancel asked after the commit point, for a provider that can cancel in the
    operation's phase (queued; running too unless `cancelsRunning` is false: a start
    recorded first), not yet forwarded: forward it (recorded as requested, never as
    confirmed)."""
    if not entry.cancel_requested or entry.phase.terminal or not spec.upstream.supports_cancel:
        return None
    if entry.started_at is not None and spec.upstream.cancels_running is False:
        return None  # running work this provider cannot cancel: the cancel is only recorded
    if policy.upstream_cancel is UpstreamCancel.NEVER:
        return None
    # A cancel needs no status lookup: a referenced object, or the operation at an
    # endpoint with a cancel call (client-disconnect.txt: "cancellation but no status").
    endpoint = policy.provider
    cancellable = spec.upstream.ref is not None or (
        endpoint is not None
        and endpoint.cancel_url is not None
        and spec.upstream.operation_id is not None
    )
    if not cancellable:
        return None
    if entry.provider is not None and entry.provider.cancel_forwarded_at is not None:
        return None
    return policy.upstream_cancel
