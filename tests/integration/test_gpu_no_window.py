"""No window, proven from the API server's own record (issue 8, DESIGN.md §7).

On a control plane of its own with the API server's audit log on, a real operator runs
GPU claims through hold → hand-off → release many times, with random timing and several
claims at once, while a competitor keeps ordinary `nvidia.com/gpu` pods pending at equal
and higher priority and kube-scheduler is killed and restarted once mid-hand-off. Then the
audit log, replayed in the API server's order, must show:

1. no device is ever in two allocations at once, across every ResourceClaim (the
   scheduler's extended-resource claims for the ordinary pods included);
2. each Reservoir ResourceClaim, from its allocation (before the placeholder's binding)
   until its last pod is gone, keeps the same allocation and a non-empty `reservedFor`;
3. each workload pod is bound to the node of its claim's allocation;
4. the competitor really competed (some of its pods were scheduled), and every round
   completed: the hand-off was recorded before the gate was lifted.

RESERVOIR_NO_WINDOW_ROUNDS sets the number of rounds (default 200).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from lightkube import ApiError, Client, KubeConfig
from lightkube.resources.core_v1 import Pod

from reservoir.sdk import Reservoir, workload_pod
from tests.integration.conftest import OperatorProcess
from tests.integration.helpers import create_envelope, eventually, ledger_line

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "hack"))

import localcluster  # noqa: E402
from localcluster import (  # noqa: E402
    ClusterState,
    LocalCluster,
    NodeShape,
    build_binaries,
    process_alive,
)
from localcluster import start as start_component  # noqa: E402

GPU = "nvidia.com/gpu"
NODES = 4
ROUNDS = int(os.environ.get("RESERVOIR_NO_WINDOW_ROUNDS", "200"))
WORKERS = 4
CANCEL_SHARE = 0.15  # rounds cancelled while Tentative, before any hand-off
COMPETITORS = {"no-window-equal": 0, "no-window-higher": 1000}  # PriorityClass -> value
PENDING_COMPETITORS = 1  # kept pending per PriorityClass
RESERVOIR_RC_PREFIX = "reservoir-"
PLACEHOLDER_PREFIX = "reservoir-hold-"
ROUND_TIMEOUT = 120.0
SEED = int(os.environ.get("RESERVOIR_NO_WINDOW_SEED", str(random.randrange(2**32))))

Event = dict[str, Any]
Device = tuple[str, str, str]


# --- the audited cluster -----------------------------------------------------------------


class AuditedCluster:
    """A LocalCluster with the audit log on, with the ClusterHandle surface the operator
    fixtures expect, and the means to restart one of its components."""

    def __init__(self, directory: Path) -> None:
        self.local = LocalCluster(directory, NodeShape(count=NODES), audit=True)
        self.local.up()
        self.kubeconfig_path = self.local.kubeconfig

    def kubectl(self, *args: str, input: str | None = None) -> str:
        return self.local.kubectl(*args, input=input)

    def delete(self) -> None:
        self.local.down(quiet=True)

    def restart_scheduler(self) -> None:
        """kill -9 kube-scheduler, then start it again the way `up` does."""
        component = "kube-scheduler"
        state = ClusterState.load(self.local.state_file)
        pid = state.pids[component]
        os.kill(pid, signal.SIGKILL)
        while process_alive(pid, component):
            time.sleep(0.05)
        time.sleep(random.uniform(0.5, 2.0))  # scheduler-less for a moment
        binaries = self.local.binaries or build_binaries()
        process = start_component(
            component, self.local.arguments(component, state.ports), binaries, self.local.logs
        )
        state.pids[component] = process.pid
        state.save(self.local.state_file)
        self.local.wait_ready(component, state.ports[component], process)


LOCAL_AUDIT_POLICY = localcluster.audit_policy


def audit_policy_with_ledger() -> dict[str, Any]:
    """The local cluster's audit policy, plus the ledger's writes (envelope status), so the
    record shows when each hand-off became a durable fact."""
    policy = LOCAL_AUDIT_POLICY()
    rules = policy["rules"]
    ledger = {
        "level": "Request",
        "verbs": localcluster.AUDITED_WRITES,
        "resources": [{"group": "reservoir.dev", "resources": ["reservationenvelopes/status"]}],
    }
    policy["rules"] = [*rules[:-1], ledger, rules[-1]]  # before the final catch-all None
    return policy


@pytest.fixture
def audited(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[AuditedCluster]:
    if request.config.getoption("--cluster") != "local":
        pytest.skip("starts a local control plane of its own, with the audit log on")
    monkeypatch.setattr(localcluster, "audit_policy", audit_policy_with_ledger)
    cluster = AuditedCluster(REPO / ".cluster" / f"no-window-{os.getpid()}")
    try:
        yield cluster
    finally:
        cluster.delete()


def prepare(cluster: AuditedCluster) -> str:
    """The CRDs, a namespace whose pods may be created, the competitors' PriorityClasses."""
    cluster.kubectl("apply", "-f", str(REPO / "crds"))
    for name in ("reservationenvelopes", "branchclaims"):
        eventually(
            f"the {name} CRD established",
            lambda n=name: (
                "True"
                in cluster.kubectl(
                    "get",
                    "crd",
                    f"{n}.reservoir.dev",
                    "-o",
                    "jsonpath={.status.conditions[?(@.type=='Established')].status}",
                )
            ),
        )
    ns = f"nw-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    eventually(
        "the namespace's default ServiceAccount",
        lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", ns, "--ignore-not-found"),
        timeout=60,
    )
    classes = [
        {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": name},
            "value": value,
        }
        for name, value in COMPETITORS.items()
    ]
    cluster.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": classes})
    )
    return ns


