"""One test per seed article, through real objects, a real API server and the real operator."""

from __future__ import annotations

import json
import time
from decimal import Decimal

from reservoir.sdk import Reservoir
from tests.clusters import ClusterHandle
from tests.integration.conftest import OperatorProcess
from tests.integration.helpers import (
    create_envelope,
    events_of,
    eventually,
    phase_of,
    records,
    settled_ledger,
    totals,
    under_lease,
    wait_phase,
)

FINAL_5 = {"usage": {"tokens": "5"}, "final": True, "outcome": "Succeeded"}


def test_dynamic_branches_pruned_capacity_returns_before_the_workflow_ends(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    dynamic_branches(cluster, ns, sdk)


def dynamic_branches(cluster: ClusterHandle, ns: str, sdk: Reservoir) -> None:
    """branch-claims.txt: an agent may call one of eight tools; two are selected.
    (Also run by tests/integration/test_rbac.py under the chart's RBAC.)"""
    create_envelope(cluster, ns, "agent", {"tokens": "160k"}, defaultLeaseSeconds=120)
    tools = ["search", "code", "sql", "browse", "math", "image", "email", "calendar"]
    claims = {t: sdk.hold("agent", t, {"tokens": "20k"}, name=f"agent-{t}") for t in tools}
    claims = {t: wait_phase(sdk, c, "Tentative") for t, c in claims.items()}
    assert totals(sdk, "agent")["available"] == "0"

    for tool in ("search", "code"):
        claims[tool] = sdk.dispatch(claims[tool])
    for tool in tools[2:]:
        sdk.cancel(claims[tool])

    # Pruned capacity is back while the two selected branches are still running.
    settled_ledger(sdk, "agent", reserved="40000", available="120000", committed="0")
    for tool in tools[2:]:
        wait_phase(sdk, f"agent-{tool}", "Released")
    for tool in ("search", "code"):
        assert wait_phase(sdk, claims[tool], "Committed").phase == "Committed"

    sdk.report_usage(sdk.get(claims["search"]), {"tokens": "5k"})
    sdk.finish(sdk.get(claims["search"]), {"tokens": "12k"})
    sdk.finish(sdk.get(claims["code"]), {"tokens": "7500"}, outcome="Failed")
    settled_ledger(sdk, "agent", committed="19500", reserved="0", available="140500")
    # Each pruned branch's release is recorded on it, as a cancel by its worker.
    for tool in tools[2:]:
        settlement = sdk.get(f"agent-{tool}").settlement
        assert settlement is not None and settlement.reason == "Cancelled", tool


def test_parallel_settlement_worked_example_ends_at_37_committed_63_available(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    worked_example(cluster, ns, sdk)


def worked_example(cluster: ClusterHandle, ns: str, sdk: Reservoir) -> None:
    """child-settlement.txt: parent 100, four children of 20; A 20, B 12, C skipped, D times
    out after activation and reports 5 late. (Also run by tests/integration/test_rbac.py
    under the chart's RBAC.)"""
    create_envelope(
        cluster,
        ns,
        "parent",
        {"tokens": "100"},
        defaultLeaseSeconds=120,
        atAmbiguityDeadline="Hold",
    )
    a = sdk.hold("parent", "A", {"tokens": "20"}, name="a")
    b = sdk.hold("parent", "B", {"tokens": "20"}, name="b")
    c = sdk.hold("parent", "C", {"tokens": "20"}, name="c")
    # D is sent as it reserves (reserve and commit in one step) with a short lease that it
    # never renews: no dispatch has to beat the lease on a loaded machine.
    d = sdk.hold("parent", "D", {"tokens": "20"}, name="d", lease_seconds=6, dispatch=True)
    for claim in (a, b, c):
        wait_phase(sdk, claim, "Tentative")
    d = sdk.report_usage(sdk.get(d), {"tokens": "1"})  # D activated
    settled_ledger(sdk, "parent", available="20")  # (D may already be Detached: held too)

    a, b = (sdk.dispatch(sdk.get(x)) for x in (a, b))
    sdk.cancel(sdk.get(c))
    sdk.finish(sdk.get(a), {"tokens": "20"})
    sdk.finish(sdk.get(b), {"tokens": "12"})

    # D stops renewing: its lease lapses after activation, its 20 enter reconciliation.
    wait_phase(sdk, d, "Detached", within=20)
    settled_ledger(sdk, "parent", committed="32", reconciling="20", available="48")

    sdk.finish(sdk.get(d), {"tokens": "5"}, outcome="Failed")  # the late report
    settled_ledger(sdk, "parent", committed="37", reserved="0", reconciling="0", available="63")
    entries = records(sdk, "parent")
    assert [str(entries[n].released.get("tokens", 0)) for n in "abcd"] == ["0", "8", "20", "15"]
    assert entries["d"].settlement is not None
    assert entries["d"].settlement.reason == "SettledAfterDetach"


def test_long_queued_job_renewals_extend_but_never_reset_age_or_queue_position(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    """lease-renewal.txt: finite renewable leases, bounded by lifetime."""
    create_envelope(
        cluster,
        ns,
        "queue",
        {"tokens": "100"},
        defaultLeaseSeconds=4,
        maxClaimLifetimeSeconds=10,
        maxQueueSeconds=300,
    )
    job = wait_phase(sdk, sdk.hold("queue", "job", {"tokens": "70"}, name="job"), "Tentative")
    assert job.status.lease is not None
    first_reserved = job.status.lease.first_reserved_at
    first_expiry = job.status.lease.expires_at
    assert first_reserved is not None and first_expiry is not None

    # Two claims queue behind it; the younger one heartbeats, the older one does not.
    # Two claims of 60 queue behind it (only one fits at a time); the younger one
    # heartbeats its Lease all along, the older one never does.
    older = sdk.hold("queue", "older", {"tokens": "60"}, name="older", lease_seconds=10)
    time.sleep(1.1)  # queue age has the API server's resolution: one second
    younger = sdk.hold("queue", "younger", {"tokens": "60"}, name="younger", lease_seconds=10)
    for queued in (older, younger):
        eventually("a queue reason", lambda q=queued: sdk.get(q).status.queue_reason)

    renewed = sdk.renew(job)
    assert renewed.status.lease is not None and renewed.status.lease.expires_at is not None
    assert renewed.status.lease.expires_at > first_expiry
    assert renewed.status.lease.first_reserved_at == first_reserved
    assert renewed.renewals == 1

    # Renewals continue until the lifetime: then refused, and the claim expires.
    while True:
        sdk.renew(sdk.get(younger), confirm_timeout=None)  # a Pending claim's heartbeat
        view = sdk.get(job)
        if view.phase != "Tentative":
            break
        try:
            sdk.renew(view, confirm_timeout=3)
        except Exception:
            eventually("the job to expire", lambda: phase_of(sdk, job) == "Expired", timeout=15)
            break
    assert phase_of(sdk, job) == "Expired"
    lease = sdk.get(job).status.lease
    assert lease is not None and lease.first_reserved_at == first_reserved
    assert lease.expires_at is not None
    assert (lease.expires_at - first_reserved).total_seconds() <= 10
    settlement = sdk.get(job).status.settlement
    assert settlement is not None and settlement.reason == "LeaseExpired"

    # The expired job's 70 return exactly once, and the older queued claim is admitted
    # first although only the younger one heartbeated.
    eventually("the older claim's reservation", lambda: sdk.get(older).status.lease)
    ledger = sdk.ledger("queue").status
    entries = records(sdk, "queue")
    assert entries["job"].phase == "Expired"
    assert entries["job"].released == {"tokens": 70} and not entries["job"].consumed
    older_at = entries["older"].first_reserved_at
    assert older_at is not None
    if "younger" in entries:  # on a slow machine the older one may have expired already
        younger_at = entries["younger"].first_reserved_at
        assert younger_at is not None
        assert younger_at > older_at
    held = sum(e.reserved["tokens"] for e in entries.values() if e.phase.holds_capacity)
    assert ledger.totals.reserved["tokens"] == held
    assert ledger.totals.available["tokens"] == 100 - held
    assert ledger.totals.committed["tokens"] == 0


def test_client_disconnect_detaches_then_a_final_report_settles_it(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    """client-disconnect.txt: a disconnect is not a cancel."""
    create_envelope(
        cluster,
        ns,
        "chat",
        {"tokens": "100"},
        defaultLeaseSeconds=3,
        ambiguityDeadlineSeconds=300,
        atAmbiguityDeadline="Release",
    )
    claim = sdk.hold(
        "chat",
        "reply",
        {"tokens": "50"},
        name="reply",
        dispatch=True,
        upstream={"operationId": "op-42", "supportsStatus": True},
    )
    wait_phase(sdk, claim, "Committed")
    # The client goes away: no more renewals. Capacity is held, never made available.
    view = wait_phase(sdk, claim, "Detached", within=20)
    assert view.condition("Detached")
    settled_ledger(sdk, "chat", reserved="0", reconciling="50", available="50")
    assert sdk.get(claim).spec.upstream.operation_id == "op-42"  # preserved for reconciliation

    sdk.finish(sdk.get(claim), {"tokens": "30"})  # the provider's authoritative outcome
    settled_ledger(sdk, "chat", committed="30", reconciling="0", available="70")
    cluster.kubectl("wait", "-n", ns, "--for=condition=Settled", "bclaim/reply", "--timeout=30s")


def test_cancel_requested_and_completion_racing_both_converge(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "race", {"tokens": "100"}, defaultLeaseSeconds=120)
    won = sdk.hold("race", "completion-wins", {"tokens": "20"}, name="won", dispatch=True)
    cancelled = sdk.hold("race", "cancel-confirmed", {"tokens": "20"}, name="cx", dispatch=True)
    won, cancelled = wait_phase(sdk, won, "Committed"), wait_phase(sdk, cancelled, "Committed")

    sdk.cancel(won)
    sdk.cancel(cancelled)
    eventually("CancelRequested", lambda: sdk.get(won).condition("CancelRequested"))
    assert phase_of(sdk, won) == "Committed", "cancel after commit is a request, not a release"
    settled_ledger(sdk, "race", reserved="40", available="60")

    sdk.finish(sdk.get(won), {"tokens": "20"}, outcome="Succeeded")  # completion won the race
    sdk.finish(sdk.get(cancelled), {"tokens": "3"}, outcome="Cancelled")  # confirmed, partial
    settled_ledger(sdk, "race", committed="23", reserved="0", available="77")


def test_at_the_ambiguity_deadline_the_policy_is_applied_and_recorded(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(
        cluster,
        ns,
        "deadline",
        {"tokens": "100"},
        defaultLeaseSeconds=2,
        ambiguityDeadlineSeconds=3,
        atAmbiguityDeadline="Quarantine",
    )
    claim = sdk.hold("deadline", "lost", {"tokens": "25"}, name="lost", dispatch=True)
    wait_phase(sdk, claim, "Detached", within=20)
    view = wait_phase(sdk, claim, "Consumed", within=20)
    assert view.status.settlement is not None
    assert view.status.settlement.reason == "AmbiguityDeadlineQuarantine"
    settled_ledger(sdk, "deadline", committed="25", reconciling="0", available="75")
    assert "AmbiguityDeadlineQuarantine" in events_of(cluster, ns, "lost")

    # The SDK refuses to report on a settled claim (StaleClaimError); a worker that writes
    # anyway, here with kubectl, is recorded as late and reopens nothing: the settlement
    # stays as it was, and (policy lateCompletion Adjust, the default) one recorded
    # adjustment returns what the quarantine charged but the branch did not use.
    cluster.kubectl(
        "patch",
        "bclaim",
        "lost",
        "-n",
        ns,
        "--type=merge",
        "-p",
        json.dumps({"spec": under_lease(sdk.get(claim).body or {}, FINAL_5)}),
    )
    eventually("the late report", lambda: sdk.get(claim).condition("LateReport"))
    settled_ledger(sdk, "deadline", committed="5", available="95")
    view = sdk.get(claim)
    assert view.status.settlement is not None
    assert view.status.settlement.reason == "AmbiguityDeadlineQuarantine"
    assert view.status.consumed == {"tokens": Decimal(25)}, "the settlement never changes"
    adjustment = view.status.adjustment
    assert adjustment is not None and adjustment.applied
    assert adjustment.returned == {"tokens": Decimal(20)}
