"""The audits' check of reservoir.core.quiet: a pass that passes quiet settled claims by
decides exactly what a pass that walks every claim decides."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from reservoir.core.quiet import QuietClaims
from reservoir.core.reconcile import Reconciliation


def passing_quiet_by(
    decide: Callable[[QuietClaims | None], Reconciliation], quiet: QuietClaims | None
) -> Reconciliation:
    """`decide(quiet)` once with the previous pass's quiet claims and once without: the two
    must be the same in everything, the claims found quiet included."""
    result = decide(quiet)
    walked = decide(None)
    assert comparable(result) == comparable(walked), "passing quiet claims by changed the pass"
    return result


def comparable(result: Reconciliation) -> Reconciliation:
    """The pass's outcome, with the retry holds in use counted: they are named by the
    id() of objects each pass copies afresh."""
    return replace(result, holds_in_use={len(result.holds_in_use)})
