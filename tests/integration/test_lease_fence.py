"""Fencing enforced by the API server (reservoir.lease_fence_rules), not only by the SDK: a
raw `kubectl patch` by a stale worker is refused, and the refusal says why.

lease-renewal.txt: writes are "conditional on the attempt ID, lease version, and ownership
token"; "the old owner should be fenced from further dispatch". child-settlement.txt:
workers "present the current lease generation when reporting usage"; "Released or
superseded attempts cannot start new work"."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from reservoir.sdk import Reservoir, StaleClaimError
from tests.clusters import ClusterHandle
from tests.integration.conftest import OperatorProcess
from tests.integration.helpers import create_envelope, eventually, settled_ledger, wait_phase


def fenced(holder: str, generation: int, **spec: Any) -> dict[str, Any]:
    return {**spec, "lease": {"fence": {"holder": holder, "generation": generation}}}


def refusal(cluster: ClusterHandle, ns: str, name: str, spec: dict[str, Any]) -> str:
    """The API server's refusal of a merge patch of the claim's spec ('' if applied)."""
    try:
        cluster.kubectl(
            "patch", "bclaim", name, "-n", ns, "--type=merge", "-p", json.dumps({"spec": spec})
        )
    except RuntimeError as error:
        return str(error)
    return ""


def lease_of(cluster: ClusterHandle, ns: str, name: str) -> dict[str, Any]:
    found = cluster.kubectl("get", "bclaim", name, "-n", ns, "-o", "jsonpath={.status.lease}")
    return json.loads(found) if found else {}


def test_no_fence_a_stale_holder_and_an_old_generation_are_refused(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=120)
    claim = wait_phase(sdk, sdk.hold("wf", "x", {"tokens": "30"}, name="x"), "Tentative")
    me = sdk.holder
    assert lease_of(cluster, ns, "x") == {"holder": me, "generation": 1, "renewals": 0}

    told = refusal(cluster, ns, "x", {"dispatch": True})
    assert "no spec.lease.fence, but the lease is" in told, told
    told = refusal(cluster, ns, "x", fenced("w-stale", 1, dispatch=True))
    assert f'{{holder: "w-stale", generation: 1}}, but the lease is {{holder: "{me}"' in told

    sdk.renew(claim)  # generation 2: a write made under generation 1 is stale
    assert lease_of(cluster, ns, "x")["generation"] == 2
    told = refusal(cluster, ns, "x", fenced(me, 1, dispatch=True))
    assert f'{{holder: "{me}", generation: 2}} (status.lease)' in told, told
    assert not sdk.get(claim).spec.dispatch, "nothing of a refused write is applied"

    assert refusal(cluster, ns, "x", fenced(me, 2, dispatch=True)) == ""
    wait_phase(sdk, claim, "Committed")
    # The fence stays in the spec: the same worker's next report, under the same lease, is
    # not asked for it again.
    assert refusal(cluster, ns, "x", {"usage": {"tokens": "5"}}) == ""
    sdk.finish(sdk.get(claim), {"tokens": "12"})
    settled_ledger(sdk, "wf", committed="12", available="88", reserved="0")


def test_a_settled_claim_is_never_dispatched_and_an_uncommitted_one_reports_nothing(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=3)
    sdk.hold("wf", "tentative", {"tokens": "20"}, name="t")
    expiring = sdk.hold("wf", "expiring", {"tokens": "30"}, name="e")
    wait_phase(sdk, "t", "Tentative")
    fence = lease_of(cluster, ns, "t")
    told = refusal(
        cluster, ns, "t", fenced(fence["holder"], fence["generation"], usage={"tokens": "1"})
    )
    assert "has not reached its commit point (phase Tentative)" in told, told
    told = refusal(
        cluster,
        ns,
        "t",
        fenced(fence["holder"], fence["generation"], upstream={"state": "Accepted"}),
    )
    assert "has not reached its commit point" in told, told

    wait_phase(sdk, expiring, "Expired", within=30)
    fence = lease_of(cluster, ns, "e")
    told = refusal(cluster, ns, "e", fenced(fence["holder"], fence["generation"], dispatch=True))
    assert "the claim already settled (Expired)" in told, told
    view = sdk.get(expiring)
    assert not view.spec.dispatch and not view.condition("DispatchRefused"), "never written"


def test_a_lease_handed_to_another_worker_fences_the_old_one_at_once(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=120)
    old_view = wait_phase(sdk, sdk.hold("wf", "x", {"tokens": "30"}, name="x"), "Tentative")
    old = sdk.holder
    hand_to(cluster, ns, "x", "w-new")
    told = refusal(cluster, ns, "x", fenced(old, 1, dispatch=True))
    assert re.search(r'being handed to "w-new"|lease is \{holder: "w-new", generation: 2\}', told)
    with pytest.raises(StaleClaimError, match="held by 'w-new'"):
        sdk.dispatch(sdk.get(old_view))
    # The operator records the handover: a new generation, the new holder's at once.
    eventually("the handover recorded", lambda: lease_of(cluster, ns, "x")["holder"] == "w-new")
    assert lease_of(cluster, ns, "x")["generation"] == 2

    with Reservoir(namespace=ns, kubeconfig=str(cluster.kubeconfig_path), holder="w-new") as new:
        new.dispatch(new.get("x"))
        wait_phase(new, "x", "Committed")
        new.renew(new.get("x"))  # its heartbeat takes the Lease over: the claim names it
    told = refusal(cluster, ns, "x", fenced(old, 2, usage={"tokens": "3"}))
    assert 'but the lease is {holder: "w-new", generation: 3}' in told, told
    eventually("the claim still committed", lambda: sdk.get("x").phase == "Committed")


def test_a_detached_claim_handed_to_a_reconciler_settles_on_its_report(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    """Found by review: the worker dispatched and went away (Detached: no renewal is granted
    any more); handed to a reconciler, the claim takes its final report, which no fence
    could carry before the handover was recorded without a renewal."""
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=3)
    claim = sdk.hold("wf", "x", {"tokens": "30"}, name="x", dispatch=True)
    wait_phase(sdk, claim, "Detached", within=30)
    hand_to(cluster, ns, "x", "reconciler")
    eventually("the handover", lambda: lease_of(cluster, ns, "x").get("holder") == "reconciler")
    with Reservoir(
        namespace=ns, kubeconfig=str(cluster.kubeconfig_path), holder="reconciler"
    ) as reconciler:
        reconciler.finish(reconciler.get("x"), {"tokens": "7"})
        wait_phase(reconciler, "x", "Consumed")
    settled_ledger(sdk, "wf", committed="7", available="93", reserved="0")


def hand_to(cluster: ClusterHandle, ns: str, name: str, holder: str) -> None:
    """The orchestrator hands the claim's lease to another worker (its spec names it)."""
    patch = json.dumps({"spec": {"lease": {"holder": holder}}})
    cluster.kubectl("patch", "bclaim", name, "-n", ns, "--type=merge", "-p", patch)
