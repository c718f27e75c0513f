"""One tenant must not stop the operator for the others (issue 21), on the real control
plane with a cluster-wide operator:

- a claim nested 2,000 levels deep (stored while the claim schema lets it through) is set
  aside with a condition, an Event and a log line naming it, and another tenant's claims
  are admitted and settle, before and after an operator restart;
- a watch that dies (here: its kind forbidden) makes /readyz say so, is started again, and
  /readyz recovers once the watch has listed its kind;
- pods of other tenants that carry none of the operator's labels never reach it (the
  watches select by label on the API server).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from reservoir.sdk import Reservoir
from tests.clusters import ClusterHandle, free_port
from tests.integration.chart import token_kubeconfig
from tests.integration.conftest import REPO, OperatorProcess
from tests.integration.helpers import (
    create_envelope,
    eventually,
    metric,
    settled_ledger,
    wait_phase,
)

INITIAL_STATES = "reservoir_watch_initial_states_total"

LOGS = REPO / ".cluster" / "test-logs"
CLAIMS_CRD = "branchclaims.reservoir.dev"


@pytest.fixture
def namespaces(cluster: ClusterHandle, crds: None) -> Iterator[tuple[str, str]]:
    """Tenant A (hostile) and tenant B."""
    names = tuple(f"{t}-{uuid.uuid4().hex[:6]}" for t in ("hostile", "tenant"))
    for name in names:
        cluster.kubectl("create", "namespace", name)
    yield names[0], names[1]
    for name in names:
        cluster.kubectl("delete", "namespace", name, "--wait=false")


def cluster_wide_operator(
    cluster: ClusterHandle, name: str, *extra: str, kubeconfig: Path | None = None
) -> tuple[OperatorProcess, int]:
    LOGS.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = LOGS / f"{name}-{uuid.uuid4().hex[:4]}.log"
    operator = OperatorProcess(
        cluster, None, log, "--metrics-port", str(port), *extra, kubeconfig=kubeconfig
    )
    return operator, port


def readyz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def deep_claim(namespace: str, name: str, levels: int = 2000) -> str:
    """JSON text (json.dumps would recurse): a claim whose affinity nests `levels` deep."""
    affinity = '{"x":' * levels + "1" + "}" * levels
    return (
        '{"apiVersion":"reservoir.dev/v1alpha1","kind":"BranchClaim","metadata":'
        f'{{"name":"{name}","namespace":"{namespace}"}},"spec":{{"envelope":"wf",'
        f'"requests":{{"tokens":"20"}},"placement":{{"affinity":{affinity}}}}}}}'
    )


def store_deep_claim(cluster: ClusterHandle, namespace: str, name: str) -> None:
    """Store it as a claim written before the schema bounded placement would be: the claim
    CRD's placement is made free-form for the moment of the create, then put back."""
    permissive = [
        {
            "op": "replace",
            "path": "/spec/versions/0/schema/openAPIV3Schema/properties/spec/properties/placement",
            "value": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        }
    ]
    cluster.kubectl("patch", "crd", CLAIMS_CRD, "--type=json", "-p", json.dumps(permissive))
    try:
        eventually(
            "the permissive claim schema to be served",
            lambda: _try_create(cluster, deep_claim(namespace, name)),
        )
    finally:
        cluster.kubectl("apply", "-f", str(REPO / "crds" / "reservoir.dev_branchclaims.yaml"))


def _try_create(cluster: ClusterHandle, manifest: str) -> bool:
    try:
        cluster.kubectl("create", "-f", "-", input=manifest)
    except RuntimeError as error:  # not served yet: try again; there already: done
        return "AlreadyExists" in str(error)
    return True


def settle_one(sdk: Reservoir, name: str, committed: str) -> None:
    claim = sdk.hold("wf", name, {"tokens": "20"}, name=name)
    claim = sdk.dispatch(wait_phase(sdk, claim, "Tentative"))
    sdk.finish(wait_phase(sdk, claim, "Committed"), {"tokens": "5"})
    settled_ledger(sdk, "wf", committed=committed, reserved="0")


