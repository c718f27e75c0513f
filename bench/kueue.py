"""Benchmark: Kueue v0.17.0's manager admitting Workloads on the local control plane.

    hack/tools/build.sh kueue       # build (once; cached by version) Kueue's manager
    .venv/bin/python bench/kueue.py --cluster-dir .cluster \\
        --queues 3 --per-queue 100 --quota 16 --concurrency 32

The comparison for Reservoir's envelopes, measured against the same API server in the same
session. What it does, in the manner of Kueue's own scheduler performance test
(test/performance/scheduler in sigs.k8s.io/kueue), which creates Workloads directly and
marks each Finished once admitted:

- installs Kueue's CRDs from the Go module cache (config/components/crd/bases of the pinned
  module, with the conversion-webhook stanza that Kueue's kustomization adds to five of them);
- starts the real manager (cmd/kueue, built by ``hack/tools/build.sh kueue``) as a
  subprocess, as user ``kueue-manager`` (a certificate user, so that the audit log tells its
  requests apart), with Kueue's shipped configuration except: leader election off,
  metrics/health/webhook servers on free loopback ports, only the batch/job integration,
  and the VisibilityOnDemand feature off (an aggregated API server no one calls here).
  Webhooks are served (internal cert management makes their certificate) but not
  registered with the API server: nothing is admission-checked by Kueue's webhooks, exactly
  as in Kueue's performance test, whose minimal manager has none;
- one ResourceFlavor, ``queues`` ClusterQueues each with a nominal quota of ``quota`` cpu
  (the resource is cpu, as in Kueue's performance test: one unit is 1 cpu) and one
  LocalQueue per ClusterQueue in one namespace. A Reservoir envelope of ``quota`` units
  admits ``quota`` concurrent 1-unit claims; a ClusterQueue of ``quota`` cpu admits
  ``quota`` concurrent 1-cpu Workloads;
- creates ``queues * per_queue`` Workloads (one podset, count 1, requesting 1 cpu),
  round-robin over the queues, at most ``concurrency`` creations in flight, as user
  ``bench-load``; one watch sees each become Admitted (v0.17 sets QuotaReserved and, with no
  admission checks, Admitted in the same status write; Admitted is what the performance
  test waits for) and the load generator then sets Finished=True on the status
  subresource by server-side apply, as the performance test does, freeing its quota.

Measured by the client's clock: wall time from the first create to the last admission
seen, admissions/s over that time, and per-Workload latency from sending its create to
seeing it Admitted on the watch (queueing included: all Workloads are created up front).
The result's ``window`` spans the first create to the last Finished write (plus a short
settle), for counting the manager's API requests in the audit log by user.

Everything it creates (CRDs, namespaces, queues, Workloads) is removed at the end, also on
error. A benchmark, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import datetime as dt
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml
from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.generic_resource import (
    GenericGlobalResource,
    GenericNamespacedResource,
    create_global_resource,
    create_namespaced_resource,
)
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace, Secret
from lightkube.types import PatchType, on_error_retry

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "hack"))

from identities import user_kubeconfig  # noqa: E402
from load import client_for  # noqa: E402
from localcluster import free_port  # noqa: E402  (outside the ephemeral range)

TOOLS = REPO / "hack" / "tools"
BUILD_SCRIPT = TOOLS / "build.sh"
KUBECTL = Path.home() / ".cache" / "reservoir" / "bin" / "current" / "kubectl"

GROUP = "kueue.x-k8s.io"
API_VERSION = f"{GROUP}/v1beta2"
MANAGER_USER = "kueue-manager"
LOAD_USER = "bench-load"
FIELD_MANAGER = "bench-load"
KUEUE_NAMESPACE = "kueue-system"  # the manager's own namespace (its webhook-cert Secret)
BENCH_NAMESPACE = "kueue-bench"
WEBHOOK_SECRET = "kueue-webhook-server-cert"
FLAVOR = "default-flavor"
RESOURCE = "cpu"
# CPU seconds used so far, by process name (the caller's control plane, the load).
CpuSnapshot = Callable[[], dict[str, float]]
# Kueue's kustomization (config/components/crd/kustomization.yaml) turns these CRDs'
# conversion to the manager's webhook; its internal cert management waits until it has
# injected its CA there, so they must carry the stanza. Only v1beta2 is used here, the
# storage version, so the API server never calls the (unreachable) conversion service.
CONVERTED_CRDS = ("localqueues", "clusterqueues", "cohorts", "workloads", "multikueueclusters")

Workload = create_namespaced_resource(GROUP, "v1beta2", "Workload", "workloads")
LocalQueue = create_namespaced_resource(GROUP, "v1beta2", "LocalQueue", "localqueues")
ClusterQueue = create_global_resource(GROUP, "v1beta2", "ClusterQueue", "clusterqueues")
ResourceFlavor = create_global_resource(GROUP, "v1beta2", "ResourceFlavor", "resourceflavors")


def log(message: str) -> None:
    print(f"[kueue] {message}", file=sys.stderr, flush=True)


def kueue_version() -> str:
    for line in (TOOLS / "versions.env").read_text().splitlines():
        if line.startswith("KUEUE_VERSION="):
            return line.split("=", 1)[1].strip()
    raise RuntimeError(f"KUEUE_VERSION is not set in {TOOLS / 'versions.env'}")


def ensure_built() -> Path:
    """Build Kueue's manager if it is not cached yet; return the binary's path."""
    try:
        result = subprocess.run(
            ["bash", str(BUILD_SCRIPT), "kueue"],
            check=False,
            capture_output=True,
            text=True,
        )
    except OSError as error:
        raise RuntimeError(f"cannot run {BUILD_SCRIPT}: {error}") from error
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-20:])
        raise RuntimeError(
            f"building Kueue {kueue_version()} failed ({BUILD_SCRIPT} kueue, exit "
            f"{result.returncode}):\n{tail}"
        )
    binary = Path(result.stdout.strip().splitlines()[-1]) / "kueue"
    if not os.access(binary, os.X_OK):
        raise RuntimeError(f"{BUILD_SCRIPT} kueue succeeded but {binary} is not an executable")
    return binary


def module_dir() -> Path:
    """The pinned Kueue module's source in the Go module cache (downloaded if missing)."""
    version = kueue_version()
    result = subprocess.run(
        ["go", "mod", "download", "-json", f"sigs.k8s.io/kueue@{version}"],
        cwd=TOOLS / "kueue",
        check=False,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"go mod download sigs.k8s.io/kueue@{version}: {result.stderr}")
    return Path(json.loads(result.stdout)["Dir"])