# --- the run -----------------------------------------------------------------------------


@dataclass
class Round:
    name: str
    gpus: int
    uid: str = ""
    node: str = ""
    cancelled: bool = False
    workload: str = ""
    handed_off_at: datetime | None = None
    done: bool = False


@dataclass
class Run:
    ns: str
    kubeconfig: Path
    rounds: list[Round] = field(default_factory=list)
    next_round: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)
    gated: threading.Event = field(default_factory=threading.Event)  # a hand-off under way
    errors: list[str] = field(default_factory=list)
    competitors_scheduled: list[tuple[str, str, str]] = field(default_factory=list)
    competitors_created: int = 0

    def take(self) -> Round | None:
        with self.lock:
            if self.next_round >= len(self.rounds) or self.stop.is_set():
                return None
            self.next_round += 1
            return self.rounds[self.next_round - 1]

    def client(self) -> Client:
        return Client(config=KubeConfig.from_file(self.kubeconfig), field_manager="no-window")


def pod_template(name: str, gpus: int) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {
            "terminationGracePeriodSeconds": random.choice([0, 1]),
            "containers": [
                {
                    "name": "work",
                    "image": "registry.k8s.io/pause:3.10",
                    "resources": {"limits": {GPU: str(gpus)}},
                }
            ],
        },
    }


def node_of(client: Client, ns: str, name: str) -> str | None:
    return client.get(Pod, name, namespace=ns).spec.nodeName  # type: ignore[union-attr]


def worker(run: Run, index: int) -> None:
    rng = random.Random(SEED + index)
    client = run.client()
    with Reservoir(namespace=run.ns, kubeconfig=str(run.kubeconfig)) as sdk:
        while (job := run.take()) is not None:
            try:
                one_round(run, sdk, client, rng, job)
            except Exception as error:  # reported by the test, which then fails
                run.errors.append(f"round {job.name}: {type(error).__name__}: {error}")
                run.stop.set()


