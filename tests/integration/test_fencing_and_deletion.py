"""Races, fencing, bad reports and deletion, against the real operator."""

from __future__ import annotations

import json
from typing import Any

import pytest

from reservoir.sdk import Reservoir, ReservoirError, StaleClaimError
from reservoir.sdk.patches import lease_fence
from tests.clusters import ClusterHandle
from tests.integration.conftest import OperatorProcess
from tests.integration.helpers import (
    committed_claim,
    create_envelope,
    events_of,
    eventually,
    settled_ledger,
    wait_phase,
)

FINAL_5 = {"usage": {"tokens": "5"}, "final": True, "outcome": "Succeeded"}


def claim_of(cluster: ClusterHandle, ns: str, name: str = "x") -> dict[str, Any]:
    return json.loads(cluster.kubectl("get", "bclaim", name, "-n", ns, "-o", "json"))


def exists(cluster: ClusterHandle, ns: str, kind: str, name: str) -> bool:
    found = cluster.kubectl("get", kind, name, "-n", ns, "--ignore-not-found", "-o", "name")
    return bool(found.strip())


def test_cancel_racing_dispatch_fences_the_loser(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=120)
    claim = wait_phase(sdk, sdk.hold("wf", "x", {"tokens": "30"}, name="x"), "Tentative")
    seen_by_dispatcher = claim  # both read the same version
    sdk.cancel(claim)  # the orchestrator prunes first
    with pytest.raises(StaleClaimError, match=r"cancelled|settled"):
        sdk.dispatch(seen_by_dispatcher)
    wait_phase(sdk, claim, "Released")
    settled_ledger(sdk, "wf", reserved="0", available="100", committed="0")


