"""Benchmark: claims settled per second through the operator, against a raw API baseline.

    make bench                      # against the local cluster (make cluster-up first)
    .venv/bin/python bench/settlement.py --claims 200

Both halves run in the same process, against the same API server, in the same minute:

- baseline: the API-server work one claim needs at the least, with no operator: create
  an object, then two spec patches (dispatch, final usage) and a status write;
- reservoir: the same claims through the real operator: hold → Committed (lazily
  dispatched) → finish → Consumed, timed until every claim has settled.

It prints claims/s for both, their ratio, latency percentiles (create → settled), and the
operator's ledger writes per claim (group commit makes this < 1 under load). A benchmark,
not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lightkube import Client, KubeConfig
from lightkube.generic_resource import create_namespaced_resource
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.types import PatchType

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "operator")]

from tests.clusters import schemaless_crd  # noqa: E402

from reservoir.sdk import Reservoir  # noqa: E402

KUBECTL = Path.home() / ".cache" / "reservoir" / "bin" / "current" / "kubectl"
BASELINE_CRD = schemaless_crd("bench.reservoir.dev", "RawClaim", "rawclaims")


def kubectl(kubeconfig: str, *args: str, stdin: str | None = None) -> str:
    return subprocess.run(
        [str(KUBECTL), "--kubeconfig", kubeconfig, *args],
        input=stdin,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def percentiles(samples: list[float]) -> str:
    ordered = sorted(samples)
    pick = {p: ordered[min(len(ordered) - 1, int(len(ordered) * p / 100))] for p in (50, 90, 99)}
    return " ".join(f"p{p}={v * 1000:.0f}ms" for p, v in pick.items())


def baseline(kubeconfig: str, namespace: str, claims: int, workers: int) -> float:
    kubectl(kubeconfig, "apply", "-f", "-", stdin=json.dumps(BASELINE_CRD))
    kubectl(kubeconfig, "wait", "--for=condition=Established", "crd/rawclaims.bench.reservoir.dev")
    raw = create_namespaced_resource("bench.reservoir.dev", "v1", "RawClaim", "rawclaims")
    client = Client(KubeConfig.from_file(kubeconfig), field_manager="bench")

    def one(index: int) -> None:
        name = f"raw-{index}"
        client.create(raw(metadata=ObjectMeta(name=name, namespace=namespace), spec={"n": 1}))
        for spec in ({"dispatch": True}, {"usage": "5", "final": True}):
            client.patch(raw, name, {"spec": spec}, namespace=namespace, patch_type=PatchType.MERGE)
        client.patch(
            raw.Status,
            name,
            {"status": {"phase": "Consumed"}},
            namespace=namespace,
            patch_type=PatchType.MERGE,
        )

    started = time.monotonic()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, range(claims)))
    return time.monotonic() - started


def operator_writes(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    found = re.findall(r'reservoir_ledger_writes_total\{.*result="written"\} ([0-9.e+]+)', text)
    return sum(float(v) for v in found)


def reservoir(
    kubeconfig: str, namespace: str, claims: int, workers: int
) -> tuple[float, list[float], float]:
    kubectl(kubeconfig, "apply", "-f", str(REPO / "crds"))
    envelope = {
        "apiVersion": "reservoir.dev/v1alpha1",
        "kind": "ReservationEnvelope",
        "metadata": {"name": "bench", "namespace": namespace},
        "spec": {
            "capacity": {"tokens": "1e9"},
            "policy": {"maxActiveClaims": 256, "defaultLeaseSeconds": 600},
        },
    }
    kubectl(kubeconfig, "apply", "-f", "-", stdin=json.dumps(envelope))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    operator = subprocess.Popen(
        [
            str(REPO / ".venv" / "bin" / "reservoir-operator"),
            "-n",
            namespace,
            "--metrics-port",
            str(port),
        ],
        env={**os.environ, "KUBECONFIG": kubeconfig},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    latencies: list[float] = []
    try:
        time.sleep(3)  # operator start-up

        def one(slot: int) -> None:
            with Reservoir(namespace=namespace, kubeconfig=kubeconfig) as sdk:
                for index in range(slot, claims, workers):
                    t0 = time.monotonic()
                    claim = sdk.hold(
                        "bench", f"b{index}", {"tokens": "10"}, name=f"c-{index}", dispatch=True
                    )
                    claim = sdk.wait(claim, phase="Committed", within=120)
                    sdk.finish(claim, {"tokens": "5"})
                    sdk.wait(claim, phase="Consumed", within=120)
                    latencies.append(time.monotonic() - t0)

        started = time.monotonic()
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(one, range(workers)))
        elapsed = time.monotonic() - started
        writes = operator_writes(port)
    finally:
        os.killpg(operator.pid, signal.SIGTERM)
        operator.wait(timeout=15)
    return elapsed, latencies, writes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--claims", type=int, default=200)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--kubeconfig", default=str(REPO / ".cluster" / "kubeconfig"))
    args = parser.parse_args()
    namespace = f"bench-{uuid.uuid4().hex[:6]}"
    kubectl(args.kubeconfig, "create", "namespace", namespace)
    try:
        raw_seconds = baseline(args.kubeconfig, namespace, args.claims, args.workers)
        seconds, latencies, writes = reservoir(
            args.kubeconfig, namespace, args.claims, args.workers
        )
    finally:
        kubectl(args.kubeconfig, "delete", "namespace", namespace, "--wait=false")
    raw_rate, rate = args.claims / raw_seconds, args.claims / seconds
    print(f"claims: {args.claims}, client workers: {args.workers}")
    print(f"baseline (raw API writes, no operator): {raw_rate:8.1f} claims/s")
    print(f"reservoir (hold → dispatch → settle):   {rate:8.1f} claims/s")
    print(f"ratio reservoir/baseline:               {rate / raw_rate:8.2f}")
    print(
        f"latency create → settled:               {percentiles(latencies)}"
        f" (mean {statistics.mean(latencies) * 1000:.0f}ms)"
    )
    print(f"ledger writes per claim:                {writes / args.claims:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
