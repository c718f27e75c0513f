"""One contract per resource (issue 22), through real objects, the real API server, the real
kube-scheduler and the real operator.

- Reusable (GPU devices, concurrency permits): in use while a claim holds it, all of R back
  when the claim ends, whatever its outcome; for devices once the scheduler confirms the
  allocation is gone. Reported usage is recorded as occupancy, never charged.
- Consumable (tokens): C committed, R − C returned, once.
- Replenishing (a provider's requests per window): C committed into the window, back once
  the window has passed, never earlier.

Each test is written to fail on the old rule (every resource a consumable): a second 8-GPU
branch, a third pair of permits, a request after the window would wait forever.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from reservoir.core.model import (
    TERMINAL_PHASES,
    ChildEntry,
    ClaimPhase,
    ReservationEnvelopeStatus,
)
from reservoir.sdk import ClaimView, Reservoir, workload_pod
from tests.clusters import ClusterHandle
from tests.integration.conftest import OperatorProcess
from tests.integration.helpers import eventually, ledger_line, records, wait_phase

GPU = "nvidia.com/gpu"
PARTS = ("capacity", "committed", "reserved", "reconciling", "lent", "borrowed", "available")
HOLDING = frozenset(ClaimPhase) - TERMINAL_PHASES - {ClaimPhase.PENDING}


# --- objects and readings -----------------------------------------------------------------


def make_envelope(
    cluster: ClusterHandle,
    ns: str,
    name: str,
    capacity: dict[str, str],
    contracts: dict[str, Any] | None = None,
    parent: str | None = None,
) -> None:
    spec: dict[str, Any] = {"capacity": capacity, "policy": {"defaultLeaseSeconds": 300}}
    if contracts:
        spec["contracts"] = contracts
    if parent:
        spec["parent"] = parent
    body = {
        "apiVersion": "reservoir.dev/v1alpha1",
        "kind": "ReservationEnvelope",
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
    }
    cluster.kubectl("create", "-f", "-", input=json.dumps(body))


def status_of(sdk: Reservoir, envelope: str) -> ReservationEnvelopeStatus:
    return sdk.ledger(envelope).status


def totals_of(status: ReservationEnvelopeStatus, resource: str) -> dict[str, Decimal]:
    """{'capacity': 8, 'committed': 0, ...} for one resource of an envelope's ledger."""
    return {part: getattr(status.totals, part).get(resource, Decimal(0)) for part in PARTS}


def balanced(status: ReservationEnvelopeStatus, resource: str) -> bool:
    """committed + reserved + reconciling + lent + available == capacity + borrowed."""
    t = totals_of(status, resource)
    held = t["committed"] + t["reserved"] + t["reconciling"] + t["lent"] + t["available"]
    return held == t["capacity"] + t["borrowed"]


def ledger_reaches(
    sdk: Reservoir, envelope: str, resource: str, within: float = 30, **expected: int
) -> ReservationEnvelopeStatus:
    """Wait until the envelope's ledger shows `expected` for `resource` (balanced)."""

    def reached() -> ReservationEnvelopeStatus | None:
        status = status_of(sdk, envelope)
        t = totals_of(status, resource)
        if all(t[part] == Decimal(value) for part, value in expected.items()):
            assert balanced(status, resource), (resource, t)
            return status
        return None

    found = eventually(f"{envelope}'s {resource} to show {expected}", reached, timeout=within)
    assert found is not None
    return found


def nonzero(resources: dict[str, Decimal]) -> dict[str, Decimal]:
    """A recorded map without its zero entries (a Reusable resource may record C = 0)."""
    return {name: value for name, value in resources.items() if value}


def pod(cluster: ClusterHandle, ns: str, name: str) -> dict[str, Any]:
    out = cluster.kubectl("get", "pod", name, "-n", ns, "--ignore-not-found", "-o", "json")
    return json.loads(out) if out.strip() else {}


def placeholders(cluster: ClusterHandle, ns: str) -> str:
    selector = "reservoir.dev/placeholder-for"
    return cluster.kubectl("get", "pods", "-n", ns, "-l", selector, "-o", "name").strip()


