"""Kubernetes quantities as exact Decimals.

Every capacity, request and usage figure in Reservoir is a Kubernetes quantity (`8`, `20k`,
`1.5Gi`, `250m`, `12.50`, `1e3`). They are parsed to `Decimal` and never touch a binary
float, so `0.1 + 0.2` tokens of budget is exactly `0.3`.

Reservoir accepts only non-negative quantities with at most nine fractional digits (the
API server's own precision) and at most 10^18 (an exa): anything else is a clear error,
never a silent rounding.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Context, Decimal, InvalidOperation, localcontext

__all__ = [
    "MAX_QUANTITY",
    "MAX_QUANTITY_LENGTH",
    "QUANTITY_PATTERN",
    "QuantityError",
    "ResourceMap",
    "format_quantity",
    "parse_quantity",
    "parse_resources",
]

ResourceMap = dict[str, Decimal]


def _number(digits: int) -> str:
    """A non-negative decimal with at most `digits` fractional digits."""
    if digits == 0:
        return "[0-9]+"
    return f"([0-9]+(\\.[0-9]{{1,{digits}}})?|\\.[0-9]{{1,{digits}}})"


# The one definition of what a quantity may look like, shared by this parser and the CRD
# schema (see reservoir.core.model): a non-negative number and an optional suffix, with no
# more fractional digits than keep the value exact to the nano (1e-9), the API server's
# own precision. So `0.5m` (5e-4) is fine, `0.0000005m` (5e-10) is not, and exponents are
# never negative (write `1m`, not `1e-3`). Whatever the schema accepts, the operator reads.
QUANTITY_PATTERN = (
    "^("
    + "|".join(
        [
            _number(9) + "([KMGTPE]i|[kMGTPE]|[eE][+]?[0-9]{1,2})?",
            _number(6) + "m",
            _number(3) + "u",
            _number(0) + "n",
        ]
    )
    + ")$"
)
_QUANTITY = re.compile(QUANTITY_PATTERN)
MAX_QUANTITY_LENGTH = 40

_SUFFIX: dict[str, Decimal] = {
    "": Decimal(1),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
}

MAX_QUANTITY = Decimal("1e18")
# Enough digits for 2^60 * 999... with nine decimals: arithmetic here is always exact.
_EXACT = Context(prec=60)


class QuantityError(ValueError):
    """A string that is not a non-negative Kubernetes quantity Reservoir can hold exactly."""


def parse_quantity(value: str | int | Decimal) -> Decimal:
    """Parse a quantity to an exact Decimal, or raise `QuantityError` saying why not."""
    if isinstance(value, bool):
        raise QuantityError(f"{value!r} is a boolean, not a quantity")
    if isinstance(value, Decimal):
        number = value
    elif isinstance(value, int):
        number = Decimal(value)
    elif isinstance(value, str):
        # fullmatch: `$` alone would let a trailing newline through, which the API
        # server's pattern does not; no stripping, for the same reason.
        if len(value) > MAX_QUANTITY_LENGTH or _QUANTITY.fullmatch(value) is None:
            raise QuantityError(
                f"{value!r} is not a non-negative Kubernetes quantity "
                "with at most nine decimal places once its unit is applied "
                "(examples: 8, 20k, 1.5Gi, 250m, 12.50, 1e3)"
            )
        mantissa, suffix = _split(value)
        with localcontext(_EXACT):
            if suffix[:1] in ("e", "E") and suffix[1:].lstrip("+").isdigit():
                number = Decimal(mantissa).scaleb(int(suffix[1:]))
            else:
                number = Decimal(mantissa) * _SUFFIX[suffix]
    else:
        raise QuantityError(f"{value!r} ({type(value).__name__}) is not a quantity")
    if not number.is_finite() or number < 0:
        raise QuantityError(f"{value!r} must be a finite, non-negative quantity")
    if number > MAX_QUANTITY:
        raise QuantityError(f"{value!r} is larger than Reservoir's limit of 1E (10^18)")
    normal = _normalize(number)
    exponent = normal.as_tuple().exponent
    if isinstance(exponent, int) and exponent < -9:
        raise QuantityError(f"{value!r} has more than nine fractional digits (nano precision)")
    return normal


def _split(text: str) -> tuple[str, str]:
    """`1.5Gi` → (`1.5`, `Gi`); `2e3` → (`2`, `e3`); `1E` → (`1`, `E`), an exa."""
    end = 0
    while end < len(text) and (text[end].isdigit() or text[end] == "."):
        end += 1
    return text[:end], text[end:]


def _normalize(number: Decimal) -> Decimal:
    """One representation per value, so equal quantities compare and hash alike."""
    with localcontext(_EXACT):
        normal = number.normalize()
    # normalize() turns 20000 into 2E+4; keep integers as integers for readable output.
    return normal.quantize(Decimal(1)) if normal == normal.to_integral_value() else normal


def format_quantity(value: Decimal) -> str:
    """The canonical text of a quantity: plain decimal notation, no exponent, no trailing
    zeros (`20000`, `12.5`, `0.25`). The API server accepts it back unchanged."""
    if not isinstance(value, Decimal):
        raise QuantityError(f"{value!r} is not a Decimal")
    try:
        text = format(_normalize(value), "f")
    except InvalidOperation as error:  # pragma: no cover - Decimal invariants
        raise QuantityError(str(error)) from error
    return text


def parse_resources(values: Mapping[str, str | int | Decimal]) -> ResourceMap:
    """Parse a resource map (`{"tokens": "20k"}`), naming the resource on error."""
    parsed: ResourceMap = {}
    for name, raw in values.items():
        try:
            parsed[name] = parse_quantity(raw)
        except QuantityError as error:
            raise QuantityError(f"{name}: {error}") from None
    return parsed
