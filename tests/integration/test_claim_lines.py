"""Each claim (and each child envelope) holds its own ledger line (issue 23), on the real
control plane: one envelope with 2,000 live claims stays a few KB, and an envelope written
in the old shape (every live claim's entry in the envelope, or every child's line in its
parent, no stamps) is taken over by the new operator without moving any capacity."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any

from reservoir.core.claimstatus import expanded, settled_record, settled_view
from reservoir.core.inflight import IN_FLIGHT_LIMIT
from reservoir.core.model import BranchClaimStatus, ClaimPhase
from reservoir.sdk import Reservoir
from reservoir.sdk.patches import lease_fence
from tests.clusters import ClusterHandle
from tests.integration.conftest import OperatorProcess, StartOperator
from tests.integration.helpers import create_envelope, eventually, records

LIVE = 2000


def envelope_of(cluster: ClusterHandle, ns: str, name: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(cluster.kubectl("get", "renv", name, "-n", ns, "-o", "json"))
    body.setdefault("status", {})  # not written yet
    return body


def claim_of(cluster: ClusterHandle, ns: str, name: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(
        cluster.kubectl("get", "bclaim", name, "-n", ns, "-o", "json")
    )
    return body


def status_fields(cluster: ClusterHandle, ns: str, kind: str, name: str) -> list[Any]:
    """The fields of the status each manager's status writes own, by managedFields."""
    shown = cluster.kubectl("get", kind, name, "-n", ns, "-o", "json", "--show-managed-fields")
    return [
        entry["fieldsV1"]
        for entry in json.loads(shown)["metadata"].get("managedFields") or []
        if entry.get("subresource") == "status"
    ]


def totals_of(cluster: ClusterHandle, ns: str, name: str, part: str) -> str:
    totals = envelope_of(cluster, ns, name)["status"].get("totals") or {}
    return str((totals.get(part) or {}).get("tokens", "0"))


def apply_claims(cluster: ClusterHandle, ns: str, envelope: str, names: list[str]) -> None:
    """Create many claims with a few kubectl applies (a List of 200 at a time)."""

    def apply(chunk: list[str]) -> None:
        items = [
            {
                "apiVersion": "reservoir.dev/v1alpha1",
                "kind": "BranchClaim",
                "metadata": {"name": name, "namespace": ns},
                "spec": {"envelope": envelope, "requests": {"tokens": "1"}},
            }
            for name in chunk
        ]
        document = json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
        cluster.kubectl("apply", "-f", "-", input=document)

    chunks = [names[i : i + 200] for i in range(0, len(names), 200)]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(apply, chunks))


def test_two_thousand_live_claims_in_one_envelope_keep_it_small(
    cluster: ClusterHandle, ns: str, operator: OperatorProcess, sdk: Reservoir
) -> None:
    create_envelope(
        cluster, ns, "wide", {"tokens": "100000"}, defaultLeaseSeconds=3600,
        maxClaimLifetimeSeconds=7200,
    )  # fmt: skip
    names = [f"branch-{i:05d}" for i in range(LIVE)]
    apply_claims(cluster, ns, "wide", names)
    most_in_flight = 0

    def all_admitted() -> bool:
        nonlocal most_in_flight
        status = envelope_of(cluster, ns, "wide").get("status") or {}
        most_in_flight = max(most_in_flight, len(status.get("entries") or {}))
        reserved = Decimal((status.get("totals") or {}).get("reserved", {}).get("tokens", "0"))
        return reserved == LIVE

    eventually("2,000 claims admitted", all_admitted, timeout=900, every=2)
    assert most_in_flight <= 2 * IN_FLIGHT_LIMIT, most_in_flight

    def settled_down() -> dict[str, Any]:
        status: dict[str, Any] = envelope_of(cluster, ns, "wide")["status"]
        return status if not status.get("entries") else {}

    status = eventually("every line to reach its claim", settled_down, timeout=300, every=2)
    assert status["claimRecords"]["count"] == LIVE
    size = len(json.dumps(status))
    assert size < 8192, f"the envelope's status holds totals, not 2,000 lines: {size} bytes"
    # The API server records the operator as the owner of each status as a whole (the
    # schema's status is atomic), not field by field: each line in flight cost the
    # envelope as many bytes again of managedFields, and every status write their upkeep.
    for kind, name in (("renv", "wide"), ("bclaim", "branch-00001")):
        assert status_fields(cluster, ns, kind, name) == [{"f:status": {}}], (kind, name)
    lines = records(sdk, "wide")
    assert len(lines) == LIVE
    assert all(line.phase is ClaimPhase.TENTATIVE for line in lines.values())
    assert sum(line.reserved["tokens"] for line in lines.values()) == LIVE

    # A move of one of them is one claim write; a settlement goes through the envelope.
    sdk.cancel(sdk.get("branch-00007"))
    eventually("the cancel to settle", lambda: sdk.get("branch-00007").phase == "Released")
    eventually(
        "its capacity back",
        lambda: (
            envelope_of(cluster, ns, "wide")["status"]["totals"]["reserved"]["tokens"]
            == str(LIVE - 1)
        ),
    )

    # And the envelope goes with its 1,999 live claims: each settles, each claim goes, then
    # the envelope (a cluster-wide operator of a later test would otherwise inherit them).
    cluster.kubectl("delete", "renv", "wide", "-n", ns, "--wait=false")
    eventually(
        "every claim settled and gone",
        lambda: not cluster.kubectl("get", "bclaim", "-n", ns, "-o", "name").strip(),
        timeout=600,
        every=5,
    )
    eventually(
        "the envelope gone",
        lambda: not cluster.kubectl("get", "renv", "-n", ns, "-o", "name").strip(),
        timeout=120,
    )


