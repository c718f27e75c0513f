#!/usr/bin/env python3
"""A real, local Kubernetes control plane with simulated GPU nodes, without Docker.

It runs etcd, kube-apiserver, kube-controller-manager, kube-scheduler and KWOK as plain
local processes (binaries built by ``hack/tools/build.sh``), envtest-style, and registers
N fake GPU nodes that KWOK keeps Ready and whose pods it moves through their lifecycle.

The GPUs are Dynamic Resource Allocation devices (resource.k8s.io/v1), as a DRA driver
would publish them: one ResourceSlice per node (driver ``gpu.reservoir.dev``, pool = the
node, devices ``gpu-0..gpu-{n-1}``), and a DeviceClass ``gpu.reservoir.dev`` whose
``extendedResourceName`` is ``nvidia.com/gpu``, so ordinary pods asking for
``nvidia.com/gpu`` are served from the same devices (KEP-5004). The nodes therefore do not
advertise ``nvidia.com/gpu`` in their allocatable; they keep the NVIDIA-style labels.

    python3 hack/localcluster.py up   [--dir .cluster] [--nodes 4] [--gpus-per-node 8] [--audit]
    python3 hack/localcluster.py down [--dir .cluster]
    python3 hack/localcluster.py status [--dir .cluster]

``up`` is idempotent: a healthy cluster in ``--dir`` is left alone. Every component logs
to ``<dir>/logs/<component>.log``; a readiness failure names the component and its log.
``down`` stops every process it started (SIGTERM, then SIGKILL) and leaves none behind.
``--audit`` (or RESERVOIR_AUDIT=1) makes kube-apiserver write an audit log of pod
bindings, pod and ResourceClaim writes at RequestResponse level to ``<dir>/logs/audit.log``
(JSON lines); ``up --audit`` restarts a healthy cluster that runs without one.
``--audit-all`` (or RESERVOIR_AUDIT=all), for the benchmarks, logs every request instead,
at Metadata level (who, verb, resource, response code; no bodies), so that the API
server itself counts each client's requests. ``up`` restarts a healthy cluster whose audit
mode is another.

Standard library only, so it runs before any virtualenv exists.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# `kubectl wait --for=condition=...` fails at once, where it would wait, on an object whose
# `status.conditions` is null: a CRD just created, before the API server marks it (seen in
# CI on a busy machine). Asked again for this long.
NULL_CONDITIONS = "accessor error: <nil> is of the type <nil>"
KUBECTL_WAIT_RETRY_SECONDS = 60.0
REPO = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO / "hack" / "tools" / "build.sh"
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
SERVICE_CIDR = "10.96.0.0/16"
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
GPU_DRIVER = "gpu.reservoir.dev"  # the DRA driver name the GPU ResourceSlices carry
GPU_DEVICE_CLASS = "gpu.reservoir.dev"
PLACEHOLDER_PRIORITY_CLASS = "reservoir-placeholder"
# High, so that ordinary pods cannot preempt a hold (and free its devices); placeholders
# themselves never preempt anything (preemptionPolicy Never).
PLACEHOLDER_PRIORITY = 1_000_000
GPU_EXTENDED_RESOURCE = "nvidia.com/gpu"  # served from the DeviceClass, not node allocatable
AUDITED_WRITES = ["create", "update", "patch", "delete", "deletecollection"]


class ClusterError(RuntimeError):
    """The local control plane could not be brought to a healthy state."""


@dataclass
class NodeShape:
    """What each simulated GPU node advertises, like a real node with the NVIDIA GPU operator."""

    count: int = 4
    gpus: int = 8
    gpu_product: str = "NVIDIA-H100-80GB-HBM3"
    gpu_memory_mib: int = 81559
    cpu: str = "96"
    memory: str = "1Ti"
    pods: str = "110"


def gpu_node(name: str, shape: NodeShape, zone: str = "local-0") -> dict[str, object]:
    """A KWOK node labelled like one with the NVIDIA GPU operator. Its GPUs are not in its
    allocatable: they are DRA devices (see `gpu_resource_slice`)."""
    resources = {"cpu": shape.cpu, "memory": shape.memory, "pods": shape.pods}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                "node.kubernetes.io/instance-type": f"gpu-{shape.gpus}x",
                "topology.kubernetes.io/zone": zone,
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": shape.gpu_product,
                "nvidia.com/gpu.count": str(shape.gpus),
                "nvidia.com/gpu.memory": str(shape.gpu_memory_mib),
            },
        },
        "status": {"capacity": resources, "allocatable": resources},
    }


def gpu_resource_slice(node: str, shape: NodeShape) -> dict[str, object]:
    """The node's GPUs as a DRA driver publishes them: one slice, a pool named after the node."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}.{GPU_DRIVER}"},
        "spec": {
            "driver": GPU_DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": f"gpu-{index}",
                    "attributes": {
                        "productName": {"string": shape.gpu_product},
                        "index": {"int": index},
                    },
                    "capacity": {"memory": {"value": f"{shape.gpu_memory_mib}Mi"}},
                }
                for index in range(shape.gpus)
            ],
        },
    }


