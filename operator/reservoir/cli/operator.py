"""`reservoir-operator`: run the operator against the current kubeconfig or, in a pod, its
service account."""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import socket
import sys
import urllib.parse
from pathlib import Path

import kopf
import yaml
from lightkube import AsyncClient
from lightkube.config.kubeconfig import KubeConfig
from lightkube.core.exceptions import ConfigError

from reservoir import __version__, gc_tuning, kopf_readiness
from reservoir.core.serving_classes import ServingClass, parse_classes
from reservoir.endpoints import listen
from reservoir.k8s import serving
from reservoir.k8s.provider_policy import AllowList
from reservoir.k8s.transition_events import TransitionEvents

SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="reservoir-operator",
        description="Hold capacity for branching AI workflows; settle it exactly once.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="watch this namespace (repeatable); none means the whole cluster",
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch all namespaces")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=8080,
        help="serve /metrics and the readiness probe /readyz on this port; 0 disables both",
    )
    parser.add_argument(
        "--metrics-auth",
        choices=("none", "kubernetes"),
        default="none",
        help="who may read /metrics: anyone who reaches the port ('none'), or only a bearer "
        "token the API server authenticates (TokenReview) and allows to get the non-resource "
        "URL /metrics (SubjectAccessReview), as the chart sets ('kubernetes')",
    )
    parser.add_argument(
        "--liveness",
        metavar="URL",
        default=None,
        help="serve kopf's liveness probe, e.g. http://0.0.0.0:8081/healthz",
    )
    parser.add_argument(
        "--peering",
        metavar="NAME",
        default=None,
        help="kopf peering object shared by HA replicas: only the highest-priority one acts; "
        "without it the operator runs standalone",
    )
    parser.add_argument(
        "--priority",
        type=int,
        default=None,
        help="this replica's peering priority; with --peering and no priority, a random one, "
        "so that the replicas of a Deployment never tie (kopf pauses tied peers)",
    )
    parser.add_argument(
        "--placeholder-priority-class",
        metavar="NAME",
        default="reservoir-placeholder",
        help="PriorityClass of the placeholder pods that hold GPU claims' devices (the chart "
        "and the local cluster create it: preemptionPolicy Never); '' for none",
    )
    parser.add_argument(
        "--restrict-placement",
        action="store_true",
        help="copy onto placeholder pods only the placement hints the allow-lists below name "
        "(the chart always sets it); a claim asking for more waits Pending with the reason. "
        "Without it, hints are copied as they are",
    )
    parser.add_argument(
        "--allowed-toleration-key",
        metavar="KEY",
        action="append",
        default=[],
        help="a toleration key claims' placement may ask for (repeatable)",
    )
    parser.add_argument(
        "--allowed-node-label-key",
        metavar="KEY",
        action="append",
        default=[],
        help="a node label key claims' nodeSelector and nodeAffinity may name (repeatable)",
    )
    parser.add_argument(
        "--transition-events",
        choices=[level.value for level in TransitionEvents],
        default=TransitionEvents.EXCEPTIONS.value,
        help="which claim phase changes post a Kubernetes Event: 'exceptions' (warnings, and "
        "endings the worker did not declare: a lease lapse, a provider's verdict, a "
        "deadline, a force-settlement, a refusal), 'settlements' (also a claim's ordinary "
        "end: its final report, cancel or deletion before dispatch: one more API write per "
        "claim) or 'all' (every move: about four more). Every move is recorded in the "
        "claim's status history and counted by the metrics either way",
    )
    parser.add_argument(
        "--queue-reason-after",
        metavar="SECONDS",
        type=int,
        default=10,
        help="how long a claim that only waits its turn (queued behind others, at a cap, "
        "short of capacity) shows just 'Pending' (the CRD's default status) before the "
        "operator writes why it waits: a claim admitted sooner costs no status write for "
        "its wait. Problems (an invalid spec, unplaceable devices, a missing envelope) are "
        "written at once. 0: every wait at once",
    )
    providers = parser.add_argument_group(
        "HTTP providers",
        "which envelope provider URLs (policy.provider) the operator may call, and how often",
    )
    providers.add_argument(
        "--provider-allow",
        metavar="HOST_OR_CIDR",
        action="append",
        default=[],
        help="a host name (inference.example.com), every name under a domain "
        "(*.example.com), or an IP/CIDR for URLs whose host is an IP literal (repeatable, "
        "or comma-separated). None: no HTTP provider is called. Loopback, link-local and "
        "metadata addresses are refused whatever is allowed",
    )
    providers.add_argument(
        "--provider-max-in-flight",
        type=int,
        default=32,
        metavar="N",
        help="HTTP provider calls in flight at once, all namespaces together",
    )
    providers.add_argument(
        "--provider-max-in-flight-per-namespace",
        type=int,
        default=4,
        metavar="N",
        help="HTTP provider calls in flight at once for one namespace",
    )
    providers.add_argument(
        "--provider-calls-per-second-per-namespace",
        type=float,
        default=2.0,
        metavar="RATE",
        help="HTTP provider calls a namespace may start per second, on average",
    )
    providers.add_argument(
        "--provider-burst-per-namespace",
        type=int,
        default=10,
        metavar="N",
        help="HTTP provider calls a namespace may start at once after a quiet spell",
    )
    parser.add_argument(
        "--serving-classes",
        metavar="FILE",
        help="a YAML file of serving classes (name: {description, policy: {...}, priority}) "
        "added to, or replacing, the built-in Interactive, Batch and Agentic: named presets "
        "of envelope policy an envelope picks with spec.servingClass",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    try:
        args.classes = read_serving_classes(args.serving_classes)
    except ValueError as error:
        parser.error(f"--serving-classes: {error}")
    try:
        AllowList.parse(allowed_entries(args.provider_allow))
    except ValueError as error:
        parser.error(f"--provider-allow: {error}")
    for name in ("max_in_flight", "max_in_flight_per_namespace", "burst_per_namespace"):
        if getattr(args, f"provider_{name}") < 1:
            parser.error(f"--provider-{name.replace('_', '-')} must be at least 1")
    if not args.provider_calls_per_second_per_namespace > 0:
        parser.error("--provider-calls-per-second-per-namespace must be positive")
    return args


def read_serving_classes(path: str | None) -> dict[str, ServingClass]:
    """The built-in classes, with the file's over them (ValueError saying what is wrong)."""
    if path is None:
        return parse_classes({})
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"cannot read {path}: {error}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a mapping of class names to classes is expected")
    return parse_classes(raw)