def crd_manifests() -> list[dict[str, Any]]:
    bases = module_dir() / "config" / "components" / "crd" / "bases"
    crds: list[dict[str, Any]] = []
    for path in sorted(bases.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["plural"] in CONVERTED_CRDS:
            crd["spec"]["conversion"] = {
                "strategy": "Webhook",
                "webhook": {
                    "clientConfig": {
                        "service": {
                            "namespace": KUEUE_NAMESPACE,
                            "name": "kueue-webhook-service",
                            "path": "/convert",
                        }
                    },
                    "conversionReviewVersions": ["v1"],
                },
            }
        crds.append(crd)
    if not crds:
        raise RuntimeError(f"no CRDs in {bases}")
    return crds


def kubectl(kubeconfig: Path, *args: str, stdin: str | None = None, check: bool = True) -> str:
    result = subprocess.run(
        [str(KUBECTL), "--kubeconfig", str(kubeconfig), *args],
        input=stdin,
        capture_output=True,
        text=True,
        check=False,
    )
    if check and result.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout


def utc_iso(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def percentile(sorted_values: list[float], fraction: float) -> float:
    """Nearest-rank percentile of an already sorted, non-empty list."""
    rank = max(1, math.ceil(fraction * len(sorted_values)))
    return sorted_values[rank - 1]


def manager_config(
    work: Path, health: int, metrics: int, webhook: int, qps: float, burst: int
) -> str:
    """Kueue's shipped controller_manager_config.yaml, adapted to run outside a Pod."""
    config = {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": KUEUE_NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"},
        "metrics": {"bindAddress": f"127.0.0.1:{metrics}"},
        "webhook": {"port": webhook, "host": "127.0.0.1", "certDir": str(work / "certs")},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": True},
        "controller": {
            "groupKindConcurrency": {
                "Job.batch": 5,
                "Pod": 5,
                "Workload.kueue.x-k8s.io": 5,
                "LocalQueue.kueue.x-k8s.io": 1,
                "Cohort.kueue.x-k8s.io": 1,
                "ClusterQueue.kueue.x-k8s.io": 1,
                "ResourceFlavor.kueue.x-k8s.io": 1,
            }
        },
        "clientConnection": {"qps": qps, "burst": burst},
        "integrations": {"frameworks": ["batch/job"]},
    }
    return yaml.safe_dump(config, sort_keys=False)


class Manager:
    """Kueue's manager as a subprocess, logging to <cluster>/logs/kueue-manager.log."""

    def __init__(
        self, binary: Path, cluster_dir: Path, secret_reader: Path, qps: float, burst: int
    ) -> None:
        self.binary = binary
        self.secret_reader = secret_reader  # a kubeconfig, not the manager's
        self.work = Path(tempfile.mkdtemp(prefix="kueue-", dir=cluster_dir))
        self.log_path = cluster_dir / "logs" / "kueue-manager.log"
        self.kubeconfig = user_kubeconfig(cluster_dir, MANAGER_USER)
        self.health = free_port()
        self.qps = qps
        self.burst = burst
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120.0) -> None:
        config = self.work / "config.yaml"
        config.write_text(
            manager_config(self.work, self.health, free_port(), free_port(), self.qps, self.burst)
        )
        (self.work / "certs").mkdir()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        with self.log_path.open("wb") as out:
            self.process = subprocess.Popen(
                [
                    str(self.binary),
                    f"--config={config}",
                    "--feature-gates=VisibilityOnDemand=false",
                    "--zap-log-level=2",  # as in Kueue's manager.yaml
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.health}/readyz"
        mounted = False
        while time.monotonic() < deadline:
            if not mounted:
                mounted = self.mount_certificate()
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"Kueue's manager exited with {self.process.returncode} before it was "
                    f"ready; last lines of {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise RuntimeError(
            f"Kueue's manager was not ready within {timeout:.0f}s ({url}); last lines of "
            f"{self.log_path}:\n{self.log_tail()}"
        )

    def mount_certificate(self) -> bool:
        """Do what the kubelet's Secret volume does in Kueue's Deployment: put the webhook
        certificate that the manager's cert rotator writes into its Secret into the
        manager's certDir, where the manager waits for it before it reports ready."""
        out = kubectl(
            self.secret_reader,
            "get",
            "secret",
            f"--namespace={KUEUE_NAMESPACE}",
            WEBHOOK_SECRET,
            "--output=json",
            check=False,
        )
        try:
            data: dict[str, str] = json.loads(out).get("data") or {}
        except json.JSONDecodeError:
            return False
        if not {"tls.crt", "tls.key"} <= data.keys():
            return False
        for key, value in data.items():
            path = self.work / "certs" / key
            path.write_bytes(base64.b64decode(value))
            path.chmod(0o600)
        return True

    def log_tail(self, lines: int = 15, width: int = 400) -> str:
        try:
            tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return "(no log)"
        return "\n".join(line[:width] for line in tail)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace: float = 15.0) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(grace)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        with contextlib.suppress(OSError):
            for path in sorted(self.work.rglob("*"), reverse=True):
                path.rmdir() if path.is_dir() else path.unlink()
            self.work.rmdir()