def test_an_envelope_in_the_old_shape_is_taken_over_without_moving_capacity(
    cluster: ClusterHandle, ns: str, start_operator: StartOperator, sdk: Reservoir
) -> None:
    """Written by an operator of before issue 23: every live claim's entry in the envelope,
    none stamped, no digest, and claims whose status carries no line."""
    create_envelope(cluster, ns, "old", {"tokens": "100"}, defaultLeaseSeconds=3600)
    apply_claims(cluster, ns, "old", ["a", "b", "c"])
    operator = start_operator()
    eventually(
        "admitted",
        lambda: totals_of(cluster, ns, "old", "reserved") == "3",
        timeout=60,
    )
    eventually(
        "lines on the claims",
        lambda: not envelope_of(cluster, ns, "old")["status"].get("entries"),
        timeout=60,
    )
    operator.stop()
    # Rewrite both sides in the old shape, as the old operator left them.
    envelope = envelope_of(cluster, ns, "old")
    status = envelope["status"]
    entries = {}
    for name in ("a", "b", "c"):
        claim = json.loads(cluster.kubectl("get", "bclaim", name, "-n", ns, "-o", "json"))
        line = dict(claim["status"]["ledger"])
        line.pop("stamp", None)
        entries[claim["metadata"]["uid"]] = line
        old_status = {k: v for k, v in claim["status"].items() if k != "ledger"}
        cluster.kubectl(
            "patch", "bclaim", name, "-n", ns, "--subresource=status", "--type=json",
            "-p", json.dumps([{"op": "replace", "path": "/status", "value": old_status}]),
        )  # fmt: skip
    old = {k: v for k, v in status.items() if k not in ("stamp", "claimRecords")}
    old["entries"] = entries
    cluster.kubectl(
        "patch", "renv", "old", "-n", ns, "--subresource=status", "--type=json",
        "-p", json.dumps([{"op": "replace", "path": "/status", "value": old}]),
    )  # fmt: skip
    before = envelope_of(cluster, ns, "old")["status"]
    assert len(before["entries"]) == 3 and "claimRecords" not in before

    start_operator()  # the new operator takes over
    eventually(
        "each claim to carry its line, and the envelope none",
        lambda: not envelope_of(cluster, ns, "old")["status"].get("entries"),
        timeout=60,
    )
    after = envelope_of(cluster, ns, "old")["status"]
    assert after["totals"] == before["totals"], "the upgrade moved no capacity"
    assert after["claimRecords"]["count"] == 3
    lines = records(sdk, "old")
    assert {n: line.phase for n, line in lines.items()} == dict.fromkeys(
        "abc", ClaimPhase.TENTATIVE
    )
    # And the ledger goes on from there: a claim settles once, exactly.
    sdk.finish(sdk.dispatch(sdk.get("a")), {"tokens": "1"})
    eventually("a to settle", lambda: sdk.get("a").phase == "Consumed")
    eventually(
        "its R − C back, its C committed",
        lambda: totals_of(cluster, ns, "old", "committed") == "1",
    )
    totals = envelope_of(cluster, ns, "old")["status"]["totals"]
    assert totals["reserved"]["tokens"] == "2" and totals["available"]["tokens"] == "97"