def test_a_claim_nested_2000_deep_is_set_aside_and_other_tenants_settle(
    cluster: ClusterHandle, namespaces: tuple[str, str]
) -> None:
    hostile, tenant = namespaces
    for namespace in namespaces:
        create_envelope(cluster, namespace, "wf", {"tokens": "100"}, defaultLeaseSeconds=300)
    store_deep_claim(cluster, hostile, "deep")

    operator, port = cluster_wide_operator(cluster, "deep-claim")
    try:
        with Reservoir(namespace=tenant, kubeconfig=str(cluster.kubeconfig_path)) as sdk:
            settle_one(sdk, "b1", committed="5")
            # Set aside, and said so: a condition on the claim, an Event, a log line.
            eventually(
                "the Undecodable condition on the deep claim",
                lambda: (
                    cluster.kubectl(
                        "get",
                        "branchclaim",
                        "deep",
                        "-n",
                        hostile,
                        "-o",
                        'jsonpath={.status.conditions[?(@.type=="Undecodable")].status}',
                    )
                    == "True"
                ),
            )
            events = cluster.kubectl(
                "get",
                "events",
                "-n",
                hostile,
                "--field-selector",
                "involvedObject.name=deep,reason=Undecodable",
                "-o",
                "jsonpath={.items[*].message}",
            )
            assert "cannot decode this BranchClaim" in events
            assert f"set aside BranchClaim {hostile}/deep" in operator.log.read_text()
            assert readyz(port)[0] == 200

            # A restart reads the same object again, and goes on serving the others.
            operator.stop()
            operator, port = cluster_wide_operator(cluster, "deep-claim-restarted")
            settle_one(sdk, "b2", committed="10")
            assert readyz(port)[0] == 200
            assert f"set aside BranchClaim {hostile}/deep" in operator.log.read_text()
            # The claims' initial state was streamed (reservoir.watch_list), the set-aside
            # claim's stand-in bookmark did not end it early, and nothing was listed.
            claims = "branchclaims.reservoir.dev"
            streamed = metric(port, INITIAL_STATES, resource=claims, how="streamed")
            listed = metric(port, INITIAL_STATES, resource=claims, how="listed")
            assert (streamed, listed) == (1, 0)
    finally:
        operator.stop()
    # The deep claim was never admitted: its envelope holds nothing.
    with Reservoir(namespace=hostile, kubeconfig=str(cluster.kubeconfig_path)) as sdk:
        assert sdk.ledger("wf").status.totals.reserved.get("tokens", 0) == 0


NOT_BATCH = [
    "",
    "reservoir.dev",
    "coordination.k8s.io",
    "resource.k8s.io",
    "kopf.dev",
    "events.k8s.io",
    "apiextensions.k8s.io",
    "scheduling.k8s.io",
]


def test_a_watch_that_dies_is_restarted_and_readyz_says_so_meanwhile(
    cluster: ClusterHandle, namespaces: tuple[str, str], tmp_path: Path
) -> None:
    """kopf gives up a watch whose list is refused (after about a minute of retries) and
    never starts it again; the operator stayed "ready" with it dead."""
    _, home = namespaces
    name = f"watch-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "serviceaccount", name, "-n", home)
    rules = [{"apiGroups": NOT_BATCH, "resources": ["*"], "verbs": ["*"]}]
    batch = [{"apiGroups": ["batch"], "resources": ["*"], "verbs": ["*"]}]
    made: list[str] = []

    def grant(role: str, granted: list[dict[str, list[str]]]) -> None:
        body = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": role},
            "rules": granted,
        }
        binding = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": role},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": role,
            },
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": home}],
        }
        for obj in (body, binding):
            cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))
        made.append(role)

    grant(f"{name}-all-but-jobs", rules)
    kubeconfig = token_kubeconfig(cluster, name, home, tmp_path / "kubeconfig")
    operator, port = cluster_wide_operator(cluster, "dead-watch", kubeconfig=kubeconfig)
    try:
        text = eventually(
            "/readyz to report the dead watch of jobs",
            lambda: (r := readyz(port))[0] == 503 and "jobs.batch" in r[1] and r[1],
            timeout=150,
            every=1,
        )
        assert "the watch of jobs.batch cluster-wide failed" in str(text)
        assert operator.process.poll() is None  # still running: the watch is restarted

        grant(f"{name}-jobs", batch)
        eventually("/readyz to recover", lambda: readyz(port)[0] == 200, timeout=150, every=1)
        assert operator.process.poll() is None
    finally:
        operator.stop()
        for role in made:
            cluster.kubectl("delete", "clusterrolebinding,clusterrole", role, "--ignore-not-found")


def pods_received(port: int) -> float:
    return metric(port, "reservoir_watch_events_total", resource="pods.core")


def test_unlabelled_pods_of_other_tenants_never_reach_the_operator(
    cluster: ClusterHandle, namespaces: tuple[str, str]
) -> None:
    other, tenant = namespaces
    operator, port = cluster_wide_operator(cluster, "selectors")
    try:
        eventually("the operator to be ready", lambda: readyz(port)[0] == 200)
        before = pods_received(port)

        def pod(namespace: str, name: str, labels: dict[str, str]) -> str:
            return json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": name, "namespace": namespace, "labels": labels},
                    "spec": {
                        "schedulingGates": [{"name": "test.reservoir.dev/hold"}],
                        "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}],
                    },
                }
            )

        unlabelled = 20
        for n in range(unlabelled):
            cluster.kubectl("create", "-f", "-", input=pod(other, f"other-{n}", {"app": "x"}))
        cluster.kubectl(
            "create", "-f", "-", input=pod(tenant, "workload", {"reservoir.dev/claim": "c1"})
        )
        eventually("the labelled pod to reach the operator", lambda: pods_received(port) > before)
        # Whatever is still on its way (the scheduler's gated condition) arrives meanwhile.
        eventually("no more pod events", lambda: _steady(port), timeout=20)
        received = pods_received(port) - before
        # The labelled pod's own events (created, the scheduler's condition): a few. The
        # twenty unlabelled pods would add twenty at least.
        assert 1 <= received < 5, received
    finally:
        operator.stop()


def _steady(port: int) -> bool:
    first = pods_received(port)
    time.sleep(2)
    return pods_received(port) == first
