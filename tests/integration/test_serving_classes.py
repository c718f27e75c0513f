"""Serving classes against the real API server and operator (issue 24; client-disconnect.txt:
interactive, batch and agentic work are different policy problems): the class presets the
envelope's policy, the envelope's own fields override it, and a class the operator does not
know is said on the envelope, nothing moved."""

from __future__ import annotations

import json
from typing import Any

from reservoir.sdk import Reservoir
from tests.clusters import ClusterHandle
from tests.integration.conftest import OperatorProcess
from tests.integration.helpers import eventually, ledger_line, wait_phase


def envelope(cluster: ClusterHandle, ns: str, name: str, **spec: Any) -> None:
    body = {
        "apiVersion": "reservoir.dev/v1alpha1",
        "kind": "ReservationEnvelope",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"capacity": {"tokens": "100"}, **spec},
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))


def lease_seconds(sdk: Reservoir, claim: str) -> float:
    line = ledger_line(sdk, claim)
    assert line is not None and line.expires_at and line.first_reserved_at
    return (line.expires_at - line.first_reserved_at).total_seconds()


def test_a_class_presets_the_policy_and_the_envelopes_own_fields_win(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    envelope(cluster, ns, "chat", servingClass="Interactive")
    envelope(cluster, ns, "tuned", servingClass="Interactive", policy={"defaultLeaseSeconds": 45})
    envelope(cluster, ns, "plain")
    stored = json.loads(cluster.kubectl("get", "renv", "plain", "-n", ns, "-o", "json"))
    assert "defaultLeaseSeconds" not in (stored["spec"].get("policy") or {}), "no default"
    for name in ("chat", "tuned", "plain"):
        wait_phase(sdk, sdk.hold(name, "b", {"tokens": "10"}, name=f"{name}-b"), "Tentative")
    assert lease_seconds(sdk, "chat-b") == 30, "the class's lease"
    assert lease_seconds(sdk, "tuned-b") == 45, "the envelope's own field wins"
    assert lease_seconds(sdk, "plain-b") == 60, "no class: the default"
    shown = cluster.kubectl("get", "renv", "chat", "-n", ns, "-o", "wide")
    assert "Interactive" in shown, shown


def test_a_class_the_operator_does_not_know_is_said_and_moves_nothing(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    envelope(cluster, ns, "gold", servingClass="Gold")
    sdk.hold("gold", "b", {"tokens": "10"}, name="b")

    def told() -> str:
        found = json.loads(cluster.kubectl("get", "renv", "gold", "-n", ns, "-o", "json"))
        conditions = (found.get("status") or {}).get("conditions") or []
        return " ".join(c.get("message", "") for c in conditions)

    said = eventually("the envelope says why", lambda: "no class 'Gold'" in told() and told())
    assert "known: Agentic, Batch, Interactive" in said
    assert sdk.get("b").phase == "Pending", "nothing admitted on a policy nobody knows"
    cluster.kubectl(
        "patch", "renv", "gold", "-n", ns, "--type=merge", "-p", '{"spec":{"servingClass":"Batch"}}'
    )
    wait_phase(sdk, "b", "Tentative")
    assert lease_seconds(sdk, "b") == 600, "Batch's lease"