def gpu_device_class() -> dict[str, object]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": GPU_DEVICE_CLASS},
        "spec": {
            "selectors": [{"cel": {"expression": f'device.driver == "{GPU_DRIVER}"'}}],
            "extendedResourceName": GPU_EXTENDED_RESOURCE,
        },
    }


def placeholder_priority_class() -> dict[str, object]:
    """The PriorityClass of the operator's placeholder pods (the Helm chart ships the same):
    they never preempt anything, and ordinary pods cannot preempt them."""
    return {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": PLACEHOLDER_PRIORITY_CLASS},
        "value": PLACEHOLDER_PRIORITY,
        "preemptionPolicy": "Never",
        "globalDefault": False,
        "description": "Reservoir placeholder pods: hold devices for admitted GPU claims.",
    }


def audit_policy() -> dict[str, object]:
    """Pod bindings, pod writes and ResourceClaim writes, with request and response bodies."""
    return {
        "apiVersion": "audit.k8s.io/v1",
        "kind": "Policy",
        "omitStages": ["RequestReceived"],
        "rules": [
            {
                "level": "RequestResponse",
                "resources": [{"group": "", "resources": ["pods/binding"]}],
            },
            {
                "level": "RequestResponse",
                "verbs": AUDITED_WRITES,
                "resources": [
                    {"group": "", "resources": ["pods"]},
                    {
                        "group": "resource.k8s.io",
                        "resources": ["resourceclaims", "resourceclaims/status"],
                    },
                ],
            },
            {"level": "None"},
        ],
    }


def audit_policy_all() -> dict[str, object]:
    """Every request at Metadata level: user, verb, resource, namespace and response code,
    without bodies. Each request is logged once, when its response completes (a watch's
    only when it ends)."""
    return {
        "apiVersion": "audit.k8s.io/v1",
        "kind": "Policy",
        "omitStages": ["RequestReceived", "ResponseStarted"],
        "rules": [{"level": "Metadata"}],
    }


def audit_mode(audit: bool | str | None) -> str | None:
    """The audit mode a flag, an environment value or a saved state names: "writes" (True,
    1, true, yes), "all", else None (off)."""
    if isinstance(audit, str):
        value = audit.strip().lower()
        if value in ("1", "true", "yes", "writes"):
            return "writes"
        return "all" if value == "all" else None
    return "writes" if audit else None


@dataclass
class ClusterState:
    """What ``up`` wrote to disk, so ``down`` and ``status`` can find the processes."""

    pids: dict[str, int] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    audit: bool | str = False  # False, True ("writes") or "all"

    @classmethod
    def load(cls, path: Path) -> ClusterState:
        if not path.exists():
            return cls()
        data = json.loads(path.read_text())
        return cls(
            pids=data.get("pids", {}), ports=data.get("ports", {}), audit=data.get("audit", False)
        )

    def save(self, path: Path) -> None:
        data = {"pids": self.pids, "ports": self.ports, "audit": self.audit}
        path.write_text(json.dumps(data, indent=2))


def log(message: str) -> None:
    print(f"[cluster] {message}", file=sys.stderr, flush=True)


