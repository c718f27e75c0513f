"""What the SDK's verbs send to the real API server (issue 23): nothing but the claim is
read, a caller's fresh view costs one PATCH and no read, and a stale view's patch is
refused by the API server through its `test` operations on `/status/...`, which the API
server checks against the stored status in a patch to the main resource."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from lightkube import ApiError
from lightkube.types import PatchType

from reservoir.k8s.resources import BranchClaim
from reservoir.sdk import Reservoir, StaleClaimError
from reservoir.sdk.client import fenced_patch
from reservoir.sdk.patches import DISPATCH_RELIES_ON, UNSETTLED
from tests.clusters import ClusterHandle
from tests.integration.conftest import StartOperator
from tests.integration.helpers import create_envelope, eventually, wait_phase

CLAIM = "branchclaims"
ENVELOPE = "reservationenvelopes"
KEEP = "test.reservoir.dev/keep"


class Requests:
    """Every request the SDK's client sends, as (method, kind): its send wrapped. A read
    of one object is a LIST selecting it by name (reservoir.k8s.resources.get_object), so
    a read shows as ("GET", kind) whatever its form."""

    def __init__(self, sdk: Reservoir) -> None:
        self.seen: list[tuple[str, str]] = []
        generic = sdk._async.client._client  # lightkube's GenericAsyncClient
        send = generic.send

        async def counted(request: Any, stream: bool = False) -> Any:
            self.seen.append((str(request.method), kind_of(str(request.url.path))))
            return await send(request, stream=stream)

        generic.send = counted  # type: ignore[method-assign]

    def take(self) -> list[tuple[str, str]]:
        seen, self.seen = self.seen, []
        return seen


def kind_of(path: str) -> str:
    """The resource a request is about: "branchclaims", "reservationenvelopes", "leases"."""
    parts = path.strip("/").split("/")
    at = parts.index("namespaces") + 2 if "namespaces" in parts else len(parts) - 1
    return parts[at] if at < len(parts) else path


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
    assert requests.take() == [("GET", ENVELOPE), ("POST", CLAIM)], (
        "hold reads the envelope once, for its owner reference"
    )
    write_status(cluster, ns, "x", tentative(ns, datetime.now(UTC) + timedelta(minutes=5)))
    view = sdk.get("x")
    assert requests.take() == [("GET", CLAIM)]

    dispatched = sdk.dispatch(view)
    assert dispatched.spec.dispatch
    reported = sdk.report_usage(dispatched, {"tokens": "5"})
    assert requests.take() == [("PATCH", CLAIM)] * 2, "one patch each, nothing read"

    # renew: the claim read once, then its Lease (created); never the envelope.
    sdk.renew(reported, confirm_timeout=None)
    seen = requests.take()
    assert seen[0] == ("GET", CLAIM) and seen[1:], seen
    assert {kind for _, kind in seen[1:]} == {"leases"}, seen

    cancelled = sdk.cancel(reported)
    assert cancelled.spec.cancel and cancelled.spec.usage == {"tokens": 5}
    assert requests.take() == [("PATCH", CLAIM)]

    # A view older than the claim (from hold: no status yet): one refused patch, one read.
    finished = sdk.finish(claim, {"tokens": "7"})
    assert finished.spec.final and finished.spec.usage == {"tokens": 7}
    assert requests.take() == [("PATCH", CLAIM), ("GET", CLAIM), ("PATCH", CLAIM)]

    # What the user asked of the envelope still reads it.
    sdk.claims("wf")
    assert ("GET", ENVELOPE) in requests.take()


def test_a_hold_on_an_envelope_view_reads_nothing_and_is_owned_by_that_envelope(
    cluster: ClusterHandle, ns: str, sdk: Reservoir, requests: Requests
) -> None:
    """An orchestrator holding many branches reads its envelope once: each hold on the view
    is one POST, owned by the envelope the view shows. A view of an envelope deleted since
    owns its claims by the old UID, so the garbage collector deletes them (no operator
    runs here: the claim stays, being deleted, behind its finalizer)."""
    create_envelope(cluster, ns, "wf", {"tokens": "100"})
    view = sdk.ledger("wf")
    requests.take()
    claims = [sdk.hold(view, f"b{n}", {"tokens": "10"}, name=f"b{n}") for n in range(3)]
    assert requests.take() == [("POST", CLAIM)] * 3
    for claim in claims:
        owners = json.loads(
            cluster.kubectl(
                "get", "bclaim", claim.name, "-n", ns, "-o", "jsonpath={.metadata.ownerReferences}"
            )
        )
        assert [(o["kind"], o["name"], o["uid"]) for o in owners] == [
            ("ReservationEnvelope", "wf", view.uid)
        ]

    elsewhere = dataclasses.replace(view, namespace="another")
    with pytest.raises(ValueError, match="not in this client's namespace"):
        sdk.hold(elsewhere, "c", {"tokens": "10"}, name="c")
    assert requests.take() == [], "refused before any request"

    cluster.kubectl("delete", "renv", "wf", "-n", ns, "--wait=true")
    create_envelope(cluster, ns, "wf", {"tokens": "100"})
    orphan = sdk.hold(view, "late", {"tokens": "10"}, name="late")

    def collected() -> bool:
        stamp = cluster.kubectl(
            "get", "bclaim", orphan.name, "-n", ns, "-o", "jsonpath={.metadata.deletionTimestamp}"
        )
        return bool(stamp.strip())

    eventually("the claim owned by the deleted envelope is garbage-collected", collected, 60)


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
    async def send(relies_on: tuple[str, ...], spec: dict[str, bool] | None = None) -> int:
        client = sdk._async.client
        try:
            await client.patch(
                BranchClaim,
                "x",
                fenced_patch(stale, spec or {"dispatch": True}, relies_on),
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
    assert requests.take() == [("PATCH", CLAIM), ("GET", CLAIM)] * 2
    current = sdk.get("x")
    assert not current.spec.dispatch and not current.spec.usage

    # A test that holds on the stored status lets the spec write through: the whole patch
    # was applied to the whole object, and only the spec kept. (A dispatch of the settled
    # claim is the API server's to refuse now: a cancel is written by anyone, any time.)
    assert loop.run_until_complete(send((), {"dispatch": True})) == 422
    assert loop.run_until_complete(send((), {"cancel": True})) == 200
    assert sdk.get("x").spec.cancel and sdk.get("x").phase == "Released"


def keep_deleting(cluster: ClusterHandle, ns: str, envelope: str) -> None:
    """Delete the envelope, held back by a test finalizer: it stays deleting."""
    found = cluster.kubectl("get", "reservationenvelope", envelope, "-n", ns, "-o", "json")
    kept = [*json.loads(found)["metadata"].get("finalizers", []), KEEP]
    patch = json.dumps({"metadata": {"finalizers": kept}})  # the operator's stay
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
