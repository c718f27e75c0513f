"""The chart's RBAC is sufficient and tight: the operator runs the seed scenarios with only
its ServiceAccount's token (TokenRequest) and is refused everything else; the worker,
viewer and aggregated edit/view roles can do what they are for, and no more."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from reservoir.sdk import Reservoir
from tests.clusters import ClusterHandle
from tests.integration.chart import (
    BIN,
    allowed,
    forbidden,
    kubectl_as,
    release,
    token_kubeconfig,
)
from tests.integration.conftest import REPO, OperatorProcess, StartOperator
from tests.integration.helpers import create_envelope, eventually, wait_phase
from tests.integration.test_seed_scenarios import dynamic_branches, worked_example

LOGS = REPO / ".cluster" / "test-logs"


@pytest.fixture(scope="module")
def chart(cluster: ClusterHandle, crds: None) -> Iterator[tuple[str, str]]:
    """One cluster-wide release with the user roles (no operator pods: the tests run the
    operator themselves, with the release's ServiceAccount token)."""
    # The local cluster has its own placeholder PriorityClass (same name): not the release's.
    # Its admission policies would refuse the namespaced release's operator (another
    # ServiceAccount) its status writes: test_admission_policies.py tests them.
    values = {
        "replicaCount": 0,
        "placeholderPriorityClass.create": False,
        "admissionPolicy.enabled": False,
    }
    with release(cluster, values, "--skip-crds") as installed:
        yield installed


def claim_manifest(ns: str, name: str, envelope: str = "wf") -> str:
    return json.dumps(
        {
            "apiVersion": "reservoir.dev/v1alpha1",
            "kind": "BranchClaim",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"envelope": envelope, "branch": name, "requests": {"tokens": "1"}},
        }
    )


def envelope_manifest(ns: str, name: str) -> str:
    return json.dumps(
        {
            "apiVersion": "reservoir.dev/v1alpha1",
            "kind": "ReservationEnvelope",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"capacity": {"tokens": "10"}},
        }
    )


def service_account(
    cluster: ClusterHandle, ns: str, name: str, cluster_role: str, path: Path
) -> Path:
    """A ServiceAccount bound in `ns` to `cluster_role`, and a kubeconfig with its token."""
    cluster.kubectl("create", "serviceaccount", name, "-n", ns)
    cluster.kubectl(
        "create",
        "rolebinding",
        name,
        "-n",
        ns,
        f"--clusterrole={cluster_role}",
        f"--serviceaccount={ns}:{name}",
    )
    return token_kubeconfig(cluster, name, ns, path)


def run_operator(
    cluster: ClusterHandle, namespace: str | None, peering: str, kubeconfig: Path, name: str
) -> OperatorProcess:
    LOGS.mkdir(parents=True, exist_ok=True)
    log = LOGS / f"rbac-{name}.log"
    log.unlink(missing_ok=True)
    return OperatorProcess(cluster, namespace, log, "--peering", peering, kubeconfig=kubeconfig)


def assert_never_refused(operator: OperatorProcess) -> None:
    """Not one request of the operator was refused by authorization, not even one kopf
    retried. (A cluster-wide operator also sees other tests' namespaces being deleted: an
    Event refused there because the namespace is terminating is not an RBAC refusal.)"""
    text = operator.log.read_text()
    refused = [
        line
        for line in text.splitlines()
        if ("Forbidden" in line or " 403" in line) and "NamespaceTerminating" not in line
    ]
    assert not refused, f"the operator was refused ({operator.log}):\n" + "\n".join(refused[:5])


def test_the_operator_runs_the_worked_example_with_only_its_token(
    cluster: ClusterHandle, ns: str, chart: tuple[str, str], tmp_path: Path
) -> None:
    """Cluster-wide (the chart's default): the ClusterRole, ClusterKopfPeering."""
    name, namespace = chart
    kubeconfig = token_kubeconfig(cluster, f"{name}-reservoir", namespace, tmp_path / "kc")
    operator = run_operator(cluster, None, f"{name}-reservoir", kubeconfig, "cluster-wide")
    try:
        with Reservoir(namespace=ns, kubeconfig=str(cluster.kubeconfig_path)) as sdk:
            worked_example(cluster, ns, sdk)
    finally:
        operator.stop()
    assert_never_refused(operator)
    assert "peering" in operator.log.read_text().lower()


