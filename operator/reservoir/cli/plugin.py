"""`kubectl reservoir ...`: the SDK's verbs from a shell, plus an envelope's ledger.

    kubectl reservoir hold ENVELOPE BRANCH tokens=20k [cost=2] [--dispatch] [--name N]
    kubectl reservoir dispatch|cancel|renew CLAIM
    kubectl reservoir usage CLAIM tokens=5k            # cumulative usage so far
    kubectl reservoir finish CLAIM tokens=12k --outcome Succeeded
    kubectl reservoir ledger ENVELOPE

A refusal exits non-zero with a one-line reason.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightkube import ApiError

from reservoir.core.ledger import render
from reservoir.core.quantity import QuantityError, format_quantity
from reservoir.sdk import ClaimView, EnvelopeView, Reservoir, ReservoirError


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


def show_claim(view: ClaimView) -> str:
    lease = view.status.lease
    return table(
        [
            ["NAME", "ENVELOPE", "BRANCH", "PHASE", "INTENT", "RESERVED", "USAGE", "EXPIRES"],
            [
                view.name,
                view.spec.envelope,
                view.spec.branch or "-",
                view.phase.value,
                view.spec.intent.value,
                render(view.status.reserved) or "-",
                render(view.status.usage) or "-",
                lease.expires_at.strftime("%H:%M:%S") if lease and lease.expires_at else "-",
            ],
        ]
    )


def show_ledger(view: EnvelopeView) -> str:
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
    claims = [["CLAIM", "BRANCH", "PHASE", "RESERVED", "CONSUMED", "RELEASED", "SETTLED"]]
    for entry in sorted(status.entries.values(), key=lambda e: (e.branch, e.claim)):
        claims.append(
            [
                entry.claim,
                entry.branch or "-",
                entry.phase.value,
                render(entry.reserved) or "-",
                render(entry.consumed) or "-",
                render(entry.released) or "-",
                entry.settlement.reason if entry.settlement else "-",
            ]
        )
    lines.append(table(claims) if len(claims) > 1 else "(no claims in the ledger)")
    if status.balance_released:
        lines.append(f"\nbalance released at close: {render(status.balance_released)}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(prog="kubectl reservoir", description=__doc__)
    main.add_argument("-n", "--namespace", help="namespace (default: the kubeconfig's)")
    main.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG)")
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
    return main


def run(args: argparse.Namespace, sdk: Reservoir) -> str:
    if args.verb == "ledger":
        return show_ledger(sdk.ledger(args.envelope))
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
        with Reservoir(namespace=args.namespace, kubeconfig=args.kubeconfig) as sdk:
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
