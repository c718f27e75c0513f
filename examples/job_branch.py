"""A Job-backed branch reconciled after its worker disappears: the claim names the Job as
its upstream operation, the worker dispatches it and dies, the lease lapses (Detached),
and the operator settles the claim from the Job's own status (README "Reconciling with
the provider").

    python examples/job_branch.py --namespace reservoir-demo
"""

from __future__ import annotations

import argparse
import json
import subprocess

from reservoir.core.ledger import render
from reservoir.sdk import Reservoir


def say(message: str) -> None:
    print(f"-- {message}", flush=True)


def kubectl(args: argparse.Namespace, *words: str, input: str | None = None) -> str:
    return subprocess.run(
        [args.kubectl, "-n", args.namespace, *words],
        input=input,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--namespace", default="reservoir-demo")
    parser.add_argument("--kubectl", default="kubectl")
    args = parser.parse_args()

    envelope = {
        "apiVersion": "reservoir.dev/v1alpha1",
        "kind": "ReservationEnvelope",
        "metadata": {"name": "batch-summaries", "namespace": args.namespace},
        "spec": {"capacity": {"tokens": "100k"}, "policy": {"defaultLeaseSeconds": 3}},
    }
    kubectl(args, "apply", "-f", "-", input=json.dumps(envelope))
    job_name = "summarize-7"
    with Reservoir(namespace=args.namespace) as reservoir:
        say(f"a branch reserves 20k tokens for the Job {job_name}, which it names upstream")
        claim = reservoir.hold(
            "batch-summaries",
            "summarize",
            {"tokens": "20k"},
            name="summarize-7",
            upstream={"ref": {"name": job_name}, "operationId": job_name, "supportsStatus": True},
        )
        claim = reservoir.wait(claim, phase="Tentative")
        claim = reservoir.dispatch(claim)
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {
                "name": job_name,
                # The label wakes the envelope's writer when the Job changes; the
                # annotations are the Job's report (usage, where its result went).
                "labels": {"reservoir.dev/envelope": "batch-summaries"},
                "annotations": {
                    "reservoir.dev/usage": json.dumps({"tokens": "7k"}),
                    "reservoir.dev/result": "s3://demo/summaries/7.json",
                },
            },
            "spec": {
                "template": {
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": [{"name": "summarize", "image": "busybox", "args": ["true"]}],
                    }
                }
            },
        }
        kubectl(args, "apply", "-f", "-", input=json.dumps(job))
        say("the worker dispatched the Job and died: no heartbeat, no final report")
        claim = reservoir.wait(claim, phase="Consumed", within=120)
        result = reservoir.result("summarize-7")
        say(
            f"its lease lapsed (Detached), the operator asked the Job and settled "
            f"{result.phase.value} ({result.reason}): C {render(result.consumed)}, "
            f"R - C {render(result.released)}, result {result.result}"
        )
        for move in reservoir.history("summarize-7"):
            moved = f"{move.from_phase.value} -> {move.to.value}"
            say(f"  {moved}: {move.reason} ({move.trigger.value})")


if __name__ == "__main__":
    main()
