"""What the SDK's verbs send to the real API server (issue 23): nothing but the claim is
read, a caller's fresh view costs one PATCH and no read, and a stale view's patch is
refused by the API server through its `test` operations on `/status/...`, which the API
server checks against the stored status in a patch to the main resource."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from lightkube import ApiError
from lightkube.types import PatchType

from reservoir.k8s.resources import BranchClaim
from reservoir.sdk import Reservoir, StaleClaimError
from reservoir.sdk.client import fenced_patch
from reservoir.sdk.patches import DISPATCH_RELIES_ON, UNSETTLED
from tests.clusters import ClusterHandle
from tests.integration.conftest import StartOperator
from tests.integration.helpers import create_envelope, wait_phase

CLAIMS = "/branchclaims"
ENVELOPES = "/reservationenvelopes"
KEEP = "test.reservoir.dev/keep"


class Requests:
    """Every request the SDK's HTTP client sends, as (method, path): a transport hook."""

    def __init__(self, sdk: Reservoir) -> None:
        self.seen: list[tuple[str, str]] = []

        async def hook(request: httpx.Request) -> None:
            self.seen.append((request.method, request.url.path))

        http: httpx.AsyncClient = sdk._async.client._client._client  # type: ignore[attr-defined]
        http.event_hooks["request"].append(hook)

    def take(self) -> list[tuple[str, str]]:
        seen, self.seen = self.seen, []
        return seen


@pytest.fixture
def requests(sdk: Reservoir) -> Requests:
    return Requests(sdk)


def stamp(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def write_status(cluster: ClusterHandle, ns: str, name: str, status: dict[str, Any]) -> None:
    """The claim's status written by hand (no operator runs), through its subresource."""
    cluster.kubectl(
        "patch",
        "bclaim",
        name,
        "-n",
        ns,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status}),
    )


def tentative(ns: str, expires: datetime) -> dict[str, Any]:
    return {"phase": "Tentative", "lease": {"expiresAt": stamp(expires), "renewals": 0}}


def released(uid: str) -> dict[str, Any]:
    return {
        "phase": "Released",
        "settlement": {
            "key": f"{uid}/1/1",
            "phase": "Released",
            "reason": "LeaseExpired",
            "at": stamp(datetime.now(UTC)),
        },
    }


def test_a_verb_reads_no_envelope_and_a_fresh_view_costs_one_patch(
    cluster: ClusterHandle, ns: str, sdk: Reservoir, requests: Requests
) -> None:
    """No operator: the claim's record is written by hand, so nothing moves it but us."""
    create_envelope(cluster, ns, "wf", {"tokens": "100"})
    claim = sdk.hold("wf", "x", {"tokens": "30"}, name="x")
    assert ("GET", f"/apis/reservoir.dev/v1alpha1/namespaces/{ns}{ENVELOPES}/wf") in (
        requests.take()
    ), "hold reads the envelope once, for its owner reference"
    write_status(cluster, ns, "x", tentative(ns, datetime.now(UTC) + timedelta(minutes=5)))
    view = sdk.get("x")
    assert requests.take() == [("GET", f"/apis/reservoir.dev/v1alpha1/namespaces/{ns}{CLAIMS}/x")]

    dispatched = sdk.dispatch(view)
    assert dispatched.spec.dispatch
    reported = sdk.report_usage(dispatched, {"tokens": "5"})
    cancelled = sdk.cancel(reported)
    assert cancelled.spec.cancel and cancelled.spec.usage == {"tokens": 5}
    claim_path = f"/apis/reservoir.dev/v1alpha1/namespaces/{ns}{CLAIMS}/x"
    assert requests.take() == [("PATCH", claim_path)] * 3, "one patch each, nothing read"

    # A view older than the claim (from hold: no status yet): one refused patch, one read.
    finished = sdk.finish(claim, {"tokens": "7"})
    assert finished.spec.final
    assert requests.take() == [("PATCH", claim_path), ("GET", claim_path), ("PATCH", claim_path)]

    # renew: the claim read once, then its Lease; never the envelope.
    sdk.renew(finished, confirm_timeout=None)
    seen = requests.take()
    assert seen[0] == ("GET", claim_path)
    assert all("/leases/" in path for _, path in seen[1:]), seen
    assert not any(ENVELOPES in path for _, path in seen)