def test_a_parent_in_the_old_shape_is_taken_over_without_moving_capacity(
    cluster: ClusterHandle, ns: str, start_operator: StartOperator
) -> None:
    """Written by an operator of before child lines: every child's line in its parent's
    `status.children`, none stamped, no digest, children's records unstamped. The new
    operator retires each line its child recorded, moves nothing, and settles on from there."""
    create_envelope(cluster, ns, "top", {"tokens": "100"})
    operator = start_operator()
    eventually("top open", lambda: envelope_of(cluster, ns, "top")["status"].get("phase") == "Open")
    for name, tokens in (("k1", "10"), ("k2", "20")):
        body = {
            "apiVersion": "reservoir.dev/v1alpha1",
            "kind": "ReservationEnvelope",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"capacity": {"tokens": tokens}, "parent": "top"},
        }
        cluster.kubectl("create", "-f", "-", input=json.dumps(body))
    eventually(
        "both children held and recorded",
        lambda: (
            totals_of(cluster, ns, "top", "reserved") == "30"
            and not envelope_of(cluster, ns, "top")["status"].get("children")
        ),
        timeout=60,
    )
    operator.stop()
    # Rewrite both sides in the old shape, as the old operator left them.
    children = {}
    for name in ("k1", "k2"):
        child = envelope_of(cluster, ns, name)
        record = dict(child["status"]["parent"])
        record.pop("stamp", None)
        children[child["metadata"]["uid"]] = {
            "envelope": name,
            "phase": "Reserved",
            "reserved": record["reserved"],
            "reservedAt": record["admittedAt"],
        }
        cluster.kubectl(
            "patch", "renv", name, "-n", ns, "--subresource=status", "--type=json",
            "-p", json.dumps([{"op": "replace", "path": "/status/parent", "value": record}]),
        )  # fmt: skip
    status = envelope_of(cluster, ns, "top")["status"]
    old = {k: v for k, v in status.items() if k not in ("stamp", "childRecords")}
    old["children"] = children
    cluster.kubectl(
        "patch", "renv", "top", "-n", ns, "--subresource=status", "--type=json",
        "-p", json.dumps([{"op": "replace", "path": "/status", "value": old}]),
    )  # fmt: skip
    before = envelope_of(cluster, ns, "top")["status"]
    assert len(before["children"]) == 2 and "childRecords" not in before

    start_operator()  # the new operator takes over
    eventually(
        "each child to carry its line, and the parent none",
        lambda: (
            not envelope_of(cluster, ns, "top")["status"].get("children")
            and (envelope_of(cluster, ns, "top")["status"].get("childRecords") or {}).get("count")
            == 2
        ),
        timeout=60,
    )
    after = envelope_of(cluster, ns, "top")["status"]
    assert after["totals"] == before["totals"], "the upgrade moved no capacity"
    # And the ledger goes on from there: a child closes and its whole balance comes back.
    cluster.kubectl(
        "patch", "renv", "k1", "-n", ns, "--type=merge", "-p", '{"spec": {"state": "Closed"}}'
    )
    eventually("k1's R back in top", lambda: totals_of(cluster, ns, "top", "reserved") == "20")
    assert totals_of(cluster, ns, "top", "available") == "80"
    assert totals_of(cluster, ns, "top", "committed") == "0"
    record = envelope_of(cluster, ns, "k1")["status"]["parent"]
    eventually(
        "k1 to mirror its settled line",
        lambda: (
            (envelope_of(cluster, ns, "k1")["status"]["parent"].get("settled") or {}).get("phase")
            == "Settled"
        ),
    )
    assert record["uid"] == envelope_of(cluster, ns, "top")["metadata"]["uid"]


