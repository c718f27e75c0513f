"""The chart's admission policies (issue 21 §2), on the real control plane: what RBAC cannot
narrow is narrowed for the operator's ServiceAccount (placeholder pods of its own shape,
only its gate lifted, only labelled Jobs deleted, nothing in protected namespaces), and what
is the operator's is kept from a tenant with full rights in its namespace (the placeholder
PriorityClass, Reservoir's ResourceClaims and the hand-off gate, placement hints beyond the
allow-list, the status of reservoir.dev kinds). Each hostile step is refused with a clear
message; the operator, running with only its token under the same policies, holds a GPU
claim, hands it off and settles it."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from reservoir.sdk import Reservoir, workload_pod
from tests.clusters import ClusterHandle
from tests.integration.chart import allowed, kubectl_as, release, token_kubeconfig
from tests.integration.conftest import REPO, OperatorProcess
from tests.integration.helpers import create_envelope, eventually, ledger_line, wait_phase

GPU = "nvidia.com/gpu"
GATE = "reservoir.dev/hand-off"
PAUSE = "registry.k8s.io/pause:3.10"
LOGS = REPO / ".cluster" / "test-logs"


@dataclass
class Installed:
    release: str
    namespace: str
    operator_user: str


@pytest.fixture(scope="module")
def chart(cluster: ClusterHandle, crds: None) -> Iterator[Installed]:
    """A cluster-wide release with its policies and no operator pods (the tests run the
    operator with the release's ServiceAccount token). The local cluster has its own
    placeholder PriorityClass of the same name; the user roles are test_rbac's."""
    values = {"replicaCount": 0, "placeholderPriorityClass.create": False, "rbac.userRoles": False}
    with release(cluster, values, "--skip-crds") as (name, namespace):
        yield Installed(name, namespace, f"system:serviceaccount:{namespace}:{name}-reservoir")


def operator_kubeconfig(cluster: ClusterHandle, chart: Installed, path: Path) -> Path:
    return token_kubeconfig(cluster, f"{chart.release}-reservoir", chart.namespace, path)


def tenant(cluster: ClusterHandle, ns: str, path: Path) -> Path:
    """A ServiceAccount with full rights over pods, Jobs, ResourceClaims and Reservoir's
    kinds in its namespace, status subresources included: only the policies stop it."""
    verbs = ["get", "list", "watch", "create", "update", "patch", "delete"]
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "tenant", "namespace": ns},
        "rules": [
            {"apiGroups": [""], "resources": ["pods", "secrets"], "verbs": verbs},
            {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": verbs},
            {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": verbs},
            {
                "apiGroups": ["reservoir.dev"],
                "resources": [
                    "branchclaims",
                    "branchclaims/status",
                    "reservationenvelopes",
                    "reservationenvelopes/status",
                ],
                "verbs": verbs,
            },
        ],
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(role))
    cluster.kubectl("create", "serviceaccount", "tenant", "-n", ns)
    cluster.kubectl(
        "create",
        "rolebinding",
        "tenant",
        "-n",
        ns,
        "--role=tenant",
        f"--serviceaccount={ns}:tenant",
    )
    return token_kubeconfig(cluster, "tenant", ns, path)


def denied(
    kubeconfig: Path, policy: str, message: str, *args: str, input: str | None = None
) -> None:
    """Refused by the admission policy `policy` (not by RBAC), with `message` in the answer."""
    result = kubectl_as(kubeconfig, *args, input=input)
    assert result.returncode != 0, f"kubectl {' '.join(args)} was allowed"
    assert f"ValidatingAdmissionPolicy '{policy}'" in result.stderr, result.stderr
    assert message in result.stderr, result.stderr


def until_enforced(kubeconfig: Path, policy: str, *args: str, input: str | None = None) -> None:
    """The API server loads new policies asynchronously: wait for the first refusal."""

    def refused() -> bool:  # a server-side dry run: admitted, nothing is created
        result = kubectl_as(kubeconfig, *args, "--dry-run=server", input=input)
        return result.returncode != 0 and f"ValidatingAdmissionPolicy '{policy}'" in result.stderr

    eventually(f"policy {policy} enforced", refused, timeout=60, every=1)


def manifest(kind: str, name: str, ns: str, spec: dict[str, Any], **meta: Any) -> str:
    api = {"Pod": "v1", "Job": "batch/v1", "ResourceClaim": "resource.k8s.io/v1"}[kind]
    body = {
        "apiVersion": api,
        "kind": kind,
        "metadata": {"name": name, "namespace": ns, **meta},
        "spec": spec,
    }
    return json.dumps(body)


def pause_pod(**spec: Any) -> dict[str, Any]:
    return {"containers": [{"name": "c", "image": PAUSE}], **spec}


def placeholder(ns: str, uid: str, **spec: Any) -> str:
    """A pod of the operator's placeholder shape (reservoir.k8s.devices.placeholder_spec)."""
    body = {
        "restartPolicy": "Always",
        "automountServiceAccountToken": False,
        "priorityClassName": "reservoir-placeholder",
        "resourceClaims": [{"name": "devices", "resourceClaimName": f"reservoir-{uid}"}],
        "containers": [
            {
                "name": "hold",
                "image": PAUSE,
                "resources": {"claims": [{"name": "devices"}]},
                "securityContext": {"allowPrivilegeEscalation": False},
            }
        ],
        **spec,
    }
    labels = {
        "reservoir.dev/envelope": "e",
        "reservoir.dev/claim-uid": uid,
        "reservoir.dev/placeholder-for": "c",
    }
    owner = {"apiVersion": "reservoir.dev/v1alpha1", "kind": "BranchClaim", "name": "c", "uid": uid}
    return manifest(
        "Pod", f"reservoir-hold-{uid}", ns, body, labels=labels, ownerReferences=[owner]
    )


def test_the_operators_token_acts_only_in_its_own_shape(
    cluster: ClusterHandle, ns: str, chart: Installed, tmp_path: Path
) -> None:
    op = operator_kubeconfig(cluster, chart, tmp_path / "op")
    pods, jobs = (
        f"{chart.release}-reservoir-operator-pods",
        f"{chart.release}-reservoir-operator-jobs",
    )
    claims = f"{chart.release}-reservoir-operator-resourceclaims"
    # A claim to own the test's placeholder (else the garbage collector takes it at once).
    create_envelope(cluster, ns, "e", {"tokens": "10"})
    body = {"envelope": "e", "branch": "c", "requests": {"tokens": "1"}}
    claim = {"apiVersion": "reservoir.dev/v1alpha1", "kind": "BranchClaim"}
    claim |= {"metadata": {"name": "c", "namespace": ns}, "spec": body}
    cluster.kubectl("create", "-f", "-", input=json.dumps(claim))
    uid = cluster.kubectl("get", "bclaim", "c", "-n", ns, "-o", "jsonpath={.metadata.uid}")
    until_enforced(op, pods, "create", "-f", "-", input=manifest("Pod", "x", ns, pause_pod()))

    # Pods: only placeholders of its own shape, nowhere protected.
    denied(
        op,
        pods,
        "creates only placeholder pods",
        "create",
        "-f",
        "-",
        input=manifest("Pod", "shell", ns, pause_pod()),
    )
    host = {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}
    denied(
        op,
        pods,
        "runs only the pause image",
        "create",
        "-f",
        "-",
        input=placeholder(ns, uid, **host),
    )
    privileged = json.loads(placeholder(ns, uid))
    privileged["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    denied(op, pods, "runs only the pause image", "create", "-f", "-", input=json.dumps(privileged))
    denied(
        op,
        pods,
        "has the PriorityClass reservoir-placeholder",
        "create",
        "-f",
        "-",
        input=placeholder(ns, uid, priorityClassName=""),
    )
    everywhere = {"tolerations": [{"operator": "Exists"}]}
    denied(
        op,
        pods,
        "limited to the administrator's allow-lists",
        "create",
        "-f",
        "-",
        input=placeholder(ns, uid, **everywhere),
    )
    other = json.loads(placeholder(ns, uid))
    other["spec"]["resourceClaims"][0]["resourceClaimName"] = f"reservoir-{uuid.uuid4()}"
    denied(
        op,
        pods,
        "references exactly its claim's ResourceClaim",
        "create",
        "-f",
        "-",
        input=json.dumps(other),
    )
    denied(
        op,
        pods,
        "writes no pods in namespace kube-system",
        "create",
        "-f",
        "-",
        input=placeholder("kube-system", uid),
    )
    denied(
        op,
        pods,
        f"writes no pods in namespace {chart.namespace}",
        "create",
        "-f",
        "-",
        input=placeholder(chart.namespace, uid),
    )
    allowed(op, "create", "-f", "-", input=placeholder(ns, uid))  # its own shape passes

    # A tenant's pod: the operator may lift its gate and change nothing else, and delete it
    # only if it is labelled for a claim (upstreamCancel: Delete).
    gated = pause_pod(schedulingGates=[{"name": GATE}, {"name": "other/gate"}])
    cluster.kubectl("create", "-f", "-", input=manifest("Pod", "work", ns, gated))
    denied(op, pods, "only removes its scheduling gate", "label", "pod", "work", "-n", ns, "x=y")
    keep_ours = '{"spec":{"schedulingGates":[{"name":"reservoir.dev/hand-off"}]}}'
    denied(
        op,
        pods,
        "only removes its scheduling gate",
        "patch",
        "pod",
        "work",
        "-n",
        ns,
        "--type=merge",
        "-p",
        keep_ours,
    )
    lift = '{"spec":{"schedulingGates":[{"name":"other/gate"}]}}'
    allowed(op, "patch", "pod", "work", "-n", ns, "--type=merge", "-p", lift)
    denied(op, pods, "deletes only its placeholder pods", "delete", "pod", "work", "-n", ns)
    allowed(op, "delete", "pod", f"reservoir-hold-{uid}", "-n", ns, "--wait=false")

    # Jobs: suspended (nothing else changed), deleted only when labelled for a claim. (Its
    # pods wait behind a gate of their own: they never run.)
    pending = pause_pod(restartPolicy="Never", schedulingGates=[{"name": "test/wait"}])
    job = {"template": {"spec": pending}}
    cluster.kubectl("create", "-f", "-", input=manifest("Job", "plain", ns, job))
    labelled = {"labels": {"reservoir.dev/claim": "c"}}
    cluster.kubectl("create", "-f", "-", input=manifest("Job", "mine", ns, job, **labelled))
    denied(
        op,
        jobs,
        "deletes only Jobs labelled reservoir.dev/claim",
        "delete",
        "job",
        "plain",
        "-n",
        ns,
    )
    denied(
        op,
        jobs,
        "only suspends a Job",
        "patch",
        "job",
        "plain",
        "-n",
        ns,
        "--type=merge",
        "-p",
        '{"spec":{"parallelism":5}}',
    )
    allowed(
        op, "patch", "job", "plain", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":true}}'
    )
    denied(
        op,
        jobs,
        "only suspends a Job",
        "patch",
        "job",
        "plain",
        "-n",
        ns,
        "--type=merge",
        "-p",
        '{"spec":{"suspend":false}}',
    )
    allowed(op, "delete", "job", "mine", "-n", ns, "--wait=false")

    # ResourceClaims: only its own, for its device classes (and never admin access).
    owner = {"apiVersion": "reservoir.dev/v1alpha1", "kind": "BranchClaim", "name": "c", "uid": uid}

    def devices(device_class: str) -> dict[str, Any]:
        exactly = {"deviceClassName": device_class}
        return {"devices": {"requests": [{"name": "dev-0", "exactly": exactly}]}}

    meta = {"labels": {"reservoir.dev/claim-uid": uid}, "ownerReferences": [owner]}
    other_class, gpus = devices("storage.example.com"), devices("gpu.reservoir.dev")
    name = f"reservoir-{uid}"
    denied(
        op,
        claims,
        "asks for devices of",
        "create",
        "-f",
        "-",
        input=manifest("ResourceClaim", name, ns, other_class, **meta),
    )
    denied(
        op,
        claims,
        "only its own ResourceClaims",
        "create",
        "-f",
        "-",
        input=manifest("ResourceClaim", "scratch", ns, gpus, **meta),
    )
    denied(
        op,
        claims,
        "writes no ResourceClaims in namespace kube-system",
        "create",
        "-f",
        "-",
        input=manifest("ResourceClaim", name, "kube-system", gpus, **meta),
    )


def test_a_tenant_cannot_use_what_is_the_operators(
    cluster: ClusterHandle, ns: str, chart: Installed, tmp_path: Path
) -> None:
    me = tenant(cluster, ns, tmp_path / "tenant")
    prefix = f"{chart.release}-reservoir"
    create_envelope(cluster, ns, "wf", {"tokens": "10", GPU: "2"})

    # The placeholder PriorityClass: jumping the queue and escaping preemption.
    jump = manifest("Pod", "jump", ns, pause_pod(priorityClassName="reservoir-placeholder"))
    until_enforced(me, f"{prefix}-placeholder-priority", "create", "-f", "-", input=jump)
    denied(
        me,
        f"{prefix}-placeholder-priority",
        "for Reservoir's placeholder pods only",
        "create",
        "-f",
        "-",
        input=jump,
    )

    # Another claim's devices: only its gated, labelled workload pod may mount them, and only
    # the operator lifts the gate.
    rc = f"reservoir-{uuid.uuid4()}"
    mount = {"resourceClaims": [{"name": "d", "resourceClaimName": rc}]}
    denied(
        me,
        f"{prefix}-claim-devices",
        "must be its claim's workload pod",
        "create",
        "-f",
        "-",
        input=manifest("Pod", "steal", ns, pause_pod(**mount)),
    )
    gated = pause_pod(schedulingGates=[{"name": GATE}], **mount)
    unlabelled = manifest("Pod", "steal", ns, gated)
    denied(
        me,
        f"{prefix}-claim-devices",
        "labelled reservoir.dev/claim",
        "create",
        "-f",
        "-",
        input=unlabelled,
    )
    workload = manifest("Pod", "work", ns, gated, labels={"reservoir.dev/claim": "c"})
    allowed(me, "create", "-f", "-", input=workload)
    # A workload pod without devices waits behind the gate too (issue 24): created without
    # it, it could start for a claim that holds nothing.
    ungated = manifest("Pod", "early", ns, pause_pod(), labels={"reservoir.dev/claim": "c"})
    denied(
        me,
        f"{prefix}-claim-devices",
        "must be created behind the scheduling gate",
        "create",
        "-f",
        "-",
        input=ungated,
    )
    # Nor labelled for a claim once it is past any gate (a gate cannot be added later).
    allowed(me, "create", "-f", "-", input=manifest("Pod", "plain", ns, pause_pod()))
    denied(
        me,
        f"{prefix}-claim-devices",
        "cannot be added, changed or removed",
        "label",
        "pod",
        "plain",
        "-n",
        ns,
        "reservoir.dev/claim=c",
    )
    denied(
        me,
        f"{prefix}-claim-devices",
        "only the Reservoir operator lifts",
        "patch",
        "pod",
        "work",
        "-n",
        ns,
        "--type=merge",
        "-p",
        '{"spec":{"schedulingGates":[]}}',
    )
    # A tenant's own ResourceClaims are its business; Reservoir's names are not.
    exactly = {"deviceClassName": "gpu.reservoir.dev"}
    spec = {"devices": {"requests": [{"name": "d", "exactly": exactly}]}}
    denied(
        me,
        f"{prefix}-claim-resourceclaims",
        "only its operator creates them",
        "create",
        "-f",
        "-",
        input=manifest("ResourceClaim", rc, ns, spec),
    )
    allowed(me, "create", "-f", "-", input=manifest("ResourceClaim", "reservoir-scratch", ns, spec))

    # Placement hints beyond the administrator's allow-list: refused at apply.
    def claim(name: str, placement: dict[str, Any]) -> str:
        spec = {"envelope": "wf", "branch": name, "requests": {GPU: "1"}, "placement": placement}
        body = {
            "apiVersion": "reservoir.dev/v1alpha1",
            "kind": "BranchClaim",
            "metadata": {"name": name, "namespace": ns},
            "spec": spec,
        }
        return json.dumps(body)

    hints = f"{prefix}-placement"
    refused: list[dict[str, Any]] = [
        {"tolerations": [{"operator": "Exists"}]},
        {"tolerations": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}]},
        {"nodeSelector": {"team": "b"}},
        {"affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": []}}},
    ]
    for placement in refused:
        denied(
            me,
            hints,
            "the administrator's allow-lists",
            "create",
            "-f",
            "-",
            input=claim("hostile", placement),
        )
    fine = {
        "tolerations": [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}],
        "nodeSelector": {"kubernetes.io/hostname": "gpu-node-1"},
    }
    allowed(me, "create", "-f", "-", input=claim("fine", fine))

    # Status is the operator's ledger: a forged one is refused even with /status rights.
    # (A forged ledger the schema accepts: a claim released, an envelope closed.)
    for kind, name, phase in (("bclaim", "fine", "Released"), ("renv", "wf", "Closed")):
        forged = json.dumps({"status": {"phase": phase}})
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
            forged,
        )