def run_gpu_branch(
    cluster: ClusterHandle,
    ns: str,
    sdk: Reservoir,
    envelope: str,
    name: str,
    requests: dict[str, str],
    usage: dict[str, str],
    busy_seconds: float = 2,
) -> tuple[ClaimView, float, float]:
    """One GPU branch as examples/gpu_branch.py runs it: devices held by a placeholder,
    handed to a gated workload pod, the usage reported, the pod gone, the devices
    confirmed free. Returns the settled claim and the bounds (seconds) of how long it
    held its devices: at least from when it was seen held to when it finished, at most
    from its creation to when its devices were seen free."""
    gpus = int(requests[GPU])
    created = time.monotonic()
    sdk.hold(envelope, name, requests, name=name)
    view = wait_phase(sdk, name, "Tentative", within=60)
    seen_held = time.monotonic()
    placement = view.status.placement
    assert placement is not None and placement.node, f"{name}: no devices held"
    assert len(placement.devices) == gpus, placement
    assert placeholders(cluster, ns), f"{name}: no placeholder pod holds its devices"

    worker = f"{name}-worker"
    template = {
        "metadata": {"name": worker},
        "spec": {"containers": [{"name": "work", "image": "registry.k8s.io/pause:3.10"}]},
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(workload_pod(view, template)))
    committed = sdk.wait(name, condition="Committed", within=60)
    line = ledger_line(sdk, committed)
    assert line is not None and line.handed_off_at is not None
    node = eventually(
        f"{worker} bound", lambda: pod(cluster, ns, worker).get("spec", {}).get("nodeName")
    )
    assert node == placement.node  # the same devices, handed over
    eventually(f"{name}'s placeholder gone", lambda: not placeholders(cluster, ns))

    time.sleep(busy_seconds)  # the branch works on its devices
    sdk.finish(sdk.get(name), usage)  # as examples/gpu_branch.py reports it
    finished = time.monotonic()
    settled = wait_phase(sdk, name, "Consumed", within=60)
    assert settled.status.placement is not None
    assert not settled.status.placement.devices_released  # the pod still runs on them
    cluster.kubectl("delete", "pod", worker, "-n", ns, "--wait=false")
    freed = sdk.wait(name, condition="DevicesReleased", within=60)
    return freed, finished - seen_held, time.monotonic() - created


def occupancy(sdk: Reservoir, claim: str, resource: str) -> Decimal:
    return eventually(
        f"{claim}'s occupancy of {resource}",
        lambda: sdk.get(claim).status.occupancy.get(resource),
    )


# --- 1. an 8-GPU envelope runs 8-GPU branches one after another, for good ------------------


