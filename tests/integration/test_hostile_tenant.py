"""Issue 21, "Done when": one tenant plays every hostile step at once while another tenant's
claims are admitted and settle, before and after a kill -9 of the operator.

The platform is installed as an administrator would: the chart's RBAC, its admission
policies and a provider allow-list that names no loopback; the operator runs cluster-wide
with nothing but the release's ServiceAccount token. Tenant A has full rights over pods,
Secrets, Jobs, ResourceClaims and Reservoir's kinds (status included) in its namespace and
uses them: a claim nested 2,000 levels deep, a megabyte claim, loopback and link-local
provider URLs, a pod with the placeholder PriorityClass, a pod mounting another claim's
devices, a forged status. Each is refused at the API server with a clear message, or (a
deep claim stored before the schema bounded it) set aside with a condition; a loopback
listener receives nothing; tenant B settles as if A were not there."""

from __future__ import annotations

import http.server
import json
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from reservoir.sdk import Reservoir
from tests.clusters import ClusterHandle
from tests.integration.chart import kubectl_as, release
from tests.integration.conftest import OperatorProcess
from tests.integration.helpers import create_envelope, eventually, wait_phase
from tests.integration.test_admission_policies import (
    LOGS,
    Installed,
    denied,
    manifest,
    operator_kubeconfig,
    pause_pod,
    tenant,
    until_enforced,
)
from tests.integration.test_hostile_objects import deep_claim, settle_one, store_deep_claim

PROVIDER_HOST = "inference.example"


@pytest.fixture(scope="module")
def platform(cluster: ClusterHandle, crds: None) -> Iterator[Installed]:
    """The chart cluster-wide, with its policies and an allow-list naming one provider
    host; no operator pods (the test runs the operator with the release's token)."""
    values = {
        "replicaCount": 0,
        "placeholderPriorityClass.create": False,  # the local cluster has one of that name
        "rbac.userRoles": False,
        "providers.allowedHosts": [PROVIDER_HOST],
    }
    with release(cluster, values, "--skip-crds") as (name, namespace):
        yield Installed(name, namespace, f"system:serviceaccount:{namespace}:{name}-reservoir")


@pytest.fixture
def tenants(cluster: ClusterHandle, crds: None) -> Iterator[tuple[str, str]]:
    names = (f"tenant-a-{uuid.uuid4().hex[:6]}", f"tenant-b-{uuid.uuid4().hex[:6]}")
    for name in names:
        cluster.kubectl("create", "namespace", name)
    yield names
    for name in names:
        cluster.kubectl("delete", "namespace", name, "--wait=false")


@contextmanager
def loopback_listener() -> Iterator[tuple[int, list[str]]]:
    """An HTTP server on 127.0.0.1 that records every request it receives."""
    hits: list[str] = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def _record(self) -> None:
            hits.append(f"{self.command} {self.path}")
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"state": "Succeeded", "usage": {}}')

        do_GET = do_POST = _record  # noqa: N815

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1]), hits
    finally:
        server.shutdown()
        server.server_close()


def claim_text(ns: str, name: str, **spec: object) -> str:
    body = {
        "apiVersion": "reservoir.dev/v1alpha1",
        "kind": "BranchClaim",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"envelope": "wf", "requests": {"tokens": "10"}, **spec},
    }
    return json.dumps(body)


def envelope_text(ns: str, name: str, status_url: str) -> str:
    body = {
        "apiVersion": "reservoir.dev/v1alpha1",
        "kind": "ReservationEnvelope",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "capacity": {"tokens": "20"},
            "policy": {"provider": {"statusURL": status_url, "cancelURL": status_url}},
        },
    }
    return json.dumps(body)


def refused(kubeconfig: Path, message: str, *args: str, input: str | None = None) -> None:
    """Refused by the API server (schema, CEL or policy), with `message` in the answer."""
    result = kubectl_as(kubeconfig, *args, input=input)
    assert result.returncode != 0, f"kubectl {' '.join(args)} was allowed"
    assert message in result.stderr, result.stderr