def test_provider_tokens_are_read_only_where_a_namespace_grants_them(
    cluster: ClusterHandle, ns: str, chart: Installed, tmp_path: Path
) -> None:
    """No cluster-wide Secret get: a namespace binds the chart's ClusterRole (the README's
    RoleBinding) and the operator may then get Secrets there, and nowhere else."""
    op = operator_kubeconfig(cluster, chart, tmp_path / "op")
    cluster.kubectl("create", "secret", "generic", "provider-token", "-n", ns, "--from-literal=t=x")

    def can_get(where: str) -> bool:
        answer = kubectl_as(op, "auth", "can-i", "get", "secrets/provider-token", "-n", where)
        return answer.stdout.strip() == "yes"

    assert not can_get(ns) and not can_get("kube-system")
    cluster.kubectl(
        "create",
        "rolebinding",
        "reservoir-provider-tokens",
        "-n",
        ns,
        f"--clusterrole={chart.release}-reservoir-provider-tokens",
        f"--serviceaccount={chart.namespace}:{chart.release}-reservoir",
    )
    eventually("the grant", lambda: can_get(ns))
    allowed(op, "get", "secret", "provider-token", "-n", ns)
    assert not can_get("kube-system") and not can_get("default")
    assert kubectl_as(op, "auth", "can-i", "list", "secrets", "-n", ns).stdout.strip() == "no"