# Ports handed out by this process: each once, though nothing listens on it yet.
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free now, outside the kernel's ephemeral range when it leaves room. A port
    from binding port 0 is an ephemeral one: any outgoing connection made before the
    component listens may take it as its local port (seen in CI: kube-controller-manager
    exited with "bind: address already in use" while the tests' operator was talking to
    another API server)."""
    span = listening_range()
    for _ in range(1000 if span else 20):
        port = random.randrange(*span) if span else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise ClusterError(f"no free port to listen on ({span or 'ephemeral'})")


def listening_range() -> tuple[int, int] | None:
    """Up to 10,000 ports below the ephemeral range (32768-60999 unless configured), or
    above it; None when it leaves fewer than 1,000 either side (then: port 0)."""
    try:
        first, last = (
            int(n) for n in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        )
    except (OSError, ValueError):
        first, last = 32768, 60999
    if first - 1024 >= 1000:
        return max(1024, first - 10_000), first
    if 65535 - last >= 1000:
        return last + 1, min(65536, last + 10_001)
    return None


def build_binaries() -> Path:
    """Build (or find cached) binaries and return the directory that holds them."""
    result = subprocess.run(
        ["bash", str(BUILD_SCRIPT)], check=False, stdout=subprocess.PIPE, text=True
    )
    if result.returncode != 0:
        raise ClusterError(f"building the control-plane binaries failed ({BUILD_SCRIPT})")
    return Path(result.stdout.strip().splitlines()[-1])


# --- PKI -------------------------------------------------------------------------------


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def sign_certificate(pki: Path, name: str, subject: str, extensions: str) -> None:
    key, csr, crt = pki / f"{name}.key", pki / f"{name}.csr", pki / f"{name}.crt"
    openssl("genrsa", "-out", str(key), "2048")
    openssl("req", "-new", "-key", str(key), "-out", str(csr), "-subj", subject)
    with tempfile.NamedTemporaryFile("w", suffix=".ext", delete=False) as ext:
        ext.write(extensions)
    try:
        openssl(
            "x509", "-req", "-in", str(csr), "-CA", str(pki / "ca.crt"),
            "-CAkey", str(pki / "ca.key"), "-CAcreateserial", "-out", str(crt),
            "-days", "3650", "-extfile", ext.name,
        )  # fmt: skip
    finally:
        os.unlink(ext.name)
    csr.unlink()


def ensure_pki(pki: Path) -> None:
    """A private CA, the API server's serving cert, an admin client cert, SA signing keys."""
    if (pki / "admin.crt").exists():
        return
    pki.mkdir(parents=True, exist_ok=True)
    openssl("genrsa", "-out", str(pki / "ca.key"), "2048")
    openssl(
        "req", "-x509", "-new", "-key", str(pki / "ca.key"), "-out", str(pki / "ca.crt"),
        "-days", "3650", "-subj", "/CN=reservoir-local-ca",
    )  # fmt: skip
    sans = ",".join(
        [
            "IP:127.0.0.1",
            "IP:10.96.0.1",
            "DNS:localhost",
            "DNS:kubernetes",
            "DNS:kubernetes.default",
            "DNS:kubernetes.default.svc",
            "DNS:kubernetes.default.svc.cluster.local",
        ]
    )
    sign_certificate(
        pki, "apiserver", "/CN=kube-apiserver",
        f"subjectAltName={sans}\nextendedKeyUsage=serverAuth\n",
    )  # fmt: skip
    sign_certificate(
        pki, "admin", "/O=system:masters/CN=reservoir-admin", "extendedKeyUsage=clientAuth\n"
    )
    openssl("genrsa", "-out", str(pki / "sa.key"), "2048")
    openssl("rsa", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))


def write_kubeconfig(path: Path, pki: Path, port: int) -> None:
    def b64(name: str) -> str:
        return base64.b64encode((pki / name).read_bytes()).decode()

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "reservoir-local",
                "cluster": {
                    "server": f"https://127.0.0.1:{port}",
                    "certificate-authority-data": b64("ca.crt"),
                },
            }
        ],
        "users": [
            {
                "name": "reservoir-admin",
                "user": {
                    "client-certificate-data": b64("admin.crt"),
                    "client-key-data": b64("admin.key"),
                },
            }
        ],
        "contexts": [
            {
                "name": "reservoir-local",
                "context": {"cluster": "reservoir-local", "user": "reservoir-admin"},
            }
        ],
        "current-context": "reservoir-local",
    }
    # JSON is valid YAML, and kubeconfig loaders accept it.
    path.write_text(json.dumps(config, indent=2))
    path.chmod(0o600)


