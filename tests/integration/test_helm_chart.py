"""The Helm chart: lint-clean for every combination of values its schema allows, the
schema rejects what it should, the rendered manifests pass the API server's dry run, and
install / upgrade / uninstall create, change and remove exactly the release's objects
(uninstall leaves only the CRDs, as Helm does)."""

from __future__ import annotations

import json
import random
import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from reservoir import crdgen
from tests.clusters import ClusterHandle, schemaless_crd
from tests.integration.chart import CHART, KUBE_VERSION, helm, render, set_args, tool
from tests.integration.helpers import eventually

# Each switch: (default, other). The schema rules out two combinations, checked below.
SWITCHES: dict[str, tuple[Any, Any]] = {
    "replicaCount": (2, 1),
    "watchNamespaces": ([], ["team-a", "team-b"]),
    "peering.enabled": (True, False),
    "serviceAccount.create": (True, False),
    "rbac.create": (True, False),
    "rbac.userRoles": (True, False),
    "verbose": (False, True),
    "metrics.service.enabled": (True, False),
    "metrics.auth.mode": ("kubernetes", "none"),
    "metrics.serviceMonitor.enabled": (False, True),
    "metrics.prometheusRule.enabled": (False, True),
    "metrics.dashboard.enabled": (False, True),
    "placeholderPriorityClass.create": (True, False),
    "admissionPolicy.enabled": (True, False),
    "providers.allowedHosts": ([], ["inference.example", "*.corp.example", "10.20.0.0/16"]),
    "admissionPolicy.exemptGroups": (["system:masters"], []),
    "placement.allowedTolerationKeys": (["nvidia.com/gpu"], []),
}
# The chart's ValidatingAdmissionPolicies, each with a binding of the same name.
POLICIES = (
    "operator-pods",
    "operator-jobs",
    "operator-resourceclaims",
    "placeholder-priority",
    "placeholder-pods",
    "claim-devices",
    "claim-resourceclaims",
    "placement",
    "status",
    "metadata",
    "compensations",
    "serving-classes",
    "provider-urls",
)
MONITORING = {
    "metrics.serviceMonitor.enabled": True,
    "metrics.prometheusRule.enabled": True,
    "metrics.dashboard.enabled": True,
}


def allowed_by_schema(values: dict[str, Any]) -> bool:
    service = values.get("metrics.service.enabled", True)
    return service or not values.get("metrics.serviceMonitor.enabled", False)


def with_requirements(values: dict[str, Any]) -> dict[str, Any]:
    if values.get("serviceAccount.create") is False:
        return {**values, "serviceAccount.name": "existing-sa"}
    return values


def combinations() -> list[dict[str, Any]]:
    """The defaults, each switch flipped alone, all flipped, and a fixed random sample."""
    found = [{}, {k: other for k, (_, other) in SWITCHES.items()}]
    found += [{key: other} for key, (_, other) in SWITCHES.items()]
    rng = random.Random(9)
    found += [{k: rng.choice(pair) for k, pair in SWITCHES.items()} for _ in range(24)]
    return [with_requirements(v) for v in found if allowed_by_schema(v)]


def lint(values: dict[str, Any]) -> str:
    return helm(None, "lint", "--strict", str(CHART), *set_args(values), check=False)


