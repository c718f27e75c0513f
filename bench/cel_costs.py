#!/usr/bin/env python3
"""What the claim's CEL rules cost each claim status write, by where the rules sit, and what
the API server's field management of the status costs.

    make cluster-up && KUBECONFIG=.cluster/kubeconfig .venv/bin/python bench/cel_costs.py

On a local control plane (hack/localcluster.py, in RESERVOIR_CLUSTER_DIR or .cluster: its
API server's process is read from the cluster's state file), with crds/ applied first and no
operator running: 40 claims admitted by the writer itself (request_costs.fill_ledger),
then rounds of the operator's kind of status write (the whole status, one field moved), 24
in flight, under each variant of the BranchClaim CRD in turn: as shipped, with its status
managed field by field (not one atomic unit), without its root rules, without the rules
under `spec`, and with none. API server CPU per write, from
/proc. The CRD as shipped is applied again at the end. Not a test: a measurement behind
the README's "where the time goes". (The rules over several spec fields, once on the
`spec` object itself, are the claim's admission policy's since 7a2a4ed: status writes no
longer meet them. `git show c6fd2ec:crds/reservoir.dev_branchclaims.yaml` is the CRD
that still had them.)"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace
from lightkube.types import PatchType

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "hack")]

from localcluster import ClusterState, build_binaries  # noqa: E402
from request_costs import fill_ledger  # noqa: E402
from reservoir.k8s.resources import BranchClaim, get_object  # noqa: E402
from reservoir.k8s.transport import fast_client  # noqa: E402
from run import proc_cpu_seconds  # noqa: E402

CRD = REPO / "crds" / "reservoir.dev_branchclaims.yaml"
CLUSTER = Path(os.environ.get("RESERVOIR_CLUSTER_DIR") or REPO / ".cluster")
KUBECTL = str(build_binaries() / "kubectl")
CLAIMS, WRITES, IN_FLIGHT, ROUNDS = 40, 1600, 24, 2

# What each variant changes in the claim's schema: rules removed, by the path of the
# schema node that declares them, or the status made field by field again for the API
# server's field management (managedFields), as it was before 2026-12-04.
Variant = Callable[[dict[str, Any]], None]


def rules_removed(removed: Callable[[str], bool]) -> Variant:
    return lambda schema: without_rules(schema, removed)


def status_field_by_field(schema: dict[str, Any]) -> None:
    schema["properties"]["status"].pop("x-kubernetes-map-type", None)


VARIANTS: dict[str, Variant] = {
    "as shipped": lambda schema: None,
    "status field by field": status_field_by_field,
    "no root rules": rules_removed(lambda path: path == ""),
    "no rules under spec": rules_removed(lambda path: path.startswith(".spec")),
    "no rules": rules_removed(lambda path: True),
}


def apiserver_cpu() -> float:
    """This cluster's API server (another may run beside it: a benchmark's, the tests')."""
    return proc_cpu_seconds(ClusterState.load(CLUSTER / "state.json").pids["kube-apiserver"])


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
    VARIANTS[variant](crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    subprocess.run(
        [KUBECTL, "apply", "--server-side", "--force-conflicts", "-f", "-"],
        input=json.dumps(crd),
        text=True,
        check=True,
        capture_output=True,
    )


def install_crds() -> None:
    """crds/ applied, and served: a kind just created answers 404 until it is established."""
    for command in (
        ["apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds")],
        ["wait", "--for=condition=Established", "crd", "--all", "--timeout=60s"],
    ):
        subprocess.run([KUBECTL, *command], check=True, capture_output=True)


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
        await client.close()
    return figures


if __name__ == "__main__":
    install_crds()
    print(json.dumps(asyncio.run(main()), indent=2))