def one_round(run: Run, sdk: Reservoir, client: Client, rng: random.Random, job: Round) -> None:
    claim = sdk.hold("gpus", job.name, {GPU: job.gpus}, name=job.name)
    job.uid = claim.uid
    view = sdk.wait(claim, phase="Tentative", within=ROUND_TIMEOUT)
    assert view.status.placement is not None
    job.node = view.status.placement.node
    time.sleep(rng.uniform(0, 0.4))
    if rng.random() < CANCEL_SHARE:
        sdk.cancel(view)
        sdk.wait(job.name, phase="Released", within=ROUND_TIMEOUT)
        job.cancelled = job.done = True
        return
    job.workload = f"w-{job.name}"
    client.create(Pod.from_dict(workload_pod(view, pod_template(job.workload, job.gpus))))
    run.gated.set()
    deadline = time.monotonic() + ROUND_TIMEOUT
    while not node_of(client, run.ns, job.workload):
        assert time.monotonic() < deadline, f"{job.workload} not bound in {ROUND_TIMEOUT}s"
        time.sleep(0.1)
    committed = sdk.wait(job.name, condition="Committed", within=ROUND_TIMEOUT)
    line = ledger_line(sdk, committed)
    assert line is not None
    job.handed_off_at = line.handed_off_at
    time.sleep(rng.uniform(0, 0.5))
    sdk.finish(committed, {GPU: job.gpus})
    sdk.wait(job.name, phase="Consumed", within=ROUND_TIMEOUT)
    time.sleep(rng.uniform(0, 0.3))
    client.delete(Pod, job.workload, namespace=run.ns)
    job.done = True


def competitor(run: Run) -> None:
    """Keep ordinary GPU pods pending at each PriorityClass: a pod that gets scheduled is
    recorded and deleted at once, and replaced a moment later (at once, the replacements
    would take every freed device and starve the claims: that proves nothing)."""
    rng = random.Random(SEED - 1)
    client = run.client()
    labels = {"no-window": "competitor"}
    due: dict[str, float] = dict.fromkeys(COMPETITORS, 0.0)  # class -> next creation
    while not run.stop.is_set():
        try:
            pending: dict[str, int] = dict.fromkeys(COMPETITORS, 0)
            for pod in client.list(Pod, namespace=run.ns, labels=labels):
                meta, spec = pod.metadata, pod.spec
                assert meta is not None and spec is not None and meta.name
                if meta.deletionTimestamp:
                    continue
                klass = str(spec.priorityClassName)
                if spec.nodeName:
                    run.competitors_scheduled.append((meta.name, klass, spec.nodeName))
                    client.delete(Pod, meta.name, namespace=run.ns, grace_period=0)
                    due[klass] = time.monotonic() + rng.uniform(0.5, 2.5)
                else:
                    pending[klass] += 1
            for klass, count in pending.items():
                if count >= PENDING_COMPETITORS or time.monotonic() < due[klass]:
                    continue
                run.competitors_created += 1
                body = {
                    "metadata": {
                        "name": f"c-{run.competitors_created:05d}",
                        "namespace": run.ns,
                        "labels": labels,
                    },
                    "spec": {
                        "priorityClassName": klass,
                        "terminationGracePeriodSeconds": 0,
                        "containers": [
                            {
                                "name": "main",
                                "image": "registry.k8s.io/pause:3.10",
                                "resources": {"limits": {GPU: str(rng.randint(1, 2))}},
                            }
                        ],
                    },
                }
                client.create(Pod.from_dict(body))
                due[klass] = time.monotonic() + rng.uniform(0.5, 2.5)
        except ApiError as error:
            if error.status.code not in (404, 409):
                run.errors.append(f"competitor: {error}")
        time.sleep(rng.uniform(0.1, 0.3))


def scheduler_restarter(run: Run, cluster: AuditedCluster, log: list[str]) -> None:
    """Once a third of the rounds are under way, kill kube-scheduler just after a workload
    pod was created behind its gate (mid-hand-off), and start it again."""
    while not run.stop.is_set() and run.next_round < len(run.rounds) // 3:
        time.sleep(0.2)
    run.gated.clear()
    while not run.stop.is_set():
        if run.gated.wait(timeout=0.5):
            time.sleep(random.uniform(0, 0.3))
            started = time.monotonic()
            cluster.restart_scheduler()
            log.append(f"kube-scheduler restarted in {time.monotonic() - started:.1f}s")
            return


# --- the audit log -----------------------------------------------------------------------


def audit_events(path: Path) -> list[Event]:
    """Successful writes, in the API server's order: by the time each request completed
    (blocking audit mode writes each event before its response), then by position."""
    events = []
    for position, line in enumerate(path.read_text().splitlines()):
        event = json.loads(line)
        if event.get("stage") != "ResponseComplete":
            continue
        if (event.get("responseStatus") or {}).get("code", 0) >= 300:
            continue
        event["_position"] = position
        events.append(event)
    events.sort(key=lambda e: (e["stageTimestamp"], e["_position"]))
    return events


