"""Why a claim waits, against the real API server and operator (--queue-reason-after).

A claim reads Pending from its creation (the CRD's default status), before any write. A
claim that only waits its turn (behind a shortage, at a cap) is told why once it has
waited the operator's --queue-reason-after; one admitted sooner costs no status write for
its wait; a problem is told at once."""

from __future__ import annotations

import time

from reservoir.sdk import Reservoir
from tests.clusters import ClusterHandle
from tests.integration.conftest import StartOperator
from tests.integration.helpers import create_envelope, eventually, wait_phase

AFTER = 6  # seconds: long enough to look, short enough to wait for


def test_a_new_claim_reads_pending_before_the_operator_wrote_anything(
    cluster: ClusterHandle, ns: str, sdk: Reservoir
) -> None:
    """No operator runs: the status is the CRD's default, on create and on read."""
    created = sdk.hold("nowhere", "a", {"tokens": "1"}, name="a")
    assert created.status.phase.value == "Pending" and created.status.queue_reason is None
    stored = cluster.kubectl("get", "bclaim", "a", "-n", ns, "-o", "jsonpath={.status}")
    assert stored == '{"phase":"Pending"}'


def test_a_claim_that_waits_its_turn_is_told_why_only_after_a_while(
    cluster: ClusterHandle, ns: str, start_operator: StartOperator, sdk: Reservoir
) -> None:
    start_operator(f"--queue-reason-after={AFTER}")
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=120)
    big = wait_phase(sdk, sdk.hold("wf", "big", {"tokens": "80"}, name="big"), "Tentative")
    # Admitted sooner than AFTER: never told why it waited (no status write for its wait).
    quick = sdk.hold("wf", "quick", {"tokens": "50"}, name="quick")
    seen = []
    for _ in range(10):
        seen.append(sdk.get(quick).status.queue_reason)
        time.sleep(0.2)
    sdk.cancel(big)
    quick = wait_phase(sdk, quick, "Tentative")
    assert seen == [None] * 10 and quick.status.queue_reason is None, seen

    # Waits longer than AFTER: Pending alone, then told why.
    later = sdk.hold("wf", "later", {"tokens": "90"}, name="later")
    born = time.monotonic()
    history: list[tuple[float, str | None]] = []

    def told() -> str | None:
        view = sdk.get(later)
        assert view.status.phase.value == "Pending"
        history.append((time.monotonic() - born, view.status.queue_reason))
        return view.status.queue_reason

    reason = eventually("the waiting claim to be told why", told, timeout=AFTER + 20)
    assert "InsufficientCapacity" in reason, reason
    untold = [t for t, r in history if r is None]
    assert untold and max(untold) >= AFTER - 2, f"told too soon: {history[:3]}"
    sdk.cancel(quick)
    wait_phase(sdk, later, "Tentative")


def test_a_problem_is_told_at_once(
    cluster: ClusterHandle, ns: str, start_operator: StartOperator, sdk: Reservoir
) -> None:
    start_operator("--queue-reason-after=600")
    claim = sdk.hold("missing", "a", {"tokens": "1"}, name="a")
    eventually(
        "the claim to say its envelope is missing",
        lambda: "EnvelopeNotFound" in (sdk.get(claim).status.queue_reason or ""),
        timeout=20,
    )