def cluster_queue(index: int, quota: int) -> GenericGlobalResource:
    return ClusterQueue(
        metadata=ObjectMeta(name=f"bench-cq-{index}"),
        spec={
            "namespaceSelector": {},
            "resourceGroups": [
                {
                    "coveredResources": [RESOURCE],
                    "flavors": [
                        {
                            "name": FLAVOR,
                            "resources": [{"name": RESOURCE, "nominalQuota": str(quota)}],
                        }
                    ],
                }
            ],
        },
    )


def workload(name: str, queue: int) -> GenericNamespacedResource:
    """One podset of one pod requesting 1 cpu: what Kueue's performance test creates."""
    return Workload(
        metadata=ObjectMeta(name=name, namespace=BENCH_NAMESPACE),
        spec={
            "queueName": f"bench-lq-{queue}",
            "podSets": [
                {
                    "name": "main",
                    "count": 1,
                    "template": {
                        "spec": {
                            "restartPolicy": "Never",
                            "containers": [
                                {
                                    "name": "c",
                                    "resources": {"requests": {RESOURCE: "1"}},
                                }
                            ],
                        }
                    },
                }
            ],
        },
    )


def condition_true(obj: GenericNamespacedResource | GenericGlobalResource, kind: str) -> bool:
    status: dict[str, Any] = obj.status if isinstance(obj.status, dict) else {}
    conditions: list[dict[str, Any]] = status.get("conditions") or []
    return any(c.get("type") == kind and c.get("status") == "True" for c in conditions)


