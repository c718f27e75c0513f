"""The SDK's fencing against the real API server and operator: every verb decides on the
claim's own record (its ledger line when it carries one, else its status) and sends one
patch whose tests refuse it if the claim moved; a refusal is decided again on the claim
as it is now. Renewals are fenced by holder identity, in the SDK and in the operator."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

import pytest

from reservoir.sdk import (
    ClaimView,
    LeaseUncertainError,
    NotReservedError,
    Reservoir,
    StaleClaimError,
)
from reservoir.sdk.client import LEASE_SAFETY_MARGIN
from tests.clusters import ClusterHandle
from tests.integration.conftest import OperatorProcess, StartOperator
from tests.integration.helpers import (
    create_envelope,
    events_of,
    eventually,
    ledger_line,
    make_claim,
    settled_ledger,
    wait_phase,
)

TEST_FINALIZER = "test.reservoir.dev/keep"


def lease_of(cluster: ClusterHandle, ns: str, name: str) -> dict[str, Any] | None:
    found = cluster.kubectl("get", "lease", name, "-n", ns, "--ignore-not-found", "-o", "json")
    return json.loads(found) if found.strip() else None


def beat_as(cluster: ClusterHandle, ns: str, claim: ClaimView, holder: str) -> None:
    """A heartbeat on the claim's Lease from `holder`, written by hand (created if
    missing, else updated as that holder)."""
    body = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": claim.name,
            "namespace": ns,
            "labels": {
                "reservoir.dev/envelope": claim.spec.envelope,
                "reservoir.dev/claim": claim.name,
            },
            "ownerReferences": [
                {
                    "apiVersion": "reservoir.dev/v1alpha1",
                    "kind": "BranchClaim",
                    "name": claim.name,
                    "uid": claim.uid,
                }
            ],
        },
        "spec": {
            "holderIdentity": holder,
            "renewTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "leaseTransitions": 3,
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))


def finalizers(cluster: ClusterHandle, ns: str, name: str) -> list[str]:
    out = cluster.kubectl("get", "bclaim", name, "-n", ns, "-o", "jsonpath={.metadata.finalizers}")
    return list(json.loads(out)) if out.strip() else []


def set_finalizers(cluster: ClusterHandle, ns: str, name: str, names: list[str]) -> None:
    patch = json.dumps({"metadata": {"finalizers": names}})
    cluster.kubectl("patch", "bclaim", name, "-n", ns, "--type=merge", "-p", patch)


def test_a_stale_view_dispatches_only_while_the_ledger_lease_holds(
    cluster: ClusterHandle, ns: str, start_operator: StartOperator, sdk: Reservoir
) -> None:
    """Both views are read at creation (Pending, no status, an old resourceVersion): each
    dispatch must decide on the claim's record as it is now."""
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=120)
    fine = sdk.hold("wf", "fine", {"tokens": "30"}, name="fine")
    lapsing = sdk.hold("wf", "lapsing", {"tokens": "30"}, name="lapsing", lease_seconds=6)
    operator = start_operator()
    wait_phase(sdk, fine, "Tentative")
    wait_phase(sdk, lapsing, "Tentative")

    dispatched = sdk.dispatch(fine)  # re-read: every check holds on the current claim
    assert dispatched.spec.dispatch and dispatched.resource_version != fine.resource_version

    # Nobody expires the claim now: its record stays Tentative past its lease end.
    operator.stop()
    record = sdk.get(lapsing)
    expires = record.ledger_expires_at
    assert record.ledger_phase == "Tentative" and expires is not None
    lapse = (expires - LEASE_SAFETY_MARGIN - datetime.now(UTC)).total_seconds()
    time.sleep(max(lapse, 0) + 0.5)
    with pytest.raises(LeaseUncertainError, match="lease expires"):
        sdk.dispatch(lapsing)
    assert not sdk.get(lapsing).spec.dispatch, "nothing was written"


def test_dispatch_of_a_claim_that_holds_nothing_is_refused(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=120)
    big = wait_phase(sdk, sdk.hold("wf", "big", {"tokens": "80"}, name="big"), "Tentative")
    queued = sdk.hold("wf", "queued", {"tokens": "50"}, name="queued")
    eventually("a queue reason", lambda: sdk.get(queued).status.queue_reason)
    queued = sdk.get(queued)
    assert queued.ledger_phase == "Pending" and queued.entry is None

    with pytest.raises(NotReservedError, match="holds nothing yet"):
        sdk.dispatch(queued)
    assert not sdk.get(queued).spec.dispatch, "nothing was written"

    sdk.cancel(big)
    queued = wait_phase(sdk, queued, "Tentative")
    assert sdk.dispatch(queued).spec.dispatch
    wait_phase(sdk, queued, "Committed")
    settled_ledger(sdk, "wf", reserved="50", available="50")


