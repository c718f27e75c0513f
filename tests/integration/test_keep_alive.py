"""A worker's keep-alive against the real operator: renewals granted while it runs, and a
worker whose renewals go unconfirmed (the operator stopped: SIGSTOP) stops starting work
before its lease ends (lease-renewal.txt: "it should not launch new provider work after
lease validity becomes uncertain")."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import UTC, datetime

import pytest

from reservoir.sdk import LeaseUncertainError, Reservoir
from tests.clusters import ClusterHandle
from tests.integration.conftest import OperatorProcess
from tests.integration.helpers import create_envelope, settled_ledger, wait_phase


def test_a_kept_lease_is_renewed_while_the_worker_runs(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=6)
    claim = wait_phase(sdk, sdk.hold("wf", "x", {"tokens": "30"}, name="x"), "Tentative")
    with sdk.keep_alive(claim, margin=1.0) as lease:
        assert lease.valid and lease.claim.entry is not None
        time.sleep(14)  # more than two leases: renewed at a third of each
        assert lease.valid, "kept alive"
        renewals = sdk.get(claim).entry
        assert renewals is not None and renewals.renewals >= 3
        sdk.dispatch(sdk.get(claim))
    wait_phase(sdk, claim, "Committed")
    assert sdk.get(claim).status.lease is not None


def test_a_worker_whose_renewals_fail_stops_starting_work_before_its_lease_ends(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=12)
    claim = wait_phase(sdk, sdk.hold("wf", "x", {"tokens": "30"}, name="x"), "Tentative")
    lost = threading.Event()
    told: list[str] = []

    def on_lost(why: str) -> None:
        told.append(why)
        lost.set()

    with sdk.keep_alive(claim, margin=5.0, on_lost=on_lost, confirm_timeout=2.0) as lease:
        entry = lease.claim.entry
        assert entry is not None and entry.expires_at is not None
        os.killpg(operator.process.pid, signal.SIGSTOP)  # no renewal is granted any more
        try:
            assert lost.wait(timeout=30), "the keeper gave the lease up"
            at = datetime.now(UTC)
            current = sdk.get(claim).entry
            assert current is not None and current.expires_at is not None
            assert (current.expires_at - at).total_seconds() > 2, "given up before its end"
            assert not lease.valid and "uncertain" in told[0]
            with pytest.raises(LeaseUncertainError, match="do not start irreversible work"):
                lease.require()
            with pytest.raises(LeaseUncertainError, match="do not start irreversible work"):
                sdk.dispatch(sdk.get(claim))  # the ledger's lease has not ended: the keeper
            assert not sdk.get(claim).spec.dispatch
        finally:
            os.killpg(operator.process.pid, signal.SIGCONT)
    wait_phase(sdk, claim, "Expired", within=40)
    settled_ledger(sdk, "wf", reserved="0", available="100")


def test_a_kept_lease_is_given_up_as_soon_as_the_claim_is_cancelled(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    """Found by review: a claim Released while its lease was kept was vouched for until the
    next renewal, a third of the lease later; the keeper follows the claim itself."""
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=60)
    claim = wait_phase(sdk, sdk.hold("wf", "x", {"tokens": "30"}, name="x"), "Tentative")
    told: list[str] = []

    def on_lost(why: str) -> None:
        told.append(why)
        raise RuntimeError("a careless callback")  # logged, never let out

    with sdk.keep_alive(claim, on_lost=on_lost) as lease:
        sdk.cancel(sdk.get(claim))
        wait_phase(sdk, claim, "Released")
        deadline = time.monotonic() + 5
        while lease.valid and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not lease.valid, "given up with the claim, not at the next renewal"
        assert told and ("cancelled" in told[0] or "settled" in told[0]), told
        with pytest.raises(LeaseUncertainError):
            lease.require()
    assert not sdk._async.kept_leases, "forgotten on leaving the block"
