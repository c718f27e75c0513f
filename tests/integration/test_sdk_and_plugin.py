"""The SDK's guarantees and the kubectl plugin, as a user meets them."""

from __future__ import annotations

import pytest

from reservoir.sdk import LeaseUncertainError, Reservoir, StaleClaimError
from tests.clusters import ClusterHandle
from tests.integration.conftest import OperatorProcess
from tests.integration.helpers import create_envelope, eventually, plugin, wait_phase


def generation(cluster: ClusterHandle, ns: str, name: str) -> str:
    return cluster.kubectl("get", "bclaim", name, "-n", ns, "-o", "jsonpath={.metadata.generation}")


def test_a_renewal_nobody_confirms_tells_the_worker_to_stop(
    cluster: ClusterHandle, ns: str, sdk: Reservoir
) -> None:
    """No operator runs here: the heartbeat lands, but no renewal is granted."""
    create_envelope(cluster, ns, "wf", {"tokens": "100"})
    claim = sdk.hold("wf", "x", {"tokens": "10"}, name="x")
    with pytest.raises(LeaseUncertainError, match="do not start irreversible work"):
        sdk.renew(claim, confirm_timeout=1.5)


def test_heartbeats_renew_through_a_lease_without_bumping_the_claims_generation(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=30)
    claim = wait_phase(sdk, sdk.hold("wf", "x", {"tokens": "10"}, name="x"), "Tentative")
    before = generation(cluster, ns, "x")
    for expected in (1, 2, 3):
        claim = sdk.renew(claim)
        assert claim.renewals == expected
        assert claim.ledger_renewals >= expected  # the ledger leads its status mirror
    assert generation(cluster, ns, "x") == before
    holder = cluster.kubectl("get", "lease", "x", "-n", ns, "-o", "jsonpath={.spec.holderIdentity}")
    assert holder == sdk.get(claim).spec.lease.holder


def test_dispatch_and_cancel_declare_facts_that_stick(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=120)
    lazy = sdk.hold("wf", "lazy", {"tokens": "10"}, name="lazy", dispatch=True)
    assert lazy.spec.dispatch and not lazy.spec.cancel and lazy.spec.declared == "Dispatch"
    lazy = wait_phase(sdk, lazy, "Committed")
    again = sdk.dispatch(lazy)  # already past the commit point: nothing to write
    assert again.resource_version == sdk.get(lazy).resource_version

    cancelled = sdk.cancel(lazy)
    assert cancelled.spec.cancel and cancelled.spec.declared == "Dispatch+Cancel"
    assert sdk.cancel(cancelled).spec.cancel  # idempotent
    with pytest.raises(StaleClaimError, match="cancelled"):
        sdk.dispatch(sdk.get(lazy))
    eventually("CancelRequested", lambda: sdk.get(lazy).condition("CancelRequested"))

    pruned = wait_phase(sdk, sdk.hold("wf", "pruned", {"tokens": "10"}, name="p"), "Tentative")
    pruned = sdk.cancel(pruned)
    assert pruned.spec.cancel and not pruned.spec.dispatch and pruned.spec.declared == "Cancel"
    pruned = wait_phase(sdk, pruned, "Released")
    assert pruned.settlement is not None and pruned.settlement.reason == "Cancelled"
    with pytest.raises(StaleClaimError, match="settled as Released"):
        sdk.dispatch(pruned)


def test_a_claim_waits_for_a_missing_envelope_and_says_so(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    claim = sdk.hold("not-yet", "x", {"tokens": "10"}, name="x")
    eventually(
        "EnvelopeNotFound",
        lambda: "EnvelopeNotFound" in (sdk.get(claim).status.queue_reason or ""),
    )
    create_envelope(cluster, ns, "not-yet", {"tokens": "100"})
    wait_phase(sdk, claim, "Tentative")


def test_the_kubectl_plugin_drives_a_claim_and_prints_the_ledger(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100k", "cost": "5"}, defaultLeaseSeconds=60)
    held = plugin(cluster, ns, "hold", "wf", "search", "tokens=20k", "cost=1", "--name", "s")
    assert held.returncode == 0, held.stderr
    wait_phase(sdk, "s", "Tentative")
    # Another worker's holder may neither dispatch nor renew it: one line, exit 1.
    for verb in ("dispatch", "renew"):
        foreign = plugin(cluster, ns, "--holder", "someone-else", verb, "s")
        assert foreign.returncode == 1
        assert foreign.stderr.strip().count("\n") == 0 and "is held by" in foreign.stderr
    # Each run is a new process; by default they all act as the same holder.
    for verb in (["dispatch", "s"], ["dispatch", "s"], ["renew", "s"], ["usage", "s", "tokens=5k"]):
        done = plugin(cluster, ns, *verb)
        assert done.returncode == 0, done.stderr
    shown = plugin(cluster, ns, "get", "s")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[1].split()[4] == "Dispatch"  # DECLARED
    finished = plugin(cluster, ns, "finish", "s", "tokens=12k", "cost=0.5")
    assert finished.returncode == 0, finished.stderr
    wait_phase(sdk, "s", "Consumed")

    ledger = plugin(cluster, ns, "ledger", "wf")
    assert ledger.returncode == 0, ledger.stderr
    rows = {line.split()[0]: line.split() for line in ledger.stdout.splitlines() if line}
    assert rows["tokens"][1:] == ["100000", "12000", "0", "0", "88000"]
    assert rows["cost"][1:] == ["5", "0.5", "0", "0", "4.5"]
    assert "Completed" in rows["s"]

    refused = plugin(cluster, ns, "dispatch", "s")
    assert refused.returncode == 1
    assert refused.stderr.strip().count("\n") == 0
    assert "settled as Consumed" in refused.stderr

    bad = plugin(cluster, ns, "usage", "s", "tokens=lots")
    assert bad.returncode == 1 and "not a non-negative Kubernetes quantity" in bad.stderr