def test_a_stale_view_is_refused_by_the_patchs_test_of_the_status(
    cluster: ClusterHandle, ns: str, sdk: Reservoir, requests: Requests
) -> None:
    create_envelope(cluster, ns, "wf", {"tokens": "100"})
    sdk.hold("wf", "x", {"tokens": "30"}, name="x")
    write_status(cluster, ns, "x", tentative(ns, datetime.now(UTC) + timedelta(minutes=5)))
    stale = sdk.get("x")
    write_status(cluster, ns, "x", released(stale.uid))  # settles behind the view's back
    assert stale.generation == sdk.get("x").generation, "a status write moves no generation"
    requests.take()

    # The API server itself refuses the stale view's patch: its tests of /status/phase and
    # /status/settlement fail against the stored status, though it writes only the spec.
    async def send(relies_on: tuple[str, ...]) -> int:
        client = sdk._async.client
        try:
            await client.patch(
                BranchClaim,
                "x",
                fenced_patch(stale, {"dispatch": True}, relies_on),
                namespace=ns,
                patch_type=PatchType.JSON,
            )
        except ApiError as error:
            return error.status.code or 0
        return 200

    loop = sdk._loop
    assert loop.run_until_complete(send(DISPATCH_RELIES_ON)) == 422
    assert loop.run_until_complete(send(UNSETTLED)) == 422
    assert not sdk.get("x").spec.dispatch, "nothing was written"

    # Through the SDK: the refusal is read again and said as before.
    requests.take()
    with pytest.raises(StaleClaimError, match="already settled as Released"):
        sdk.dispatch(stale)
    with pytest.raises(StaleClaimError, match="already settled as Released"):
        sdk.report_usage(stale, {"tokens": "1"})
    claim_path = f"/apis/reservoir.dev/v1alpha1/namespaces/{ns}{CLAIMS}/x"
    assert requests.take() == [("PATCH", claim_path), ("GET", claim_path)] * 2
    current = sdk.get("x")
    assert not current.spec.dispatch and not current.spec.usage

    # A test that holds on the stored status lets the spec write through: the whole patch
    # was applied to the whole object, and only the spec kept.
    assert loop.run_until_complete(send(())) == 200
    assert sdk.get("x").spec.dispatch and sdk.get("x").phase == "Released"


def keep_deleting(cluster: ClusterHandle, ns: str, envelope: str) -> None:
    """Delete the envelope, held back by a test finalizer: it stays deleting."""
    patch = json.dumps({"metadata": {"finalizers": [KEEP]}})
    cluster.kubectl("patch", "reservationenvelope", envelope, "-n", ns, "--type=merge", "-p", patch)
    cluster.kubectl("delete", "reservationenvelope", envelope, "-n", ns, "--wait=false")


def let_go(cluster: ClusterHandle, ns: str, envelope: str) -> None:
    found = cluster.kubectl(
        "get", "reservationenvelope", envelope, "-n", ns, "-o", "json", "--ignore-not-found"
    )
    if found.strip():
        kept = [f for f in json.loads(found)["metadata"].get("finalizers", []) if f != KEEP]
        patch = json.dumps([{"op": "replace", "path": "/metadata/finalizers", "value": kept}])
        cluster.kubectl(
            "patch", "reservationenvelope", envelope, "-n", ns, "--type=json", "-p", patch
        )


def test_a_dispatch_on_a_deleting_envelope_is_fenced_by_the_claims_own_record(
    cluster: ClusterHandle, ns: str, start_operator: StartOperator, sdk: Reservoir
) -> None:
    """The SDK no longer reads the envelope. The operator treats the claims of a deleting
    envelope as deleted: it releases a Tentative one, and a dispatch from a view taken
    before is then refused by its test of the phase; a dispatch that landed before the
    operator's pass is a commit, and the envelope's deletion waits for its final report."""
    create_envelope(cluster, ns, "wf", {"tokens": "100"}, defaultLeaseSeconds=120)
    operator = start_operator()
    early = wait_phase(sdk, sdk.hold("wf", "early", {"tokens": "30"}, name="early"), "Tentative")
    late = wait_phase(sdk, sdk.hold("wf", "late", {"tokens": "30"}, name="late"), "Tentative")
    operator.stop()
    try:
        keep_deleting(cluster, ns, "wf")
        # The operator has not seen the deletion: the claim's record still says Tentative.
        assert sdk.dispatch(early).spec.dispatch
        start_operator()
        released = wait_phase(sdk, late, "Released")
        assert released.settlement is not None and released.settlement.reason == "Deleted"
        with pytest.raises(StaleClaimError, match="already settled as Released"):
            sdk.dispatch(late)  # its view is from before the release
        assert not sdk.get("late").spec.dispatch, "nothing was written"

        committed = wait_phase(sdk, "early", "Committed")
        assert committed.condition("CancelRequested"), "deletion waits for the final report"
        sdk.finish(committed, {"tokens": "12"})
        done = wait_phase(sdk, "early", "Consumed")
        assert done.status.consumed == {"tokens": 12}
        assert not sdk.get("late").condition("DispatchRefused")
    finally:
        let_go(cluster, ns, "wf")