def test_lint_strict_and_render_for_every_combination_of_values() -> None:
    for values in combinations():
        out = lint(values)
        assert "0 chart(s) failed" in out, f"helm lint --strict with {values}:\n{out}"
        docs = render(values)
        keys = [(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs]
        assert len(keys) == len(set(keys)), f"{values}: an object twice: {keys}"
        for doc in docs:
            labels = doc["metadata"].get("labels") or {}
            assert labels.get("app.kubernetes.io/instance") == "rel", f"{values}: {doc}"
        kinds = {d["kind"] for d in docs}
        assert ("ServiceMonitor" in kinds) == values.get("metrics.serviceMonitor.enabled", False)
        assert ("ClusterRoleBinding" in kinds) == values.get("rbac.create", True)
        if values.get("watchNamespaces") and values.get("rbac.create", True):
            roles = {d["metadata"]["namespace"] for d in docs if d["kind"] == "Role"}
            assert roles == set(values["watchNamespaces"])


def test_the_deployment_runs_hardened_with_probes_and_peering() -> None:
    docs = render({})
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert deployment["spec"]["replicas"] == 2
    assert container["image"] == "ghcr.io/reservoir-dev/reservoir-operator:0.1.0"
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 65532
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
    assert security["capabilities"]["drop"] == ["ALL"]
    assert security["seccompProfile"]["type"] == "RuntimeDefault"
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": 8080, "health": 8081}
    assert container["args"] == [
        "--all-namespaces",
        "--peering=rel-reservoir",
        "--metrics-port=8080",
        "--metrics-auth=kubernetes",
        "--placeholder-priority-class=reservoir-placeholder",
        "--transition-events=exceptions",
        "--queue-reason-after=10",
        "--restrict-placement",
        "--allowed-toleration-key=nvidia.com/gpu",
        "--allowed-node-label-key=kubernetes.io/hostname",
        "--allowed-node-label-key=topology.kubernetes.io/zone",
        "--allowed-node-label-key=topology.kubernetes.io/region",
        "--allowed-node-label-key=node.kubernetes.io/instance-type",
        "--allowed-node-label-key=nvidia.com/gpu.product",
        "--liveness=http://0.0.0.0:8081/healthz",
        "--provider-max-in-flight=32",
        "--provider-max-in-flight-per-namespace=4",
        "--provider-calls-per-second-per-namespace=2",
        "--provider-burst-per-namespace=10",
    ]
    assert pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    peering = next(d for d in docs if d["kind"] == "ClusterKopfPeering")
    assert peering["metadata"]["name"] == "rel-reservoir"
    namespaced = render({"watchNamespaces": ["a", "b"]})
    container = next(d for d in namespaced if d["kind"] == "Deployment")["spec"]["template"][
        "spec"
    ]["containers"][0]
    assert container["args"][:3] == ["--namespace=a", "--namespace=b", "--peering=rel-reservoir"]
    assert {(d["kind"], d["metadata"].get("namespace")) for d in namespaced} >= {
        ("KopfPeering", "a"),
        ("KopfPeering", "b"),
        ("Role", "a"),
        ("RoleBinding", "b"),
    }


def test_no_rule_uses_a_wildcard_or_touches_secrets() -> None:
    """Issue 21: no Secret anywhere in the operator's own roles (it had `get` on the named
    Secrets in every namespace, kube-system included); the one ClusterRole that names
    Secrets is bound by a namespace that grants its token, and has get alone."""
    for values in ({}, {"watchNamespaces": ["a"]}):
        bound = set()
        for doc in render(values):
            if doc["kind"] in ("RoleBinding", "ClusterRoleBinding"):
                bound.add(doc["roleRef"]["name"])
            for rule in doc.get("rules", []) if doc["kind"] in ("Role", "ClusterRole") else []:
                for field in ("apiGroups", "resources", "verbs"):
                    assert "*" not in rule.get(field, []), f"{doc['metadata']['name']}: {rule}"
                if doc["metadata"]["name"] == "rel-reservoir-metrics-reader":
                    assert rule == {"nonResourceURLs": ["/metrics"], "verbs": ["get"]}
                    continue
                assert not rule.get("nonResourceURLs"), doc["metadata"]["name"]
                if doc["metadata"]["name"] == "rel-reservoir-provider-tokens":
                    assert rule == {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}
                else:
                    assert "secrets" not in rule.get("resources", []), doc["metadata"]["name"]
        assert "rel-reservoir-provider-tokens" not in bound  # only a namespace binds it


def test_metrics_auth_grants_the_reviews_and_a_reader_role_and_the_scrape_sends_a_token() -> None:
    """Issue 21: /metrics behind TokenReview + SubjectAccessReview by default."""
    values = {"metrics.serviceMonitor.enabled": True}
    docs = render(values)
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    auth = by_name["ClusterRole", "rel-reservoir-metrics-auth"]
    assert auth["rules"] == [
        {
            "apiGroups": ["authentication.k8s.io"],
            "resources": ["tokenreviews"],
            "verbs": ["create"],
        },
        {
            "apiGroups": ["authorization.k8s.io"],
            "resources": ["subjectaccessreviews"],
            "verbs": ["create"],
        },
    ]
    binding = by_name["ClusterRoleBinding", "rel-reservoir-metrics-auth"]
    assert binding["subjects"][0]["kind"] == "ServiceAccount"
    assert ("ClusterRole", "rel-reservoir-metrics-reader") in by_name
    assert ("ClusterRoleBinding", "rel-reservoir-metrics-reader") not in by_name
    deployment = by_name["Deployment", "rel-reservoir"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--metrics-auth=kubernetes" in args
    monitor = next(d for d in docs if d["kind"] == "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["bearerTokenFile"].endswith("serviceaccount/token")

    readers = [{"name": "prometheus", "namespace": "monitoring"}]
    docs = render({**values, "metrics.auth.readerServiceAccounts": readers})
    bound = next(
        d
        for d in docs
        if d["metadata"]["name"] == "rel-reservoir-metrics-reader"
        and d["kind"] == "ClusterRoleBinding"
    )
    assert bound["subjects"] == [{"kind": "ServiceAccount", **readers[0]}]

    docs = render({**values, "metrics.auth.mode": "none"})
    assert not [d for d in docs if "metrics-" in d["metadata"]["name"] and "Role" in d["kind"]]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert "--metrics-auth=none" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    monitor = next(d for d in docs if d["kind"] == "ServiceMonitor")
    assert "bearerTokenFile" not in monitor["spec"]["endpoints"][0]


def operator_rules(docs: list[dict[str, Any]]) -> dict[tuple[str, str | None], list[Any]]:
    """The rules of the operator's (Cluster)Roles, by (kind, namespace)."""
    return {
        (d["kind"], d["metadata"].get("namespace")): d["rules"]
        for d in docs
        if d["kind"] in ("Role", "ClusterRole") and d["metadata"]["name"] == "rel-reservoir"
    }


def test_provider_rules_jobs_and_extra_rules() -> None:
    """Upstream Jobs (watch, read, suspend, delete) and Pods (read) always; no Secrets;
    providers.extraRules as given. Wherever the operator's other namespaced rules are: the
    ClusterRole, or each watched namespace's Role (never the namespaced release's
    ClusterRole)."""
    extra = {"apiGroups": ["example.com"], "resources": ["trainings"], "verbs": ["get", "delete"]}
    jobs = {
        "apiGroups": ["batch"],
        "resources": ["jobs"],
        "verbs": ["get", "list", "watch", "patch", "delete"],
    }
    for scope in ({}, {"watchNamespaces": ["a", "b"]}):
        where = [("Role", "a"), ("Role", "b")] if scope else [("ClusterRole", None)]
        plain = operator_rules(render(scope))
        for key in where:
            assert jobs in plain[key], plain[key]
            assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]} in plain[key]
            assert not [r for r in plain[key] if "secrets" in r["resources"]], plain[key]
            assert extra not in plain[key]
        values = {**scope, "providers.extraRules": [extra]}
        rules = operator_rules(render(values))
        for key in where:
            assert extra in rules[key], rules[key]
            assert not [r for r in rules[key] if "secrets" in r["resources"]], rules[key]
        if scope:
            cluster_wide = operator_rules(render(values))[("ClusterRole", None)]
            assert not [r for r in cluster_wide if r["resources"][0] in ("jobs", "secrets")]
            assert extra not in cluster_wide


def test_the_schema_rejects_typos_and_wrong_types() -> None:
    for values in (
        {"replicacount": 2},
        {"image.tags": "x"},
        {"metrics.servicemonitor.enabled": True},
        {"peering.enable": True},
        {"placeholderPriorityClass.preemptionPolicy": "Never"},
        {"replicaCount": "two"},
        {"watchNamespaces": "team-a"},
        {"watchNamespaces": ["Team_A"]},
        {"image.pullPolicy": "Sometimes"},
        {"metrics.service.enabled": False, "metrics.serviceMonitor.enabled": True},
        {"serviceAccount.create": False},
        # Names the API server would refuse: too long (the Service appends -metrics), not
        # DNS-1123, or two dots in a row.
        {"fullnameOverride": "a" * 56},
        {"fullnameOverride": "a" * 63},
        {"fullnameOverride": "Reservoir_Op"},
        {"fullnameOverride": "1reservoir"},  # a Service name must start with a letter
        {"nameOverride": "Res"},
        {"nameOverride": "res-"},
        {"serviceAccount.name": "Bad_Name"},
        {"serviceAccount.create": False, "serviceAccount.name": "Bad_Name"},
        {"serviceAccount.name": "a" * 254},
        {"peering.name": "a..b"},
        {"peering.name": "Peer"},
        {"peering.name": "a" * 254},
        # The selector's labels: the Deployment would no longer select its pods.
        {"podLabels": {"app.kubernetes.io/name": "other"}},
        {"podLabels": {"app.kubernetes.io/instance": "other"}},
        # No Secrets by name any more (a namespace grants them); extra rules have no
        # wildcard and no Secrets.
        {"providers.secrets": ["provider-token"]},
        # Allow-lists are label keys; exempt groups are names.
        {"placement.allowedTolerationKeys": ["bad key"]},
        {"placement.allowedNodeLabelKeys": "kubernetes.io/hostname"},
        {"admissionPolicy.protectedNamespaces": ["Kube_System"]},
        {"admissionPolicy.exemptGroups": ["a'b"]},
        {"providers.extraRules": [{"apiGroups": ["*"], "resources": ["x"], "verbs": ["get"]}]},
        {"providers.extraRules": [{"apiGroups": ["a"], "resources": ["*"], "verbs": ["get"]}]},
        {"providers.extraRules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]},
        # ... and nothing as strong as reading Secrets: subresources, accounts, RBAC.
        *(
            {"providers.extraRules": [{"apiGroups": [group], "resources": [r], "verbs": ["get"]}]}
            for group, r in (
                ("", "*/exec"),
                ("", "pods/exec"),
                ("", "serviceaccounts/token"),
                ("", "serviceaccounts"),
                ("rbac.authorization.k8s.io", "clusterroles"),
            )
        ),
        {"providers.extraRules": [{"apiGroups": ["a"], "resources": ["x"], "verbs": ["*"]}]},
        {"providers.extraRules": [{"apiGroups": ["a"], "resources": ["x"], "verbs": ["bind"]}]},
        {"providers.extraRules": [{"apiGroups": ["a"], "resources": ["x"]}]},
        # The provider allow-list: host names, "*." wildcards, IPs and CIDRs only.
        {"providers.allowedHosts": "inference.example"},
        {"providers.allowedHosts": ["https://inference.example"]},
        {"providers.allowedHosts": ["Inference_Example"]},
        {"providers.allowedHosts": ["*"]},
        {"providers.allowedHosts": ["inference.example:8080"]},
        {"providers.maxInFlight": 0},
        {"providers.callsPerSecondPerNamespace": 0},
    ):
        out = lint(values)
        assert "1 chart(s) failed" in out and "schema" in out, f"accepted {values}:\n{out}"
    for values in (
        {"fullnameOverride": "a" * 55},
        {"nameOverride": "res"},
        {"serviceAccount.name": "ops.reservoir-sa"},
        {"peering.name": "a.b-c"},
        {"podLabels": {"team": "gpu", "app.kubernetes.io/component": "operator"}},
        {"providers.allowedHosts": ["a.example", "*.b.example", "10.0.0.1", "fd00::/8"]},
        {"providers.callsPerSecondPerNamespace": 0.5},
    ):
        out = lint(values)
        assert "0 chart(s) failed" in out, f"refused {values}:\n{out}"


def test_the_provider_allow_list_reaches_the_operator_and_the_admission_policy() -> None:
    def of(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
        return next(d for d in docs if d["kind"] == kind)

    def variables(docs: list[dict[str, Any]]) -> dict[str, str]:
        policy = next(
            d
            for d in docs
            if d["kind"] == "ValidatingAdmissionPolicy"
            and d["metadata"]["name"].endswith("-provider-urls")
        )
        return {v["name"]: v["expression"] for v in policy["spec"]["variables"]}

    default = render({})
    args = of(default, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [a for a in args if a.startswith("--provider-allow")], "empty: none allowed"
    assert "--provider-max-in-flight=32" in args
    assert "--provider-calls-per-second-per-namespace=2" in args
    empty = variables(default)
    assert (empty["names"], empty["suffixes"], empty["cidrs"]) == ("[]", "[]", "[]")

    hosts = ["inference.example", "*.corp.example", "10.20.0.0/16", "10.9.8.7", "fd00::1"]
    docs = render({"providers.allowedHosts": hosts, "watchNamespaces": ["team-a"]})
    args = of(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--provider-allow")] == [
        f"--provider-allow={h}" for h in hosts
    ]
    listed = variables(docs)
    assert json.loads(listed["names"]) == ["inference.example"]
    assert json.loads(listed["suffixes"]) == [".corp.example"]
    assert json.loads(listed["cidrs"]) == ["10.20.0.0/16", "10.9.8.7/32", "fd00::1/128"]
    binding = next(
        d
        for d in docs
        if d["kind"] == "ValidatingAdmissionPolicyBinding"
        and d["metadata"]["name"].endswith("-provider-urls")
    )
    selector = binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"][0]
    assert selector["values"] == ["team-a"], "only the watched namespaces"
    assert not [d for d in render({"admissionPolicy.enabled": False}) if "provider-urls" in str(d)]


def test_the_chart_refuses_one_port_for_metrics_and_health() -> None:
    """The schema cannot compare two values: the template fails, saying why (helm lint
    reports a template's `fail` only as INFO: install and template refuse it)."""

    def template(values: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        args = ["template", "rel", str(CHART), "--kube-version", KUBE_VERSION]
        return subprocess.run(
            [tool("helm"), *args, *set_args(values)], capture_output=True, text=True, check=False
        )

    for values in (
        {"metrics.port": 8081},
        {"health.port": 8080},
        {"metrics.port": 9000, "health.port": 9000},
    ):
        result = template(values)
        assert result.returncode != 0, f"rendered {values}"
        assert "metrics.port and health.port are both" in result.stderr, result.stderr
    assert template({"metrics.port": 9000, "health.port": 9001}).returncode == 0


DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
# A release name of Helm's maximum length (53).
LONG_RELEASE = "a-release-name-of-fifty-three-characters-for-a-test-x"


def assert_names_valid(docs: list[dict[str, Any]], context: str) -> None:
    """Every name within the API server's limits: Services DNS-1035 labels (63), other
    objects DNS-1123 subdomains (253), label values 63."""
    for doc in docs:
        kind, name = doc["kind"], doc["metadata"]["name"]
        if kind == "Service":
            assert len(name) <= 63 and DNS_1035_LABEL.match(name), f"{context}: Service {name}"
        else:
            assert len(name) <= 253 and DNS_SUBDOMAIN.match(name), f"{context}: {kind} {name}"
        labels = dict(doc["metadata"].get("labels") or {})
        if kind == "Deployment":
            labels.update(doc["spec"]["template"]["metadata"]["labels"])
        for key, value in labels.items():
            assert len(value) <= 63 and LABEL_VALUE.match(value), f"{context}: {key}={value}"


def test_every_name_fits_whatever_the_release_name() -> None:
    """Helm allows release names of up to 53 characters; the derived names must fit
    (`<fullname>-metrics` is a Service, at most 63)."""
    assert len(LONG_RELEASE) == 53
    everything = {**MONITORING, "watchNamespaces": ["team-a"]}
    for length in range(44, 54):
        name = LONG_RELEASE[: length - 1] + "z"
        for values in (MONITORING, everything):
            docs = render(values, name=name)
            assert_names_valid(docs, f"release {name} ({length})")
            service = next(d for d in docs if d["kind"] == "Service")
            assert service["metadata"]["name"].endswith("-metrics")
            deployment = next(d for d in docs if d["kind"] == "Deployment")
            assert deployment["metadata"]["name"] == service["metadata"]["name"][: -len("-metrics")]
    # A release name that contains the chart's name is the full name, and overrides fit.
    assert_names_valid(render({}, name=("reservoir-" + "x" * 53)[:53]), "reservoir-xxx")
    for values in ({"fullnameOverride": "f" * 55}, {"nameOverride": "n" * 63}):
        assert_names_valid(render({**values, **MONITORING}, name=LONG_RELEASE), str(values))


def test_the_selector_matches_the_pods_whatever_the_pod_labels() -> None:
    deployment = next(
        d for d in render({"podLabels": {"team": "gpu"}}) if d["kind"] == "Deployment"
    )
    selector = deployment["spec"]["selector"]["matchLabels"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items() and labels["team"] == "gpu", (selector, labels)


def test_the_prometheus_rule_is_the_rule_file_and_the_dashboard_the_json() -> None:
    docs = render(MONITORING)
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    rule_file = yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text())
    assert rule["spec"] == rule_file
    dashboard = next(d for d in docs if d["kind"] == "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
    assert json.loads(dashboard["data"]["reservoir.json"]) == shipped


@pytest.fixture(scope="module")
def monitoring_crds(cluster: ClusterHandle, crds: None) -> None:
    """The Prometheus Operator's kinds, schemaless: enough for the API server to take a
    ServiceMonitor and a PrometheusRule."""
    for kind, plural in (
        ("ServiceMonitor", "servicemonitors"),
        ("PrometheusRule", "prometheusrules"),
    ):
        crd = schemaless_crd("monitoring.coreos.com", kind, plural)
        cluster.kubectl("apply", "-f", "-", input=json.dumps(crd))
        cluster.kubectl(
            "wait",
            "--for=condition=Established",
            f"crd/{plural}.monitoring.coreos.com",
            "--timeout=60s",
        )


def test_rendered_manifests_pass_the_api_servers_dry_run(
    cluster: ClusterHandle, ns: str, monitoring_crds: None
) -> None:
    watched = [f"{ns}-a", f"{ns}-b"]
    for name in watched:
        cluster.kubectl("create", "namespace", name)
    try:
        for release, values in (
            ("dry", MONITORING),
            ("dry", {**MONITORING, "watchNamespaces": watched}),
            # Helm's longest release name: the full name is truncated to fit -metrics.
            (LONG_RELEASE, MONITORING),
        ):
            full = f"{release}-reservoir"[:55].rstrip("-")
            out = helm(
                None,
                "template",
                release,
                str(CHART),
                "--namespace",
                ns,
                "--include-crds",
                "--kube-version",
                KUBE_VERSION,
                *set_args(values),
            )
            applied = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=out)
            assert f"servicemonitor.monitoring.coreos.com/{full}" in applied, applied
            assert f"validatingadmissionpolicy.admissionregistration.k8s.io/{full}" in applied
            assert f"deployment.apps/{full}" in applied
            assert f"service/{full}-metrics" in applied
            assert f"configmap/{full}-dashboard" in applied
    finally:
        for name in watched:
            cluster.kubectl("delete", "namespace", name, "--wait=false")


def exists(cluster: ClusterHandle, kind: str, name: str, namespace: str | None = None) -> bool:
    args = ["get", kind, name, "--ignore-not-found", "-o", "name"]
    if namespace:
        args += ["-n", namespace]
    return bool(cluster.kubectl(*args).strip())


def cluster_scoped_of(cluster: ClusterHandle, release: str) -> list[str]:
    """Every cluster-scoped object labelled with the release, whatever its kind."""
    kinds = cluster.kubectl("api-resources", "--namespaced=false", "--verbs=list", "-o", "name")
    found = []
    for kind in kinds.split():
        listed = cluster.kubectl(
            "get", kind, "-l", f"app.kubernetes.io/instance={release}", "-o", "name"
        )
        found += listed.split()
    return found


@pytest.fixture
def release_name(cluster: ClusterHandle) -> Iterator[str]:
    name = f"inst-{uuid.uuid4().hex[:6]}"
    yield name
    helm(cluster, "uninstall", name, "-n", f"{name}-system", "--wait", check=False)
    cluster.kubectl("delete", "namespace", f"{name}-system", "--wait=false", "--ignore-not-found")


def test_install_upgrade_uninstall(
    cluster: ClusterHandle, ns: str, monitoring_crds: None, release_name: str
) -> None:
    name, namespace, full = release_name, f"{release_name}-system", f"{release_name}-reservoir"
    # Without --skip-crds: the chart's CRDs already exist (identical), so Helm skips them.
    # The claim's admission policy, which comes with them, is taken away first: Helm must
    # create it from crds/ (and put it back here whatever happens).
    policy = CHART / "crds" / crdgen.CLAIM_POLICY_FILE
    cluster.kubectl("delete", "-f", str(policy), "--ignore-not-found", "--wait")
    try:
        _install_upgrade_uninstall(cluster, ns, name, namespace, full)
    finally:
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(policy))


CLAIM_POLICY = "branchclaims.reservoir.dev"  # the policy's name, and its binding's


def _install_upgrade_uninstall(
    cluster: ClusterHandle, ns: str, name: str, namespace: str, full: str
) -> None:
    helm(
        cluster,
        "install",
        name,
        str(CHART),
        "-n",
        namespace,
        "--create-namespace",
        "--wait",
        "--timeout=90s",
        *set_args(MONITORING),
        # The local cluster has a PriorityClass of the default name already: take another.
        "--set",
        f"placeholderPriorityClass.name={name}-placeholder",
    )
    expected = [
        ("deployment", full, namespace),
        ("serviceaccount", full, namespace),
        ("service", f"{full}-metrics", namespace),
        ("servicemonitor", full, namespace),
        ("prometheusrule", full, namespace),
        ("configmap", f"{full}-dashboard", namespace),
        ("clusterrole", full, None),
        ("clusterrolebinding", full, None),
        ("clusterrole", f"{full}-metrics-auth", None),
        ("clusterrolebinding", f"{full}-metrics-auth", None),
        ("clusterrole", f"{full}-metrics-reader", None),
        ("clusterrole", "reservoir-worker", None),
        ("clusterrole", "reservoir-envelope-editor", None),
        ("clusterrole", "reservoir-viewer", None),
        ("clusterrole", "reservoir-compensator", None),
        ("clusterrole", "reservoir-pool-admin", None),
        ("clusterrole", "reservoir-pool-viewer", None),
        ("priorityclass", f"{name}-placeholder", None),
        ("clusterkopfpeering", full, None),
        ("clusterrole", f"{full}-provider-tokens", None),
        *(
            (kind, f"{full}-{policy}", None)
            for kind in ("validatingadmissionpolicy", "validatingadmissionpolicybinding")
            for policy in POLICIES
        ),
        ("crd", "reservationenvelopes.reservoir.dev", None),
        ("crd", "branchclaims.reservoir.dev", None),
        ("crd", "clusterkopfpeerings.kopf.dev", None),
        ("crd", "kopfpeerings.kopf.dev", None),
    ]
    missing = [e for e in expected if not exists(cluster, *e)]
    assert not missing, f"not created: {missing}"
    for kind in ("validatingadmissionpolicy", "validatingadmissionpolicybinding"):
        made = json.loads(cluster.kubectl("get", kind, CLAIM_POLICY, "-o", "json"))
        # Created from crds/, as the CRDs are: not the release's, so never taken away by it.
        assert "meta.helm.sh/release-name" not in made["metadata"].get("annotations", {}), kind
    placeholder = json.loads(
        cluster.kubectl("get", "priorityclass", f"{name}-placeholder", "-o", "json")
    )
    assert placeholder["preemptionPolicy"] == "Never" and placeholder["value"] == 1_000_000
    # Two replicas (KWOK runs the pods), spread over two nodes.
    pods = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-o", "json"))["items"]
    assert len({p["spec"]["nodeName"] for p in pods}) == 2, [p["spec"]["nodeName"] for p in pods]
    cluster_scoped = cluster_scoped_of(cluster, name)
    # the cluster-scoped objects above
    assert len(cluster_scoped) == sum(1 for e in expected if e[2] is None and e[0] != "crd")

    # Upgrade: replicas, resources, and the operator limited to one namespace.
    helm(
        cluster,
        "upgrade",
        name,
        str(CHART),
        "-n",
        namespace,
        "--reuse-values",
        "--wait",
        "--timeout=90s",
        *set_args({"replicaCount": 3, "resources.limits.memory": "1Gi", "watchNamespaces": [ns]}),
    )
    deployment = json.loads(
        cluster.kubectl("get", "deployment", full, "-n", namespace, "-o", "json")
    )
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert deployment["spec"]["replicas"] == 3
    assert deployment["status"].get("readyReplicas") == 3
    assert container["resources"]["limits"]["memory"] == "1Gi"
    assert f"--namespace={ns}" in container["args"]
    assert exists(cluster, "role", full, ns) and exists(cluster, "kopfpeering", full, ns)
    assert not exists(cluster, "clusterkopfpeering", full)
    rules = json.loads(cluster.kubectl("get", "clusterrole", full, "-o", "json"))["rules"]
    # Cluster-scoped reads only, and the tenant pools (cluster-scoped themselves).
    assert {r["resources"][0] for r in rules} == {
        "customresourcedefinitions",
        "namespaces",
        "reservationpools",
        "reservationpools/status",
    }

    helm(cluster, "uninstall", name, "-n", namespace, "--wait")
    leftovers = cluster_scoped_of(cluster, name) + [
        f"{kind}/{obj}"
        for kind, obj, where in expected
        if where is None and kind != "crd" and exists(cluster, kind, obj)
    ]
    assert not leftovers, f"left behind by helm uninstall: {leftovers}"
    assert not exists(cluster, "role", full, ns) and not exists(cluster, "kopfpeering", full, ns)
    # The CRDs stay (and with them every envelope and claim), as Helm does, and so does the
    # claim's admission policy that Helm created with them (its spec rules).
    assert exists(cluster, "crd", "branchclaims.reservoir.dev")
    assert exists(cluster, "validatingadmissionpolicy", CLAIM_POLICY)
    assert exists(cluster, "validatingadmissionpolicybinding", CLAIM_POLICY)
    eventually(
        "edit to drop the worker's rules",
        lambda: "branchclaims" not in cluster.kubectl("get", "clusterrole", "edit", "-o", "yaml"),
    )


def test_the_claim_policy_comes_with_the_crds_not_with_a_release() -> None:
    """The claim's spec rules live in its admission policy: the chart carries it in crds/,
    which Helm installs once and never upgrades, rolls back or deletes, as the CRDs (found by
    review: as a release's template, `helm uninstall` or a rollback took the rules away while
    the claims stayed). Whatever the values, no template renders it."""
    args = ["template", "rel", str(CHART), "--kube-version", KUBE_VERSION, "--include-crds"]
    out = helm(None, *args)
    with_crds = [doc for doc in yaml.safe_load_all(out) if doc]
    claim_policy = [
        (doc["kind"], doc["metadata"]["name"])
        for doc in with_crds
        if doc["metadata"]["name"] == "branchclaims.reservoir.dev"
        and doc["kind"].startswith("ValidatingAdmissionPolicy")
    ]
    assert sorted(claim_policy) == [
        ("ValidatingAdmissionPolicy", "branchclaims.reservoir.dev"),
        ("ValidatingAdmissionPolicyBinding", "branchclaims.reservoir.dev"),
    ]
    for values in ({}, {"admissionPolicy.enabled": False}):
        assert not [d for d in render(values) if "branchclaims.reservoir.dev" in str(d["metadata"])]


def rules_text(policy: dict[str, Any]) -> str:
    return "\n".join(
        f"{v['expression']}\n{v.get('message', '')}" for v in policy["spec"]["validations"]
    )


def policies(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        d["metadata"]["name"].removeprefix("rel-reservoir-"): d
        for d in docs
        if d["kind"] == "ValidatingAdmissionPolicy"
    }


def test_the_admission_policies_bind_the_operator_and_keep_its_own_from_others() -> None:
    """Issue 21: each policy is bound (Deny); the operator's are matched on its
    ServiceAccount's username, the tenant-facing ones let only it (and the exempt groups)
    through; the protected namespaces always include the release's own; the constants the
    policies share with the operator (the pause image, the device classes) are its."""
    from reservoir.core.model import DEVICE_CLASSES
    from reservoir.k8s.devices import PAUSE_IMAGE

    docs = render({}, namespace="ops")
    found = policies(docs)
    assert set(found) == set(POLICIES)
    bindings = {
        d["spec"]["policyName"]: d["spec"]["validationActions"]
        for d in docs
        if d["kind"] == "ValidatingAdmissionPolicyBinding"
    }
    assert bindings == {f"rel-reservoir-{name}": ["Deny"] for name in found}
    operator = "request.userInfo.username == 'system:serviceaccount:ops:rel-reservoir'"
    for name in ("operator-pods", "operator-jobs", "operator-resourceclaims"):
        assert found[name]["spec"]["matchConditions"][0]["expression"] == operator
        first = found[name]["spec"]["validations"][0]["expression"]
        assert (
            first == '!(request.namespace in ["kube-system","kube-public","kube-node-lease","ops"])'
        )
    for name in ("placeholder-priority", "status"):
        text = rules_text(found[name])
        assert "system:serviceaccount:ops:rel-reservoir" in text and "system:masters" in text
    pods = rules_text(found["operator-pods"])
    assert f"c.image == '{PAUSE_IMAGE}'" in pods
    assert "'reservoir-placeholder'" in pods
    claims = rules_text(found["operator-resourceclaims"])
    assert f"in {json.dumps(sorted(DEVICE_CLASSES.values()))}" in claims
    assert 't.key in ["nvidia.com/gpu"]' in rules_text(found["placement"])
    status = found["status"]["spec"]["matchConstraints"]["resourceRules"][0]["resources"]
    assert sorted(status) == [
        "branchclaims/status",
        "reservationenvelopes/status",
        "reservationpools/status",
    ]
    assert not policies(render({"admissionPolicy.enabled": False}))
    # No exempt group: nobody but the operator passes.
    strict = policies(render({"admissionPolicy.exemptGroups": []}))
    assert "system:masters" not in rules_text(strict["status"])


def test_a_namespaced_release_guards_the_placeholder_class_everywhere_and_no_pool() -> None:
    """Found by review: bound to its namespaces, the placeholder PriorityClass (cluster-wide)
    was open in every other namespace; and the status policy, on cluster-scoped pools,
    refused another release's operator its own pools."""
    docs = render({"watchNamespaces": ["team-a"]})
    bindings = {
        d["spec"]["policyName"]: d["spec"]
        for d in docs
        if d["kind"] == "ValidatingAdmissionPolicyBinding"
    }
    for name in ("rel-reservoir-placeholder-priority", "rel-reservoir-placeholder-pods"):
        assert "matchResources" not in bindings[name], name
    assert "matchResources" in bindings["rel-reservoir-claim-devices"]
    status = next(d for d in docs if d["metadata"]["name"] == "rel-reservoir-status")
    [rule] = status["spec"]["matchConstraints"]["resourceRules"]
    assert "reservationpools/status" not in rule["resources"]
    cluster_wide = next(d for d in render({}) if d["metadata"]["name"] == "rel-reservoir-status")
    [rule] = cluster_wide["spec"]["matchConstraints"]["resourceRules"]
    assert "reservationpools/status" in rule["resources"]


def test_serving_classes_reach_the_operator_and_the_admission_policy_checked_by_the_schema(
    tmp_path: Path,
) -> None:
    """Issue 24: the chart's classes go to the operator's --serving-classes (a change rolls
    it), the tenant policy knows their names, and the schema refuses a class the operator
    would refuse at start (found by review: install passed, the operator exited 2)."""
    classes = {"Realtime": {"priority": 200, "policy": {"defaultLeaseSeconds": 15}}}
    docs = render({"servingClasses": classes})
    config = next(d for d in docs if d["metadata"]["name"] == "rel-reservoir-serving-classes")
    written = tmp_path / "serving-classes.yaml"
    written.write_text(config["data"]["serving-classes.yaml"])
    from reservoir.cli.operator import read_serving_classes

    assert read_serving_classes(str(written))["Realtime"].priority == 200
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]
    assert (
        "--serving-classes=/etc/reservoir/serving-classes.yaml"
        in pod["spec"]["containers"][0]["args"]
    )
    assert "checksum/serving-classes" in pod["metadata"]["annotations"]
    policy = next(
        d
        for d in docs
        if d["metadata"]["name"] == "rel-reservoir-serving-classes"
        and d["kind"] == "ValidatingAdmissionPolicy"
    )
    assert '"Realtime"' in policy["spec"]["validations"][0]["expression"]
    for bad in (
        {"ambiguityDeadlineSeconds": 0},
        {"maxActiveClaims": 5},
        {"defaultLeaseSeconds": "x"},
    ):
        out = helm(
            None,
            "template",
            "rel",
            str(CHART),
            "--kube-version",
            KUBE_VERSION,
            *set_args({"servingClasses": {"Fast": {"policy": bad}}}),
            check=False,
        )
        assert "values don't meet the specifications" in out, (bad, out)
    plain = render({})
    assert not [
        d for d in plain if "serving-classes" in d["metadata"]["name"] and d["kind"] == "ConfigMap"
    ]


def test_a_release_name_with_dots_makes_a_valid_service_name() -> None:
    """Issue 25's rough edge: a Service's name is a DNS-1035 label (no dots)."""
    docs = render({}, name="team.a")
    service = next(d for d in docs if d["kind"] == "Service")
    assert service["metadata"]["name"] == "team-a-reservoir-metrics"
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", service["metadata"]["name"])


def test_helm_template_needs_no_kube_version(tmp_path: Path) -> None:
    """Issue 25's rough edge: the helm that hack/tools/build.sh builds assumes the
    Kubernetes of the client-go it is built with (as Helm's own Makefile sets it), not
    v1.20.0, so `helm template` and `helm lint` of the chart need no --kube-version."""
    go_mod = (CHART.parents[1] / "hack" / "tools" / "helm" / "go.mod").read_text()
    minor = re.search(r"^\s*k8s\.io/client-go v0\.(\d+)\.", go_mod, re.MULTILINE)
    assert minor, "hack/tools/helm/go.mod requires k8s.io/client-go"
    probe = tmp_path / "probe"
    (probe / "templates").mkdir(parents=True)
    (probe / "Chart.yaml").write_text("apiVersion: v2\nname: probe\nversion: 0.1.0\n")
    (probe / "templates" / "v.yaml").write_text(
        "kube: {{ .Capabilities.KubeVersion.Version | quote }}\n"
    )
    rendered = yaml.safe_load(
        helm(None, "template", "p", str(probe), "--show-only", "templates/v.yaml")
    )
    assert rendered == {"kube": f"v1.{minor.group(1)}.0"}, rendered
    docs = [d for d in yaml.safe_load_all(helm(None, "template", "rel", str(CHART))) if d]
    assert any(d["kind"] == "Deployment" for d in docs)
    assert sorted(d["kind"] for d in docs) == sorted(d["kind"] for d in render({})), (
        "the same manifests as with --kube-version"
    )
    helm(None, "lint", "--strict", str(CHART))
