"""Settle only on recorded facts, on the real cluster: what the operator missed while it was
down, a ledger pushed past its cap, settled claims that expire, and claims that vanished."""

from __future__ import annotations

import json

from reservoir.core.model import MAX_LEDGER_ENTRIES
from reservoir.sdk import Reservoir
from tests.clusters import ClusterHandle
from tests.integration.conftest import OperatorProcess, StartOperator
from tests.integration.helpers import (
    committed_claim,
    create_envelope,
    events_of,
    eventually,
    plugin,
    settled_ledger,
    wait_phase,
)


def test_dispatch_then_cancel_while_the_operator_is_down_holds_the_capacity(
    cluster: ClusterHandle, ns: str, start_operator: StartOperator, sdk: Reservoir
) -> None:
    operator = start_operator()
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=120)
    held = plugin(cluster, ns, "hold", "wf", "x", "tokens=30", "--name", "x")
    assert held.returncode == 0, held.stderr
    claim = wait_phase(sdk, "x", "Tentative")
    operator.stop()
    for verb in ("dispatch", "cancel"):  # two writes the operator never sees apart
        done = plugin(cluster, ns, verb, "x")
        assert done.returncode == 0, done.stderr
    start_operator()
    claim = sdk.wait(claim, condition="CancelRequested", within=30)
    assert claim.phase.value == "Committed", "a dispatched branch may be running"
    settled_ledger(sdk, "wf", reserved="30", available="70")
    sdk.finish(sdk.get(claim), {"tokens": "12"}, outcome="Cancelled")
    wait_phase(sdk, claim, "Consumed")
    settled_ledger(sdk, "wf", committed="12", reserved="0", available="88")


def test_an_envelope_pushed_past_its_ledger_cap_still_admits_and_deletes_cleanly(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=120)
    rejected = MAX_LEDGER_ENTRIES + 40
    claims = {
        "apiVersion": "v1",
        "kind": "List",
        "items": [
            {
                "apiVersion": "reservoir.dev/v1alpha1",
                "kind": "BranchClaim",
                "metadata": {"name": f"bad-{i:04}", "namespace": ns},
                "spec": {"envelope": "wf", "requests": {"nvidia.com/gpu": "1"}},
            }
            for i in range(rejected)
        ],
    }
    cluster.kubectl("create", "-f", "-", input=json.dumps(claims))
    good = sdk.hold("wf", "good", {"tokens": "30"}, name="good")
    wait_phase(sdk, good, "Tentative", within=120)

    def rejected_so_far() -> int:
        listing = json.loads(cluster.kubectl("get", "bclaim", "-n", ns, "-o", "json"))
        return sum(1 for c in listing["items"] if c.get("status", {}).get("phase") == "Rejected")

    eventually(f"{rejected} rejections", lambda: rejected_so_far() == rejected, timeout=180)

    def announced() -> dict[str, int]:
        listing = json.loads(cluster.kubectl("get", "events", "-n", ns, "-o", "json"))
        counts: dict[str, int] = {}
        for event in listing["items"]:
            if event["reason"] == "UnknownResource":
                name = event["involvedObject"]["name"]
                counts[name] = counts.get(name, 0) + event.get("count", 1)
        return counts

    # Verdicts kept off the ledger are announced once they are durable, and only once.
    counts = eventually(
        "every rejection announced",
        lambda: len(announced()) == rejected and announced(),
        timeout=60,
    )
    assert set(counts.values()) == {1}, {n: c for n, c in counts.items() if c != 1}
    ledger = sdk.ledger("wf").status
    assert len(ledger.entries) <= MAX_LEDGER_ENTRIES // 2, "rejections never crowd the ledger"
    assert not any(c.type == "LedgerHealthy" for c in ledger.conditions)
    settled_ledger(sdk, "wf", reserved="30", available="70")

    cluster.kubectl("delete", "renv", "wf", "-n", ns, "--wait=false")
    eventually(
        "the envelope and its claims to be gone",
        lambda: not cluster.kubectl("get", "renv,bclaim", "-n", ns, "-o", "name").strip(),
        timeout=180,
    )


