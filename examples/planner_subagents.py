"""A planner with two sub-agents: budgets inside budgets (child-settlement.txt, one level
down), drawn from the tenant's pool.

    tenant pool (cluster-scoped, caps the namespace)
      └─ planner envelope          tokens 100k, cost 10
           ├─ researcher envelope  tokens 60k, cost 6  (branches A, B, C, D)
           └─ coder envelope       tokens 30k, cost 3  (lends spare tokens to its sibling)

The researcher runs the seed's four branches in thousands of tokens: A consumes all 20k,
B 12k of 20k, C is pruned before dispatch, D consumes 5k of 20k. A fifth branch E needs
more than the researcher has left, so it borrows from the coder (which lends above its
floor) and repays as its branches settle; what E consumed of the loan and could not repay
is charged to the coder when the researcher closes. When the sub-agents close, each one's committed
total stays committed in the planner and its balance returns there, R − C, once; when the
planner closes, its balance returns to the pool.

    python examples/planner_subagents.py --namespace reservoir-demo-team
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from reservoir.core.ledger import render
from reservoir.sdk import Reservoir

POOL = "reservoir-demo-tenant"  # cluster-scoped: it outlives the namespace, keeping its ledger
CLOSED = json.dumps({"spec": {"state": "Closed"}})
Object = dict[str, Any]


def say(message: str) -> None:
    print(f"-- {message}", flush=True)


def envelope(name: str, namespace: str, capacity: dict[str, str], **spec: object) -> Object:
    return {
        "apiVersion": "reservoir.dev/v1alpha1",
        "kind": "ReservationEnvelope",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"capacity": capacity, **spec},
    }


def nonzero(resources: Mapping[str, Decimal]) -> str:
    return render({k: v for k, v in resources.items() if v})


def wait_for_phase(reservoir: Reservoir, name: str, phase: str, within: float = 60) -> None:
    deadline = time.monotonic() + within
    while reservoir.ledger(name).status.phase.value != phase:
        if time.monotonic() > deadline:
            raise TimeoutError(f"envelope {name} is not {phase} after {within}s")
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--namespace", default="reservoir-demo-team")
    parser.add_argument("--kubectl", default="kubectl")
    args = parser.parse_args()
    ns = args.namespace

    def apply(*objects: Object) -> None:
        for obj in objects:
            subprocess.run(
                [args.kubectl, "apply", "-f", "-"],
                input=json.dumps(obj),
                text=True,
                check=True,
                stdout=subprocess.DEVNULL,
            )

    def close(name: str) -> None:
        subprocess.run(
            [args.kubectl, "-n", ns, "patch", "renv", name, "--type", "merge", "-p", CLOSED],
            check=True,
            stdout=subprocess.DEVNULL,
        )

    pool = {
        "apiVersion": "reservoir.dev/v1alpha1",
        "kind": "ReservationPool",
        "metadata": {"name": POOL},
        "spec": {"capacity": {"tokens": "1M", "cost": "100"}, "namespaces": [ns]},
    }
    apply(pool)
    say(f"tenant pool {POOL}: the root envelopes of {ns} draw from it")
    apply(envelope("planner", ns, {"tokens": "100k", "cost": "10"}))
    apply(
        envelope("researcher", ns, {"tokens": "60k", "cost": "6"}, parent="planner"),
        envelope(
            "coder",
            ns,
            {"tokens": "30k", "cost": "3"},
            parent="planner",
            policy={"lending": {"floor": {"tokens": "10k", "cost": "1"}}},
        ),
    )
    with Reservoir(namespace=ns) as reservoir:
        for name in ("planner", "researcher", "coder"):
            wait_for_phase(reservoir, name, "Open")
        planner = reservoir.ledger("planner").status.summary
        say(f"sub-agents open; planner available {planner.available} (60k + 30k reserved)")

        say("researcher: branches A, B, C reserve 20k each; A and B are dispatched, C pruned")
        held = {
            b: reservoir.hold(
                "researcher", b, {"tokens": "20k", "cost": "1"}, name=f"res-{b.lower()}"
            )
            for b in "ABC"
        }
        for b in "AB":
            held[b] = reservoir.dispatch(reservoir.wait(held[b], phase="Tentative"))
        reservoir.cancel(reservoir.wait(held["C"], phase="Tentative"))
        reservoir.wait(held["C"], phase="Released")
        held["D"] = reservoir.hold(
            "researcher", "D", {"tokens": "20k", "cost": "1"}, name="res-d", dispatch=True
        )
        for branch, tokens in (("A", "20k"), ("B", "12k"), ("D", "5k")):
            claim = reservoir.wait(held[branch], phase="Committed")
            reservoir.finish(reservoir.get(claim), {"tokens": tokens, "cost": "0.5"})
            reservoir.wait(claim, phase="Consumed")
        say("A consumed 20k, B 12k (8k back), C pruned (20k back), D 5k (15k back)")

        say("researcher: branch E needs 40k, more than the 23k it has left: it borrows")
        e = reservoir.hold(
            "researcher", "E", {"tokens": "40k", "cost": "1"}, name="res-e", dispatch=True
        )
        e = reservoir.wait(e, phase="Committed", within=60)
        researcher = reservoir.ledger("researcher").status.totals
        say(f"E admitted on a loan from coder: borrowed {nonzero(researcher.borrowed)}")
        reservoir.finish(reservoir.get(e), {"tokens": "30k", "cost": "0.5"})
        reservoir.wait(e, phase="Consumed")

        say("coder: one branch reserves 10k and consumes 7k")
        c = reservoir.hold("coder", "fix", {"tokens": "10k", "cost": "1"}, name="cod-fix")
        c = reservoir.dispatch(reservoir.wait(c, phase="Tentative"))
        reservoir.finish(reservoir.wait(c, phase="Committed"), {"tokens": "7k", "cost": "0.2"})
        reservoir.wait(c, phase="Consumed")

        say("both sub-agents close: R − C returns to the planner, once")
        for name in ("researcher", "coder"):
            close(name)
        for name in ("researcher", "coder"):
            wait_for_phase(reservoir, name, "Closed")
        deadline = time.monotonic() + 60
        while any(reservoir.ledger("planner").status.totals.reserved.values()):
            if time.monotonic() > deadline:
                raise TimeoutError("the planner has not settled its sub-agents' lines")
            time.sleep(0.2)
        totals = reservoir.ledger("planner").status.totals
        say(f"planner: committed {render(totals.committed)}, available {render(totals.available)}")
        say("(74k tokens committed: A 20k + B 12k + D 5k + E 30k + coder 7k; 26k returned)")
        close("planner")
        wait_for_phase(reservoir, "planner", "Closed")
        say(f"planner closed: its balance returned to the pool {POOL}")


if __name__ == "__main__":
    main()
