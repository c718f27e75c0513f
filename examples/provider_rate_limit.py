"""A provider's rate limit as a Replenishing budget: 3 requests per 20-second window
(branch-claims.txt: "Rate-limit capacity depends on the provider's window").

Three calls use the window's 3 requests; a fourth waits, refused past the limit, and is
admitted again once the first calls' window has passed: what a call consumed comes back
one window after its settlement (a sliding window, README "Resource contracts"), not
never, as a Consumable budget would, and not early, as a fixed window would.

    python examples/provider_rate_limit.py --namespace reservoir-demo
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from typing import Any

from reservoir.core.ledger import render
from reservoir.sdk import ClaimView, Reservoir

ENVELOPE = "provider-calls"
LIMIT = 3
WINDOW_SECONDS = 20
CALL = {"requests": "1"}


def say(message: str) -> None:
    print(f"-- {message}", flush=True)


def call(reservoir: Reservoir, claim: ClaimView, within: float = 60) -> ClaimView:
    """Dispatch a held call, let it use its one request, and wait for its settlement."""
    claim = reservoir.dispatch(reservoir.wait(claim, phase="Tentative", within=within))
    claim = reservoir.wait(claim, phase="Committed")
    reservoir.finish(reservoir.get(claim), CALL)
    return reservoir.wait(claim, phase="Consumed")


def queue_reason(reservoir: Reservoir, claim: ClaimView, within: float = 30) -> str:
    """Why the claim waits, once the operator has said so."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        reason = reservoir.get(claim).status.queue_reason
        if reason:
            return reason
        time.sleep(0.2)
    return "no reason recorded yet"


def envelope(namespace: str) -> dict[str, Any]:
    """The provider's limit: requests are Replenishing, returning a window after use."""
    return {
        "apiVersion": "reservoir.dev/v1alpha1",
        "kind": "ReservationEnvelope",
        "metadata": {"name": ENVELOPE, "namespace": namespace},
        "spec": {
            "capacity": {"requests": str(LIMIT)},
            "contracts": {"requests": {"type": "Replenishing", "windowSeconds": WINDOW_SECONDS}},
            "policy": {"defaultLeaseSeconds": 300},
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
        stdout=subprocess.DEVNULL,
    )
    with Reservoir(namespace=args.namespace) as reservoir:
        say(f"the provider allows {LIMIT} requests per {WINDOW_SECONDS} s: three calls use them")
        first_settled = 0.0
        for number in range(1, LIMIT + 1):
            claim = reservoir.hold(ENVELOPE, f"call-{number}", CALL, name=f"call-{number}")
            call(reservoir, claim)
            first_settled = first_settled or time.monotonic()
        totals = reservoir.ledger(ENVELOPE).status.totals
        say(
            f"committed {render(totals.committed)} in the window, "
            f"available {render(totals.available)}"
        )

        fourth = reservoir.hold(ENVELOPE, "call-4", CALL, name="call-4")
        say(f"call-4 is past the limit: Pending ({queue_reason(reservoir, fourth)})")
        fourth = reservoir.wait(fourth, phase="Tentative", within=3 * WINDOW_SECONDS)
        waited = time.monotonic() - first_settled
        say(
            f"call-4 admitted {waited:.0f} s after call-1 settled: its request came back "
            f"when the {WINDOW_SECONDS} s window passed"
        )
        call(reservoir, fourth)
        totals = reservoir.ledger(ENVELOPE).status.totals
        say(
            f"call-4 settled: committed {render(totals.committed)} in the window, "
            f"available {render(totals.available)}"
        )


if __name__ == "__main__":
    main()
