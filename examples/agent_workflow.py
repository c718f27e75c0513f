"""An agent that may call one of eight tools (branch-claims.txt's example).

Eight tentative claims are held from one envelope; the planner selects two, which are
dispatched; the other six are pruned and their capacity returns at once; the two report
partial usage and settle (commit C, return R − C).

    python examples/agent_workflow.py --namespace reservoir-demo
"""

from __future__ import annotations

import argparse
import json
import subprocess

from reservoir.sdk import Reservoir

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


def say(message: str) -> None:
    print(f"-- {message}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--namespace", default="reservoir-demo")
    parser.add_argument("--kubectl", default="kubectl")
    args = parser.parse_args()

    envelope = {
        "apiVersion": "reservoir.dev/v1alpha1",
        "kind": "ReservationEnvelope",
        "metadata": {"name": "research-agent", "namespace": args.namespace},
        "spec": {
            "capacity": {"tokens": "200k", "cost": "10"},
            "policy": {"maxActiveClaims": 8, "defaultLeaseSeconds": 300},
        },
    }
    subprocess.run(
        [args.kubectl, "apply", "-f", "-"], input=json.dumps(envelope), text=True, check=True
    )
    with Reservoir(namespace=args.namespace) as reservoir:
        say("the agent may call one of eight tools: hold a tentative claim for each")
        claims = {
            tool: reservoir.hold(
                "research-agent", tool, {"tokens": "20k", "cost": "1"}, name=f"agent-{tool}"
            )
            for tool in TOOLS
        }
        claims = {t: reservoir.wait(c, phase="Tentative") for t, c in claims.items()}
        available = reservoir.ledger("research-agent").status.summary.available
        say(f"8 claims Tentative; envelope available: {available}")

        say(f"the planner selects {', '.join(SELECTED)}: dispatch them (the commit point)")
        for tool in SELECTED:
            claims[tool] = reservoir.dispatch(claims[tool])
        say("the six other branches are pruned: cancel them")
        for tool in TOOLS:
            if tool not in SELECTED:
                reservoir.cancel(claims[tool])
        for tool in TOOLS:
            if tool not in SELECTED:
                reservoir.wait(claims[tool], phase="Released")
        available = reservoir.ledger("research-agent").status.summary.available
        say(f"pruned capacity is back before the workflow ends; available: {available}")

        for tool, (tokens, cost) in SELECTED.items():
            claim = reservoir.wait(claims[tool], phase="Committed")
            claim = reservoir.report_usage(claim, {"tokens": "1k", "cost": "0.01"})
            reservoir.finish(reservoir.get(claim), {"tokens": tokens, "cost": cost})
            settled = reservoir.wait(claim, phase="Consumed")
            say(
                f"{tool} finished: consumed {settled.status.consumed['tokens']} tokens, "
                f"returned {settled.status.released['tokens']}"
            )


if __name__ == "__main__":
    main()
