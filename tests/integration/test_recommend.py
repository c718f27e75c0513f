"""`kubectl reservoir recommend CLASS`: right-sizing from the settled claims of a workflow
class, against the real control plane and a real operator."""

from __future__ import annotations

import json
from typing import Any

from reservoir.k8s.resources import WORKFLOW_CLASS_LABEL
from reservoir.sdk import Reservoir
from tests.clusters import ClusterHandle
from tests.integration.conftest import OperatorProcess
from tests.integration.helpers import plugin, wait_phase

REQUEST = {"tokens": "20k", "cost": "2", "concurrency": "1"}
# name → (envelope, final usage); every claim reserves REQUEST.
USAGE = {
    "a": ("wf-a", {"tokens": "12k", "cost": "0.35"}),
    "b": ("wf-a", {"tokens": "5k", "cost": "0.5"}),
    "c": ("wf-a", {"tokens": "20k", "cost": "1.25"}),
    "d": ("wf-b", {"tokens": "8k", "cost": "0.1"}),
    "e": ("wf-b", {"tokens": "25k", "cost": "0.5"}),  # overrun: charged 20k, needed 25k
    "f": ("wf-b", {"tokens": "15k", "cost": "0.75"}),
}


def envelope(cluster: ClusterHandle, ns: str, name: str, workflow_class: str | None) -> None:
    labels = {WORKFLOW_CLASS_LABEL: workflow_class} if workflow_class else {}
    body = {
        "apiVersion": "reservoir.dev/v1alpha1",
        "kind": "ReservationEnvelope",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {
            # concurrency is Reusable by default: a permit comes back when its claim ends.
            "capacity": {"tokens": "200k", "cost": "20", "concurrency": "8"},
            "policy": {"defaultLeaseSeconds": 120},
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))


