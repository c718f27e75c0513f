"""What the operator writes on a claim besides its status, with the real operator: a claim
made with kubectl is adopted (envelope owner, claim finalizer) once; a deleted claim goes
as soon as its settlement is recorded, also when its envelope does not exist; and a
claim's ordinary life posts no Event unless asked (`--transition-events`), while what a
person should hear of (here, a refusal) always does."""

from __future__ import annotations

import json

import pytest

from reservoir.handlers.claims import adoption_view, envelope_not_found, waits_without_reason
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


def apply_waiting_claims(cluster: ClusterHandle, ns: str, names: list[str]) -> None:
    """Claims made with kubectl, not dispatched (a closed envelope releases them)."""
    items = [
        {
            "apiVersion": "reservoir.dev/v1alpha1",
            "kind": "BranchClaim",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"envelope": "wf", "requests": {"tokens": "1"}},
        }
        for name in names
    ]
    document = json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
    cluster.kubectl("apply", "-f", "-", input=document)


def test_an_envelope_deleted_at_once_takes_every_kubectl_claim_with_it(
    cluster: ClusterHandle, ns: str, start_operator: StartOperator
) -> None:
    """Claims made with kubectl are adopted (owned by their envelope) off the watch, which
    may lag behind a quick deletion of the envelope: the deletion makes each its own
    before the envelope goes, so the garbage collector takes every one with it (found
    by the 2,000-claim test: 1,461 settled claims stayed for good)."""
    operator = start_operator()
    create_envelope(cluster, ns, "wf", {"tokens": "1000"}, defaultLeaseSeconds=120)
    eventually(
        "the envelope guarded",
        lambda: json.loads(cluster.kubectl("get", "renv", "wf", "-n", ns, "-o", "json"))[
            "metadata"
        ].get("finalizers"),
    )
    operator.stop()
    apply_waiting_claims(cluster, ns, [f"quick-{i:03d}" for i in range(200)])
    cluster.kubectl("delete", "renv", "wf", "-n", ns, "--wait=false")
    start_operator()
    eventually(
        "every claim gone with its envelope",
        lambda: not cluster.kubectl("get", "bclaim", "-n", ns, "-o", "name").strip(),
        timeout=240,
        every=3,
    )


def test_a_late_envelope_not_found_never_sets_a_settled_claim_back(
    cluster: ClusterHandle, ns: str
) -> None:
    """The reason an adoption writes on a claim whose envelope is missing applies only to
    the version it read: a claim settled meanwhile keeps its settled status (the API
    server's own JSON patch refuses the write)."""
    apply_claim(cluster, ns, "late", envelope="nowhere")
    read = json.loads(cluster.kubectl("get", "bclaim", "late", "-n", ns, "-o", "json"))
    view = adoption_view(read)
    assert waits_without_reason(view)
    settled = {"status": {"phase": "Released"}}
    cluster.kubectl(
        "patch", "bclaim", "late", "-n", ns, "--subresource=status", "--type=merge",
        "-p", json.dumps(settled),
    )  # fmt: skip
    late = envelope_not_found(view, read["metadata"]["resourceVersion"], "nowhere")
    with pytest.raises(RuntimeError, match=r"(?i)test"):
        cluster.kubectl(
            "patch", "bclaim", "late", "-n", ns, "--subresource=status", "--type=json",
            "-p", json.dumps(late),
        )  # fmt: skip
    now = json.loads(cluster.kubectl("get", "bclaim", "late", "-n", ns, "-o", "json"))
    assert now["status"]["phase"] == "Released" and "queueReason" not in now["status"]
    # At the version read, on a claim still waiting, it is written.
    apply_claim(cluster, ns, "waits", envelope="nowhere")
    read = json.loads(cluster.kubectl("get", "bclaim", "waits", "-n", ns, "-o", "json"))
    patch = envelope_not_found(adoption_view(read), read["metadata"]["resourceVersion"], "nowhere")
    cluster.kubectl(
        "patch", "bclaim", "waits", "-n", ns, "--subresource=status", "--type=json",
        "-p", json.dumps(patch),
    )  # fmt: skip
    now = json.loads(cluster.kubectl("get", "bclaim", "waits", "-n", ns, "-o", "json"))
    assert now["status"]["queueReason"].startswith("EnvelopeNotFound")
    assert now["status"].get("phase", "Pending") == "Pending"