def test_the_operator_holds_hands_off_and_settles_a_gpu_claim_under_the_policies(
    cluster: ClusterHandle, ns: str, chart: Installed, tmp_path: Path
) -> None:
    """The legitimate case end to end, with nothing but the ServiceAccount's token and every
    policy enforced: placeholder and ResourceClaim created, the hand-off gate lifted, the
    placeholder deleted, the claim settled, and its devices counted against the envelope
    until the scheduler confirms their release."""
    op = operator_kubeconfig(cluster, chart, tmp_path / "op")
    until_enforced(
        op,
        f"{chart.release}-reservoir-operator-pods",
        "create",
        "-f",
        "-",
        input=manifest("Pod", "x", ns, pause_pod()),
    )
    LOGS.mkdir(parents=True, exist_ok=True)
    log = LOGS / "policies-gpu.log"
    log.unlink(missing_ok=True)
    # Cluster-wide, as the chart runs it (its ClusterRole; the chart's peering object).
    operator = OperatorProcess(
        cluster,
        None,
        log,
        "--peering",
        f"{chart.release}-reservoir",
        "--restrict-placement",
        "--allowed-node-label-key=kubernetes.io/hostname",
        kubeconfig=op,
    )
    try:
        with Reservoir(namespace=ns, kubeconfig=str(cluster.kubeconfig_path)) as sdk:
            create_envelope(cluster, ns, "gpus", {GPU: "8"}, defaultLeaseSeconds=300)
            placement = {"nodeSelector": {"kubernetes.io/hostname": "gpu-node-1"}}
            view = wait_phase(
                sdk,
                sdk.hold("gpus", "train", {GPU: "2"}, name="train", placement=placement),
                "Tentative",
            )
            assert view.status.placement is not None
            assert view.status.placement.node == "gpu-node-1"
            template = {"metadata": {"name": "trainer"}, "spec": pause_pod()}
            cluster.kubectl("apply", "-f", "-", input=json.dumps(workload_pod(view, template)))
            committed = sdk.wait("train", condition="Committed", within=30)
            line = ledger_line(sdk, committed)
            assert line is not None and line.handed_off_at is not None
            eventually(
                "the workload pod bound",
                lambda: (
                    "gpu-node-1"
                    in cluster.kubectl(
                        "get", "pod", "trainer", "-n", ns, "-o", "jsonpath={.spec.nodeName}"
                    )
                ),
            )
            eventually(
                "the placeholder gone",
                lambda: (
                    not cluster.kubectl(
                        "get", "pods", "-n", ns, "-l", "reservoir.dev/placeholder-for", "-o", "name"
                    ).strip()
                ),
            )
            sdk.finish(sdk.get("train"), {})  # nothing consumed: all of R returns
            settled = wait_phase(sdk, "train", "Consumed")
            assert settled.status.placement is not None
            assert not settled.status.placement.devices_released
            # The pod still runs on the devices: they count against the envelope.
            assert sdk.ledger("gpus").status.totals.available[GPU] == 6
            cluster.kubectl("delete", "pod", "trainer", "-n", ns, "--wait=false")
            eventually(
                "the devices confirmed free",
                lambda: (p := sdk.get("train").status.placement) is not None and p.devices_released,
            )
            eventually(
                "the devices back in the envelope",
                lambda: sdk.ledger("gpus").status.totals.available[GPU] == 8,
            )
            # Hints beyond the operator's allow-list (here: no toleration key allowed) are
            # not copied: the claim waits, saying why.
            hostile = {"tolerations": [{"key": GPU, "operator": "Exists"}]}
            sdk.hold("gpus", "wide", {GPU: "1"}, name="wide", placement=hostile)
            eventually(
                "the refusal as the claim's reason",
                lambda: (
                    "refused by the administrator's allow-list"
                    in str(sdk.get("wide").status.model_dump())
                ),
            )
    finally:
        operator.stop()
    text = log.read_text()
    # (A cluster-wide operator also serves earlier tests' namespaces; an Event posted into
    # one being deleted is refused by the namespace lifecycle, not by a policy.)
    refusals = [
        line
        for line in text.splitlines()
        if ("denied request" in line or " 403" in line) and "is being terminated" not in line
    ]
    assert not refusals, f"the operator was refused ({log}):\n" + "\n".join(refusals[:5])