# --- processes -------------------------------------------------------------------------


def process_alive(pid: int, component: str) -> bool:
    """True if `pid` runs and is still our component (pids get reused)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z" and os.path.basename(cmdline) == component


def start(component: str, args: list[str], binaries: Path, logs: Path) -> subprocess.Popen[bytes]:
    logfile = (logs / f"{component}.log").open("ab")
    process = subprocess.Popen(
        [str(binaries / component), *args],
        stdout=logfile,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # our own process group: a Ctrl-C in the shell won't kill it
    )
    logfile.close()
    return process


def stop(pid: int, component: str, grace: float = 10.0) -> None:
    if not process_alive(pid, component):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not process_alive(pid, component):
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    while process_alive(pid, component):
        time.sleep(0.05)


def wait_until(
    what: str,
    check: Callable[[], object],
    timeout: float,
    logfile: Path,
    process: subprocess.Popen[bytes] | None = None,
) -> None:
    """Poll `check()` until it is truthy; on timeout or a dead process, point at the log.
    A process must still run once its check passed: a component that could not listen on
    its port exits at once, and another process listening there may answer its health
    check (seen in CI)."""
    deadline = time.monotonic() + timeout
    last_error = ""
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise ClusterError(
                f"{what} exited (code {process.returncode}) during start-up; see its log: {logfile}"
            )
        try:
            passed = check()
        except Exception as error:  # any failure is "not ready yet"
            passed, last_error = False, f" (last error: {error})"
        if passed:
            if process is not None:
                time.sleep(0.5)
                if process.poll() is not None:
                    continue  # reported as exited above
            return
        time.sleep(0.3)
    raise ClusterError(f"{what} not ready after {timeout:.0f}s{last_error}; see its log: {logfile}")


def https_ok(url: str, pki: Path | None = None) -> bool:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    if pki is not None:
        context.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    with urllib.request.urlopen(url, context=context, timeout=3) as response:
        return bool(response.status == 200)


def http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=3) as response:
        return bool(response.status == 200)


# --- the cluster -----------------------------------------------------------------------


class LocalCluster:
    def __init__(
        self,
        directory: Path,
        nodes: NodeShape | None = None,
        audit: bool | str | None = None,
        feature_gates: str = "",
    ) -> None:
        """audit: True (or "writes") for the default audit policy, "all" for every request
        at Metadata level; None: from RESERVOIR_AUDIT (off unless 1/true/yes, or all).
        feature_gates: the API server's `--feature-gates` (a test of an older server's
        behaviour: "WatchList=false")."""
        self.feature_gates = feature_gates
        self.dir = directory.resolve()
        self.pki = self.dir / "pki"
        self.logs = self.dir / "logs"
        self.kubeconfig = self.dir / "kubeconfig"
        self.state_file = self.dir / "state.json"
        self.audit_policy = self.dir / "audit-policy.json"
        self.audit_log = self.logs / "audit.log"
        self.nodes = nodes or NodeShape()
        if audit is None:
            audit = os.environ.get("RESERVOIR_AUDIT", "")
        self.audit_mode = audit_mode(audit)
        self.audit = self.audit_mode is not None
        self.binaries: Path | None = None

    # - public verbs -

    def up(self) -> None:
        if self.healthy():
            running = audit_mode(ClusterState.load(self.state_file).audit)
            if not self.audit or running == self.audit_mode:
                log(f"already running (kubeconfig: {self.kubeconfig})")
                return
            log(f"restarting: audit mode {self.audit_mode} was asked for, it runs {running}")
        self.down(quiet=True)
        started = time.monotonic()
        self.binaries = build_binaries()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        for old in self.logs.glob("*.log"):  # the audit log too
            old.unlink()
        shutil.rmtree(self.dir / "etcd-data", ignore_errors=True)
        ensure_pki(self.pki)
        if self.audit:
            policy = audit_policy_all() if self.audit_mode == "all" else audit_policy()
            self.audit_policy.write_text(json.dumps(policy, indent=2))
        saved: bool | str = "all" if self.audit_mode == "all" else self.audit
        state = ClusterState(ports={name: free_port() for name in COMPONENTS}, audit=saved)
        state.ports["etcd-peer"] = free_port()
        write_kubeconfig(self.kubeconfig, self.pki, state.ports["kube-apiserver"])
        try:
            for component in COMPONENTS:
                process = start(
                    component, self.arguments(component, state.ports), self.binaries, self.logs
                )
                state.pids[component] = process.pid
                state.save(self.state_file)
                self.wait_ready(component, state.ports[component], process)
            self.create_gpu_nodes()
            self.wait_nodes_ready()
            self.wait_default_service_account()
        except BaseException:
            self.down(quiet=True)
            raise
        log(f"up in {time.monotonic() - started:.1f}s: {self.nodes.count} GPU nodes")

    def down(self, quiet: bool = False) -> None:
        state = ClusterState.load(self.state_file)
        for component in reversed(COMPONENTS):
            pid = state.pids.get(component)
            if pid:
                stop(pid, component)
        if self.state_file.exists():
            self.state_file.unlink()
        shutil.rmtree(self.dir / "etcd-data", ignore_errors=True)
        if not quiet:
            log("down: no control-plane process left running")

    def healthy(self) -> bool:
        state = ClusterState.load(self.state_file)
        if not state.pids or not self.kubeconfig.exists():
            return False
        if not all(process_alive(state.pids.get(c, 0), c) for c in COMPONENTS):
            return False
        try:
            port = state.ports["kube-apiserver"]
            return https_ok(f"https://127.0.0.1:{port}/readyz", self.pki)
        except (OSError, KeyError, urllib.error.URLError):
            return False

    def kubectl(self, *args: str, input: str | None = None) -> str:
        binaries = self.binaries or build_binaries()
        deadline = time.monotonic() + KUBECTL_WAIT_RETRY_SECONDS
        while True:
            result = subprocess.run(
                [str(binaries / "kubectl"), "--kubeconfig", str(self.kubeconfig), *args],
                input=input,
                capture_output=True,
                text=True,
                check=False,
            )
            if result.returncode == 0:
                return result.stdout
            null_conditions = args[:1] == ("wait",) and NULL_CONDITIONS in result.stderr
            if null_conditions and time.monotonic() < deadline:
                time.sleep(0.5)
                continue
            raise ClusterError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")

    # - internals -

    def arguments(self, component: str, ports: dict[str, int]) -> list[str]:
        pki, kubeconfig = self.pki, str(self.kubeconfig)
        delegated_auth = [
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={ports[component]}",
            "--leader-elect=false",
        ]
        if component == "etcd":
            client, peer = (
                f"http://127.0.0.1:{ports['etcd']}",
                f"http://127.0.0.1:{ports['etcd-peer']}",
            )
            return [
                f"--data-dir={self.dir / 'etcd-data'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=default={peer}",
                "--unsafe-no-fsync",  # a throwaway test store: durability is not the point
                "--log-level=warn",
            ]
        if component == "kube-apiserver":
            return [
                f"--etcd-servers=http://127.0.0.1:{ports['etcd']}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={ports['kube-apiserver']}",
                f"--cert-dir={pki}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=RBAC",
                "--allow-privileged=true",
                "--endpoint-reconciler-type=none",
                *self.audit_arguments(),
                *([f"--feature-gates={self.feature_gates}"] * bool(self.feature_gates)),
                "--v=1",
            ]
        if component == "kube-controller-manager":
            return [
                *delegated_auth,
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--controllers=*",
                "--use-service-account-credentials=false",
                "--v=1",
            ]
        if component == "kube-scheduler":
            return [*delegated_auth, "--v=1"]
        if component == "kwok":
            return [
                f"--kubeconfig={kubeconfig}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
                f"--server-address=127.0.0.1:{ports['kwok']}",
                "--cidr=10.244.0.0/16",
                "--node-ip=10.240.0.1",
                "--node-lease-duration-seconds=40",
            ]
        raise ValueError(component)

    def audit_arguments(self) -> list[str]:
        if not self.audit:
            return []
        return [
            f"--audit-policy-file={self.audit_policy}",
            f"--audit-log-path={self.audit_log}",
            "--audit-log-format=json",
            "--audit-log-mode=blocking",  # each event is written before the request returns
            "--audit-log-maxsize=0",  # no rotation: one file for the whole run
        ]

    def wait_ready(self, component: str, port: int, process: subprocess.Popen[bytes]) -> None:
        logfile = self.logs / f"{component}.log"
        checks = {
            "etcd": lambda: http_ok(f"http://127.0.0.1:{port}/health"),
            "kube-apiserver": lambda: https_ok(f"https://127.0.0.1:{port}/readyz", self.pki),
            "kube-controller-manager": lambda: https_ok(f"https://127.0.0.1:{port}/healthz"),
            "kube-scheduler": lambda: https_ok(f"https://127.0.0.1:{port}/healthz"),
            "kwok": lambda: http_ok(f"http://127.0.0.1:{port}/healthz"),
        }
        wait_until(component, checks[component], timeout=90, logfile=logfile, process=process)
        log(f"{component} ready (pid {process.pid})")

    def gpu_node_names(self) -> list[str]:
        return [f"gpu-node-{index}" for index in range(self.nodes.count)]

    def create_gpu_nodes(self) -> None:
        """The nodes, their GPUs as ResourceSlices and the DeviceClass, in one apply."""
        names = self.gpu_node_names()
        items = [
            *(gpu_node(name, self.nodes, zone=f"local-{i % 2}") for i, name in enumerate(names)),
            gpu_device_class(),
            placeholder_priority_class(),
            *(gpu_resource_slice(name, self.nodes) for name in names),
        ]
        self.kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}),
        )

    def wait_nodes_ready(self) -> None:
        def all_ready() -> bool:
            nodes = json.loads(self.kubectl("get", "nodes", "-o", "json"))["items"]
            ready = [
                n
                for n in nodes
                if any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in n.get("status", {}).get("conditions", [])
                )
            ]
            return len(ready) >= self.nodes.count

        wait_until("GPU nodes (kwok)", all_ready, timeout=60, logfile=self.logs / "kwok.log")
        log(f"{self.nodes.count} GPU nodes Ready")

    def wait_default_service_account(self) -> None:
        # Pods are refused until the controller manager has made the `default` ServiceAccount.
        wait_until(
            "default ServiceAccount (kube-controller-manager)",
            lambda: self.kubectl("get", "serviceaccount", "default", "-o", "name"),
            timeout=60,
            logfile=self.logs / "kube-controller-manager.log",
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("verb", choices=["up", "down", "status", "build"])
    parser.add_argument("--dir", default=os.environ.get("RESERVOIR_CLUSTER_DIR", REPO / ".cluster"))
    parser.add_argument("--nodes", type=int, default=int(os.environ.get("RESERVOIR_NODES", 4)))
    parser.add_argument(
        "--gpus-per-node", type=int, default=int(os.environ.get("RESERVOIR_GPUS_PER_NODE", 8))
    )
    parser.add_argument(
        "--gpu-product", default=os.environ.get("RESERVOIR_GPU_PRODUCT", NodeShape.gpu_product)
    )
    parser.add_argument(
        "--audit",
        action="store_true",
        default=None,
        help="audit log of pod bindings and pod/ResourceClaim writes in <dir>/logs/audit.log "
        "(default: RESERVOIR_AUDIT)",
    )
    parser.add_argument(
        "--audit-all",
        action="store_true",
        help="audit log of every request at Metadata level, for the benchmarks",
    )
    args = parser.parse_args(argv)
    shape = NodeShape(count=args.nodes, gpus=args.gpus_per_node, gpu_product=args.gpu_product)
    audit: bool | str | None = "all" if args.audit_all else args.audit
    cluster = LocalCluster(Path(args.dir), shape, audit=audit)
    try:
        if args.verb == "build":
            print(build_binaries())
        elif args.verb == "up":
            cluster.up()
            print(f"export KUBECONFIG={cluster.kubeconfig}")
        elif args.verb == "down":
            cluster.down()
        else:
            healthy = cluster.healthy()
            print("running" if healthy else "not running")
            return 0 if healthy else 1
    except ClusterError as error:
        log(f"error: {error}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
