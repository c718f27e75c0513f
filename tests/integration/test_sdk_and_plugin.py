"""The SDK's guarantees and the kubectl plugin, as a user meets them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from reservoir.sdk import LeaseUncertainError, Reservoir
from tests.clusters import ClusterHandle
from tests.integration.conftest import OperatorProcess
from tests.integration.helpers import create_envelope, eventually, wait_phase

REPO = Path(__file__).resolve().parents[2]


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
    assert generation(cluster, ns, "x") == before
    holder = cluster.kubectl("get", "lease", "x", "-n", ns, "-o", "jsonpath={.spec.holderIdentity}")
    assert holder == sdk.get(claim).spec.lease.holder


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


def plugin(cluster: ClusterHandle, ns: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "KUBECONFIG": str(cluster.kubeconfig_path),
        "PATH": f"{REPO / '.venv' / 'bin'}:{Path.home() / '.cache/reservoir/bin/current'}:"
        + os.environ.get("PATH", ""),
    }
    return subprocess.run(
        ["kubectl", "reservoir", "-n", ns, *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_kubectl_plugin_drives_a_claim_and_prints_the_ledger(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100k", "cost": "5"}, defaultLeaseSeconds=60)
    held = plugin(cluster, ns, "hold", "wf", "search", "tokens=20k", "cost=1", "--name", "s")
    assert held.returncode == 0, held.stderr
    wait_phase(sdk, "s", "Tentative")
    for verb in (["dispatch", "s"], ["renew", "s"], ["usage", "s", "tokens=5k"]):
        done = plugin(cluster, ns, *verb)
        assert done.returncode == 0, done.stderr
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