def names(total: int, queues: int) -> Iterator[tuple[str, int]]:
    """Workload names round-robin over the queues, so every queue is loaded from the start."""
    for index in range(total):
        yield f"wl-{index:06d}", index % queues


class Load:
    """Creates the Workloads, watches them, finishes each one once admitted."""

    def __init__(self, client: AsyncClient, total: int, queues: int, concurrency: int) -> None:
        self.client = client
        self.total = total
        self.queues = queues
        self.slots = asyncio.Semaphore(concurrency)  # creations in flight
        self.finish_slots = asyncio.Semaphore(concurrency)  # Finished writes in flight
        self.sent: dict[str, float] = {}  # name → wall clock when its create was sent
        self.latencies: list[float] = []
        self.admitted: set[str] = set()
        self.first_create = 0.0
        self.last_admission = 0.0
        self.last_finish = 0.0
        self.finishing: set[asyncio.Task[None]] = set()
        self.done = asyncio.Event()
        self.errors: list[str] = []

    async def create_all(self) -> None:
        async def create(name: str, queue: int) -> None:
            try:
                self.sent[name] = time.time()
                await self.client.create(workload(name, queue), field_manager=FIELD_MANAGER)
            except ApiError as error:
                self.errors.append(f"create {name}: {error.status.message}")
            finally:
                self.slots.release()

        self.first_create = time.time()
        tasks: list[asyncio.Task[None]] = []
        for name, queue in names(self.total, self.queues):
            await self.slots.acquire()
            tasks.append(asyncio.create_task(create(name, queue)))
        await asyncio.gather(*tasks)

    async def finish(self, name: str, generation: int) -> None:
        """Finished=True through the status subresource, as the performance test does."""
        condition = {
            "type": "Finished",
            "status": "True",
            "reason": "ByTest",
            "message": "By test runner",
            "observedGeneration": generation,
            "lastTransitionTime": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        patch = {
            "apiVersion": API_VERSION,
            "kind": "Workload",
            "metadata": {"name": name, "namespace": BENCH_NAMESPACE},
            "status": {"conditions": [condition]},
        }
        async with self.finish_slots:
            try:
                await self.client.patch(
                    Workload.Status,
                    name,
                    patch,
                    namespace=BENCH_NAMESPACE,
                    patch_type=PatchType.APPLY,
                    field_manager=f"{FIELD_MANAGER}-Finished",
                    force=True,
                )
            except ApiError as error:
                self.errors.append(f"finish {name}: {error.status.message}")
        self.last_finish = time.time()

    async def watch(self, resource_version: str) -> None:
        async for _kind, obj in self.client.watch(
            Workload,
            namespace=BENCH_NAMESPACE,
            resource_version=resource_version,
            on_error=on_error_retry,
        ):
            metadata = obj.metadata
            name = metadata.name if metadata else None
            if (
                metadata is None
                or name is None
                or name in self.admitted
                or not condition_true(obj, "Admitted")
            ):
                continue
            now = time.time()
            self.admitted.add(name)
            self.last_admission = now
            if name in self.sent:
                self.latencies.append(now - self.sent[name])
            if not condition_true(obj, "Finished"):
                task = asyncio.create_task(self.finish(name, metadata.generation or 1))
                self.finishing.add(task)
                task.add_done_callback(self.finishing.discard)
            if len(self.admitted) >= self.total:
                self.done.set()
                return


async def wait_active(client: AsyncClient, queues: int, seconds: float = 60.0) -> None:
    """Until every ClusterQueue and LocalQueue reports Active (the manager has them cached)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        active = 0
        async for cq in client.list(ClusterQueue):
            if cq.metadata and (cq.metadata.name or "").startswith("bench-cq-"):
                active += condition_true(cq, "Active")
        async for lq in client.list(LocalQueue, namespace=BENCH_NAMESPACE):
            active += condition_true(lq, "Active")
        if active == 2 * queues:
            return
        await asyncio.sleep(0.25)
    raise RuntimeError(f"the {queues} ClusterQueues/LocalQueues did not become Active in time")


async def measure(
    client: AsyncClient,
    manager: Manager,
    queues: int,
    per_queue: int,
    quota: int,
    concurrency: int,
    stall_seconds: float,
    cpu: CpuSnapshot | None = None,
) -> dict[str, Any]:
    await client.create(
        ResourceFlavor(metadata=ObjectMeta(name=FLAVOR), spec={}), field_manager=FIELD_MANAGER
    )
    for index in range(queues):
        await client.create(cluster_queue(index, quota), field_manager=FIELD_MANAGER)
        await client.create(
            LocalQueue(
                metadata=ObjectMeta(name=f"bench-lq-{index}", namespace=BENCH_NAMESPACE),
                spec={"clusterQueue": f"bench-cq-{index}"},
            ),
            field_manager=FIELD_MANAGER,
        )
    await wait_active(client, queues)

    total = queues * per_queue
    load = Load(client, total, queues, concurrency)
    listing = client.list(Workload, namespace=BENCH_NAMESPACE)
    async for _ in listing:
        pass
    resource_version = listing.resourceVersion
    watcher = asyncio.create_task(load.watch(resource_version))
    log(f"creating {total} Workloads over {queues} ClusterQueues of {quota} {RESOURCE}")
    cpu_before = manager_cpu(manager, cpu)
    creator = asyncio.create_task(load.create_all())
    progress, last_count, last_change = time.monotonic(), 0, time.monotonic()
    try:
        while not load.done.is_set():
            if watcher.done():
                watcher.result()  # the watch ended: raise its error
                break
            if not manager.alive():
                raise RuntimeError(f"Kueue's manager died:\n{manager.log_tail()}")
            now = time.monotonic()
            if len(load.admitted) != last_count:
                last_count, last_change = len(load.admitted), now
            elif now - last_change > stall_seconds and creator.done():
                log(f"no admission for {stall_seconds:.0f}s: stopping at {last_count}/{total}")
                break
            if now - progress > 5:
                progress = now
                log(f"admitted {len(load.admitted)}/{total}, created {len(load.sent)}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(load.done.wait(), 1.0)
        await creator
        if load.finishing:
            await asyncio.gather(*list(load.finishing))
        await asyncio.sleep(2.0)  # let the manager process the last Finished writes
        window_end = time.time()
        cpu_after = manager_cpu(manager, cpu)
    finally:
        for task in (watcher, creator):
            task.cancel()
        await asyncio.gather(watcher, creator, return_exceptions=True)

    admitted = len(load.admitted)
    wall = max(load.last_admission - load.first_create, 0.0) if admitted else 0.0
    latencies = sorted(1000.0 * v for v in load.latencies)
    result: dict[str, Any] = {
        "wall_seconds": round(wall, 3),
        "workloads": total,
        "admitted": admitted,
        "admissions_per_second": round(admitted / wall, 2) if wall > 0 else 0.0,
        "latency_ms": {
            p: round(percentile(latencies, f), 1) if latencies else None
            for p, f in (("p50", 0.50), ("p95", 0.95), ("p99", 0.99))
        },
        "user": MANAGER_USER,
        "window": [utc_iso(load.first_create - 0.001), utc_iso(window_end)],
        "version": kueue_version(),
        "queues": queues,
        "per_queue": per_queue,
        "quota": quota,
        "resource": RESOURCE,
        "concurrency": concurrency,
    }
    spent = {k: after - cpu_before[k] for k, after in cpu_after.items() if k in cpu_before}
    result["cpu_seconds"] = {k: round(v, 2) for k, v in spent.items()}
    result["cpu_ms_per_workload"] = {k: round(1000 * v / total, 1) for k, v in spent.items()}
    if load.errors:
        result["errors"] = {"count": len(load.errors), "first": load.errors[:5]}
    return result


def manager_cpu(manager: Manager, others: CpuSnapshot | None) -> dict[str, float]:
    """CPU seconds used so far by the manager (user + system, from /proc) and, from
    `others`, by the rest (the caller's API server, etcd, this process): so that a rate
    can be told CPU-bound or not."""
    snapshot = dict(others()) if others is not None else {}
    if manager.process is not None:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{manager.process.pid}/stat").read_text().rsplit(")", 1)[1]
            utime, stime = fields.split()[11:13]
            snapshot["kueue manager"] = (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")
    return snapshot


async def queue_objects(client: AsyncClient) -> list[tuple[Any, str | None, str]]:
    """(resource, namespace, name) of the queues and flavors this benchmark may have left."""
    found: list[tuple[Any, str | None, str]] = []
    with contextlib.suppress(ApiError):
        async for obj in client.list(LocalQueue, namespace=BENCH_NAMESPACE):
            if obj.metadata and obj.metadata.name:
                found.append((LocalQueue, BENCH_NAMESPACE, obj.metadata.name))
        for cluster_scoped in (ClusterQueue, ResourceFlavor):
            async for item in client.list(cluster_scoped):
                if item.metadata and item.metadata.name:
                    found.append((cluster_scoped, None, item.metadata.name))
    return found


async def drop_finalizers(client: AsyncClient, objects: list[tuple[Any, str | None, str]]) -> None:
    for kind, namespace, name in objects:
        with contextlib.suppress(ApiError):
            await client.patch(
                kind,
                name,
                {"metadata": {"finalizers": None}},
                namespace=namespace,
                patch_type=PatchType.MERGE,
            )


async def delete_crds(load_kubeconfig: Path, seconds: int) -> bool:
    """Delete Kueue's CRDs, and with them every object of theirs; True once they are gone."""
    crds = [crd["metadata"]["name"] for crd in crd_manifests()]
    await asyncio.to_thread(
        kubectl,
        load_kubeconfig,
        "delete",
        "crd",
        "--ignore-not-found",
        "--wait=true",
        f"--timeout={seconds}s",
        *crds,
        check=False,
    )
    left = await asyncio.to_thread(
        kubectl,
        load_kubeconfig,
        "get",
        "crd",
        "--ignore-not-found",
        "-o",
        "name",
        *crds,
        check=False,
    )
    return not left.strip()


async def cleanup(client: AsyncClient, manager: Manager, load_kubeconfig: Path) -> None:
    """Remove everything, in an order that lets the manager drop its finalizers first.

    Workloads are not deleted one by one (15,000 of them outlast a request's timeout): the
    CRDs' deletion removes them server-side. Finished Workloads carry no finalizer; the
    queues and the flavor do (Kueue's resource-in-use), so they go first, while the manager
    runs, and whatever still holds one afterwards (the manager dead or slow) is stripped.
    """
    if manager.alive():
        with contextlib.suppress(ApiError):
            await client.deletecollection(LocalQueue, namespace=BENCH_NAMESPACE)
        with contextlib.suppress(ApiError):
            await client.deletecollection(ClusterQueue)
        with contextlib.suppress(ApiError):
            await client.deletecollection(ResourceFlavor)
        for _ in range(60):  # up to half a minute
            if not await queue_objects(client):
                break
            await asyncio.sleep(0.5)
    manager.stop()
    await drop_finalizers(client, await queue_objects(client))
    if not await delete_crds(load_kubeconfig, 300):
        # Unfinished Workloads (a stalled or failed run) may hold Kueue's finalizer.
        held: list[tuple[Any, str | None, str]] = []
        with contextlib.suppress(ApiError):
            async for obj in client.list(Workload, namespace=BENCH_NAMESPACE, chunk_size=500):
                if obj.metadata and obj.metadata.name and obj.metadata.finalizers:
                    held.append((Workload, BENCH_NAMESPACE, obj.metadata.name))
        await drop_finalizers(client, held)
        if not await delete_crds(load_kubeconfig, 300):
            log("warning: Kueue's CRDs are still being deleted")
    for namespace in (BENCH_NAMESPACE, KUEUE_NAMESPACE):
        with contextlib.suppress(ApiError):
            await client.delete(Namespace, namespace)


async def wait_namespaces_gone(client: AsyncClient, seconds: float = 300.0) -> None:
    """A previous run's namespaces may still be terminating: creating in them would fail."""
    deadline = time.monotonic() + seconds
    for namespace in (BENCH_NAMESPACE, KUEUE_NAMESPACE):
        while True:
            try:
                found = await client.get(Namespace, namespace)
            except ApiError as error:
                if error.status.code == 404:
                    break
                raise
            if not (found.status and found.status.phase == "Terminating"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"namespace {namespace} is still terminating")
            await asyncio.sleep(1.0)


async def run_async(
    cluster_dir: Path,
    queues: int,
    per_queue: int,
    quota: int,
    concurrency: int,
    *,
    qps: float,
    burst: int,
    stall_seconds: float,
    cpu: CpuSnapshot | None = None,
) -> dict[str, Any]:
    binary = await asyncio.to_thread(ensure_built)
    load_kubeconfig = user_kubeconfig(cluster_dir, LOAD_USER)
    manager = Manager(binary, cluster_dir, load_kubeconfig, qps, burst)
    # The same client stack as Reservoir's load generator (bench/load.py: the SDK's
    # transport, a connection per request in flight): like with like.
    client = client_for(str(load_kubeconfig), concurrency, FIELD_MANAGER)
    try:
        await wait_namespaces_gone(client)
        # CRDs first (kubectl: server-side apply of large schemas), then the namespaces.
        crds = crd_manifests()
        document = json.dumps({"apiVersion": "v1", "kind": "List", "items": crds})
        await asyncio.to_thread(
            kubectl,
            load_kubeconfig,
            "apply",
            "--server-side",
            "--force-conflicts",
            f"--field-manager={FIELD_MANAGER}",
            "-f",
            "-",
            stdin=document,
        )
        await asyncio.to_thread(
            kubectl,
            load_kubeconfig,
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            *[f"crd/{crd['metadata']['name']}" for crd in crds],
        )
        for namespace in (KUEUE_NAMESPACE, BENCH_NAMESPACE):
            with contextlib.suppress(ApiError):  # 409: left over; reused
                await client.create(Namespace(metadata=ObjectMeta(name=namespace)))
        # The empty Secret that Kueue's manifests ship (config/components/internalcert): the
        # manager's cert rotator fills it in, and gives up at start-up if it is missing.
        with contextlib.suppress(ApiError):
            await client.create(
                Secret(metadata=ObjectMeta(name=WEBHOOK_SECRET, namespace=KUEUE_NAMESPACE))
            )
        log(f"starting Kueue's manager ({binary}), log in {manager.log_path}")
        await asyncio.to_thread(manager.start)
        result = await measure(
            client, manager, queues, per_queue, quota, concurrency, stall_seconds, cpu
        )
        log(f"result (before cleaning up): {json.dumps(result)}")
        return result
    finally:
        log("cleaning up")
        try:
            await cleanup(client, manager, load_kubeconfig)
        except Exception as error:  # never let cleaning up hide the result or the failure
            log(f"warning: cleaning up failed: {error!r}")
        finally:
            manager.stop()
            await client.close()


def run(
    cluster_dir: Path,
    queues: int,
    per_queue: int,
    quota: int,
    concurrency: int,
    *,
    qps: float = 50.0,
    burst: int = 100,
    stall_seconds: float = 120.0,
    cpu: CpuSnapshot | None = None,
) -> dict[str, Any]:
    """Run Kueue against the local cluster in `cluster_dir`; see the module's docstring.

    qps/burst: the manager's client rate limit, 50/100 as in Kueue's shipped configuration.
    stall_seconds: give up (reporting admitted < workloads) after that long without an
    admission once every Workload is created.
    cpu: CPU seconds so far of the other processes worth counting, by name.
    """
    if min(queues, per_queue, quota, concurrency) < 1:
        raise ValueError("queues, per_queue, quota and concurrency must all be >= 1")
    return asyncio.run(
        run_async(
            Path(cluster_dir).resolve(),
            queues,
            per_queue,
            quota,
            concurrency,
            qps=qps,
            burst=burst,
            stall_seconds=stall_seconds,
            cpu=cpu,
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster-dir", type=Path, required=True)
    parser.add_argument("--queues", type=int, default=3)
    parser.add_argument("--per-queue", type=int, default=100)
    parser.add_argument("--quota", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--qps", type=float, default=50.0, help="manager's client QPS")
    parser.add_argument("--burst", type=int, default=100, help="manager's client burst")
    parser.add_argument("--stall-seconds", type=float, default=120.0)
    args = parser.parse_args(argv)
    try:
        result = run(
            args.cluster_dir,
            args.queues,
            args.per_queue,
            args.quota,
            args.concurrency,
            qps=args.qps,
            burst=args.burst,
            stall_seconds=args.stall_seconds,
        )
    except RuntimeError as error:
        print(json.dumps({"error": str(error)}), file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
