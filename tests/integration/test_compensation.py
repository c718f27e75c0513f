"""Compensations on the real control plane (issue 22): a settled Consumable claim
compensated through the SDK and through `kubectl reservoir compensate` moves its envelope's
committed total once per key; the API server refuses editing or removing a compensation
sent, and a second one with the same key; and across kill -9 of the operator each
compensation is applied exactly once."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Any

import pytest

from reservoir.core.claimstatus import settled_record
from reservoir.core.model import MAX_COMPENSATIONS, CompensationRecord
from reservoir.sdk import ClaimView, CompensationError, Reservoir
from tests.clusters import ClusterHandle
from tests.integration.conftest import OperatorProcess, StartOperator
from tests.integration.helpers import (
    create_envelope,
    events_with_messages,
    eventually,
    in_flight,
    ledger_line,
    make_claim,
    plugin,
    wait_phase,
)

CAPACITY = {"tokens": "100", "cost": "10", "concurrency": "2"}


def settled_claim(cluster: ClusterHandle, ns: str, sdk: Reservoir, name: str = "x") -> ClaimView:
    """Envelope `wf`; claim `name` settled Consumed with tokens C=30 (R=50), cost C=4 (R=5),
    its record compacted into its own status."""
    create_envelope(cluster, ns, "wf", CAPACITY, defaultLeaseSeconds=120)
    claim = sdk.hold("wf", name, {"tokens": "50", "cost": "5"}, name=name, dispatch=True)
    claim = wait_phase(sdk, claim, "Committed")
    sdk.finish(claim, {"tokens": "30", "cost": "4"})
    eventually(
        "the settled line on the claim, none in flight",
        lambda: not in_flight(sdk, name) and sdk.get(name).status.settlement is not None,
    )
    assert committed(sdk) == {"tokens": Decimal(30), "cost": Decimal(4)}
    return sdk.get(name)


def committed(sdk: Reservoir) -> dict[str, Decimal]:
    totals = sdk.ledger("wf").status.totals
    return {r: totals.committed.get(r, Decimal(0)) for r in ("tokens", "cost")}


def recorded(sdk: Reservoir, name: str = "x") -> list[CompensationRecord]:
    view = sdk.get(name)
    record = ledger_line(sdk, view) or settled_record(
        view.status, view.uid, view.name, view.spec.attempt
    )
    return record.compensations if record is not None else []


def steady(sdk: Reservoir, expected: dict[str, Decimal], seconds: float = 3) -> None:
    """The committed total reaches `expected` and stays there."""
    eventually(f"committed {expected}", lambda: committed(sdk) == expected)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert committed(sdk) == expected
        time.sleep(0.3)


def test_a_settled_claim_is_compensated_once_through_the_sdk_and_the_plugin(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    claim = settled_claim(cluster, ns, sdk)
    sdk.compensate(claim, {"cost": "-2.50"}, "refund, ticket 42", reference="RF-42")
    sdk.compensate("x", {"cost": Decimal("-2.5")}, "refund, ticket 42", reference="RF-42")
    assert len(sdk.get("x").spec.compensations) == 1  # the retried call wrote nothing
    steady(sdk, {"tokens": Decimal(30), "cost": Decimal("1.5")})

    args = ["compensate", "x", "--amount", "tokens=10", "--amount", "cost=1"]
    args += ["--reason", "late invoice", "--reference", "INV-7"]
    for _ in range(2):  # the second run finds its key: nothing written
        done = plugin(cluster, ns, *args)
        assert done.returncode == 0, done.stderr
    assert "compensation" in done.stdout
    assert len(sdk.get("x").spec.compensations) == 2
    steady(sdk, {"tokens": Decimal(40), "cost": Decimal("2.5")})

    eventually("both recorded", lambda: len(recorded(sdk)) == 2)
    first, second = recorded(sdk)
    assert first.applied and first.refunded == {"cost": Decimal("2.5")}
    assert first.reference == "RF-42"
    assert second.applied and second.charged == {"tokens": Decimal(10), "cost": Decimal(1)}
    eventually("the line retired from the envelope again", lambda: not in_flight(sdk, "x"))

    def compensated() -> list[str]:
        return [m for r, m in events_with_messages(cluster, ns, "x") if r == "Compensated"]

    eventually("two Compensated Events", lambda: len(compensated()) == 2)
    reasons = compensated()
    assert any("RF-42" in m for m in reasons)
    history = plugin(cluster, ns, "history", "x")
    assert history.returncode == 0, history.stderr
    assert "refunded cost=2.5; applied" in history.stdout
    ledger = plugin(cluster, ns, "ledger", "wf")
    assert "x: compensation" in ledger.stdout and "charged" in ledger.stdout
    steady(sdk, {"tokens": Decimal(40), "cost": Decimal("2.5")})


def test_the_sdk_and_plugin_refuse_what_cannot_be_sent(
    cluster: ClusterHandle, ns: str, sdk: Reservoir
) -> None:
    make_claim(cluster, ns, "y")
    with pytest.raises(CompensationError, match="needs an amount"):
        sdk.compensate("y", {}, "r")
    with pytest.raises(CompensationError, match="zero amount"):
        sdk.compensate("y", {"cost": "0"}, "r")
    refused = plugin(cluster, ns, "compensate", "y", "--amount", "cost=0", "--reason", "r")
    assert refused.returncode == 1 and "zero amount" in refused.stderr
    for i in range(MAX_COMPENSATIONS):
        sdk.compensate("y", {"cost": f"-{i + 1}"}, "r")
    with pytest.raises(CompensationError, match=f"already holds {MAX_COMPENSATIONS}"):
        sdk.compensate("y", {"cost": "-100"}, "r")
    assert len(sdk.get("y").spec.compensations) == MAX_COMPENSATIONS


def patch(cluster: ClusterHandle, ns: str, ops: Sequence[Mapping[str, Any]]) -> str:
    try:
        cluster.kubectl("patch", "bclaim", "z", "-n", ns, "--type=json", "-p", json.dumps(ops))
    except RuntimeError as error:  # kubectl's refusal, with its message
        return str(error)
    return ""


def test_the_api_server_refuses_editing_removing_or_reusing_a_key(
    cluster: ClusterHandle, ns: str, sdk: Reservoir
) -> None:
    make_claim(cluster, ns, "z")
    sdk.compensate("z", {"cost": "-1"}, "void", key="void-1")
    edit = [{"op": "replace", "path": "/spec/compensations/0/reason", "value": "other"}]
    assert "append-only" in patch(cluster, ns, edit)
    remove = [{"op": "remove", "path": "/spec/compensations/0"}]
    assert "append-only" in patch(cluster, ns, remove)
    again = {"key": "void-1", "refund": {"cost": "5"}, "reason": "again"}
    duplicate = [{"op": "add", "path": "/spec/compensations/-", "value": again}]
    assert "its own key" in patch(cluster, ns, duplicate)
    negative = {"key": "neg", "refund": {"cost": "-5"}, "reason": "signed"}
    assert patch(cluster, ns, [{"op": "add", "path": "/spec/compensations/-", "value": negative}])
    with pytest.raises(CompensationError, match="already names another"):
        sdk.compensate("z", {"cost": "-5"}, "again", key="void-1")
    (kept,) = sdk.get("z").spec.compensations
    assert kept.reason == "void" and kept.refund == {"cost": Decimal(1)}


def test_each_compensation_is_applied_once_across_kill_9(
    cluster: ClusterHandle, ns: str, start_operator: StartOperator, sdk: Reservoir
) -> None:
    running = [start_operator()]
    settled_claim(cluster, ns, sdk)
    rng = random.Random(22)
    asked = [
        ({"tokens": "-3"}, Decimal(-3), Decimal(0)),
        ({"cost": "0.5"}, Decimal(0), Decimal("0.5")),
        ({"tokens": "-2", "cost": "-1"}, Decimal(-2), Decimal(-1)),
        ({"tokens": "4"}, Decimal(4), Decimal(0)),
        ({"cost": "-0.25"}, Decimal(0), Decimal("-0.25")),
        ({"tokens": "-1", "cost": "1"}, Decimal(-1), Decimal(1)),
    ]
    for index, (amount, _, _) in enumerate(asked):
        sdk.compensate("x", amount, f"step {index}")
        # Killed at a random moment of the pass that applies it: before its ledger write,
        # between the ledger write and the claim's status write, or after both.
        time.sleep(rng.uniform(0.0, 1.5))
        running[-1].kill()
        if index in (1, 3):  # 6 + 2: the most a claim keeps
            sdk.compensate(
                "x", {"tokens": "-1"}, "sent while the operator is down", key=f"d{index}"
            )
        running.append(start_operator())
    expected_tokens = Decimal(30) + sum(t for _, t, _ in asked) - 2  # and the two `d` refunds
    expected_cost = Decimal(4) + sum(c for _, _, c in asked)
    steady(sdk, {"tokens": expected_tokens, "cost": expected_cost}, seconds=5)
    eventually("all recorded", lambda: len(recorded(sdk)) == MAX_COMPENSATIONS)
    records = recorded(sdk)
    keys = [r.key for r in records]
    assert len(set(keys)) == MAX_COMPENSATIONS and all(r.applied for r in records), records
    assert [c.key for c in sdk.get("x").spec.compensations] == keys


def mirror_blocker(ns: str) -> str:
    """A policy refusing every status write of the namespace's claims: the operator's
    ledger writes go through, its mirror into the claims' statuses does not. It stands for
    a kill -9 between the two writes, made certain."""
    name = f"block-claim-status-{ns}"
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
                "resourceRules": [
                    {
                        "apiGroups": ["reservoir.dev"],
                        "apiVersions": ["*"],
                        "operations": ["UPDATE"],
                        "resources": ["branchclaims/status"],
                    }
                ],
            },
            "validations": [{"expression": "false", "message": "claim status writes held"}],
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {"policyName": name, "validationActions": ["Deny"]},
    }
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": [policy, binding]})


def status_writes_refused(cluster: ClusterHandle, ns: str) -> bool:
    """A server-side dry run of a claim status write: refused by the blocker or not."""
    try:
        cluster.kubectl(
            "patch", "bclaim", "x", "-n", ns, "--subresource=status", "--type=merge",
            "-p", '{"status": {"observedGeneration": 99}}', "--dry-run=server",
        )  # fmt: skip
    except RuntimeError as error:
        return "claim status writes held" in str(error)
    return False


def test_a_ledger_written_without_its_mirror_never_applies_a_compensation_twice(
    cluster: ClusterHandle, ns: str, start_operator: StartOperator, sdk: Reservoir
) -> None:
    """The ledger write that applies a compensation is durable, the claim's status write
    is not (refused), then the operator is killed with kill -9 and another one starts:
    it finds the record in the ledger and applies nothing again."""
    first = start_operator()
    settled_claim(cluster, ns, sdk)
    blocker = mirror_blocker(ns)
    cluster.kubectl("apply", "-f", "-", input=blocker)
    try:
        eventually("the blocker enforced", lambda: status_writes_refused(cluster, ns), 60, 1)
        sdk.compensate("x", {"cost": "-2.50"}, "refund", reference="RF-1")
        eventually("applied in the ledger", lambda: committed(sdk)["cost"] == Decimal("1.5"))
        entry = ledger_line(sdk, "x")
        assert entry is not None and [c.key for c in entry.compensations] == [
            sdk.get("x").spec.compensations[0].key
        ], "the record is written with the totals it moved, in the ledger"
        assert sdk.get("x").status.compensations == []  # its mirror was refused
        first.kill()
    finally:
        cluster.kubectl("delete", "-f", "-", "--ignore-not-found", input=blocker)
    eventually("the blocker gone", lambda: not status_writes_refused(cluster, ns), 60, 1)
    start_operator()
    eventually("mirrored", lambda: len(sdk.get("x").status.compensations) == 1)
    eventually("retired from the envelope again", lambda: not in_flight(sdk, "x"))
    steady(sdk, {"tokens": Decimal(30), "cost": Decimal("1.5")}, seconds=5)