def allowed_entries(flags: list[str]) -> list[str]:
    """--provider-allow values, each maybe a comma-separated list."""
    return [entry.strip() for flag in flags for entry in flag.split(",") if entry.strip()]


def peering_priority(peering: str | None, priority: int | None) -> int:
    """The given priority; else, for a peered replica, a random one: kopf pauses every peer
    of a tie, so two replicas of a Deployment must never share one."""
    if priority is not None:
        return priority
    return random.randint(1, 2**31 - 1) if peering else 0


def credentials_problem() -> str | None:
    """None if there is something to log in with, else one line saying what was looked for.
    kopf would otherwise retry its start-up forever with a traceback a minute. A client is
    built too, so that certificate files that are named but missing fail here."""
    if os.environ.get("KUBERNETES_SERVICE_HOST") and os.path.exists(SERVICE_ACCOUNT_TOKEN):
        return None
    where = os.environ.get("KUBECONFIG") or "~/.kube/config"
    try:
        config = KubeConfig.from_env()
        current = config.get()
        if current is None:
            raise ConfigError("it has no current context")
        user, cluster = current.user, current.cluster
        named = [cluster.certificate_auth] if cluster else []
        named += [user.client_cert, user.client_key, user.token_file] if user else []
        missing = [path for path in named if path and not os.path.exists(path)]
        if missing:
            return f"unusable kubeconfig at {where}: missing file(s) {', '.join(missing)}"
        AsyncClient(config=config)
    except ConfigError as error:
        return (
            f"no Kubernetes credentials: not in a cluster (no $KUBERNETES_SERVICE_HOST and "
            f"{SERVICE_ACCOUNT_TOKEN}) and no usable kubeconfig at {where} ({error})"
        )
    except Exception as error:  # a kubeconfig lightkube cannot use, whatever the reason
        detail = str(error) or type(error).__name__
        if isinstance(error, KeyError):
            detail = f"its context names a missing entry {error}"
        elif isinstance(error, OSError) and error.filename:
            detail = f"{error.strerror}: {error.filename}"
        detail = " ".join(detail.split())[:300]  # one line
        return f"unusable kubeconfig at {where}: {type(error).__name__}: {detail}"
    return None