def test_an_8_gpu_envelope_runs_three_8_gpu_branches_in_sequence(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    make_envelope(cluster, ns, "fine-tune", {GPU: "8"})
    ledger_reaches(sdk, "fine-tune", GPU, capacity=8, available=8)
    assert status_of(sdk, "fine-tune").contracts.get(GPU) == "Reusable"  # by default

    for i in range(3):
        name = f"train-{i}"
        claim, at_least, at_most = run_gpu_branch(
            cluster, ns, sdk, "fine-tune", name, {GPU: "8"}, {GPU: "8"}
        )
        # The whole envelope, back as soon as the allocation is gone: nothing committed.
        status = ledger_reaches(
            sdk, "fine-tune", GPU,
            available=8, committed=0, reserved=0, reconciling=0,
        )  # fmt: skip
        record = records(sdk, "fine-tune")[name]
        assert record.consumed.get(GPU, Decimal(0)) == 0, record.consumed
        assert record.released.get(GPU) == 8, record.released
        assert record.overrun is None
        # The usage is recorded, not charged; the device-seconds are its occupancy.
        assert claim.status.usage.get(GPU) == 8
        seconds = occupancy(sdk, name, GPU)
        assert 8 * (int(at_least) - 1) <= seconds <= 8 * (int(at_most) + 2), (
            f"{name}: {seconds} device-seconds for 8 GPUs held {at_least:.1f}s to {at_most:.1f}s"
        )
        assert status.peak.get(GPU) == 8

    # Nothing was spent: another whole-envelope branch is admitted at once.
    sdk.hold("fine-tune", "again", {GPU: "8"}, name="again")
    wait_phase(sdk, "again", "Tentative", within=60)
    sdk.cancel(sdk.get("again"))
    wait_phase(sdk, "again", "Released")


# --- 2. concurrency permits are reusable ---------------------------------------------------


def test_a_concurrency_2_envelope_runs_ten_branches_two_at_a_time(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    """Ten branches queue on two permits; each pair ends differently (completed with its
    usage reported, failed, pruned before dispatch), and every outcome returns its
    permit. Never more than two hold at once: at every look at the ledger, and in the
    recorded admission and settlement times of all ten."""
    make_envelope(cluster, ns, "agents", {"concurrency": "2"})
    ledger_reaches(sdk, "agents", "concurrency", capacity=2, available=2)
    names = [f"b{i}" for i in range(10)]
    for name in names:
        sdk.hold("agents", name, {"concurrency": "1"}, name=name)

    done: set[str] = set()
    most = 0

    def holding() -> list[str]:
        """The claims the ledger says hold a permit now (checked on every look)."""
        nonlocal most
        status = status_of(sdk, "agents")
        held = sorted(e.claim for e in records(sdk, "agents").values() if e.phase in HOLDING)
        t = totals_of(status, "concurrency")
        most = max(most, len(held), int(t["reserved"] + t["reconciling"]))
        assert len(held) <= 2, f"more than two hold a permit: {held}"
        assert t["reserved"] + t["reconciling"] <= 2, t
        assert t["committed"] == 0, t  # a permit is never spent
        assert balanced(status, "concurrency"), t
        return held

    for round_ in range(5):
        want = min(2, len(names) - len(done))

        def next_pair(want: int = want, done: frozenset[str] = frozenset(done)) -> list[str]:
            held = holding()
            return held if len(held) == want and not set(held) & done else []

        pair = eventually(f"round {round_}: {want} branches holding", next_pair, timeout=60)
        waiting = [n for n in names if n not in done and n not in pair]
        for name in waiting:  # the rest wait, and say for what
            view = sdk.get(name)
            assert view.phase.value == "Pending", (name, view.phase)
        if waiting:
            reason = eventually(
                "a waiting branch's reason",
                lambda first=waiting[0]: sdk.get(first).status.queue_reason,
            )
            assert "concurrency" in reason, reason
        first, second = pair
        sdk.finish(sdk.dispatch(sdk.get(first)), {"concurrency": "1"})
        if round_ % 2:
            sdk.finish(sdk.dispatch(sdk.get(second)), {"concurrency": "1"}, outcome="Failed")
        else:
            sdk.cancel(sdk.get(second))
        for name in pair:
            eventually(f"{name} settled", lambda name=name: sdk.get(name).settled)
            holding()
        done |= set(pair)

    status = ledger_reaches(
        sdk, "agents", "concurrency", available=2, committed=0, reserved=0, reconciling=0
    )
    assert most == 2
    assert status.peak.get("concurrency") == 2
    settled = records(sdk, "agents")
    assert sorted(settled) == sorted(names)
    for name, record in settled.items():
        assert record.consumed.get("concurrency", Decimal(0)) == 0, (name, record.consumed)
        assert record.released.get("concurrency") == 1, (name, record.released)
    # The recorded facts agree: at no instant did three claims hold a permit.
    spans = sorted(
        (r.first_reserved_at, r.settlement.at)
        for r in settled.values()
        if r.first_reserved_at is not None and r.settlement is not None
    )
    assert len(spans) == 10
    for i, (start, _) in enumerate(spans):
        overlapping = [s for s, e in spans[: i + 1] if s <= start < e]
        assert len(overlapping) <= 2, f"three held at {start}: {spans}"


# --- 3. a provider's rate limit refills after its window -----------------------------------

WINDOW = 15
B_AFTER_A = 5  # seconds: more than a slice (WINDOW / 12), so b's request returns later


def test_a_replenishing_budget_refuses_past_its_limit_and_admits_again_after_the_window(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    contracts = {"requests": {"type": "Replenishing", "windowSeconds": WINDOW}}
    make_envelope(cluster, ns, "provider", {"requests": "3"}, contracts)
    status = ledger_reaches(sdk, "provider", "requests", capacity=3, available=3)
    assert status.contracts.get("requests") == "Replenishing"

    # a reserves 2 and uses 1: the unused 1 comes back at once, the used 1 a window later.
    sdk.hold("provider", "a", {"requests": "2"}, name="a", dispatch=True)
    wait_phase(sdk, "a", "Committed")
    sdk.finish(sdk.get("a"), {"requests": "1"})
    a = wait_phase(sdk, "a", "Consumed")
    status = ledger_reaches(sdk, "provider", "requests", committed=1, reserved=0, available=2)
    assert a.settlement is not None
    a_settled = a.settlement.at
    slices = status.windows.get("requests", [])
    assert sum(s.amount for s in slices) == 1, slices
    for piece in slices:  # never early, at most one slice late
        assert piece.returns_at >= a_settled + timedelta(seconds=WINDOW), (a_settled, piece)
        assert piece.returns_at <= a_settled + timedelta(seconds=WINDOW * 13 / 12 + 1), piece

    # b uses all it reserved, in a later slice of the window: the limit is reached.
    time.sleep(B_AFTER_A)
    sdk.hold("provider", "b", {"requests": "2"}, name="b", dispatch=True)
    wait_phase(sdk, "b", "Committed")
    sdk.finish(sdk.get("b"), {"requests": "2"})
    wait_phase(sdk, "b", "Consumed")
    status = ledger_reaches(sdk, "provider", "requests", committed=3, reserved=0, available=0)
    slices = sorted(status.windows["requests"], key=lambda s: s.returns_at)
    assert [s.amount for s in slices] == [1, 2], slices  # a's slice, then b's
    first_return = slices[0].returns_at
    assert status.peak.get("requests") == 3

    # d is refused while the window is full, and says why.
    sdk.hold("provider", "d", {"requests": "1"}, name="d")
    reason = eventually("d's queue reason", lambda: sdk.get("d").status.queue_reason)
    assert "requests" in reason, reason
    while datetime.now(UTC) < first_return - timedelta(seconds=0.5):
        assert sdk.get("d").phase.value == "Pending", "admitted before the window passed"
        assert status_of(sdk, "provider").windows.get("requests"), "the window emptied early"
        time.sleep(0.5)

    # ... and admitted once a's request has left the window.
    wait_phase(sdk, "d", "Tentative", within=WINDOW + 10)
    d = ledger_line(sdk, "d")
    assert d is not None and d.first_reserved_at is not None
    assert d.first_reserved_at >= first_return, (d.first_reserved_at, first_return)
    assert d.first_reserved_at >= a_settled + timedelta(seconds=WINDOW)
    status = ledger_reaches(sdk, "provider", "requests", committed=2, reserved=1, available=0)
    assert sum(s.amount for s in status.windows["requests"]) == 2

    # Pruned: its 1 returns at once; b's 2 a window after b.
    sdk.cancel(sdk.get("d"))
    wait_phase(sdk, "d", "Released")
    status = ledger_reaches(
        sdk, "provider", "requests", within=WINDOW + 10, committed=0, reserved=0, available=3
    )
    assert not status.windows.get("requests")


# --- 4. a child returns its reusable capacity in full ---------------------------------------


def test_a_child_envelope_returns_its_gpus_and_permits_in_full_and_settles_its_tokens(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    make_envelope(cluster, ns, "team", {GPU: "8", "concurrency": "4", "tokens": "1000"})
    ledger_reaches(sdk, "team", GPU, available=8)
    make_envelope(
        cluster, ns, "sub", {GPU: "8", "concurrency": "2", "tokens": "400"}, parent="team"
    )
    ledger_reaches(sdk, "sub", GPU, capacity=8, available=8)
    ledger_reaches(sdk, "team", GPU, reserved=8, available=0, committed=0)
    ledger_reaches(sdk, "team", "concurrency", reserved=2, available=2, committed=0)
    ledger_reaches(sdk, "team", "tokens", reserved=400, available=600, committed=0)

    run_gpu_branch(
        cluster, ns, sdk, "sub", "train",
        {GPU: "4", "concurrency": "1", "tokens": "100"},
        {GPU: "4", "concurrency": "1", "tokens": "60"},
        busy_seconds=0,
    )  # fmt: skip
    sdk.hold("sub", "eval", {"concurrency": "1", "tokens": "50"}, name="eval", dispatch=True)
    wait_phase(sdk, "eval", "Committed")
    sdk.finish(sdk.get("eval"), {"concurrency": "1", "tokens": "30"})
    wait_phase(sdk, "eval", "Consumed")
    ledger_reaches(sdk, "sub", GPU, committed=0, reserved=0, available=8)
    ledger_reaches(sdk, "sub", "concurrency", committed=0, reserved=0, available=2)
    ledger_reaches(sdk, "sub", "tokens", committed=90, reserved=0, available=310)
    # While the child is open its capacity is held in the parent, not spent.
    ledger_reaches(sdk, "team", GPU, reserved=8, committed=0)

    cluster.kubectl(
        "patch", "renv", "sub", "-n", ns, "--type=merge", "-p", '{"spec": {"state": "Closed"}}'
    )

    def closed_status() -> ReservationEnvelopeStatus | None:
        status = status_of(sdk, "sub")
        return status if status.phase.value == "Closed" else None

    closed = eventually("sub closed", closed_status, timeout=60)
    assert closed.balance_released == {
        GPU: Decimal(8),
        "concurrency": Decimal(2),
        "tokens": Decimal(310),
    }
    ledger_reaches(sdk, "team", GPU, committed=0, reserved=0, available=8)
    ledger_reaches(sdk, "team", "concurrency", committed=0, reserved=0, available=4)
    ledger_reaches(sdk, "team", "tokens", committed=90, reserved=0, available=910)

    def settled_line() -> ChildEntry | None:
        parent = status_of(sdk, "sub").parent
        return parent.settled if parent is not None else None

    line = eventually("sub's settled line", settled_line)
    assert nonzero(line.consumed) == {"tokens": Decimal(90)}, line.consumed  # only the consumable
    assert line.released == {GPU: Decimal(8), "concurrency": Decimal(2), "tokens": Decimal(310)}

    # Returned for good: a second child takes all the parent's GPUs and permits.
    make_envelope(
        cluster, ns, "sub2", {GPU: "8", "concurrency": "4", "tokens": "100"}, parent="team"
    )
    ledger_reaches(sdk, "sub2", GPU, capacity=8, available=8)
    ledger_reaches(sdk, "team", "concurrency", reserved=4, available=0, committed=0)


# --- 5. one claim, three contracts ----------------------------------------------------------


def test_a_mixed_claim_settles_each_resource_by_its_own_contract(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    contracts = {"requests": {"type": "Replenishing", "windowSeconds": 600}}
    capacity = {"concurrency": "2", GPU: "8", "tokens": "1000", "requests": "10"}
    make_envelope(cluster, ns, "mixed", capacity, contracts)
    status = ledger_reaches(sdk, "mixed", "tokens", capacity=1000, available=1000)
    assert status.contracts == {
        "concurrency": "Reusable", GPU: "Reusable", "tokens": "Consumable",
        "requests": "Replenishing",
    }  # fmt: skip
    for pair in (f"{GPU}=Reusable", "tokens=Consumable", "requests=Replenishing"):
        assert pair in status.summary.contracts, status.summary.contracts

    requests = {"concurrency": "1", GPU: "2", "tokens": "300", "requests": "4"}
    usage = {"concurrency": "1", GPU: "2", "tokens": "120", "requests": "3"}
    sdk.hold("mixed", "all", requests, name="all")
    view = wait_phase(sdk, "all", "Tentative", within=60)
    template = {
        "metadata": {"name": "all-worker"},
        "spec": {"containers": [{"name": "work", "image": "registry.k8s.io/pause:3.10"}]},
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(workload_pod(view, template)))
    sdk.wait("all", condition="Committed", within=60)
    time.sleep(1.5)  # held a measurable while
    sdk.finish(sdk.get("all"), usage)
    wait_phase(sdk, "all", "Consumed")

    # Settled, with its pod still on the devices: the permit is back, the tokens settled
    # R − C, the requests sit in the window, and only the GPUs still wait for the scheduler.
    ledger_reaches(sdk, "mixed", "concurrency", committed=0, reserved=0, available=2)
    ledger_reaches(sdk, "mixed", "tokens", committed=120, reserved=0, available=880)
    status = ledger_reaches(sdk, "mixed", "requests", committed=3, reserved=0, available=7)
    assert sum(s.amount for s in status.windows["requests"]) == 3
    gpus = totals_of(status_of(sdk, "mixed"), GPU)
    assert gpus["available"] == 6 and gpus["committed"] == 0, gpus

    cluster.kubectl("delete", "pod", "all-worker", "-n", ns, "--wait=false")
    sdk.wait("all", condition="DevicesReleased", within=60)
    ledger_reaches(sdk, "mixed", GPU, committed=0, reserved=0, reconciling=0, available=8)
    record = records(sdk, "mixed")["all"]
    assert nonzero(record.consumed) == {"tokens": Decimal(120), "requests": Decimal(3)}, (
        record.consumed
    )
    assert record.released == {
        "concurrency": Decimal(1), GPU: Decimal(2), "tokens": Decimal(180),
        "requests": Decimal(1),
    }, record.released  # fmt: skip

    def recorded_occupancy() -> dict[str, Decimal] | None:
        found = sdk.get("all").status.occupancy
        return found if GPU in found else None

    held = eventually("the occupancy of its reusable resources", recorded_occupancy)
    assert set(nonzero(held)) == {"concurrency", GPU}, held  # never tokens or requests
    # R x seconds: 2 GPUs held at least as long as the one permit.
    assert held["concurrency"] > 0 and held[GPU] >= 2 * held["concurrency"], held


# --- 6. a child keeps its parent's contracts -------------------------------------------------


def test_a_child_declaring_another_contract_than_its_parent_waits_with_the_reason(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    """A parent's tokens are Consumable; a child declaring them Replenishing would return
    to its parent, a window later, what the parent counts as spent: it is not admitted."""
    make_envelope(cluster, ns, "planner", {"tokens": "100"})
    ledger_reaches(sdk, "planner", "tokens", available=100)
    replenishing = {"tokens": {"type": "Replenishing", "windowSeconds": 60}}
    make_envelope(cluster, ns, "odd", {"tokens": "10"}, replenishing, parent="planner")
    make_envelope(cluster, ns, "even", {"tokens": "10"}, parent="planner")

    seen: list[str] = []  # what odd showed, for the failure message

    def mismatch() -> str | None:
        status = status_of(sdk, "odd")
        seen.append(f"{status.phase.value}: {status.queue_reason}")
        reason = status.queue_reason or ""
        return reason if status.phase.value == "Pending" and "ContractMismatch" in reason else None

    try:
        reason = eventually("odd to wait on the mismatch", mismatch)
    except AssertionError as error:
        raise AssertionError(f"{error}; odd showed {sorted(set(seen))}") from None
    # e.g. "ReservationEnvelope planner cannot admit it: ContractMismatch: its parent keeps
    # tokens under another contract"
    assert "ContractMismatch" in reason and "tokens" in reason and "planner" in reason, reason
    ledger_reaches(sdk, "planner", "tokens", reserved=10, available=90)  # even's only
    time.sleep(2)
    assert status_of(sdk, "odd").phase.value == "Pending"
    assert status_of(sdk, "even").phase.value == "Open"


# --- 7. a tenant pool: reusable capacity back in full, consumables settled ------------------


def test_a_pool_gets_its_permits_back_in_full_when_an_envelope_closes(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    cluster.kubectl(
        "wait", "--for=condition=Established", "crd/reservationpools.reservoir.dev",
        "--timeout=60s",
    )  # fmt: skip
    pool = f"contracts-{ns}"
    body = {
        "apiVersion": "reservoir.dev/v1alpha1",
        "kind": "ReservationPool",
        "metadata": {"name": pool},
        "spec": {"capacity": {"concurrency": "2", "tokens": "100"}, "namespaces": [ns]},
    }
    cluster.kubectl("create", "-f", "-", input=json.dumps(body))

    def pool_totals(resource: str) -> dict[str, Decimal]:
        totals = sdk.pool(pool).status.totals
        return {part: getattr(totals, part).get(resource, Decimal(0)) for part in PARTS}

    def pool_reaches(resource: str, **expected: int) -> None:
        eventually(
            f"pool's {resource} to show {expected}",
            lambda: all(pool_totals(resource)[k] == v for k, v in expected.items()),
        )

    try:
        make_envelope(cluster, ns, "first", {"concurrency": "2", "tokens": "60"})
        ledger_reaches(sdk, "first", "concurrency", capacity=2, available=2)
        pool_reaches("concurrency", reserved=2, available=0, committed=0)
        sdk.hold("first", "work", {"concurrency": "1", "tokens": "50"}, name="work", dispatch=True)
        wait_phase(sdk, "work", "Committed")
        sdk.finish(sdk.get("work"), {"concurrency": "1", "tokens": "20"})
        wait_phase(sdk, "work", "Consumed")
        cluster.kubectl(
            "patch", "renv", "first", "-n", ns, "--type=merge",
            "-p", '{"spec": {"state": "Closed"}}',
        )  # fmt: skip
        pool_reaches("concurrency", committed=0, reserved=0, available=2)
        pool_reaches("tokens", committed=20, reserved=0, available=80)
        assert sdk.pool(pool).status.contracts.get("concurrency") == "Reusable"

        # Both permits again, for the next root envelope of the tenant.
        make_envelope(cluster, ns, "second", {"concurrency": "2", "tokens": "80"})
        ledger_reaches(sdk, "second", "concurrency", capacity=2, available=2)
        pool_reaches("concurrency", reserved=2, available=0, committed=0)
        pool_reaches("tokens", committed=20, reserved=80, available=0)
    finally:
        for name in ("first", "second"):
            cluster.kubectl("delete", "renv", name, "-n", ns, "--wait=false", "--ignore-not-found")
        cluster.kubectl("delete", "rpool", pool, "--wait=false", "--ignore-not-found")