def play_hostile_tenant(me: Path, ns: str, prefix: str, loopback_port: int) -> None:
    # A claim nested 2,000 levels deep: the schema has no field to nest into.
    refused(me, "unknown field", "create", "-f", "-", input=deep_claim(ns, "deep-2"))
    # A megabyte claim: every map, list and string is bounded.
    labels = {f"example.com/k{i}": "v" * 63 for i in range(12_000)}
    big = claim_text(ns, "big", placement={"nodeSelector": labels})
    assert len(big) > 1_000_000
    refused(me, "must have at most 16 items", "create", "-f", "-", input=big)
    # ... and through its metadata, which no CRD schema bounds: a policy counts it.
    labelled = json.loads(claim_text(ns, "labelled"))
    labelled["metadata"]["labels"] = {f"k{i}": "v" * 63 for i in range(14_000)}
    assert len(json.dumps(labelled)) > 1_000_000
    refused(me, "metadata is bounded", "create", "-f", "-", input=json.dumps(labelled))
    # Provider URLs to loopback and to the metadata address: refused at apply.
    never = "is a loopback, link-local or metadata address: the operator never calls it"
    for n, url in enumerate(
        [
            f"http://127.0.0.1:{loopback_port}/ops/{{operationId}}",
            "http://169.254.169.254/latest/meta-data/{operationId}",
        ]
    ):
        envelope = envelope_text(ns, f"ssrf-{n}", url)
        refused(me, never, "create", "-f", "-", input=envelope)
    # The placeholder PriorityClass: jumping the queue and escaping preemption.
    jump = manifest("Pod", "jump", ns, pause_pod(priorityClassName="reservoir-placeholder"))
    denied(
        me,
        f"{prefix}-placeholder-priority",
        "for Reservoir's placeholder pods only",
        "create",
        "-f",
        "-",
        input=jump,
    )
    # Another claim's devices (Reservoir's ResourceClaims are named after the claim's UID).
    mount = {"resourceClaims": [{"name": "d", "resourceClaimName": f"reservoir-{uuid.uuid4()}"}]}
    denied(
        me,
        f"{prefix}-claim-devices",
        "must be its claim's workload pod",
        "create",
        "-f",
        "-",
        input=manifest("Pod", "steal", ns, pause_pod(**mount)),
    )
    # A forged ledger: the tenant holds /status rights, the policy keeps status the
    # operator's (a claim "Released" would return capacity; an envelope "Closed" too).
    for kind, name, phase in (("bclaim", "mine", "Released"), ("renv", "wf", "Closed")):
        denied(
            me,
            f"{prefix}-status",
            "only its ServiceAccount",
            "patch",
            kind,
            name,
            "-n",
            ns,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps({"status": {"phase": phase}}),
        )


def start_operator(
    cluster: ClusterHandle, platform: Installed, op: Path, log: str
) -> OperatorProcess:
    """Cluster-wide with the release's token and the chart's allow-list. Standalone (no
    peering): a kill -9'd peer stays in kopf's peering until its entry expires, which is
    kopf's business and not this test's (test_admission_policies runs it peered)."""
    LOGS.mkdir(parents=True, exist_ok=True)
    path = LOGS / f"{log}-{uuid.uuid4().hex[:4]}.log"
    return OperatorProcess(cluster, None, path, "--provider-allow", PROVIDER_HOST, kubeconfig=op)


def set_aside(cluster: ClusterHandle, ns: str, name: str) -> bool:
    condition = cluster.kubectl(
        "get",
        "branchclaim",
        name,
        "-n",
        ns,
        "-o",
        'jsonpath={.status.conditions[?(@.type=="Undecodable")].status}',
    )
    return condition == "True"


def test_a_hostile_tenant_is_refused_while_another_tenants_claims_settle(
    cluster: ClusterHandle, platform: Installed, tenants: tuple[str, str], tmp_path: Path
) -> None:
    a, b = tenants
    prefix = f"{platform.release}-reservoir"
    me = tenant(cluster, a, tmp_path / "tenant-a")
    op = operator_kubeconfig(cluster, platform, tmp_path / "operator")
    for ns in tenants:
        create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=300)
    # The tenant's own claim (its forged status is refused below).
    kubectl_as(me, "create", "-f", "-", input=claim_text(a, "mine"))
    # A deep claim stored before the schema bounded placement (an upgrade's leftover).
    store_deep_claim(cluster, a, "deep")
    jump = manifest("Pod", "probe", a, pause_pod(priorityClassName="reservoir-placeholder"))
    until_enforced(me, f"{prefix}-placeholder-priority", "create", "-f", "-", input=jump)

    with loopback_listener() as (port, hits):
        operator = start_operator(cluster, platform, op, "hostile-tenant")
        try:
            with Reservoir(namespace=b, kubeconfig=str(cluster.kubeconfig_path)) as sdk:
                settle_one(sdk, "b1", committed="5")
                play_hostile_tenant(me, a, prefix, port)
                eventually("the deep claim set aside", lambda: set_aside(cluster, a, "deep"))

                operator.kill()  # kill -9: no clean-up, no last writes
                operator = start_operator(cluster, platform, op, "hostile-tenant-restarted")
                settle_one(sdk, "b2", committed="10")
                play_hostile_tenant(me, a, prefix, port)
                eventually(
                    "the deep claim set aside again after the restart",
                    lambda: "set aside BranchClaim" in operator.log.read_text(),
                )
                assert set_aside(cluster, a, "deep")
            with Reservoir(namespace=a, kubeconfig=str(cluster.kubeconfig_path)) as mine:
                # The tenant's legitimate claim was served all along; its forgery moved nothing.
                wait_phase(mine, "mine", "Tentative")
                totals = mine.ledger("wf").status.totals
                assert totals.reserved.get("tokens") == 10, totals
        finally:
            operator.stop()
        assert hits == [], f"the loopback listener was called: {hits}"
    text = operator.log.read_text()
    forbidden = [line for line in text.splitlines() if "denied request" in line]
    assert not forbidden, "the operator was refused:\n" + "\n".join(forbidden[:5])
