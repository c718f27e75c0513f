from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reservoir.core.quantity import QuantityError, format_quantity, parse_quantity


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("8", Decimal(8)),
        ("20k", Decimal(20000)),
        ("1.5Gi", Decimal(1610612736)),
        ("250m", Decimal("0.25")),
        ("12.50", Decimal("12.5")),
        ("1e3", Decimal(1000)),
        ("2M", Decimal(2_000_000)),
        ("100n", Decimal("0.0000001")),
        ("0", Decimal(0)),
        (".5", Decimal("0.5")),
    ],
)
def test_kubernetes_quantities_parse_exactly(text: str, value: Decimal) -> None:
    assert parse_quantity(text) == value


def test_no_binary_float_rounding_ever() -> None:
    assert parse_quantity("0.1") + parse_quantity("0.2") == parse_quantity("0.3")


@pytest.mark.parametrize(
    "bad",
    ["-1", "1.5.5", "abc", "", "1 k", "1KB", "0x10", "1e99", "0.0000000001", "NaN", "inf", "1ki"],
)
def test_anything_else_is_a_clear_error(bad: str) -> None:
    with pytest.raises(QuantityError):
        parse_quantity(bad)


@pytest.mark.parametrize("bad", [1.5, True, None, [1]])
def test_non_string_garbage_is_rejected(bad: object) -> None:
    with pytest.raises(QuantityError):
        parse_quantity(bad)  # type: ignore[arg-type]


def test_canonical_format_is_plain_decimal() -> None:
    assert [format_quantity(parse_quantity(q)) for q in ["20k", "12.50", "250m", "1e3"]] == [
        "20000",
        "12.5",
        "0.25",
        "1000",
    ]


@given(st.decimals(min_value=0, max_value=10**15, places=9, allow_nan=False))
def test_format_then_parse_round_trips(value: Decimal) -> None:
    assert parse_quantity(format_quantity(value)) == value