def test_a_claim_being_deleted_is_neither_dispatched_nor_renewed_nor_charged(
    cluster: ClusterHandle, ns: str, start_operator: StartOperator, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=120)
    operator = start_operator()
    seen = wait_phase(sdk, sdk.hold("wf", "x", {"tokens": "30"}, name="x"), "Tentative")
    # The operator has not seen the deletion yet (it is stopped), so the ledger still
    # shows the claim Tentative with a good lease: only deletionTimestamp tells.
    operator.stop()
    set_finalizers(cluster, ns, "x", [*finalizers(cluster, ns, "x"), TEST_FINALIZER])
    cluster.kubectl("delete", "bclaim", "x", "-n", ns, "--wait=false")
    current = sdk.get("x")
    assert current.deleting and current.ledger_phase == "Tentative"

    with pytest.raises(StaleClaimError, match="being deleted"):
        sdk.dispatch(seen)  # a view from before the deletion
    with pytest.raises(StaleClaimError, match="being deleted"):
        sdk.dispatch(current)
    with pytest.raises(StaleClaimError, match="being deleted"):
        sdk.renew(seen)
    assert lease_of(cluster, ns, "x") is None, "no heartbeat was written"
    with pytest.raises(StaleClaimError, match="deleted before it was dispatched"):
        sdk.report_usage(seen, {"tokens": "1"})
    cancelled = sdk.cancel(seen)  # deletion already cancels it: nothing to write
    assert cancelled.deleting and not cancelled.spec.cancel
    assert not sdk.get("x").spec.dispatch

    set_finalizers(
        cluster, ns, "x", [f for f in finalizers(cluster, ns, "x") if f != TEST_FINALIZER]
    )
    start_operator()
    eventually(
        "the claim to go",
        lambda: not cluster.kubectl("get", "bclaim", "x", "-n", ns, "--ignore-not-found"),
    )
    settled_ledger(sdk, "wf", reserved="0", committed="0", available="100")


def test_renew_never_takes_over_a_lease_another_holder_holds(
    cluster: ClusterHandle, ns: str, sdk: Reservoir
) -> None:
    """No operator: only the SDK's own fencing is at work. A claim that names no holder:
    another worker's Lease is never taken over. A claim that names this worker (it was
    handed the lease): its Lease follows the claim, one transition more."""
    create_envelope(cluster, ns, "wf", {"tokens": "100"})
    make_claim(cluster, ns, "x")
    claim = sdk.get("x")
    assert claim.spec.lease.holder is None
    beat_as(cluster, ns, claim, "someone-else")
    before = lease_of(cluster, ns, "x")
    assert before is not None

    with pytest.raises(LeaseUncertainError, match="held by 'someone-else'"):
        sdk.renew(claim, confirm_timeout=1)
    after = lease_of(cluster, ns, "x")
    assert after is not None
    assert after["spec"] == before["spec"]
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]

    named = sdk.hold("wf", "y", {"tokens": "10"}, name="y")
    beat_as(cluster, ns, named, "someone-else")
    with pytest.raises(LeaseUncertainError, match="not confirmed"):  # no operator to grant
        sdk.renew(named, confirm_timeout=1)
    taken = lease_of(cluster, ns, "y")
    assert taken is not None and taken["spec"]["holderIdentity"] == sdk.holder
    assert taken["spec"]["leaseTransitions"] == 4


def test_the_operator_grants_no_renewal_to_a_heartbeat_from_another_holder(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=60)
    claim = wait_phase(sdk, sdk.hold("wf", "x", {"tokens": "10"}, name="x"), "Tentative")
    assert claim.spec.lease.holder == sdk.holder
    granted = ledger_line(sdk, claim)
    assert granted is not None and granted.renewals == 0

    beat_as(cluster, ns, claim, "intruder")
    eventually("RenewalRefused", lambda: "RenewalRefused" in events_of(cluster, ns, "x"))
    time.sleep(1.1)  # a second heartbeat, with another renewTime
    beat_as(cluster, ns, claim, "intruder")
    time.sleep(2)
    entry = ledger_line(sdk, claim)
    assert entry is not None
    assert entry.renewals == 0 and entry.expires_at == granted.expires_at, "nothing granted"

    # The holder the claim names takes its Lease back (the claim says whose it is), and
    # its renewal is granted; another worker's SDK may neither renew nor dispatch it.
    renewed = sdk.renew(claim, confirm_timeout=10)
    line = ledger_line(sdk, renewed)
    assert line is not None and line.renewals == 1 and line.holder == sdk.holder
    with Reservoir(
        namespace=ns, kubeconfig=str(cluster.kubeconfig_path), holder="intruder"
    ) as other:
        with pytest.raises(StaleClaimError, match="held by"):
            other.renew(other.get("x"), confirm_timeout=2)
        with pytest.raises(StaleClaimError, match="held by"):
            other.dispatch(other.get("x"))
    assert not sdk.get(claim).spec.dispatch


def test_a_view_of_an_earlier_claim_of_the_same_name_is_fenced(
    cluster: ClusterHandle, ns: str, sdk: Reservoir
) -> None:
    """No operator: the claim's finalizer (which the operator would remove at once, as the
    claim never reserved anything) is removed by hand."""
    create_envelope(cluster, ns, "wf", {"tokens": "100"})
    earlier = sdk.hold("wf", "x", {"tokens": "10"}, name="x")
    cluster.kubectl("delete", "bclaim", "x", "-n", ns, "--wait=false")
    set_finalizers(cluster, ns, "x", [])
    cluster.kubectl("wait", "--for=delete", "bclaim/x", "-n", ns, "--timeout=60s")
    retry = sdk.hold("wf", "x", {"tokens": "10"}, name="x", attempt=2)
    assert retry.uid != earlier.uid

    with pytest.raises(StaleClaimError, match="different claim"):
        sdk.renew(earlier, confirm_timeout=1)
    assert lease_of(cluster, ns, "x") is None, "no heartbeat for the new claim"
    with pytest.raises(StaleClaimError, match="different claim"):
        sdk.dispatch(earlier)
    with pytest.raises(StaleClaimError, match="different claim"):
        sdk.report_usage(earlier, {"tokens": "1"})
    with pytest.raises(StaleClaimError, match="different claim"):
        sdk.cancel(earlier)
    current = sdk.get("x")
    assert current.spec.attempt == 2 and not current.spec.cancel and not current.spec.usage