def test_recommend_summarizes_a_workflow_class_from_its_settled_claims(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    workflow_class = f"research-{ns}"  # unique across namespaces, for -A
    envelope(cluster, ns, "wf-a", workflow_class)
    envelope(cluster, ns, "wf-b", workflow_class)
    envelope(cluster, ns, "other", None)  # not of the class: its claim must not count

    held = {
        name: sdk.hold(env, name, REQUEST, name=name, dispatch=True)
        for name, (env, _) in USAGE.items()
    }
    pruned = sdk.hold("wf-a", "g", REQUEST, name="g")
    stray = sdk.hold("other", "z", REQUEST, name="z", dispatch=True)
    # Every claim holds its permit at once before any ends: wf-a's peak is 4 (a, b, c and
    # g), wf-b's 3.
    committed = {name: wait_phase(sdk, held[name], "Committed") for name in USAGE}
    wait_phase(sdk, pruned, "Tentative")
    for name, (_, usage) in USAGE.items():
        sdk.finish(committed[name], usage)
    sdk.finish(wait_phase(sdk, stray, "Committed"), {"tokens": "1", "cost": "1"})
    sdk.cancel(wait_phase(sdk, pruned, "Tentative"))
    for name in [*USAGE, "z"]:
        wait_phase(sdk, name, "Consumed")
    wait_phase(sdk, "g", "Released")
    assert sdk.get("e").status.overrun is not None

    done = plugin(cluster, ns, "recommend", workflow_class, "-n", ns, "-o", "json")
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    assert report["envelopes"] == [f"{ns}/wf-a", f"{ns}/wf-b"]
    assert (report["namespace"], report["claims"], report["excluded"]) == (ns, 6, {"Released": 1})
    by = {r["resource"]: r for r in report["resources"]}
    assert sorted(by) == ["cost", "tokens"]  # concurrency is not judged by C against R
    # tokens C sorted: 5k 8k 12k 15k 20k 20k (e capped at R); nearest rank n = 6:
    # p50 = 3rd, p95 = 6th. Demand (e needed 25k): p95 = 25k.
    assert {k: v for k, v in by["tokens"].items() if k != "explanation"} == {
        "resource": "tokens",
        "contract": "Consumable",
        "judgedBy": "consumed C against reserved R per claim",
        "samples": 6,
        "p50Consumed": "12000",
        "p95Consumed": "20000",
        "maxConsumed": "20000",
        "p50Reserved": "20000",
        "p50Ratio": "0.6",
        "p95Ratio": "1",
        "p95Demand": "25000",
        "overran": 1,
        "suggestedRequest": "25000",
    }
    assert "1 of 6 claims overran R" in by["tokens"]["explanation"]
    # cost C sorted: 0.1 0.35 0.5 0.5 0.75 1.25; C/R = C/2
    assert {k: v for k, v in by["cost"].items() if k != "explanation"} == {
        "resource": "cost",
        "contract": "Consumable",
        "judgedBy": "consumed C against reserved R per claim",
        "samples": 6,
        "p50Consumed": "0.5",
        "p95Consumed": "1.25",
        "maxConsumed": "1.25",
        "p50Reserved": "2",
        "p50Ratio": "0.25",
        "p95Ratio": "0.625",
        "p95Demand": "1.25",
        "overran": 0,
        "suggestedRequest": "1.25",
    }
    # The permits: peak concurrent use of each envelope against its capacity, [3, 4].
    assert report["peakEnvelopes"] == 2
    (permits,) = report["capacities"]
    assert {k: v for k, v in permits.items() if k != "explanation"} == {
        "resource": "concurrency",
        "contract": "Reusable",
        "judgedBy": "peak concurrent use against capacity per envelope",
        "envelopes": 2,
        "p50Peak": "3",
        "p95Peak": "4",
        "maxPeak": "4",
        "p50Capacity": "8",
        "p50PeakRatio": "0.375",
        "p95PeakRatio": "0.5",
        "atCapacity": 0,
        "suggests": "capacity",
        "suggested": None,
    }
    assert permits["explanation"] == "too few envelopes (2 < 5): no suggestion"

    # The table, and -A: the same figures from every namespace.
    shown = plugin(cluster, ns, "recommend", workflow_class)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert "6 settled Consumed claim(s) counted (excluded: 1 Released)" in lines[0]
    assert lines[2] == "Consumable: consumed C against reserved R per claim"
    assert lines[4].split() == [
        "RESOURCE",
        "SAMPLES",
        "P50",
        "CONSUMED",
        "P95",
        "CONSUMED",
        "P50",
        "RESERVED",
        "P95",
        "C/R",
        "SUGGESTED",
        "REQUEST",
    ]
    assert lines[5].split() == ["cost", "6", "0.5", "1.25", "2", "0.625", "1.25"]
    assert lines[6].split() == ["tokens", "6", "12000", "20000", "20000", "1", "25000"]
    at = lines.index(
        "Reusable and Replenishing: peak use against capacity (the limit per window) per "
        "envelope, over 2 opened envelope(s)"
    )
    assert lines[at + 3].split() == ["concurrency", "Reusable", "2", "3", "4", "8", "0.5", "0", "-"]
    assert lines[-1] == "concurrency (Reusable): too few envelopes (2 < 5): no suggestion"
    everywhere = plugin(cluster, ns, "recommend", workflow_class, "-A", "-o", "json")
    assert everywhere.returncode == 0, everywhere.stderr
    across = json.loads(everywhere.stdout)
    assert across["namespace"] is None
    assert across["resources"] == report["resources"]
    assert across["capacities"] == report["capacities"]


def test_recommend_names_the_label_it_found_nothing_for(
    cluster: ClusterHandle, ns: str, sdk: Reservoir
) -> None:
    envelope(cluster, ns, "wf", "known")
    unknown = plugin(cluster, ns, "recommend", "nope")
    assert unknown.returncode == 1
    assert unknown.stderr.strip() == (
        f"error: no envelopes with label {WORKFLOW_CLASS_LABEL}=nope in {ns}"
    )
    # An envelope of the class whose claims never settled Consumed, and that never had a
    # permit in use: nothing to suggest.
    empty = plugin(cluster, ns, "recommend", "known", "-o", "json")
    assert empty.returncode == 0, empty.stderr
    assert (json.loads(empty.stdout)["resources"], json.loads(empty.stdout)["capacities"]) == (
        [],
        [],
    )
    table = plugin(cluster, ns, "recommend", "known")
    assert "nothing to suggest" in table.stdout
