"""The SDK's guarantees and the kubectl plugin, as a user meets them."""

from __future__ import annotations

import pytest

from reservoir.core.model import ClaimPhase, Outcome, Trigger
from reservoir.sdk import (
    ClaimExistsError,
    DuplicateRequestIdError,
    LeaseUncertainError,
    Reservoir,
    StaleClaimError,
)
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


def test_holding_again_by_name_returns_the_same_claim_and_refuses_another(
    cluster: ClusterHandle, ns: str, sdk: Reservoir
) -> None:
    """Idempotent submission: a client that lost the answer to its hold holds again."""
    create_envelope(cluster, ns, "wf", {"tokens": "100"})
    first = sdk.hold("wf", "search", {"tokens": "20"}, name="x", lease_seconds=30)
    again = sdk.hold("wf", "search", {"tokens": "2e1"}, name="x", lease_seconds=30)
    assert again.uid == first.uid and again.name == "x"
    assert type(again) is type(first)

    with pytest.raises(ClaimExistsError, match="already exists") as raised:
        sdk.hold("wf", "search", {"tokens": "30"}, name="x", lease_seconds=30)
    assert raised.value.differences == ("spec.requests",)
    assert "tokens=30 asked, tokens=20 on the claim" in str(raised.value)
    with pytest.raises(ClaimExistsError) as raised:
        sdk.hold("wf", "other", {"tokens": "20"}, name="x", lease_seconds=30, priority=3)
    assert raised.value.differences == ("spec.branch", "spec.priority")
    # Nothing was written by the refused holds.
    assert sdk.get("x").resource_version == first.resource_version
    listed = cluster.kubectl("get", "bclaim", "-n", ns, "-o", "name").split()
    assert listed == ["branchclaim.reservoir.dev/x"]


def test_hold_records_the_request_id_on_the_claim(
    cluster: ClusterHandle, ns: str, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100"})
    claim = sdk.hold("wf", "search", {"tokens": "20"}, name="x", request_id="req-7f3a")
    assert claim.spec.upstream.request_id == "req-7f3a"
    stored = cluster.kubectl(
        "get", "bclaim", "x", "-n", ns, "-o", "jsonpath={.spec.upstream.requestId}"
    )
    assert stored == "req-7f3a"
    # The same request id again is the same claim; another one on that name is not.
    assert sdk.hold("wf", "search", {"tokens": "20"}, name="x", request_id="req-7f3a").uid == (
        claim.uid
    )
    with pytest.raises(ClaimExistsError) as raised:
        sdk.hold("wf", "search", {"tokens": "20"}, name="x", request_id="req-other")
    assert raised.value.differences == ("spec.upstream.requestId",)
    # Another claim with the same request id is refused before anything is written.
    with pytest.raises(DuplicateRequestIdError) as duplicate:
        sdk.hold("wf", "search", {"tokens": "20"}, name="y", request_id="req-7f3a")
    assert duplicate.value.claim == "x" and "branchclaim/x" in str(duplicate.value)
    assert "y" not in cluster.kubectl("get", "bclaim", "-n", ns, "-o", "name").split("/")
    with pytest.raises(DuplicateRequestIdError):
        sdk.hold("wf", "search", {"tokens": "20"}, request_id="req-7f3a")  # generated name


def test_a_settled_claims_result_and_history_outlive_its_worker(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    """hold → dispatch → final report with a result reference; then another client, by the
    claim's name only, reads the outcome and how the claim got there."""
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=60)
    claim = wait_phase(sdk, sdk.hold("wf", "search", {"tokens": "20"}, name="x"), "Tentative")
    claim = wait_phase(sdk, sdk.dispatch(claim), "Committed")
    sdk.finish(claim, {"tokens": "12"}, outcome="Succeeded", result="s3://bucket/out")
    wait_phase(sdk, "x", "Consumed")

    # A reconnecting client: another SDK (another holder), knowing only the name.
    with Reservoir(
        namespace=ns, kubeconfig=str(cluster.kubeconfig_path), holder="reconnected"
    ) as other:
        result = eventually(
            "the result recorded", lambda: other.result("x").result and other.result("x")
        )
        moves = eventually(
            "four moves recorded", lambda: len(other.history("x")) >= 4 and other.history("x")
        )
    assert result.phase is ClaimPhase.CONSUMED and result.outcome is Outcome.SUCCEEDED
    assert result.result == "s3://bucket/out"
    assert result.consumed == {"tokens": 12} and result.released == {"tokens": 8}
    # Usage in the final report proves the branch ran: Running, then settled, in one pass.
    assert [(m.from_phase, m.to, m.reason) for m in moves] == [
        (ClaimPhase.PENDING, ClaimPhase.TENTATIVE, "Reserved"),
        (ClaimPhase.TENTATIVE, ClaimPhase.COMMITTED, "CommitPointReached"),
        (ClaimPhase.COMMITTED, ClaimPhase.RUNNING, "ExecutionStarted"),
        (ClaimPhase.RUNNING, ClaimPhase.CONSUMED, "Completed"),
    ]
    assert [m.trigger for m in moves] == [
        Trigger.ADMISSION,
        Trigger.WORKER,
        Trigger.WORKER,
        Trigger.WORKER,
    ]
    assert [m.at for m in moves] == sorted(m.at for m in moves)
    # The status (what outlives the ledger entry) carries the same.
    status = eventually("the status mirror", lambda: (s := sdk.get("x").status).result and s)
    assert status.result == "s3://bucket/out" and status.history == moves

    shown = plugin(cluster, ns, "result", "x")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].startswith(f"branchclaim {ns}/x: Consumed (Completed, settled ")
    assert "outcome: Succeeded" in lines
    assert "result:  s3://bucket/out" in lines
    assert "amounts: C tokens=12, R−C tokens=8" in lines

    table = plugin(cluster, ns, "history", "x", "-n", ns)
    assert table.returncode == 0, table.stderr
    rows = table.stdout.splitlines()
    assert rows[0] == f"branchclaim {ns}/x: Consumed"
    assert rows[1].split() == [
        "TIME",
        "FROM",
        "→",
        "TO",
        "REASON",
        "TRIGGER",
        "LEASE-GEN",
        "AMOUNTS",
    ]
    moved = [row.split() for row in rows[2:]]
    assert [row[1:5] for row in moved] == [
        ["Pending", "→", "Tentative", "Reserved"],
        ["Tentative", "→", "Committed", "CommitPointReached"],
        ["Committed", "→", "Running", "ExecutionStarted"],
        ["Running", "→", "Consumed", "Completed"],
    ]
    assert moved[0][5:] == ["Admission", str(moves[0].lease_generation), "R", "tokens=20"]
    assert moved[1][-1] == moved[2][-1] == "-"
    assert moved[3][-4:] == ["C", "tokens=12,", "R−C", "tokens=8"]

    missing = plugin(cluster, ns, "result", "nope")
    assert missing.returncode == 1 and "branchclaim/nope not found" in missing.stderr
