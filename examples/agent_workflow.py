"""An agent that may call one of eight tools (branch-claims.txt's example), with a budget
of tokens and cost (Consumable) and 4 concurrency permits (Reusable).

Every branch holds a permit while it is held, so of eight tentative claims four are
admitted and four wait for a permit. The planner selects two; the other six are pruned
and their capacity returns at once; the two report usage and settle: their tokens and
cost commit C and return R − C, their permits come back whole (README "Resource
contracts"). With every permit back, the agent runs four follow-up calls at once.

    python examples/agent_workflow.py --namespace reservoir-demo
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import time
from typing import Any

from reservoir.core.ledger import render
from reservoir.sdk import ClaimView, Reservoir

TOOLS = [
    "web-search",
    "code-exec",
    "sql",
    "browser",
    "calculator",
    "image-gen",
    "email",
    "calendar",
]
SELECTED = {"web-search": ("12k", "0.35"), "code-exec": ("4500", "0.10")}
PERMITS = 4  # the envelope's concurrency: branches held at once
# Each branch holds one concurrency permit with its tokens and cost.
REQUESTS = {"tokens": "20k", "cost": "1", "concurrency": "1"}
FOLLOW_UPS = ["summarize", "cite", "check", "reply"]


def say(message: str) -> None:
    print(f"-- {message}", flush=True)


def available(reservoir: Reservoir) -> str:
    return render(reservoir.ledger("research-agent").status.totals.available)


def admitted(reservoir: Reservoir, claims: dict[str, ClaimView], count: int) -> list[str]:
    """The tools whose claims hold capacity, once `count` of them do (within 60 s)."""
    deadline = time.monotonic() + 60
    while True:
        views = {tool: reservoir.get(claim) for tool, claim in claims.items()}
        held = [tool for tool, view in views.items() if view.phase.value == "Tentative"]
        if len(held) >= count or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


def envelope(namespace: str) -> dict[str, Any]:
    """The workflow's envelope."""
    return {
        "apiVersion": "reservoir.dev/v1alpha1",
        "kind": "ReservationEnvelope",
        "metadata": {"name": "research-agent", "namespace": namespace},
        "spec": {
            # tokens and cost are Consumable, concurrency Reusable: the defaults by name,
            # spelled out here for the reader.
            "capacity": {"tokens": "200k", "cost": "10", "concurrency": str(PERMITS)},
            "contracts": {
                "tokens": {"type": "Consumable"},
                "cost": {"type": "Consumable"},
                "concurrency": {"type": "Reusable"},
            },
            "policy": {"maxActiveClaims": 8, "defaultLeaseSeconds": 300},
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--namespace", default="reservoir-demo")
    parser.add_argument("--kubectl", default="kubectl")
    args = parser.parse_args()

    subprocess.run(
        [args.kubectl, "apply", "-f", "-"],
        input=json.dumps(envelope(args.namespace)),
        text=True,
        check=True,
    )
    with Reservoir(namespace=args.namespace) as reservoir:
        say("the agent may call one of eight tools: hold a tentative claim for each")
        claims = {
            tool: reservoir.hold("research-agent", tool, REQUESTS, name=f"agent-{tool}")
            for tool in TOOLS
        }
        held = admitted(reservoir, claims, PERMITS)
        waiting = [tool for tool in TOOLS if tool not in held]
        reason = reservoir.get(claims[waiting[0]]).status.queue_reason if waiting else None
        say(
            f"{len(held)} claims Tentative, one concurrency permit each; {len(waiting)} wait "
            f"for a permit ({reason or 'queued'}); available: {available(reservoir)}"
        )

        say(f"the planner selects {', '.join(SELECTED)}; the six other branches are pruned")
        for tool in TOOLS:
            if tool not in SELECTED:
                reservoir.cancel(reservoir.get(claims[tool]))
        for tool in TOOLS:
            if tool not in SELECTED:
                reservoir.wait(claims[tool], phase="Released")
        # Each selected branch's worker keeps its lease alive while it runs: renewed in the
        # background, and given up (lease.require() raising) before it could lapse unseen.
        with contextlib.ExitStack() as kept:
            leases = {
                tool: kept.enter_context(
                    reservoir.keep_alive(reservoir.wait(claims[tool], phase="Tentative"))
                )
                for tool in SELECTED
            }
            for tool, lease in leases.items():
                lease.require()  # the tool is called only on a lease still vouched for
                claims[tool] = reservoir.dispatch(lease.claim)
            say(
                f"pruned capacity is back at once; the two dispatched, their leases kept "
                f"alive: available {available(reservoir)}"
            )

            for tool, (tokens, cost) in SELECTED.items():
                claim = reservoir.wait(claims[tool], phase="Committed")
                claim = reservoir.report_usage(claim, {"tokens": "1k", "cost": "0.01"})
                reservoir.finish(reservoir.get(claim), {"tokens": tokens, "cost": cost})
                settled = reservoir.wait(claim, phase="Consumed")
                say(
                    f"{tool} finished: consumed {settled.status.consumed['tokens']} tokens, "
                    f"returned {settled.status.released['tokens']} and its permit "
                    f"(concurrency {settled.status.released.get('concurrency', 0)} returned)"
                )
        say(f"every permit is back: available {available(reservoir)}")

        say(f"the next step: {len(FOLLOW_UPS)} follow-up calls at once, one permit each")
        follow = [
            reservoir.hold("research-agent", step, REQUESTS, name=f"agent-{step}", dispatch=True)
            for step in FOLLOW_UPS
        ]
        follow = [reservoir.wait(claim, phase="Committed") for claim in follow]
        say(f"all {len(follow)} running: available {available(reservoir)}")
        for claim in follow:
            reservoir.finish(reservoir.get(claim), {"tokens": "2k", "cost": "0.05"})
        for claim in follow:
            reservoir.wait(claim, phase="Consumed")
        say(f"follow-ups settled: available {available(reservoir)}")


if __name__ == "__main__":
    main()
