"""Crash and concurrency: a churn of a few hundred claims while the operator is killed with
SIGKILL at random moments (and, separately, while two operators run at once with peering
off). At the end every claim is settled exactly once and the invariant holds exactly."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

from reservoir.core.claimstatus import settled_record
from reservoir.core.model import TERMINAL_PHASES, BranchClaimStatus
from reservoir.sdk import Reservoir
from tests.clusters import ClusterHandle
from tests.integration.conftest import OperatorProcess, StartOperator
from tests.integration.helpers import (
    EVERY_SETTLEMENT,
    SETTLE_REASONS,
    create_envelope,
    eventually,
    run_branch,
)

CLAIMS = 200
WORKERS = 4


def churn(cluster: ClusterHandle, ns: str, chaos: Callable[[threading.Event], None]) -> None:
    create_envelope(
        cluster, ns, "churn", {"tokens": "1000000"}, defaultLeaseSeconds=10,
        maxActiveClaims=256, ambiguityDeadlineSeconds=10, atAmbiguityDeadline="Release",
    )  # fmt: skip
    declared: dict[str, str] = {}
    done = threading.Event()
    chaos_thread = threading.Thread(target=chaos, args=(done,), daemon=True)
    chaos_thread.start()

    def worker(slot: int) -> None:
        rng = random.Random(slot)
        with Reservoir(namespace=ns, kubeconfig=str(cluster.kubeconfig_path)) as sdk:
            for index in range(slot, CLAIMS, WORKERS):
                run_branch(sdk, "churn", f"c{index:03d}", index, rng, declared)

    with ThreadPoolExecutor(WORKERS) as pool:
        list(pool.map(worker, range(WORKERS)))
    done.set()
    chaos_thread.join()
    verify(cluster, ns, declared)


def claims_of(cluster: ClusterHandle, ns: str) -> list[dict[str, object]]:
    items: list[dict[str, object]] = json.loads(
        cluster.kubectl("get", "bclaim", "-n", ns, "-o", "json")
    )["items"]
    return items


def verify(cluster: ClusterHandle, ns: str, declared: dict[str, str]) -> None:
    def all_settled() -> bool:
        phases = [c.get("status", {}).get("phase") for c in claims_of(cluster, ns)]  # type: ignore[union-attr]
        return len(phases) == CLAIMS and all(p in TERMINAL_PHASES for p in phases)

    eventually("every claim to settle", all_settled, timeout=180, every=1)
    envelope = json.loads(cluster.kubectl("get", "renv", "churn", "-n", ns, "-o", "json"))
    status = envelope["status"]
    totals = {k: Decimal(v.get("tokens", "0")) for k, v in status["totals"].items()}
    # Each claim's record: its ledger entry, or the one its status carries once compacted.
    entries = {}
    for claim in claims_of(cluster, ns):
        meta = claim["metadata"]  # type: ignore[index]
        entry = status.get("entries", {}).get(meta["uid"])  # a move still in flight
        if entry is None:
            entry = (claim.get("status") or {}).get("ledger")  # type: ignore[union-attr]
        if entry is None:
            view = BranchClaimStatus.model_validate(claim["status"])  # type: ignore[index]
            record = settled_record(view, meta["uid"], meta["name"], 1)
            assert record is not None, f"{meta['name']}: no record anywhere"
            entry = record.to_api()
        entries[meta["uid"]] = entry
    assert len(entries) == CLAIMS

    # The invariant, exactly, and nothing left held.
    assert totals["reserved"] == 0 and totals["reconciling"] == 0
    assert totals["committed"] + totals["available"] == totals["capacity"]
    # Each claim settled once: the committed total is exactly the sum of the settlements,
    # and every settlement returned exactly R - C.
    consumed = [Decimal(e.get("consumed", {}).get("tokens", "0")) for e in entries.values()]
    assert totals["committed"] == sum(consumed)
    for entry in entries.values():
        r = Decimal(entry["reserved"].get("tokens", "0"))
        c = Decimal(entry.get("consumed", {}).get("tokens", "0"))
        assert c + Decimal(entry.get("released", {}).get("tokens", "0")) == r
        reason = entry["settlement"]["reason"]
        if reason in ("Completed", "SettledAfterDetach"):
            assert str(c) == declared[entry["claim"]], entry  # exactly the final report
        elif reason == "AmbiguityDeadlineRelease":
            # policy Release charges only the usage already reported, never more
            assert c == Decimal(entry.get("usage", {}).get("tokens", "0")), entry
        else:
            assert c == 0, entry  # nothing charged without usage
    # No claim's settlement was announced twice.
    events = json.loads(cluster.kubectl("get", "events", "-n", ns, "-o", "json"))["items"]
    announced: dict[str, int] = {}
    for event in events:
        if event["reason"] in SETTLE_REASONS and event["involvedObject"]["kind"] == "BranchClaim":
            name = event["involvedObject"]["name"]
            announced[name] = announced.get(name, 0) + event.get("count", 1)
    twice = {n: k for n, k in announced.items() if k > 1}
    assert not twice, f"settled more than once: {twice}"


def test_kill_9_the_operator_at_random_moments_during_churn(
    cluster: ClusterHandle, ns: str, start_operator: StartOperator
) -> None:
    current: list[OperatorProcess] = [start_operator(EVERY_SETTLEMENT)]
    rng = random.Random(7)

    def kill_and_restart(done: threading.Event) -> None:
        while not done.is_set():
            time.sleep(rng.uniform(0.5, 3.0))
            current[-1].kill()
            current.append(start_operator(EVERY_SETTLEMENT))

    churn(cluster, ns, kill_and_restart)
    assert len(current) > 3, "the operator was killed several times"


def test_two_operators_without_peering_never_settle_twice(
    cluster: ClusterHandle, ns: str, start_operator: StartOperator
) -> None:
    start_operator(EVERY_SETTLEMENT)
    start_operator(EVERY_SETTLEMENT)

    def nothing(done: threading.Event) -> None:
        done.wait()

    churn(cluster, ns, nothing)
