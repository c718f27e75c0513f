"""Integration fixtures: the CRDs, a fresh namespace per test, and real operator processes."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from reservoir.sdk import Reservoir
from tests.clusters import ClusterHandle, free_port

REPO = Path(__file__).resolve().parents[2]
OPERATOR = REPO / ".venv" / "bin" / "reservoir-operator"


@pytest.fixture(scope="session")
def crds(cluster: ClusterHandle) -> None:
    install_crds(cluster)


def install_crds(cluster: ClusterHandle) -> None:
    """Reservoir's CRDs, applied and served."""
    cluster.kubectl("apply", "-f", str(REPO / "crds"))
    for name in ("reservationenvelopes", "branchclaims", "reservationpools"):
        # `kubectl wait` fails outright on a CRD whose status has no conditions yet, and
        # an Established CRD may still answer 429 "storage is (re)initializing": wait until
        # a list of the kind is served (a writer driven directly by a test does not retry).
        deadline = time.monotonic() + 60
        while True:
            try:
                cluster.kubectl(
                    "wait",
                    "--for=condition=Established",
                    f"crd/{name}.reservoir.dev",
                    "--timeout=60s",
                )
                cluster.kubectl("get", f"{name}.reservoir.dev", "-A", "--chunk-size=1")
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


@pytest.fixture
def ns(cluster: ClusterHandle, crds: None) -> Iterator[str]:
    name = f"it-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false")


class OperatorProcess:
    """One `reservoir-operator` process, as a user would run it."""

    def __init__(
        self,
        cluster: ClusterHandle,
        namespace: str | None,
        log: Path,
        *extra: str,
        kubeconfig: Path | None = None,
    ) -> None:
        """namespace None: the whole cluster (-A); kubeconfig: other credentials than
        the cluster's (a ServiceAccount token, say)."""
        # Outside the ephemeral range (an operator's liveness port once came from it and an
        # outgoing connection took it first: "Address already in use").
        self.port = free_port()
        self.log = log
        env = {**os.environ, "KUBECONFIG": str(kubeconfig or cluster.kubeconfig_path)}
        scope = ["-n", namespace] if namespace is not None else ["-A"]
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                [
                    str(OPERATOR),
                    *scope,
                    "--metrics-port",
                    "0",
                    "--liveness",
                    f"http://127.0.0.1:{self.port}/healthz",
                    # Tests read why claims wait as soon as they wait (a test's own
                    # --queue-reason-after, later on the line, wins).
                    "--queue-reason-after=0",
                    *extra,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.wait_ready()

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"operator exited; see {self.log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"operator not ready after {timeout}s; see {self.log}")

    def kill(self) -> None:
        """kill -9: no clean-up, no last writes."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


StartOperator = Callable[..., OperatorProcess]


@pytest.fixture
def start_operator(
    cluster: ClusterHandle, ns: str, request: pytest.FixtureRequest
) -> Iterator[StartOperator]:
    started: list[OperatorProcess] = []
    logs = REPO / ".cluster" / "test-logs"
    logs.mkdir(parents=True, exist_ok=True)

    def start(*extra: str, kubeconfig: Path | None = None) -> OperatorProcess:
        log = logs / f"{request.node.name[:60]}-{len(started)}.log"
        operator = OperatorProcess(cluster, ns, log, *extra, kubeconfig=kubeconfig)
        started.append(operator)
        return operator

    yield start
    for operator in started:
        operator.stop()


@pytest.fixture
def operator(start_operator: StartOperator) -> OperatorProcess:
    return start_operator()


@pytest.fixture
def sdk(cluster: ClusterHandle, ns: str) -> Iterator[Reservoir]:
    with Reservoir(namespace=ns, kubeconfig=str(cluster.kubeconfig_path)) as client:
        yield client
