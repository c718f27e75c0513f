"""The SDK's guarantees and the kubectl plugin, as a user meets them."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable

import pytest

from reservoir.core.model import ClaimPhase, Outcome, Trigger
from reservoir.k8s.resources import CLAIM_FINALIZER
from reservoir.sdk import (
    AsyncReservoir,
    ClaimExistsError,
    ClaimNotFoundError,
    ClaimView,
    DuplicateRequestIdError,
    LeaseUncertainError,
    Reservoir,
    StaleClaimError,
)
from tests.clusters import ClusterHandle
from tests.integration.conftest import OperatorProcess, StartOperator
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
    assert rows["tokens"][1:] == ["Consumable", "100000", "12000", "0", "0", "88000"]
    assert rows["cost"][1:] == ["Consumable", "5", "0.5", "0", "0", "4.5"]
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


# --- waits follow a watch; hold creates claims as the operator would leave them ----------


async def _until(what: str, check: Callable[[], object]) -> None:
    """Poll a condition on the event loop (the SDK's watch task runs meanwhile), 30 s."""
    for _ in range(1500):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


async def test_concurrent_waits_share_one_watch_and_see_changes_made_after_they_began(
    cluster: ClusterHandle, ns: str, start_operator: StartOperator
) -> None:
    """No operator runs while the waits begin: each reads its claim Pending, then follows
    the one watch this SDK holds for the namespace until the operator reserves it."""
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=60)
    async with AsyncReservoir(namespace=ns, kubeconfig=str(cluster.kubeconfig_path)) as sdk:
        held = [await sdk.hold("wf", f"b{i}", {"tokens": "10"}, name=f"c{i}") for i in range(8)]
        assert sdk.watches == ()  # started by the first wait, not before
        waits = [asyncio.ensure_future(sdk.wait(c, phase="Tentative", within=60)) for c in held]
        try:
            await _until("every wait to follow its claim", lambda: _following(sdk) == len(held))
            (watch,) = sdk.watches
            assert not any(w.done() for w in waits)
            assert {(await sdk.get(c)).phase for c in held} == {ClaimPhase.PENDING}

            await asyncio.to_thread(start_operator)
            views = await asyncio.gather(*waits)
        finally:
            for w in waits:
                w.cancel()
        assert [v.name for v in views] == [c.name for c in held]
        assert all(v.phase is ClaimPhase.TENTATIVE for v in views)
        # The claim's own record: a wait reads no envelope.
        assert all(not v.ledger_read and v.ledger_phase is ClaimPhase.TENTATIVE for v in views)
        # One watch for all eight waits: one task, one request, one list.
        assert sdk.watches == (watch,)
        assert (watch.connections, watch.open_streams, watch.relists) == (1, 1, 1)
        assert watch.waiters == 0
        # Later waits ride the same watch.
        again = await sdk.wait(held[0], phase="Tentative")
        assert again.uid == held[0].uid and watch.connections == 1
    assert sdk.watches == () and not watch.running and watch.open_streams == 0


def _following(sdk: AsyncReservoir) -> int:
    return sum(watch.following for watch in sdk.watches)


async def test_a_wait_for_a_claim_deleted_meanwhile_raises_claim_not_found(
    cluster: ClusterHandle, ns: str
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100"})
    async with AsyncReservoir(namespace=ns, kubeconfig=str(cluster.kubeconfig_path)) as sdk:
        claim = await sdk.hold("wf", "x", {"tokens": "10"}, name="x")
        waiting = asyncio.ensure_future(sdk.wait(claim, phase="Tentative", within=60))
        try:
            await _until("the wait to follow the claim", lambda: _following(sdk) == 1)
            # No operator settles it: let it go by hand.
            await asyncio.to_thread(
                cluster.kubectl, "delete", "bclaim", "x", "-n", ns, "--wait=false"
            )
            await asyncio.to_thread(
                cluster.kubectl,
                "patch",
                "bclaim",
                "x",
                "-n",
                ns,
                "--type=merge",
                "-p",
                '{"metadata": {"finalizers": null}}',
            )
            with pytest.raises(ClaimNotFoundError, match="branchclaim/x"):
                await waiting
        finally:
            waiting.cancel()


def test_the_synchronous_sdk_waits_on_a_watch_of_its_own_for_the_call_only(
    cluster: ClusterHandle, ns: str, start_operator: StartOperator, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=60)
    claim = sdk.hold("wf", "x", {"tokens": "10"}, name="x")
    answers: list[ClaimView | BaseException] = []

    def wait() -> None:
        try:
            answers.append(sdk.wait(claim, phase="Tentative", within=60))
        except BaseException as error:  # reported below
            answers.append(error)

    waiter = threading.Thread(target=wait)
    waiter.start()
    try:
        inner = sdk._async
        eventually("the wait to follow the claim", lambda: _following(inner) == 1, every=0.02)
        (watch,) = inner.watches
        assert watch.name == "x" and not answers  # a watch of this one claim
        start_operator()
    finally:
        waiter.join(timeout=90)
    (answer,) = answers
    assert isinstance(answer, ClaimView), answer
    assert answer.phase is ClaimPhase.TENTATIVE and answer.ledger_phase is ClaimPhase.TENTATIVE
    # The call's watch ended with the call: nothing runs between calls.
    assert inner.watches == () and not watch.running and watch.open_streams == 0


def test_renew_waits_for_the_grant_on_the_watch(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=30)
    claim = wait_phase(sdk, sdk.hold("wf", "x", {"tokens": "10"}, name="x"), "Tentative")
    renewed = sdk.renew(claim, confirm_timeout=30)
    assert renewed.renewals == 1 and renewed.ledger_renewals >= 1
    assert sdk._async.watches == ()


def test_hold_creates_the_claim_with_its_finalizer_and_its_envelope_as_owner(
    cluster: ClusterHandle, ns: str, start_operator: StartOperator, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=60)
    envelope_uid = cluster.kubectl(
        "get", "renv", "wf", "-n", ns, "-o", "jsonpath={.metadata.uid}"
    ).strip()
    claim = sdk.hold("wf", "x", {"tokens": "10"}, name="x")
    stored = json.loads(cluster.kubectl("get", "bclaim", "x", "-n", ns, "-o", "json"))
    assert stored["metadata"]["finalizers"] == [CLAIM_FINALIZER]
    assert stored["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "reservoir.dev/v1alpha1",
            "kind": "ReservationEnvelope",
            "name": "wf",
            "uid": envelope_uid,
        }
    ]
    assert sdk.hold("wf", "x", {"tokens": "10"}, name="x").uid == claim.uid  # idempotent

    # A claim on an envelope that does not exist (yet) has the finalizer and no owner.
    orphan = sdk.hold("later", "y", {"tokens": "10"}, name="y")
    meta = json.loads(cluster.kubectl("get", "bclaim", "y", "-n", ns, "-o", "json"))["metadata"]
    assert meta["finalizers"] == [CLAIM_FINALIZER] and "ownerReferences" not in meta
    assert orphan.name == "y"

    # The operator has nothing to add to the SDK's claim: the fields stay the SDK's own.
    start_operator()
    wait_phase(sdk, claim, "Tentative")
    fields = json.loads(
        cluster.kubectl("get", "bclaim", "x", "-n", ns, "-o", "json", "--show-managed-fields")
    )
    owners = {
        entry["manager"]
        for entry in fields["metadata"]["managedFields"]
        if {"f:finalizers", "f:ownerReferences"} & set(entry["fieldsV1"].get("f:metadata", {}))
    }
    assert len(owners) == 1 and "reservoir-operator" not in owners, owners