def test_a_namespaced_release_runs_the_dynamic_branches_with_only_its_token(
    cluster: ClusterHandle, ns: str, tmp_path: Path
) -> None:
    """watchNamespaces: a Role per namespace, a KopfPeering there, and only the
    cluster-scoped reads kopf needs at start-up in a ClusterRole."""
    values = {
        "replicaCount": 0,
        "watchNamespaces": [ns],
        "rbac.userRoles": False,
        "placeholderPriorityClass.create": False,
    }
    with release(cluster, values, "--skip-crds") as (name, namespace):
        kubeconfig = token_kubeconfig(cluster, f"{name}-reservoir", namespace, tmp_path / "kc")
        operator = run_operator(cluster, ns, f"{name}-reservoir", kubeconfig, "namespaced")
        try:
            with Reservoir(namespace=ns, kubeconfig=str(cluster.kubeconfig_path)) as sdk:
                dynamic_branches(cluster, ns, sdk)
                # The paths the scenario leaves out: a pod commit point (the writer lists
                # pods) and a settled claim's TTL (the operator deletes it).
                create_envelope(cluster, ns, "ttl", {"tokens": "10"}, settledClaimTTLSeconds=1)
                claim = sdk.hold("ttl", "pod", {"tokens": "1"}, commit_point="PodScheduled")
                sdk.cancel(wait_phase(sdk, claim, "Tentative"))
                eventually(
                    "the settled claim's deletion",
                    lambda: (
                        not cluster.kubectl(
                            "get",
                            "bclaim",
                            claim.name,
                            "-n",
                            ns,
                            "--ignore-not-found",
                            "-o",
                            "name",
                        )
                    ),
                )
        finally:
            operator.stop()
        assert_never_refused(operator)
        # Nothing outside its namespaces.
        allowed(kubeconfig, "get", "bclaim", "-n", ns)
        forbidden(kubeconfig, "get", "bclaim", "-n", "default")
        forbidden(kubeconfig, "get", "bclaim", "-A")
        forbidden(kubeconfig, "get", "pods", "-n", namespace)
        forbidden(kubeconfig, "get", "clusterkopfpeerings")
        # Upstream Jobs in its namespaces; no Secret until a namespace grants it (issue 21).
        assert can(kubeconfig, "patch", "jobs.batch", ns)
        assert not can(kubeconfig, "get", "secrets/provider-token", ns)
        assert not can(kubeconfig, "list", "secrets", ns)
        assert not can(kubeconfig, "get", "secrets/provider-token", namespace)
        forbidden(kubeconfig, "get", "jobs", "-n", namespace)


def test_the_operators_token_is_refused_everything_else(
    cluster: ClusterHandle, ns: str, chart: tuple[str, str], tmp_path: Path
) -> None:
    name, namespace = chart
    kubeconfig = token_kubeconfig(cluster, f"{name}-reservoir", namespace, tmp_path / "kc")
    create_envelope(cluster, ns, "wf", {"tokens": "10"})
    allowed(kubeconfig, "get", "renv,bclaim", "-A")  # the token works
    allowed(kubeconfig, "get", "leases,pods,jobs", "-n", ns)
    forbidden(kubeconfig, "get", "secrets", "-n", ns)  # list
    forbidden(kubeconfig, "get", "secret", "anything", "-n", ns)  # get
    forbidden(kubeconfig, "get", "secrets", "-A")
    assert not can(kubeconfig, "get", "secrets/provider-token", ns)  # none named: none at all
    forbidden(kubeconfig, "create", "job", "x", "--image=busybox", "-n", ns)
    forbidden(kubeconfig, "get", "configmaps", "-n", ns)
    forbidden(kubeconfig, "create", "configmap", "x", "-n", ns, "--from-literal=a=b")
    forbidden(kubeconfig, "delete", "namespace", ns)
    forbidden(
        kubeconfig,
        "patch",
        "deployment",
        f"{name}-reservoir",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"spec":{"replicas":5}}',
    )
    # Pods and ResourceClaims it may create and delete (GPU placeholders), and pods it may
    # read (upstream refs), nothing more. (`kubectl logs/exec` would get the pod first.)
    for verb, subresource in (("get", "log"), ("create", "exec")):
        asked = ("auth", "can-i", verb, "pods", f"--subresource={subresource}", "-n", ns)
        assert kubectl_as(kubeconfig, *asked).stdout.strip() == "no", subresource
    forbidden(kubeconfig, "patch", "resourceclaim", "x", "-n", ns, "-p", '{"metadata":{}}')
    forbidden(kubeconfig, "get", "deviceclasses")
    forbidden(kubeconfig, "create", "-f", "-", input=envelope_manifest(ns, "mine"))
    forbidden(kubeconfig, "delete", "renv", "wf", "-n", ns)
    forbidden(kubeconfig, "create", "-f", "-", input=claim_manifest(ns, "c"))
    forbidden(
        kubeconfig,
        "create",
        "-f",
        "-",
        input=json.dumps(
            {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": "x", "namespace": ns},
            }
        ),
    )
    forbidden(kubeconfig, "create", "clusterrole", "x", "--verb=get", "--resource=pods")
    forbidden(kubeconfig, "get", "clusterroles")
    forbidden(kubeconfig, "create", "token", f"{name}-reservoir", "-n", namespace)
    forbidden(kubeconfig, "get", "kopfpeerings", "-n", ns)  # cluster-wide: the cluster's only


