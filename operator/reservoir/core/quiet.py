"""Settled claims a pass may pass by.

A claim settled long ago keeps its record in its own status, and every pass of its
envelope still walks it (step 2 of reservoir.core.reconcile: late reports, a provider's
late answer, compensations, a retry hold's window). With hundreds of settled claims per
envelope that walk (a deep copy, the lifecycle's checks, a comparison per claim) was the
largest cost of a pass, and passes come once per admission.

A settled claim is *quiet* when step 2 left its record exactly as it was and nothing that
is not in its facts can move it later:
- no provider answer in this pass (an answer, or a lookup coming due, is news);
- no retry hold open (its window closes with the clock or the envelope);
- no compensation it has not recorded (one may wait for room, or for the byte budget);
- not deferred for room (a late completion waiting to fit back in the ledger).

The clock, the balance and the byte budget reach a settled record only through those, so a
quiet record stays as it is for as long as its facts and its envelope's terms (policy,
resources, contracts) are the same: the next pass passes it by. Equal facts are the same
facts, whatever object carries them; a change in either makes the claim walked again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from reservoir.core.compensation import waiting
from reservoir.core.lifecycle import ClaimFacts, LedgerEvent
from reservoir.core.model import Contract, EnvelopePolicy, LedgerEntry


@dataclass(frozen=True)
class Terms:
    """What of its envelope step 2 reads besides the clock and the balance."""

    policy: EnvelopePolicy
    dimensions: frozenset[str]
    contracts: Mapping[str, Contract]


@dataclass(frozen=True)
class QuietClaims:
    """Settled claims found quiet by a pass: claim uid -> the facts it was found quiet on,
    under the envelope's `terms` of that pass."""

    terms: Terms | None = None
    facts: Mapping[str, ClaimFacts] = field(default_factory=dict)

    def passes_by(self, facts: ClaimFacts, terms: Terms) -> bool:
        """Whether this claim, with these facts under these terms, is still quiet (facts
        found quiet carry no provider answer, so neither do equal ones)."""
        seen = self.facts.get(facts.uid)
        return seen is not None and seen == facts and self.terms == terms


def stays_quiet(
    record: LedgerEntry,
    facts: ClaimFacts,
    adjusted: bool,
    events: list[LedgerEvent],
) -> bool:
    """Whether a settled record step 2 left as `facts.settled_record` stays so while its
    facts and terms do (`adjusted`: step 2 was allowed to adjust it in this pass)."""
    hold = record.retry
    return (
        adjusted
        and not events
        and facts.provider is None
        and (hold is None or not hold.active)
        and not waiting(record, facts.spec.compensations)
    )
