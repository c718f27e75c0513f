"""A compensation as the SDK and `kubectl reservoir compensate` ask it: a signed amount per
resource (positive: a follow-up charge; negative: a reversal, or the void of an external
authorization), a reason and a business reference, idempotent by a key.

The claim's spec holds quantities that are never negative, so the signed amount is split
into `charge` and `refund`. The key defaults to a hash of what is asked, so a retried call
(the answer lost, the process restarted) finds its own compensation and writes nothing;
the append is a JSON patch that tests the list as read (reservoir.sdk.patches
.compensation_patch), so two writers never lose one."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from pydantic import ValidationError

from reservoir.core.model import COMPENSATION_KEY, MAX_COMPENSATIONS, Compensation
from reservoir.core.quantity import QuantityError, format_quantity, parse_quantity
from reservoir.sdk.errors import CompensationError

_KEY = re.compile(COMPENSATION_KEY)


def signed(value: Decimal | str | int) -> Decimal:
    """A signed quantity: `-2.50`, `+100`, `1.5k`, or a Decimal."""
    if isinstance(value, Decimal | int) and not isinstance(value, bool):
        return -parse_quantity(-value) if value < 0 else parse_quantity(value)
    if isinstance(value, str) and value[:1] in ("-", "+"):
        magnitude = parse_quantity(value[1:])
        return -magnitude if value[0] == "-" else magnitude
    return parse_quantity(value)


def default_key(amount: Mapping[str, Decimal], reason: str, reference: str | None) -> str:
    """The same compensation asked again gets the same key: a stable hash of its amounts
    (canonical quantities), its reason and its reference."""
    asked = {
        "amount": {name: _text(value) for name, value in sorted(amount.items())},
        "reason": reason,
        "reference": reference,
    }
    digest = hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()
    return f"c-{digest[:40]}"


def _text(value: Decimal) -> str:
    return format_quantity(value) if value >= 0 else "-" + format_quantity(-value)


def compensation_request(
    amount: Mapping[str, Decimal | str | int],
    reason: str,
    reference: str | None = None,
    key: str | None = None,
) -> Compensation:
    """The compensation to append, or `CompensationError` saying what is wrong with it."""
    if not amount:
        raise CompensationError("a compensation needs an amount, e.g. cost=-2.50 or tokens=100")
    parsed: dict[str, Decimal] = {}
    for name, value in amount.items():
        try:
            parsed[name] = signed(value)
        except QuantityError as error:
            raise CompensationError(f"{name}: {error} (a sign is allowed: -2.50)") from None
        if parsed[name] == 0:
            raise CompensationError(
                f"{name}: a zero amount moves nothing (positive charges, negative refunds)"
            )
    if not reason or not reason.strip():
        raise CompensationError("a compensation needs a reason (a person's words, for the record)")
    if key is not None and _KEY.fullmatch(key) is None:
        raise CompensationError(
            f"key {key!r}: letters, digits and -_.:, starting with a letter or digit, "
            "at most 63 characters"
        )
    body: dict[str, Any] = {
        "key": key or default_key(parsed, reason, reference),
        "charge": {n: format_quantity(v) for n, v in parsed.items() if v > 0},
        "refund": {n: format_quantity(-v) for n, v in parsed.items() if v < 0},
        "reason": reason,
    }
    if reference is not None:
        body["reference"] = reference
    try:
        return Compensation.model_validate(body)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors()
        )
        raise CompensationError(f"not a valid compensation: {problems}") from None


def already_sent(sent: list[Compensation], wanted: Compensation, claim: str) -> bool:
    """Whether the claim holds this compensation already (a retried call: nothing to
    write). Its key naming another compensation, or a full list, is an error."""
    for existing in sent:
        if existing.key == wanted.key:
            if existing != wanted:
                raise CompensationError(
                    f"branchclaim/{claim}: key {wanted.key!r} already names another "
                    f"compensation ({existing.reason!r}): a new one needs a new key"
                )
            return True
    if len(sent) >= MAX_COMPENSATIONS:
        raise CompensationError(
            f"branchclaim/{claim} already holds {MAX_COMPENSATIONS} compensations, the most "
            "a claim keeps: nothing was written"
        )
    return False
