"""`kubectl reservoir ...`: the SDK's verbs from a shell, plus an envelope's ledger.

    kubectl reservoir hold ENVELOPE BRANCH tokens=20k [cost=2] [--dispatch] [--name N]
    kubectl reservoir dispatch|cancel|renew|get CLAIM
    kubectl reservoir usage CLAIM tokens=5k            # cumulative usage so far
    kubectl reservoir finish CLAIM tokens=12k --outcome Succeeded
    kubectl reservoir ledger ENVELOPE
    kubectl reservoir recommend CLASS [-n NS | -A] [-o json]   # right-sizing

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
from collections.abc import Sequence
from decimal import Decimal
from fractions import Fraction

from lightkube import ApiError

from reservoir.core.ledger import render
from reservoir.core.model import BranchClaimStatus, LedgerEntry
from reservoir.core.quantity import QuantityError, format_quantity
from reservoir.core.rightsizing import Recommendation, recommend, round_ratio
from reservoir.k8s.resources import WORKFLOW_CLASS_LABEL
from reservoir.sdk import ClaimView, EnvelopeView, Reservoir, ReservoirError
from reservoir.sdk.client import HOLDER_ENV


def resources(pairs: Sequence[str]) -> dict[str, str]:
    parsed: dict[str, str] = {}
    for pair in pairs:
        name, sep, amount = pair.partition("=")
        if not sep or not name or not amount:
            raise ReservoirError(f"{pair!r}: expected RESOURCE=QUANTITY, e.g. tokens=20k")
        parsed[name] = amount
    return parsed


def table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


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
    return table(
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


def claim_row(name: str, branch: str, record: LedgerEntry | BranchClaimStatus) -> list[str]:
    """A claim's line: from its ledger entry, or from its status once a settled entry was
    compacted out of the ledger."""
    return [
        name,
        branch or "-",
        record.phase.value,
        render(record.reserved) or "-",
        render(record.consumed) or "-",
        render(record.released) or "-",
        record.settlement.reason if record.settlement else "-",
    ]


def show_ledger(view: EnvelopeView, claims: Sequence[ClaimView] = ()) -> str:
    """The envelope's totals and claims: its ledger entries, and the settled claims whose
    entries were compacted out of the ledger (their record lives in their status)."""
    status = view.status
    totals = status.totals
    lines = [f"envelope {view.namespace}/{view.name}: {status.phase.value}"]
    rows = [["RESOURCE", "CAPACITY", "COMMITTED", "RESERVED", "RECONCILING", "AVAILABLE"]]
    for resource in sorted(totals.capacity):
        rows.append(
            [resource]
            + [
                format_quantity(getattr(totals, part)[resource])
                for part in ("capacity", "committed", "reserved", "reconciling", "available")
            ]
        )
    lines += [table(rows), ""]
    listed = [claim_row(e.claim, e.branch, e) for e in status.entries.values()]
    listed += [
        claim_row(c.name, c.spec.branch, c.status)
        for c in claims
        if c.uid not in status.entries and c.status.settlement is not None
    ]
    rows = [["CLAIM", "BRANCH", "PHASE", "RESERVED", "CONSUMED", "RELEASED", "SETTLED"]]
    rows += sorted(listed, key=lambda row: (row[1], row[0]))
    lines.append(table(rows) if len(rows) > 1 else "(no claims in the ledger)")
    if status.balance_released:
        lines.append(f"\nbalance released at close: {render(status.balance_released)}")
    return "\n".join(lines)


def recommendation(
    sdk: Reservoir, workflow_class: str, all_namespaces: bool
) -> tuple[list[EnvelopeView], Recommendation]:
    """The right-sizing of a workflow class: the settled claims of every envelope labelled
    with it (in the namespace, or in all of them)."""
    envelopes = sdk.envelopes({WORKFLOW_CLASS_LABEL: workflow_class}, all_namespaces)
    if not envelopes:
        where = "any namespace" if all_namespaces else sdk.namespace
        raise ReservoirError(
            f"no envelopes with label {WORKFLOW_CLASS_LABEL}={workflow_class} in {where}"
        )
    records = [r for e in envelopes for r in sdk.settled_records(e.name, e.namespace)]
    return envelopes, recommend(records)


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
    if not rec.resources:
        lines.append("(no claim of this class has settled Consumed yet: nothing to suggest)")
        return "\n".join(lines)
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
    lines += [table(rows), ""]
    lines += [f"{r.resource}: {r.explanation}" for r in rec.resources]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(prog="kubectl reservoir", description=__doc__)
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

    ledger = verbs.add_parser("ledger", help="an envelope's totals and claims")
    ledger.add_argument("envelope")

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
        return show_ledger(sdk.ledger(args.envelope), sdk.claims(args.envelope))
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
        )
        return show_claim(view)
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
        view = sdk.finish(view, resources(args.usage), args.outcome)
    return show_claim(view)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        with Reservoir(
            namespace=args.namespace,
            kubeconfig=args.kubeconfig,
            holder=args.holder or default_holder(),
        ) as sdk:
            print(run(args, sdk))
    except (ReservoirError, QuantityError, TimeoutError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except ApiError as error:
        print(f"error: {error.status.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
