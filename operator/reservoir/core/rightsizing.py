"""Right-sizing: what a workflow class's envelopes and settled claims say its requests and
budgets should be, each resource judged by its contract (README "Resource contracts").

A workflow class is a set of envelopes (the label `reservoir.dev/workflow-class`). Each
resource is judged by the contract its envelope keeps for it (`status.contracts`; an
envelope that does not show one: the default by name):

- **Consumable** (tokens, cost): each settled claim is a sample of reserved R and consumed
  C. The line suggests a claim's *request*: the p95 of observed demand, rounded up to
  three significant digits.
- **Reusable** (GPUs, concurrency permits): a claim consumes nothing (all of R returns when
  it ends), so C against R says nothing. Each envelope is a sample of its peak concurrent
  use (`status.peak`, the most ever in use at once) against its capacity (an open envelope
  only once it has had some in use: until then it says nothing). The line
  suggests the envelope's *capacity*: the p95 of the peaks, rounded up the same way.
- **Replenishing** (a provider's requests or tokens per window): each envelope is a sample
  of its most in use within one window (`status.peak`: held plus committed in the window)
  against its limit (capacity). The line suggests the *limit per window*.

A peak that reached its capacity is censored: claims may have waited for it, and the need
may be higher than anything observed; the line says how many envelopes did.

What counts as a sample:

- Only claims that settled **Consumed** with a measured C. A Released claim never ran (or
  used nothing) and an Expired one lapsed before dispatch: neither says anything about
  what the branch needs, so they are excluded and counted by phase. A claim charged its
  whole reservation because its outcome was unknown at the ambiguity deadline
  (`AmbiguityDeadlineQuarantine`) carries a policy's C = R, not a measurement: excluded
  too, as `Quarantined`. Rejected claims never held anything.
- Demand is C plus any overrun excess (`status.overrun.excess`): a branch that reported 25
  against a reservation of 20 is charged C = 20 but needed 25, and a suggestion built on
  the capped C alone would keep it capped.

Every figure is exact: quantities are Decimals, ratios (C/R, peak/capacity) are Fractions
(shown rounded to four decimal places), and percentiles pick a sample, never interpolate.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import ROUND_CEILING, Decimal, localcontext
from fractions import Fraction
from typing import TypeVar

from reservoir.core.contracts import type_of
from reservoir.core.model import (
    ClaimPhase,
    ContractType,
    EnvelopePhase,
    LedgerEntry,
    ReservationEnvelopeStatus,
)
from reservoir.core.quantity import format_quantity

MIN_SAMPLES = 5
SIGNIFICANT_DIGITS = 3
RATIO_PLACES = 4
QUARANTINE_REASON = "AmbiguityDeadlineQuarantine"
QUARANTINED = "Quarantined"
ZERO = Decimal(0)
REUSABLE, CONSUMABLE, REPLENISHING = (
    ContractType.REUSABLE,
    ContractType.CONSUMABLE,
    ContractType.REPLENISHING,
)
# What each contract's line is judged by, and what it suggests (README, `recommend`).
JUDGED_BY = {
    CONSUMABLE: "consumed C against reserved R per claim",
    REUSABLE: "peak concurrent use against capacity per envelope",
    REPLENISHING: "peak use per window against the limit per envelope",
}
SUGGESTS = {CONSUMABLE: "request", REUSABLE: "capacity", REPLENISHING: "limit per window"}

T = TypeVar("T", Decimal, Fraction)


def nearest_rank(values: Sequence[T], percent: int) -> T:
    """The `percent`-th percentile by the nearest-rank method: sort the n values
    ascending and take the k-th (1-based), k = ceil(percent / 100 * n). It is always one of
    the values (no interpolation), so it is exact; p100 is the maximum, and for n = 3 the
    p50 is the 2nd value and the p95 the 3rd."""
    if not values:
        raise ValueError("no values: a percentile needs at least one")
    if not 0 < percent <= 100:
        raise ValueError(f"percent must be in (0, 100], not {percent}")
    rank = -(-percent * len(values) // 100)  # ceil(percent * n / 100), in integers
    return sorted(values)[rank - 1]


def round_up(value: Decimal, digits: int = SIGNIFICANT_DIGITS) -> Decimal:
    """`value` rounded up (towards +infinity) to `digits` significant digits: 12345 →
    12400, 0.12341 → 0.124, 999 → 999, 0 → 0. Never below `value`, and less than
    10^(1 - digits) above it relatively (1% for three digits)."""
    if value <= ZERO:
        return ZERO
    quantum = Decimal(1).scaleb(value.adjusted() - digits + 1)
    with localcontext() as context:
        context.prec = 60
        rounded = (value / quantum).to_integral_value(rounding=ROUND_CEILING) * quantum
    return Decimal(format_quantity(rounded))


def round_ratio(ratio: Fraction, places: int = RATIO_PLACES) -> Decimal:
    """A ratio as a Decimal with at most `places` decimals, rounded half to even, from the
    exact Fraction (integer arithmetic: no double rounding)."""
    scaled = ratio * 10**places
    quotient, remainder = divmod(scaled.numerator, scaled.denominator)
    twice = 2 * remainder
    if twice > scaled.denominator or (twice == scaled.denominator and quotient % 2 == 1):
        quotient += 1
    return Decimal(format_quantity(Decimal(quotient).scaleb(-places)))


@dataclass(frozen=True)
class Sample:
    """One settled claim's record: its terminal phase and settlement reason, per resource
    what it reserved (R), was charged (C) and reported above R (overrun excess), and the
    contracts its envelope keeps (only its Consumable resources are judged by C and R)."""

    phase: ClaimPhase
    reserved: Mapping[str, Decimal]
    consumed: Mapping[str, Decimal] = field(default_factory=dict)
    excess: Mapping[str, Decimal] = field(default_factory=dict)
    reason: str = ""
    contracts: Mapping[str, ContractType] = field(default_factory=dict)

    @classmethod
    def from_entry(
        cls, entry: LedgerEntry, contracts: Mapping[str, ContractType] | None = None
    ) -> Sample | None:
        """The sample a ledger entry (or a settled claim's status record) gives, with its
        envelope's contracts; None for a claim that has not settled."""
        if entry.settlement is None or not entry.phase.terminal:
            return None
        return cls(
            phase=entry.settlement.phase,
            reserved=dict(entry.reserved),
            consumed=dict(entry.consumed),
            excess=dict(entry.overrun.excess) if entry.overrun else {},
            reason=entry.settlement.reason,
            contracts=dict(contracts or {}),
        )

    def consumable(self, resource: str) -> bool:
        return type_of(resource, self.contracts) is CONSUMABLE

    @property
    def exclusion(self) -> str | None:
        """Why this claim says nothing about need (None: it counts)."""
        if self.phase is not ClaimPhase.CONSUMED:
            return self.phase.value
        if self.reason == QUARANTINE_REASON:
            return QUARANTINED
        return None


@dataclass(frozen=True)
class EnvelopeUse:
    """One envelope's record of its Reusable and Replenishing resources: the most ever in
    use at once (`status.peak`) against its capacity, and whether it has finished (Closed
    or Expired: its peak is final; an open one's is the most so far)."""

    contracts: Mapping[str, ContractType]
    capacity: Mapping[str, Decimal]
    peak: Mapping[str, Decimal] = field(default_factory=dict)
    finished: bool = True

    @classmethod
    def from_status(cls, status: ReservationEnvelopeStatus) -> EnvelopeUse | None:
        """The record an envelope's status gives; None for an envelope that never opened
        (it held nothing, and says nothing about what its workflow needs)."""
        if status.phase is EnvelopePhase.PENDING:
            return None
        finished = status.phase in (EnvelopePhase.CLOSED, EnvelopePhase.EXPIRED)
        return cls(
            dict(status.contracts), dict(status.totals.capacity), dict(status.peak), finished
        )

    def contract(self, resource: str) -> ContractType:
        return type_of(resource, self.contracts)

    def sample(self, resource: str) -> bool:
        """Whether its peak of `resource` says something: once it has finished, or once it
        has had any in use (an open envelope that has not run anything yet says nothing)."""
        return self.finished or self.peak.get(resource, ZERO) > ZERO


@dataclass(frozen=True)
class ResourceRecommendation:
    """A Consumable resource's line: C against R over the claims that reserved it."""

    resource: str
    samples: int  # counted claims that reserved this resource
    p50_consumed: Decimal
    p95_consumed: Decimal
    max_consumed: Decimal
    p50_reserved: Decimal
    p50_ratio: Fraction | None  # C/R over the samples with R > 0 (None: there are none)
    p95_ratio: Fraction | None
    p95_demand: Decimal  # demand = C + overrun excess
    capped: int  # samples whose usage went above R (C was capped at R)
    suggested: Decimal | None  # None: too few samples
    explanation: str
    contract: ContractType = CONSUMABLE

    @property
    def judged_by(self) -> str:
        return JUDGED_BY[self.contract]


@dataclass(frozen=True)
class CapacityRecommendation:
    """A Reusable or Replenishing resource's line: peak use against capacity (the limit per
    window, for Replenishing) over the envelopes that have it."""

    resource: str
    contract: ContractType  # Reusable or Replenishing
    envelopes: int  # samples: opened envelopes with this resource under this contract
    p50_peak: Decimal
    p95_peak: Decimal
    max_peak: Decimal
    p50_capacity: Decimal
    p50_ratio: Fraction | None  # peak/capacity over envelopes with capacity > 0
    p95_ratio: Fraction | None
    at_capacity: int  # envelopes whose peak reached their capacity: the need may be higher
    suggested: Decimal | None  # a capacity (Reusable) or limit per window; None: too few
    explanation: str

    @property
    def judged_by(self) -> str:
        return JUDGED_BY[self.contract]


@dataclass(frozen=True)
class Recommendation:
    claims: int  # settled claims counted as samples
    excluded: dict[str, int]  # claims left out, by phase (or Quarantined)
    resources: list[ResourceRecommendation]  # Consumable resources, by name
    min_samples: int = MIN_SAMPLES
    # Reusable and Replenishing resources, by name then contract
    capacities: list[CapacityRecommendation] = field(default_factory=list)
    envelopes: int = 0  # opened envelopes counted as samples of peak use


def recommend(
    samples: Iterable[Sample | LedgerEntry],
    min_samples: int = MIN_SAMPLES,
    envelopes: Iterable[EnvelopeUse] = (),
) -> Recommendation:
    """Per Consumable resource: sample size, p50/p95/max of consumed C, p50 of reserved R,
    p50/p95 of C/R, and a suggested request, the p95 of demand (C plus overrun excess)
    rounded up to three significant digits; None below `min_samples` samples. The
    suggestion is the p95, not the maximum: about one claim in twenty may need more, and
    such a claim is charged at most its R with the excess recorded as an overrun, never an
    overdraft. A ledger entry given alone is read with the default contracts.

    Per Reusable and Replenishing resource of `envelopes`: p50/p95/max of the peaks, p50
    of capacity, p50/p95 of peak/capacity, and a suggested capacity (limit per window),
    the p95 of the peaks rounded up likewise; None below `min_samples` envelopes."""
    counted: list[Sample] = []
    excluded: dict[str, int] = {}
    for item in samples:
        sample = Sample.from_entry(item) if isinstance(item, LedgerEntry) else item
        if sample is None:
            continue
        why = sample.exclusion
        if why is None:
            counted.append(sample)
        else:
            excluded[why] = excluded.get(why, 0) + 1
    # A resource a claim never requested but overran is demand too (R is 0 for it).
    names = sorted(
        {
            name
            for sample in counted
            for name in (*sample.reserved, *sample.excess)
            if sample.consumable(name)
        }
    )
    resources = [_resource(name, counted, min_samples) for name in names]
    uses = list(envelopes)
    lines = sorted(
        {
            (name, use.contract(name))
            for use in uses
            for name in use.capacity
            if use.contract(name) is not CONSUMABLE and use.sample(name)
        }
    )
    capacities = [_capacity(name, contract, uses, min_samples) for name, contract in lines]
    return Recommendation(
        len(counted),
        dict(sorted(excluded.items())),
        resources,
        min_samples,
        capacities,
        len(uses),
    )


def _resource(name: str, counted: Sequence[Sample], min_samples: int) -> ResourceRecommendation:
    held = [s for s in counted if (name in s.reserved or name in s.excess) and s.consumable(name)]
    reserved = [s.reserved.get(name, ZERO) for s in held]
    consumed = [s.consumed.get(name, ZERO) for s in held]
    demand = [c + s.excess.get(name, ZERO) for c, s in zip(consumed, held, strict=True)]
    ratios = [Fraction(c) / Fraction(r) for c, r in zip(consumed, reserved, strict=True) if r]
    capped = sum(1 for s in held if s.excess.get(name, ZERO) > ZERO)
    p95_consumed = nearest_rank(consumed, 95)
    p95_demand = nearest_rank(demand, 95)
    n = len(held)
    if n < min_samples:
        suggested = None
        explanation = f"too few samples ({n} < {min_samples}): no suggestion"
    else:
        suggested = round_up(p95_demand)
        basis = (
            f"p95 of demand (consumed plus overrun; {capped} of {n} claims overran R) is "
            f"{format_quantity(p95_demand)}"
            if capped
            else f"p95 of consumed over {n} claims is {format_quantity(p95_consumed)}"
        )
        explanation = (
            f"{basis}, rounded up to {SIGNIFICANT_DIGITS} significant digits; "
            "about 1 claim in 20 may need more"
        )
    return ResourceRecommendation(
        resource=name,
        samples=n,
        p50_consumed=nearest_rank(consumed, 50),
        p95_consumed=p95_consumed,
        max_consumed=max(consumed),
        p50_reserved=nearest_rank(reserved, 50),
        p50_ratio=nearest_rank(ratios, 50) if ratios else None,
        p95_ratio=nearest_rank(ratios, 95) if ratios else None,
        p95_demand=p95_demand,
        capped=capped,
        suggested=suggested,
        explanation=explanation,
    )


def _capacity(
    name: str, contract: ContractType, uses: Sequence[EnvelopeUse], min_samples: int
) -> CapacityRecommendation:
    having = [
        u for u in uses if name in u.capacity and u.contract(name) is contract and u.sample(name)
    ]
    peaks = [u.peak.get(name, ZERO) for u in having]
    capacities = [u.capacity[name] for u in having]
    ratios = [Fraction(p) / Fraction(c) for p, c in zip(peaks, capacities, strict=True) if c]
    at_capacity = sum(1 for p, c in zip(peaks, capacities, strict=True) if p >= c)
    p95_peak = nearest_rank(peaks, 95)
    n = len(having)
    what = SUGGESTS[contract]
    if n < min_samples:
        suggested = None
        explanation = f"too few envelopes ({n} < {min_samples}): no suggestion"
    else:
        suggested = round_up(p95_peak)
        peak = "peak in use at once" if contract is REUSABLE else "peak in use within a window"
        explanation = (
            f"p95 of the {peak} over {n} envelopes is "
            f"{format_quantity(p95_peak)}, rounded up to {SIGNIFICANT_DIGITS} significant "
            f"digits as the {what}"
        )
        if at_capacity:
            explanation += (
                f"; {at_capacity} of {n} envelopes reached their "
                f"{'capacity' if contract is REUSABLE else 'limit'}: claims may have "
                "waited, and the need may be higher"
            )
    return CapacityRecommendation(
        resource=name,
        contract=contract,
        envelopes=n,
        p50_peak=nearest_rank(peaks, 50),
        p95_peak=p95_peak,
        max_peak=max(peaks),
        p50_capacity=nearest_rank(capacities, 50),
        p50_ratio=nearest_rank(ratios, 50) if ratios else None,
        p95_ratio=nearest_rank(ratios, 95) if ratios else None,
        at_capacity=at_capacity,
        suggested=suggested,
        explanation=explanation,
    )
