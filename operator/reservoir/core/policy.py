"""Per-envelope policy: who gets admitted, in what order, and how long a lease lasts.

Pure decisions over plain data; the lifecycle applies them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal

from reservoir.core.ledger import ZERO, fits
from reservoir.core.model import (
    MAX_ACTIVE_CLAIMS_LIMIT,
    EnvelopePolicy,
    LedgerEntry,
)
from reservoir.core.text import MESSAGE_LENGTH, bounded, names


@dataclass(frozen=True)
class QueueKey:
    """Pending claims are admitted by priority (high first), then age (old first). The age
    is the claim's creation time, set by the API server (to the second), so renewals never
    improve it; claims created in the same second queue by name."""

    priority: int
    created_at: datetime
    name: str
    uid: str

    def sort_key(self) -> tuple[int, datetime, str, str]:
        return (-self.priority, self.created_at, self.name, self.uid)


@dataclass(frozen=True)
class Admission:
    admitted: bool
    reason: str  # CamelCase reason when not admitted
    message: str = ""
    permanent: bool = False  # can never be admitted: reject instead of queueing

    def __post_init__(self) -> None:
        # Bounded where it is made: the message becomes a queue reason and a condition
        # (16 resource names of 63 characters once overflowed both, issue 21).
        object.__setattr__(self, "message", bounded(self.message, MESSAGE_LENGTH))


def request_problem(
    requests: Mapping[str, Decimal], capacity: Mapping[str, Decimal]
) -> Admission | None:
    """A request that can never be admitted, whatever else happens."""
    unknown = sorted(set(requests) - set(capacity))
    if unknown:
        return Admission(
            False,
            "UnknownResource",
            f"the envelope has no budget for {', '.join(unknown)} "
            f"(it has: {', '.join(sorted(capacity)) or 'nothing'})",
            permanent=True,
        )
    if not requests or all(amount == ZERO for amount in requests.values()):
        return Admission(False, "EmptyRequest", "requests must ask for something", True)
    too_big = sorted(name for name, amount in requests.items() if amount > capacity[name])
    if too_big:
        return Admission(
            False,
            "LargerThanEnvelope",
            f"requests exceed the envelope's whole capacity for {', '.join(too_big)}",
            permanent=True,
        )
    return None


def admission(
    requests: Mapping[str, Decimal],
    available: Mapping[str, Decimal],
    live: list[LedgerEntry],
    will_be_tentative: bool,
    policy: EnvelopePolicy,
) -> Admission:
    """Whether a (valid) request can reserve now, and if not, the reason it waits."""
    # The messages name limits, never counts that move with every claim: a waiting claim's
    # status repeats its reason, and a message that changed on every pass would rewrite
    # every waiting claim's status on every pass.
    max_active = policy.max_active_claims or MAX_ACTIVE_CLAIMS_LIMIT
    if len(live) >= max_active:
        return Admission(
            False, "MaxActiveClaims", f"the envelope has its most active claims ({max_active})"
        )
    tentative = sum(1 for e in live if e.phase.value == "Tentative")
    if (
        will_be_tentative
        and policy.max_tentative_claims is not None
        and tentative >= policy.max_tentative_claims
    ):
        return Admission(
            False,
            "MaxTentativeClaims",
            f"the envelope holds its most tentative claims ({policy.max_tentative_claims})",
        )
    if not fits(requests, available):
        short = sorted(n for n, a in requests.items() if a > available.get(n, ZERO))
        return Admission(False, "InsufficientCapacity", f"not enough available {names(short)}")
    return Admission(True, "Admitted")


def within_grant(policy: EnvelopePolicy, granted: int | None) -> EnvelopePolicy:
    """The envelope's policy under what its pool granted it of a cap on tentative claims
    (`status.parent.tentativeClaims`): the lower of the two caps."""
    own = policy.max_tentative_claims
    if granted is None or (own is not None and own <= granted):
        return policy
    return policy.model_copy(update={"max_tentative_claims": granted})


def queue_expired(created_at: datetime, now: datetime, policy: EnvelopePolicy) -> bool:
    return now >= created_at + timedelta(seconds=policy.max_queue_seconds)


def lease_seconds(requested: int | None, policy: EnvelopePolicy) -> int:
    """The lease a claim gets: the envelope default, or less if the claim asks for less;
    never longer than the claim's maximum lifetime."""
    asked = min(requested or policy.default_lease_seconds, policy.default_lease_seconds)
    return min(asked, policy.max_claim_lifetime_seconds)


def first_expiry(now: datetime, requested: int | None, policy: EnvelopePolicy) -> datetime:
    return now + timedelta(seconds=lease_seconds(requested, policy))


@dataclass(frozen=True)
class Renewal:
    granted: bool
    expires_at: datetime | None = None
    reason: str = ""
    message: str = ""


def renewal(
    entry: LedgerEntry, now: datetime, requested: int | None, policy: EnvelopePolicy
) -> Renewal:
    """A renewal extends expiry and counts itself. It never moves first-reserved time,
    priority, budget or queue position, and is refused past the lifetime or budget."""
    assert entry.first_reserved_at is not None and entry.expires_at is not None
    if policy.max_renewals is not None and entry.renewals >= policy.max_renewals:
        used = f"{entry.renewals} of {policy.max_renewals} renewals used"
        return Renewal(False, reason="RenewalBudgetExhausted", message=used)
    end_of_life = entry.first_reserved_at + timedelta(seconds=policy.max_claim_lifetime_seconds)
    if now >= end_of_life:
        reached = f"reached its maximum lifetime of {policy.max_claim_lifetime_seconds}s"
        return Renewal(False, reason="MaxLifetime", message=reached)
    expires_at = min(now + timedelta(seconds=lease_seconds(requested, policy)), end_of_life)
    return Renewal(True, expires_at=max(expires_at, entry.expires_at))


def settlement_due(
    entry: LedgerEntry | None, deleted_at: datetime, policy: EnvelopePolicy
) -> datetime:
    """By when a deleted claim's settlement is due, so its finalizer can go: at once before
    its commit point; after it, at the ambiguity deadline that follows its lease's end (no
    renewal is granted once it is being deleted) or its detachment. Later than this means
    something is stuck, or the policy is Hold and a person must decide."""
    deadline = timedelta(seconds=policy.ambiguity_deadline_seconds)
    if entry is None or entry.settlement is not None or not entry.phase.committed:
        return deleted_at
    if entry.detached_at is not None:
        return entry.detached_at + deadline
    lease_end = entry.expires_at or deleted_at
    return max(lease_end, deleted_at) + deadline


def ambiguity_deadline(entry: LedgerEntry, policy: EnvelopePolicy) -> datetime | None:
    if entry.detached_at is None:
        return None
    return entry.detached_at + timedelta(seconds=policy.ambiguity_deadline_seconds)
