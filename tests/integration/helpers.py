"""Small helpers for the operator's integration tests."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import time
import urllib.request
from collections.abc import Callable, Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any, TypeVar

from lightkube import AsyncClient, KubeConfig
from prometheus_client.parser import text_string_to_metric_families

from reservoir.core.claimstatus import settled_record
from reservoir.core.inflight import newest
from reservoir.core.model import LedgerEntry
from reservoir.sdk import ClaimView, EnvelopeView, LeaseUncertainError, Reservoir, StaleClaimError
from reservoir.sdk.patches import lease_fence
from tests.clusters import ClusterHandle

T = TypeVar("T")
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
REPO = Path(__file__).resolve().parents[2]


def eventually(what: str, check: Callable[[], T], timeout: float = 30, every: float = 0.2) -> T:
    """Poll until `check()` is truthy (the API is eventually consistent); fail with `what`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def create_envelope(
    cluster: ClusterHandle, ns: str, name: str, capacity: dict[str, str], **policy: Any
) -> None:
    body = {
        "apiVersion": "reservoir.dev/v1alpha1",
        "kind": "ReservationEnvelope",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"capacity": capacity, "policy": policy},
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))


def make_claim(cluster: ClusterHandle, ns: str, name: str, **spec: Any) -> None:
    """A claim on envelope `wf` asking for 20 tokens, with `spec` laid over that."""
    body = {
        "apiVersion": "reservoir.dev/v1alpha1",
        "kind": "BranchClaim",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"envelope": "wf", "requests": {"tokens": "20"}, **spec},
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))


def with_client(cluster: ClusterHandle, scenario: Callable[[AsyncClient], Any]) -> Any:
    """Run the coroutine `scenario(client)` with an async client of the cluster."""

    async def run() -> Any:
        client = AsyncClient(config=KubeConfig.from_file(str(cluster.kubeconfig_path)))
        try:
            return await scenario(client)
        finally:
            await client.close()

    return asyncio.run(run())


def totals(sdk: Reservoir, envelope: str) -> dict[str, str]:
    """{'committed': '37', ...} for the envelope's single resource `tokens`."""
    t = sdk.ledger(envelope).status.totals
    return {
        part: str(getattr(t, part).get("tokens", Decimal(0)))
        for part in ("capacity", "committed", "reserved", "reconciling", "available")
    }


def settled_ledger(sdk: Reservoir, envelope: str, **expected: str) -> EnvelopeView:
    eventually(
        f"ledger of {envelope} to reach {expected}",
        lambda: (
            all(totals(sdk, envelope)[k] == v for k, v in expected.items())
            and totals(sdk, envelope)
        ),
    )
    return sdk.ledger(envelope)


def phase_of(sdk: Reservoir, claim: ClaimView | str) -> str:
    return sdk.get(claim).phase.value


def wait_phase(sdk: Reservoir, claim: ClaimView | str, phase: str, within: float = 30) -> ClaimView:
    return sdk.wait(claim, phase=phase, within=within)


def events_of(cluster: ClusterHandle, ns: str, name: str) -> list[str]:
    return [reason for reason, _ in events_with_messages(cluster, ns, name)]


def events_with_messages(cluster: ClusterHandle, ns: str, name: str) -> list[tuple[str, str]]:
    """The Events about an object: (reason, message) each."""
    listing = json.loads(
        cluster.kubectl(
            "get",
            "events",
            "-n",
            ns,
            "--field-selector",
            f"involvedObject.name={name}",
            "-o",
            "json",
        )
    )
    return [(e["reason"], e.get("message", "")) for e in listing["items"]]


def committed_claim(
    cluster: ClusterHandle, ns: str, sdk: Reservoir, name: str = "x", tokens: str = "30"
) -> ClaimView:
    """An envelope `wf` of 100 tokens (2-minute leases) and one dispatched claim on it,
    once the operator has committed it."""
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=120)
    claim = sdk.hold("wf", name, {"tokens": tokens}, name=name, dispatch=True)
    return wait_phase(sdk, claim, "Committed")