def is_claim_write(event: Event) -> bool:
    ref = event["objectRef"]
    return ref.get("resource") == "resourceclaims" and ref.get("apiGroup") == "resource.k8s.io"


def is_binding(event: Event) -> bool:
    ref = event["objectRef"]
    return ref.get("resource") == "pods" and ref.get("subresource") == "binding"


def is_pod_write(event: Event) -> bool:
    ref = event["objectRef"]
    return ref.get("resource") == "pods" and not ref.get("subresource")


def claim_after(event: Event) -> dict[str, Any] | None:
    """The ResourceClaim as this write left it; None once it is gone."""
    body = event.get("responseObject") or {}
    if body.get("kind") != "ResourceClaim":
        return None if event["verb"] in ("delete", "deletecollection") else {}
    meta = body.get("metadata") or {}
    if meta.get("deletionTimestamp") and not meta.get("finalizers"):
        return None
    return body


def devices_of(allocation: dict[str, Any] | None) -> set[Device]:
    results = ((allocation or {}).get("devices") or {}).get("results") or []
    return {(r["driver"], r["pool"], r["device"]) for r in results}


def node_of_allocation(allocation: dict[str, Any]) -> str | None:
    for term in (allocation.get("nodeSelector") or {}).get("nodeSelectorTerms") or []:
        for match in term.get("matchFields") or []:
            if match.get("key") == "metadata.name" and match.get("values"):
                return str(match["values"][0])
    return None


@dataclass
class Replay:
    """The audit log replayed: every ResourceClaim's state after each write."""

    events: list[Event]
    # (namespace, name) -> [(event index, claim body or None when gone)]
    claims: dict[tuple[str, str], list[tuple[int, dict[str, Any] | None]]] = field(
        default_factory=dict
    )
    double_allocations: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        holders: dict[Device, tuple[str, str]] = {}
        current: dict[tuple[str, str], set[Device]] = {}
        for index, event in enumerate(self.events):
            if not is_claim_write(event):
                continue
            ref = event["objectRef"]
            body = claim_after(event)
            name = ref.get("name") or ((body or {}).get("metadata") or {}).get("name")
            key = (ref.get("namespace", ""), str(name))
            if body == {}:  # a write whose response is no claim: the state did not change
                continue
            self.claims.setdefault(key, []).append((index, body))
            now = devices_of(((body or {}).get("status") or {}).get("allocation"))
            for device in current.get(key, set()) - now:
                holders.pop(device, None)
            for device in now - current.get(key, set()):
                other = holders.get(device)
                if other is not None and other != key:
                    self.double_allocations.append(
                        f"{device} allocated to {key} at {event['stageTimestamp']} "
                        f"({event['user'].get('username')}, {event.get('userAgent', '')[:40]}) "
                        f"while still allocated to {other}"
                    )
                holders[device] = key
            current[key] = now

    def claim_at(self, key: tuple[str, str], index: int) -> dict[str, Any] | None:
        """The claim as it stood when event `index` completed."""
        state = None
        for at, body in self.claims.get(key, []):
            if at > index:
                break
            state = body
        return state

    def first(self, predicate: Any) -> int | None:
        return next((i for i, e in enumerate(self.events) if predicate(e)), None)

    def last(self, predicate: Any) -> int | None:
        found = [i for i, e in enumerate(self.events) if predicate(e)]
        return found[-1] if found else None


def recorded_hand_off(uid: str) -> Any:
    """A ledger write (envelope status) that records the claim's hand-off."""

    def check(event: Event) -> bool:
        ref = event["objectRef"]
        if ref.get("resource") != "reservationenvelopes" or ref.get("subresource") != "status":
            return False
        status = (event.get("requestObject") or {}).get("status") or {}
        return bool(((status.get("entries") or {}).get(uid) or {}).get("handedOffAt"))

    return check


def bound(name: str) -> Any:
    return lambda e: is_binding(e) and e["objectRef"]["name"] == name


def deleted(name: str) -> Any:
    return lambda e: is_pod_write(e) and e["verb"] == "delete" and e["objectRef"]["name"] == name