def test_only_a_compensator_may_send_a_compensation(
    cluster: ClusterHandle, ns: str, chart: Installed, tmp_path: Path
) -> None:
    """A refund gives a settled charge back to the envelope (and at close to the pool): a
    tenant with every right over its claims may not send one without the `compensate`
    verb (issue 22), and may still do everything else to its claims."""
    me = tenant(cluster, ns, tmp_path / "tenant")
    policy = f"{chart.release}-reservoir-compensations"
    create_envelope(cluster, ns, "wf", {"tokens": "10"})
    refund = {"key": "r-1", "refund": {"tokens": "2"}, "reason": "refund #1"}
    claim = {
        "apiVersion": "reservoir.dev/v1alpha1",
        "kind": "BranchClaim",
        "metadata": {"name": "c", "namespace": ns},
        "spec": {"envelope": "wf", "requests": {"tokens": "3"}, "compensations": [refund]},
    }
    until_enforced(me, policy, "create", "-f", "-", input=json.dumps(claim))
    denied(me, policy, "needs the 'compensate' verb", "create", "-f", "-", input=json.dumps(claim))
    plain = {**claim, "spec": {"envelope": "wf", "requests": {"tokens": "3"}}}
    allowed(me, "create", "-f", "-", input=json.dumps(plain))
    patch = json.dumps({"spec": {"compensations": [refund]}})
    denied(
        me,
        policy,
        "needs the 'compensate' verb",
        "patch",
        "branchclaim",
        "c",
        "-n",
        ns,
        "--type=merge",
        "-p",
        patch,
    )
    allowed(
        me,
        "patch",
        "branchclaim",
        "c",
        "-n",
        ns,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"cancel": True}}),
    )

    # Granted the verb (the chart's reservoir-compensator, here as a Role), it may.
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "compensator", "namespace": ns},
        "rules": [
            {"apiGroups": ["reservoir.dev"], "resources": ["branchclaims"], "verbs": ["compensate"]}
        ],
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(role))
    cluster.kubectl(
        "create",
        "rolebinding",
        "compensator",
        "-n",
        ns,
        "--role=compensator",
        f"--serviceaccount={ns}:tenant",
    )
    eventually(
        "the compensate verb granted",
        lambda: (
            kubectl_as(
                me, "patch", "branchclaim", "c", "-n", ns, "--type=merge", "-p", patch
            ).returncode
            == 0
        ),
        timeout=30,
        every=1,
    )
    stored = json.loads(cluster.kubectl("get", "branchclaim", "c", "-n", ns, "-o", "json"))
    assert [c["key"] for c in stored["spec"]["compensations"]] == ["r-1"]
