"""`reservoir-operator`: run the operator against the current kubeconfig."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import kopf


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="reservoir-operator",
        description="Hold capacity for branching AI workflows; settle it exactly once.",
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n", "--namespace", action="append", default=[], help="watch this namespace (repeatable)"
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch all namespaces")
    parser.add_argument("--metrics-port", type=int, default=8080, help="0 disables metrics")
    parser.add_argument(
        "--peering",
        metavar="NAME",
        help="kopf peering object for HA replicas: only the highest-priority replica acts",
    )
    parser.add_argument("--priority", type=int, default=0, help="this replica's peering priority")
    parser.add_argument("--liveness", default=None, help="e.g. http://0.0.0.0:8081/healthz")
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for chatty in ("httpx", "httpx2", "httpcore"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
    os.environ["RESERVOIR_METRICS_PORT"] = str(args.metrics_port)
    import reservoir.handlers  # noqa: F401  (registers the handlers)

    namespaces = args.namespace  # none given (or -A): the whole cluster
    kopf.run(
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=args.peering is None,
        peering_name=args.peering,
        priority=args.priority,
        liveness_endpoint=args.liveness,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
