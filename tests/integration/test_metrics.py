"""The operator's /metrics and /readyz, scraped from a real operator process: the figures a
scrape returns match the ledger exactly, promtool accepts the exposition, and an envelope's
series leave with it."""

from __future__ import annotations

import contextlib
import json
import math
import re
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

import pytest
import yaml

from reservoir import dashboard
from reservoir.sdk import Reservoir
from tests.clusters import ClusterHandle, free_port
from tests.integration.conftest import StartOperator
from tests.integration.helpers import (
    Samples,
    create_envelope,
    eventually,
    samples,
    scrape,
    settled_ledger,
    under_lease,
    value,
    wait_phase,
)
from tests.integration.provider_server import (
    ProviderServer,
    answer,
    host_address,
    provider_server,
)
from tests.tools import tool
from tests.unit.metric_names import referenced_metric_names

CLASS_LABEL = "reservoir.dev/workflow-class"


def test_a_scrape_after_the_worked_example_matches_the_ledger(
    cluster: ClusterHandle, ns: str, start_operator: StartOperator, sdk: Reservoir
) -> None:
    port = free_port()
    start_operator("--metrics-port", str(port))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as response:
        assert response.status == 200

    create_envelope(
        cluster,
        ns,
        "parent",
        {"tokens": "100"},
        defaultLeaseSeconds=120,
        ambiguityDeadlineSeconds=600,
    )
    cluster.kubectl("label", "reservationenvelope", "parent", f"{CLASS_LABEL}=planner", "-n", ns)
    a, b, c = (sdk.hold("parent", n.upper(), {"tokens": "20"}, name=n) for n in "abc")
    # D is sent as it reserves (reserve and commit in one step) with a short lease that it
    # never renews: no dispatch has to beat the lease on a loaded machine.
    d = sdk.hold("parent", "D", {"tokens": "20"}, name="d", lease_seconds=3, dispatch=True)
    for claim in (a, b, c):
        wait_phase(sdk, claim, "Tentative")
    a, b = (sdk.dispatch(sdk.get(x)) for x in (a, b))
    sdk.cancel(sdk.get(c))
    d = sdk.report_usage(wait_phase(sdk, d, "Committed"), {"tokens": "1"})
    sdk.finish(sdk.get(a), {"tokens": "20"})
    sdk.finish(sdk.get(b), {"tokens": "12"})
    wait_phase(sdk, d, "Detached", within=20)
    settled_ledger(sdk, "parent", committed="32", reconciling="20", available="48")

    # While D is Detached its 20 are stranded: held for a worker nobody hears from.
    env = {"namespace": ns, "envelope": "parent"}
    found = eventually(
        "D's capacity shown as stranded",
        lambda: (
            s
            if value(
                s := samples(scrape(port)), "reservoir_envelope_stranded", **env, resource="tokens"
            )
            == 20
            else None
        ),
    )
    assert value(found, "reservoir_envelope_claims", **env, phase="Detached") == 1
    assert value(found, "reservoir_envelope_info", **env, **{"class": "planner"}) == 1
    assert value(found, "reservoir_envelope_ambiguity_deadline_seconds", **env) == 600

    sdk.finish(sdk.get(d), {"tokens": "5"}, outcome="Failed")
    view = settled_ledger(sdk, "parent", committed="37", reserved="0", reconciling="0")

    # Every state of every resource and every phase count, as the ledger says it, exactly.
    def matches_ledger() -> Samples | None:
        found, ledger = samples(scrape(port)), sdk.ledger("parent").status
        for state in ("capacity", "reserved", "committed", "reconciling", "available"):
            for resource, amount in getattr(ledger.totals, state).items():
                got = value(
                    found,
                    "reservoir_envelope_capacity",
                    **env,
                    resource=resource,
                    state=state,
                    contract="Consumable",  # tokens, by default
                )
                if got is None or Decimal(str(got)) != amount:
                    return None
        for phase in ("Pending", "Tentative", "Committed", "Running", "Detached", "Consumed"):
            if value(found, "reservoir_envelope_claims", **env, phase=phase) != ledger.counts.get(
                phase, 0
            ):
                return None
        return found

    found = eventually("the scrape to match the settled ledger", matches_ledger)
    assert view.status.totals.committed["tokens"] == 37
    tokens = {"resource": "tokens", "contract": "Consumable"}
    assert value(found, "reservoir_envelope_capacity", **env, **tokens, state="committed") == 37
    # A Consumable resource has nothing in use (what is committed is spent) and no peak.
    assert value(found, "reservoir_envelope_in_use", **env, **tokens) is None
    assert value(found, "reservoir_envelope_peak_in_use", **env, **tokens) is None
    assert value(found, "reservoir_envelope_stranded", **env, resource="tokens") == 0
    assert value(found, "reservoir_envelope_ledger_healthy", **env) == 1

    # By class: A, B and D settled Consumed (C/R 1, 0.6, 0.25); four claims reserved.
    by_class = {"namespace": ns, "class": "planner"}
    ratio = {**by_class, "resource": "tokens"}
    assert value(found, "reservoir_claim_consumed_ratio_count", **ratio) == 3
    assert value(found, "reservoir_claim_consumed_ratio_sum", **ratio) == pytest.approx(1.85)
    assert value(found, "reservoir_claim_consumed_ratio_bucket", **ratio, le="0.3") == 1
    assert value(found, "reservoir_claim_consumed_ratio_bucket", **ratio, le="0.6") == 2
    assert value(found, "reservoir_claim_admission_wait_seconds_count", **by_class) == 4
    assert value(found, "reservoir_claim_commit_wait_seconds_count", **by_class) == 3
    assert value(found, "reservoir_claim_hold_seconds_count", **by_class) == 3  # C: cancelled
    assert value(found, "reservoir_lease_expiries_total", **by_class) == 1
    assert value(found, "reservoir_claim_transitions_total", **by_class, reason="Cancelled") == 1

    # promtool, the tool Prometheus users lint expositions with, accepts the scrape.
    check = subprocess.run(
        [str(tool("promtool")), "check", "metrics"],
        input=scrape(port),
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr

    # The envelope's series leave with it; the counters by class stay.
    cluster.kubectl("delete", "reservationenvelope", "parent", "-n", ns)
    found = eventually(
        "the envelope's series to disappear",
        lambda: (
            s
            if value(s := samples(scrape(port)), "reservoir_envelope_ledger_healthy", **env) is None
            else None
        ),
    )
    assert not any(labels and ("envelope", "parent") in labels for _, labels in found)
    assert value(found, "reservoir_claim_consumed_ratio_count", **ratio) == 3


def test_a_scrape_shows_permits_and_a_rate_limit_in_use_their_peaks_shortfall_and_occupancy(
    cluster: ClusterHandle, ns: str, start_operator: StartOperator, sdk: Reservoir
) -> None:
    """Issue 22: `concurrency` is Reusable (by default): two permits, three branches. The
    third waits while both permits are in use (the shortfall an alert fires on), every
    permit comes back as its claim ends, and the permit-seconds held are counted. A
    provider rate limit (`rpm`, Replenishing, a 10-minute window) keeps what was consumed
    in its window."""
    port = free_port()
    start_operator("--metrics-port", str(port))
    body = {
        "apiVersion": "reservoir.dev/v1alpha1",
        "kind": "ReservationEnvelope",
        "metadata": {"name": "agents", "namespace": ns, "labels": {CLASS_LABEL: "agents"}},
        "spec": {
            "capacity": {"concurrency": "2", "tokens": "100", "rpm": "30"},
            "contracts": {"rpm": {"type": "Replenishing", "windowSeconds": 600}},
            "policy": {"defaultLeaseSeconds": 120},
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    request = {"concurrency": "1", "tokens": "10", "rpm": "10"}
    a, b, c = (sdk.hold("agents", n, request, name=n, dispatch=True) for n in "abc")
    a, b = (wait_phase(sdk, x, "Committed") for x in (a, b))
    wait_phase(sdk, c, "Pending")

    env = {"namespace": ns, "envelope": "agents"}
    permits = {"resource": "concurrency", "contract": "Reusable"}
    found = eventually(
        "both permits in use and the third branch short of one",
        lambda: (
            s
            if value(s := samples(scrape(port)), "reservoir_envelope_shortfall", **env, **permits)
            == 1
            else None
        ),
    )
    assert value(found, "reservoir_envelope_in_use", **env, **permits) == 2
    assert value(found, "reservoir_envelope_capacity", **env, **permits, state="capacity") == 2
    assert value(found, "reservoir_envelope_capacity", **env, **permits, state="available") == 0
    assert value(found, "reservoir_envelope_peak_in_use", **env, **permits) == 2
    tokens = {"resource": "tokens", "contract": "Consumable"}
    assert value(found, "reservoir_envelope_capacity", **env, **tokens, state="capacity") == 100

    rpm = {"resource": "rpm", "contract": "Replenishing"}
    assert value(found, "reservoir_envelope_in_use", **env, **rpm) == 20  # a and b hold 10

    time.sleep(2)  # a and b hold their permits for at least 2 whole seconds each
    sdk.finish(a, {"tokens": "5", "rpm": "3"})
    c = wait_phase(sdk, c, "Committed")  # a's permit came back
    for claim in (b, c):
        sdk.finish(claim, {"tokens": "5", "rpm": "3"})
    for name in "abc":
        wait_phase(sdk, name, "Consumed")

    def all_back() -> Samples | None:
        s = samples(scrape(port))
        back = (
            value(s, "reservoir_envelope_in_use", **env, **permits) == 0
            and value(s, "reservoir_envelope_capacity", **env, **permits, state="available") == 2
            and value(s, "reservoir_envelope_capacity", **env, **tokens, state="committed") == 15
        )
        return s if back else None

    found = eventually("every permit back and the tokens committed", all_back)
    assert value(found, "reservoir_envelope_shortfall", **env, **permits) is None
    assert value(found, "reservoir_envelope_peak_in_use", **env, **permits) == 2
    # The requests consumed stay in the window (10 minutes): 3 each, nothing held now. The
    # most in use at once: a's 3 committed while b and c held 10 each.
    assert value(found, "reservoir_envelope_window_committed", **env, resource="rpm") == 9
    assert value(found, "reservoir_envelope_in_use", **env, **rpm) == 9
    assert value(found, "reservoir_envelope_peak_in_use", **env, **rpm) == 23
    assert value(found, "reservoir_envelope_capacity", **env, **rpm, state="available") == 21
    by_class = {"namespace": ns, "class": "agents"}
    held = value(
        found, "reservoir_claim_occupancy_seconds_total", **by_class, resource="concurrency"
    )
    assert held is not None and held >= 4  # a and b: 1 permit for at least 2 s each
    assert (
        value(found, "reservoir_claim_occupancy_seconds_total", **by_class, resource="tokens")
        is None
    )
    # C/R is the tokens' only: a permit consumes nothing.
    assert value(found, "reservoir_claim_consumed_ratio_count", **by_class, resource="tokens") == 3
    ratio = value(found, "reservoir_claim_consumed_ratio_count", **by_class, resource="concurrency")
    assert ratio is None


class Proxy:
    """A TCP relay to the API server that can be cut and restored: the operator's only
    way to the API, so cutting it is the API server going away for that operator."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.open = threading.Event()
        self.open.set()
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            if not self.open.is_set():
                client.close()
                continue
            upstream = socket.create_connection(self.target)
            self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self.open.clear()
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        self.sockets.clear()

    def restore(self) -> None:
        self.open.set()


def ready(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=3) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def test_readiness_follows_the_api_server_even_with_nothing_to_reconcile(
    cluster: ClusterHandle, ns: str, start_operator: StartOperator, tmp_path: Path
) -> None:
    """Found by review: with no envelope to reconcile, /readyz said ok for as long as the
    API server was unreachable."""
    config = yaml.safe_load(cluster.kubeconfig_path.read_text())
    server = urllib.parse.urlsplit(config["clusters"][0]["cluster"]["server"])
    proxy = Proxy((server.hostname or "127.0.0.1", server.port or 443))
    config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{proxy.port}"
    # The API server's certificate names 127.0.0.1, so the relay is transparent to TLS.
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(config))
    port = free_port()
    start_operator("--metrics-port", str(port), kubeconfig=kubeconfig)
    assert ready(port) == 200

    proxy.cut()
    eventually("/readyz to fail while the API server is unreachable", lambda: ready(port) == 503)
    proxy.restore()
    eventually("/readyz to recover", lambda: ready(port) == 200, timeout=60)


def get_status(url: str, token: str | None = None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    try:
        request = urllib.request.Request(url, headers=headers)
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_metrics_answer_only_a_token_allowed_to_get_them(
    cluster: ClusterHandle, ns: str, start_operator: StartOperator
) -> None:
    """Issue 21: the metrics name every tenant's envelopes. With --metrics-auth=kubernetes
    (the chart's default) the API server says whose a token is (TokenReview) and whether
    it may get /metrics (SubjectAccessReview, as the chart's metrics-reader ClusterRole
    grants); the kubelet's readiness probe needs no token."""
    reader = f"{ns}-metrics-reader"
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": reader},
        "rules": [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": reader},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": reader},
        "subjects": [{"kind": "ServiceAccount", "name": "scraper", "namespace": ns}],
    }
    for account in ("scraper", "tenant"):
        cluster.kubectl("create", "serviceaccount", account, "-n", ns)
    for obj in (role, binding):
        cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))
    try:
        scraper, tenant = (
            cluster.kubectl("create", "token", account, "-n", ns).strip()
            for account in ("scraper", "tenant")
        )
        port = free_port()
        start_operator("--metrics-port", str(port), "--metrics-auth", "kubernetes")
        metrics = f"http://127.0.0.1:{port}/metrics"
        assert get_status(f"http://127.0.0.1:{port}/readyz")[0] == 200
        assert get_status(metrics)[0] == 401
        assert get_status(metrics, "not-a-token")[0] == 401
        status, text = get_status(metrics, tenant)
        assert status == 403, text
        assert f"system:serviceaccount:{ns}:tenant may not get /metrics" in text
        allowed = eventually(
            "the scraper's token to be allowed",  # RBAC's cache may lag the binding
            lambda: (r := get_status(metrics, scraper))[0] == 200 and r[1],
        )
        assert "reservoir_build_info" in str(allowed)
    finally:
        cluster.kubectl("delete", "clusterrolebinding,clusterrole", reader, "--ignore-not-found")


# --- every dashboard panel's query against a live scrape (issue 25) -------------------------

# Grafana's variables, as a user who selects this test's namespace would have them.
RATE_INTERVAL = "5m"
# A panel filter that shows only trouble (`> 0`, `== 0`) is left off: a healthy worked example
# has none to show, and what the test proves is that the series the panel aggregates exist.
DISPLAY_FILTER = re.compile(r"\s*(?:>|==)\s*0$")
# Metrics only a failure the worked example does not stage can give a value; their queries
# are still run, and the operator must export their families (HELP and TYPE on /metrics).
NOT_STAGED = {
    "reservoir_ledger_errors_total": "a ledger that cannot move (an unreadable envelope, an "
    "invariant violation, a refused write): every ledger here stays healthy",
}


def dashboard_queries(namespace: str) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel's query, Grafana's variables filled in."""
    variables = {
        "$__rate_interval": RATE_INTERVAL,
        "$namespace": namespace,
        "$envelope": ".*",
        "$resource": "tokens",
        "$pool": ".*",
    }
    queries = []
    for panel in dashboard.dashboard()["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, filled in sorted(variables.items(), key=lambda kv: -len(kv[0])):
                expr = expr.replace(name, filled)
            assert "$" not in expr, f"{panel['title']}: unknown variable in {expr}"
            queries.append((panel["title"], DISPLAY_FILTER.sub("", expr)))
    return queries


def input_series(scrapes: list[str]) -> list[dict[str, str]]:
    """The scrapes as promtool input series, one scrape a minute ("_": absent then)."""
    series: dict[str, list[str]] = {}
    for index, text in enumerate(scrapes):
        for (name, labels), number in samples(text).items():
            if not math.isfinite(number):
                continue
            selector = ",".join(f"{k}={json.dumps(v)}" for k, v in labels)
            values = series.setdefault(f"{name}{{{selector}}}", ["_"] * len(scrapes))
            values[index] = repr(float(number))
    return [{"series": key, "values": " ".join(v)} for key, v in sorted(series.items())]


def returns_data(
    scrapes: list[str], queries: list[tuple[str, str]], directory: Path
) -> subprocess.CompletedProcess[str]:
    """`promtool test rules` of a file where each query must have returned a number (not NaN)
    at some scrape: count_over_time of `q == q` over them all, clamped to 1, must be 1."""
    minutes = len(scrapes)
    tests = [
        {
            "expr": f"clamp_max(count(count_over_time((({q}) == ({q}))[{minutes + 1}m:1m])), 1)",
            "eval_time": f"{minutes - 1}m",
            "exp_samples": [{"labels": "{}", "value": 1}],
        }
        for _, q in queries
    ]
    document = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {"interval": "1m", "input_series": input_series(scrapes), "promql_expr_test": tests}
        ],
    }
    path = directory / "dashboard_queries_test.yaml"
    path.write_text(yaml.safe_dump(document, width=1_000_000))
    return subprocess.run(
        [str(tool("promtool")), "test", "rules", path.name],
        cwd=directory,
        capture_output=True,
        text=True,
        check=False,
    )


class Scraper:
    """Scrapes /metrics every half second in the background, keeping each exposition."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.scrapes: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError):
                self.scrapes.append(scrape(self.port))
            self._stop.wait(0.5)

    def latest(self) -> str:
        """The last exposition scraped (what promtool will see), "" before the first."""
        return self.scrapes[-1] if self.scrapes else ""

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.scrapes.append(scrape(self.port))


def test_every_dashboard_query_returns_data_from_a_live_scrape(
    cluster: ClusterHandle, ns: str, start_operator: StartOperator, sdk: Reservoir, tmp_path: Path
) -> None:
    """Issue 25: a worked example that stages what every panel shows (open claims of every
    phase, a waiting claim, renewals, a lapse, an expiry, a deletion waiting on its
    settlement, cancels the provider confirms, an overrun and a late report, Reusable and
    Replenishing resources, a pool with an envelope waiting), scraped all along; promtool
    then evaluates every dashboard query over the scrapes, and each must return a number
    at some scrape. A query over a metric the operator does not export fails the check."""
    with provider_server() as provider:
        port = free_port()
        start_operator("--metrics-port", str(port), "--provider-allow", host_address())
        body = {
            "apiVersion": "reservoir.dev/v1alpha1",
            "kind": "ReservationEnvelope",
            "metadata": {"name": "work", "namespace": ns, "labels": {CLASS_LABEL: "live"}},
            "spec": {
                "capacity": {"concurrency": "2", "tokens": "200", "rpm": "60"},
                "contracts": {"rpm": {"type": "Replenishing", "windowSeconds": 600}},
                "policy": {
                    "defaultLeaseSeconds": 120,
                    "ambiguityDeadlineSeconds": 600,
                    "provider": {"statusURL": provider.status_url},
                    "providerLookupMaxSeconds": 2,
                },
            },
        }
        cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
        with Scraper(port) as scraper:
            staged = stage_every_panel(cluster, ns, sdk, provider, scraper)
        scrapes = scraper.scrapes
    assert len(scrapes) >= 10, len(scrapes)
    last = scrapes[-1]

    queries = dashboard_queries(ns)
    assert len(queries) >= 40, len(queries)
    staged_queries = []
    for title, query in queries:
        if referenced_metric_names(query) <= NOT_STAGED.keys():
            for metric in referenced_metric_names(query):
                assert f"# TYPE {metric} " in last, f"{title}: {metric} is not exported"
        else:
            staged_queries.append((title, query))
    result = returns_data(scrapes, staged_queries, tmp_path)
    assert result.returncode == 0, (
        f"dashboard queries without data (staged: {staged}):\n{result.stdout}{result.stderr}"
    )

    # The check can fail: a query over a metric the operator never exports has no data.
    bogus = [("bogus", 'sum by (resource) (reservoir_envelope_never_exported{namespace=~".*"})')]
    result = returns_data(scrapes, bogus, tmp_path)
    assert result.returncode != 0, "a query over an unexported metric passed"
    assert "reservoir_envelope_never_exported" in result.stdout + result.stderr


def stage_every_panel(
    cluster: ClusterHandle, ns: str, sdk: Reservoir, provider: ProviderServer, scraper: Scraper
) -> list[str]:
    """The worked example behind test_every_dashboard_query_returns_data_from_a_live_scrape;
    returns what it staged, in order (for the failure message). Each stage waits until a
    scrape the scraper kept shows it, so that promtool sees every state staged."""
    staged: list[str] = []
    env = {"namespace": ns, "envelope": "work"}
    permits = {"resource": "concurrency", "contract": "Reusable"}
    by_class = {"namespace": ns, "class": "live"}

    def seen(what: str, check: Callable[[Samples], bool]) -> Samples:
        found = eventually(what, lambda: s if check(s := samples(scraper.latest())) else None)
        staged.append(what)
        return found

    # A lease that lapses after the commit point (Detached, stranded), and a Tentative hold
    # that expires (released as LeaseExpired).
    d = sdk.hold("work", "D", {"tokens": "5"}, name="d", lease_seconds=3, dispatch=True)
    t = sdk.hold("work", "T", {"tokens": "5"}, name="t", lease_seconds=3)
    # Two permits, three branches: the third waits (a shortfall) while both are held.
    request = {"concurrency": "1", "tokens": "10", "rpm": "5"}
    a, b, c = (sdk.hold("work", n, request, name=n, dispatch=True) for n in "abc")
    a, b = (wait_phase(sdk, x, "Committed") for x in (a, b))
    seen(
        "the third branch short of a permit",
        lambda s: value(s, "reservoir_envelope_shortfall", **env, **permits) == 1,
    )
    # Two renewals, one scrape apart (a histogram shows a rate from its second observation).
    a = sdk.renew(sdk.get(a))
    seen(
        "a renewal's margin",
        lambda s: value(s, "reservoir_lease_renewal_margin_seconds_count", **by_class) == 1,
    )
    a = sdk.renew(sdk.get(a))
    seen(
        "open leases and reservations",
        lambda s: (
            value(s, "reservoir_lease_renewal_margin_seconds_count", **by_class) == 2
            and value(s, "reservoir_envelope_lease_remaining_seconds", **env) is not None
            and value(s, "reservoir_envelope_oldest_reservation_timestamp_seconds", **env)
            is not None
        ),
    )
    wait_phase(sdk, d, "Detached", within=20)
    wait_phase(sdk, t, "Expired", within=20)
    seen(
        "D's capacity stranded and T's released as LeaseExpired",
        lambda s: (
            value(s, "reservoir_envelope_stranded", **env, resource="tokens") == 5
            and value(
                s,
                "reservoir_claim_released_total",
                **by_class,
                resource="tokens",
                reason="LeaseExpired",
            )
            == 5
        ),
    )

    # B deleted after its commit point: the deletion waits on its settlement (a cancel).
    cluster.kubectl("delete", "bclaim", "b", "-n", ns, "--wait=false")
    seen(
        "B's deletion waiting on its settlement",
        lambda s: value(s, "reservoir_envelope_finalizer_due_timestamp_seconds", **env) is not None,
    )
    sdk.finish(sdk.get("b"), {"tokens": "4", "rpm": "2"})
    c = wait_phase(sdk, c, "Committed")  # B's permit came back

    # Two cancels the provider confirms, one scrape apart.
    for number, name in enumerate(("e1", "e2"), start=1):
        operation = f"op-{name}"
        provider.script(operation, answer(operation, "Running"))
        upstream = {"operationId": operation, "supportsStatus": True}
        claim = sdk.hold(
            "work", name, {"tokens": "10"}, name=name, dispatch=True, upstream=upstream
        )
        claim = wait_phase(sdk, claim, "Committed")
        sdk.cancel(claim)
        provider.script(operation, answer(operation, "Cancelled", usage={"tokens": "2"}))
        seen(
            f"{name}'s cancel confirmed by the provider",
            lambda s, n=number: (
                value(s, "reservoir_claim_cancel_confirmation_seconds_count", **by_class) == n
            ),
        )

    # E1's worker reports after the provider settled it (kubectl: the SDK would refuse); A
    # overruns its reservation; C and D end.
    late = {"usage": {"tokens": "3"}, "final": True, "outcome": "Succeeded"}
    cluster.kubectl(
        "patch",
        "bclaim",
        "e1",
        "-n",
        ns,
        "--type=merge",
        "-p",
        json.dumps({"spec": under_lease(sdk.get("e1").body or {}, late)}),
    )
    sdk.finish(sdk.get(a), {"tokens": "15", "rpm": "3"})
    sdk.finish(sdk.get(c), {"tokens": "6", "rpm": "3"})
    sdk.finish(sdk.get(d), {"tokens": "5"}, outcome="Failed")
    seen(
        "an overrun, a late report, and occupancy",
        lambda s: (
            value(s, "reservoir_claim_overruns_total", **by_class) == 1
            and value(s, "reservoir_claim_late_reports_total", **by_class) == 1
            and (
                value(
                    s, "reservoir_claim_occupancy_seconds_total", **by_class, resource="concurrency"
                )
                or 0
            )
            > 0
        ),
    )

    # A pool over the namespace: one envelope admitted, one waiting for it.
    pool = f"live-{ns}"
    body = {
        "apiVersion": "reservoir.dev/v1alpha1",
        "kind": "ReservationPool",
        "metadata": {"name": pool},
        "spec": {"capacity": {"tokens": "100"}, "namespaces": [ns]},
    }
    eventually(
        "the pool created", lambda: cluster.kubectl("create", "-f", "-", input=json.dumps(body))
    )
    try:
        for name, tokens in (("admitted", "70"), ("waiting", "50")):
            create_envelope(cluster, ns, name, {"tokens": tokens}, defaultLeaseSeconds=120)
        seen(
            "the pool's envelopes, one admitted and one waiting",
            lambda s: (
                value(s, "reservoir_pool_envelopes", pool=pool, namespace=ns, state="reserved") == 1
                and value(s, "reservoir_pool_envelopes", pool=pool, namespace=ns, state="pending")
                == 1
            ),
        )
    finally:
        cluster.kubectl(
            "delete",
            "reservationenvelope",
            "admitted",
            "waiting",
            "-n",
            ns,
            "--wait=false",
            "--ignore-not-found",
        )
        cluster.kubectl("delete", "reservationpool", pool, "--wait=false", "--ignore-not-found")
    return staged