def liveness_problem(url: str) -> str | None:
    """None if kopf can serve its liveness probe at `url`, else one line saying why not.
    kopf binds the port itself; a port taken would otherwise surface as a traceback."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http":
        return f"--liveness {url}: only http:// URLs are served"
    try:
        port = parts.port or 80
    except ValueError as error:
        return f"--liveness {url}: {error}"
    try:
        listen(port, parts.hostname or "127.0.0.1").close()
    except OSError as error:
        return f"cannot serve the liveness probe on port {port}: {error.strerror or error}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for chatty in ("httpx", "httpx2", "httpcore", "aiohttp"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
    if not args.verbose:
        # kopf logs every handler call that succeeded: a line per claim event under load.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    problem = credentials_problem()
    if problem is not None:
        print(f"reservoir-operator: {problem}", file=sys.stderr)
        return 2
    # The ports are taken now, not in kopf's start-up, which retries a failure every minute.
    endpoints: socket.socket | None = None
    if args.metrics_port:
        try:
            endpoints = listen(args.metrics_port)
        except OSError as error:
            why = error.strerror or str(error)
            print(
                f"reservoir-operator: cannot serve /metrics and /readyz on port "
                f"{args.metrics_port}: {why}",
                file=sys.stderr,
            )
            return 2
    problem = liveness_problem(args.liveness) if args.liveness else None
    if problem is not None:
        print(f"reservoir-operator: {problem}", file=sys.stderr)
        return 2
    os.environ["RESERVOIR_PLACEHOLDER_PRIORITY_CLASS"] = args.placeholder_priority_class
    os.environ["RESERVOIR_PROBE_NAMESPACE"] = args.namespace[0] if args.namespace else ""
    os.environ["RESERVOIR_WATCHED_NAMESPACES"] = ",".join(args.namespace or [])
    os.environ["RESERVOIR_TRANSITION_EVENTS"] = args.transition_events
    os.environ["RESERVOIR_QUEUE_REASON_AFTER"] = str(max(args.queue_reason_after, 0))
    os.environ["RESERVOIR_PROVIDER_ALLOW"] = ",".join(allowed_entries(args.provider_allow))
    os.environ["RESERVOIR_PROVIDER_MAX_IN_FLIGHT"] = str(args.provider_max_in_flight)
    os.environ["RESERVOIR_PROVIDER_MAX_IN_FLIGHT_PER_NAMESPACE"] = str(
        args.provider_max_in_flight_per_namespace
    )
    os.environ["RESERVOIR_PROVIDER_CALLS_PER_SECOND_PER_NAMESPACE"] = str(
        args.provider_calls_per_second_per_namespace
    )
    os.environ["RESERVOIR_PROVIDER_BURST_PER_NAMESPACE"] = str(args.provider_burst_per_namespace)
    if args.restrict_placement:
        os.environ["RESERVOIR_PLACEMENT_ALLOWED"] = json.dumps(
            {
                "tolerationKeys": args.allowed_toleration_key,
                "nodeLabelKeys": args.allowed_node_label_key,
            }
        )
    serving.install(args.classes)  # before any envelope is read
    import reservoir.handlers  # noqa: F401  (registers the handlers)

    kopf_readiness.apply()  # start-up in O(objects), not O(objects²): see the module
    gc_tuning.tune()  # a fifth of the operator's CPU was garbage collection: see the module

    namespaces = args.namespace  # none given (or -A): the whole cluster
    kopf.run(
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=args.peering is None,
        peering_name=args.peering,
        priority=peering_priority(args.peering, args.priority),
        liveness_endpoint=args.liveness,
        memo=kopf.Memo(endpoints_socket=endpoints, metrics_auth=args.metrics_auth == "kubernetes"),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