def gate_lifted(name: str, gate: str = "reservoir.dev/hand-off") -> Any:
    def check(event: Event) -> bool:
        if not (is_pod_write(event) and event["objectRef"]["name"] == name):
            return False
        if event["verb"] not in ("update", "patch"):
            return False
        gates = ((event.get("responseObject") or {}).get("spec") or {}).get("schedulingGates")
        return not any(g.get("name") == gate for g in gates or [])

    return check


def windows_of(replay: Replay, ns: str, job: Round) -> list[str]:
    """Assertion 2 for one round's ResourceClaim; the problems found."""
    key = (ns, f"{RESERVOIR_RC_PREFIX}{job.uid}")
    placeholder = f"{PLACEHOLDER_PREFIX}{job.uid}"
    history = replay.claims.get(key, [])
    start = next((i for i, body in history if body and body["status"].get("allocation")), None)
    binding = replay.first(bound(placeholder))
    if start is None or binding is None:
        return [f"{job.name}: no allocation ({start}) or placeholder binding ({binding})"]
    if binding < start:
        return [f"{job.name}: placeholder bound before its claim was allocated"]
    last_pod = job.workload or placeholder
    # Until its deletion is asked for: a pod being deleted may stop (terminal phase, in a
    # pod status write this log does not keep) and so let go before it is removed.
    end = replay.first(deleted(last_pod))
    if end is None:
        return [f"{job.name}: {last_pod} never deleted"]
    allocation = replay.claim_at(key, start)["status"]["allocation"]  # type: ignore[index]
    problems = []
    if job.workload:
        # The placeholder goes only once the workload pod is bound (DESIGN.md §7): a pod
        # merely reserved may still fail to bind and be dropped from reservedFor.
        workload_bound = replay.first(bound(job.workload))
        let_go = replay.first(deleted(placeholder))
        if workload_bound is None or let_go is None or let_go < workload_bound:
            problems.append(
                f"{job.name}: placeholder deleted (event {let_go}) before its workload pod "
                f"was bound (event {workload_bound})"
            )
    # Effects of the deletion may be recorded before the deletion's own response: the end
    # is when the API server received the request.
    asked = (
        replay.events[end].get("requestReceivedTimestamp") or replay.events[end]["stageTimestamp"]
    )
    for at, body in history:
        if not start <= at <= end or replay.events[at]["stageTimestamp"] >= asked:
            continue
        when = replay.events[at]["stageTimestamp"]
        agent = replay.events[at].get("userAgent", "")[:40]
        if body is None:
            problems.append(f"{job.name}: ResourceClaim gone at {when} ({agent})")
            continue
        status = body.get("status") or {}
        if status.get("allocation") != allocation:
            problems.append(f"{job.name}: allocation changed at {when} ({agent})")
        if not status.get("reservedFor"):
            problems.append(f"{job.name}: reservedFor empty at {when} ({agent})")
    return problems


# --- the test ----------------------------------------------------------------------------


def test_no_window_in_the_api_servers_own_record(audited: AuditedCluster) -> None:
    cluster = audited
    ns = prepare(cluster)
    # The envelope is a budget (a finished claim's usage stays spent): big enough for every
    # round, so that only the devices limit what is held at once.
    capacity = {GPU: str(8 * ROUNDS + NODES * NodeShape().gpus)}
    create_envelope(cluster, ns, "gpus", capacity, defaultLeaseSeconds=600)
    logs = REPO / ".cluster" / "test-logs"
    logs.mkdir(parents=True, exist_ok=True)
    operator = OperatorProcess(cluster, ns, logs / f"no-window-{os.getpid()}.log")  # type: ignore[arg-type]
    try:
        run, restarts = exercise(cluster, ns)
        # Everything lets go, so that the record is complete: every pod gone, every
        # ResourceClaim deallocated and deleted.
        cluster.kubectl("delete", "pods", "-n", ns, "-l", "no-window=competitor", "--wait=false")
        eventually(
            "every pod and ResourceClaim gone",
            lambda: not cluster.kubectl("get", "pods,resourceclaims", "-n", ns, "-o", "name"),
            timeout=120,
        )
    finally:
        operator.stop()
    # What the run did, next to the audit log, for a look at a failure.
    rounds = [{**vars(j), "handed_off_at": str(j.handed_off_at)} for j in run.rounds]
    (cluster.local.dir / "rounds.json").write_text(json.dumps(rounds, indent=1))
    check(Replay(audit_events(cluster.local.audit_log)), run, restarts)


