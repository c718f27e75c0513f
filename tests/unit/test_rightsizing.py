"""Right-sizing in the pure core: nearest-rank percentiles, exclusions, exact figures."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reservoir.core.contracts import type_of
from reservoir.core.model import (
    ClaimPhase,
    ContractType,
    LedgerEntry,
    Overrun,
    ReservationEnvelopeStatus,
    Settlement,
)
from reservoir.core.quantity import format_quantity, parse_quantity
from reservoir.core.rightsizing import (
    EnvelopeUse,
    Recommendation,
    ResourceRecommendation,
    Sample,
    nearest_rank,
    recommend,
    round_ratio,
    round_up,
)

D = Decimal
CONSUMED, RELEASED, EXPIRED = ClaimPhase.CONSUMED, ClaimPhase.RELEASED, ClaimPhase.EXPIRED


def used(consumed: str, reserved: str = "20", excess: str = "0", name: str = "tokens") -> Sample:
    extra = {name: parse_quantity(excess)} if parse_quantity(excess) else {}
    return Sample(
        CONSUMED,
        {name: parse_quantity(reserved)},
        {name: parse_quantity(consumed)},
        extra,
        "Completed",
    )


def only(rec: Recommendation) -> ResourceRecommendation:
    assert len(rec.resources) == 1
    return rec.resources[0]


# --- nearest rank ----------------------------------------------------------------------


def test_nearest_rank_takes_the_ceil_p_n_over_100_th_smallest_value() -> None:
    twenty = [D(v) for v in range(20, 0, -1)]  # unsorted on purpose
    assert nearest_rank(twenty, 50) == 10  # k = ceil(0.50 * 20) = 10
    assert nearest_rank(twenty, 95) == 19  # k = ceil(0.95 * 20) = 19
    assert nearest_rank(twenty, 100) == 20
    assert nearest_rank(twenty, 1) == 1
    twenty_one = [D(v) for v in range(1, 22)]
    assert nearest_rank(twenty_one, 95) == 20  # k = ceil(19.95) = 20
    assert nearest_rank(twenty_one, 50) == 11  # k = ceil(10.5) = 11
    three = [D(5), D(20), D(12)]
    assert (nearest_rank(three, 50), nearest_rank(three, 95)) == (12, 20)  # k = 2, 3
    assert nearest_rank([D(7)], 95) == 7
    assert nearest_rank([Fraction(1, 3), Fraction(1, 4)], 50) == Fraction(1, 4)


def test_nearest_rank_refuses_nothing_and_out_of_range_percents() -> None:
    with pytest.raises(ValueError, match="no values"):
        nearest_rank([], 50)
    for bad in (0, 101, -5):
        with pytest.raises(ValueError, match="percent"):
            nearest_rank([D(1)], bad)


# --- rounding ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("12345", "12400"),
        ("12300", "12300"),
        ("999", "999"),
        ("1001", "1010"),
        ("99950", "100000"),
        ("25", "25"),
        ("0.12341", "0.124"),
        ("1.25", "1.25"),
        ("250m", "0.25"),
        ("1n", "0.000000001"),
        ("0", "0"),
    ],
)
def test_round_up_goes_up_to_three_significant_digits(value: str, expected: str) -> None:
    rounded = round_up(parse_quantity(value))
    assert format_quantity(rounded) == expected
    assert rounded >= parse_quantity(value)


def test_ratios_are_rounded_from_the_exact_fraction_half_to_even() -> None:
    assert round_ratio(Fraction(1, 3)) == D("0.3333")
    assert round_ratio(Fraction(2, 3)) == D("0.6667")
    assert round_ratio(Fraction(1, 8), places=2) == D("0.12")  # 0.125: half to even
    assert round_ratio(Fraction(3, 8), places=2) == D("0.38")  # 0.375: half to even
    assert round_ratio(Fraction(1)) == D(1)
    assert round_ratio(Fraction(0)) == D(0)


# --- recommend --------------------------------------------------------------------------


def test_the_seed_worked_example_is_three_samples_and_too_few_to_suggest() -> None:
    """child-settlement.txt: four branches of 20; A used 20, B 12, C was pruned before
    dispatch (Released), D reported 5 late. C says nothing about need."""
    samples = [
        used("20"),
        used("12"),
        Sample(RELEASED, {"tokens": D(20)}, {}, {}, "Cancelled"),
        Sample(CONSUMED, {"tokens": D(20)}, {"tokens": D(5)}, {}, "SettledAfterDetach"),
    ]
    rec = recommend(samples)
    assert (rec.claims, rec.excluded) == (3, {"Released": 1})
    tokens = only(rec)
    # sorted C = [5, 12, 20]: p50 is the 2nd, p95 the 3rd; R is 20 throughout.
    assert (tokens.samples, tokens.p50_consumed, tokens.p95_consumed) == (3, 12, 20)
    assert (tokens.max_consumed, tokens.p50_reserved) == (20, 20)
    # C/R sorted = [1/4, 3/5, 1]
    assert (tokens.p50_ratio, tokens.p95_ratio) == (Fraction(3, 5), Fraction(1))
    assert tokens.suggested is None
    assert tokens.explanation == "too few samples (3 < 5): no suggestion"


def test_ten_claims_of_20_with_an_overrun_suggest_the_p95_of_demand() -> None:
    consumed = ["12", "0", "8", "15", "20", "5", "10", "18", "3"]
    samples = [used(c) for c in consumed]
    samples.append(used("20", excess="5"))  # reported 25 against R = 20: charged 20
    samples += [
        Sample(RELEASED, {"tokens": D(20)}, {}, {}, "Cancelled"),
        Sample(RELEASED, {"tokens": D(20)}, {}, {}, "FinishedBeforeCommit"),
        Sample(EXPIRED, {"tokens": D(20)}, {}, {}, "LeaseExpired"),
        # C = R by policy at the ambiguity deadline: not a measurement.
        Sample(CONSUMED, {"tokens": D(20)}, {"tokens": D(20)}, {}, "AmbiguityDeadlineQuarantine"),
    ]
    rec = recommend(samples)
    assert rec.claims == 10
    assert rec.excluded == {"Expired": 1, "Quarantined": 1, "Released": 2}
    tokens = only(rec)
    # sorted C = [0, 3, 5, 8, 10, 12, 15, 18, 20, 20]: p50 = 5th, p95 = 10th
    assert (tokens.p50_consumed, tokens.p95_consumed, tokens.max_consumed) == (10, 20, 20)
    assert tokens.p50_reserved == 20
    assert (tokens.p50_ratio, tokens.p95_ratio) == (Fraction(1, 2), Fraction(1))
    # demand: the capped claim needed 25; sorted [0, 3, 5, 8, 10, 12, 15, 18, 20, 25]
    assert (tokens.p95_demand, tokens.capped, tokens.suggested) == (25, 1, 25)
    assert "1 of 10 claims overran R" in tokens.explanation
    assert "is 25, rounded up to 3 significant digits" in tokens.explanation


def test_the_suggestion_is_the_p95_not_the_max_rounded_up() -> None:
    # 20 samples: p95 is the 19th smallest (12345), the maximum (19000) is left out.
    samples = [used(str(1000 + i), reserved="20000") for i in range(18)]
    samples += [used("12345", reserved="20000"), used("19000", reserved="20000")]
    tokens = only(recommend(samples))
    assert (tokens.samples, tokens.p95_consumed, tokens.max_consumed) == (20, 12345, 19000)
    assert tokens.p50_consumed == 1009  # the 10th smallest
    assert (tokens.suggested, tokens.capped) == (D(12400), 0)
    assert tokens.explanation == (
        "p95 of consumed over 20 claims is 12345, rounded up to 3 significant digits; "
        "about 1 claim in 20 may need more"
    )


def test_fractional_quantities_stay_exact() -> None:
    cost = ["0.35", "0.5", "0.1", "1.25", "0.5"]
    samples = [
        Sample(
            CONSUMED,
            {"cost": D(2), "cpu": parse_quantity("500m")},
            {"cost": parse_quantity(c), "cpu": parse_quantity("250m")},
        )
        for c in cost
    ]
    rec = recommend(samples)
    by = {r.resource: r for r in rec.resources}
    assert sorted(by) == ["cost", "cpu"]
    # sorted cost = [0.1, 0.35, 0.5, 0.5, 1.25]: p50 = 3rd, p95 = 5th
    assert (by["cost"].p50_consumed, by["cost"].p95_consumed) == (D("0.5"), D("1.25"))
    assert by["cost"].p95_ratio == Fraction(5, 8)  # 1.25 / 2
    assert round_ratio(by["cost"].p95_ratio) == D("0.625")
    assert by["cost"].suggested == D("1.25")
    assert (by["cpu"].p50_consumed, by["cpu"].p50_reserved) == (D("0.25"), D("0.5"))
    assert by["cpu"].p50_ratio == Fraction(1, 2)
    assert by["cpu"].suggested == D("0.25")
    # A ratio a float would get wrong: 0.1 / 0.3 is exactly 1/3.
    third = recommend([used("0.1", reserved="0.3")] * 5).resources[0]
    assert third.p50_ratio == Fraction(1, 3)


def test_a_resource_is_counted_only_over_the_claims_that_reserved_it() -> None:
    samples = [Sample(CONSUMED, {"tokens": D(10)}, {"tokens": D(4)}) for _ in range(5)]
    samples.append(Sample(CONSUMED, {"tokens": D(10), "gpu": D(2)}, {"tokens": D(10)}))
    by = {r.resource: r for r in recommend(samples).resources}
    assert (by["tokens"].samples, by["gpu"].samples) == (6, 1)
    # the gpu claim reported no gpu usage: C = 0 for it
    assert (by["gpu"].p95_consumed, by["gpu"].p95_ratio) == (0, Fraction(0))
    assert by["gpu"].suggested is None
    # a zero reservation has no ratio
    zero = only(recommend([Sample(CONSUMED, {"x": D(0)}, {})] * 5))
    assert (zero.p50_ratio, zero.p95_ratio, zero.suggested) == (None, None, D(0))


def test_ledger_entries_are_read_as_samples_and_unsettled_ones_ignored() -> None:
    at = datetime(2026, 1, 1, tzinfo=UTC)

    def entry(phase: ClaimPhase, reason: str | None, **parts: object) -> LedgerEntry:
        settlement = Settlement(key="u/1/1", phase=phase, reason=reason, at=at) if reason else None
        return LedgerEntry.model_validate(
            {"claim": "x", "phase": phase, "settlement": settlement, **parts}
        )

    overrun = Overrun(usage={"tokens": D(25)}, excess={"tokens": D(5)}, at=at)
    entries = [
        entry(CONSUMED, "Completed", reserved={"tokens": D(20)}, consumed={"tokens": D(12)}),
        entry(
            CONSUMED,
            "Completed",
            reserved={"tokens": D(20)},
            consumed={"tokens": D(20)},
            overrun=overrun,
        ),
        entry(ClaimPhase.RUNNING, None, reserved={"tokens": D(20)}),  # not settled
        entry(RELEASED, "Cancelled", reserved={"tokens": D(20)}, released={"tokens": D(20)}),
        entry(ClaimPhase.REJECTED, "TooLarge"),
    ]
    rec = recommend(entries, min_samples=2)
    assert (rec.claims, rec.excluded) == (2, {"Rejected": 1, "Released": 1})
    tokens = only(rec)
    assert (tokens.p95_consumed, tokens.p95_demand, tokens.suggested) == (20, 25, 25)
    sample = Sample.from_entry(entries[1])
    assert sample is not None and sample.excess == {"tokens": 5}


# --- properties -------------------------------------------------------------------------

quantities = st.decimals(min_value=0, max_value=10**6, places=3, allow_nan=False).map(
    lambda d: parse_quantity(format(d, "f"))
)


@st.composite
def settled(draw: st.DrawFn) -> Sample:
    reserved = draw(quantities)
    consumed = draw(quantities.filter(lambda c: c <= reserved))
    excess = draw(quantities) if consumed == reserved and draw(st.booleans()) else D(0)
    phase = draw(st.sampled_from([CONSUMED, CONSUMED, CONSUMED, RELEASED, EXPIRED]))
    return Sample(phase, {"r": reserved}, {"r": consumed}, {"r": excess} if excess else {})


@given(st.lists(settled(), min_size=1, max_size=40))
def test_percentiles_are_ordered_and_the_suggestion_covers_the_p95(samples: list[Sample]) -> None:
    rec = recommend(samples)
    counted = [s for s in samples if s.phase is CONSUMED]
    assert rec.claims == len(counted)
    assert rec.claims + sum(rec.excluded.values()) == len(samples)
    if not counted:
        assert rec.resources == []
        return
    r = only(rec)
    assert r.samples == len(counted)
    values = [s.consumed["r"] for s in counted]
    assert r.p50_consumed in values and r.p95_consumed in values
    assert r.p50_consumed <= r.p95_consumed <= r.max_consumed == max(values)
    assert r.p95_consumed <= r.p95_demand
    if r.p50_ratio is not None and r.p95_ratio is not None:
        assert 0 <= r.p50_ratio <= r.p95_ratio <= 1
    if r.samples < 5:
        assert r.suggested is None
    else:
        assert r.suggested is not None
        assert r.p95_consumed <= r.p95_demand <= r.suggested
        assert r.suggested <= r.p95_demand * D("1.01")  # three significant digits
        assert parse_quantity(format(r.suggested, "f")) == r.suggested  # a valid quantity


def test_overrun_of_a_resource_never_requested_is_demand_for_it() -> None:
    """Found by review: claims that requested only tokens but reported cost were charged
    nothing for cost (R is 0) and the cost they needed was never suggested."""
    samples = [
        Sample(
            phase=ClaimPhase.CONSUMED,
            reserved={"tokens": Decimal(10)},
            consumed={"tokens": Decimal(4)},
            excess={"cost": Decimal(3)},
        )
        for _ in range(6)
    ]
    result = recommend(samples)
    cost = next(r for r in result.resources if r.resource == "cost")
    assert cost.samples == 6 and cost.suggested == Decimal(3)
    assert cost.p50_reserved == 0


# --- by contract (issue 22) -----------------------------------------------------------------

GPU = "nvidia.com/gpu"
REUSABLE, CONSUMABLE, REPLENISHING = (
    ContractType.REUSABLE,
    ContractType.CONSUMABLE,
    ContractType.REPLENISHING,
)


def gpu_and_tokens(tokens: str) -> Sample:
    """A claim of 4 GPUs and 20 tokens that ran: the GPUs all came back (C = 0 for a
    Reusable resource), the tokens it used were committed."""
    return Sample(
        CONSUMED,
        {GPU: D(4), "tokens": D(20)},
        {GPU: D(0), "tokens": parse_quantity(tokens)},
        {},
        "Completed",
        {GPU: REUSABLE, "tokens": CONSUMABLE},
    )


def used_envelope(peak: str, capacity: str = "8", name: str = GPU) -> EnvelopeUse:
    return EnvelopeUse(
        {name: REUSABLE}, {name: parse_quantity(capacity)}, {name: parse_quantity(peak)}
    )


def test_a_reusable_resource_is_judged_by_peak_use_against_capacity_not_c_against_r() -> None:
    """Before contracts, GPUs were judged like tokens: C = 0 for every claim (its devices
    all came back) suggested a request of 0 GPUs."""
    samples = [gpu_and_tokens(t) for t in ("12", "5", "20", "8", "15")]
    # sorted peaks [2, 4, 4, 6, 8]: p50 = 3rd, p95 = 5th; one envelope reached its 8.
    envelopes = [used_envelope(p) for p in ("4", "8", "6", "2", "4")]
    rec = recommend(samples, envelopes=envelopes)
    assert [r.resource for r in rec.resources] == ["tokens"]  # no C/R line for the GPUs
    assert rec.resources[0].contract is CONSUMABLE
    assert rec.resources[0].judged_by == "consumed C against reserved R per claim"
    assert (rec.claims, rec.envelopes) == (5, 5)
    (gpu,) = rec.capacities
    assert (gpu.resource, gpu.contract, gpu.envelopes) == (GPU, REUSABLE, 5)
    assert (gpu.p50_peak, gpu.p95_peak, gpu.max_peak, gpu.p50_capacity) == (4, 8, 8, 8)
    assert (gpu.p50_ratio, gpu.p95_ratio) == (Fraction(1, 2), Fraction(1))
    assert (gpu.at_capacity, gpu.suggested) == (1, D(8))
    assert gpu.judged_by == "peak concurrent use against capacity per envelope"
    assert gpu.explanation == (
        "p95 of the peak in use at once over 5 envelopes is 8, rounded up to 3 significant "
        "digits as the capacity; 1 of 5 envelopes reached their capacity: claims may have "
        "waited, and the need may be higher"
    )


def test_an_envelope_that_never_peaked_near_its_capacity_is_suggested_less() -> None:
    # 20 envelopes of 16 permits: p95 is the 19th smallest peak (5), the maximum (9) is left out.
    peaks = ["2"] * 18 + ["5", "9"]
    rec = recommend([], envelopes=[used_envelope(p, "16", "concurrency") for p in peaks])
    (permits,) = rec.capacities
    assert (permits.p95_peak, permits.max_peak, permits.at_capacity) == (5, 9, 0)
    assert (permits.suggested, permits.p95_ratio) == (D(5), Fraction(5, 16))
    assert "reached" not in permits.explanation


def test_a_replenishing_resource_is_judged_by_its_use_per_window_against_the_limit() -> None:
    def window(peak: str) -> EnvelopeUse:
        return EnvelopeUse(
            {"requests": REPLENISHING, "tokens": CONSUMABLE},
            {"requests": D(600), "tokens": D(1000)},
            {"requests": parse_quantity(peak)},
        )

    # Claims consumed requests (committed into a window): not a request line of their own.
    samples = [
        Sample(
            CONSUMED,
            {"requests": D(10), "tokens": D(100)},
            {"requests": D(3), "tokens": D(40)},
            contracts={"requests": REPLENISHING, "tokens": CONSUMABLE},
        )
    ] * 5
    # sorted peaks [90, 120, 250, 280, 300, 600]: n = 6, p50 = 3rd, p95 = 6th
    rec = recommend(
        samples, envelopes=[window(p) for p in ("120", "600", "250", "90", "300", "280")]
    )
    assert [r.resource for r in rec.resources] == ["tokens"]
    (requests,) = rec.capacities
    assert (requests.contract, requests.envelopes) == (REPLENISHING, 6)
    assert (requests.p50_peak, requests.p95_peak, requests.p50_capacity) == (250, 600, 600)
    assert (requests.at_capacity, requests.suggested) == (1, D(600))
    assert requests.judged_by == "peak use per window against the limit per envelope"
    assert requests.explanation.startswith(
        "p95 of the peak in use within a window over 6 envelopes is 600, rounded up to 3 "
        "significant digits as the limit per window; 1 of 6 envelopes reached their limit"
    )


def test_a_resource_kept_under_two_contracts_in_a_class_gets_a_line_per_contract() -> None:
    """Contracts are per envelope: a class whose envelopes keep `tokens` Consumable in one
    and Replenishing in another is judged each way over the envelopes that keep it so."""
    consumable = Sample(CONSUMED, {"tokens": D(20)}, {"tokens": D(10)}, contracts={})
    replenishing = Sample(
        CONSUMED, {"tokens": D(20)}, {"tokens": D(19)}, contracts={"tokens": REPLENISHING}
    )
    uses = [
        EnvelopeUse({"tokens": CONSUMABLE}, {"tokens": D(100)}, {}),
        EnvelopeUse({"tokens": REPLENISHING}, {"tokens": D(50)}, {"tokens": D(30)}),
    ]
    rec = recommend([consumable, replenishing], min_samples=1, envelopes=uses)
    (line,) = rec.resources
    # Only the Consumable envelope's claim is a sample of C against R.
    assert (line.samples, line.p95_consumed, line.suggested) == (1, 10, 10)
    (window,) = rec.capacities
    assert (window.contract, window.envelopes, window.p95_peak) == (REPLENISHING, 1, 30)


def test_too_few_envelopes_suggest_nothing() -> None:
    rec = recommend([], envelopes=[used_envelope("4")] * 4)
    (gpu,) = rec.capacities
    assert (gpu.envelopes, gpu.suggested) == (4, None)
    assert gpu.explanation == "too few envelopes (4 < 5): no suggestion"
    # A zero capacity has no ratio.
    (zero,) = recommend([], 1, [used_envelope("0", "0")]).capacities
    assert (zero.p50_ratio, zero.p95_ratio, zero.at_capacity) == (None, None, 1)


def test_an_envelope_status_is_read_with_its_contracts_or_the_defaults() -> None:
    pending = ReservationEnvelopeStatus()
    assert EnvelopeUse.from_status(pending) is None  # never opened: held nothing
    status = ReservationEnvelopeStatus.model_validate(
        {
            "phase": "Closed",
            "totals": {"capacity": {GPU: "8", "concurrency": "2", "tokens": "1k", "rpm": "60"}},
            "contracts": {"rpm": "Replenishing"},
            "peak": {GPU: "8", "concurrency": "1", "rpm": "45"},
        }
    )
    use = EnvelopeUse.from_status(status)
    assert use is not None
    assert {name: use.contract(name) for name in use.capacity} == {
        GPU: REUSABLE,  # device resources and concurrency: Reusable by default
        "concurrency": REUSABLE,
        "tokens": CONSUMABLE,
        "rpm": REPLENISHING,
    }
    rec = recommend([], 1, [use])
    assert [(c.resource, c.contract, c.p95_peak) for c in rec.capacities] == [
        ("concurrency", REUSABLE, 1),
        (GPU, REUSABLE, 8),
        ("rpm", REPLENISHING, 45),
    ]
    assert type_of("tokens", {}) is CONSUMABLE and type_of(GPU, {}) is REUSABLE


def test_an_open_envelope_is_a_sample_once_it_has_had_something_in_use() -> None:
    """An envelope just opened has a peak of 0 only because nothing ran yet: counted, it
    would pull the percentiles down. A finished one that never used a resource is a 0."""
    status = ReservationEnvelopeStatus.model_validate(
        {
            "phase": "Open",
            "totals": {"capacity": {GPU: "8", "concurrency": "4"}},
            "peak": {"concurrency": "2"},
        }
    )
    use = EnvelopeUse.from_status(status)
    assert use is not None and not use.finished
    (permits,) = recommend([], 1, [use]).capacities  # no GPU line: none in use yet
    assert (permits.resource, permits.p95_peak) == ("concurrency", 2)
    closed = EnvelopeUse.from_status(status.model_copy(update={"phase": "Closed"}))
    assert closed is not None and closed.finished
    lines = {c.resource: c for c in recommend([], 1, [use, closed]).capacities}
    assert (lines[GPU].envelopes, lines[GPU].max_peak) == (1, 0)
    assert lines["concurrency"].envelopes == 2


@given(
    st.lists(
        st.tuples(quantities, quantities).map(lambda pc: (min(pc), max(pc))),
        min_size=1,
        max_size=30,
    )
)
def test_peak_percentiles_are_ordered_and_the_suggestion_covers_the_p95(
    pairs: list[tuple[Decimal, Decimal]],
) -> None:
    uses = [EnvelopeUse({"slots": REUSABLE}, {"slots": c}, {"slots": p}) for p, c in pairs]
    (line,) = recommend([], envelopes=uses).capacities
    peaks = [p for p, _ in pairs]
    assert line.envelopes == len(pairs)
    assert line.p50_peak in peaks and line.p95_peak in peaks
    assert line.p50_peak <= line.p95_peak <= line.max_peak == max(peaks)
    assert line.at_capacity == sum(1 for p, c in pairs if p >= c)
    if line.p50_ratio is not None and line.p95_ratio is not None:
        assert 0 <= line.p50_ratio <= line.p95_ratio <= 1
    if len(pairs) < 5:
        assert line.suggested is None
    else:
        assert line.suggested is not None
        assert line.p95_peak <= line.suggested <= line.p95_peak * D("1.01")
