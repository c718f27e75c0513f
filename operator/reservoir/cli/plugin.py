"""`kubectl reservoir ...`: the SDK's verbs from a shell, plus an envelope's ledger.

    kubectl reservoir hold ENVELOPE BRANCH tokens=20k [cost=2] [--dispatch] [--name N]
    kubectl reservoir dispatch|cancel|renew|get CLAIM
    kubectl reservoir usage CLAIM tokens=5k            # cumulative usage so far
    kubectl reservoir finish CLAIM tokens=12k --outcome Succeeded [--result s3://b/out]
    kubectl reservoir result CLAIM [-n NS]              # phase, outcome, result reference, C
    kubectl reservoir history CLAIM [-n NS]             # the claim's recorded transitions
    kubectl reservoir compensate CLAIM --amount cost=-2.50 --reason "refund"  # after settlement
        [--amount tokens=100] [--reference INV-7] [--key K]
    kubectl reservoir ledger ENVELOPE                   # and its child envelopes, as a tree
    kubectl reservoir pool POOL                         # a ReservationPool and its envelopes
    kubectl reservoir why CLAIM | renv/ENVELOPE         # why it waits, who is ahead of it
    kubectl reservoir recommend CLASS [-n NS | -A] [-o json]   # right-sizing, by contract

Claims created by `hold` name a lease holder, and only that holder may dispatch or renew
them. Every invocation uses the same holder, `--holder` (default: $RESERVOIR_HOLDER, else
kubectl-reservoir/USER@HOST), so the verbs of one person on one machine go together.
A refusal exits non-zero with a one-line reason.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
import unicodedata
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from decimal import Decimal
from fractions import Fraction

from lightkube import ApiError

from reservoir.cli.tables import table
from reservoir.cli.why import explain_claim, explain_envelope, shares_table
from reservoir.core.childlines import LOST_CHILDREN_PREFIX
from reservoir.core.inflight import newest
from reservoir.core.ledger import ZERO, render, render_each
from reservoir.core.model import (
    MAX_DEPTH,
    Adjustment,
    BranchClaimStatus,
    ChildEntry,
    ChildPhase,
    ClaimPhase,
    Compensation,
    CompensationRecord,
    ContractType,
    EnvelopePhase,
    LedgerEntry,
    ParentKind,
    ResourceTotals,
    RetryHold,
    Transition,
    WindowSlice,
)
from reservoir.core.quantity import QuantityError, format_quantity
from reservoir.core.rightsizing import (
    SUGGESTS,
    EnvelopeUse,
    Recommendation,
    Sample,
    recommend,
    round_ratio,
)
from reservoir.k8s.resources import WORKFLOW_CLASS_LABEL
from reservoir.sdk import (
    ClaimView,
    EnvelopeTree,
    EnvelopeView,
    PoolView,
    Reservoir,
    ReservoirError,
    ResultView,
)
from reservoir.sdk.client import HOLDER_ENV


def resources(pairs: Sequence[str]) -> dict[str, str]:
    parsed: dict[str, str] = {}
    for pair in pairs:
        name, sep, amount = pair.partition("=")
        if not sep or not name or not amount:
            raise ReservoirError(f"{pair!r}: expected RESOURCE=QUANTITY, e.g. tokens=20k")
        if name in parsed:
            # The last one would win silently (found by review: a refund then a charge of
            # the same resource sent only the charge).
            raise ReservoirError(f"{name} is given twice ({parsed[name]} and {amount}): once")
        parsed[name] = amount
    return parsed


def visible(text: str, *, keep_newlines: bool = False) -> str:
    """The text with every control character shown as an escape (`\\x1b`, `\\u202e`):
    a result reference or a reason comes from a worker, a provider or a Job, and printed raw
    an escape sequence would drive the reader's terminal (move the cursor, rewrite what was
    printed, set the window title) and a bidirectional override would reorder the line.
    Newlines are kept only in text this plugin laid out itself."""
    shown = []
    for char in text:
        if (char == "\n" and keep_newlines) or unicodedata.category(char) not in ("Cc", "Cf"):
            shown.append(char)
        else:
            shown.append(char.encode("unicode_escape").decode("ascii"))
    return "".join(shown)


def default_holder() -> str:
    """One holder per person and machine: the plugin runs as a new process every time."""
    held = os.environ.get(HOLDER_ENV)
    if held:
        return held
    try:
        user = getpass.getuser()
    except (OSError, KeyError):
        user = "unknown"
    return f"kubectl-reservoir/{user}@{os.uname().nodename}"


def show_claim(view: ClaimView) -> str:
    """The claim as its ledger entry records it (the claim's status when it has none)."""
    record = view.entry if view.entry is not None else view.status
    expires = view.ledger_expires_at
    shown = table(
        [
            ["NAME", "ENVELOPE", "BRANCH", "PHASE", "DECLARED", "RESERVED", "USAGE", "EXPIRES"],
            [
                view.name,
                view.spec.envelope,
                view.spec.branch or "-",
                view.ledger_phase.value + ("/deleting" if view.deleting else ""),
                view.spec.declared,
                render(record.reserved) or "-",
                render(record.usage) or "-",
                expires.strftime("%H:%M:%S") if expires else "-",
            ],
        ]
    )
    group = view.speculation_group
    if group is None:
        return shown
    lost = view.superseded_by
    said = f"lost to {lost}, cancelled" if lost else "not superseded"
    return f"{shown}\nspeculation group {group}: {said}"


def claim_row(name: str, branch: str, record: LedgerEntry | BranchClaimStatus) -> list[str]:
    """A claim's line: from its ledger entry, or from its status once a settled entry was
    compacted out of the ledger. The last cell is its occupancy (Reusable resources, R ×
    seconds held), shown only when some claim has one."""
    return [
        name,
        branch or "-",
        record.phase.value,
        render(record.reserved) or "-",
        render(record.consumed) or "-",
        render(record.released) or "-",
        record.settlement.reason if record.settlement else "-",
        render(record.occupancy) or "-",
    ]


def timestamp(at: datetime | None) -> str:
    """`2025-01-01T12:00:00Z`: a recorded time, in UTC, to the second."""
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if at else "-"


def settled_amounts(consumed: Mapping[str, Decimal], released: Mapping[str, Decimal]) -> str:
    """`C tokens=12k, R−C tokens=8k`: what settlement committed and what it returned."""
    return f"C {render(consumed) or '-'}, R−C {render(released) or '-'}"


def show_result(view: ResultView) -> str:
    """What became of a claim: its phase, outcome and result reference, C and R − C."""
    if view.settled:
        settled = f"{visible(view.reason or '-')}, settled {timestamp(view.settled_at)}"
        outcome = view.outcome.value if view.outcome else "none reported"
        amounts = settled_amounts(view.consumed, view.released)
    else:
        settled = "not settled yet"
        outcome = "- (not settled yet)"
        amounts = f"R {render(view.reserved) or '-'} held, nothing settled yet"
    lines = [
        f"branchclaim {view.namespace}/{view.name}: {view.phase.value} ({settled})",
        f"outcome: {outcome}",
        f"result:  {visible(view.result or '- (none recorded)')}",
        f"amounts: {amounts}",
    ]
    if view.occupancy:
        lines.append(occupancy_line(view.occupancy))
    if view.adjustment is not None:
        lines.append(adjustment_line(view.adjustment))
    if view.retry is not None:
        lines.append(retry_line(view.retry))
    return "\n".join(lines)


def occupancy_line(occupancy: Mapping[str, Decimal]) -> str:
    """What a claim's Reusable resources were used for: R × seconds held, all returned."""
    return f"occupancy: {render(occupancy)} (R × seconds held; returned in full, not charged)"


def transition_amounts(move: Transition, record: LedgerEntry | BranchClaimStatus) -> str:
    """R on the move that reserved it (out of Pending into a phase that holds capacity);
    C and R − C on the move into a terminal phase; nothing on the others."""
    if move.to.terminal and move.from_phase is move.to:  # a late completion's adjustment
        adjustment = record.adjustment
        if adjustment is None:
            return "-"
        return adjustment_moves(adjustment) or "-"
    if move.to.terminal:
        return settled_amounts(record.consumed, record.released)
    if move.from_phase is ClaimPhase.PENDING and move.to.holds_capacity:
        return f"R {render(record.reserved) or '-'}"
    return "-"


def history_table(record: LedgerEntry | BranchClaimStatus) -> str:
    """One row per recorded transition, oldest first."""
    if not record.history:
        return "(no transitions recorded)"
    rows = [["TIME", "FROM → TO", "REASON", "TRIGGER", "LEASE-GEN", "AMOUNTS"]]
    rows += [
        [
            timestamp(move.at),
            f"{move.from_phase.value} → {move.to.value}",
            move.reason,
            move.trigger.value,
            str(move.lease_generation),
            transition_amounts(move, record),
        ]
        for move in record.history
    ]
    return table(rows)


def adjustment_moves(adjustment: Adjustment) -> str:
    """What a late completion moved: returned and charged, "" if nothing."""
    parts = [
        f"returned {render(adjustment.returned)}" if adjustment.returned else "",
        f"charged {render(adjustment.charged)}" if adjustment.charged else "",
    ]
    return ", ".join(part for part in parts if part)


def adjustment_line(adjustment: Adjustment) -> str:
    """A late completion after a deadline decision: returned or charged, applied or only
    recorded. The settlement itself is never changed."""
    what = adjustment_moves(adjustment) or "nothing to move"
    how = "applied" if adjustment.applied else "recorded only (not applied to the envelope)"
    outcome = f", outcome {adjustment.outcome.value}" if adjustment.outcome else ""
    return f"adjustment at {timestamp(adjustment.at)} (late report{outcome}): {what}; {how}"


def retry_line(retry: RetryHold) -> str:
    """What a failed attempt keeps for the branch's next attempt, and what became of it."""
    line = (
        f"retry: {render(retry.resources) or '-'} held for the next attempt "
        f"until {timestamp(retry.until)}"
    )
    if retry.taken_by:
        return f"{line}; taken by {retry.taken_by}"
    if retry.returned:
        return f"{line}; returned to the envelope (window closed)"
    return line


def compensation_line(record: CompensationRecord) -> str:
    """A compensation as recorded: what it moved, applied or only recorded, and why."""
    moved = render_each(("refunded", record.refunded), ("charged", record.charged))
    how = "applied" if record.applied else "recorded only (not applied to the envelope)"
    line = (
        f"compensation {record.key} at {timestamp(record.at)}: {moved or 'nothing moved'}; "
        f"{how}; reason: {visible(record.reason)}"
    )
    if record.reference:
        line += f"; reference: {visible(record.reference)}"
    if record.note:
        line += f" ({visible(record.note)})"
    return line


def waiting_compensation_line(asked: Compensation, settled: bool) -> str:
    """A compensation the claim's spec asks that its record does not hold yet."""
    amounts = render_each(("refund", asked.refund), ("charge", asked.charge))
    why = "being applied" if settled else "waits for the claim's settlement"
    return (
        f"compensation {asked.key}: {amounts or '-'} asked, {why}; reason: {visible(asked.reason)}"
    )


def history_lines(
    name: str, record: LedgerEntry | BranchClaimStatus, asked: Sequence[Compensation] = ()
) -> list[str]:
    """The transitions table, then the adjustment, the retry hold and the compensations
    (recorded, then those asked and not recorded yet) when there are."""
    lines = [f"branchclaim {name}: {record.phase.value}", history_table(record)]
    if record.adjustment is not None:
        lines.append(adjustment_line(record.adjustment))
    if record.retry is not None:
        lines.append(retry_line(record.retry))
    lines += [compensation_line(c) for c in record.compensations]
    recorded = {c.key for c in record.compensations}
    settled = record.settlement is not None
    lines += [waiting_compensation_line(a, settled) for a in asked if a.key not in recorded]
    return lines


def show_history(view: ClaimView) -> str:
    """A claim's durable history, from its authoritative record (ledger entry, else
    status): it outlives the claim's Events and its worker."""
    name = f"{view.namespace}/{view.name}"
    return "\n".join(history_lines(name, view.record, view.spec.compensations))


TOTALS = ("capacity", "committed", "reserved", "reconciling", "available")
INDENT = "  "
# The contracts whose use comes back (when a claim ends, or when its window passes): their
# peak in use at once is what right-sizes them.
PEAKED = frozenset({ContractType.REUSABLE, ContractType.REPLENISHING})


def duration(seconds: int) -> str:
    """`20s`, `5m`, `1h`, `90s`: a window's length as it was declared, in its largest
    whole unit."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def totals_table(
    totals: ResourceTotals,
    contracts: Mapping[str, ContractType] | None = None,
    peak: Mapping[str, Decimal] | None = None,
    window_seconds: Mapping[str, int] | None = None,
) -> str:
    """Per resource: its contract, capacity, committed, reserved, reconciling, available;
    lent and borrowed when the envelope has loans with siblings; the peak in use at once
    when a resource is Reusable or Replenishing, and the window when one is Replenishing.
    A Reusable resource's committed is always 0: all of R returns when a claim ends."""
    if not totals.capacity:
        return "(no totals recorded yet)"
    contracts = contracts or {}
    peak = peak or {}
    window_seconds = window_seconds or {}
    kinds = {contracts.get(resource) for resource in totals.capacity}
    parts = [*TOTALS[:-1], *(p for p in ("lent", "borrowed") if getattr(totals, p)), TOTALS[-1]]
    peaks = bool(kinds & PEAKED)
    windows = ContractType.REPLENISHING in kinds
    header = ["RESOURCE", "CONTRACT", *(part.upper() for part in parts)]
    rows = [header + ["PEAK"] * peaks + ["WINDOW"] * windows]
    for resource in sorted(totals.capacity):
        contract = contracts.get(resource)
        row = [resource, contract.value if contract else "-"]
        row += [format_quantity(getattr(totals, part).get(resource, ZERO)) for part in parts]
        if peaks:
            row.append(format_quantity(peak.get(resource, ZERO)) if contract in PEAKED else "-")
        if windows:
            length = window_seconds.get(resource)
            shown = duration(length) if length else "?"
            row.append(shown if contract is ContractType.REPLENISHING else "-")
        rows.append(row)
    return table(rows)


def window_lines(
    windows: Mapping[str, Sequence[WindowSlice]], window_seconds: Mapping[str, int]
) -> list[str]:
    """For each Replenishing resource with consumption still in its window: how much, and
    when each slice of it returns (a sliding window: never before one window has passed
    since its settlement, at most one slice after)."""
    lines = []
    for resource in sorted(windows):
        slices = sorted(windows[resource], key=lambda part: part.returns_at)
        if not slices:
            continue
        length = window_seconds.get(resource)
        within = f"its {duration(length)} window" if length else "its window"
        total = format_quantity(sum((part.amount for part in slices), ZERO))
        returns = ", ".join(
            f"{format_quantity(part.amount)} at {timestamp(part.returns_at)}" for part in slices
        )
        lines.append(f"window {resource}: {total} committed in {within}, returning {returns}")
    return lines


def indented(text: str, level: int) -> str:
    return "\n".join(INDENT * level + line if line else line for line in text.split("\n"))


def drawn_from(view: EnvelopeView) -> str | None:
    """Where the envelope's capacity comes from, as its status records it (`spec.parent`
    while it has no record yet)."""
    record = view.status.parent
    if record is None:
        if view.parent:
            return f"parent {ParentKind.ENVELOPE.value} {view.parent} (not admitted yet)"
        return None
    if record.kind is ParentKind.ROOT:
        return f"root: its own capacity (depth {record.depth})"
    if record.admitted_at is None:
        return f"withdrawn from {record.kind.value} {record.name} (never admitted)"
    return f"drawn from {record.kind.value} {record.name} (depth {record.depth})"


def envelope_header(view: EnvelopeView) -> str:
    """`envelope NS/NAME: PHASE, drawn from KIND NAME (depth D)`, and why it waits when
    it is Pending."""
    status = view.status
    header = f"envelope {view.namespace}/{view.name}: {status.phase.value}"
    where = drawn_from(view)
    if where:
        header += f", {where}"
    if status.phase is EnvelopePhase.PENDING:
        header += f"; queued: {status.queue_reason or 'no reason recorded yet'}"
    return header


def child_line(parent: str, entry: ChildEntry | None) -> str:
    """A child envelope's line in its parent's ledger: R held, or C kept and R − C
    returned."""
    where = f"line in {parent}:"
    if entry is None:
        return f"{where} none (not admitted)"
    if entry.phase is ChildPhase.RESERVED:
        return f"{where} Reserved {render(entry.reserved) or '-'}"
    return (
        f"{where} Settled ({entry.reason or '-'}): reserved {render(entry.reserved) or '-'}, "
        f"consumed {render(entry.consumed) or '-'}, released {render(entry.released) or '-'}"
    )


def envelope_ledger(view: EnvelopeView, claims: Sequence[ClaimView] = ()) -> list[str]:
    """One envelope's header, totals (with each resource's contract) and claims: each
    claim's line (its own, or the envelope's copy while a move of it is in flight), the
    lines in flight of claims gone, and the settled claims that carry only a record."""
    status = view.status
    totals = totals_table(status.totals, view.contracts, view.peak, view.window_seconds)
    lines = [envelope_header(view), totals, *window_lines(view.windows, view.window_seconds), ""]
    listed = [
        claim_row(e.claim, e.branch, e)
        for uid, e in status.entries.items()
        if uid not in {c.uid for c in claims}
    ]
    for c in claims:
        line = newest(status.entries.get(c.uid), c.status.ledger)
        if line is not None:
            listed.append(claim_row(c.name, c.spec.branch, line))
        elif c.status.settlement is not None:
            listed.append(claim_row(c.name, c.spec.branch, c.status))
    rows = [["CLAIM", "BRANCH", "PHASE", "RESERVED", "CONSUMED", "RELEASED", "SETTLED"]]
    if any(row[-1] != "-" for row in listed):
        rows[0].append("OCCUPANCY")  # Reusable resources: R × seconds held
    else:
        listed = [row[:-1] for row in listed]
    rows += sorted(listed, key=lambda row: (row[1], row[0]))
    lines.append(table(rows) if len(rows) > 1 else "(no claims in the ledger)")
    compensated: list[tuple[str, LedgerEntry | BranchClaimStatus]] = [
        (e.claim, e)
        for uid, e in status.entries.items()
        if e.compensations and uid not in {c.uid for c in claims}
    ]
    for c in claims:
        record: LedgerEntry | BranchClaimStatus | None = newest(
            status.entries.get(c.uid), c.status.ledger
        )
        record = record or (c.status if c.status.settlement is not None else None)
        if record is not None and record.compensations:
            compensated.append((c.name, record))
    if compensated:
        lines.append("\ncompensations:")
        lines += [
            f"{INDENT}{claim}: {compensation_line(c)}"
            for claim, record in sorted(compensated, key=lambda item: item[0])
            for c in record.compensations
        ]
    if status.balance_released:
        lines.append(f"\nbalance released at close: {render(status.balance_released)}")
    return lines


def tree_lines(tree: EnvelopeTree, level: int = 1) -> list[str]:
    """The envelope's ledger, then each child envelope's (its line in this ledger first),
    indented one step per level: at most MAX_DEPTH levels."""
    view = tree.envelope
    lines = envelope_ledger(view, tree.claims)
    if level >= MAX_DEPTH or tree.children is None:
        records = view.status.child_records
        below = len(view.status.children) + (records.count if records is not None else 0)
        if below:
            lines.append(
                f"\n({below} child envelope line(s) below the depth bound "
                f"of {MAX_DEPTH} not shown: run `ledger` on a child)"
            )
        return lines
    orphans = tree.orphan_lines()
    if not tree.children and not orphans:
        return lines
    lines += ["", f"child envelopes of {view.name} ({len(tree.children) + len(orphans)}):"]
    for child in tree.children:
        block = tree_lines(child, level + 1)
        block.insert(1, child_line(view.name, tree.line(child.envelope)))
        lines += ["", indented("\n".join(block), 1)]
    for uid, entry in sorted(orphans.items(), key=lambda item: (item[1].envelope, item[0])):
        gone = f"envelope {entry.namespace or view.namespace}/{entry.envelope}: not found ({uid})"
        if uid.startswith(LOST_CHILDREN_PREFIX):
            gone = (
                f"{uid}: held for child envelopes removed by hand (settle it by name with "
                "reservoir.dev/force-settle-gone once you know what they used)"
            )
        lines += ["", indented(f"{gone}\n{child_line(view.name, entry)}", 1)]
    return lines


def show_ledger(tree: EnvelopeTree | EnvelopeView, claims: Sequence[ClaimView] = ()) -> str:
    """The envelope's totals and claims, then its child envelopes' (recursively, indented),
    each with its line in its parent's ledger. An EnvelopeView alone is shown without its
    children."""
    if isinstance(tree, EnvelopeView):
        tree = EnvelopeTree(tree, tuple(claims))
    return "\n".join(tree_lines(tree))


def show_pool(pool: PoolView) -> str:
    """A ReservationPool's totals and its envelopes' lines (R held, or C kept and R − C
    returned)."""
    status = pool.status
    header = f"pool {pool.name}: namespaces {', '.join(pool.namespaces) or '-'}"
    waiting = status.counts.get("Pending", 0)
    if waiting:
        header += f"; {waiting} envelope(s) waiting"
    totals = totals_table(status.totals, pool.contracts, pool.peak, pool.window_seconds)
    lines = [header, totals, *window_lines(pool.windows, pool.window_seconds), ""]
    if not pool.complete:
        lines.append("(some namespaces could not be listed: their envelopes' lines are missing)")
    rows = [["ENVELOPE", "PHASE", "RESERVED", "CONSUMED", "RELEASED", "SETTLED"]]
    rows += sorted(
        [
            f"{entry.namespace}/{entry.envelope}",
            entry.phase.value,
            render(entry.reserved) or "-",
            render(entry.consumed) or "-",
            render(entry.released) or "-",
            entry.reason or "-",
        ]
        for entry in pool.lines().values()
    )
    lines.append(table(rows) if len(rows) > 1 else "(no envelopes in the pool's ledger)")
    if status.shares:
        lines += ["", "fair share (lowest weighted dominant share goes first):"]
        lines.append(shares_table(status.shares))
    if status.preemptions:
        lines += ["", "asked to give their room (preemption of tentative holds, undecided):"]
        rows = [["ENVELOPE", "FOR", "CLASS", "ASKED"]]
        rows += [
            [
                f"{r.namespace}/{r.envelope}",
                r.preemptor,
                r.priority_class,
                r.requested_at.strftime("%Y-%m-%dT%H:%M:%SZ"),
            ]
            for r in sorted(status.preemptions.values(), key=lambda r: (r.namespace, r.envelope))
        ]
        lines.append(table(rows))
    return "\n".join(lines)


def recommendation(
    sdk: Reservoir, workflow_class: str, all_namespaces: bool
) -> tuple[list[EnvelopeView], Recommendation]:
    """The right-sizing of a workflow class: the settled claims of every envelope labelled
    with it (in the namespace, or in all of them), each read with its envelope's contracts,
    and the envelopes' peak use."""
    envelopes = sdk.envelopes({WORKFLOW_CLASS_LABEL: workflow_class}, all_namespaces)
    if not envelopes:
        where = "any namespace" if all_namespaces else sdk.namespace
        raise ReservoirError(
            f"no envelopes with label {WORKFLOW_CLASS_LABEL}={workflow_class} in {where}"
        )
    samples = [
        sample
        for e in envelopes
        for record in sdk.settled_records(e.name, e.namespace)
        if (sample := Sample.from_entry(record, e.status.contracts)) is not None
    ]
    uses = [use for e in envelopes if (use := EnvelopeUse.from_status(e.status)) is not None]
    return envelopes, recommend(samples, envelopes=uses)


def _ratio(value: Fraction | None) -> str | None:
    """C/R to four decimal places (the exact Fraction rounded half to even)."""
    return None if value is None else format_quantity(round_ratio(value))


def _quantity(value: Decimal | None) -> str | None:
    return None if value is None else format_quantity(value)


def recommendation_json(
    workflow_class: str, where: str | None, envelopes: Sequence[EnvelopeView], rec: Recommendation
) -> str:
    return json.dumps(
        {
            "workflowClass": workflow_class,
            "namespace": where,
            "envelopes": [f"{e.namespace}/{e.name}" for e in envelopes],
            "claims": rec.claims,
            "excluded": rec.excluded,
            "minSamples": rec.min_samples,
            "resources": [
                {
                    "resource": r.resource,
                    "contract": r.contract.value,
                    "judgedBy": r.judged_by,
                    "samples": r.samples,
                    "p50Consumed": _quantity(r.p50_consumed),
                    "p95Consumed": _quantity(r.p95_consumed),
                    "maxConsumed": _quantity(r.max_consumed),
                    "p50Reserved": _quantity(r.p50_reserved),
                    "p50Ratio": _ratio(r.p50_ratio),
                    "p95Ratio": _ratio(r.p95_ratio),
                    "p95Demand": _quantity(r.p95_demand),
                    "overran": r.capped,
                    "suggestedRequest": _quantity(r.suggested),
                    "explanation": r.explanation,
                }
                for r in rec.resources
            ],
            # Reusable and Replenishing resources: peak use of each envelope against its
            # capacity (the limit per window), not C against R (README "Resource contracts").
            "peakEnvelopes": rec.envelopes,
            "capacities": [
                {
                    "resource": c.resource,
                    "contract": c.contract.value,
                    "judgedBy": c.judged_by,
                    "envelopes": c.envelopes,
                    "p50Peak": _quantity(c.p50_peak),
                    "p95Peak": _quantity(c.p95_peak),
                    "maxPeak": _quantity(c.max_peak),
                    "p50Capacity": _quantity(c.p50_capacity),
                    "p50PeakRatio": _ratio(c.p50_ratio),
                    "p95PeakRatio": _ratio(c.p95_ratio),
                    "atCapacity": c.at_capacity,
                    "suggests": SUGGESTS[c.contract],
                    "suggested": _quantity(c.suggested),
                    "explanation": c.explanation,
                }
                for c in rec.capacities
            ],
        },
        indent=2,
    )


def show_recommendation(
    workflow_class: str, where: str | None, envelopes: Sequence[EnvelopeView], rec: Recommendation
) -> str:
    excluded = ", ".join(f"{count} {why}" for why, count in rec.excluded.items()) or "none"
    lines = [
        f"workflow class {workflow_class} in {where or 'all namespaces'}: "
        f"{len(envelopes)} envelope(s), {rec.claims} settled Consumed claim(s) counted "
        f"(excluded: {excluded})"
    ]
    if not rec.resources and not rec.capacities:
        lines.append("(no claim of this class has settled Consumed yet: nothing to suggest)")
        return "\n".join(lines)
    if rec.resources:
        lines += ["", "Consumable: consumed C against reserved R per claim", ""]
        lines += _consumable_table(rec)
    if rec.capacities:
        lines += [
            "",
            "Reusable and Replenishing: peak use against capacity (the limit per window) "
            f"per envelope, over {rec.envelopes} opened envelope(s)",
            "",
        ]
        lines += _capacity_table(rec)
    return "\n".join(lines)


def _consumable_table(rec: Recommendation) -> list[str]:
    rows = [
        [
            "RESOURCE",
            "SAMPLES",
            "P50 CONSUMED",
            "P95 CONSUMED",
            "P50 RESERVED",
            "P95 C/R",
            "SUGGESTED REQUEST",
        ]
    ]
    for r in rec.resources:
        rows.append(
            [
                r.resource,
                str(r.samples),
                format_quantity(r.p50_consumed),
                format_quantity(r.p95_consumed),
                format_quantity(r.p50_reserved),
                _ratio(r.p95_ratio) or "-",
                _quantity(r.suggested) or "-",
            ]
        )
    return [
        table(rows),
        "",
        *(f"{r.resource} ({r.contract.value}): {r.explanation}" for r in rec.resources),
    ]


def _capacity_table(rec: Recommendation) -> list[str]:
    rows = [
        [
            "RESOURCE",
            "CONTRACT",
            "ENVELOPES",
            "P50 PEAK",
            "P95 PEAK",
            "P50 CAPACITY",
            "P95 PEAK/CAPACITY",
            "AT CAPACITY",
            "SUGGESTED",
        ]
    ]
    for c in rec.capacities:
        rows.append(
            [
                c.resource,
                c.contract.value,
                str(c.envelopes),
                format_quantity(c.p50_peak),
                format_quantity(c.p95_peak),
                format_quantity(c.p50_capacity),
                _ratio(c.p95_ratio) or "-",
                str(c.at_capacity),
                f"{_quantity(c.suggested)} ({SUGGESTS[c.contract]})"
                if c.suggested is not None
                else "-",
            ]
        )
    return [
        table(rows),
        "",
        *(f"{c.resource} ({c.contract.value}): {c.explanation}" for c in rec.capacities),
    ]


def parser() -> argparse.ArgumentParser:
    # The module docstring is the usage: one verb a line, as written (not refolded).
    main = argparse.ArgumentParser(
        prog="kubectl reservoir",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    main.add_argument("-n", "--namespace", help="namespace (default: the kubeconfig's)")
    main.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG)")
    main.add_argument(
        "--holder",
        help=f"the lease holder this invocation acts as (default: ${HOLDER_ENV}, "
        "else kubectl-reservoir/USER@HOST)",
    )
    verbs = main.add_subparsers(dest="verb", required=True)

    hold = verbs.add_parser("hold", help="create a claim on an envelope")
    hold.add_argument("envelope")
    hold.add_argument("branch")
    hold.add_argument("requests", nargs="+", metavar="RESOURCE=QUANTITY")
    hold.add_argument("--name")
    hold.add_argument("--priority", type=int, default=0)
    hold.add_argument("--attempt", type=int, default=1)
    hold.add_argument("--lease-seconds", type=int)
    hold.add_argument("--dispatch", action="store_true", help="reserve and commit at once")
    hold.add_argument("--request-id", help="the submission's idempotency key (upstream.requestId)")

    for verb, text in [
        ("dispatch", "cross the commit point"),
        ("cancel", "prune the branch"),
        ("renew", "heartbeat the claim's lease and wait for the renewal"),
        ("get", "show a claim"),
    ]:
        verbs.add_parser(verb, help=text).add_argument("claim")

    usage = verbs.add_parser("usage", help="report cumulative usage so far")
    usage.add_argument("claim")
    usage.add_argument("usage", nargs="+", metavar="RESOURCE=QUANTITY")

    finish = verbs.add_parser("finish", help="final usage and outcome: settle the claim")
    finish.add_argument("claim")
    finish.add_argument("usage", nargs="*", metavar="RESOURCE=QUANTITY")
    finish.add_argument(
        "--outcome", choices=["Succeeded", "Failed", "Cancelled"], default="Succeeded"
    )
    finish.add_argument("--result", help="a durable reference to the result (URI, object name)")

    for verb, text in [
        ("result", "what became of a claim: phase, outcome, result reference, C and R − C"),
        ("history", "a claim's recorded transitions, adjustment, retry hold, compensations"),
    ]:
        read = verbs.add_parser(verb, help=text)
        read.add_argument("claim")
        # Also after the verb (`result CLAIM -n NS`); SUPPRESS keeps a -n given before it.
        read.add_argument("-n", "--namespace", default=argparse.SUPPRESS, help="namespace")

    compensate = verbs.add_parser(
        "compensate",
        help="a reversal or follow-up charge after settlement, applied once (by its key)",
    )
    compensate.add_argument("claim")
    compensate.add_argument(
        "--amount",
        action="append",
        required=True,
        metavar="RESOURCE=SIGNED_QUANTITY",
        help="negative: given back (a refund, a void); positive: charged. Repeatable.",
    )
    compensate.add_argument("--reason", required=True, help="why, for the record")
    compensate.add_argument("--reference", help="the business record: invoice, refund, auth")
    compensate.add_argument(
        "--key", help="idempotency key (default: a hash of amount, reason and reference)"
    )

    ledger = verbs.add_parser(
        "ledger", help="an envelope's totals and claims, then its child envelopes' (a tree)"
    )
    ledger.add_argument("envelope")

    pool = verbs.add_parser("pool", help="a ReservationPool's totals and its envelopes")
    pool.add_argument("pool")

    why = verbs.add_parser("why", help="why a claim (or renv/ENVELOPE) waits, who is ahead")
    why.add_argument("target", metavar="CLAIM|renv/ENVELOPE")
    why.add_argument("-n", "--namespace", default=argparse.SUPPRESS, help="namespace")

    advise = verbs.add_parser(
        "recommend", help="suggested requests per resource for a workflow class"
    )
    advise.add_argument("workflow_class", metavar="CLASS", help=f"{WORKFLOW_CLASS_LABEL} value")
    # Also after the verb (`recommend CLASS -n NS`); SUPPRESS keeps a -n given before it.
    advise.add_argument("-n", "--namespace", default=argparse.SUPPRESS, help="namespace")
    advise.add_argument(
        "-A", "--all-namespaces", action="store_true", help="envelopes in every namespace"
    )
    advise.add_argument("-o", "--output", choices=["table", "json"], default="table")
    return main


def run(args: argparse.Namespace, sdk: Reservoir) -> str:
    if args.verb == "recommend":
        envelopes, rec = recommendation(sdk, args.workflow_class, args.all_namespaces)
        where = None if args.all_namespaces else sdk.namespace
        show = recommendation_json if args.output == "json" else show_recommendation
        return show(args.workflow_class, where, envelopes, rec)
    if args.verb == "ledger":
        return show_ledger(sdk.tree(args.envelope))
    if args.verb == "pool":
        return show_pool(sdk.pool(args.pool))
    if args.verb == "why":
        return why(sdk, args.target)
    if args.verb == "hold":
        view = sdk.hold(
            args.envelope,
            args.branch,
            resources(args.requests),
            name=args.name,
            priority=args.priority,
            attempt=args.attempt,
            lease_seconds=args.lease_seconds,
            dispatch=args.dispatch,
            request_id=args.request_id,
        )
        return show_claim(view)
    if args.verb == "result":
        return show_result(sdk.result(args.claim))
    if args.verb == "history":
        return show_history(sdk.get(args.claim))
    if args.verb == "compensate":
        view = sdk.compensate(
            args.claim, resources(args.amount), args.reason, args.reference, args.key
        )
        return show_history(view)
    view = sdk.get(args.claim)
    if args.verb == "dispatch":
        view = sdk.dispatch(view)
    elif args.verb == "cancel":
        view = sdk.cancel(view)
    elif args.verb == "renew":
        view = sdk.renew(view)
    elif args.verb == "usage":
        view = sdk.report_usage(view, resources(args.usage))
    elif args.verb == "finish":
        view = sdk.finish(view, resources(args.usage), args.outcome, args.result)
    return show_claim(view)


ENVELOPE_PREFIXES = ("renv/", "reservationenvelope/", "reservationenvelopes/", "envelope/")


def why(sdk: Reservoir, target: str) -> str:
    """What `kubectl reservoir why` shows (reservoir.cli.why), read from the cluster."""
    for prefix in ENVELOPE_PREFIXES:
        if target.startswith(prefix):
            tree = sdk.tree(target.removeprefix(prefix))
            return explain_envelope(tree.envelope, sdk.covering_pool())
    claim = sdk.get(target.removeprefix("branchclaim/").removeprefix("bc/"))
    if claim.status.phase is not ClaimPhase.PENDING:
        return explain_claim(claim, None, [], None)
    try:
        tree = sdk.tree(claim.spec.envelope)
    except ApiError as error:
        if error.status.code != 404:
            raise
        return explain_claim(claim, None, [claim], None)  # its envelope does not exist
    waits = tree.envelope.status.parent is None and tree.envelope.parent is None
    return explain_claim(claim, tree.envelope, tree.claims, sdk.covering_pool() if waits else None)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        with Reservoir(
            namespace=args.namespace,
            kubeconfig=args.kubeconfig,
            holder=args.holder or default_holder(),
        ) as sdk:
            # Fields from tenants' workers and providers are escaped where they are
            # shown; this catches any other control character before the terminal does.
            print(visible(run(args, sdk), keep_newlines=True))
    except (ReservoirError, QuantityError, TimeoutError) as error:
        print(f"error: {visible(str(error))}", file=sys.stderr)
        return 1
    except ApiError as error:
        print(f"error: {visible(str(error.status.message))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