def test_settled_claims_are_deleted_after_the_envelopes_ttl(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, settledClaimTTLSeconds=2)
    kept = wait_phase(sdk, sdk.hold("wf", "kept", {"tokens": "10"}, name="kept"), "Tentative")
    gone = wait_phase(sdk, sdk.hold("wf", "gone", {"tokens": "10"}, name="gone"), "Tentative")
    sdk.cancel(gone)
    eventually(
        "the settled claim to be deleted",
        lambda: not cluster.kubectl("get", "bclaim", "gone", "-n", ns, "--ignore-not-found"),
        timeout=30,
    )
    assert sdk.get(kept).phase.value == "Tentative", "live claims are never deleted"
    settled_ledger(sdk, "wf", reserved="10", available="90")


def test_a_committed_claim_that_vanished_keeps_its_usage_and_the_envelope_settles_it(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    claim = committed_claim(cluster, ns, sdk)
    cluster.kubectl(
        "patch", "renv", "wf", "-n", ns, "--type=merge", "-p",
        '{"spec": {"policy": {"atAmbiguityDeadline": "Hold"}}}',
    )  # fmt: skip
    sdk.report_usage(sdk.get(claim), {"tokens": "7"})
    eventually("usage recorded", lambda: str(sdk.get(claim).status.usage.get("tokens")) == "7")
    # Someone deletes the claim and removes its finalizer by hand: its facts are gone.
    cluster.kubectl("delete", "bclaim", "x", "-n", ns, "--wait=false")
    cluster.kubectl(
        "patch", "bclaim", "x", "-n", ns, "--type=json", "-p",
        '[{"op": "remove", "path": "/metadata/finalizers"}]',
    )  # fmt: skip
    eventually("the claim to be gone", lambda: not sdk.claims("wf"))
    cluster.kubectl(
        "patch", "renv", "wf", "-n", ns, "--type=merge", "-p", '{"spec":{"state":"Closed"}}'
    )
    eventually(
        "the gone claim's entry to keep its recorded usage",
        lambda: any(
            e.claim == "x" and str(e.usage.get("tokens")) == "7" and e.cancel_requested
            for e in sdk.ledger("wf").status.entries.values()
        ),
    )
    eventually("held until someone decides", lambda: sdk.ledger("wf").status.phase == "Closing")
    cluster.kubectl(
        "annotate", "renv", "wf", "-n", ns, "reservoir.dev/force-settle-gone=x: OPS-8 node lost"
    )
    settled_ledger(sdk, "wf", committed="7", reserved="0", reconciling="0")
    eventually("the envelope to close", lambda: sdk.ledger("wf").status.phase.value == "Closed")


def test_a_ledger_the_operator_cannot_write_is_reported_on_the_envelope_not_looped_on(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100"})
    eventually("the envelope to open", lambda: sdk.ledger("wf").status.phase == "Open")
    # A ledger that holds a resource the envelope has no budget for: no reconcile can
    # produce a ledger that keeps the invariant from it.
    corrupt = {
        "status": {
            "entries": {
                "u-1": {
                    "claim": "ghost",
                    "phase": "Committed",
                    "reserved": {"gpu": "1"},
                    "committedAt": "2026-01-01T00:00:00Z",
                }
            }
        }
    }
    cluster.kubectl(
        "patch", "renv", "wf", "-n", ns, "--subresource=status", "--type=merge",
        "-p", json.dumps(corrupt),
    )  # fmt: skip
    sdk.hold("wf", "x", {"tokens": "10"}, name="x")  # wakes the envelope's writer
    condition = eventually(
        "a LedgerHealthy=False condition",
        lambda: next(
            (c for c in sdk.ledger("wf").status.conditions if c.type == "LedgerHealthy"), None
        ),
    )
    assert condition.status == "False" and condition.reason == "InvariantViolation"
    assert "InvariantViolation" in events_of(cluster, ns, "wf")
    assert operator.process.poll() is None, "the operator keeps running"