def plugin(cluster: ClusterHandle, ns: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`kubectl reservoir -n NS ARGS...`, found on PATH as a user would have it."""
    env = {
        **os.environ,
        "KUBECONFIG": str(cluster.kubeconfig_path),
        "PATH": f"{REPO / '.venv' / 'bin'}:{Path.home() / '.cache/reservoir/bin/current'}:"
        + os.environ.get("PATH", ""),
    }
    return subprocess.run(
        ["kubectl", "reservoir", "-n", ns, *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def ledger_line(sdk: Reservoir, claim: ClaimView | str) -> LedgerEntry | None:
    """The claim's ledger line as it is now: the envelope's copy while a move of it is in
    flight, else the one the claim carries (`status.ledger`); None if not admitted."""
    view = sdk.get(claim)
    entry = sdk.ledger(view.spec.envelope).status.entries.get(view.uid)
    return newest(entry, view.entry)


def in_flight(sdk: Reservoir, claim: ClaimView | str) -> bool:
    """Whether the claim's envelope holds a move of its line not yet shown by the claim."""
    view = sdk.get(claim)
    return view.uid in sdk.ledger(view.spec.envelope).status.entries


def records(sdk: Reservoir, envelope: str) -> dict[str, LedgerEntry]:
    """Each claim's record by name: its ledger entry, or, once the ledger compacted a
    settled entry away, the record its own status carries."""
    found: dict[str, LedgerEntry] = {}
    for view in sdk.claims(envelope):
        record = view.entry or view.status.ledger
        record = record or settled_record(view.status, view.uid, view.name, view.spec.attempt)
        if record is not None:
            found[view.name] = record
    return found


# A churn's operators post an Event for every settlement (the default posts none for a
# claim's ordinary end), so that "no settlement announced twice" is checked on each.
EVERY_SETTLEMENT = "--transition-events=settlements"
# How a churn's claims may settle (test_crash_churn, test_nested_budgets).
SETTLE_REASONS = {
    "Completed", "SettledAfterDetach", "Cancelled", "Deleted", "LeaseExpired",
    "FinishedBeforeCommit", "AmbiguityDeadlineRelease", "AmbiguityDeadlineQuarantine",
    "CancelledWhilePending", "DeletedWhilePending", "ForceSettled",
}  # fmt: skip


def run_branch(
    sdk: Reservoir,
    envelope: str,
    name: str,
    index: int,
    rng: random.Random,
    declared: dict[str, str],
    within: float = 120,
    tolerated: tuple[type[Exception], ...] = (StaleClaimError, LeaseUncertainError),
) -> None:
    """One branch of a churn, chosen at random: pruned, completed, lazily dispatched,
    abandoned before dispatch, or disconnected after it. `declared`: the final usage of
    each branch that reported one. An operator down too long for a branch (a refusal in
    `tolerated`, or a timeout) leaves it to its lease."""
    reserved = rng.randint(1, 100)
    kind = rng.choice(["prune", "complete", "lazy", "abandon", "disconnect"])
    try:
        claim = sdk.hold(
            envelope, f"b{index}", {"tokens": str(reserved)}, name=name,
            dispatch=kind in ("lazy", "disconnect"),
        )  # fmt: skip
        if kind == "abandon":
            return
        if kind == "prune":
            sdk.cancel(sdk.wait(claim, phase="Tentative", within=within))
            return
        claim = sdk.wait(claim, condition="Reserved", within=within)
        if kind == "complete":
            claim = sdk.dispatch(claim)
            claim = sdk.report_usage(claim, {"tokens": str(rng.randint(0, reserved))})
        if kind == "disconnect":
            return
        final = rng.randint(int(claim.spec.usage.get("tokens", 0)), reserved)
        declared[name] = str(final)
        sdk.finish(sdk.get(claim), {"tokens": str(final)})
    except (*tolerated, TimeoutError):
        pass


def scrape(port: int) -> str:
    """The operator's /metrics exposition, as text."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def samples(text: str) -> Samples:
    """Every sample of an exposition, by name and labels (in any order)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(found: Samples, name: str, **labels: str) -> float | None:
    return found.get((name, tuple(sorted(labels.items()))))


def metric(port: int, name: str, **labels: str) -> float:
    """One sample's value on the operator's /metrics, 0 if it has none."""
    return value(samples(scrape(port)), name, **labels) or 0.0


def under_lease(claim: Mapping[str, Any], spec: Mapping[str, Any]) -> dict[str, Any]:
    """`spec` (a merge patch of a claim's spec) written under the claim's current lease, as
    the API server requires of a dispatch or a report (reservoir.lease_fence_rules):
    `spec.lease.fence` is the lease `claim` (the object as read) shows."""
    return {**spec, "lease": {**dict(spec.get("lease") or {}), "fence": lease_fence(claim)}}
