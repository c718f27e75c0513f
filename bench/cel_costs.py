#!/usr/bin/env python3
"""What the claim's CEL rules cost each claim status write, by where the rules sit.

    make cluster-up && KUBECONFIG=.cluster/kubeconfig .venv/bin/python bench/cel_costs.py

On a local control plane (hack/localcluster.py, in RESERVOIR_CLUSTER_DIR or .cluster: its
API server's process is read from the cluster's state file), with crds/ applied first and no
operator running: 40 claims admitted by the writer itself (request_costs.fill_ledger),
then rounds of the operator's kind of status write (the whole status, one field moved), 24
in flight, under each variant of the BranchClaim CRD in turn: as shipped, without its
root rules, without the rules under `spec`, without the `spec` object's own rules, and
with none. API server CPU per write, from /proc. The CRD as shipped is applied again at
the end. Not a test: a measurement behind the README's "where the time goes"."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace
from lightkube.types import PatchType

from request_costs import fill_ledger
from reservoir.k8s.resources import BranchClaim, get_object
from reservoir.k8s.transport import fast_client

REPO = Path(__file__).resolve().parents[1]
CRD = REPO / "crds" / "reservoir.dev_branchclaims.yaml"
CLUSTER = Path(os.environ.get("RESERVOIR_CLUSTER_DIR") or REPO / ".cluster")
KUBECTL = os.environ.get("KUBECTL") or str(Path.home() / ".cache/reservoir/bin/current/kubectl")
CLAIMS, WRITES, IN_FLIGHT, ROUNDS = 40, 1600, 24, 2

# Which rules each variant removes, by the path of the schema node that declares them.
VARIANTS: dict[str, Callable[[str], bool]] = {
    "as shipped": lambda path: False,
    "no root rules": lambda path: path == "",
    "no rules under spec": lambda path: path.startswith(".spec"),
    "no rules on spec itself": lambda path: path == ".spec",
    "no rules": lambda path: True,
}


def apiserver_cpu() -> float:
    """This cluster's API server (another may run beside it: a benchmark's, the tests')."""
    pid = json.loads((CLUSTER / "state.json").read_text())["pids"]["kube-apiserver"]
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def without_rules(node: dict[str, Any], removed: Callable[[str], bool], path: str = "") -> None:
    if removed(path):
        node.pop("x-kubernetes-validations", None)
    for name, child in (node.get("properties") or {}).items():
        without_rules(child, removed, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        without_rules(node["items"], removed, f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        without_rules(node["additionalProperties"], removed, f"{path}{{}}")


def apply(variant: str) -> None:
    crd = yaml.safe_load(CRD.read_text())
    without_rules(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"], VARIANTS[variant])
    subprocess.run(
        [KUBECTL, "apply", "--server-side", "--force-conflicts", "-f", "-"],
        input=json.dumps(crd),
        text=True,
        check=True,
        capture_output=True,
    )


def install_crds() -> None:
    subprocess.run(
        [KUBECTL, "apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds")],
        check=True,
        capture_output=True,
    )


async def main() -> dict[str, list[float]]:
    client = fast_client()
    namespace = f"cel-costs-{int(time.time())}"
    await client.create(Namespace(metadata=ObjectMeta(name=namespace)))
    await fill_ledger(client, namespace, CLAIMS)
    statuses: dict[str, Any] = {}
    for index in range(CLAIMS):
        claim = await get_object(client, BranchClaim, f"c-{index:03d}", namespace)
        assert claim is not None
        statuses[claim["metadata"]["name"]] = claim["status"]
    names = sorted(statuses)
    slots = asyncio.Semaphore(IN_FLIGHT)
    sent = 0

    async def write(count: int) -> None:
        name = names[count % len(names)]
        moved = {**statuses[name], "observedGeneration": 100_000 + count}
        async with slots:
            await client.patch(
                BranchClaim.Status,
                name,
                [{"op": "replace", "path": "/status", "value": moved}],
                namespace=namespace,
                patch_type=PatchType.JSON,
            )

    figures: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    try:
        for _ in range(ROUNDS):
            for variant in VARIANTS:
                apply(variant)
                await asyncio.sleep(4)  # the new schema in force
                await asyncio.gather(*(write(sent + i) for i in range(100)))  # warm
                sent += 100
                cpu = apiserver_cpu()
                await asyncio.gather(*(write(sent + i) for i in range(WRITES)))
                sent += WRITES
                ms = (apiserver_cpu() - cpu) / WRITES * 1000
                figures[variant].append(round(ms, 2))
                print(f"{variant}: {ms:.2f} ms of API server CPU a status write", flush=True)
    finally:
        apply("as shipped")
    return figures


if __name__ == "__main__":
    install_crds()
    print(json.dumps(asyncio.run(main()), indent=2))