def test_a_claim_settled_before_its_line_was_written_once_keeps_its_record(
    cluster: ClusterHandle, ns: str, start_operator: StartOperator, sdk: Reservoir
) -> None:
    """A claim settled by an operator that copied every field of the line into the status
    beside `status.ledger`, or before `status.ledger` existed: its status fields are its
    only record (the ledger compacted its line away; its spec says what it reported). The
    new operator reads it as before, and once something about it moves, writes that record
    as its `status.ledger`, keeps its `status.settlement`, and moves no capacity."""
    create_envelope(cluster, ns, "old", {"tokens": "100"}, defaultLeaseSeconds=3600)
    apply_claims(cluster, ns, "old", ["s", "t"])
    operator = start_operator()
    eventually("admitted", lambda: totals_of(cluster, ns, "old", "reserved") == "2", timeout=60)
    sdk.finish(sdk.dispatch(sdk.get("s")), {"tokens": "1"}, outcome="Succeeded")
    sdk.cancel(sdk.get("t"))
    eventually(
        "both settled, their lines on the claims only",
        lambda: (
            totals_of(cluster, ns, "old", "reserved") == "0"
            and not envelope_of(cluster, ns, "old")["status"].get("entries")
            and sdk.get("t").settled
        ),
        timeout=60,
    )
    operator.stop()
    # "u": a third claim whose status is s's record in the old shape (the fields beside no
    # line; its settlement keyed to u), as a claim settled by the old operator carries it.
    apply_claims(cluster, ns, "old", ["u"])
    s = claim_of(cluster, ns, "s")
    facts = {"dispatch": True, "usage": {"tokens": "1"}, "final": True, "outcome": "Succeeded"}
    facts["lease"] = {"fence": {"generation": 0}}  # no lease yet: generation 0
    cluster.kubectl("patch", "bclaim", "u", "-n", ns, "--type=merge", "-p",
                    json.dumps({"spec": facts}))  # fmt: skip
    u = json.loads(cluster.kubectl("get", "bclaim", "u", "-n", ns, "-o", "json"))
    old_status = expanded(BranchClaimStatus.model_validate(s["status"])).to_api()
    old_status.pop("ledger")
    old_status["settlement"]["key"] = old_status["settlement"]["key"].replace(
        s["metadata"]["uid"], u["metadata"]["uid"]
    )
    cluster.kubectl(
        "patch", "bclaim", "u", "-n", ns, "--subresource=status", "--type=json",
        "-p", json.dumps([{"op": "replace", "path": "/status", "value": old_status}]),
    )  # fmt: skip
    before = envelope_of(cluster, ns, "old")["status"]["totals"]
    record = settled_record(
        BranchClaimStatus.model_validate(old_status), u["metadata"]["uid"], "u", 1
    )
    assert record is not None and record.consumed == {"tokens": Decimal(1)}

    start_operator()
    # Nothing about it moves: its status stays as it was, and it reads as before.
    eventually("the operator's first pass", lambda: sdk.get("s").settled, timeout=60)
    assert sdk.get("u").status.consumed == {"tokens": Decimal(1)}, "read as before"
    assert records(sdk, "old")["u"].settlement == record.settlement
    # A result reported after it settled moves it: the operator's write carries the record
    # as its line, once.
    fence = lease_fence(claim_of(cluster, ns, "u"))  # its lease as its old status shows it
    late = {"result": "s3://b/late", "lease": {"fence": fence}}
    cluster.kubectl("patch", "bclaim", "u", "-n", ns, "--type=merge", "-p",
                    json.dumps({"spec": late}))  # fmt: skip
    eventually(
        "u to carry its record as its line",
        lambda: "ledger" in claim_of(cluster, ns, "u")["status"],
        timeout=60,
    )
    written = claim_of(cluster, ns, "u")["status"]
    assert written["settlement"] == old_status["settlement"], "kept for good"
    line = BranchClaimStatus.model_validate(written).ledger
    assert line is not None and line.result == "s3://b/late"
    moved = line.model_copy(update={"result": record.result, "late": record.late})
    assert settled_view(moved) == settled_view(record)
    assert "history" not in written and "released" not in written, "the line, once"
    # The claims settled by this operator carry their line once, and nothing moved.
    for name in ("s", "t"):
        status = claim_of(cluster, ns, name)["status"]
        assert set(status) <= {"phase", "conditions", "placement", "queueReason", "ledger", "lease",
                               "envelopeUid", "observedGeneration"}, sorted(status)  # fmt: skip
    assert envelope_of(cluster, ns, "old")["status"]["totals"] == before