def test_a_stale_worker_gets_a_409_and_then_a_stale_claim_error(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    claim = committed_claim(cluster, ns, sdk)
    old_worker_view = claim
    sdk.finish(sdk.get(claim), {"tokens": "10"})  # the new worker settles it
    wait_phase(sdk, claim, "Consumed")
    with pytest.raises(StaleClaimError, match="settled as Consumed"):
        sdk.report_usage(old_worker_view, {"tokens": "25"})
    settled_ledger(sdk, "wf", committed="10", available="90")


def test_duplicated_and_out_of_order_usage_reports_change_nothing_twice(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    claim = committed_claim(cluster, ns, sdk)
    for _ in range(3):  # the same cumulative report, delivered three times
        claim = sdk.report_usage(sdk.get(claim), {"tokens": "10"})
    eventually("usage 10", lambda: str(sdk.get(claim).status.usage.get("tokens")) == "10")
    with pytest.raises(ReservoirError, match="cumulative"):  # an older report, late
        sdk.report_usage(sdk.get(claim), {"tokens": "7"})
    assert str(sdk.get(claim).spec.usage["tokens"]) == "10", "nothing recorded is lost"
    sdk.finish(sdk.get(claim), {"tokens": "12"})
    settled_ledger(sdk, "wf", committed="12", available="88", reserved="0")


def test_usage_above_the_reservation_is_recorded_as_an_overrun(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    claim = committed_claim(cluster, ns, sdk)
    sdk.report_usage(claim, {"tokens": "45"})
    view = eventually("Overrun", lambda: sdk.get(claim).condition("Overrun") and sdk.get(claim))
    assert view.status.overrun is not None
    assert str(view.status.overrun.usage["tokens"]) == "45"  # the report is preserved
    assert "Overrun" in events_of(cluster, ns, "x")
    settled_ledger(sdk, "wf", reserved="30", committed="0", available="70")  # not overdrawn


def test_a_dispatch_after_expiry_is_refused_and_recorded(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=2)
    claim = sdk.hold("wf", "x", {"tokens": "30"}, name="x")
    wait_phase(sdk, claim, "Expired", within=20)
    with pytest.raises(StaleClaimError, match="Expired"):
        sdk.dispatch(sdk.get(claim))
    # A worker that bypasses the SDK is refused by the API server, with the lease it was
    # granted or without: nothing of it is recorded, and the claim stays Expired.
    lease = json.loads(
        cluster.kubectl("get", "bclaim", "x", "-n", ns, "-o", "jsonpath={.status.lease}")
    )
    fence = {"holder": lease["holder"], "generation": lease["generation"]}
    for spec in ({"dispatch": True}, {"dispatch": True, "lease": {"fence": fence}}):
        with pytest.raises(RuntimeError, match=r"already settled|spec\.lease\.fence"):
            cluster.kubectl(
                "patch", "bclaim", "x", "-n", ns, "--type=merge", "-p", json.dumps({"spec": spec})
            )
    assert not sdk.get(claim).spec.dispatch and sdk.get(claim).phase == "Expired"
    settled_ledger(sdk, "wf", reserved="0", available="100")


def test_deleting_claims_never_loses_or_double_returns_capacity(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=120)
    tentative = wait_phase(sdk, sdk.hold("wf", "t", {"tokens": "30"}, name="t"), "Tentative")
    running = sdk.hold("wf", "r", {"tokens": "30"}, name="r", dispatch=True)
    running = sdk.report_usage(wait_phase(sdk, running, "Committed"), {"tokens": "4"})

    cluster.kubectl("delete", "bclaim", "t", "r", "-n", ns, "--wait=false")
    eventually("the tentative claim to go", lambda: not exists(cluster, ns, "bclaim", "t"))
    settled_ledger(sdk, "wf", reserved="30", available="70")
    # The committed claim waits for its facts: still there, capacity still held.
    deleting = eventually(
        "DeletionBlocked",
        lambda: sdk.get(running).condition("DeletionBlocked") and sdk.get(running),
    )
    assert deleting.condition("CancelRequested")
    assert deleting.phase in ("Committed", "Running")
    eventually(
        "an AwaitingSettlement Event", lambda: "AwaitingSettlement" in events_of(cluster, ns, "r")
    )
    assert exists(cluster, ns, "bclaim", "r")

    sdk.finish(sdk.get(running), {"tokens": "9"})
    eventually("the settled claim to go", lambda: not exists(cluster, ns, "bclaim", "r"))
    settled_ledger(sdk, "wf", committed="9", reserved="0", available="91")
    assert tentative.name not in [e.claim for e in sdk.ledger("wf").status.entries.values()]


def test_deleting_an_envelope_cancels_its_children_first(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=120)
    wait_phase(sdk, sdk.hold("wf", "t", {"tokens": "30"}, name="t"), "Tentative")
    running = wait_phase(
        sdk, sdk.hold("wf", "r", {"tokens": "30"}, name="r", dispatch=True), "Committed"
    )
    cluster.kubectl("delete", "renv", "wf", "-n", ns, "--wait=false")
    wait_phase(sdk, "t", "Released")
    eventually(
        "the committed child to be asked to cancel",
        lambda: sdk.get(running).condition("CancelRequested"),
    )
    assert exists(cluster, ns, "renv", "wf"), "the envelope waits for its committed child"

    sdk.finish(sdk.get(running), {"tokens": "11"}, outcome="Cancelled")
    eventually("the envelope to go", lambda: not exists(cluster, ns, "renv", "wf"), timeout=60)
    eventually(
        "its claims to be collected",
        lambda: not exists(cluster, ns, "bclaim", "t") and not exists(cluster, ns, "bclaim", "r"),
        timeout=60,
    )


def test_force_settle_annotation_unsticks_a_claim_and_is_audited(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    claim = committed_claim(cluster, ns, sdk)
    sdk.report_usage(claim, {"tokens": "6"})
    cluster.kubectl("delete", "bclaim", "x", "-n", ns, "--wait=false")
    wait_phase(sdk, claim, "Running")
    assert exists(cluster, ns, "bclaim", "x"), "held back by its finalizer"
    cluster.kubectl(
        "annotate",
        "bclaim",
        "x",
        "-n",
        ns,
        "reservoir.dev/force-settle=OPS-7: worker node lost, provider billed 6",
    )
    eventually("the claim to go", lambda: not exists(cluster, ns, "bclaim", "x"))
    settled_ledger(sdk, "wf", committed="6", reserved="0", available="94")
    reasons = events_of(cluster, ns, "x")
    assert "ForceSettled" in reasons


def test_kubectl_wait_and_get_work_on_claims(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=120)
    sdk.hold("wf", "x", {"tokens": "30"}, name="x", dispatch=True)
    cluster.kubectl("wait", "-n", ns, "--for=condition=Committed", "bclaim/x", "--timeout=30s")
    cluster.kubectl(
        "wait", "-n", ns, "--for=jsonpath={.status.phase}=Committed", "bclaim/x", "--timeout=30s"
    )
    table = cluster.kubectl("get", "reservoir", "-n", ns)
    assert "Committed" in table and "tokens=70" in table
    listing = json.loads(
        cluster.kubectl(
            "get", "bclaim", "-n", ns, "--field-selector", "spec.envelope=wf", "-o", "json"
        )
    )
    assert [i["metadata"]["name"] for i in listing["items"]] == ["x"]


def test_an_envelope_re_created_under_an_old_name_moves_nothing_for_its_claims(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    """Issue 21 #3: x (20) is quarantined in wf (C = R: all 20 charged); wf is deleted with
    x surviving (orphaned) and re-created under its name. x's late report (5 of 20) would
    have returned 15 to the new wf it never drew from: the new wf stays untouched and x is
    set aside with condition EnvelopeReplaced."""
    create_envelope(
        cluster,
        ns,
        "wf",
        {"tokens": "100"},
        defaultLeaseSeconds=2,
        ambiguityDeadlineSeconds=2,
        atAmbiguityDeadline="Quarantine",
    )
    sdk.hold("wf", "x", {"tokens": "20"}, name="x", dispatch=True)
    quarantined = eventually(
        "x quarantined", lambda: (v := sdk.get("x")).status.settlement is not None and v
    )
    assert quarantined.status.settlement is not None
    assert quarantined.status.settlement.reason == "AmbiguityDeadlineQuarantine"
    old_uid = quarantined.status.envelope_uid
    assert old_uid, "bound to the envelope that decided on it"
    settled_ledger(sdk, "wf", committed="20", available="80")

    # A finalizer of the tenant's own keeps x after its envelope collected it.
    keep = [{"op": "add", "path": "/metadata/finalizers/-", "value": "test.reservoir.dev/keep"}]
    cluster.kubectl("patch", "bclaim", "x", "-n", ns, "--type", "json", "-p", json.dumps(keep))
    cluster.kubectl("delete", "renv", "wf", "-n", ns, "--wait=false")
    eventually("wf to go", lambda: not exists(cluster, ns, "renv", "wf"), timeout=60)
    assert exists(cluster, ns, "bclaim", "x"), "x survives its envelope"
    create_envelope(cluster, ns, "wf", {"tokens": "100"})
    settled_ledger(sdk, "wf", committed="0", reserved="0", available="100")

    cluster.kubectl(
        "patch",
        "bclaim",
        "x",
        "-n",
        ns,
        "--type",
        "merge",
        "-p",
        json.dumps({"spec": {**FINAL_5, "lease": {"fence": lease_fence(claim_of(cluster, ns))}}}),
    )
    aside = eventually(
        "x set aside", lambda: (v := sdk.get("x")).condition("EnvelopeReplaced") and v
    )
    assert aside.status.envelope_uid == old_uid
    assert aside.status.settlement == quarantined.status.settlement
    assert "EnvelopeReplaced" in events_of(cluster, ns, "x")
    new = settled_ledger(sdk, "wf", committed="0", reserved="0", available="100")
    assert "x" not in [e.claim for e in new.status.entries.values()]
    cluster.kubectl(
        "patch",
        "bclaim",
        "x",
        "-n",
        ns,
        "--type",
        "merge",
        "-p",
        '{"metadata":{"finalizers":null}}',
    )