def exercise(cluster: AuditedCluster, ns: str) -> tuple[Run, list[str]]:
    """The rounds, the competitor and the scheduler restart, all at once."""
    rng = random.Random(SEED)
    run = Run(ns=ns, kubeconfig=cluster.kubeconfig_path)
    run.rounds = [Round(name=f"r{i:04d}", gpus=rng.randint(1, 8)) for i in range(ROUNDS)]
    restarts: list[str] = []
    threads = [threading.Thread(target=worker, args=(run, i)) for i in range(WORKERS)]
    helpers = [
        threading.Thread(target=competitor, args=(run,)),
        threading.Thread(target=scheduler_restarter, args=(run, cluster, restarts)),
    ]
    started = time.monotonic()
    try:
        for thread in [*helpers, *threads]:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        run.stop.set()
        for thread in [*helpers, *threads]:
            thread.join(timeout=60)
    print(
        f"seed {SEED}: {ROUNDS} rounds in {time.monotonic() - started:.0f}s, "
        f"{sum(j.cancelled for j in run.rounds)} cancelled; {restarts}; "
        f"{len(run.competitors_scheduled)} of {run.competitors_created} competitor pods "
        "scheduled"
    )
    assert not run.errors, run.errors
    return run, restarts


def check(replay: Replay, run: Run, restarts: list[str]) -> None:
    """The four assertions, on the replayed audit log."""
    ns = run.ns
    reservoir = [k for k in replay.claims if k[1].startswith(RESERVOIR_RC_PREFIX)]
    print(
        f"audit: {len(replay.events)} writes, {len(replay.claims)} ResourceClaims "
        f"({len(reservoir)} Reservoir's)"
    )

    # 1. No device is ever in two allocations at once, across all ResourceClaims.
    extended = [k for k in replay.claims if not k[1].startswith(RESERVOIR_RC_PREFIX)]
    assert extended, "the competitors' extended-resource claims are not in the record"
    assert not replay.double_allocations, replay.double_allocations[:10]

    # 2. From allocation (and the placeholder's binding) until its last pod is gone, each
    # Reservoir claim keeps its allocation and is never reserved for nobody.
    problems = [p for job in run.rounds for p in windows_of(replay, ns, job)]
    assert not problems, problems[:10]

    # 3. Each workload pod is bound to the node of its claim's allocation.
    misplaced = []
    for job in run.rounds:
        if job.cancelled:
            continue
        bindings = [i for i, e in enumerate(replay.events) if bound(job.workload)(e)]
        assert len(bindings) == 1, (job.workload, bindings)
        target = replay.events[bindings[0]]["requestObject"]["target"]["name"]
        claim = replay.claim_at((ns, f"{RESERVOIR_RC_PREFIX}{job.uid}"), bindings[0])
        allocation = ((claim or {}).get("status") or {}).get("allocation") or {}
        if target != node_of_allocation(allocation) or target != job.node:
            misplaced.append(f"{job.workload} on {target}, its claim's devices on {job.node}")
    assert not misplaced, misplaced

    # 4. The competitor competed, and every round completed, its hand-off recorded before
    # its gate was lifted.
    competitor_bindings = [
        e for e in replay.events if is_binding(e) and e["objectRef"]["name"].startswith("c-")
    ]
    assert run.competitors_scheduled and competitor_bindings
    assert all(job.done for job in run.rounds), [j.name for j in run.rounds if not j.done]
    handed_off = [job for job in run.rounds if not job.cancelled]
    assert handed_off and len(handed_off) < ROUNDS  # some cancelled, most handed off
    early = []
    for job in handed_off:
        lifted = replay.first(gate_lifted(job.workload))
        recorded = replay.first(recorded_hand_off(job.uid))
        assert lifted is not None, f"{job.workload}: no gate lift in the record"
        if job.handed_off_at is None or recorded is None or recorded > lifted:
            when = replay.events[lifted]["stageTimestamp"]
            early.append(f"{job.workload}: gate lifted at {when}, hand-off recorded: {recorded}")
    assert not early, early
    assert restarts, "kube-scheduler was not restarted"
