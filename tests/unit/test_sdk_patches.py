"""The SDK's JSON patches carry the verbs' preconditions as `test` operations (pure): what
each tests, the merge of a map into the spec, and the local reading of a refused patch
(whose tests the claim read again still passes: a refusal, not a moved claim)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from reservoir.core.model import ClaimPhase
from reservoir.sdk.patches import (
    DISPATCH_RELIES_ON,
    UNSETTLED,
    compensation_patch,
    failed_tests,
    fenced_patch,
    pointer,
    record_tests,
    segments_of,
)
from reservoir.sdk.views import ClaimView

EXPIRES = "2026-01-01T00:01:00Z"
LINE = {
    "claim": "x",
    "branch": "b",
    "attempt": 1,
    "phase": "Tentative",
    "reserved": {"tokens": "20"},
    "expiresAt": EXPIRES,
}


def claim(status: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "metadata": {"name": "x", "namespace": "ns", "uid": "u-1", "resourceVersion": "7"},
        "spec": {"envelope": "wf", "requests": {"tokens": "20"}, **spec},
    }
    body["metadata"]["generation"] = 2
    if status is not None:
        body["status"] = status
    return body


def mirror(phase: str = "Tentative", **more: Any) -> dict[str, Any]:
    return {"phase": phase, "lease": {"expiresAt": EXPIRES, "renewals": 0}, **more}


def checks_in(patch: list[dict[str, Any]]) -> dict[str, Any]:
    return {op["path"]: op["value"] for op in patch if op["op"] == "test"}


def test_pointers_escape_tilde_and_slash_and_read_back() -> None:
    assert pointer(("spec", "usage", "nvidia.com/gpu")) == "/spec/usage/nvidia.com~1gpu"
    assert pointer(("a~b",)) == "/a~0b"
    assert segments_of("/spec/usage/nvidia.com~1gpu/a~0b") == [
        "spec",
        "usage",
        "nvidia.com/gpu",
        "a~b",
    ]
    assert segments_of("") == []


def test_a_dispatch_decided_on_the_mirror_tests_identity_phase_no_settlement_and_lease() -> None:
    read = claim(mirror())
    patch = fenced_patch(read, {"dispatch": True}, DISPATCH_RELIES_ON)
    assert checks_in(patch) == {
        "/metadata/uid": "u-1",
        "/metadata/generation": 2,
        "/status/ledger": None,  # no ledger line appeared since
        "/status/phase": "Tentative",
        "/status/settlement": None,
        "/status/lease/expiresAt": EXPIRES,
        "/status/lease": {"expiresAt": EXPIRES, "renewals": 0},  # the lease it is fenced on
    }
    assert patch[-2:] == [
        {"op": "add", "path": "/spec/dispatch", "value": True},
        {"op": "add", "path": "/spec/lease", "value": {"fence": {"generation": 0}}},
    ]
    assert [op["op"] for op in patch] == ["test"] * 7 + ["add"] * 2, "tests come first"


def test_a_decision_on_the_claims_ledger_line_tests_the_line() -> None:
    read = claim({**mirror(phase="Pending"), "ledger": LINE})
    assert checks_in(fenced_patch(read, {"dispatch": True}, DISPATCH_RELIES_ON)) == {
        "/metadata/uid": "u-1",
        "/metadata/generation": 2,
        "/status/ledger/phase": "Tentative",  # the line, not the lagging mirror
        "/status/ledger/settlement": None,
        "/status/ledger/expiresAt": EXPIRES,
        "/status/lease": {"expiresAt": EXPIRES, "renewals": 0},
    }
    view = ClaimView.from_api(read)
    assert view.entry is not None and view.carries_ledger
    assert view.ledger_phase is ClaimPhase.TENTATIVE and view.phase is ClaimPhase.PENDING


def test_a_claim_without_status_tests_that_it_still_has_none() -> None:
    """The API server matches null to a missing member only: the first missing segment is
    the one tested, once."""
    assert checks_in(fenced_patch(claim(), {"cancel": True}, UNSETTLED)) == {
        "/metadata/uid": "u-1",
        "/metadata/generation": 2,
        "/status": None,
    }
    no_lease = checks_in(record_tests(claim({"phase": "Pending"}), DISPATCH_RELIES_ON))
    assert no_lease["/status/lease"] is None and "/status/lease/expiresAt" not in no_lease


def test_a_decision_relying_on_no_record_field_tests_only_the_identity() -> None:
    """The operator's status writes never refuse it (tests/integration/
    test_conditional_writes.py)."""
    patch = fenced_patch(claim(), {"cancel": True})
    assert checks_in(patch) == {"/metadata/uid": "u-1", "/metadata/generation": 2}
    assert failed_tests(patch, claim(mirror())) == []


def test_a_map_merges_key_by_key_into_a_map_already_there() -> None:
    usage = {"tokens": "5", "nvidia.com/gpu": "1"}
    first = fenced_patch(claim(mirror()), {"usage": usage}, UNSETTLED)
    assert first[-2] == {"op": "add", "path": "/spec/usage", "value": usage}
    later = fenced_patch(claim(mirror(), usage={"cost": "1"}), {"usage": usage}, UNSETTLED)
    assert later[-3:-1] == [
        {"op": "add", "path": "/spec/usage/tokens", "value": "5"},
        {"op": "add", "path": "/spec/usage/nvidia.com~1gpu", "value": "1"},
    ]


def test_failed_tests_tell_a_moved_claim_from_a_refusal() -> None:
    read = claim(mirror())
    patch = fenced_patch(read, {"dispatch": True}, DISPATCH_RELIES_ON)
    assert failed_tests(patch, read) == [], "unmoved: a 422 was a refusal"
    assert failed_tests(patch, None) == [op["path"] for op in patch if op["op"] == "test"]

    released = copy.deepcopy(read)
    released["status"].update(phase="Released", settlement={"phase": "Released"})
    assert failed_tests(patch, released) == ["/status/phase", "/status/settlement"]

    renewed = copy.deepcopy(read)
    renewed["status"]["lease"]["expiresAt"] = "2026-01-01T00:02:00Z"
    assert failed_tests(patch, renewed) == ["/status/lease/expiresAt", "/status/lease"]

    cancelled = copy.deepcopy(read)
    cancelled["spec"]["cancel"] = True
    cancelled["metadata"]["generation"] = 3
    assert failed_tests(patch, cancelled) == ["/metadata/generation"]

    lined = copy.deepcopy(read)
    lined["status"]["ledger"] = LINE
    assert failed_tests(patch, lined) == ["/status/ledger"]

    recreated = copy.deepcopy(read)
    recreated["metadata"]["uid"] = "u-2"
    assert failed_tests(patch, recreated) == ["/metadata/uid"]


def test_a_report_on_a_view_older_than_the_commit_is_not_refused_for_it() -> None:
    """Usage, the final report and a cancel rely on the claim being unsettled, not on its
    phase: the operator's commit in between must not fail their tests (it did, once per
    claim in the benchmarks); a settlement must."""
    for read in (claim({**mirror(), "ledger": LINE}), claim(mirror())):
        patch = fenced_patch(read, {"usage": {"tokens": "3"}}, UNSETTLED)
        committed = copy.deepcopy(read)
        record = committed["status"].get("ledger", committed["status"])
        record["phase"] = "Committed"
        committed["status"]["phase"] = "Committed"
        assert failed_tests(patch, committed) == []
        settled = copy.deepcopy(committed)
        record = settled["status"].get("ledger", settled["status"])
        record.update(phase="Consumed", settlement={"phase": "Consumed"})
        assert failed_tests(patch, settled) != []


def test_null_matches_a_missing_member_not_a_missing_parent() -> None:
    fresh = claim()
    patch = fenced_patch(fresh, {"cancel": True}, UNSETTLED)
    assert failed_tests(patch, fresh) == []
    assert failed_tests(patch, claim({"phase": "Pending"})) == ["/status"]
    orphan = [{"op": "test", "path": "/status/ledger/phase", "value": None}]
    assert failed_tests(orphan, claim({"phase": "Pending"})) == ["/status/ledger/phase"]
    assert failed_tests(orphan, claim({"ledger": {}})) == []


def test_the_status_ledger_is_read_tolerantly_and_the_status_parsed_without_it() -> None:
    view = ClaimView.from_api(claim({**mirror(), "ledger": LINE}))
    assert view.status.phase is ClaimPhase.TENTATIVE
    assert view.entry is not None and view.entry.expires_at is not None
    plain = ClaimView.from_api(claim(mirror()))
    assert plain.entry is None and not plain.carries_ledger
    assert plain.ledger_expires_at == plain.expires_at


def test_a_compensation_tests_identity_and_the_list_as_read() -> None:
    item = {"key": "k1", "reason": "refund", "refund": {"cost": "1"}}
    first = compensation_patch(claim(), item)
    assert checks_in(first) == {"/metadata/uid": "u-1", "/metadata/generation": 2}
    assert first[-1] == {"op": "add", "path": "/spec/compensations", "value": [item]}
    listed = [{"key": "k0", "reason": "r", "charge": {"cost": "1"}}]
    more = compensation_patch(claim(compensations=listed), item)
    assert checks_in(more)["/spec/compensations"] == listed
    assert more[-1] == {"op": "add", "path": "/spec/compensations/-", "value": item}


@pytest.mark.parametrize("fields", [(), UNSETTLED, DISPATCH_RELIES_ON])
def test_a_patch_passes_its_own_tests_on_the_object_it_was_built_from(
    fields: tuple[str, ...],
) -> None:
    for status in (None, {"phase": "Pending"}, mirror(), {**mirror(), "ledger": LINE}):
        read = claim(status)
        assert failed_tests(fenced_patch(read, {"cancel": True}, fields), read) == []


def test_a_dispatch_or_report_carries_the_lease_as_stored_and_a_cancel_does_not() -> None:
    """The API server refuses a dispatch or report whose spec.lease.fence is not the claim's
    status.lease (reservoir.lease_fence_rules): the fence is status.lease as stored, the
    holder the claim names before any grant, generation 0 before the first reservation."""
    granted = claim(
        {**mirror(), "lease": {"holder": "w-2", "generation": 3}}, lease={"holder": "w"}
    )
    for spec_patch in (
        {"dispatch": True},
        {"usage": {"tokens": "1"}},
        {"final": True, "outcome": "Succeeded"},
        {"result": "s3://r"},
        {"upstream": {"state": "Accepted"}},
    ):
        patch = fenced_patch(granted, spec_patch)
        assert {
            "op": "add",
            "path": "/spec/lease/fence",
            "value": {"holder": "w-2", "generation": 3},
        } in patch
        assert checks_in(patch)["/status/lease"] == {"holder": "w-2", "generation": 3}
    unleased = fenced_patch(claim({"phase": "Pending"}, lease={"holder": "w"}), {"dispatch": True})
    assert {
        "op": "add",
        "path": "/spec/lease/fence",
        "value": {"holder": "w", "generation": 0},
    } in unleased
    cancel = fenced_patch(granted, {"cancel": True})
    assert not any(op["path"].startswith("/spec/lease") for op in cancel)
    assert "/status/lease" not in checks_in(cancel), "a renewal never refuses a cancel"


def test_a_line_written_before_status_lease_fences_on_the_generation_it_implies() -> None:
    """As the API server's rule reads it: no status.lease, so the line's renewals (and
    handovers) + 1 once it first held capacity (found by review: 0 let a stale write in)."""
    line = {**LINE, "firstReservedAt": EXPIRES, "renewals": 2, "handovers": 1}
    patch = fenced_patch(claim({"phase": "Tentative", "ledger": line}), {"dispatch": True})
    assert {"op": "add", "path": "/spec/lease", "value": {"fence": {"generation": 4}}} in patch
    unreserved = fenced_patch(claim({"phase": "Pending", "ledger": LINE}), {"dispatch": True})
    assert {"op": "add", "path": "/spec/lease", "value": {"fence": {"generation": 0}}} in unreserved