def plugin_as(kubeconfig: Path, ns: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "PATH": f"{REPO / '.venv' / 'bin'}:{BIN}:{os.environ.get('PATH', '')}",
    }
    return subprocess.run(
        ["kubectl", "reservoir", "-n", ns, "--holder", "plugin-worker", *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def test_a_worker_holds_renews_and_reports_through_the_sdk_and_plugin_and_no_more(
    cluster: ClusterHandle,
    ns: str,
    chart: tuple[str, str],
    start_operator: StartOperator,
    tmp_path: Path,
) -> None:
    start_operator()
    worker = service_account(cluster, ns, "worker", "reservoir-worker", tmp_path / "worker")
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=60)

    with Reservoir(namespace=ns, kubeconfig=str(worker), holder="sdk-worker") as sdk:
        claim = wait_phase(sdk, sdk.hold("wf", "a", {"tokens": "10"}, name="a"), "Tentative")
        claim = sdk.renew(claim)  # creates the claim's Lease
        claim = sdk.renew(claim)  # replaces it
        assert claim.renewals == 2
        claim = sdk.dispatch(claim)
        claim = sdk.report_usage(wait_phase(sdk, claim, "Committed"), {"tokens": "3"})
        sdk.finish(claim, {"tokens": "4"})
        assert wait_phase(sdk, "a", "Consumed").phase == "Consumed"
        assert sdk.ledger("wf").status.totals.committed["tokens"] == 4

    for args in (("hold", "wf", "b", "tokens=5", "--name", "b"), ("renew", "b"), ("ledger", "wf")):
        result = plugin_as(worker, ns, *args)
        assert result.returncode == 0, f"kubectl reservoir {' '.join(args)}: {result.stderr}"
        if args[0] == "hold":
            with Reservoir(namespace=ns, kubeconfig=str(worker)) as sdk:
                wait_phase(sdk, "b", "Tentative")

    status = '{"status":{"phase":"Released"}}'
    forbidden(
        worker,
        "patch",
        "bclaim",
        "a",
        "-n",
        ns,
        "--subresource=status",
        "--type=merge",
        "-p",
        status,
    )
    forbidden(
        worker,
        "patch",
        "renv",
        "wf",
        "-n",
        ns,
        "--subresource=status",
        "--type=merge",
        "-p",
        status,
    )
    forbidden(worker, "create", "-f", "-", input=envelope_manifest(ns, "mine"))
    forbidden(worker, "patch", "renv", "wf", "-n", ns, "--type=merge", "-p", '{"spec":{}}')
    forbidden(worker, "delete", "renv", "wf", "-n", ns)
    forbidden(worker, "get", "secrets", "-n", ns)
    forbidden(worker, "get", "secret", "anything", "-n", ns)
    forbidden(worker, "create", "configmap", "x", "-n", ns, "--from-literal=a=b")
    forbidden(worker, "get", "bclaim", "-n", "default")  # bound in its namespace only
    # A worker deletes its claims: the finalizer holds the claim until it is settled.
    allowed(worker, "delete", "bclaim", "b", "-n", ns, "--wait=false")
    eventually(
        "the deleted claim to go",
        lambda: not allowed(worker, "get", "bclaim", "b", "-n", ns, "--ignore-not-found"),
    )


def test_a_viewer_reads_and_cannot_write(
    cluster: ClusterHandle, ns: str, chart: tuple[str, str], tmp_path: Path
) -> None:
    viewer = service_account(cluster, ns, "viewer", "reservoir-viewer", tmp_path / "viewer")
    create_envelope(cluster, ns, "wf", {"tokens": "10"})
    cluster.kubectl("create", "-f", "-", input=claim_manifest(ns, "c"))
    assert "c" in allowed(viewer, "get", "bclaim", "-n", ns, "-o", "name")
    allowed(viewer, "get", "renv", "wf", "-n", ns)
    forbidden(viewer, "create", "-f", "-", input=claim_manifest(ns, "d"))
    forbidden(viewer, "patch", "bclaim", "c", "-n", ns, "--type=merge", "-p", '{"spec":{}}')
    forbidden(viewer, "delete", "bclaim", "c", "-n", ns)
    forbidden(viewer, "get", "leases", "-n", ns)
    forbidden(viewer, "get", "secrets", "-n", ns)


def can(kubeconfig: Path, verb: str, resource: str, ns: str) -> bool:
    result = kubectl_as(kubeconfig, "auth", "can-i", verb, resource, "-n", ns)
    return result.stdout.strip() == "yes"


def test_the_roles_are_aggregated_into_edit_and_view(
    cluster: ClusterHandle, ns: str, chart: tuple[str, str], tmp_path: Path
) -> None:
    editor = service_account(cluster, ns, "editor", "edit", tmp_path / "editor")
    looker = service_account(cluster, ns, "looker", "view", tmp_path / "looker")
    claims = "branchclaims.reservoir.dev"
    eventually("edit to aggregate reservoir-worker", lambda: can(editor, "create", claims, ns))
    eventually("view to aggregate reservoir-viewer", lambda: can(looker, "list", claims, ns))

    allowed(editor, "create", "-f", "-", input=envelope_manifest(ns, "wf"))
    allowed(editor, "create", "-f", "-", input=claim_manifest(ns, "c"))
    allowed(
        editor, "patch", "bclaim", "c", "-n", ns, "--type=merge", "-p", '{"spec":{"cancel":true}}'
    )
    assert "c" in allowed(looker, "get", "bclaim", "-n", ns, "-o", "name")
    allowed(looker, "get", "renv", "wf", "-n", ns)
    forbidden(looker, "create", "-f", "-", input=claim_manifest(ns, "d"))
    forbidden(looker, "create", "-f", "-", input=envelope_manifest(ns, "mine"))
    forbidden(looker, "delete", "bclaim", "c", "-n", ns)
    assert can(editor, "delete", claims, ns) and not can(looker, "delete", claims, ns)
    allowed(editor, "delete", "bclaim", "c", "-n", ns, "--wait=false")


def cluster_service_account(
    cluster: ClusterHandle, ns: str, name: str, cluster_role: str, path: Path
) -> Path:
    """A ServiceAccount bound cluster-wide to `cluster_role` (pools are cluster-scoped)."""
    cluster.kubectl("create", "serviceaccount", name, "-n", ns)
    binding = f"{ns}-{name}"
    cluster.kubectl(
        "create",
        "clusterrolebinding",
        binding,
        f"--clusterrole={cluster_role}",
        f"--serviceaccount={ns}:{name}",
    )
    return token_kubeconfig(cluster, name, ns, path)


def pool_manifest(name: str, ns: str) -> str:
    return json.dumps(
        {
            "apiVersion": "reservoir.dev/v1alpha1",
            "kind": "ReservationPool",
            "metadata": {"name": name},
            "spec": {"capacity": {"tokens": "10"}, "namespaces": [ns]},
        }
    )


def test_a_pool_admin_runs_pools_a_pool_viewer_reads_them_and_tenants_do_neither(
    cluster: ClusterHandle, ns: str, chart: tuple[str, str], tmp_path: Path
) -> None:
    admin = cluster_service_account(cluster, ns, "padmin", "reservoir-pool-admin", tmp_path / "a")
    viewer = cluster_service_account(
        cluster, ns, "pviewer", "reservoir-pool-viewer", tmp_path / "v"
    )
    editor = service_account(cluster, ns, "peditor", "edit", tmp_path / "e")
    pool = f"rbac-{ns}"
    try:
        allowed(admin, "create", "-f", "-", input=pool_manifest(pool, ns))
        # Closing a pool freezes a tenant's budget: the admin's, not the tenants'.
        allowed(admin, "patch", "rpool", pool, "--type=merge", "-p", '{"spec":{"state":"Closed"}}')
        forbidden(
            admin, "patch", "rpool", pool, "--subresource=status", "--type=merge",
            "-p", '{"status":{"stamp":7}}',
        )  # fmt: skip
        allowed(viewer, "get", "rpool", pool)
        forbidden(viewer, "patch", "rpool", pool, "--type=merge", "-p", '{"spec":{"state":"Open"}}')
        forbidden(viewer, "delete", "rpool", pool)
        forbidden(editor, "get", "rpool", pool)
        forbidden(editor, "create", "-f", "-", input=pool_manifest(f"{pool}-x", ns))
        allowed(admin, "delete", "rpool", pool, "--wait=false")
    finally:
        cluster.kubectl("delete", "rpool", pool, "--wait=false", "--ignore-not-found")
        for name in ("padmin", "pviewer"):
            cluster.kubectl("delete", "clusterrolebinding", f"{ns}-{name}", "--ignore-not-found")
