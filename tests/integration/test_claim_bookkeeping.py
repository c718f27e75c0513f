"""What the operator writes on a claim besides its status, with the real operator: a claim
made with kubectl is adopted (envelope owner, claim finalizer) once; a deleted claim goes
as soon as its settlement is recorded, also when its envelope does not exist; and a
claim's ordinary life posts no Event unless asked (`--transition-events`), while what a
person should hear of (here, a refusal) always does."""

from __future__ import annotations

import json

import pytest

from reservoir.k8s.resources import CLAIM_FINALIZER
from reservoir.sdk import Reservoir
from tests.clusters import ClusterHandle
from tests.integration.conftest import StartOperator
from tests.integration.helpers import create_envelope, events_of, eventually, wait_phase


def apply_claim(
    cluster: ClusterHandle, ns: str, name: str, envelope: str = "wf", tokens: str = "10"
) -> None:
    body = {
        "apiVersion": "reservoir.dev/v1alpha1",
        "kind": "BranchClaim",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"envelope": envelope, "requests": {"tokens": tokens}, "dispatch": True},
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))


def metadata(cluster: ClusterHandle, ns: str, name: str) -> dict[str, object]:
    found = json.loads(
        cluster.kubectl("get", "bclaim", name, "-n", ns, "-o", "json", "--ignore-not-found") or "{}"
    )
    return dict(found.get("metadata") or {})


def settle_one(sdk: Reservoir, name: str) -> None:
    """A claim on envelope wf through its happy path: reserved, committed, consumed."""
    claim = sdk.hold("wf", name, {"tokens": "10"}, name=name, dispatch=True)
    wait_phase(sdk, sdk.finish(wait_phase(sdk, claim, "Committed"), {"tokens": "3"}), "Consumed")


def test_a_kubectl_claim_is_adopted_and_released_once_settled(
    cluster: ClusterHandle, ns: str, start_operator: StartOperator, sdk: Reservoir
) -> None:
    start_operator()
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=120)
    apply_claim(cluster, ns, "k")
    meta = eventually(
        "the claim adopted",
        lambda: (m := metadata(cluster, ns, "k")).get("ownerReferences") and m,
    )
    assert CLAIM_FINALIZER in meta.get("finalizers", [])  # type: ignore[operator]
    owners = meta["ownerReferences"]
    assert [(o["kind"], o["name"]) for o in owners] == [("ReservationEnvelope", "wf")]  # type: ignore[attr-defined]
    claim = wait_phase(sdk, "k", "Committed")
    cluster.kubectl("delete", "bclaim", "k", "-n", ns, "--wait=false")
    # Dispatched, not settled: the deletion waits for the final report.
    eventually("the wait announced", lambda: "AwaitingSettlement" in events_of(cluster, ns, "k"))
    assert metadata(cluster, ns, "k"), "held while its settlement is open"
    sdk.finish(sdk.get(claim), {"tokens": "4"})
    eventually("the claim released", lambda: not metadata(cluster, ns, "k"))


def test_a_deleted_claim_of_a_missing_envelope_is_released(
    cluster: ClusterHandle, ns: str, start_operator: StartOperator
) -> None:
    start_operator()
    apply_claim(cluster, ns, "orphan", envelope="nowhere")
    eventually(
        "the claim guarded",
        lambda: CLAIM_FINALIZER in (metadata(cluster, ns, "orphan").get("finalizers") or []),  # type: ignore[operator]
    )
    cluster.kubectl("delete", "bclaim", "orphan", "-n", ns, "--wait=false")
    eventually("the claim gone", lambda: not metadata(cluster, ns, "orphan"))


def test_an_ordinary_life_posts_no_event_and_a_refusal_does(
    cluster: ClusterHandle, ns: str, start_operator: StartOperator, sdk: Reservoir
) -> None:
    start_operator()
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=120)
    settle_one(sdk, "q")
    # Asked for more than the envelope's whole capacity: refused, which a person hears of.
    # Posted after q's settlement was recorded, by the same poster: once it is there, an
    # Event for q would be too.
    apply_claim(cluster, ns, "big", tokens="1000")
    wait_phase(sdk, "big", "Rejected")
    eventually("the refusal's Event", lambda: events_of(cluster, ns, "big"))
    assert events_of(cluster, ns, "q") == []
    moves = [t.reason for t in sdk.history("q")]
    assert moves[0] == "Reserved" and moves[-1] == "Completed", "recorded all the same"


@pytest.mark.parametrize(
    ("level", "posted", "not_posted"),
    [
        ("settlements", {"Completed"}, {"Reserved"}),
        ("all", {"Reserved", "CommitPointReached", "Completed"}, set()),
    ],
)
def test_more_moves_post_events_when_asked(
    cluster: ClusterHandle,
    ns: str,
    start_operator: StartOperator,
    sdk: Reservoir,
    level: str,
    posted: set[str],
    not_posted: set[str],
) -> None:
    start_operator(f"--transition-events={level}")
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=120)
    settle_one(sdk, "q")
    reasons = eventually(
        "the Events asked for", lambda: posted <= set(r := events_of(cluster, ns, "q")) and r
    )
    assert not not_posted & set(reasons), reasons
