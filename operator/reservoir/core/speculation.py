"""Speculative copies of one branch, one winner (child-settlement.txt: "Retries and
speculative copies should normally receive distinct attempt identifiers"; "When one attempt
wins, cancel the others").

Claims of one envelope that share `spec.speculationGroup` are copies of one branch. The
winner is decided on recorded lines only, as the pass finds them before it moves anything:

- a winner already recorded stays the winner: on the envelope (`status.speculation`, kept
  for the envelope's life, so it outlives the winner's claim), or on a loser's line;
- else, by the envelope's `policy.speculationWinner`: FirstCommit, the copy whose line
  recorded its commit point first (`committedAt`); FirstSuccess, the copy whose line
  recorded it settled Consumed with outcome Succeeded first. Ties (copies recorded in the
  same pass) go to the lowest claim name.

Every other copy of the group that has not settled is superseded: its facts read as a
cancel, so it settles by its own facts as any cancelled claim does (released at once
before its commit point; after it, a cancel request that waits for its usage), and its line
records the winner once. A copy that declared its dispatch is past its commit point whether
or not the operator recorded that before the winner's: it is never released as unrun.

Which copy wins can depend on what the operator saw apart: two copies dispatched between
two of its looks are recorded committed in the same pass, and the name breaks the tie; seen
apart, the first seen wins. No capacity moves differently (both committed, each settles by
its own usage); only which one is asked to cancel does. The API server records no order
between two writes to different objects that could decide it instead."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from reservoir.core.lifecycle import ClaimFacts
from reservoir.core.model import ClaimPhase, LedgerEntry, Outcome, SpeculationWinner


def winners(
    facts: Mapping[str, ClaimFacts],
    lines: Mapping[str, LedgerEntry],
    rule: SpeculationWinner,
    kept: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Each speculation group with a winner -> the winning claim's name. `facts`: claim
    uid -> facts; `lines`: claim uid -> its line as the pass read it (a settled claim whose
    record is its own status is found through its facts); `kept`: the winners the envelope
    recorded (its `status.speculation`), which outlive the winners' claims."""
    recorded: dict[str, set[str]] = {group: {name} for group, name in (kept or {}).items()}
    candidates: dict[str, list[tuple[datetime, str]]] = {}
    for uid, claim in facts.items():
        group = claim.spec.speculation_group
        if group is None:
            continue
        line = lines.get(uid) or claim.settled_record
        if line is None:
            continue
        if line.superseded_by is not None:
            recorded.setdefault(group, set()).add(line.superseded_by)
        won_at = _won_at(line, rule)
        if won_at is not None and line.superseded_by is None:
            candidates.setdefault(group, []).append((won_at, claim.name))
    decided = {group: min(names) for group, names in recorded.items()}
    for group, found in candidates.items():
        decided.setdefault(group, min(found)[1])
    return decided


def superseded(
    decided: Mapping[str, str],
    facts: Mapping[str, ClaimFacts],
    lines: Mapping[str, LedgerEntry],
) -> dict[str, str]:
    """Claim uid -> the winner's name, for every copy that lost and has not settled
    (`decided`: each group's winner, from `winners`)."""
    lost: dict[str, str] = {}
    for uid, claim in facts.items():
        group = claim.spec.speculation_group
        winner = decided.get(group) if group is not None else None
        if winner is None or winner == claim.name:
            continue
        line = lines.get(uid) or claim.settled_record
        if line is not None and line.settlement is not None:
            continue  # settled already: by its own facts, before or without losing
        lost[uid] = winner
    return lost


def _won_at(line: LedgerEntry, rule: SpeculationWinner) -> datetime | None:
    if rule is SpeculationWinner.FIRST_COMMIT:
        return line.committed_at
    settled = line.settlement
    if settled is None or settled.phase is not ClaimPhase.CONSUMED:
        return None
    return settled.at if settled.outcome is Outcome.SUCCEEDED else None
