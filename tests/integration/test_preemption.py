"""Preemption of tentative holds on the real control plane: an administrator's priority
class with preemptionPolicy PreemptLowerPriority takes room from a lower class's envelope
whose claims are all Tentative, and from none whose claim is past its commit point. The
preempted claim is released once, with reason Preempted, and says so; the worker's later
dispatch of it is refused; the workflow queues again with a new envelope."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from reservoir.sdk import Reservoir
from reservoir.sdk.errors import StaleClaimError
from tests.clusters import ClusterHandle
from tests.integration.conftest import StartOperator
from tests.integration.helpers import events_with_messages, eventually, wait_phase

POOL_MANIFEST = """
apiVersion: reservoir.dev/v1alpha1
kind: ReservationPool
metadata:
  name: {name}
spec:
  capacity: {{slots: "4"}}
  contracts:
    slots: {{type: Reusable}}
  namespaces: [{a}, {b}]
  priorityClasses:
    batch: {{value: 0}}
    urgent: {{value: 100, preemptionPolicy: PreemptLowerPriority}}
"""

ENVELOPE_MANIFEST = """
apiVersion: reservoir.dev/v1alpha1
kind: ReservationEnvelope
metadata:
  name: {name}
  namespace: {ns}
spec:
  capacity: {{slots: "{slots}"}}
  contracts:
    slots: {{type: Reusable}}
  priorityClassName: {klass}
"""


@pytest.fixture
def tenant_b(cluster: ClusterHandle, ns: str) -> Iterator[str]:
    name = f"{ns}-b"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false")


def apply(cluster: ClusterHandle, manifest: str) -> None:
    cluster.kubectl("apply", "-f", "-", input=manifest)


def envelope(cluster: ClusterHandle, ns: str, name: str, slots: int, klass: str) -> None:
    apply(cluster, ENVELOPE_MANIFEST.format(name=name, ns=ns, slots=slots, klass=klass))


def status(cluster: ClusterHandle, kind: str, name: str, ns: str | None = None) -> Any:
    where = ["-n", ns] if ns else []
    body = json.loads(cluster.kubectl("get", kind, name, *where, "-o", "json"))
    return body.get("status") or {}


def admitted(cluster: ClusterHandle, ns: str, name: str) -> bool:
    return bool((status(cluster, "renv", name, ns).get("parent") or {}).get("admittedAt"))


def test_a_high_class_preempts_tentative_holds_and_no_committed_one(
    cluster: ClusterHandle, ns: str, tenant_b: str, start_operator: StartOperator
) -> None:
    start_operator("-n", tenant_b)
    pool = f"pre-{uuid.uuid4().hex[:8]}"
    apply(cluster, POOL_MANIFEST.format(name=pool, a=ns, b=tenant_b))
    try:
        # Tenant a: one envelope holding a Tentative claim, one a Committed one.
        envelope(cluster, ns, "exploring", 2, "batch")
        envelope(cluster, ns, "running", 2, "batch")
        eventually("a's envelopes admitted", lambda: admitted(cluster, ns, "running"))
        eventually("a's envelopes admitted", lambda: admitted(cluster, ns, "exploring"))
        with Reservoir(namespace=ns, kubeconfig=str(cluster.kubeconfig_path)) as sdk:
            tentative = sdk.hold("exploring", "search", {"slots": "1"}, name="search")
            running = sdk.hold("running", "train", {"slots": "1"}, name="train")
            tentative = wait_phase(sdk, tentative, "Tentative")
            running = sdk.dispatch(wait_phase(sdk, running, "Tentative"))
            wait_phase(sdk, running, "Committed")

            # Tenant b's urgent envelope: the pool is full, its class may preempt.
            envelope(cluster, tenant_b, "incident", 2, "urgent")
            eventually(
                "b's urgent envelope admitted",
                lambda: admitted(cluster, tenant_b, "incident"),
                timeout=60,
            )

            preempted = wait_phase(sdk, tentative, "Released")
            line = status(cluster, "bclaim", "search", ns)["ledger"]
            assert line["settlement"]["reason"] == "Preempted", line["settlement"]
            assert line["history"][-1]["trigger"] == "Preemption", line["history"][-1]
            said = eventually(
                "the claim's Event",
                lambda: [
                    m for r, m in events_with_messages(cluster, ns, "search") if r == "Preempted"
                ],
            )
            assert f"{tenant_b}/incident" in said[0], said
            # As a user waits for it.
            cluster.kubectl(
                "wait", "bclaim/search", "-n", ns, "--for=condition=Settled", "--timeout=10s"
            )
            settled = [
                c
                for c in status(cluster, "bclaim", "search", ns)["conditions"]
                if c["type"] == "Settled"
            ]
            assert settled[0]["reason"] == "Preempted", settled
            exploring = status(cluster, "renv", "exploring", ns)
            assert exploring["preemption"]["outcome"] == "Preempted", exploring["preemption"]
            assert exploring["preemption"]["preemptor"] == f"{tenant_b}/incident"
            eventually(
                "the preempted envelope to close",
                lambda: status(cluster, "renv", "exploring", ns).get("phase") == "Closed",
            )

            # The committed branch goes on, never asked.
            assert sdk.get(running).ledger_phase.value == "Committed"
            assert "preemption" not in status(cluster, "renv", "running", ns)

            # The worker that held the preempted claim dispatches too late: refused.
            with pytest.raises(StaleClaimError):
                sdk.dispatch(preempted)
            assert sdk.get(preempted).ledger_phase.value == "Released"

            # Queue again: a new envelope waits in the pool's queue like any other.
            envelope(cluster, ns, "exploring-2", 2, "batch")
            eventually(
                "the new envelope to wait",
                lambda: status(cluster, "renv", "exploring-2", ns).get("phase") == "Pending",
            )
            assert status(cluster, "rpool", pool).get("preemptions", {}) == {}
            # When the committed branch finishes, its envelope's room goes to the queue.
            sdk.finish(running, {"slots": "1"})
            close = '{"spec": {"state": "Closed"}}'
            cluster.kubectl("patch", "renv", "running", "-n", ns, "--type=merge", "-p", close)
            eventually(
                "the new envelope admitted",
                lambda: admitted(cluster, ns, "exploring-2"),
                timeout=60,
            )
    finally:
        for where in (ns, tenant_b):
            cluster.kubectl("delete", "renv", "--all", "-n", where, "--wait=false")
        cluster.kubectl("delete", "rpool", pool, "--wait=false", "--ignore-not-found")
