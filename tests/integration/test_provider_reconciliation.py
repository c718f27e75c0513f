"""Reconciling with the provider, not only with the worker (issue 11), on the real control
plane: a Detached claim settled by its upstream Job (the local cluster runs the Job
controller, and KWOK completes a Job's pods once their scheduling gate is lifted) or by
any object with conditions, or by an HTTP provider (tests/integration/provider_server.py,
which the operator, a local process here allowed to call it, reaches on this machine's own
address); cancels forwarded and
recorded as requested; submissions that may be running; duplicate idempotency keys; the
timeout-boundary races of client-disconnect.txt; a history that outlives operator restarts
and Events; and retry windows."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from reservoir.core.model import ClaimPhase, Outcome, ProviderState, Transition, Trigger
from reservoir.sdk import ClaimView, DuplicateRequestIdError, Reservoir
from tests.clusters import ClusterHandle, free_port, schemaless_crd
from tests.integration.conftest import OperatorProcess, StartOperator
from tests.integration.helpers import (
    create_envelope,
    events_of,
    events_with_messages,
    eventually,
    ledger_line,
    settled_ledger,
    totals,
    under_lease,
    wait_phase,
)
from tests.integration.provider_server import (
    ProviderServer,
    answer,
    host_address,
    provider_server,
)
from tests.integration.test_metrics import samples, scrape, value

TOKEN = "s3cret-provider-token"
ENVELOPE_LABEL = "reservoir.dev/envelope"
CLAIM_LABEL = "reservoir.dev/claim"
SHORT_LEASE = 2  # seconds: no test heartbeats, so a dispatched claim goes Detached soon


# --- fixtures and small helpers ------------------------------------------------------------


@pytest.fixture
def provider() -> Iterator[ProviderServer]:
    with provider_server(token=TOKEN) as server:
        yield server


@pytest.fixture
def start_operator(start_operator: StartOperator) -> StartOperator:
    """Operators an administrator allowed to call the test provider, which serves on this
    machine's own address (the operator never calls loopback, whatever it is allowed)."""

    def start(*extra: str, kubeconfig: Path | None = None) -> OperatorProcess:
        return start_operator("--provider-allow", host_address(), *extra, kubeconfig=kubeconfig)

    return start


def token_secret(cluster: ClusterHandle, ns: str, name: str = "provider-token") -> dict[str, str]:
    """A Secret holding the provider's bearer token; returns the policy's tokenSecret."""
    body = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": ns},
        "data": {"token": base64.b64encode(TOKEN.encode()).decode()},
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    return {"name": name, "key": "token"}


def http_policy(
    cluster: ClusterHandle, ns: str, provider: ProviderServer, cancel: bool = True
) -> dict[str, Any]:
    endpoint: dict[str, Any] = {
        "statusURL": provider.status_url,
        "tokenSecret": token_secret(cluster, ns),
    }
    if cancel:
        endpoint["cancelURL"] = provider.cancel_url
    # Lookups back off from 2 s to at most this: the tests see a few in seconds.
    return {"provider": endpoint, "providerLookupMaxSeconds": 2}


GATE = "reservoir.dev/test-hold"


def create_job(
    cluster: ClusterHandle,
    ns: str,
    name: str,
    envelope: str,
    usage: dict[str, str] | None = None,
    result: str | None = None,
    suspended: bool = False,
    claim: str | None = None,
) -> None:
    """A Job labelled for its envelope (the operator's Job watch wakes the envelope's
    writer as it changes). It starts at once, and its pod waits behind a scheduling gate:
    the Job is running until `finish_job` lifts the gate (KWOK then runs the pod to
    completion) or `fail_job` gives it a deadline already past. `suspended`: created
    suspended (queued, as Kueue creates Jobs) until `resume_job`. `claim`: labelled
    reservoir.dev/claim with it, the owner's consent to its deletion by that claim."""
    annotations = {}
    if usage is not None:
        annotations["reservoir.dev/usage"] = json.dumps(usage)
    if result is not None:
        annotations["reservoir.dev/result"] = result
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [{"name": "work", "image": "busybox"}],
    }
    spec: dict[str, Any] = {"backoffLimit": 0, "template": {"spec": pod}}
    if suspended:
        spec["suspend"] = True
    else:
        pod["schedulingGates"] = [{"name": GATE}]
    body = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": {ENVELOPE_LABEL: envelope, **({CLAIM_LABEL: claim} if claim else {})},
            "annotations": annotations,
        },
        "spec": spec,
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))


def resume_job(cluster: ClusterHandle, ns: str, name: str) -> None:
    cluster.kubectl(
        "patch", "job", name, "-n", ns, "--type", "merge", "-p", '{"spec": {"suspend": false}}'
    )


def finish_job(cluster: ClusterHandle, ns: str, name: str) -> None:
    """Lift the gate of the Job's pod: it is scheduled, and KWOK completes it."""
    pods = cluster.kubectl("get", "pods", "-n", ns, "-l", f"job-name={name}", "-o", "name")
    assert pods.split(), f"Job {name} has no pod"
    for pod in pods.split():
        cluster.kubectl(
            "patch",
            pod,
            "-n",
            ns,
            "--type",
            "json",
            "-p",
            '[{"op": "remove", "path": "/spec/schedulingGates"}]',
        )


def fail_job(cluster: ClusterHandle, ns: str, name: str) -> None:
    """A 1-second active deadline on a Job running for longer: the Job controller fails
    it (DeadlineExceeded)."""
    cluster.kubectl(
        "patch",
        "job",
        name,
        "-n",
        ns,
        "--type",
        "merge",
        "-p",
        '{"spec": {"activeDeadlineSeconds": 1}}',
    )


def job_running(sdk: Reservoir, claim: str) -> ClaimView:
    """The claim once a lookup has recorded its Job running."""
    return eventually(
        f"{claim}: its Job looked up, running",
        lambda: (
            (v := sdk.get(claim)).status.provider is not None
            and v.status.provider.state is ProviderState.RUNNING
            and v
        ),
    )


def job_upstream(job: str) -> dict[str, Any]:
    return {"ref": {"name": job}, "operationId": job, "supportsStatus": True}


def patch_spec(cluster: ClusterHandle, ns: str, claim: str, spec: dict[str, Any]) -> None:
    """A worker writing its claim directly (as one that comes back late would, without the
    SDK's checks), under the claim's current lease (`spec.lease.fence`, as the API server
    requires of a report)."""
    for _ in range(20):  # the lease may move between the read and the write: read again
        current = json.loads(cluster.kubectl("get", "bclaim", claim, "-n", ns, "-o", "json"))
        fenced = json.dumps({"spec": under_lease(current, spec)})
        try:
            cluster.kubectl("patch", "bclaim", claim, "-n", ns, "--type", "merge", "-p", fenced)
            return
        except RuntimeError as error:
            if "must carry the current lease" not in str(error):
                raise
            time.sleep(0.2)
    raise AssertionError(f"branchclaim/{claim}: its lease kept moving")


def poke(cluster: ClusterHandle, ns: str, claim: str, n: int) -> None:
    """Touch the claim (an annotation): every change to a claim wakes its envelope's writer."""
    cluster.kubectl(
        "annotate", "bclaim", claim, "-n", ns, f"test.reservoir.dev/poke={n}", "--overwrite"
    )


def condition(view: ClaimView, kind: str) -> tuple[str, str, str] | None:
    for c in view.status.conditions:
        if c.type == kind:
            return c.status, c.reason, c.message
    return None


def tokens(amounts: dict[str, Decimal]) -> Decimal:
    return amounts.get("tokens", Decimal(0))


def settled(sdk: Reservoir, name: str, within: float = 30) -> ClaimView:
    """The claim once its own status carries its settlement (the mirror of the ledger)."""
    return eventually(
        f"{name} to settle",
        lambda: (view := sdk.get(name)).status.settlement is not None and view,
        timeout=within,
    )


def moves(history: list[Transition]) -> list[tuple[str, str, str, str]]:
    return [(t.from_phase.value, t.to.value, t.reason, t.trigger.value) for t in history]


def detached(sdk: Reservoir, name: str) -> ClaimView:
    return wait_phase(sdk, name, "Detached", within=30)


# --- 1-3. a Job's status is the provider's answer ------------------------------------------


def test_a_detached_claim_settles_from_its_jobs_completion_without_a_worker_report(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(
        cluster,
        ns,
        "wf",
        {"tokens": "20"},
        defaultLeaseSeconds=SHORT_LEASE,
        atAmbiguityDeadline="Hold",
    )
    create_job(cluster, ns, "train-7", "wf", usage={"tokens": "7"})
    sdk.hold(
        "wf", "train", {"tokens": "20"}, name="x", dispatch=True, upstream=job_upstream("train-7")
    )
    detached(sdk, "x")
    # Looked up while Detached: the Job is running, so nothing settles.
    claim = job_running(sdk, "x")
    assert claim.phase is ClaimPhase.DETACHED and claim.status.settlement is None
    settled_ledger(sdk, "wf", reconciling="20", committed="0", available="0")

    finish_job(cluster, ns, "train-7")  # KWOK runs its pod: the Job completes
    claim = settled(sdk, "x")
    settlement = claim.status.settlement
    assert settlement is not None
    assert settlement.reason == "ProviderSucceeded", settlement
    assert settlement.outcome is Outcome.SUCCEEDED
    assert claim.phase is ClaimPhase.CONSUMED
    assert tokens(claim.status.consumed) == 7 and tokens(claim.status.released) == 13
    assert claim.status.result == "Job/train-7"
    assert claim.status.provider is not None
    assert claim.status.provider.state is ProviderState.SUCCEEDED
    assert claim.status.provider.failures == 0
    # No worker reported anything: the Job alone settled it.
    assert not claim.spec.final and not claim.spec.usage
    assert moves(claim.status.history)[-1] == (
        "Detached",
        "Consumed",
        "ProviderSucceeded",
        "Provider",
    )
    settled_ledger(sdk, "wf", committed="7", reserved="0", reconciling="0", available="13")
    found = sdk.result("x")
    assert (found.result, found.outcome, found.reason) == (
        "Job/train-7",
        Outcome.SUCCEEDED,
        "ProviderSucceeded",
    )


def test_a_detached_claim_whose_job_fails_settles_as_failed(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(
        cluster,
        ns,
        "wf",
        {"tokens": "20"},
        defaultLeaseSeconds=SHORT_LEASE,
        atAmbiguityDeadline="Hold",
    )
    create_job(
        cluster,
        ns,
        "eval-3",
        "wf",
        usage={"tokens": "4"},
        result="s3://bucket/eval-3/log.txt",
    )
    sdk.hold(
        "wf", "eval", {"tokens": "20"}, name="x", dispatch=True, upstream=job_upstream("eval-3")
    )
    detached(sdk, "x")
    job_running(sdk, "x")
    fail_job(cluster, ns, "eval-3")
    claim = settled(sdk, "x")
    settlement = claim.status.settlement
    assert settlement is not None
    assert (settlement.reason, settlement.outcome) == ("ProviderFailed", Outcome.FAILED)
    assert claim.phase is ClaimPhase.CONSUMED
    assert tokens(claim.status.consumed) == 4 and tokens(claim.status.released) == 16
    assert claim.status.result == "s3://bucket/eval-3/log.txt"
    assert claim.status.provider is not None
    assert claim.status.provider.state is ProviderState.FAILED
    settled_ledger(sdk, "wf", committed="4", reserved="0", reconciling="0", available="16")


def test_a_claim_whose_job_vanished_stays_detached_and_says_why(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(
        cluster,
        ns,
        "wf",
        {"tokens": "40"},
        defaultLeaseSeconds=SHORT_LEASE,
        atAmbiguityDeadline="Hold",
    )
    create_job(cluster, ns, "short-lived", "wf")
    # One Job never created, one deleted after it was looked up.
    sdk.hold(
        "wf",
        "a",
        {"tokens": "20"},
        name="ghost",
        dispatch=True,
        upstream=job_upstream("never-made"),
    )
    sdk.hold(
        "wf",
        "b",
        {"tokens": "20"},
        name="gone",
        dispatch=True,
        upstream=job_upstream("short-lived"),
    )
    detached(sdk, "ghost")
    detached(sdk, "gone")
    job_running(sdk, "gone")
    cluster.kubectl("delete", "job", "short-lived", "-n", ns, "--wait=true")

    for name, job in (("ghost", "never-made"), ("gone", "short-lived")):
        claim = eventually(
            f"{name}: the lookup failure recorded",
            lambda name=name: (
                (v := sdk.get(name)).status.provider is not None
                and v.status.provider.last_error is not None
                and condition(v, "ProviderReachable") is not None
                and v
            ),
        )
        record = claim.status.provider
        assert record is not None and record.last_error is not None
        assert "not found" in record.last_error and job in record.last_error, record
        assert record.failures >= 1
        reachable = condition(claim, "ProviderReachable")
        assert reachable is not None and reachable[:2] == ("False", "LookupFailed"), reachable
        assert "not found" in reachable[2]
        assert claim.phase is ClaimPhase.DETACHED and claim.status.settlement is None
    # A missing Job is no answer: the capacity stays held as reconciling.
    settled_ledger(sdk, "wf", reconciling="40", committed="0", available="0")
    eventually(
        "the failure announced", lambda: "ProviderLookupFailed" in events_of(cluster, ns, "ghost")
    )


def job_spec(cluster: ClusterHandle, ns: str, name: str) -> dict[str, Any] | None:
    found = cluster.kubectl("get", "job", name, "-n", ns, "-o", "json", "--ignore-not-found")
    return json.loads(found)["spec"] if found.strip() else None


def test_a_cancel_is_forwarded_to_a_job_by_suspending_or_deleting_it_per_policy(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    """upstreamCancel Suspend suspends the Job, Delete deletes it, and a claim whose
    provider cannot cancel (supportsCancel false) leaves its Job alone. Each is only a
    request: the capacity waits for the Job's answer (a suspended Job with no pod left is
    not Cancelled: anyone may resume it, and it settles when it completes; a deleted one
    answers nothing)."""
    for envelope, how in (("wfs", "Suspend"), ("wfd", "Delete")):
        create_envelope(
            cluster,
            ns,
            envelope,
            {"tokens": "40"},
            defaultLeaseSeconds=120,
            upstreamCancel=how,
            providerLookupMaxSeconds=2,
        )
    # Jobs that start and keep running (their pods wait behind a scheduling gate).
    create_job(cluster, ns, "jn", "wfs")
    create_job(cluster, ns, "jd", "wfd", claim="d")  # the Job's owner lets claim d delete it
    create_job(cluster, ns, "js", "wfs", usage={"tokens": "15"})
    cancellable = {**job_upstream("js"), "supportsCancel": True}
    sdk.hold("wfs", "s", {"tokens": "20"}, name="s", dispatch=True, upstream=cancellable)
    cancellable = {**job_upstream("jd"), "supportsCancel": True}
    sdk.hold("wfd", "d", {"tokens": "20"}, name="d", dispatch=True, upstream=cancellable)
    sdk.hold("wfs", "n", {"tokens": "20"}, name="n", dispatch=True, upstream=job_upstream("jn"))
    for name in ("s", "d", "n"):
        sdk.cancel(wait_phase(sdk, name, "Committed"))

    claim = eventually(
        "the Job suspended",
        lambda: (
            (v := sdk.get("s")).status.provider is not None
            and v.status.provider.cancel_forwarded_at is not None
            and v
        ),
    )
    assert claim.status.provider is not None and claim.status.provider.cancel is not None
    assert "suspended" in claim.status.provider.cancel, claim.status.provider
    spec = job_spec(cluster, ns, "js")
    assert spec is not None and spec["suspend"] is True
    # Suspended, its pod gone: not a confirmed cancel (issue 21, defect 2). It is resumed
    # (anyone may re-apply the Job), runs and completes: the usage it reports is charged.
    eventually(
        "the suspended Job's pod gone",
        lambda: (
            not cluster.kubectl("get", "pods", "-n", ns, "-l", "job-name=js", "-o", "name").split()
        ),
    )
    record = sdk.get("s").status.provider
    asked = record.lookups if record is not None else 0
    claim = eventually(
        "the suspended Job looked up twice more",
        lambda: (
            (v := sdk.get("s")).status.provider is not None
            and v.status.provider.lookups >= asked + 2
            and v
        ),
        timeout=60,
    )
    assert claim.status.provider is not None
    assert claim.status.provider.state in (ProviderState.PENDING, ProviderState.RUNNING)
    assert claim.status.settlement is None and claim.phase.holds_capacity
    resume_job(cluster, ns, "js")
    eventually(
        "the resumed Job's pod",
        lambda: cluster.kubectl("get", "pods", "-n", ns, "-l", "job-name=js", "-o", "name").split(),
    )
    finish_job(cluster, ns, "js")
    claim = settled(sdk, "s", within=60)
    settlement = claim.status.settlement
    assert settlement is not None
    assert (settlement.reason, settlement.outcome) == ("ProviderSucceeded", Outcome.SUCCEEDED)
    assert tokens(claim.status.consumed) == 15 and tokens(claim.status.released) == 5

    claim = eventually(
        "the Job deleted",
        lambda: (
            (v := sdk.get("d")).status.provider is not None
            and v.status.provider.cancel_forwarded_at is not None
            and v
        ),
    )
    assert claim.status.provider is not None and claim.status.provider.cancel is not None
    assert "deleted" in claim.status.provider.cancel, claim.status.provider
    eventually("the Job gone", lambda: job_spec(cluster, ns, "jd") is None)
    # Gone is not an answer: the claim still holds, and says why it cannot look.
    claim = eventually(
        "the deleted Job's lookup failing",
        lambda: (
            (v := sdk.get("d")).status.provider is not None
            and v.status.provider.last_error is not None
            and v
        ),
    )
    assert claim.status.provider is not None and claim.status.provider.last_error is not None
    assert "not found" in claim.status.provider.last_error

    # Not cancellable upstream: looked up (the cancel is pending), never forwarded.
    eventually(
        "the uncancellable claim looked up",
        lambda: (p := sdk.get("n").status.provider) is not None and p.lookups >= 2,
        timeout=60,
    )
    claim = sdk.get("n")
    assert claim.status.provider is not None
    assert (
        claim.status.provider.cancel_forwarded_at is None and claim.status.provider.cancel is None
    )
    spec = job_spec(cluster, ns, "jn")
    assert spec is not None and not spec.get("suspend")

    for name in ("d", "n"):
        claim = sdk.get(name)
        assert claim.condition("CancelRequested"), name
        assert claim.status.settlement is None and claim.phase.holds_capacity, name
    for name, forwarded in (("s", 1), ("d", 1), ("n", 0)):
        reasons = events_of(cluster, ns, name)
        assert reasons.count("CancelForwarded") == forwarded, (name, reasons)
    settled_ledger(sdk, "wfs", reserved="20", committed="15", available="5")
    settled_ledger(sdk, "wfd", reserved="20", committed="0", available="20")


def test_a_job_created_suspended_is_queued_not_cancelled(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    """A Job created with spec.suspend (queued: Kueue creates Jobs so and resumes them on
    admission) has not run and will: it is no terminal answer, and the claim stays
    Detached until the Job finishes."""
    create_envelope(
        cluster,
        ns,
        "wf",
        {"tokens": "20"},
        defaultLeaseSeconds=SHORT_LEASE,
        atAmbiguityDeadline="Hold",
    )
    create_job(cluster, ns, "queued", "wf", usage={"tokens": "5"}, suspended=True)
    eventually(
        "the Job controller to mark it suspended",
        lambda: (
            "Suspended"
            in cluster.kubectl(
                "get",
                "job",
                "queued",
                "-n",
                ns,
                "-o",
                "jsonpath={.status.conditions[?(@.status=='True')].type}",
            )
        ),
    )
    sdk.hold("wf", "q", {"tokens": "20"}, name="x", dispatch=True, upstream=job_upstream("queued"))
    # Detached once its lease lapses, and then looked up (whatever it then decides).
    claim = eventually(
        "the queued Job looked up",
        lambda: (
            (v := sdk.get("x")).status.provider is not None
            and v.status.provider.checked_at is not None
            and v
        ),
    )
    assert claim.status.settlement is None, claim.status.settlement
    assert claim.phase is ClaimPhase.DETACHED
    assert claim.status.provider is not None
    assert claim.status.provider.state is ProviderState.PENDING, claim.status.provider
    settled_ledger(sdk, "wf", reconciling="20", committed="0", available="0")

    resume_job(cluster, ns, "queued")  # admitted: it runs, and KWOK completes it
    claim = settled(sdk, "x")
    settlement = claim.status.settlement
    assert settlement is not None and settlement.reason == "ProviderSucceeded", settlement
    settled_ledger(sdk, "wf", committed="5", reserved="0", reconciling="0", available="15")


WIDGET_GROUP = "it-provider.reservoir.dev"


def test_a_detached_claim_settles_from_an_objects_conditions(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    """Any object with standard status.conditions (here a custom resource nobody watches):
    no conditions yet is Unknown (held, not an error); Succeeded=True settles."""
    crd = schemaless_crd(WIDGET_GROUP, "Widget", "widgets")
    cluster.kubectl("apply", "-f", "-", input=json.dumps(crd))
    cluster.kubectl(
        "wait", "--for=condition=Established", f"crd/widgets.{WIDGET_GROUP}", "--timeout=60s"
    )
    create_envelope(
        cluster,
        ns,
        "wf",
        {"tokens": "20"},
        defaultLeaseSeconds=SHORT_LEASE,
        atAmbiguityDeadline="Hold",
        providerLookupMaxSeconds=2,
    )
    widget = {
        "apiVersion": f"{WIDGET_GROUP}/v1",
        "kind": "Widget",
        "metadata": {
            "name": "w1",
            "namespace": ns,
            "annotations": {"reservoir.dev/usage": json.dumps({"tokens": "3"})},
        },
        "spec": {},
    }
    eventually(
        "the Widget created",
        lambda: cluster.kubectl("apply", "-f", "-", input=json.dumps(widget)),
    )
    ref = {"apiVersion": f"{WIDGET_GROUP}/v1", "kind": "Widget", "name": "w1"}
    upstream = {"ref": ref, "operationId": "w1", "supportsStatus": True}
    sdk.hold("wf", "w", {"tokens": "20"}, name="x", dispatch=True, upstream=upstream)
    detached(sdk, "x")
    claim = eventually(
        "the Widget looked up",
        lambda: (
            (v := sdk.get("x")).status.provider is not None
            and v.status.provider.checked_at is not None
            and v
        ),
    )
    record = claim.status.provider
    assert record is not None
    assert record.state is ProviderState.UNKNOWN and record.failures == 0, record
    reachable = condition(claim, "ProviderReachable")
    assert reachable is not None and reachable[:2] == ("True", "Answered"), reachable
    assert claim.phase is ClaimPhase.DETACHED

    status = {"status": {"conditions": [{"type": "Succeeded", "status": "True"}]}}
    cluster.kubectl(
        "patch",
        f"widgets.{WIDGET_GROUP}",
        "w1",
        "-n",
        ns,
        "--subresource=status",
        "--type",
        "merge",
        "-p",
        json.dumps(status),
    )
    claim = settled(sdk, "x", within=60)
    settlement = claim.status.settlement
    assert settlement is not None
    assert (settlement.reason, settlement.outcome) == ("ProviderSucceeded", Outcome.SUCCEEDED)
    assert claim.status.result == "Widget/w1"
    assert tokens(claim.status.consumed) == 3
    settled_ledger(sdk, "wf", committed="3", reserved="0", reconciling="0", available="17")


# --- 4. an HTTP provider: failures, then running, then succeeded (race c) ------------------


def test_an_http_provider_settles_a_detached_claim_once_after_failed_lookups(
    cluster: ClusterHandle,
    ns: str,
    start_operator: StartOperator,
    sdk: Reservoir,
    provider: ProviderServer,
) -> None:
    port = free_port()
    start_operator("--metrics-port", str(port))
    provider.script(
        "op-1",
        (500, {"error": "boom"}),
        (500, {"error": "boom"}),
        answer("op-1", "Running"),
        answer("op-1", "Succeeded", usage={"tokens": "9"}, result="s3://bucket/op-1/out.json"),
    )
    create_envelope(
        cluster,
        ns,
        "wf",
        {"tokens": "20"},
        defaultLeaseSeconds=SHORT_LEASE,
        atAmbiguityDeadline="Hold",
        **http_policy(cluster, ns, provider),
    )
    upstream = {"operationId": "op-1", "supportsStatus": True}
    sdk.hold("wf", "search", {"tokens": "20"}, name="x", dispatch=True, upstream=upstream)
    claim = settled(sdk, "x", within=60)
    settlement = claim.status.settlement
    assert settlement is not None
    assert (settlement.reason, settlement.outcome) == ("ProviderSucceeded", Outcome.SUCCEEDED)
    assert claim.phase is ClaimPhase.CONSUMED
    assert tokens(claim.status.consumed) == 9 and tokens(claim.status.released) == 11
    assert claim.status.result == "s3://bucket/op-1/out.json"
    record = claim.status.provider
    assert record is not None
    assert record.state is ProviderState.SUCCEEDED
    assert record.failures == 0 and record.last_error is None, "failures reset by an answer"
    assert record.lookups >= 4, record  # two failures, Running, Succeeded
    reachable = condition(claim, "ProviderReachable")
    assert reachable is not None and reachable[:2] == ("True", "Answered"), reachable
    settled_ledger(sdk, "wf", committed="9", reserved="0", reconciling="0", available="11")

    # Bounded: a handful of GETs, every one with the token from the Secret.
    asked = provider.lookups("op-1")
    assert 4 <= asked <= 8, asked
    assert {r.authorization for r in provider.requests} == {f"Bearer {TOKEN}"}
    # Failures were counted, then the answers.
    found = eventually(
        "the lookups counted",
        lambda: (
            (s := samples(scrape(port)))
            and (
                value(
                    s,
                    "reservoir_provider_lookups_total",
                    namespace=ns,
                    adapter="HTTP",
                    result="answered",
                )
                or 0
            )
            >= 2
            and s
        ),
    )
    failed = value(
        found, "reservoir_provider_lookups_total", namespace=ns, adapter="HTTP", result="failed"
    )
    assert failed is not None and failed >= 2, failed
    reasons = eventually(
        "the lookup Events",
        lambda: (
            {"ProviderLookupFailed", "ProviderAnswered", "ProviderSucceeded"}
            <= set(r := events_of(cluster, ns, "x"))
            and r
        ),
    )
    assert reasons.count("ProviderSucceeded") == 1, reasons

    # Settled once, and a settled claim is not polled again, whatever wakes its envelope.
    for n in range(3):
        poke(cluster, ns, "x", n)
    eventually("the pokes seen", lambda: sdk.get("x").status.settlement is not None)
    time.sleep(2 * 2 + 1)  # longer than the longest lookup wait (providerLookupMaxSeconds)
    assert provider.lookups("op-1") == asked
    again = sdk.get("x")
    assert again.status.settlement == settlement
    assert [t.reason for t in again.status.history].count("ProviderSucceeded") == 1
    settled_ledger(sdk, "wf", committed="9", reserved="0", available="11")


# --- 5. cancel forwarded, recorded as requested, settled by the provider's answer ----------


def test_a_cancel_after_dispatch_is_forwarded_once_and_settles_only_on_the_answer(
    cluster: ClusterHandle,
    ns: str,
    operator: OperatorProcess,
    sdk: Reservoir,
    provider: ProviderServer,
) -> None:
    provider.script("op-c", answer("op-c", "Running"))
    create_envelope(
        cluster,
        ns,
        "wf",
        {"tokens": "20"},
        defaultLeaseSeconds=120,
        **http_policy(cluster, ns, provider),
    )
    upstream = {"operationId": "op-c", "supportsStatus": True, "supportsCancel": True}
    claim = sdk.hold("wf", "code", {"tokens": "20"}, name="x", dispatch=True, upstream=upstream)
    claim = wait_phase(sdk, claim, "Committed")
    # Attached, not cancelled: nothing to ask the provider (the pokes make sure it looked).
    for n in range(2):
        poke(cluster, ns, "x", n)
    eventually("the pokes seen", lambda: sdk.get("x").phase is ClaimPhase.COMMITTED)
    assert provider.lookups("op-c") == 0, "an attached claim is not polled"
    assert sdk.get("x").status.provider is None
    sdk.cancel(sdk.get("x"))

    claim = eventually(
        "the cancel forwarded",
        lambda: (
            (v := sdk.get("x")).status.provider is not None
            and v.status.provider.cancel_forwarded_at is not None
            and v
        ),
    )
    assert claim.condition("CancelRequested")
    record = claim.status.provider
    assert record is not None and record.cancel == "requested (HTTP 202)", record
    # Requested, never confirmed: the provider goes on saying Running, the capacity stays.
    claim = eventually(
        "a few lookups after the cancel",
        lambda: (
            (v := sdk.get("x")).status.provider is not None and v.status.provider.lookups >= 3 and v
        ),
        timeout=60,
    )
    assert claim.status.settlement is None
    assert claim.phase is ClaimPhase.RUNNING, "the provider's Running proves execution"
    assert claim.condition("CancelRequested")
    assert provider.cancels("op-c") == 1
    settled_ledger(sdk, "wf", reserved="20", committed="0", available="0")
    posts = [r for r in provider.requests if r.method == "POST"]
    assert [r.path for r in posts] == ["/operations/op-c/cancel"]
    assert posts[0].authorization == f"Bearer {TOKEN}"

    provider.script("op-c", answer("op-c", "Cancelled", usage={"tokens": "3"}))
    claim = settled(sdk, "x", within=60)
    settlement = claim.status.settlement
    assert settlement is not None
    assert (settlement.reason, settlement.outcome) == ("ProviderCancelled", Outcome.CANCELLED)
    assert tokens(claim.status.consumed) == 3 and tokens(claim.status.released) == 17
    assert provider.cancels("op-c") == 1, "forwarded once"
    settled_ledger(sdk, "wf", committed="3", reserved="0", available="17")


def test_a_cancel_the_provider_refuses_is_tried_again_until_it_is_forwarded(
    cluster: ClusterHandle,
    ns: str,
    operator: OperatorProcess,
    sdk: Reservoir,
    provider: ProviderServer,
) -> None:
    provider.script("op-r", answer("op-r", "Running"))
    provider.on_cancel("op-r", 503, {"error": "try later"})
    create_envelope(
        cluster,
        ns,
        "wf",
        {"tokens": "20"},
        defaultLeaseSeconds=120,
        **http_policy(cluster, ns, provider),
    )
    upstream = {"operationId": "op-r", "supportsStatus": True, "supportsCancel": True}
    claim = sdk.hold("wf", "r", {"tokens": "20"}, name="x", dispatch=True, upstream=upstream)
    sdk.cancel(wait_phase(sdk, claim, "Committed"))
    claim = eventually(
        "the refusal recorded",
        lambda: (
            (v := sdk.get("x")).status.provider is not None
            and v.status.provider.cancel is not None
            and v
        ),
    )
    record = claim.status.provider
    assert record is not None and record.cancel is not None
    assert "503" in record.cancel and record.cancel_forwarded_at is None, record
    eventually("the refusal announced", lambda: "CancelNotForwarded" in events_of(cluster, ns, "x"))

    provider.on_cancel("op-r", 202, {})
    claim = eventually(
        "the cancel forwarded on a later try",
        lambda: (
            (v := sdk.get("x")).status.provider is not None
            and v.status.provider.cancel_forwarded_at is not None
            and v
        ),
        timeout=60,
    )
    record = claim.status.provider
    assert record is not None and record.cancel == "requested (HTTP 202)", record
    posts = provider.cancels("op-r")
    assert 2 <= posts <= 10, posts
    # Forwarded: never again, while lookups go on.
    looked = record.lookups
    eventually(
        "more lookups",
        lambda: (p := sdk.get("x").status.provider) is not None and p.lookups >= looked + 2,
        timeout=60,
    )
    assert provider.cancels("op-r") == posts
    assert sdk.get("x").status.settlement is None
    settled_ledger(sdk, "wf", reserved="20", available="0")


def test_a_provider_that_can_cancel_but_not_report_is_forwarded_once_and_never_polled(
    cluster: ClusterHandle,
    ns: str,
    operator: OperatorProcess,
    sdk: Reservoir,
    provider: ProviderServer,
) -> None:
    """Cancellation, no status lookup (client-disconnect.txt): the cancel is forwarded and
    recorded as requested; only a final report (or the deadline) settles the claim."""
    provider.script("op-n", answer("op-n", "Cancelled"))  # never asked: no supportsStatus
    create_envelope(
        cluster,
        ns,
        "wf",
        {"tokens": "20"},
        defaultLeaseSeconds=120,
        **http_policy(cluster, ns, provider),
    )
    upstream = {"operationId": "op-n", "supportsCancel": True}
    claim = sdk.hold("wf", "n", {"tokens": "20"}, name="x", dispatch=True, upstream=upstream)
    sdk.cancel(wait_phase(sdk, claim, "Committed"))
    claim = eventually(
        "the cancel forwarded",
        lambda: (
            (v := sdk.get("x")).status.provider is not None
            and v.status.provider.cancel_forwarded_at is not None
            and v
        ),
    )
    assert claim.condition("CancelRequested") and claim.status.settlement is None
    settled_ledger(sdk, "wf", reserved="20", available="0")
    sdk.finish(sdk.get("x"), {"tokens": "4"}, outcome="Cancelled")
    claim = settled(sdk, "x")
    settlement = claim.status.settlement
    assert settlement is not None
    assert (settlement.reason, settlement.outcome) == ("Completed", Outcome.CANCELLED)
    settled_ledger(sdk, "wf", committed="4", reserved="0", available="16")
    assert provider.cancels("op-n") == 1
    assert provider.lookups("op-n") == 0, "no status lookup without supportsStatus"


# --- 6. submitted, maybe running: a cancel keeps R until the provider says NeverStarted ----


def test_a_submitted_claim_keeps_its_capacity_on_cancel_until_the_provider_says_never_started(
    cluster: ClusterHandle,
    ns: str,
    operator: OperatorProcess,
    sdk: Reservoir,
    provider: ProviderServer,
) -> None:
    provider.script("op-s", answer("op-s", "Pending"))
    create_envelope(
        cluster,
        ns,
        "wf",
        {"tokens": "20"},
        defaultLeaseSeconds=120,
        **http_policy(cluster, ns, provider, cancel=False),
    )
    upstream = {"operationId": "op-s", "supportsStatus": True, "state": "Submitted"}
    claim = sdk.hold("wf", "sql", {"tokens": "20"}, name="x", upstream=upstream)
    assert not claim.spec.dispatch
    claim = wait_phase(sdk, claim, "Committed")
    assert ("Tentative", "Committed", "Submitted", "Worker") in moves(claim.status.history)

    sdk.cancel(claim)
    claim = sdk.wait("x", condition="CancelRequested", within=30)
    base = claim.status.provider.lookups if claim.status.provider is not None else 0
    eventually(
        "lookups after the cancel",
        lambda: (p := sdk.get("x").status.provider) is not None and p.lookups >= base + 2,
        timeout=60,
    )
    claim = sdk.get("x")
    assert claim.phase is ClaimPhase.COMMITTED and claim.status.settlement is None
    assert claim.status.provider is not None
    assert claim.status.provider.state is ProviderState.PENDING
    settled_ledger(sdk, "wf", reserved="20", committed="0", available="0")

    provider.script("op-s", answer("op-s", "NeverStarted"))
    claim = settled(sdk, "x", within=60)
    settlement = claim.status.settlement
    assert settlement is not None and settlement.reason == "ProviderNeverStarted", settlement
    assert claim.phase is ClaimPhase.RELEASED
    assert tokens(claim.status.consumed) == 0 and tokens(claim.status.released) == 20
    assert moves(claim.status.history)[-1] == (
        "Committed",
        "Released",
        "ProviderNeverStarted",
        "Provider",
    )
    settled_ledger(sdk, "wf", reserved="0", committed="0", available="20")
    assert provider.cancels("op-s") == 0, "the provider cannot cancel: nothing forwarded"


def test_a_submitted_claim_whose_lease_lapses_is_detached_not_expired(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    """Submitted without an acceptance is maybe running: a lapse holds R (Detached),
    where a claim that was never sent expires and returns it."""
    create_envelope(
        cluster,
        ns,
        "wf",
        {"tokens": "40"},
        defaultLeaseSeconds=SHORT_LEASE,
        atAmbiguityDeadline="Hold",
    )
    sdk.hold("wf", "s", {"tokens": "20"}, name="sent", upstream={"state": "Submitted"})
    sdk.hold("wf", "n", {"tokens": "20"}, name="never")
    claim = detached(sdk, "sent")
    assert ("Committed", "Detached", "LeaseLapsed", "Clock") in moves(claim.status.history)
    wait_phase(sdk, "never", "Expired")
    settled_ledger(sdk, "wf", reconciling="20", reserved="0", committed="0", available="20")


# --- 7. duplicate requestId ----------------------------------------------------------------


def test_a_second_claim_with_the_same_request_id_is_rejected_naming_the_first(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf1", {"tokens": "100"}, defaultLeaseSeconds=120)
    create_envelope(cluster, ns, "wf2", {"tokens": "100"}, defaultLeaseSeconds=120)
    first = sdk.hold("wf1", "a", {"tokens": "20"}, name="first", request_id="req-7")
    first = wait_phase(sdk, first, "Tentative")
    # The same submission retried by name is the same claim (hold is idempotent).
    again = sdk.hold("wf1", "a", {"tokens": "20"}, name="first", request_id="req-7")
    assert again.uid == first.uid

    # Another claim with the same key, in another envelope and in the same one: the SDK
    # refuses it before writing; written anyway (kubectl), the operator rejects it.
    for name, envelope in (("second", "wf2"), ("third", "wf1")):
        with pytest.raises(DuplicateRequestIdError):
            sdk.hold(envelope, "b", {"tokens": "20"}, name=name, request_id="req-7")
        raw = {
            "apiVersion": "reservoir.dev/v1alpha1",
            "kind": "BranchClaim",
            "metadata": {"name": name, "namespace": ns},
            "spec": {
                "envelope": envelope,
                "branch": "b",
                "requests": {"tokens": "20"},
                "upstream": {"requestId": "req-7"},
            },
        }
        cluster.kubectl("apply", "-f", "-", input=json.dumps(raw))
        claim = wait_phase(sdk, name, "Rejected")
        settlement = claim.status.settlement
        assert settlement is not None and settlement.reason == "DuplicateRequestId", settlement
        assert not claim.status.reserved
        messages = eventually(
            f"{name}'s rejection announced",
            lambda name=name: [
                m for r, m in events_with_messages(cluster, ns, name) if r == "DuplicateRequestId"
            ],
        )
        assert "'first'" in messages[0] and "req-7" in messages[0], messages

    first = sdk.get("first")
    assert first.phase is ClaimPhase.TENTATIVE and first.status.settlement is None
    settled_ledger(sdk, "wf1", reserved="20", available="80")
    settled_ledger(sdk, "wf2", reserved="0", available="100")


# --- 8. timeout-boundary races (client-disconnect.txt) -------------------------------------


def detached_at(claim: ClaimView) -> datetime:
    return next(t.at for t in claim.status.history if t.to is ClaimPhase.DETACHED)


def sleep_until(moment: datetime) -> None:
    time.sleep(max(0.0, (moment - datetime.now(UTC)).total_seconds()))


def test_a_final_report_just_before_the_ambiguity_deadline_settles_on_it(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(
        cluster,
        ns,
        "wf",
        {"tokens": "20"},
        defaultLeaseSeconds=SHORT_LEASE,
        ambiguityDeadlineSeconds=6,
        atAmbiguityDeadline="Quarantine",
    )
    sdk.hold("wf", "x", {"tokens": "20"}, name="x", dispatch=True)
    claim = detached(sdk, "x")
    deadline = detached_at(claim) + timedelta(seconds=6)
    sdk.finish(claim, {"tokens": "8"}, result="s3://bucket/x")
    claim = settled(sdk, "x")
    settlement = claim.status.settlement
    assert settlement is not None and settlement.at < deadline, (settlement, deadline)
    assert settlement.reason == "SettledAfterDetach", settlement
    assert tokens(claim.status.consumed) == 8 and tokens(claim.status.released) == 12
    settled_ledger(sdk, "wf", committed="8", reconciling="0", available="12")

    sleep_until(deadline + timedelta(seconds=1))  # the deadline passes: nothing more happens
    poke(cluster, ns, "x", 1)
    eventually("the poke seen", lambda: sdk.get("x").status.settlement is not None)
    claim = sdk.get("x")
    assert claim.status.settlement == settlement
    assert claim.status.adjustment is None
    assert [t.reason for t in claim.status.history][-1] == "SettledAfterDetach"
    assert totals(sdk, "wf")["committed"] == "8" and totals(sdk, "wf")["available"] == "12"


def test_a_final_report_just_after_a_quarantine_decision_is_adjusted_exactly_once(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(
        cluster,
        ns,
        "wf",
        {"tokens": "50"},
        defaultLeaseSeconds=SHORT_LEASE,
        ambiguityDeadlineSeconds=2,
        atAmbiguityDeadline="Quarantine",
    )
    sdk.hold("wf", "x", {"tokens": "20"}, name="x", dispatch=True)
    claim = settled(sdk, "x")
    quarantined = claim.status.settlement
    assert quarantined is not None and quarantined.reason == "AmbiguityDeadlineQuarantine"
    assert tokens(claim.status.consumed) == 20
    settled_ledger(sdk, "wf", committed="20", reconciling="0", available="30")

    # The worker comes back just after the decision with its final report: 6 used.
    patch_spec(cluster, ns, "x", {"usage": {"tokens": "6"}, "final": True, "outcome": "Succeeded"})
    claim = eventually(
        "the late completion adjusted",
        lambda: (v := sdk.get("x")).status.adjustment is not None and v,
    )
    adjustment = claim.status.adjustment
    assert adjustment is not None
    assert adjustment.applied and adjustment.outcome is Outcome.SUCCEEDED
    assert adjustment.returned == {"tokens": Decimal(14)} and not adjustment.charged, adjustment
    # The settlement itself never changes.
    assert claim.status.settlement == quarantined
    assert tokens(claim.status.consumed) == 20
    settled_ledger(sdk, "wf", committed="6", reserved="0", available="44")

    # Exactly once: whatever wakes the envelope again, the totals stay.
    for n in range(3):
        poke(cluster, ns, "x", n)
    other = sdk.hold("wf", "y", {"tokens": "5"}, name="y")
    sdk.cancel(wait_phase(sdk, other, "Tentative"))
    wait_phase(sdk, "y", "Released")
    claim = sdk.get("x")
    assert claim.status.adjustment == adjustment
    adjusted = [t for t in claim.status.history if t.reason == "LateCompletionAdjusted"]
    assert len(adjusted) == 1 and adjusted[0].trigger is Trigger.WORKER, claim.status.history
    assert claim.status.settlement == quarantined
    settled_ledger(sdk, "wf", committed="6", reserved="0", available="44")


def test_a_late_report_after_a_release_decision_is_charged_at_most_what_is_available(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(
        cluster,
        ns,
        "wf",
        {"tokens": "20"},
        defaultLeaseSeconds=3,
        ambiguityDeadlineSeconds=2,
        atAmbiguityDeadline="Release",
    )
    sdk.hold("wf", "x", {"tokens": "12"}, name="x", dispatch=True)
    patch_spec(cluster, ns, "x", {"usage": {"tokens": "2"}})  # a partial report, then silence
    claim = settled(sdk, "x")
    released = claim.status.settlement
    assert released is not None and released.reason == "AmbiguityDeadlineRelease", released
    assert tokens(claim.status.consumed) == 2 and tokens(claim.status.released) == 10
    settled_ledger(sdk, "wf", committed="2", reserved="0", available="18")
    # A child envelope draws 12 of the 18 back out (held while it is open).
    child = {
        "apiVersion": "reservoir.dev/v1alpha1",
        "kind": "ReservationEnvelope",
        "metadata": {"name": "sub", "namespace": ns},
        "spec": {"capacity": {"tokens": "12"}, "parent": "wf"},
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(child))
    settled_ledger(sdk, "wf", committed="2", reserved="12", available="6")

    # It used all 12 after all: 10 more is owed, only 6 is available.
    patch_spec(cluster, ns, "x", {"usage": {"tokens": "12"}, "final": True, "outcome": "Succeeded"})
    claim = eventually(
        "the late completion charged",
        lambda: (v := sdk.get("x")).status.adjustment is not None and v,
    )
    adjustment = claim.status.adjustment
    assert adjustment is not None and adjustment.applied, adjustment
    assert adjustment.charged == {"tokens": Decimal(6)} and not adjustment.returned, adjustment
    assert claim.status.settlement == released
    settled_ledger(sdk, "wf", committed="8", reserved="12", available="0")
    for n in range(3):
        poke(cluster, ns, "x", n)
    eventually("the pokes seen", lambda: sdk.get("x").status.adjustment is not None)
    assert sdk.get("x").status.adjustment == adjustment
    settled_ledger(sdk, "wf", committed="8", reserved="12", available="0")


def test_a_late_report_under_policy_record_is_recorded_and_moves_nothing(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(
        cluster,
        ns,
        "wf",
        {"tokens": "50"},
        defaultLeaseSeconds=SHORT_LEASE,
        ambiguityDeadlineSeconds=2,
        atAmbiguityDeadline="Quarantine",
        lateCompletion="Record",
    )
    sdk.hold("wf", "x", {"tokens": "20"}, name="x", dispatch=True)
    quarantined = settled(sdk, "x").status.settlement
    assert quarantined is not None and quarantined.reason == "AmbiguityDeadlineQuarantine"
    settled_ledger(sdk, "wf", committed="20", available="30")
    patch_spec(cluster, ns, "x", {"usage": {"tokens": "6"}, "final": True, "outcome": "Succeeded"})
    claim = eventually(
        "the late completion recorded",
        lambda: (v := sdk.get("x")).status.adjustment is not None and v,
    )
    adjustment = claim.status.adjustment
    assert adjustment is not None and not adjustment.applied, adjustment
    assert adjustment.returned == {"tokens": Decimal(14)}, adjustment
    assert moves(claim.status.history)[-1] == (
        "Consumed",
        "Consumed",
        "LateCompletionRecorded",
        "Worker",
    )
    assert claim.status.settlement == quarantined
    poke(cluster, ns, "x", 1)
    settled_ledger(sdk, "wf", committed="20", reserved="0", available="30")


def test_a_provider_answer_after_a_quarantine_decision_is_adjusted_once_and_polling_stops(
    cluster: ClusterHandle,
    ns: str,
    operator: OperatorProcess,
    sdk: Reservoir,
    provider: ProviderServer,
) -> None:
    provider.script("op-q", answer("op-q", "Running"))
    create_envelope(
        cluster,
        ns,
        "wf",
        {"tokens": "50"},
        defaultLeaseSeconds=SHORT_LEASE,
        ambiguityDeadlineSeconds=3,
        atAmbiguityDeadline="Quarantine",
        **http_policy(cluster, ns, provider),
    )
    upstream = {"operationId": "op-q", "supportsStatus": True}
    sdk.hold("wf", "x", {"tokens": "20"}, name="x", dispatch=True, upstream=upstream)
    claim = settled(sdk, "x", within=60)
    quarantined = claim.status.settlement
    assert quarantined is not None and quarantined.reason == "AmbiguityDeadlineQuarantine"
    settled_ledger(sdk, "wf", committed="20", reconciling="0", available="30")

    # Still running upstream: a settled claim waiting for a late answer is polled with the
    # same bounded backoff (at most every providerLookupMaxSeconds = 2 s, at least 1 s).
    start = provider.lookups("op-q")
    time.sleep(6)
    polled = provider.lookups("op-q") - start
    assert 1 <= polled <= 8, f"{polled} lookups in 6 s"

    provider.script("op-q", answer("op-q", "Succeeded", usage={"tokens": "5"}, result="s3://q"))
    claim = eventually(
        "the provider's late answer adjusted",
        lambda: (v := sdk.get("x")).status.adjustment is not None and v,
        timeout=60,
    )
    adjustment = claim.status.adjustment
    assert adjustment is not None and adjustment.applied, adjustment
    assert adjustment.returned == {"tokens": Decimal(15)} and not adjustment.charged, adjustment
    assert adjustment.outcome is Outcome.SUCCEEDED
    assert moves(claim.status.history)[-1] == (
        "Consumed",
        "Consumed",
        "LateCompletionAdjusted",
        "Provider",
    )
    assert claim.status.settlement == quarantined
    settled_ledger(sdk, "wf", committed="5", reserved="0", available="45")
    eventually("the result recorded", lambda: sdk.get("x").status.result == "s3://q")

    # Adjusted once, and nothing more to ask.
    asked = provider.lookups("op-q")
    time.sleep(4)
    assert provider.lookups("op-q") - asked <= 1, provider.lookups("op-q") - asked
    settled_ledger(sdk, "wf", committed="5", reserved="0", available="45")
    assert sdk.get("x").status.adjustment == adjustment


def test_a_final_report_after_a_force_settle_is_recorded_as_late_and_moves_nothing(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "20"}, defaultLeaseSeconds=120)
    claim = sdk.hold("wf", "x", {"tokens": "20"}, name="x", dispatch=True)
    claim = wait_phase(sdk, claim, "Committed")
    sdk.report_usage(claim, {"tokens": "4"})
    wait_phase(sdk, "x", "Running")
    cluster.kubectl(
        "annotate", "bclaim", "x", "-n", ns, "reservoir.dev/force-settle=OPS-11: worker lost"
    )
    claim = settled(sdk, "x")
    forced = claim.status.settlement
    assert forced is not None and forced.reason == "ForceSettled", forced
    assert tokens(claim.status.consumed) == 4
    settled_ledger(sdk, "wf", committed="4", reserved="0", available="16")

    patch_spec(cluster, ns, "x", {"usage": {"tokens": "10"}, "final": True, "outcome": "Succeeded"})
    claim = eventually(
        "the late report recorded",
        lambda: (v := sdk.get("x")).status.late is not None and v.status.late.count >= 1 and v,
    )
    assert claim.status.late is not None and claim.status.late.count == 1
    assert claim.condition("LateReport")
    assert claim.status.adjustment is None, "a person's decision is not adjusted"
    assert claim.status.settlement == forced
    for n in range(2):
        poke(cluster, ns, "x", n)
    eventually("the pokes seen", lambda: sdk.get("x").status.late is not None)
    claim = sdk.get("x")
    assert claim.status.adjustment is None and claim.status.late is not None
    assert claim.status.late.count == 1
    settled_ledger(sdk, "wf", committed="4", reserved="0", available="16")


# --- 9. the history outlives operator restarts and Events ---------------------------------


def test_the_history_survives_an_operator_restart_and_event_expiry(
    cluster: ClusterHandle, ns: str, start_operator: StartOperator, sdk: Reservoir
) -> None:
    operator = start_operator()
    # Long enough a lease for the usage report to come before it lapses.
    create_envelope(
        cluster, ns, "wf", {"tokens": "20"}, defaultLeaseSeconds=6, atAmbiguityDeadline="Hold"
    )
    claim = sdk.hold("wf", "x", {"tokens": "20"}, name="x", dispatch=True)
    claim = wait_phase(sdk, claim, "Committed")
    sdk.report_usage(claim, {"tokens": "3"})
    wait_phase(sdk, "x", "Running")
    claim = detached(sdk, "x")
    before = claim.status.history
    assert moves(before) == [
        ("Pending", "Tentative", "Reserved", "Admission"),
        ("Tentative", "Committed", "CommitPointReached", "Worker"),
        ("Committed", "Running", "ExecutionStarted", "Worker"),
        ("Running", "Detached", "LeaseLapsed", "Clock"),
    ], moves(before)
    assert [t.at for t in before] == sorted(t.at for t in before)

    operator.kill()  # no clean-up, no last writes
    operator = start_operator()
    poke(cluster, ns, "x", 1)
    sdk.finish(sdk.get("x"), {"tokens": "11"})
    claim = settled(sdk, "x")
    after = claim.status.history
    assert after[: len(before)] == before, "nothing earlier lost or rewritten"
    assert moves(after[len(before) :]) == [("Detached", "Consumed", "SettledAfterDetach", "Worker")]

    # Another restart and more wake-ups add nothing.
    operator.stop()
    start_operator()
    poke(cluster, ns, "x", 2)
    settled_ledger(sdk, "wf", committed="11", reserved="0", reconciling="0", available="9")
    assert sdk.get("x").status.history == after

    # Events expire; the history does not depend on them.
    assert events_of(cluster, ns, "x"), "Events were posted"
    cluster.kubectl(
        "delete", "events", "-n", ns, "--field-selector", "involvedObject.name=x", "--wait=true"
    )
    eventually("the Events gone", lambda: not events_of(cluster, ns, "x"))
    assert sdk.history("x") == after
    assert sdk.get("x").status.history == after


# --- 10. retry windows ---------------------------------------------------------------------


def failed_attempt(sdk: Reservoir, window: int) -> ClaimView:
    """Attempt 1 of branch b: 20 tokens, dispatched, failed having used 5."""
    claim = sdk.hold(
        "wf",
        "b",
        {"tokens": "20"},
        name="a1",
        attempt=1,
        dispatch=True,
        retry_window_seconds=window,
    )
    claim = wait_phase(sdk, claim, "Committed")
    sdk.finish(claim, {"tokens": "5"}, outcome="Failed")
    claim = settled(sdk, "a1")
    settlement = claim.status.settlement
    assert settlement is not None and settlement.outcome is Outcome.FAILED
    assert tokens(claim.status.consumed) == 5 and tokens(claim.status.released) == 15
    return claim


def created_at(cluster: ClusterHandle, ns: str, claim: str) -> datetime:
    stamp = cluster.kubectl(
        "get", "bclaim", claim, "-n", ns, "-o", "jsonpath={.metadata.creationTimestamp}"
    )
    return datetime.fromisoformat(stamp.strip().replace("Z", "+00:00"))


def test_a_failed_attempt_keeps_its_balance_for_the_next_attempt(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "30"}, defaultLeaseSeconds=120)
    failed_attempt(sdk, window=60)
    claim = eventually(
        "the retry hold mirrored", lambda: (v := sdk.get("a1")).status.retry is not None and v
    )
    hold = claim.status.retry
    assert hold is not None and hold.resources == {"tokens": Decimal(15)}
    assert hold.taken_by is None and not hold.returned
    settled_ledger(sdk, "wf", committed="5", reserved="15", available="10")

    # Another branch cannot use what the failed attempt keeps.
    other = sdk.hold("wf", "other", {"tokens": "12"}, name="other")
    other = eventually(
        "the other branch waiting",
        lambda: (v := sdk.get("other")).status.queue_reason is not None and v,
    )
    assert other.phase is ClaimPhase.PENDING
    assert other.status.queue_reason is not None
    assert "InsufficientCapacity" in other.status.queue_reason, other.status.queue_reason

    # The next attempt of the same branch, created after the other branch queued (the
    # queue orders by creation time, to the second), takes it: 15 kept + 5 of the 10
    # available. The other branch waiting ahead of it does not block it.
    sleep_until(created_at(cluster, ns, "other") + timedelta(seconds=1.1))
    retry = sdk.hold("wf", "b", {"tokens": "20"}, name="a2", attempt=2)
    wait_phase(sdk, retry, "Tentative")
    claim = eventually(
        "the hold taken",
        lambda: (v := sdk.get("a1")).status.retry is not None and v.status.retry.taken_by and v,
    )
    assert claim.status.retry is not None and claim.status.retry.taken_by == "a2"
    settled_ledger(sdk, "wf", committed="5", reserved="20", available="5")
    assert sdk.get("other").phase is ClaimPhase.PENDING


def test_a_retry_window_that_closes_returns_the_held_balance(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "30"}, defaultLeaseSeconds=120)
    failed_attempt(sdk, window=3)
    claim = eventually(
        "the window closed",
        lambda: (v := sdk.get("a1")).status.retry is not None and v.status.retry.returned and v,
    )
    assert claim.status.retry is not None and claim.status.retry.taken_by is None
    settled_ledger(sdk, "wf", committed="5", reserved="0", available="25")
    # A late next attempt finds nothing kept for it: it takes from what is available.
    retry = sdk.hold("wf", "b", {"tokens": "20"}, name="a2", attempt=2)
    wait_phase(sdk, retry, "Tentative")
    assert sdk.get("a1").status.retry == claim.status.retry
    settled_ledger(sdk, "wf", committed="5", reserved="20", available="5")


def test_an_accepted_operation_never_started_is_cancelled_at_its_queue_bound(
    cluster: ClusterHandle,
    ns: str,
    operator: OperatorProcess,
    sdk: Reservoir,
    provider: ProviderServer,
) -> None:
    """Issue 24 (lease-renewal.txt: "Accepted but not started ... Apply an explicit
    provider-queue policy rather than treating acceptance as execution"): accepted and still
    queued at the envelope's bound, the operation is cancelled (forwarded once), and the
    claim settles on the provider's answer, never on the clock alone."""
    provider.script("op-q", answer("op-q", "Pending"))
    create_envelope(
        cluster,
        ns,
        "wf",
        {"tokens": "20"},
        defaultLeaseSeconds=120,
        queueBoundSeconds=4,
        atQueueBound="Cancel",
        **http_policy(cluster, ns, provider),
    )
    upstream = {"operationId": "op-q", "supportsStatus": True, "supportsCancel": True}
    claim = sdk.hold("wf", "sql", {"tokens": "20"}, name="q", upstream=upstream, dispatch=True)
    claim = wait_phase(sdk, claim, "Committed")
    line = ledger_line(sdk, claim)
    assert line is not None and line.accepted_at is None, "dispatched, not yet accepted"
    patch_spec(cluster, ns, "q", {"upstream": {"state": "Accepted"}})
    line = eventually(
        "the acceptance recorded",
        lambda: (found := ledger_line(sdk, "q")) is not None and found.accepted_at and found,
    )
    assert line.committed_at is not None and line.accepted_at > line.committed_at
    assert line.started_at is None, "accepted is not started"

    claim = sdk.wait("q", condition="CancelRequested", within=30)
    line = ledger_line(sdk, claim)
    assert line is not None and line.queue_bound_at is not None
    assert "QueueBoundReached" in events_of(cluster, ns, "q")
    eventually("the cancel forwarded", lambda: provider.cancels("op-q") == 1, timeout=30)
    assert sdk.get("q").phase is ClaimPhase.COMMITTED, "held until the provider answers"
    settled_ledger(sdk, "wf", reserved="20", available="0")

    provider.script("op-q", answer("op-q", "NeverStarted"))
    claim = settled(sdk, "q", within=60)
    assert claim.phase is ClaimPhase.RELEASED
    assert claim.status.settlement is not None
    assert claim.status.settlement.reason == "ProviderNeverStarted"
    settled_ledger(sdk, "wf", reserved="0", committed="0", available="20")
    assert provider.cancels("op-q") == 1, "forwarded once"
